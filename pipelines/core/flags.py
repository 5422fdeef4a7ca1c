"""Flag parsing shared by the converters: strict parsing, checks, the common configuration.

A bad argument is a `UsageError` (the launcher prints it as one line and exits 2
before anything is written). Unknown flags are errors too: Beam itself only
warns and drops them, so a typo would silently change a job. Every converter's
shared flags become one frozen `CommonConfig`; its own flags are checked by
its `configure` with the helpers here (`int_flag`, `bool_flag`, ...).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import dataclasses
import importlib
import os
import re
import sys

from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions, WorkerOptions
from apache_beam.portability import common_urns
from apache_beam.runners.runner import PipelineRunner

from formats import naming
from formats.outputs import commit
from formats.storage import files as fs
from formats.outputs.output import is_output, load_manifest
from pipelines.core import inputs
from pipelines.core.errors import UsageError

MODES = ("rebuild", "append")
DEFAULT_KEEP_REPLACED = "7d"  # formats.outputs.commit.DEFAULT_KEEP_REPLACED_SECONDS, as a flag (a test checks they agree)
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

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
    parser.add_argument("--plan", default="auto",
                        help="Where the shard plan is made: auto (default: the launcher lists the input unless it "
                             "holds more than 2,000,000 files, then the workers), launcher or workers.")
    parser.add_argument("--overwrite", default="false",
                        help="true: replace an output folder that already holds a complete output.")
    parser.add_argument("--max_input_bytes", default=str(inputs.DEFAULT_MAX_INPUT_BYTES),
                        help="Largest input file read; a larger one is a reject (default 2 GiB).")
    parser.add_argument("--mode", default="rebuild",
                        help="rebuild (default: the output is made from the whole input) or append (convert only "
                             "the inputs the current output does not hold, into new shards of the same splits; "
                             "with no output there yet, the whole input).")
    parser.add_argument("--reuse_shards", default="true",
                        help="true (default): copy shards an earlier run of the same plan published (a failed or "
                             "killed run's) instead of converting them again; false converts every shard.")
    parser.add_argument("--keep_replaced", default=DEFAULT_KEEP_REPLACED,
                        help="How long a replaced output generation is kept for the readers still on it, e.g. 7d "
                             "(default), 12h, 30m, 0 (remove at once).")
    parser.add_argument("--transient_retry_seconds", default=str(int(inputs.DEFAULT_TRANSIENT_RETRY_SECONDS)),
                        help="How long to retry an input that answers a transient error (HTTP 5xx/429, "
                             "timeout, dropped connection) before the job fails (default 300).")


def _all_option_classes(cls=PipelineOptions):
  for sub in cls.__subclasses__():
    yield sub
    yield from _all_option_classes(sub)


def parse_options(argv: Sequence[str] | None, own: Sequence[type[PipelineOptions]]) -> PipelineOptions:
  """Beam options from `argv`, rejecting flags that neither Beam nor this pipeline
  (`own` options classes and ConverterOptions) defines.

  Args:
    argv: the command-line arguments; None reads `sys.argv[1:]`.
    own: the converter's own options classes.

  Returns:
    The parsed `PipelineOptions`.

  Raises:
    UsageError: an unknown flag, or a Beam flag with a bad value (runner, environment, a number).
    TypeError: an `own` class defines a flag that Beam or `ConverterOptions` already defines.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = _RaisingParser(allow_abbrev=False, add_help=False)
  allowed = [ConverterOptions, *own]
  beam_classes = [c for c in _all_option_classes() if c.__module__.startswith("apache_beam.")]
  for cls in dict.fromkeys(beam_classes):
    try:
      cls._add_argparse_args(parser)
    except argparse.ArgumentError:
      pass  # a flag Beam itself defines in two classes; the first definition wins
  for cls in dict.fromkeys(allowed):
    try:
      cls._add_argparse_args(parser)
    except argparse.ArgumentError as e:  # a converter's flag that Beam or the shared flags define
      raise TypeError(f"{cls.__name__} defines a flag that is already defined: {e}") from None
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
  """An integer flag, checked against its bounds.

  Args:
    name: the flag's name, without `--`, for the message.
    value: the flag's value as given (usually a string).
    minimum: the smallest value allowed.
    maximum: the largest value allowed; None for no limit.

  Returns:
    The value as an int.

  Raises:
    UsageError: the value is not an integer or is out of bounds.
  """
  try:
    n = int(value)
  except (TypeError, ValueError):
    raise UsageError(f"--{name} must be an integer, got {value!r}") from None
  if n < minimum:
    raise UsageError(f"--{name} must be >= {minimum}, got {n}")
  if maximum is not None and n > maximum:
    raise UsageError(f"--{name} must be <= {maximum}, got {n}")
  return n


