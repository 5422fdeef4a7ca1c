"""The converter protocol: what a converter supplies, and the one record path core runs for all of them.

A converter is a small class (a subclass of `Converter`, registered in
pipelines/registry.py) that says who it is with class keywords (`name`:
`python -m pipelines.<name>` and the metrics namespace; the record `kind` it
writes, formats.kinds; what its `--input` must be; its own flags, `options`)
and implements

- `configure`: its own flags → a frozen config (UsageError on a bad value);
- `plan`: at launch, from the input's top level, what the output will be
  (features, splits, description, source, the inputs already turned down);

and then the three hooks of a record converter:

1. `sources`: what core lists (folders, each with the key its files carry) or,
   when nothing needs listing, the plan units themselves;
2. `plan_unit`: how one listed file becomes a plan unit (split, record key, the
   unit the converter reads, estimated output bytes);
3. `unit_converter`: the `UnitConverter` that turns one unit into records,
   rejects and events on the workers.

Core owns the rest, the same for every record converter: listing (at launch, or
on the workers beyond `shards.LAUNCHER_LISTING_LIMIT` files or with
`--plan=workers`), planning the shards, `ConvertShards` (one step converts,
writes and publishes a shard), the input accounting, the rejects, `Finalize`
and the commit. A change to how shards are planned or written is made in
`pipelines/core` alone.

Two optional hooks cover what does not fit: `expand_units` (units that need a
Beam stage of their own before planning: CT reads headers and groups series)
and `warnings` (the manifest's warnings from the input accounting). A converter
whose output is whole files rather than record shards (a `.graphbin`) takes the
escape hatch `expand_files`. docs/architecture.md walks through adding one.
"""

from __future__ import annotations

import abc
import collections
from collections.abc import Iterable, Mapping, Sequence
import dataclasses
import types
from typing import Any, ClassVar, NamedTuple

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions

from formats import kinds
from formats.features import ClassLabel, Features
from formats.manifest import Manifest
from formats.outputs.output import is_output, load_manifest
from pipelines.core import flags, inputs, shards
from pipelines.core.errors import UsageError
from pipelines.core.flags import CommonConfig
from pipelines.core.records import Event, InputSummary, Record, Reject
from pipelines.core.shards import ConvertShards, FinalizeShards, ListedFile, PlanUnit, plan_shards
from pipelines.core.sink import CommitFiles, OutputSpec


@dataclasses.dataclass(frozen=True)
class OutputPlan:
  """What the launcher knows of the output before the job runs.

  `features` may be replaced at run time (`Units.features`) when the schema
  depends on the data (CT's volume dtype). `launcher_rejects` are inputs the
  launcher already turned down while reading the top level. `kind` overrides
  the converter's record kind when one converter writes several (OGB).
  `state` carries what `plan` found to the hooks (an input layout, a graph plan);
  it is shipped to the workers with them, so it stays small.
  """

  features: Features
  splits: tuple[str, ...]
  description: str
  source: Mapping[str, Any]
  launcher_rejects: tuple[Reject, ...] = ()
  kind: str | None = None
  state: Any = None
  # What decides the record keys but is in no manifest (a secret salt), as a keyed digest: an append
  # with another one would convert every input again beside its old copy, so it is refused.
  fingerprint: str = ""


class Sources(NamedTuple):
  """What a record converter's input is made of (`Converter.sources`).

  Either `folders` core lists, each as (key, location): every file below a
  folder is listed with its key, which is the file's split or a tuple whose
  first item is the split; or `units`, the plan units themselves when the plan
  already knows them (nothing is listed), standing for `num_inputs` input units.
  """

  folders: Sequence[tuple[Any, str]] = ()
  root: str | None = None  # the input root: record keys are paths relative to it; a link out of it is a reject
  on_workers: bool = False  # list on the workers whatever --plan says (the units need a Beam stage: expand_units)
  units: Sequence[PlanUnit] | None = None
  num_inputs: int = 0


