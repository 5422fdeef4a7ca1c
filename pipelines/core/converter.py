"""The converter protocol: the one shape every converter has, and the shared path that runs it.

A converter is a small class (a subclass of `Converter`) that says

- who it is: `name` (`python -m pipelines.<name>`, the registry key, the
  metrics namespace), the record `kind` it writes (formats.kinds), what its
  `--input` must be, and its own flags (`options`, a Beam options class);
- `configure`: its own flags → a frozen config (UsageError on a bad value);
- `plan`: at launch, from the input's top level, what the output will be
  (features, splits, description, source, the inputs already turned down);
- `expand`: the Beam graph from input to `Records` (records + rejects, and the
  accounting of inputs) or, for a converter that writes whole files, `Files`.

Everything else is shared and lives in `pipelines.core`: flag parsing and the
common flags (`flags.CommonConfig`), listing and reading inputs (`inputs`),
converting units (`ConvertUnits`), shuffling, sharding, writing and committing
(`sink`), running, the heartbeat and exit codes (`launch`), Dataflow packaging
(`dataflow`). The stages are: list inputs → plan units → convert each unit →
write shards → commit; a converter supplies the first three as pure functions
and small transforms, so a change to how units become shards (conversions at
scale) is made once, in `core`. docs/architecture.md walks through adding one.
"""

from __future__ import annotations

import abc
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
from pipelines.core import flags
from pipelines.core.errors import UsageError
from pipelines.core.flags import CommonConfig
from pipelines.core.shards import FinalizeShards
from pipelines.core.sink import CommitFiles, InputSummary, OutputSpec, Record, Reject, WriteOutput


@dataclasses.dataclass(frozen=True)
class OutputPlan:
  """What the launcher knows of the output before the job runs.

  `features` may be replaced at run time (`Records.features`) when the schema
  depends on the data (CT's volume dtype). `launcher_rejects` are inputs the
  launcher already turned down while listing the top level. `kind` overrides
  the converter's record kind when one converter writes several (OGB).
  `state` carries what `plan` found to `expand` (an input layout, a graph plan).
  """

  features: Features
  splits: tuple[str, ...]
  description: str
  source: Mapping[str, Any]
  launcher_rejects: tuple[Reject, ...] = ()
  kind: str | None = None
  state: Any = None  # what `plan` found that `expand` needs (the converter's own business)
  # What decides the record keys but is in no manifest (a secret salt), as a keyed digest: an append
  # with another one would convert every input again beside its old copy, so it is refused.
  fingerprint: str = ""


class Records(NamedTuple):
  """A record converter's result: PCollections the shared sink shards, writes and commits.

  `summary` holds one `InputSummary` (the input units found, for the check
  that nothing was lost, and the manifest's warnings); `features` one
  `Features` when the schema is only known at run time.
  """

  records: beam.PCollection
  rejects: beam.PCollection
  summary: beam.PCollection | None = None
  features: beam.PCollection | None = None


class Files(NamedTuple):
  """A file converter's result: a PCollection of the `FileInfo`s it published in the run's
  generation, and what the manifest says of them (its `graph` section)."""

  files: beam.PCollection
  graph: Mapping[str, Any] | None = None


class ShardsWritten(NamedTuple):
  """A record converter's result when its shards are the work units (`pipelines.core.shards`).

  `results` are the `ShardResult`s of `ConvertShards`; `planned` holds
  (split, shard count) per planned split; `rejects` every reject (listing and
  conversion); `summary` and `features` as in `Records`; `append` is
  `shards.Planned.append` (the accounting of `--mode=append`).
  """

  results: beam.PCollection
  planned: beam.PCollection
  rejects: beam.PCollection
  summary: beam.PCollection | None = None
  features: beam.PCollection | None = None
  append: beam.PCollection | None = None


