"""Flag parsing shared by the converters: strict parsing, typed flags, the common configuration.

Every flag is declared once, with its type, choices and default, in a
`PipelineOptions._add_argparse_args` (`ConverterOptions` here, each converter's
own class next to it), using the `type=` callables here for what argparse lacks
(`integer`, `boolean`, `duration`, `positive_ints`, ...). A bad argument is a
`UsageError` that names the flag and the value (the launcher prints it as one
line and exits 2 before anything is written). Unknown flags are errors too:
Beam itself only warns and drops them, so a typo would silently change a job.
Every converter's shared flags become one frozen `CommonConfig`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import dataclasses
import importlib
import os
import re
import sys
import textwrap

from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions, WorkerOptions
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_provision_api_pb2
from apache_beam.runners.portability.fn_api_runner import fn_runner
from apache_beam.runners.portability.portable_runner import JobServiceHandle
from apache_beam.runners.runner import PipelineRunner

from formats import naming
from formats.outputs import commit
from formats.storage import files as fs
from formats.outputs.output import is_output, load_manifest
from pipelines.core import inputs, shards
from pipelines.core.errors import UsageError, usage_errors
from pipelines.core.sink import DEFAULT_TARGET_SHARD_BYTES

MODES = ("rebuild", "append")
DEFAULT_SHARD_SIZE_MB = DEFAULT_TARGET_SHARD_BYTES >> 20
DEFAULT_KEEP_REPLACED = "7d"  # formats.outputs.commit.DEFAULT_KEEP_REPLACED_SECONDS, as a flag (a test checks they agree)
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

# Beam's numeric flags and their smallest sensible value (Beam itself does not check them).
_BEAM_INT_MINIMUMS = {
    "direct_num_workers": 0,  # 0: one worker per CPU
    "num_workers": 1, "max_num_workers": 1, "disk_size_gb": 1, "number_of_worker_harness_threads": 1,
    "max_cache_memory_usage_mb": 0, "sdk_worker_parallelism": 0, "environment_cache_millis": 0,
}


class _RaisingParser(argparse.ArgumentParser):
  """The strict parser: its errors are `UsageError`s that begin with the flag's name."""

  def error(self, message):
    m = re.fullmatch(r"argument (--\w+): (must .*)", message, re.S)
    if m:  # a `type=` callable's or a choice's "argument --x: must be ..." reads as "--x must be ..."
      message = f"{m[1]} {m[2]}"
    raise UsageError(message)

  def _check_value(self, action, value):
    if action.choices is not None and value not in action.choices:
      raise argparse.ArgumentError(action, f"must be {alternatives(action.choices)}, got {value!r}")


def alternatives(choices: Sequence) -> str:
  """A flag's allowed values in an error: "a or b", "a, b or c" for up to three plain names (letters
  and digits); "one of a_b, c, ..." for longer lists or other names, which read as a list."""
  words = [str(c) for c in choices]
  if 1 < len(words) <= 3 and all(w.isalnum() for w in words):
    return f"{', '.join(words[:-1])} or {words[-1]}"
  return f"one of {', '.join(words)}"


# ---------------------------------------------------------------- argparse `type=` callables
# Each takes the flag's text and returns its value, or raises ArgumentTypeError with a message that
# begins with "must": the parser puts the flag's name before it. Every value they return is a str,
# int, float or bool whose text parses back to itself: Beam hands the options to its workers as
# flags again (`PipelineOptions.from_dictionary`). `label` is what --help shows as the flag's type.


def _labelled(label: str):
  def mark(fn):
    fn.label = label
    return fn
  return mark


def integer(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
  """An integer in [minimum, maximum] (either bound None: no limit).

  Args:
    minimum: the smallest value allowed.
    maximum: the largest value allowed.

  Returns:
    The `type=` callable; its errors say "must be an integer" or name the bound.
  """
  if minimum is not None and maximum is not None:
    label = f"int in [{minimum}, {maximum}]"
  else:
    label = " ".join(["int", *[f">= {minimum}"] * (minimum is not None), *[f"<= {maximum}"] * (maximum is not None)])

  @_labelled(label)
  def parse(value) -> int:
    try:
      n = int(value)
    except (TypeError, ValueError):
      raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}") from None
    if minimum is not None and maximum is not None and not minimum <= n <= maximum:
      raise argparse.ArgumentTypeError(f"must be in [{minimum}, {maximum}], got {n}")
    if minimum is not None and n < minimum:
      raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {n}")
    if maximum is not None and n > maximum:
      raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {n}")
    return n

  return parse