class Units(NamedTuple):
  """What `Converter.expand_units` makes of the listed files on the workers.

  `units` are the `PlanUnit`s; `rejects` the inputs turned down while making
  them; `num_inputs` (a PCollection of one int) the input units they stand for
  when that is not one per listed file (CT counts frames); `warnings` strings
  for the manifest; `side_inputs` Beam side inputs `UnitConverter.convert`
  receives by name; `features` (a PCollection of one `Features`) the schema
  when it is known only at run time.
  """

  units: beam.PCollection
  rejects: beam.PCollection | None = None
  num_inputs: beam.PCollection | None = None
  warnings: beam.PCollection | None = None
  side_inputs: Mapping[str, Any] = types.MappingProxyType({})
  features: beam.PCollection | None = None


class Found(NamedTuple):
  """The input accounting `Converter.warnings` reads: files per listing key, undecodable names, events."""

  per_key: Mapping[Any, int]  # listed files per `Sources.folders` key
  undecodable: int  # listed names (files and listing rejects) that are not valid UTF-8
  events: Mapping[str, int]  # the conversion's `Event`s, by name


class Files(NamedTuple):
  """A file converter's result (`Converter.expand_files`): a PCollection of the `FileInfo`s it
  published in the run's generation, and what the manifest says of them (its `graph` section)."""

  files: beam.PCollection
  graph: Mapping[str, Any] | None = None


