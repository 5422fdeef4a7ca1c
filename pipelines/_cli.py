"""Command-line plumbing shared by the pipelines: strict flag parsing and exit codes.

A bad argument is a `UsageError`; `main` prints it as one line and exits 2
before anything is written. Unknown flags are errors too (Beam itself only
warns and drops them, so a typo would silently change a job).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import importlib
import logging
import os
import re
import sys
import threading
import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.portability import common_urns
from apache_beam.runners.runner import PipelineRunner

from formats import commit
from formats import files as fs
from formats import naming
from formats.manifest import MANIFEST_FILENAME, Manifest
from pipelines import _dataflow, _inputs
from pipelines._errors import InputDataError, UsageError

# Beam's numeric flags and their smallest sensible value (Beam itself does not check them).
_BEAM_INT_MINIMUMS = {
    "direct_num_workers": 0,  # 0: one worker per CPU
    "num_workers": 1, "max_num_workers": 1, "disk_size_gb": 1, "number_of_worker_harness_threads": 1,
    "max_cache_memory_usage_mb": 0, "sdk_worker_parallelism": 0, "environment_cache_millis": 0,
}


class _RaisingParser(argparse.ArgumentParser):
  def error(self, message):
    raise UsageError(message)


class ConverterOptions(PipelineOptions):
  """Flags every converter shares. Pipeline-specific flags live in their own
  classes: Beam registers every options class in one parser, so two pipelines
  defining the same flag could not be imported into one process."""

  @classmethod
  def _add_argparse_args(cls, parser):
    parser.add_argument("--input", help="Input folder, local or gs://.")
    parser.add_argument("--output", help="Output folder, local or gs://.")
    parser.add_argument("--format", dest="file_format", default="array_record",
                        help="array_record (default; random access) or tfrecord.")
    parser.add_argument("--num_shards", default="0", help="Shards per split; 0 (default) picks ~128 MB shards.")
    parser.add_argument("--name", default=None, help="Dataset name in shard names; default: the input folder's name.")
    parser.add_argument("--seed", default="0", help="Seed of the record order.")
    parser.add_argument("--overwrite", default="false",
                        help="true: replace an output folder that already holds a complete output.")
    parser.add_argument("--max_input_bytes", default=str(_inputs.DEFAULT_MAX_INPUT_BYTES),
                        help="Largest input file read; a larger one is a reject (default 2 GiB).")
    parser.add_argument("--transient_retry_seconds", default=str(int(_inputs.DEFAULT_TRANSIENT_RETRY_SECONDS)),
                        help="How long to retry an input that answers a transient error (HTTP 5xx/429, "
                             "timeout, dropped connection) before the job fails (default 300).")


def _all_option_classes(cls=PipelineOptions):
  for sub in cls.__subclasses__():
    yield sub
    yield from _all_option_classes(sub)


def parse_options(argv: Sequence[str] | None, own: Sequence[type[PipelineOptions]]) -> PipelineOptions:
  """Beam options from `argv`, rejecting flags that neither Beam nor this pipeline
  (`own` options classes and ConverterOptions) defines."""
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = _RaisingParser(allow_abbrev=False, add_help=False)
  allowed = [ConverterOptions, *own]
  beam_classes = [c for c in _all_option_classes() if c.__module__.startswith("apache_beam.")]
  for cls in dict.fromkeys([*allowed, *beam_classes]):
    try:
      cls._add_argparse_args(parser)
    except argparse.ArgumentError:
      pass  # a flag Beam defines in two classes; the first definition wins
  _, unknown = parser.parse_known_args(argv)
  if unknown:
    raise UsageError(f"unrecognized arguments: {' '.join(unknown)}")
  options = PipelineOptions(argv)
  _check_beam_flags(options)
  return options


def _check_runner(name: str) -> None:
  """Accepts what Beam's `create_runner` accepts (a known name, with or without
  "Runner", or module.Class of an importable class), without creating the runner."""
  known = {path.rsplit(".", 1)[-1].lower(): path for path in StandardOptions.ALL_KNOWN_RUNNERS}
  if name.lower() in known or name.lower() + "runner" in known:
    return
  module, _, cls = name.rpartition(".")
  if module:
    try:
      found = getattr(importlib.import_module(module), cls, None)
    except ImportError:
      found = None
    if isinstance(found, type) and issubclass(found, PipelineRunner):
      return
  raise UsageError(f"--runner {name!r} is not a Beam runner; known: {', '.join(StandardOptions.KNOWN_RUNNER_NAMES)}"
                   " or module.ClassName of a PipelineRunner")


def _check_beam_flags(options: PipelineOptions) -> None:
  """Beam's own flags that Beam would only trip over later, with a traceback."""
  values = options.get_all_options(drop_default=True)
  if values.get("runner"):
    _check_runner(str(values["runner"]))
  env = values.get("environment_type")
  if env is not None and not (str(env).startswith("beam:env:") or str(env) == "LOOPBACK"
                              or hasattr(common_urns.environments, str(env))):
    raise UsageError(f"--environment_type {env!r} is not a Beam environment (DOCKER, PROCESS, EXTERNAL, "
                     "LOOPBACK or a beam:env: URN)")
  for name, minimum in _BEAM_INT_MINIMUMS.items():
    if values.get(name) is not None:
      int_flag(name, values[name], minimum)