@_labelled("true|false")
def boolean(value) -> bool:
  """true, 1 or yes; false, 0 or no; in any case."""
  v = str(value).lower()
  if v in ("true", "1", "yes"):
    return True
  if v in ("false", "0", "no"):
    return False
  raise argparse.ArgumentTypeError(f"must be true or false, got {value!r}")


def _number(value) -> float:
  """`value` as a float; NaN when it is not a number, so that every range check refuses it."""
  try:
    return float(value)
  except (TypeError, ValueError):
    return float("nan")


@_labelled("seconds")
def seconds(value) -> float:
  """A number of seconds, >= 0 and finite."""
  x = _number(value)
  if not 0 <= x < float("inf"):
    raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value!r}")
  return x


@_labelled("duration")
def duration(value) -> float:
  """A duration in seconds from a number with an optional unit s, m, h or d ("7d", "12h", "90", "0")."""
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(value))
  if not m:
    raise argparse.ArgumentTypeError(f"must be a duration such as 7d, 12h, 30m, 90s or 0, got {value!r}")
  return float(m[1]) * _DURATION_UNITS[m[2] or "s"]


def fraction(above: float, below: float) -> Callable[[str], float]:
  """A number strictly between `above` and `below`.

  Args:
    above: the bound the value must exceed.
    below: the bound the value must stay under.

  Returns:
    The `type=` callable.
  """
  @_labelled(f"fraction in ({above:g}, {below:g})")
  def parse(value) -> float:
    x = _number(value)
    if not above < x < below:
      raise argparse.ArgumentTypeError(f"must be a fraction in ({above:g}, {below:g}), got {value!r}")
    return x

  return parse


class Ints(str):
  """A list of positive integers as the flag's text, "224,224": a str so that Beam's round trip to
  the workers gives it back unchanged; the integers are `values`."""

  @property
  def values(self) -> tuple[int, ...]:
    """The integers, in order."""
    return tuple(int(d) for d in self.split(","))


def positive_ints(form: str, length: int | None = None) -> Callable[[str], Ints]:
  """Comma-separated positive integers, `length` of them (None: one or more).

  Args:
    form: how the value is written, for the help and the message: "H,W".
    length: how many integers the value holds.

  Returns:
    The `type=` callable; its value is the `Ints` text without spaces ("224, 224" → "224,224").
  """
  @_labelled(form)
  def parse(value) -> Ints:
    parts = [p.strip() for p in str(value).split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts) or length is not None and len(parts) != length:
      raise argparse.ArgumentTypeError(f"must be {form} with positive integers, got {value!r}")
    return Ints(",".join(str(int(p)) for p in parts))

  return parse


def _checked(name: str, parse: Callable, value):
  """`parse(value)`, its error a `UsageError` that names --`name`."""
  try:
    return parse(value)
  except argparse.ArgumentTypeError as e:
    raise UsageError(f"--{name} {e}") from None