class Converter(abc.ABC):
  """Raw input → a committed output. Subclass it with the class keywords (`name`, `kind`,
  `options`, and optionally `input_kind`, `worker_extras`), implement `configure`, `plan`
  and the record hooks (`sources`, `plan_unit`, `unit_converter`), or `expand_files` for
  whole-file outputs; register the name in pipelines/registry.py."""

  name: ClassVar[str]
  kind: ClassVar[str]
  input_kind: ClassVar[str] = "a folder"
  options: ClassVar[type[PipelineOptions]]
  worker_extras: ClassVar[tuple[str, ...]] = ("pipelines",)  # pyproject extras Dataflow workers need

  def __init_subclass__(cls, *, name: str, kind: str, options: type[PipelineOptions], input_kind: str = "a folder",
                        worker_extras: tuple[str, ...] = ("pipelines",), **kwargs):
    """`class MyConverter(Converter, name="my_folder", kind="tensors", options=MyOptions, ...)`."""
    super().__init_subclass__(**kwargs)
    cls.name, cls.kind, cls.options, cls.input_kind, cls.worker_extras = name, kind, options, input_kind, worker_extras

  @property
  def prog(self) -> str:
    """The module users run, `python -m pipelines.<name>`; also the metrics namespace."""
    return f"pipelines.{self.name}"

  def common_config(self, options: PipelineOptions) -> CommonConfig:
    """The shared flags, checked. Override to derive the data set name differently.

    Args:
      options: the parsed command-line options.

    Returns:
      The frozen `CommonConfig` (without `generation`, which the launcher adds).

    Raises:
      UsageError: a shared flag is missing or has a bad value.
    """
    return flags.common_config(options, self.input_kind)

  @abc.abstractmethod
  def configure(self, own: PipelineOptions, common: CommonConfig) -> Any:
    """The converter's own flags (`own`: the options viewed as its `options` class) → a frozen config.

    Args:
      own: the parsed options, viewed as the converter's `options` class.
      common: the checked shared flags.

    Returns:
      The converter's frozen config, passed to `plan` and the hooks.

    Raises:
      UsageError: a flag is missing or has a bad value (nothing has been read or written).
    """

  @abc.abstractmethod
  def plan(self, common: CommonConfig, config: Any) -> OutputPlan:
    """What the output will be, from the input's top level (read here, at launch).

    Args:
      common: the checked shared flags.
      config: what `configure` returned.

    Returns:
      The `OutputPlan`: features, splits, description, source, launcher rejects.

    Raises:
      UsageError: the input cannot be converted at all (for example, no class folders).
    """

  # ------------------------------------------------------------ the record hooks

  def sources(self, common: CommonConfig, config: Any, plan: OutputPlan) -> Sources:
    """Hook 1: what core lists, or the plan units themselves (called at launch).

    Args:
      common: the checked shared flags.
      config: what `configure` returned.
      plan: what `plan` returned.

    Returns:
      The `Sources`.
    """
    raise NotImplementedError(f"{type(self).__name__} implements neither sources() nor expand_files()")

  def plan_unit(self, config: Any, listed: ListedFile) -> PlanUnit:
    """Hook 2: one listed file → its plan unit (at launch, or on the workers). By default the file
    is the unit, `(key, InputFile)`, keyed by its relative path, estimated at its own size.

    Args:
      config: what `configure` returned.
      listed: the file, its listing key, size, split and relative path.

    Returns:
      The `PlanUnit` (split, record key unique in the split, the unit `convert` receives, estimated bytes).
    """
    del config
    return PlanUnit(listed.split, listed.rel, (listed.key, listed.file), listed.size)

  def unit_converter(self, common: CommonConfig, config: Any, plan: OutputPlan) -> UnitConverter:
    """Hook 3: the `UnitConverter` the workers convert each unit with (called at launch, shipped pickled).

    Args:
      common: the checked shared flags (the read policy).
      config: what `configure` returned.
      plan: what `plan` returned (its features, its state).

    Returns:
      The `UnitConverter`.
    """
    raise NotImplementedError(f"{type(self).__name__} implements neither unit_converter() nor expand_files()")

  def expand_units(self, p: beam.Pipeline, listed: shards.ListedOnWorkers, common: CommonConfig, config: Any,
                   plan: OutputPlan) -> Units:
    """Optional: the plan units of the listed files, when they need a Beam stage of their own (CT reads
    every file's header and groups the series). Only called with `Sources.on_workers`.

    Args:
      p: the pipeline.
      listed: the listed files (as `ListedFile`s) and the listing's rejects ((key, InputFile, reason)).
      common, config, plan: as `sources` takes them.

    Returns:
      The `Units`.
    """
    del p, common, plan
    return Units(listed.files | "PlanUnits" >> beam.Map(lambda f, c: self.plan_unit(c, f), config))

  def warnings(self, config: Any, plan: OutputPlan, found: Found) -> list[str]:
    """Optional: the manifest's warnings from the input accounting (runs on a worker, after conversion).

    Args:
      config: what `configure` returned.
      plan: what `plan` returned.
      found: files per listing key, undecodable names, events by name.

    Returns:
      The warnings; by default one for names that are not valid UTF-8.
    """
    del config, plan
    return [inputs.undecodable_warning(found.undecodable)] if found.undecodable else []

  # ------------------------------------------------------------ the escape hatch

  def expand_files(self, p: beam.Pipeline, common: CommonConfig, config: Any, plan: OutputPlan) -> Files | None:
    """Optional: the Beam graph of a converter whose output is whole files, not record shards.

    Args:
      p: the pipeline to add the steps to.
      common: the checked shared flags, with the launcher's `generation`.
      config: what `configure` returned.
      plan: what `plan` returned.

    Returns:
      The `Files` published in the run's generation (core commits them), or None to take the record path.
    """
    del p, common, config, plan
    return None

  # ------------------------------------------------------------ what core runs

  def output_spec(self, common: CommonConfig, plan: OutputPlan) -> OutputSpec:
    """Where and how the run writes its output (what `ConvertShards` and the commit need).

    Args:
      common: the shared flags, with the launcher's `generation` and `expected`.
      plan: what `plan` returned.

    Returns:
      The `OutputSpec`.
    """
    return OutputSpec(
        output=common.output, name=common.name, file_format=common.file_format, features=plan.features,
        splits=plan.splits, num_shards=common.num_shards, target_shard_bytes=common.target_shard_bytes,
        seed=common.seed, description=plan.description,
        source=plan.source, generation=common.generation, expected=common.expected,
        kind=plan.kind or self.kind, mode=common.mode, reuse_shards=common.reuse_shards,
        keep_replaced_seconds=common.keep_replaced_seconds, fingerprint=plan.fingerprint)

  def build(self, p: beam.Pipeline, common: CommonConfig, config: Any) -> beam.PCollection:
    """Adds the whole conversion to `p`: plan, then the record path (or the converter's files), then the commit.

    Args:
      p: the pipeline to add the steps to.
      common: the shared flags, with the launcher's `generation` and `expected`.
      config: what `configure` returned.

    Returns:
      The PCollection holding the committed manifest (a dict).

    Raises:
      UsageError: `plan` found an input that cannot be converted at all.
    """
    plan = self.plan(common, config)
    kinds.check(plan.kind or self.kind, plan.features)  # a converter's own mistake, found before anything runs
    if common.mode == "append" and is_output(common.output):
      check_append(load_manifest(common.output), plan.features, common.file_format, common.name, plan.source)
    spec = self.output_spec(common, plan)
    files = self.expand_files(p, common, config, plan)
    if files is not None:
      return files.files | "Commit" >> CommitFiles(spec, graph=files.graph)
    return _record_path(self, p, common, config, plan, spec)