def read_policy(options: PipelineOptions) -> inputs.ReadPolicy:
  """How the converter reads its inputs, from the shared flags.

  Args:
    options: the parsed options (`--transient_retry_seconds`, `--max_input_bytes`).

  Returns:
    The `inputs.ReadPolicy`.

  Raises:
    UsageError: either flag has a bad value.
  """
  c = options.view_as(ConverterOptions)
  return inputs.ReadPolicy(seconds_flag("transient_retry_seconds", c.transient_retry_seconds),
                            int_flag("max_input_bytes", c.max_input_bytes, 1))


def seconds_flag(name: str, value) -> float:
  """A duration in seconds, >= 0 and finite.

  Args:
    name: the flag's name, without `--`, for the message.
    value: the flag's value as given.

  Returns:
    The duration as a float.

  Raises:
    UsageError: the value is not a number, negative, infinite or NaN.
  """
  try:
    x = float(value)
  except (TypeError, ValueError):
    x = float("nan")
  if not 0 <= x < float("inf"):
    raise UsageError(f"--{name} must be a number of seconds >= 0, got {value!r}")
  return x


def duration_flag(name: str, value) -> float:
  """A duration: a number with an optional unit s, m, h or d ("7d", "12h", "90", "0").

  Args:
    name: the flag (no `--`), named in the error.
    value: the flag's value as given.

  Returns:
    Seconds, >= 0.

  Raises:
    UsageError: not a non-negative number with one of those units.
  """
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(value))
  if not m:
    raise UsageError(f"--{name} must be a duration such as 7d, 12h, 30m, 90s or 0, got {value!r}")
  return float(m[1]) * _DURATION_UNITS[m[2] or "s"]


def bool_flag(name: str, value) -> bool:
  """A true/false flag.

  Args:
    name: the flag (no `--`), named in the error.
    value: true, 1 or yes; false, 0 or no; in any case.

  Returns:
    True or False.

  Raises:
    UsageError: any other value.
  """
  v = str(value).lower()
  if v in ("true", "1", "yes"):
    return True
  if v in ("false", "0", "no"):
    return False
  raise UsageError(f"--{name} must be true or false, got {value!r}")


def dataset_name(name_flag: str | None, input_root: str) -> str:
  """--name, or one derived from the input folder's name; checked.

  Args:
    name_flag: the --name flag; empty or None derives the name from `input_root`.
    input_root: the input folder, local or gs://.

  Returns:
    A data set name that `naming.check_dataset_name` accepts.

  Raises:
    UsageError: --name is not a valid data set name.
  """
  name = name_flag
  if not name:
    base = os.path.basename(input_root.rstrip("/")) or "data"
    name = re.sub(r"[^A-Za-z0-9_.]+", "_", base).strip("_.").lower() or "data"
  try:
    return naming.check_dataset_name(name)
  except ValueError as e:
    raise UsageError(f"--name: {e}") from None


def check_file_format(value: str) -> str:
  """The --format flag, checked against the known record file formats.

  Args:
    value: the flag's value.

  Returns:
    The value, unchanged.

  Raises:
    UsageError: not one of `naming.FILE_FORMATS`.
  """
  if value not in naming.FILE_FORMATS:
    raise UsageError(f"--format must be one of {', '.join(naming.FILE_FORMATS)}, got {value!r}")
  return value