class ConverterOptions(PipelineOptions):
  """Flags every converter shares. Pipeline-specific flags live in their own
  classes: Beam registers every options class in one parser, so two pipelines
  defining the same flag could not be imported into one process."""

  @classmethod
  def _add_argparse_args(cls, parser):
    parser.add_argument("--input", help="Input folder, local or gs:// (required).")
    parser.add_argument("--output", help="Output folder, local or gs:// (required).")
    parser.add_argument("--format", dest="file_format", default="array_record", choices=naming.FILE_FORMATS,
                        help="Record file format: array_record (random access) or tfrecord.")
    parser.add_argument("--num_shards", type=integer(0), default=0,
                        help="Shards per split; 0 (default) picks shards of about --shard_size_mb.")
    parser.add_argument("--shard_size_mb", type=integer(1), default=DEFAULT_SHARD_SIZE_MB,
                        help="The shard size aimed at when --num_shards is 0, in MiB of estimated output: smaller "
                             "shards spread a split over more readers, larger ones mean fewer files.")
    parser.add_argument("--name", default=None, help="Dataset name in shard names; default: the input folder's name.")
    parser.add_argument("--seed", type=integer(0), default=0, help="Seed of the record order.")
    parser.add_argument("--plan", default="auto", choices=shards.PLAN_MODES,
                        help=f"Where the shard plan is made: auto (the launcher lists the input unless it holds "
                             f"more than {shards.LAUNCHER_LISTING_LIMIT:,} files, then the workers), launcher or "
                             "workers.")
    parser.add_argument("--overwrite", type=boolean, nargs="?", const=True, default=False,
                        help="true: replace an output folder that already holds a complete output.")
    parser.add_argument("--max_input_bytes", type=integer(1), default=inputs.DEFAULT_MAX_INPUT_BYTES,
                        help="Largest input file read, in bytes; a larger one is a reject.")
    parser.add_argument("--mode", default="rebuild", choices=MODES,
                        help="rebuild: the output is made from the whole input; append: convert only the inputs "
                             "the output does not hold, into new shards of the same splits.")
    parser.add_argument("--reuse_shards", type=boolean, nargs="?", const=True, default=True,
                        help="true: copy shards an earlier run of the same plan published (a failed or killed "
                             "run's) instead of converting them again; false converts every shard.")
    parser.add_argument("--keep_replaced", type=duration, default=DEFAULT_KEEP_REPLACED,
                        help="How long a replaced output generation is kept for the readers still on it: "
                             "7d, 12h, 30m, 0 (remove at once).")
    parser.add_argument("--transient_retry_seconds", type=seconds, default=inputs.DEFAULT_TRANSIENT_RETRY_SECONDS,
                        help="How long to retry an input that answers a transient error (HTTP 5xx/429, "
                             "timeout, dropped connection) before the job fails.")


HELP_FLAGS = ("-h", "--help")
BEAM_FLAGS_HELP = (
    "Beam's runner and worker flags (--runner, --project, --region, --temp_location, --num_workers, "
    "--max_num_workers, --machine_type, --direct_num_workers, ...) are accepted too: see "
    "https://beam.apache.org/documentation/runners/dataflow/ and "
    "https://beam.apache.org/releases/pydoc/current/apache_beam.options.pipeline_options.html")


def declared_flags(cls: type[PipelineOptions]) -> list[argparse.Action]:
  """The flags an options class declares, in its order: what --help shows and its test reads.

  Args:
    cls: a class with `_add_argparse_args` (`ConverterOptions`, a converter's options).

  Returns:
    Its argparse actions.
  """
  parser = argparse.ArgumentParser(add_help=False)
  cls._add_argparse_args(parser)
  return list(parser._actions)  # pylint: disable=protected-access


def shown_default(value) -> str:
  """A default as --help writes it, in the flag's own syntax: true/false, 300 (not 300.0)."""
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, float):
    return f"{value:g}"
  return str(value)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """Each flag as `--flag TYPE`, its help, then its default; the type is the `type=` callable's
  `label` (text when there is none)."""

  def _get_default_metavar_for_optional(self, action):
    return getattr(action.type, "label", "text")

  def _get_help_string(self, action):
    text = action.help or ""
    if action.default is not None and action.default is not argparse.SUPPRESS:
      text += f" (default: {shown_default(action.default).replace('%', '%%')})"
    return text


def help_text(prog: str, summary: str, input_kind: str, own: type[PipelineOptions]) -> str:
  """What `python -m <prog> --help` prints, from the declarations the parser uses.

  Args:
    prog: the converter's module, `pipelines.<name>`.
    summary: one line on what the converter makes.
    input_kind: what --input must be.
    own: the converter's options class; its flags come first, then the shared ones.

  Returns:
    The usage, the input, the converter's flags, the shared flags and where Beam's flags are described.
  """
  parser = argparse.ArgumentParser(
      prog=f"python -m {prog}", add_help=False, formatter_class=_HelpFormatter,
      usage=f"python -m {prog} --input=INPUT --output=OUTPUT [--flag=value ...] [Beam flags]",
      description=f"{summary}\n\nInput (--input): {input_kind}, local or gs://.",
      epilog=textwrap.fill(BEAM_FLAGS_HELP, 100, break_on_hyphens=False, break_long_words=False))
  own._add_argparse_args(parser.add_argument_group(f"{prog.rsplit('.', 1)[-1]} flags"))  # pylint: disable=protected-access
  ConverterOptions._add_argparse_args(parser.add_argument_group("shared flags"))  # pylint: disable=protected-access
  parser.add_argument_group("help").add_argument(*HELP_FLAGS, action="help", help="Show this help and exit.")
  return parser.format_help()


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
      _checked(name, integer(minimum), values[name])