def _record_path(converter: Converter, p: beam.Pipeline, common: CommonConfig, config: Any, plan: OutputPlan,
                 spec: OutputSpec) -> beam.PCollection:
  """sources → listing → plan units → shard plan → ConvertShards → accounting → Finalize (the commit)."""
  sources = converter.sources(common, config, plan)
  units_converter = converter.unit_converter(common, config, plan)
  extra = Units(None)
  listing = None  # the launcher's listing accounting, when it listed
  if sources.units is not None:  # nothing to list
    units = list(sources.units)
    listing_rejects = p | "ListingRejects" >> beam.Create([])
    listing = shards.ListingCounts({}, 0, 0, 0)
  else:
    listed = None
    if not sources.on_workers and common.plan != "workers":
      listed = shards.list_at_launch(sources.folders, common.read_policy.retry_seconds, sources.root,
                                     shards.LAUNCHER_LISTING_LIMIT if common.plan == "auto" else None)
    if listed is not None:  # planned here
      units = [converter.plan_unit(config, f) for f in listed.files]
      listing_rejects = p | "ListingRejects" >> beam.Create(
          [Reject(f.path, reason, shards.split_of_key(key)) for key, f, reason in listed.rejects])
      listing = listed.counts
    else:  # planned on the workers
      on_workers = shards.list_on_workers(p, sources.folders, common.read_policy.retry_seconds, sources.root)
      extra = converter.expand_units(p, on_workers, common, config, plan)
      units = extra.units
      listing_rejects = on_workers.rejects | "ListingRejects" >> beam.MapTuple(
          lambda key, f, reason: Reject(f.path, reason, shards.split_of_key(key)))
      listing = beam.pvalue.AsSingleton(on_workers.counts)
  planned = plan_shards(p, units, spec, common.workers, units_converter)
  done = planned.tasks | "Convert" >> ConvertShards(
      units_converter, spec, converter.prog, totals=planned.totals, processes=common.processes,
      **extra.side_inputs)

  summary = (
      p
      | "SummaryTrigger" >> beam.Create([None])
      | "Summarize" >> beam.Map(
          _summarize, converter=converter, config=config, plan=plan,
          fixed=len(plan.launcher_rejects) + (sources.num_inputs if sources.units is not None else 0),
          counts=listing, events=beam.pvalue.AsIter(done.events),
          num_inputs=None if extra.num_inputs is None else beam.pvalue.AsSingleton(extra.num_inputs),
          warnings=None if extra.warnings is None else beam.pvalue.AsList(extra.warnings)))
  rejects = [done.rejects, listing_rejects] + ([extra.rejects] if extra.rejects is not None else [])
  return {"results": done.results, "rejects": rejects | "AllRejects" >> beam.Flatten()} | "Finalize" >> FinalizeShards(
      spec, planned.planned, summary=summary, launcher_rejects=plan.launcher_rejects, features=extra.features,
      append=planned.append)