def int_flag(name: str, value, minimum: int, maximum: int | None = None) -> int:
  try:
    n = int(value)
  except (TypeError, ValueError):
    raise UsageError(f"--{name} must be an integer, got {value!r}") from None
  if n < minimum:
    raise UsageError(f"--{name} must be >= {minimum}, got {n}")
  if maximum is not None and n > maximum:
    raise UsageError(f"--{name} must be <= {maximum}, got {n}")
  return n


def read_policy(options: PipelineOptions) -> _inputs.ReadPolicy:
  """How the converter reads its inputs, from the shared flags."""
  c = options.view_as(ConverterOptions)
  return _inputs.ReadPolicy(seconds_flag("transient_retry_seconds", c.transient_retry_seconds),
                            int_flag("max_input_bytes", c.max_input_bytes, 1))


def seconds_flag(name: str, value) -> float:
  """A duration in seconds, >= 0 and finite."""
  try:
    x = float(value)
  except (TypeError, ValueError):
    x = float("nan")
  if not 0 <= x < float("inf"):
    raise UsageError(f"--{name} must be a number of seconds >= 0, got {value!r}")
  return x


def bool_flag(name: str, value) -> bool:
  v = str(value).lower()
  if v in ("true", "1", "yes"):
    return True
  if v in ("false", "0", "no"):
    return False
  raise UsageError(f"--{name} must be true or false, got {value!r}")


def dataset_name(name_flag: str | None, input_root: str) -> str:
  """--name, or one derived from the input folder's name; checked."""
  name = name_flag
  if not name:
    base = os.path.basename(input_root.rstrip("/")) or "data"
    name = re.sub(r"[^A-Za-z0-9_.]+", "_", base).strip("_.").lower() or "data"
  try:
    return naming.check_dataset_name(name)
  except ValueError as e:
    raise UsageError(f"--name: {e}") from None


def check_file_format(value: str) -> str:
  if value not in naming.FILE_FORMATS:
    raise UsageError(f"--format must be one of {', '.join(naming.FILE_FORMATS)}, got {value!r}")
  return value


def check_input_output(input_flag: str | None, output_flag: str | None, overwrite_flag,
                       input_kind: str = "a folder") -> tuple[str, str, bool]:
  """(input root, output root, overwrite) after the checks every converter makes.

  Local paths become absolute. The input must exist, the output must not be
  inside it, and an output holding a complete output needs --overwrite=true.
  `input_kind` describes the expected input in the "--input is required" message.
  """
  if not input_flag:
    raise UsageError(f"--input is required ({input_kind}, local or gs://)")
  if not output_flag:
    raise UsageError("--output is required (a folder, local or gs://)")
  root = input_flag.rstrip("/") if fs.is_gcs(input_flag) else os.path.abspath(input_flag)
  output = output_flag.rstrip("/") if fs.is_gcs(output_flag) else os.path.abspath(output_flag)
  overwrite = bool_flag("overwrite", overwrite_flag)
  if not fs.is_dir(root):
    raise UsageError(f"--input {input_flag!r} does not exist or is not a folder")
  if fs.is_gcs(output) or not fs.is_gcs(root):
    # Real paths: an output reached through a symbolic link into the input is inside it too.
    real_root, real_output = (root, output) if fs.is_gcs(root) else (os.path.realpath(root), os.path.realpath(output))
    if (real_output + "/").startswith(real_root + "/"):
      raise UsageError(f"--output {output_flag!r} must not be inside --input")
  if fs.is_gcs(output) and output.count("/") > 2 and fs.exists(output) or (
      not fs.is_gcs(output) and os.path.lexists(output) and not os.path.isdir(output)):
    raise UsageError(f"--output {output_flag!r} is a file; it must be a folder (or not exist yet)")
  if fs.exists(fs.join(output, MANIFEST_FILENAME)) and not overwrite:
    raise UsageError(f"--output {output_flag!r} already holds a complete output; pass --overwrite=true to replace it")
  return root, output, overwrite