def int_flag(name: str, value, minimum: int, maximum: int | None = None) -> int:
  """An integer checked against its bounds, outside a parser (`integer` is the flag type).

  Args:
    name: the flag's name, without `--`, for the message.
    value: the value as given (usually a string).
    minimum: the smallest value allowed.
    maximum: the largest value allowed; None for no limit.

  Returns:
    The value as an int.

  Raises:
    UsageError: the value is not an integer or is out of bounds.
  """
  return _checked(name, integer(minimum, maximum), value)


def bool_flag(name: str, value) -> bool:
  """A true/false value outside a parser (`boolean` is the flag type).

  Args:
    name: the flag (no `--`), named in the error.
    value: true, 1 or yes; false, 0 or no; in any case.

  Returns:
    True or False.

  Raises:
    UsageError: any other value.
  """
  return _checked(name, boolean, value)


def seconds_flag(name: str, value) -> float:
  """A duration in seconds outside a parser (`seconds` is the flag type).

  Args:
    name: the flag's name, without `--`, for the message.
    value: the value as given.

  Returns:
    The duration as a float.

  Raises:
    UsageError: the value is not a number, negative, infinite or NaN.
  """
  return _checked(name, seconds, value)


def read_policy(options: PipelineOptions) -> inputs.ReadPolicy:
  """How the converter reads its inputs: `--transient_retry_seconds` and `--max_input_bytes`.

  Args:
    options: the parsed options.

  Returns:
    The `inputs.ReadPolicy`.
  """
  c = options.view_as(ConverterOptions)
  return inputs.ReadPolicy(c.transient_retry_seconds, c.max_input_bytes)


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
  with usage_errors("--name"):
    return naming.check_dataset_name(name)