def _summarize(_, converter: Converter, config: Any, plan: OutputPlan, fixed: int, counts: shards.ListingCounts,
               events: Iterable[Event], num_inputs: int | None, warnings: Sequence[str] | None) -> InputSummary:
  """The run's `InputSummary`: listed entries (or the units' own count) + listing and launcher rejects,
  and the warnings (the converter's, from the accounting, and those its units stage made)."""
  found = Found(counts.per_key, counts.undecodable, collections.Counter(e.name for e in events))
  total = (counts.files if num_inputs is None else num_inputs) + counts.rejects + fixed
  return InputSummary(total, (*converter.warnings(config, plan, found), *sorted(set(warnings or ()))))


# Settings (the manifest's `source` keys) an append may change: where the input is, the order
# and count of the new shards, CT's dtype policy (the schema check covers the dtype itself) and
# which studies of a DICOM store it lists (a daily run moves its StudyDate window).
APPEND_MAY_CHANGE = frozenset({"input", "seed", "num_shards", "volume_dtype", "dicomweb_filter"})


def check_append(current: Manifest, features: Features, file_format: str, name: str,
                 source: Mapping[str, Any] | None = None) -> None:
  """Refuses `--mode=append` flags that would make the new shards unlike the output's.

  The format, name and settings (`source`, but `APPEND_MAY_CHANGE`) must be the output's, and the
  schema too, except that class names may be added at the end (existing ids never change).

  Args:
    current: the manifest of the output appended to.
    features: the features the run would write.
    file_format: --format.
    name: the data set name.
    source: the run's `OutputPlan.source`.

  Raises:
    UsageError: another format, name, setting or schema (naming them, with both values).
  """
  if (current.file_format, current.name) != (file_format, name):
    raise UsageError(f"--mode=append: the output is {current.file_format} shards named {current.name!r}; this run "
                     f"would write {file_format} shards named {name!r}")
  if source is not None:
    changed = sorted(k for k in set(current.source) | set(source)
                     if k not in APPEND_MAY_CHANGE and current.source.get(k) != source.get(k))
    if changed:
      raise UsageError(f"--mode=append: the output was converted with other settings ({', '.join(changed)}: "
                       f"{', '.join(f'{current.source.get(k)!r} now {source.get(k)!r}' for k in changed)}); "
                       "give the flags it was made with, or run --mode=rebuild")
  if set(current.features) != set(features):
    raise UsageError(f"--mode=append: the output's features are {sorted(current.features)}, this run's "
                     f"{sorted(features)}")
  for k in current.features:
    old, new = current.features[k], features[k]
    if isinstance(old, ClassLabel) and isinstance(new, ClassLabel):
      if new.names[:len(old.names)] != old.names:
        raise UsageError(f"--mode=append: feature {k!r}: the output's class names {list(old.names)} must stay "
                         f"first and in order, got {list(new.names)}")
    elif old != new:
      raise UsageError(f"--mode=append: feature {k!r} would change from {old} to {new}; the flags must give the "
                       "output's layout (or run --mode=rebuild)")


def appended_feature(common: CommonConfig, name: str, spec: type, what: str):
  """The feature `name` of the output a run adds to (--mode=append onto a complete output), which a
  converter keeps (image label ids, a volume's dtype); None when the run adds to no output.

  Args:
    common: the checked shared flags (--mode and --output).
    name: the feature.
    spec: the spec class it must be (`ClassLabel`, `Tensor`).
    what: the output that holds it, for the message ("image output (no class label feature)").

  Raises:
    UsageError: the output holds no such feature.
  """
  if common.mode != "append" or not is_output(common.output):
    return None
  held = load_manifest(common.output).features
  if name not in list(held) or not isinstance(held[name], spec):
    raise UsageError(f"--mode=append: {common.output} holds no {what}")
  return held[name]


