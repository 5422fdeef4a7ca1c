"""Running a converter: from argv to a committed output, and the exit codes of `python -m`.

`run(converter, argv)` parses the flags (UsageError before anything is
written; -h or --help prints them, from their declarations, and exits 0),
builds the pipeline (the converter lists its input's top level), then claims
a fresh generation folder, runs the job with a heartbeat, and commits by the
protocol of formats.outputs.commit (docs/architecture.md). `main` turns the
errors a user can act on into one line on stderr and an exit status.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import logging
import sys
import threading
import time

import apache_beam as beam
from apache_beam.runners.runner import PipelineResult

from formats import naming
from formats.errors import CommitConflict
from formats.outputs import commit
from formats.manifest import Manifest
from formats.outputs.output import is_output, load_manifest
from formats.storage import retry
from pipelines.core import dataflow, flags, inputs, progress
from pipelines.core.converter import Converter
from pipelines.core.errors import InputDataError, UsageError


def parse(converter: Converter, argv: Sequence[str] | None):
  """(Beam options, CommonConfig, the converter's own config) from `argv`.

  Args:
    converter: the converter whose flags to parse.
    argv: the command-line arguments; None reads `sys.argv[1:]`.

  Returns:
    (options, common, config), all checked.

  Raises:
    UsageError: an unknown flag or a bad value (nothing has been read or written).
    SystemExit: 0 after printing the help, for -h or --help.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  if any(a in flags.HELP_FLAGS for a in argv):
    summary = (type(converter).__doc__ or "").strip().splitlines()[0]
    print(flags.help_text(converter.prog, summary, converter.input_kind, converter.options), end="", flush=True)
    raise SystemExit(0)
  options = flags.parse_options(argv, [converter.options])
  common = converter.common_config(options)
  return options, common, converter.configure(options.view_as(converter.options), common)


def run(converter: Converter, argv: Sequence[str] | None = None) -> PipelineResult:
  """Parses flags, runs the conversion and waits for it.

  Args:
    converter: the converter to run.
    argv: the command-line arguments; None reads `sys.argv[1:]`.

  Returns:
    The finished job's `PipelineResult`.

  Raises:
    UsageError: a bad flag, or an input that cannot be converted (nothing was written).
    InputDataError: the input is malformed as a whole.
    TransientInputError: transient read errors persisted past the retry budget.
    CommitConflict: another run switched the manifest first.
  """
  options, common, config = parse(converter, argv)
  return run_pipeline(options, converter, common, config)


def entry_point(converter: Converter) -> Callable[[Sequence[str] | None], PipelineResult]:
  """`pipelines.<name>.run`: the converter run with command-line flags, waited for.

  Args:
    converter: the converter the function runs.

  Returns:
    `run(argv=None) -> PipelineResult`, with `run`'s errors (UsageError on a bad flag).
  """
  def run_converter(argv: Sequence[str] | None = None) -> PipelineResult:
    return run(converter, argv)

  run_converter.__name__ = run_converter.__qualname__ = "run"
  run_converter.__doc__ = (f"Runs {converter.prog} with command-line flags (`python -m {converter.prog} --help`) "
                           "and waits for it.\n\nRaises:\n  UsageError: a bad flag (nothing was written).")
  return run_converter


class _Heartbeat:
  """Refreshes the run's generation marker while the job runs, so no other run's
  clean-up takes the generation for a dead run's (formats.outputs.commit.LEASE_SECONDS)."""

  def __init__(self, output: str, generation: str, prog: str):
    self._args = (output, generation, {"pipeline": prog})
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat, name="toolkit-heartbeat", daemon=True)

  def _beat(self):
    while not self._stop.wait(commit.HEARTBEAT_SECONDS):
      try:
        commit.heartbeat(*self._args)
      except CommitConflict as e:  # a clean-up took the generation: the commit refuses it too
        logging.error("%s", e)
        return
      except Exception as e:  # a missed beat is not fatal; a lease lasts many beats
        logging.warning("heartbeat of %s failed: %s", self._args[1], type(e).__name__)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()  # a beat in flight ends before the caller records the end of the run


def run_pipeline(options, converter: Converter, common: flags.CommonConfig, config) -> PipelineResult:
  """Builds, claims a generation, runs with a heartbeat, waits, prints a summary.

  Args:
    options: the parsed Beam options (Dataflow staging flags may be added).
    converter: the converter to run.
    common: the checked shared flags; the run's `generation` and `expected` are added here.
    config: what `converter.configure` returned.

  Returns:
    The finished job's `PipelineResult`.

  Raises:
    UsageError: a Dataflow flag, or the input's top level, is unusable (before anything is written).
    InputDataError: the input is malformed as a whole.
    TransientInputError: transient read errors persisted past the retry budget.
    CommitConflict: another run switched the manifest first.
  """
  t0 = time.monotonic()
  prog = converter.prog
  # The commit, the leases and the other writes of this process retry for --transient_retry_seconds too.
  retry.set_default(common.read_policy.retry_policy)
  # The wheel and requirements file staged for Dataflow's workers are uploaded by p.run() (the submission);
  # their local copies go right after it, or when the block ends if it never gets there.
  with dataflow.staging(options, common, converter.worker_extras) as uploaded:
    # This run's data files go to a fresh generation folder; the switch is a compare-and-swap
    # of manifest.json against the version read now (formats.outputs.commit, docs/manifest.md).
    output = common.output
    common = dataclasses.replace(common, generation=naming.new_generation(), expected=commit.read_version(output))
    p = beam.Pipeline(runner=flags.local_runner(options), options=options)
    converter.build(p, common, config)  # reads the input's listing; writes nothing
    commit.repair(output)  # an earlier run killed between its switch and its clean-up
    commit.claim(output, common.generation, {"pipeline": prog})
    try:
      with _Heartbeat(output, common.generation, prog):  # stopped before finish: no beat may re-create the marker
        result = p.run()
        uploaded()
        result.wait_until_finish()
    finally:
      commit.finish(output, common.generation)
  if is_output(output):
    seconds = time.monotonic() - t0
    counts = stage_counters(result, "toolkit")
    print(summary_line(prog, load_manifest(output), output, seconds, counts.get("shards_reused", 0),
                       counts.get("pieces_reused", 0)), flush=True)
    rates = progress.rates_line(prog, stage_counters(result, prog), seconds)
    if rates:
      print(rates, flush=True)
  return result