def check_input_output(input_flag: str | None, output_flag: str | None, overwrite_flag,
                       input_kind: str = "a folder", append: bool = False) -> tuple[str, str, bool]:
  """(input root, output root, overwrite) after the checks every converter makes.

  Local paths become absolute. The input must exist, the output must not be
  inside it, and an output holding a complete output needs --overwrite=true.

  Args:
    input_flag: the --input flag.
    output_flag: the --output flag.
    overwrite_flag: the --overwrite flag, as given.
    input_kind: the expected input, for the "--input is required" message.
    append: --mode=append: adding to a complete output needs no --overwrite (and without one, the run
      makes it, as rebuild would).

  Returns:
    (input root, output root, overwrite); local roots are absolute paths.

  Raises:
    UsageError: a flag is missing, the input is not a folder, the output is
      inside the input or is a file, or it holds a complete output without --overwrite=true.
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
  if fs.is_gcs(output) == fs.is_gcs(root):  # a gs:// output is never inside a local input, nor the reverse
    # Real paths: an output reached through a symbolic link into the input is inside it too.
    real_root, real_output = (root, output) if fs.is_gcs(root) else (os.path.realpath(root), os.path.realpath(output))
    if (real_output + "/").startswith(real_root + "/"):
      raise UsageError(f"--output {output_flag!r} must not be inside --input")
  if fs.is_gcs(output) and output.count("/") > 2 and fs.exists(output) or (
      not fs.is_gcs(output) and os.path.lexists(output) and not os.path.isdir(output)):
    raise UsageError(f"--output {output_flag!r} is a file; it must be a folder (or not exist yet)")
  if is_output(output):
    try:
      load_manifest(output)
    except ValueError as e:  # written by something else than the toolkit, or damaged: never built upon
      raise UsageError(f"--output {output_flag!r} holds a manifest.json that is not a valid manifest ({e}); "
                       "nothing was written: move the output aside or fix it") from None
  if not append and is_output(output) and not overwrite:
    raise UsageError(f"--output {output_flag!r} already holds a complete output; pass --overwrite=true to replace it")
  return root, output, overwrite



@dataclasses.dataclass(frozen=True)
class CommonConfig:
  """The flags every converter shares, checked: what the untyped `args` dict used to hold.

  `generation` and `expected` are set by the launcher (`launch.run_pipeline`):
  the run's fresh generation folder and the manifest version its commit
  replaces (formats.outputs.commit); a converter never sets them.
  """

  input: str  # the input root: an absolute local path or gs://...
  output: str  # the output folder: an absolute local path or gs://...
  name: str  # the data set's name in shard names
  file_format: str
  num_shards: int = 0  # per split; 0 picks ~128 MB shards
  seed: int = 0
  overwrite: bool = False
  read_policy: inputs.ReadPolicy = inputs.ReadPolicy()
  plan: str = "auto"  # where record converters plan their shards: auto, launcher or workers
  workers: int = 1  # workers the runner may use (`worker_count`): automatic shard counts are >= 2 per worker
  processes: int = 1  # worker processes sharing the work (`process_count`): what a progress ETA divides by
  mode: str = "rebuild"  # rebuild (the whole input) or append (only inputs the output does not hold)
  reuse_shards: bool = True  # copy shards an earlier run of the same plan published
  keep_replaced_seconds: float = commit.DEFAULT_KEEP_REPLACED_SECONDS  # how long clean-up keeps replaced generations
  generation: str = ""
  expected: commit.Version | None = None

  def __post_init__(self):
    naming.check_dataset_name(self.name)
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
    if self.file_format not in naming.FILE_FORMATS:
      raise ValueError(f"file_format must be one of {naming.FILE_FORMATS}, got {self.file_format!r}")
    if self.num_shards < 0 or self.seed < 0:
      raise ValueError(f"num_shards and seed must be >= 0, got {self.num_shards} and {self.seed}")


def common_config(options: PipelineOptions, input_kind: str, name: str | None = None,
                  name_rule: Callable[[str | None, str], str] | None = None) -> CommonConfig:
  """The shared flags of `options`, checked, as a `CommonConfig`.

  Args:
    options: the parsed options.
    input_kind: what --input should be, for the "--input is required" message.
    name: the data set name when the caller already has it.
    name_rule: (--name, checked input root) -> the data set name; `dataset_name` when None.

  Returns:
    The `CommonConfig`, without the launcher's `generation` and `expected`.

  Raises:
    UsageError: a shared flag is missing or has a bad value.
  """
  c = options.view_as(ConverterOptions)
  mode = mode_flag(c.mode)
  root, output, overwrite = check_input_output(c.input, c.output, c.overwrite, input_kind, append=mode == "append")
  return CommonConfig(
      input=root, output=output, name=name or (name_rule or dataset_name)(c.name, root),
      file_format=check_file_format(c.file_format), num_shards=int_flag("num_shards", c.num_shards, 0),
      seed=int_flag("seed", c.seed, 0), overwrite=overwrite, read_policy=read_policy(options),
      workers=worker_count(options), processes=process_count(options), plan=plan_flag(c.plan), mode=mode,
      reuse_shards=bool_flag("reuse_shards", c.reuse_shards),
      keep_replaced_seconds=duration_flag("keep_replaced", c.keep_replaced))


def mode_flag(value: str) -> str:
  """--mode: rebuild or append.

  Raises:
    UsageError: any other value.
  """
  if value not in MODES:
    raise UsageError(f"--mode must be {' or '.join(MODES)}, got {value!r}")
  return value


def plan_flag(value: str) -> str:
  """--plan: auto, launcher or workers.

  Raises:
    UsageError: any other value.
  """
  if value not in ("auto", "launcher", "workers"):
    raise UsageError(f"--plan must be auto, launcher or workers, got {value!r}")
  return value


def worker_count(options: PipelineOptions) -> int:
  """How many workers the run may use, from the runner's flags: what shard counts balance over.

  Dataflow: --max_num_workers, else --num_workers, else 1 (the service's autoscaling
  is not known at launch; pass --max_num_workers or --num_shards to plan for it).
  DirectRunner: --direct_num_workers (0: one per CPU) in the multi_threading and
  multi_processing modes; 1 in the default in-process mode.

  Args:
    options: the parsed options.

  Returns:
    The count, >= 1.
  """
  if _on_dataflow(options):
    w = options.view_as(WorkerOptions)
    return max(1, int(w.max_num_workers or w.num_workers or 1))
  d = options.view_as(DirectOptions)
  if d.direct_running_mode in ("multi_threading", "multi_processing"):
    return max(1, int(d.direct_num_workers or os.cpu_count() or 1))
  return 1


def process_count(options: PipelineOptions) -> int:
  """How many worker processes share a stage's work: what each one's progress ETA divides by.

  Dataflow: the workers (`worker_count`) × the vCPUs of --machine_type (one SDK
  process per vCPU; n1-standard-1 when not given). DirectRunner:
  --direct_num_workers (0: one per CPU) with multi_processing; otherwise 1 (the
  in-process and multi_threading modes run the whole job in one process).

  Args:
    options: the parsed options.

  Returns:
    The count, >= 1.
  """
  if _on_dataflow(options):
    return worker_count(options) * _vcpus(options.view_as(WorkerOptions).machine_type or "n1-standard-1")
  d = options.view_as(DirectOptions)
  if d.direct_running_mode == "multi_processing":
    return max(1, int(d.direct_num_workers or os.cpu_count() or 1))
  return 1


def _on_dataflow(options: PipelineOptions) -> bool:
  return "dataflow" in str(options.view_as(StandardOptions).runner or "").lower()


def _vcpus(machine_type: str) -> int:
  """vCPUs of a Compute Engine machine type: n2-standard-4 → 4, custom-8-30720 → 8, e2-small → 1."""
  custom = re.search(r"custom-(\d+)-", machine_type)
  last = re.search(r"-(\d+)$", machine_type)
  return max(1, int(custom[1] if custom else last[1] if last else 1))