def check_input_output(input_flag: str | None, output_flag: str | None, overwrite: bool,
                       input_kind: str = "a folder", append: bool = False,
                       service_input: bool = False) -> tuple[str, str, bool]:
  """(input root, output root, overwrite) after the checks every converter makes.

  Local paths become absolute. The input must exist, the output must not be
  inside it, and an output holding a complete output needs --overwrite=true.

  Args:
    input_flag: the --input flag.
    output_flag: the --output flag.
    overwrite: the --overwrite flag.
    input_kind: the expected input, for the "--input is required" message.
    append: --mode=append: adding to a complete output needs no --overwrite (and without one, the run
      makes it, as rebuild would).
    service_input: --input is a service's URL (a DICOM store), kept as given: the converter checks it.

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
  root = input_flag.rstrip("/") if fs.is_gcs(input_flag) or service_input else os.path.abspath(input_flag)
  output = output_flag.rstrip("/") if fs.is_gcs(output_flag) else os.path.abspath(output_flag)
  if not service_input and not fs.is_dir(root):
    raise UsageError(f"--input {input_flag!r} does not exist or is not a folder")
  if not service_input and fs.is_gcs(output) == fs.is_gcs(root):  # a gs:// output is never inside a local input, nor the reverse
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
  """The flags every converter shares, checked and typed.

  `generation` and `expected` are set by the launcher (`launch.run_pipeline`):
  the run's fresh generation folder and the manifest version its commit
  replaces (formats.outputs.commit); a converter never sets them.
  """

  input: str  # the input root: an absolute local path or gs://...
  output: str  # the output folder: an absolute local path or gs://...
  name: str  # the data set's name in shard names
  file_format: str
  num_shards: int = 0  # per split; 0 picks shards of about `target_shard_bytes`
  target_shard_bytes: int = DEFAULT_SHARD_SIZE_MB << 20  # --shard_size_mb
  seed: int = 0
  overwrite: bool = False
  read_policy: inputs.ReadPolicy = inputs.ReadPolicy()
  plan: str = "auto"  # where record converters plan their shards: auto, launcher or workers
  workers: int = 1  # workers the runner may use (`worker_counts`): automatic shard counts are >= 2 per worker
  processes: int = 1  # worker processes sharing the work (`worker_counts`): what a progress ETA divides by
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
                  name_rule: Callable[[str | None, str], str] | None = None,
                  service_input: bool = False) -> CommonConfig:
  """The shared flags of `options`, checked, as a `CommonConfig`.

  Args:
    options: the parsed options.
    input_kind: what --input should be, for the "--input is required" message.
    name: the data set name when the caller already has it.
    name_rule: (--name, checked input root) -> the data set name; `dataset_name` when None.
    service_input: --input is a service's URL, as for `check_input_output`.

  Returns:
    The `CommonConfig`, without the launcher's `generation` and `expected`.

  Raises:
    UsageError: --input or --output is missing or unusable, or --name is not a valid data set name.
  """
  c = options.view_as(ConverterOptions)
  workers, processes = worker_counts(options)
  root, output, overwrite = check_input_output(c.input, c.output, c.overwrite, input_kind,
                                               append=c.mode == "append", service_input=service_input)
  return CommonConfig(
      input=root, output=output, name=name or (name_rule or dataset_name)(c.name, root),
      file_format=c.file_format, num_shards=c.num_shards, target_shard_bytes=c.shard_size_mb << 20, seed=c.seed,
      overwrite=overwrite,
      read_policy=read_policy(options), workers=workers, processes=processes,
      plan=c.plan, mode=c.mode, reuse_shards=c.reuse_shards, keep_replaced_seconds=c.keep_replaced)


def worker_counts(options: PipelineOptions) -> tuple[int, int]:
  """(workers, processes) of the run, from the runner's flags: the workers it may use (what shard counts
  balance over) and the worker processes that share a stage's work (what each one's progress ETA divides by).

  Dataflow: the workers are --max_num_workers, else --num_workers, else 1 (the service's autoscaling
  is not known at launch; pass --max_num_workers or --num_shards to plan for it); the processes are the
  workers × the vCPUs of --machine_type (one SDK process per vCPU; n1-standard-1 when not given).
  DirectRunner: --direct_num_workers (0: one per CPU) workers in the multi_threading and
  multi_processing modes, 1 in the default in-process mode; as many processes with multi_processing,
  otherwise 1 (the in-process and multi_threading modes run the whole job in one process).

  Args:
    options: the parsed options.

  Returns:
    (workers, processes), each >= 1.
  """
  if _on_dataflow(options):
    w = options.view_as(WorkerOptions)
    workers = max(1, int(w.max_num_workers or w.num_workers or 1))
    return workers, workers * _vcpus(w.machine_type or "n1-standard-1")
  d = options.view_as(DirectOptions)
  n = max(1, int(d.direct_num_workers or os.cpu_count() or 1))
  mode = d.direct_running_mode
  return (n if mode in ("multi_threading", "multi_processing") else 1), (n if mode == "multi_processing" else 1)


def local_runner(options: PipelineOptions) -> PipelineRunner | None:
  """The runner of a run on Beam's DirectRunner (named, or by default): its in-process FnApiRunner, set up as
  the DirectRunner sets it up; None for any other runner (Beam creates the one named).

  Since Beam 2.68 the DirectRunner first tries Prism, a Go binary it downloads from GitHub: where that works
  the job runs on another engine than the one the tests exercise (its failures all RuntimeErrors, its metrics
  named otherwise), and where the network drops packets the download waits minutes before it falls back.
  `--runner=PrismRunner` still asks for Prism.
  """
  name = str(options.view_as(StandardOptions).runner or "DirectRunner").lower()
  if name.removesuffix("runner") not in ("direct", "switchingdirect"):
    return None
  provision = fn_runner.ExtendedProvisionInfo(beam_provision_api_pb2.ProvisionInfo(
      pipeline_options=JobServiceHandle.encode_pipeline_options(options.get_all_options())))
  return fn_runner.FnApiRunner(provision_info=provision)


def _on_dataflow(options: PipelineOptions) -> bool:
  return "dataflow" in str(options.view_as(StandardOptions).runner or "").lower()


def _vcpus(machine_type: str) -> int:
  """vCPUs of a Compute Engine machine type: n2-standard-4 → 4, custom-8-30720 → 8, e2-small → 1."""
  custom = re.search(r"custom-(\d+)-", machine_type)
  last = re.search(r"-(\d+)$", machine_type)
  return max(1, int(custom[1] if custom else last[1] if last else 1))