def stage_counters(result: PipelineResult, namespace: str) -> dict[str, int]:
  """The run's counters in `namespace` (the stages' progress counters among them), by name.

  Args:
    result: the finished run.
    namespace: the converter's metrics namespace.

  Returns:
    {counter name: value}; committed values where the runner has them, else attempted; {} when
    the runner reports no metrics.
  """
  try:
    counters = result.metrics().query()["counters"]
  except Exception:  # pylint: disable=broad-except  # a runner without metrics: no rates line
    return {}
  out: dict[str, int] = {}
  for c in counters:
    if c.key.metric.namespace == namespace:
      value = c.committed if c.committed is not None else c.attempted
      out[c.key.metric.name] = out.get(c.key.metric.name, 0) + int(value or 0)
  return out


def summary_line(prog: str, m: Manifest, output: str, seconds: float, reused: int = 0, pieces_reused: int = 0) -> str:
  """The line a run prints when it is done (and its warnings, one line each).

  Args:
    prog: the converter's module, `pipelines.<name>`.
    m: the committed manifest.
    output: the output folder.
    seconds: how long the run took.
    reused: shards copied from earlier runs instead of converted (pipelines/core/reuse.py).
    pieces_reused: pieces of a graph file copied from an earlier run instead of read again.

  Returns:
    The summary: files or records, shards, sizes, rejects; then one line per warning.
  """
  if m.files:
    return (f"{prog}: {', '.join(f'{f.path} ({f.num_bytes / 1e6:.1f} MB)' for f in m.files)} "
            f"-> {output} in {seconds:.1f}s" + (f" ({pieces_reused} pieces reused from earlier runs)"
                                                 if pieces_reused else ""))
  shards = sum(len(s.shards) for s in m.splits.values())
  size = sum(s.num_bytes for s in m.splits.values())
  lines = [f"{prog}: {m.num_records} records in {shards} shards ({size / 1e6:.1f} MB, "
           f"{', '.join(f'{k}={v.num_records}' for k, v in m.splits.items())}), "
           f"{m.rejected.count} rejected -> {output} in {seconds:.1f}s"
           + (f" ({reused} of {shards} shards reused from earlier runs)" if reused else "")]
  lines += [f"{prog}: warning: {w}" for w in m.warnings]
  return "\n".join(lines)


# Errors `main` reports as one line: Beam's own log of their traceback is noise.
_ONE_LINE_ERRORS = (UsageError, InputDataError, inputs.TransientInputError, commit.CommitConflict)


class _OneLineErrors(logging.Filter):
  """Drops Beam's ERROR records (a full traceback) for errors `main` prints as one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (record.name.startswith("apache_beam") and isinstance(exc, _ONE_LINE_ERRORS))


def main(converter: Converter, argv: Sequence[str] | None = None) -> None:
  """`python -m pipelines.<name>`: runs the converter with one-line errors; exit status 2 for bad
  arguments and 1 for unusable input, persistent transient faults and a lost race to another run.

  Args:
    converter: the converter to run.
    argv: the command-line arguments; None reads `sys.argv[1:]`.

  Raises:
    SystemExit: 0 after -h or --help; 2 on a UsageError; 1 on InputDataError, TransientInputError or
      CommitConflict.
  """
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  for handler in logging.getLogger().handlers:
    handler.addFilter(_OneLineErrors())
  for noisy in ("apache_beam", "google", "urllib3", "absl"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  prog = converter.prog
  try:
    run(converter, sys.argv[1:] if argv is None else argv)
  except UsageError as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    sys.exit(2)
  except InputDataError as e:  # the whole input is unusable: no output was marked complete
    print(f"{prog}: error: {_message(e)}", file=sys.stderr)
    sys.exit(1)
  except inputs.TransientInputError as e:  # the job failed before its switch: no new manifest
    print(f"{prog}: error: {_message(e)}; nothing was committed, run again", file=sys.stderr)
    sys.exit(1)
  except commit.CommitConflict as e:  # lost a race to another run: its output stands
    print(f"{prog}: error: {_message(e)}", file=sys.stderr)
    sys.exit(1)


def _message(e: Exception) -> str:
  """The error's own text, without the step name Beam appends."""
  return str(e).split(" [while running")[0]