class _Heartbeat:
  """Refreshes the run's generation marker while the job runs, so no other run's
  clean-up takes the generation for a dead run's (formats.commit.LEASE_SECONDS)."""

  def __init__(self, output: str, generation: str, prog: str):
    self._args = (output, generation, {"pipeline": prog})
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat, name="toolkit-heartbeat", daemon=True)

  def _beat(self):
    while not self._stop.wait(commit.HEARTBEAT_SECONDS):
      try:
        commit.heartbeat(*self._args)
      except Exception as e:  # a missed beat is not fatal; a lease lasts many beats
        logging.warning("heartbeat of %s failed: %s", self._args[1], type(e).__name__)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()  # a beat in flight ends before the caller records the end of the run


def run_pipeline(options: PipelineOptions, args: dict, build: Callable[[beam.Pipeline, dict], object],
                 prog: str) -> beam.runners.runner.PipelineResult:
  """Builds (may raise UsageError, before anything is written), runs, waits, prints a summary."""
  t0 = time.monotonic()
  _dataflow.prepare(options, args)
  # This run's data files go to a fresh generation folder; the switch is a compare-and-swap
  # of manifest.json against the version read now (formats.commit, docs/manifest.md).
  output = args["output"]
  generation = naming.new_generation()
  args = {**args, "generation": generation, "expected": commit.read_version(output)}
  p = beam.Pipeline(options=options)
  build(p, args)  # reads the input's listing; writes nothing
  commit.repair(output)  # an earlier run killed between its switch and its clean-up
  commit.claim(output, generation, {"pipeline": prog})
  manifest_path = fs.join(output, MANIFEST_FILENAME)
  try:
    with _Heartbeat(output, generation, prog):  # stopped before finish: no beat may re-create the marker
      result = p.run()
      result.wait_until_finish()
  finally:
    commit.finish(output, generation)
  if fs.exists(manifest_path):
    m = Manifest.loads(fs.read_bytes(manifest_path))
    if m.files:
      print(f"{prog}: {', '.join(f'{f.path} ({f.num_bytes / 1e6:.1f} MB)' for f in m.files)} "
            f"-> {args['output']} in {time.monotonic() - t0:.1f}s", flush=True)
      return result
    shards = sum(len(s.shards) for s in m.splits.values())
    size = sum(s.num_bytes for s in m.splits.values())
    print(
        f"{prog}: {m.num_records} records in {shards} shards ({size / 1e6:.1f} MB, "
        f"{', '.join(f'{k}={v.num_records}' for k, v in m.splits.items())}), "
        f"{m.rejected.count} rejected -> {args['output']} in {time.monotonic() - t0:.1f}s",
        flush=True,
    )
    for w in m.warnings:
      print(f"{prog}: warning: {w}", flush=True)
  return result


# Errors `main` reports as one line: Beam's own log of their traceback is noise.
_ONE_LINE_ERRORS = (UsageError, InputDataError, _inputs.TransientInputError, commit.CommitConflict)


class _OneLineErrors(logging.Filter):
  """Drops Beam's ERROR records (a full traceback) for errors `main` prints as one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (record.name.startswith("apache_beam") and isinstance(exc, _ONE_LINE_ERRORS))


def main(run: Callable[[Sequence[str] | None], object], prog: str) -> None:
  """Runs `run(sys.argv[1:])`: one-line errors, exit status 2 for bad arguments and 1 for
  unusable input, persistent transient faults and a lost race to another run."""
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  for handler in logging.getLogger().handlers:
    handler.addFilter(_OneLineErrors())
  for noisy in ("apache_beam", "google", "urllib3", "absl"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  try:
    run(sys.argv[1:])
  except UsageError as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    sys.exit(2)
  except InputDataError as e:  # the whole input is unusable: no output was marked complete
    print(f"{prog}: error: {_message(e)}", file=sys.stderr)
    sys.exit(1)
  except _inputs.TransientInputError as e:  # the job failed before its switch: no new manifest
    print(f"{prog}: error: {_message(e)}; nothing was committed, run again", file=sys.stderr)
    sys.exit(1)
  except commit.CommitConflict as e:  # lost a race to another run: its output stands
    print(f"{prog}: error: {_message(e)}", file=sys.stderr)
    sys.exit(1)


def _message(e: Exception) -> str:
  """The error's own text, without the step name Beam appends."""
  return str(e).split(" [while running")[0]