class Converter(abc.ABC):
  """Raw input → a committed output. Subclass it with the class keywords (`name`, `kind`,
  `options`, and optionally `input_kind`, `worker_extras`), implement `configure`, `plan`
  and `expand`; register the name in pipelines/registry.py."""

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
    """The module users run: `python -m pipelines.<name>`."""
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
      The converter's frozen config, passed to `plan` and `expand`.

    Raises:
      UsageError: a flag is missing or has a bad value (nothing has been read or written).
    """

  @abc.abstractmethod
  def plan(self, common: CommonConfig, config: Any) -> OutputPlan:
    """What the output will be, from the input's top level (listed here, at launch).

    Args:
      common: the checked shared flags.
      config: what `configure` returned.

    Returns:
      The `OutputPlan`: features, splits, description, source, launcher rejects.

    Raises:
      UsageError: the input cannot be converted at all (for example, no class folders).
    """

  @abc.abstractmethod
  def expand(self, p: beam.Pipeline, common: CommonConfig, config: Any, plan: OutputPlan) -> Records | Files:
    """The Beam graph from the input to records and rejects (or published files).

    Args:
      p: the pipeline to add the steps to.
      common: the checked shared flags.
      config: what `configure` returned.
      plan: what `plan` returned (its `state` included).

    Returns:
      `Records` for the shared sink to shard and commit, or `Files` already published.
    """

  def output_spec(self, common: CommonConfig, plan: OutputPlan) -> OutputSpec:
    """Where and how the run writes its output (what `ConvertShards` and the sinks need).

    Args:
      common: the shared flags, with the launcher's `generation` and `expected`.
      plan: what `plan` returned.

    Returns:
      The `OutputSpec`.
    """
    return OutputSpec(
        output=common.output, name=common.name, file_format=common.file_format, features=plan.features,
        splits=plan.splits, num_shards=common.num_shards, seed=common.seed, description=plan.description,
        source=plan.source, generation=common.generation, expected=common.expected,
        kind=plan.kind or self.kind, mode=common.mode, reuse_shards=common.reuse_shards,
        keep_replaced_seconds=common.keep_replaced_seconds, fingerprint=plan.fingerprint)

  def build(self, p: beam.Pipeline, common: CommonConfig, config: Any) -> beam.PCollection:
    """Adds the whole conversion to `p`: plan, expand, then write and commit.

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
    out = self.expand(p, common, config, plan)
    if isinstance(out, Files):
      return out.files | "Commit" >> CommitFiles(spec, graph=out.graph)
    if isinstance(out, ShardsWritten):
      return {"results": out.results, "rejects": out.rejects} | "Finalize" >> FinalizeShards(
          spec, out.planned, summary=out.summary, launcher_rejects=plan.launcher_rejects, features=out.features,
          append=out.append)
    return {"records": out.records, "rejects": out.rejects} | "Write" >> WriteOutput(
        spec, summary=out.summary, launcher_rejects=plan.launcher_rejects, features=out.features)


# Settings (the manifest's `source` keys) an append may change: where the input is, the order
# and count of the new shards, and CT's dtype policy (the schema check covers the dtype itself).
APPEND_MAY_CHANGE = frozenset({"input", "seed", "num_shards", "volume_dtype"})


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


class Event(NamedTuple):
  """Something a unit's conversion noticed that the converter counts for its summary
  (for example "multi_frame"); it is neither a record nor a reject."""

  name: str


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


class _ConvertUnitsFn(beam.DoFn):
  def __init__(self, converter: UnitConverter, namespace: str):
    self._converter = converter
    self._namespace = namespace

  def setup(self):
    self._converter.setup()
    self._units = Metrics.counter(self._namespace, "units_converted")
    self._records = Metrics.counter(self._namespace, "records_made")
    self._rejects = Metrics.counter(self._namespace, "rejects_made")

  def process(self, unit, **side_inputs):
    self._units.inc()
    for out in self._converter.convert(unit, **side_inputs):
      if isinstance(out, Reject):
        self._rejects.inc()
        yield beam.pvalue.TaggedOutput("rejects", out)
      elif isinstance(out, Event):
        yield beam.pvalue.TaggedOutput("events", out)
      else:
        self._records.inc()
        yield out


class ConvertUnits(beam.PTransform):
  """PCollection[unit] → (records, rejects, events): each unit converted by `converter` on some worker.

      converted = units | ConvertUnits(MyUnitConverter(...), namespace="pipelines.my_folder")
      converted.records, converted.rejects, converted.events

  `side_inputs` are passed to `convert` by name (Beam side inputs, e.g. AsSingleton).
  The units are spread over workers first (a Reshuffle): listing hands them out unevenly.
  """

  def __init__(self, converter: UnitConverter, namespace: str, reshuffle: bool = True, **side_inputs):
    super().__init__()
    self._converter = converter
    self._namespace = namespace
    self._reshuffle = reshuffle
    self._side_inputs = side_inputs

  def expand(self, units):
    if self._reshuffle:
      units = units | "Spread" >> beam.Reshuffle()
    return units | "Convert" >> beam.ParDo(
        _ConvertUnitsFn(self._converter, self._namespace), **self._side_inputs).with_outputs("rejects", "events", main="records")


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


def summary_of(p: beam.Pipeline, count: beam.PCollection, warnings: Sequence[str] = ()) -> beam.PCollection:
  """A PCollection of one `InputSummary` from a PCollection holding the number of input units.

  Args:
    p: the pipeline to add the steps to.
    count: a PCollection of one int, the number of input units found.
    warnings: the summary's warnings, recorded in the manifest.

  Returns:
    A PCollection of one `InputSummary`, for `Records.summary`.
  """
  return (p | "SummaryTrigger" >> beam.Create([None])
          | "Summarize" >> beam.Map(lambda _, n: InputSummary(n, tuple(warnings)), n=beam.pvalue.AsSingleton(count)))