class UnitConverter(abc.ABC):
  """Converts one unit of input (a file, a series, a graph) into records and rejects.

  Pure Python, picklable (it is shipped to workers): open clients in `setup`.
  `convert` yields `Record`s, `Reject`s and `Event`s; a transient error raised from it
  fails the bundle, which the runner retries.
  """

  def setup(self) -> None:
    """Called once per worker before the first unit."""

  def input_paths(self, unit, **side_inputs) -> Sequence[str] | None:
    """The locations of the inputs `unit` is read from (local or gs://), or None when unknown.

    A shard whose units all name their inputs can be reused by a later run of the same plan
    while those inputs are unchanged (pipelines/core/reuse.py); None converts it every time.

    Args:
      unit: one unit, as `convert` receives it.
      **side_inputs: as for `convert`.

    Returns:
      The input locations, or None.
    """
    del unit, side_inputs
    return None

  def listed_units(self, unit) -> int:
    """How many input units the run's `InputSummary` counts for `unit` (by default its input files).

    `--mode=append` skips the units the output already holds; this is what it takes off the
    summary's count for each, so that the accounting still adds up.

    Args:
      unit: one unit, as `convert` receives it.

    Returns:
      The count.
    """
    return len(self.input_paths(unit) or ())

  @abc.abstractmethod
  def convert(self, unit, **side_inputs) -> Iterable[Record | Reject | Event]:
    """The records, rejects and events of one unit.

    Args:
      unit: one unit of input (a file, a series, a graph set), as the converter listed it.
      **side_inputs: the Beam side inputs `ConvertUnits` was given, by name.

    Returns:
      The unit's `Record`s, `Reject`s and `Event`s (usually a generator).
    """


class FileUnits(UnitConverter):
  """A unit converter whose units are listed files, `(key, InputFile)` as the default `plan_unit` makes
  them, each becoming one record.

  `convert` reads the file by the read policy and hands its bytes to `payload`; the file's own fault
  (unreadable, too large, or one of `rejected_errors` raised by `payload`) is a reject with the reason,
  while a transient error fails the bundle, which the runner retries. The record's key is the path
  relative to the input root.
  """

  rejected_errors: ClassVar[tuple[type[Exception], ...]] = (ValueError,)

  def __init__(self, root: str, read_policy: inputs.ReadPolicy):
    self._root = inputs.printable(root).rstrip("/") + "/"
    self._read_policy = read_policy

  def input_paths(self, unit):
    return [unit[1].location]

  @abc.abstractmethod
  def payload(self, key, rel: str, data: bytes) -> bytes:
    """One file's record payload.

    Args:
      key: the file's listing key (`Sources.folders`).
      rel: its path relative to the input root.
      data: its bytes.

    Returns:
      The encoded record.

    Raises:
      One of `rejected_errors`: the reason the file is a reject (its message is the reason).
    """

  def convert(self, unit):
    key, f = unit
    split = shards.split_of_key(key)
    rel = f.path[len(self._root):]
    try:
      payload = self.payload(key, rel, self._read_policy.read(f.location))
    except (inputs.Unreadable, *self.rejected_errors) as e:
      yield Reject(f.path, str(e), split)
      return
    yield Record(split, rel, payload)


def counters(namespace: str, *names: str) -> types.SimpleNamespace:
  """Beam counters by name, for a DoFn's or UnitConverter's `setup`.

      self._count = counters(PIPELINE, "files_read", "files_rejected")
      self._count.files_read.inc()

  Args:
    namespace: the metrics namespace (the converter's module, `pipelines.<name>`).
    *names: the counters' names.

  Returns:
    A namespace with one `Metrics.counter` attribute per name.
  """
  return types.SimpleNamespace(**{n: Metrics.counter(namespace, n) for n in names})
