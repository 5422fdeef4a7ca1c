"""The record types every converter shares, the older record sink, and the commit every output ends with.

`Record`, `Reject`, `InputSummary`, `OutputSpec`, `sort_key`, `write_shard`
(one shard written, hashed and published), `commit_records` (the input
accounting and the manifest) and `commit_output` (the switch) serve both record
paths: shards as work units (`pipelines.core.shards`, used by image_folder,
array_folder and ct_volumes) and `WriteOutput` below (graph-property records of
ogb_graphs), which shards records after they are converted.

Records arrive as `Record(split, key, payload)`; rejected inputs as `Reject`.
`WriteOutput` turns them into a complete output folder:

  1. each record gets a sort key, a hash of (seed, split, key): a fixed shuffle
     that does not depend on the runner, the worker count or bundle order;
  2. per split, the sorted sort keys give shard boundaries so that record
     counts differ by at most one between shards;
  3. records are grouped by shard, sorted, written to a local file and published
     with one atomic upload per shard (array_record cannot write to gs://,
     google/array_record#120); a retry rewrites the same bytes under the same name;
  4. one finalize step checks every shard is there, writes errors/ and the TFDS
     metadata, switches the output by writing manifest.json, then removes older
     generations and stale files (shards go to this run's generation folder).
     A split without records is listed in neither (TFDS cannot open one); the
     manifest's warnings name it.

Memory: the step that computes boundaries holds the 16-byte sort keys of one
split (about 100 bytes each with Python overhead: 130 MB for 1.3 M records);
a shard writer holds one shard's payloads (the shard size, `target_shard_bytes`).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Mapping, Sequence
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from typing import Any, NamedTuple

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.transforms.window import GlobalWindows

from formats import adapters, naming
from formats.outputs import commit
from formats.features import Features
from formats.manifest import (
    MANIFEST_FILENAME,
    REJECTED_FILENAME,
    Manifest,
    Rejected,
    ShardInfo,
    SplitInfo,
    sha256_file,
)
from formats.storage import files as fs
from pipelines.core import fileio

_NAMESPACE = "toolkit"
DEFAULT_TARGET_SHARD_BYTES = 128 << 20


class Record(NamedTuple):
  """One output record: `key` is unique within the split (for example the input path).

  `num_inputs` is how many input units (files, or frames of multi-frame files)
  it was made from, for the accounting Finalize checks.
  """

  split: str
  key: str
  payload: bytes
  num_inputs: int = 1


class Reject(NamedTuple):
  """An input that did not become a record, and why; `units` as in `Record.num_inputs`."""

  input: str
  reason: str
  split: str = ""
  units: int = 1

  def to_json(self) -> dict:
    """The reject's line in errors/rejected.jsonl.

    Returns:
      {"input", "reason", "split"} (`units` is accounting only, not written).
    """
    return {"input": self.input, "reason": self.reason, "split": self.split}


class InputSummary(NamedTuple):
  """What a pipeline found in its input, checked against what was written.

  `num_inputs` (input units: files, or frames) must equal the units of the
  records written plus those of the rejects, or Finalize fails the job: an
  input was lost. `warnings` go to the manifest.
  """

  num_inputs: int
  warnings: tuple[str, ...] = ()


class ShardPlan(NamedTuple):
  num_records: int
  num_bytes: int
  num_shards: int
  boundaries: tuple[bytes, ...]  # first sort key of shards 1..n-1
  num_inputs: int = 0  # input units the records were made from


def sort_key(seed: int, split: str, key: str) -> bytes:
  """16 bytes that order the records of a split; a pure function of its inputs.

  Args:
    seed: the run's --seed.
    split: the record's split.
    key: the record's key, unique within the split.

  Returns:
    A 16-byte BLAKE2b digest: the same inputs give the same order on every run.
  """
  return hashlib.blake2b(f"{seed}\0{split}\0{key}".encode("utf-8"), digest_size=16).digest()


def plan_shards(
    sort_keys: Sequence[bytes], num_bytes: int, num_shards: int, target_shard_bytes: int,
    num_inputs: int = 0,
) -> ShardPlan:
  """Shard boundaries giving shards whose record counts differ by at most one.

  Args:
    sort_keys: the sort keys of the split's records (`sort_key`).
    num_bytes: the records' total size.
    num_shards: the shards wanted; 0 picks ceil(num_bytes / target_shard_bytes).
    target_shard_bytes: the shard size aimed at when `num_shards` is 0.
    num_inputs: the input units the records were made from, carried along.

  Returns:
    The `ShardPlan`; never more shards than records, and none for no records.
  """
  keys = sorted(sort_keys)
  n = len(keys)
  if n == 0:
    return ShardPlan(0, 0, 0, (), num_inputs)
  shards = num_shards or max(1, math.ceil(num_bytes / target_shard_bytes))
  shards = min(shards, n)
  boundaries = tuple(keys[i * n // shards] for i in range(1, shards))
  return ShardPlan(n, num_bytes, shards, boundaries, num_inputs)


def shard_of(plan: ShardPlan, key: bytes) -> int:
  """The index of the shard that holds the record with sort key `key`.

  Args:
    plan: the split's `ShardPlan`.
    key: the record's sort key.

  Returns:
    An index in [0, plan.num_shards).
  """
  return bisect.bisect_right(plan.boundaries, key)


class _KeyAndBatch(beam.DoFn):
  """Record → (split, sort key, payload), grouped into lists of up to ~32 MB.

  Fewer, larger elements: the records cross two materializations (the wait for
  the shard plan, and the GroupByKey), and each element costs a fixed overhead there.
  """

  MAX_BYTES = 32 << 20
  MAX_RECORDS = 1024

  def __init__(self, seed: int):
    self._seed = seed

  def start_bundle(self):
    self._batch, self._bytes = [], 0

  def process(self, r: Record):
    self._batch.append((r.split, sort_key(self._seed, r.split, r.key), r.payload, r.num_inputs))
    self._bytes += len(r.payload)
    if self._bytes >= self.MAX_BYTES or len(self._batch) >= self.MAX_RECORDS:
      yield self._flush()

  def finish_bundle(self):
    if self._batch:
      yield GlobalWindows.windowed_value(self._flush())

  def _flush(self) -> list:
    batch, self._batch, self._bytes = self._batch, [], 0
    return batch


def _assign_shards(batch, plans):
  """A batch → ((split, shard index), [(sort key, payload), ...]) per shard it touches."""
  groups: dict[tuple[str, int], list] = collections.defaultdict(list)
  for split, key, payload, _ in batch:
    groups[(split, shard_of(plans[split], key))].append((key, payload))
  return groups.items()


class _CollectKeys(beam.CombineFn):
  """Per split: all sort keys, payload bytes and input units, combined into a `ShardPlan`."""

  def __init__(self, num_shards: int, target_shard_bytes: int):
    self._num_shards = num_shards
    self._target = target_shard_bytes

  def create_accumulator(self):
    return [], 0, 0

  def add_input(self, acc, element):
    keys, nbytes, inputs = acc
    keys.append(element[0])
    return keys, nbytes + element[1], inputs + element[2]

  def merge_accumulators(self, accs):
    accs = iter(accs)
    keys, nbytes, inputs = next(accs)
    for k, b, i in accs:
      keys.extend(k)
      nbytes += b
      inputs += i
    return keys, nbytes, inputs

  def extract_output(self, acc):
    return plan_shards(acc[0], acc[1], self._num_shards, self._target, acc[2])


@dataclasses.dataclass(frozen=True)
class OutputSpec:
  """Where and how an output is written. Validated on construction."""

  output: str
  name: str
  file_format: str
  features: Features
  splits: tuple[str, ...]
  num_shards: int = 0
  seed: int = 0
  target_shard_bytes: int = DEFAULT_TARGET_SHARD_BYTES
  description: str = ""
  source: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  warnings: tuple[str, ...] = ()
  # The run's generation folder and the manifest version its commit replaces
  # (formats.outputs.commit.begin); WriteOutput claims them itself when left empty.
  generation: str = ""
  expected: commit.Version | None = None
  kind: str = ""  # the record kind (formats.kinds) the manifest records
  mode: str = "rebuild"  # rebuild, or append: new shards after the current output's (pipelines/core/shards.py)
  keep_replaced_seconds: float = commit.DEFAULT_KEEP_REPLACED_SECONDS  # clean-up's retention (--keep_replaced)
  fingerprint: str = ""  # OutputPlan.fingerprint: recorded with every shard, checked by an append
  reuse_shards: bool = True  # copy shards an earlier run of the same plan published (pipelines/core/reuse.py)

  def __post_init__(self):
    naming.check_dataset_name(self.name)
    for s in self.splits:
      naming.check_split_name(s)
    if self.file_format not in naming.FILE_FORMATS:
      raise ValueError(f"format must be one of {naming.FILE_FORMATS}, got {self.file_format!r}")
    if self.num_shards < 0:
      raise ValueError(f"num_shards must be >= 0 (0 = automatic), got {self.num_shards}")
    if self.target_shard_bytes <= 0:
      raise ValueError(f"target_shard_bytes must be > 0, got {self.target_shard_bytes}")

  def reuse_settings(self) -> dict:
    """What of this spec shapes a shard's bytes besides its units: part of every shard's plan digest.

    Returns:
      The settings, JSON-able (the output folder, generation and expected version left out).
    """
    return {"name": self.name, "file_format": self.file_format, "features": self.features.to_json(),
            "num_shards": self.num_shards, "seed": self.seed, "target_shard_bytes": self.target_shard_bytes,
            "source": dict(self.source), "kind": self.kind}

  def shard_name(self, split: str, index: int, num_shards: int) -> naming.ShardName:
    """The name of one shard of `split` (`naming.ShardName`).

    Args:
      split: the split's name.
      index: the shard's index, from 0.
      num_shards: the split's number of shards.

    Returns:
      The `naming.ShardName`.
    """
    return naming.ShardName(self.name, split, self.file_format, index, num_shards)

  def relative(self, name: str) -> str:
    """Path of a data file of this run, relative to the output root.

    Args:
      name: the file's name (a shard name, the rejects file).

    Returns:
      `generation/name`, or `name` when the spec has no generation.
    """
    return f"{self.generation}/{name}" if self.generation else name


def write_shard(spec: OutputSpec, split: str, index: int, num_shards: int, payloads: Iterable[bytes]) -> ShardInfo:
  """Writes one shard locally, hashes it and publishes it to the output in one atomic step.

  Args:
    spec: the output.
    split: the shard's split.
    index: its index in [0, num_shards).
    num_shards: the split's shard count (part of the name).
    payloads: the records, in order (an iterator is written as it yields: nothing is published
      when it raises).

  Returns:
    The shard's manifest entry (path relative to the output, records, bytes, SHA-256).
  """
  name = spec.relative(spec.shard_name(split, index, num_shards).filename)
  dest = fs.join(spec.output, name)
  tmpdir = tempfile.mkdtemp(prefix="toolkit-shards-")  # removed here: runners need not call teardown
  local = fileio.local_staging_path(dest, tmpdir)
  try:
    count = adapters.get(spec.file_format).write_file(local, payloads)
    size = os.path.getsize(local)
    digest = sha256_file(local)
    fileio.publish(local, dest)
  finally:
    if os.path.exists(local):
      os.remove(local)
    shutil.rmtree(tmpdir, ignore_errors=True)
  return ShardInfo(name, count, size, digest)


class _WriteShardFn(beam.DoFn):
  """Writes one shard locally, then publishes it to the output in one step."""

  def __init__(self, spec: OutputSpec):
    self._spec = spec

  def setup(self):
    self._records = Metrics.counter(_NAMESPACE, "records_written")
    self._bytes = Metrics.counter(_NAMESPACE, "bytes_written")
    self._shards = Metrics.counter(_NAMESPACE, "shards_written")

  def process(self, element, plans):
    (split, index), groups = element
    plan = plans[split]
    items = [item for group in groups for item in group]
    payloads = [p for _, p in sorted(items, key=lambda kv: kv[0])]
    info = write_shard(self._spec, split, index, plan.num_shards, payloads)
    size = info.num_bytes
    self._records.inc(len(payloads))
    self._bytes.inc(size)
    self._shards.inc()
    yield split, index, info


class _FinalizeFn(beam.DoFn):
  """Checks that every shard is there, then writes errors/, metadata and the manifest."""

  def __init__(self, spec: OutputSpec, launcher_rejects: tuple[Reject, ...]):
    self._spec = spec
    self._launcher_rejects = launcher_rejects

  def process(self, _, shards, plans, rejects, summary: InputSummary | None, features: Features | None):
    spec = self._spec if features is None else dataclasses.replace(self._spec, features=features)
    by_split: dict[str, dict[int, ShardInfo]] = collections.defaultdict(dict)
    for split, index, info in shards:
      by_split[split][index] = info
    splits: dict[str, SplitInfo] = {}
    for split in sorted(set(spec.splits) | set(plans)):
      plan = plans.get(split, ShardPlan(0, 0, 0, ()))
      got = by_split.get(split, {})
      if sorted(got) != list(range(plan.num_shards)):
        raise RuntimeError(
            f"split {split!r}: expected shards 0..{plan.num_shards - 1}, got {sorted(got)}"
        )
      split_info = SplitInfo(tuple(got[i] for i in range(plan.num_shards)))
      if split_info.num_records != plan.num_records:
        raise RuntimeError(
            f"split {split!r}: shards hold {split_info.num_records} records, expected {plan.num_records}"
        )
      if split_info.num_records:
        splits[split] = split_info
    manifest = commit_records(spec, splits, set(spec.splits) | set(plans), [*rejects, *self._launcher_rejects],
                              summary, sum(plan.num_inputs for plan in plans.values()))
    yield manifest.to_json()


def commit_records(spec: OutputSpec, splits: Mapping[str, SplitInfo], all_splits, rejects: Sequence[Reject],
                   summary: InputSummary | None, used: int, warnings: Sequence[str] = ()) -> Manifest:
  """The end of a record output: the input accounting, then the manifest committed (`commit_output`).

  Args:
    spec: the output.
    splits: the splits that hold records, with their shards.
    all_splits: every split planned or expected; those without records get the manifest's warning.
    rejects: every reject (the launcher's included).
    summary: the input units found (None: not checked).
    used: the input units the records were made from (appending: adjusted for what was carried and skipped).
    warnings: more warnings for the manifest (an append's changed and vanished inputs).

  Returns:
    The committed manifest.

  Raises:
    RuntimeError: records + rejects do not account for every input unit found.
  """
  # TFDS cannot open a split without records (a split of one empty shard file is refused by
  # both as_data_source and as_dataset), so neither the manifest nor the metadata lists one.
  empty = sorted(set(all_splits) - set(splits))
  empty_warning = (f"empty splits left out: {', '.join(empty)} (no records)",) if empty else ()
  rejects = sorted(rejects)
  rejected_units = sum(r.units for r in rejects)
  if summary is not None and used + rejected_units != summary.num_inputs:
    raise RuntimeError(
        f"{summary.num_inputs} input units but {used} in records + {rejected_units} rejected: "
        "an input was lost or counted twice"
    )
  by_reason = collections.Counter(r.reason.split(":")[0] for r in rejects)
  manifest = Manifest(
      name=spec.name,
      file_format=spec.file_format,
      features=spec.features,
      splits=dict(splits),
      rejected=Rejected(len(rejects), dict(by_reason), spec.relative(REJECTED_FILENAME)),
      source=spec.source,
      warnings=(tuple(spec.warnings) + tuple(sorted(summary.warnings if summary else ())) + tuple(warnings)
                + empty_warning),
      kind=spec.kind,
  )
  commit_output(spec, manifest, rejects)
  return manifest


def commit_output(spec: OutputSpec, manifest: Manifest, rejects: Sequence[Reject]) -> None:
  """The end of every run: errors/rejected.jsonl, the switch to `manifest`, the TFDS view, clean-up.

  The one commit path of all converters (formats.outputs.commit, docs/manifest.md).

  Args:
    spec: the output (its folder, generation, expected manifest version, description).
    manifest: the manifest to switch to; its data files are already published.
    rejects: the rejects, written to errors/rejected.jsonl first.

  Raises:
    commit.CommitConflict: another run switched the manifest first (this run loses the race).
  """
  out = spec.output
  commit.fault_point("finalize:start")
  fs.write_bytes(
      fs.join(out, manifest.rejected.path),
      b"".join(json.dumps(r.to_json(), sort_keys=True).encode() + b"\n" for r in rejects),
  )
  commit.fault_point("finalize:rejects_written")
  replaced = commit.commit(out, spec.generation, manifest, spec.expected)  # the switch
  logging.info("committed %s (generation %s)", fs.join(out, MANIFEST_FILENAME), spec.generation)
  commit.sync_tfds_metadata(out, spec.description)  # a no-op for file outputs: they have no TFDS view
  commit.cleanup(out, replaced=replaced, log=logging.info, keep_replaced_seconds=spec.keep_replaced_seconds)


class _CommitFilesFn(beam.DoFn):
  """The published files of a file converter → the manifest, committed like any output."""

  def __init__(self, spec: OutputSpec, graph):
    self._spec = spec
    self._graph = graph

  def process(self, _, infos):
    spec = self._spec
    manifest = Manifest(
        name=spec.name, file_format=infos[0].kind if infos else spec.file_format, features=spec.features,
        splits={}, source=spec.source, files=tuple(sorted(infos, key=lambda f: f.path)),
        rejected=Rejected(0, {}, spec.relative(REJECTED_FILENAME)), graph=self._graph, kind=spec.kind)
    commit_output(spec, manifest, ())
    yield manifest.to_json()


class CommitFiles(beam.PTransform):
  """PCollection[FileInfo] (files published in the run's generation) → the committed manifest.

  For converters whose output is whole files (a `.graphbin`) rather than record shards.
  """

  def __init__(self, spec: OutputSpec, graph=None):
    super().__init__()
    self._spec = spec
    self._graph = graph

  def expand(self, infos):
    return (infos.pipeline
            | "CommitTrigger" >> beam.Create([None])
            | "CommitManifest" >> beam.ParDo(_CommitFilesFn(self._spec, self._graph), infos=beam.pvalue.AsList(infos)))


class WriteOutput(beam.PTransform):
  """records (PCollection[Record]) + rejects (PCollection[Reject]) → a complete output.

      ({"records": records, "rejects": rejects} | WriteOutput(spec, summary=summary))

  `summary` is an optional PCollection holding one `InputSummary`;
  `launcher_rejects` are inputs the launcher already turned down while planning;
  `features`, an optional PCollection holding one `Features`, replaces
  `spec.features` in the metadata when the schema is only known at run time.
  Returns a PCollection holding the manifest as a dict.
  """

  def __init__(self, spec: OutputSpec, summary=None, launcher_rejects: Sequence[Reject] = (),
               features=None):
    super().__init__()
    self._spec = spec
    self._summary = summary
    self._launcher_rejects = tuple(launcher_rejects)
    self._features = features

  def expand(self, pcolls):
    spec = self._spec
    if not spec.generation:  # not launched by pipelines.core.launch: claim a generation now, at construction
      generation, expected = commit.begin(spec.output, {"pipeline": "WriteOutput"})
      spec = dataclasses.replace(spec, generation=generation, expected=expected)
    records, rejects = pcolls["records"], pcolls["rejects"]
    batches = records | "SortKeyAndBatch" >> beam.ParDo(_KeyAndBatch(spec.seed))
    plans = (
        batches
        | "KeysAndSizes" >> beam.FlatMap(lambda batch: [(t[0], (t[1], len(t[2]), t[3])) for t in batch])
        | "PlanShards" >> beam.CombinePerKey(_CollectKeys(spec.num_shards, spec.target_shard_bytes))
    )
    shards = (
        batches
        | "AssignShard" >> beam.FlatMap(_assign_shards, plans=beam.pvalue.AsDict(plans))
        | "GroupByShard" >> beam.GroupByKey()
        | "WriteShard" >> beam.ParDo(_WriteShardFn(spec), plans=beam.pvalue.AsDict(plans))
    )
    return (
        records.pipeline
        | "FinalizeTrigger" >> beam.Create([None])
        | "Finalize" >> beam.ParDo(
            _FinalizeFn(spec, self._launcher_rejects),
            shards=beam.pvalue.AsList(shards),
            plans=beam.pvalue.AsDict(plans),
            rejects=beam.pvalue.AsList(rejects),
            summary=beam.pvalue.AsSingleton(self._summary) if self._summary is not None else None,
            features=beam.pvalue.AsSingleton(self._features) if self._features is not None else None,
        )
    )
