"""Shards as work units: a plan of which inputs go to which shard, then one step per shard.

The record converters' path at scale (docs/dataflow.md):

    list inputs → plan shards → Reshuffle → convert + write + checksum one shard per task → Finalize

1. **The plan.** Every input unit has a `PlanUnit`: its split, the key of the
   record it will make (unique in the split), what the converter needs to
   convert it, and an estimate of its output bytes. Its sort key is
   `sort_key(seed, split, key)`, a 16-byte hash, so the order is a pure function of the seed and the keys:
   the same on every runner and for any worker count. Per split, the units
   sorted by sort key are cut into shards whose unit counts differ by at most
   one. A shard's record count may end lower by the units it rejected; the
   manifest records the exact counts.

   - `plan_in_memory`: the launcher's plan, for listings it can hold (the
     launcher lists the input; `PlannedShards` ships the plan compressed).
   - `PlanOnWorkers`: the distributed plan, for listings too big for one
     process. Its memory is bounded without sampling error: a histogram of the
     sort keys' top 16 bits (64 Ki counts per split) locates each shard
     boundary's bucket and its rank there; only the keys of those buckets are
     then gathered (about n / 65 536 per boundary) to find the exact boundary
     key. The result is the same plan `plan_in_memory` makes (by test).

2. **One step per shard.** `ConvertShards` converts every unit of a shard with
   the converter's `UnitConverter`, sorts the records by sort key, writes the
   shard locally, hashes it and publishes it with one atomic upload. Nothing
   heavier than a plan or a manifest entry crosses a stage: no payload is
   shuffled.

3. **Finalize** (`FinalizeShards`) checks that every planned shard is there and
   that every planned unit became records or rejects, then commits like every
   other output (`sink.commit_output`).

Shard count: `--num_shards` when given; otherwise enough shards for
`target_shard_bytes` (`--shard_size_mb`, 128 MiB) of estimated output, and at least two per worker
the job may use (`min_shards`), so that the work balances, unless that makes
shards smaller than `MIN_SHARD_BYTES` (4 MB); never more shards than units.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Iterator, Mapping, Sequence
import dataclasses
import hashlib
import itertools
import logging
import math
import pickle
from typing import Any, NamedTuple
import zlib

import apache_beam as beam
from apache_beam.metrics import Metrics
import numpy as np

from formats.outputs import commit
from formats.storage import files as fs
from formats.features import Features
from formats.manifest import ShardInfo, SplitInfo
from formats.outputs.output import is_output
from pipelines.core import inputs, reuse
from pipelines.core.progress import Progress
from pipelines.core.records import METRICS_NAMESPACE, Event, InputSummary, Record, Reject
from pipelines.core.sink import OutputSpec, commit_records, write_shard

MIN_SHARD_BYTES = 4 << 20  # automatic shard counts stop at 2 per worker or at shards this small
BUCKET_BITS = 16
NUM_BUCKETS = 1 << BUCKET_BITS
_log = logging.getLogger(__name__)


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


class PlanUnit(NamedTuple):
  """One unit of input in a shard plan.

  `key` is the key of the record the unit makes (`Record.key`, unique within
  the split): the unit's place in the seeded order. `unit` is what the
  converter's `UnitConverter.convert` receives. `nbytes` estimates the unit's
  output bytes (for the automatic shard count).
  """

  split: str
  key: str
  unit: Any
  nbytes: int = 0


class ShardTask(NamedTuple):
  """One shard to convert and write: its place, and its units in sort-key order (compressed).

  `units_blob` is zlib(pickle(tuple of units)): a plan of a million file
  paths ships as a few MB, and only the worker that converts the shard opens it.
  `keys_blob` holds the units' plan keys the same way (what the shard's record
  lists, so that `--mode=append` knows which inputs an output holds). A task
  with `carry` converts nothing: it copies a shard of the current output under
  its new name (`--mode=append`; pipelines/core/reuse.py).
  """

  split: str
  index: int
  num_shards: int
  num_units: int
  nbytes: int
  units_blob: bytes
  keys_blob: bytes = b""
  carry: Any = None  # reuse.Reusable: the current output's shard this task copies

  def units(self) -> tuple:
    """The converter's units of this shard, in sort-key order."""
    return pickle.loads(zlib.decompress(self.units_blob)) if self.units_blob else ()

  def keys(self) -> tuple[str, ...]:
    """The units' plan keys, in the same order ("" for each when the plan had none)."""
    return pickle.loads(zlib.decompress(self.keys_blob)) if self.keys_blob else ("",) * self.num_units


def _pack(values: Sequence[Any]) -> bytes:
  return zlib.compress(pickle.dumps(tuple(values), protocol=pickle.HIGHEST_PROTOCOL), 6)


def make_task(split: str, index: int, num_shards: int, units: Sequence[Any], nbytes: int,
              keys: Sequence[str] = ()) -> ShardTask:
  """A `ShardTask` holding `units` (already in sort-key order).

  Args:
    split: the split.
    index: the shard's index in [0, num_shards).
    num_shards: the split's shard count.
    units: the converter's units, in sort-key order.
    nbytes: their estimated output bytes.
    keys: the units' plan keys (`PlanUnit.key`), in the same order.

  Returns:
    The task, its units compressed.
  """
  return ShardTask(split, index, num_shards, len(units), nbytes, _pack(units), _pack(keys) if keys else b"")


def shard_count(num_units: int, nbytes: int, num_shards: int, target_shard_bytes: int, min_shards: int = 1) -> int:
  """How many shards a split of `num_units` units (about `nbytes` of output) gets.

  Args:
    num_units: the split's planned units.
    nbytes: their estimated output bytes.
    num_shards: `--num_shards` (0: automatic).
    target_shard_bytes: the shard size aimed at when automatic.
    min_shards: the fewest shards when automatic (2 per worker: the work balances), unless
      that would make them smaller than `MIN_SHARD_BYTES`.

  Returns:
    The count: never more than the units, 0 for none.
  """
  if num_units <= 0:
    return 0
  # The per-worker minimum never makes shards smaller than MIN_SHARD_BYTES: a 50-record
  # validation split is not cut into 200 one-record shards for 100 workers.
  balanced = min(min_shards, math.ceil(nbytes / MIN_SHARD_BYTES))
  shards = num_shards or max(balanced, math.ceil(nbytes / target_shard_bytes), 1)
  return min(shards, num_units)


def boundary_ranks(num_units: int, num_shards: int) -> list[int]:
  """The rank (in sort order) of each shard's first unit, for shards 1..n-1.

  Shard i holds ranks [i*n//s, (i+1)*n//s): unit counts differ by at most one.
  """
  return [i * num_units // num_shards for i in range(1, num_shards)]


def plan_in_memory(units: Iterable[PlanUnit], seed: int, num_shards: int, target_shard_bytes: int,
                   min_shards: int = 1) -> list[ShardTask]:
  """The shard plan of units the launcher holds: per split, sort by sort key and cut.

  Args:
    units: every unit of every split.
    seed: the run's `--seed`.
    num_shards: `--num_shards` (0: automatic).
    target_shard_bytes: the shard size aimed at when automatic.
    min_shards: the fewest shards per split when automatic.

  Returns:
    The tasks, by split and shard index.

  Raises:
    ValueError: two units of one split share a key.
  """
  by_split: dict[str, list[tuple[bytes, PlanUnit]]] = collections.defaultdict(list)
  for u in units:
    by_split[u.split].append((sort_key(seed, u.split, u.key), u))
  tasks = []
  for split in sorted(by_split):
    keyed = sorted(by_split[split], key=lambda ku: ku[0])
    _check_unique(split, keyed)
    n = len(keyed)
    shards = shard_count(n, sum(u.nbytes for _, u in keyed), num_shards, target_shard_bytes, min_shards)
    cuts = [0, *boundary_ranks(n, shards), n]
    for i in range(shards):
      part = keyed[cuts[i]:cuts[i + 1]]
      tasks.append(make_task(split, i, shards, [u.unit for _, u in part], sum(u.nbytes for _, u in part),
                             [u.key for _, u in part]))
  return tasks


def _check_unique(split: str, keyed: Sequence[tuple[bytes, PlanUnit]]) -> None:
  for (a, ua), (b, ub) in zip(keyed, keyed[1:]):
    if a == b:
      raise ValueError(f"split {split!r}: two inputs have the same record key {ua.key!r}")


# ---------------------------------------------------------------- the distributed plan, in bounded memory

def bucket_of(key: bytes) -> int:
  """The histogram bucket of a sort key: its top `BUCKET_BITS` bits."""
  return int.from_bytes(key[:2], "big")


@dataclasses.dataclass(frozen=True)
class SplitLayout:
  """A split's shard count, and where its boundaries lie: {bucket: [(boundary index, rank in bucket)]}."""

  num_units: int
  nbytes: int
  num_shards: int
  located: Mapping[int, tuple[tuple[int, int], ...]]


def layout_from_histogram(counts: np.ndarray, nbytes: int, num_shards: int, target_shard_bytes: int,
                          min_shards: int = 1) -> SplitLayout:
  """The shard count and each boundary's (bucket, rank within the bucket), from a split's histogram.

  Args:
    counts: units per bucket (`NUM_BUCKETS` int64).
    nbytes: the split's estimated output bytes.
    num_shards: `--num_shards` (0: automatic).
    target_shard_bytes: the shard size aimed at when automatic.
    min_shards: the fewest shards when automatic.

  Returns:
    The `SplitLayout`.
  """
  n = int(counts.sum())
  shards = shard_count(n, nbytes, num_shards, target_shard_bytes, min_shards)
  ends = np.cumsum(counts)  # ends[b]: units in buckets 0..b
  located: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
  for i, rank in enumerate(boundary_ranks(n, shards)):
    b = int(np.searchsorted(ends, rank, side="right"))  # the bucket holding rank
    located[b].append((i, rank - int(ends[b] - counts[b])))
  return SplitLayout(n, nbytes, shards, {b: tuple(v) for b, v in located.items()})


def boundary_keys(bucket_keys: Sequence[bytes], wanted: Sequence[tuple[int, int]]) -> list[tuple[int, bytes]]:
  """(boundary index, key) for each wanted (boundary index, rank within the bucket)."""
  keys = sorted(bucket_keys)
  return [(i, keys[r]) for i, r in wanted]


def shard_of(boundaries: Sequence[bytes], key: bytes) -> int:
  """The shard holding sort key `key`, given the first keys of shards 1..n-1."""
  return bisect.bisect_right(boundaries, key)


class _Histogram(beam.CombineFn):
  """(bucket, nbytes) → (counts per bucket, total bytes).

  The accumulator is a dense 512 KiB count array while it adds; Beam ships one
  per bundle and key to the merge, so `compact` sends only the non-zero buckets
  (12 bytes each: a bundle of 1,000 units ships ~12 KB, not 512 KiB).
  """

  def create_accumulator(self):
    return np.zeros(NUM_BUCKETS, np.int64), 0

  def add_input(self, acc, element):
    counts, nbytes = self._dense(acc)
    counts[element[0]] += 1
    return counts, nbytes + element[1]

  def add_inputs(self, acc, elements):
    counts, nbytes = self._dense(acc)
    buckets = []
    for b, size in elements:
      buckets.append(b)
      nbytes += size
    if buckets:
      counts += np.bincount(np.asarray(buckets, np.int64), minlength=NUM_BUCKETS)
    return counts, nbytes

  def merge_accumulators(self, accs):
    counts, nbytes = np.zeros(NUM_BUCKETS, np.int64), 0
    for acc in accs:
      if len(acc) == 3:  # compacted: (buckets, counts, bytes)
        np.add.at(counts, acc[0], acc[1])
        nbytes += acc[2]
      else:
        counts += acc[0]
        nbytes += acc[1]
    return counts, nbytes

  def compact(self, acc):
    if len(acc) == 3:
      return acc
    (nonzero,) = np.nonzero(acc[0])
    return nonzero.astype(np.int32), acc[0][nonzero], acc[1]

  def extract_output(self, acc):
    return self._dense(acc)

  @staticmethod
  def _dense(acc):
    if len(acc) == 3:
      counts = np.zeros(NUM_BUCKETS, np.int64)
      np.add.at(counts, acc[0], acc[1])
      return counts, acc[2]
    return acc


def _keyed(u: PlanUnit, seed: int):
  return u.split, sort_key(seed, u.split, u.key), u.unit, u.nbytes, u.key


def _in_boundary_bucket(k, layouts):
  split, key, _, _, _ = k
  layout = layouts.get(split)
  if layout is not None and bucket_of(key) in layout.located:
    yield (split, bucket_of(key)), key


def _boundaries_of_bucket(element, layouts):
  (split, bucket), keys = element
  for i, key in boundary_keys(list(keys), layouts[split].located[bucket]):
    yield split, (i, key)


def _task_of(element, layouts):
  (split, index), members = element
  members = sorted(members, key=lambda m: m[0])
  for (a, *_), (b, *_) in zip(members, members[1:]):
    if a == b:
      raise ValueError(f"split {split!r}: two inputs have the same sort key")
  return make_task(split, index, layouts[split].num_shards, [m[1] for m in members], sum(m[2] for m in members),
                   [m[3] for m in members])


class PlanOnWorkers(beam.PTransform):
  """PCollection[PlanUnit] → (tasks: PCollection[ShardTask], layouts: PCollection[(split, SplitLayout)]).

  The same plan as `plan_in_memory`, made on the workers in bounded memory
  (see the module's docstring). Only plan data (sort keys and units) is shuffled.
  """

  def __init__(self, seed: int, num_shards: int, target_shard_bytes: int, min_shards: int = 1):
    super().__init__()
    self._seed, self._num_shards, self._target, self._min = seed, num_shards, target_shard_bytes, min_shards

  def expand(self, units):
    keyed = units | "SortKeys" >> beam.Map(_keyed, self._seed)
    num_shards, target, min_shards = self._num_shards, self._target, self._min
    layouts = (
        keyed
        | "Buckets" >> beam.Map(lambda k: (k[0], (bucket_of(k[1]), k[3])))
        | "Histogram" >> beam.CombinePerKey(_Histogram())
        | "Layout" >> beam.MapTuple(lambda split, acc: (split, layout_from_histogram(
            acc[0], acc[1], num_shards, target, min_shards)))
    )
    by_split = beam.pvalue.AsDict(layouts)
    boundaries = (
        keyed
        | "BoundaryBuckets" >> beam.FlatMap(_in_boundary_bucket, layouts=by_split)
        | "GroupBucket" >> beam.GroupByKey()
        | "BoundaryKeys" >> beam.FlatMap(_boundaries_of_bucket, layouts=by_split)
        | "GroupSplit" >> beam.GroupByKey()
        | "Boundaries" >> beam.MapTuple(lambda split, ik: (split, tuple(k for _, k in sorted(ik))))
    )
    tasks = (
        keyed
        | "AssignShard" >> beam.Map(
            lambda k, b: ((k[0], shard_of(b.get(k[0], ()), k[1])), (k[1], k[2], k[3], k[4])),
            b=beam.pvalue.AsDict(boundaries))
        | "GroupShard" >> beam.GroupByKey()
        | "Task" >> beam.Map(_task_of, layouts=by_split)
    )
    return tasks, layouts


# ---------------------------------------------------------------- converting and writing one shard

class ShardResult(NamedTuple):
  """What one shard's step reports to Finalize: the shard written, and its accounting."""

  split: str
  index: int
  info: ShardInfo
  num_units: int  # units planned into the shard
  inputs_used: int  # input units (Record.num_inputs) its records were made from
  inputs_rejected: int  # input units (Reject.units) it rejected
  carried: bool = False  # a shard of the output appended to, copied under its new name


class _ConvertShardFn(beam.DoFn):
  """ShardTask → the shard written and published (main), its rejects and events (tagged).

  A shard whose plan digest names a shard an earlier run published (`reusable`: plan digest →
  [(generation, shard file)], newest first, found at launch) is copied from the first whose record
  and bytes check out (pipelines/core/reuse.py); any other is converted. Either way the shard's record
  is written beside it for later runs.
  """

  def __init__(self, converter, spec: OutputSpec, namespace: str, totals: tuple[int, int], processes: int,
               identity: str, reusable: Mapping[str, Sequence[tuple[str, str]]]):
    self._converter = converter
    self._spec = spec
    self._namespace = namespace
    self._totals = totals
    self._processes = processes
    self._identity = identity
    self._reusable = dict(reusable)

  def setup(self):
    self._converter.setup()
    self._progress = Progress(self._namespace, "convert_shards", total_units=self._totals[0],
                              total_bytes=self._totals[1], processes=self._processes, run=self._spec.generation)
    self._shards = Metrics.counter(METRICS_NAMESPACE, "shards_written")
    self._records_out = Metrics.counter(METRICS_NAMESPACE, "records_written")
    self._bytes_out = Metrics.counter(METRICS_NAMESPACE, "bytes_written")
    self._rejects_out = Metrics.counter(self._namespace, "rejects_made")
    self._reused = Metrics.counter(METRICS_NAMESPACE, "shards_reused")

  def process(self, task: ShardTask, **side_inputs):
    plan_totals = side_inputs.pop(_TOTALS, None)
    if plan_totals is not None and not self._progress.has_totals():  # planned on the workers: known now
      self._progress.set_totals(*plan_totals)
    if task.carry is not None:
      yield from self._carried_shard(task)
      return
    digest, unit_inputs = self._plan_digest(task, side_inputs)
    for where in self._reusable.get(digest, ()) if digest else ():  # newest first
      record = reuse.read_record(self._spec.output, *where)  # read again: only its place crossed the job graph
      fits = record is not None and record.plan == digest and (
          record.split, record.index, record.num_shards, tuple(k for k, _, _ in record.inputs)) == (
              task.split, task.index, task.num_shards, task.keys())  # a record is untrusted: it must be this task's
      info = reuse.adopt(self._spec.output, self._spec.generation, reuse.Reusable(where[0], record)) if fits else None
      if info is not None:
        yield from self._reused_shard(task, record, info)
        return
    # Records are written as they are made when they come in sort-key order (each unit makes the
    # record its plan key names, and units come in that order): a worker then holds one record,
    # not the shard. A converter whose records come out of order is buffered and sorted instead.
    try:
      state = _ShardState()
      info = write_shard(self._spec, task.split, task.index, task.num_shards,
                         self._payloads(task, side_inputs, state, stream=True))
    except _OutOfOrder:  # nothing was published; convert again, buffered
      counted, state = state.units_counted, _ShardState()
      info = write_shard(self._spec, task.split, task.index, task.num_shards,
                         self._payloads(task, side_inputs, state, stream=False, counted=counted))
    if digest:
      reuse.write_record(self._spec.output, self._spec.generation, reuse.ShardRecord(
          digest, task.split, task.index, task.num_shards, dataclasses.replace(info, path=info.path.rsplit("/", 1)[-1]),
          task.num_units, state.used, state.rejected, tuple(tuple(r) for r in state.rejects),
          tuple(e.name for e in state.events), unit_inputs, self._spec.fingerprint))
    self._progress.add(bytes_out=info.num_bytes)
    yield from self._report(ShardResult(task.split, task.index, info, task.num_units, state.used, state.rejected),
                            state.rejects, state.events)

  def _report(self, result: ShardResult, rejects: Sequence[Reject], events: Sequence[Event]):
    """A published shard's outputs: its rejects and events (tagged), then its result; the counters and the
    fault harness's hook after each shard this process published (`shards:published:<n>`, from 1)."""
    commit.fault_point(f"shards:published:{next(_PUBLISHED_HERE)}")
    self._shards.inc()
    self._records_out.inc(result.info.num_records)
    self._bytes_out.inc(result.info.num_bytes)
    self._rejects_out.inc(len(rejects))
    for r in rejects:
      yield beam.pvalue.TaggedOutput("rejects", r)
    for e in events:
      yield beam.pvalue.TaggedOutput("events", e)
    yield result

  def _plan_digest(self, task: ShardTask, side_inputs) -> tuple[str, tuple[tuple[str, str, int], ...]]:
    """(the task's plan digest, (key, unit_version, input files) per unit); ("", ()) when the converter
    does not name its units' inputs: such a shard is never reused."""
    named = [self._converter.input_paths(unit, **side_inputs) for unit in task.units()]
    if any(n is None for n in named):
      return "", ()
    versions = reuse.input_versions([p for paths in named for p in paths])
    unit_inputs, at = [], 0
    for key, paths in zip(task.keys(), named):
      unit_inputs.append((key, reuse.unit_version(versions[at:at + len(paths)]), len(paths)))
      at += len(paths)
    side = repr(sorted((k, sorted(v.items()) if isinstance(v, Mapping) else v) for k, v in side_inputs.items()))
    return reuse.plan_digest(f"{self._identity}\0{side}", task.split, task.index, task.num_shards,
                             task.units_blob, versions), tuple(unit_inputs)

  def _carried_shard(self, task: ShardTask):
    """A shard of the output appended to, copied under its place in the new output."""
    old = reuse.read_record(self._spec.output, task.carry.generation, task.carry.record.shard.path)
    name = self._spec.shard_name(task.split, task.index, task.num_shards).filename
    same = old is not None and dataclasses.replace(old, inputs=()) == task.carry.record
    info = reuse.adopt(self._spec.output, self._spec.generation, task.carry, dest_name=name) if same else None
    if info is None:
      raise RuntimeError(
          f"{self._spec.output}: shard {task.carry.generation}/{task.carry.record.shard.path} of the output "
          "appended to does not match its manifest entry (changed or damaged since it was written); nothing "
          "was committed: run --mode=rebuild")
    record = dataclasses.replace(old, plan=reuse.carried_plan(old.plan, task.index, task.num_shards),
                                 index=task.index, num_shards=task.num_shards,
                                 shard=dataclasses.replace(old.shard, path=name))
    yield from self._reused_shard(task, record, info, carried=True)

  def _reused_shard(self, task: ShardTask, record: reuse.ShardRecord, info: ShardInfo, carried: bool = False):
    """What a reused shard reports: its earlier accounting, as if it had been converted now."""
    reuse.write_record(self._spec.output, self._spec.generation, record)
    if carried:  # not part of the plan's totals (those count the units to convert)
      self._progress.add(bytes_out=info.num_bytes)
    else:
      self._progress.add(units=task.num_units, records=info.num_records, bytes_out=info.num_bytes)
      self._reused.inc()
    yield from self._report(
        ShardResult(task.split, task.index, info, task.num_units, record.inputs_used, record.inputs_rejected, carried),
        [Reject(*r) for r in record.rejects], [Event(name) for name in record.events])

  def _payloads(self, task: ShardTask, side_inputs, state: _ShardState, stream: bool,
                counted: int = 0) -> Iterator[bytes]:
    """The shard's payloads in sort-key order, converting its units; accounting into `state`.

    The first `counted` units were already counted in the progress figures (by a streamed
    attempt that stopped at an out-of-order record): converted again, they are not counted twice.

    Raises:
      _OutOfOrder: (stream) a record's sort key is below the previous one's.
      RuntimeError: a unit made nothing, a record of another split, or two records share a key.
    """
    spec, split = self._spec, task.split
    buffered: list[tuple[bytes, bytes]] = []
    last = None
    for unit in task.units():
      made = state.records + len(state.rejects)
      records_before = state.records
      for out in self._converter.convert(unit, **side_inputs):
        if isinstance(out, Reject):
          state.rejected += out.units
          state.rejects.append(out)
        elif isinstance(out, Event):
          state.events.append(out)
        elif isinstance(out, Record):
          if out.split != split:
            raise RuntimeError(f"a unit planned into split {split!r} made a record of split {out.split!r}")
          state.used += out.num_inputs
          state.records += 1
          key = sort_key(spec.seed, split, out.key)
          if not stream:
            buffered.append((key, out.payload))
            continue
          if last is not None and key <= last:
            if key == last:
              raise RuntimeError(f"split {split!r}: two records of shard {task.index} have the same key")
            raise _OutOfOrder()
          last = key
          yield out.payload
        else:
          raise TypeError(f"a UnitConverter yielded {type(out).__name__}, not a Record, Reject or Event")
      if state.records + len(state.rejects) == made:  # neither a record nor a reject: it would be lost silently
        raise RuntimeError(f"split {split!r}: a unit of shard {task.index} made no record and no reject")
      if state.units_counted >= counted:
        self._progress.add(units=1, records=state.records - records_before)
      state.units_counted += 1
    buffered.sort(key=lambda kv: kv[0])
    for (a, _), (b, _) in zip(buffered, buffered[1:]):
      if a == b:
        raise RuntimeError(f"split {split!r}: two records of shard {task.index} have the same key")
    for _, payload in buffered:
      yield payload


_PUBLISHED_HERE = itertools.count(1)  # shards published by this process (the fault harness kills after the n-th)


class _OutOfOrder(Exception):
  """A streamed shard's record came out of sort-key order (the shard is redone, buffered)."""


@dataclasses.dataclass
class _ShardState:
  """One shard step's accounting: records made, input units used and rejected, rejects, events."""

  records: int = 0
  used: int = 0
  rejected: int = 0
  rejects: list = dataclasses.field(default_factory=list)
  events: list = dataclasses.field(default_factory=list)
  units_counted: int = 0  # units converted to the end, so far (each counted once in the progress)


_TOTALS = "_toolkit_plan_totals"  # the side input carrying a plan's totals when it was made on the workers


class ConvertShards(beam.PTransform):
  """PCollection[ShardTask] → (results: ShardResult, rejects: Reject, events: Event).

      done = tasks | ConvertShards(MyUnitConverter(...), spec, namespace="pipelines.my_folder")

  Each task is converted, written, hashed and published by one worker in one
  step; the tasks are spread over the workers first (a Reshuffle).
  `side_inputs` reach `UnitConverter.convert` by name. `totals` (units, bytes
  planned: a tuple, or a PCollection of one tuple when the plan was made on the
  workers) feed the progress log's ETA; `processes` is how many worker processes share
  them (`CommonConfig.processes`).
  """

  def __init__(self, converter, spec: OutputSpec, namespace: str, totals=(0, 0), processes: int = 1,
               **side_inputs):
    super().__init__()
    if isinstance(totals, beam.PCollection):
      side_inputs[_TOTALS] = beam.pvalue.AsSingleton(totals)
      totals = (0, 0)
    # Found here, at launch: the shards the output's other generations hold, by plan digest.
    reusable = reuse.find_reusable(spec.output, exclude=spec.generation) if spec.reuse_shards else {}
    if reusable:
      _log.info("%d shards of earlier runs found; those of the same plan are reused", len(reusable))
    # The converter's own settings (its config, class ids, options) shape the bytes too.
    settings = {**spec.reuse_settings(), "converter": hashlib.sha256(pickle.dumps(converter, protocol=4)).hexdigest()}
    self._fn = _ConvertShardFn(converter, spec, namespace, totals, processes, reuse.output_identity(settings),
                               {d: [(r.generation, r.record.shard.path) for r in rs] for d, rs in reusable.items()})
    self._side_inputs = side_inputs

  def expand(self, tasks):
    return (tasks
            | "SpreadShards" >> beam.Reshuffle()
            | "ConvertAndWrite" >> beam.ParDo(self._fn, **self._side_inputs).with_outputs(
                "rejects", "events", main="results"))


# ---------------------------------------------------------------- finalize

def check_shards(planned: Mapping[str, int], results: Iterable[ShardResult]) -> dict[str, list[ShardResult]]:
  """The results by split, in shard order, once every planned shard is there exactly once.

  Args:
    planned: {split: planned shard count}.
    results: every `ShardResult` of the run.

  Returns:
    {split: [result of shard 0, 1, ...]} for every planned split.

  Raises:
    RuntimeError: a shard is missing, extra, or reported twice.
  """
  by_split: dict[str, dict[int, ShardResult]] = collections.defaultdict(dict)
  for r in results:
    if r.index in by_split[r.split]:
      raise RuntimeError(f"split {r.split!r}: shard {r.index} reported twice")
    by_split[r.split][r.index] = r
  out = {}
  for split in sorted(set(planned) | set(by_split)):
    got = by_split.get(split, {})
    n = planned.get(split, 0)
    if sorted(got) != list(range(n)):
      raise RuntimeError(f"split {split!r}: expected shards 0..{n - 1}, got {sorted(got)}")
    out[split] = [got[i] for i in range(n)]
  return out


class _FinalizeShardsFn(beam.DoFn):
  """Every shard there, every unit accounted for → errors/, the manifest, the TFDS view."""

  def __init__(self, spec: OutputSpec, launcher_rejects: tuple[Reject, ...]):
    self._spec = spec
    self._launcher_rejects = launcher_rejects

  def process(self, _, results, planned, rejects, summary: InputSummary | None, features: Features | None,
              append: AppendSummary | None):
    spec = self._spec if features is None else dataclasses.replace(self._spec, features=features)
    by_split = check_shards(dict(planned), results)
    splits: dict[str, SplitInfo] = {}
    for split, shard_results in by_split.items():
      info = SplitInfo(tuple(r.info for r in shard_results))
      if info.num_records:
        splits[split] = info
      else:  # every unit of the split was rejected: its empty shard files are not part of the output
        fs.delete_many([fs.join(spec.output, r.info.path) for r in shard_results])
    used = sum(r.inputs_used for rs in by_split.values() for r in rs)
    append = append or AppendSummary(0)
    manifest = commit_records(spec, splits, set(spec.splits) | set(by_split), [*rejects, *self._launcher_rejects],
                              summary, used + append.adjust, append.warnings)
    yield manifest.to_json()


class FinalizeShards(beam.PTransform):
  """results (PCollection[ShardResult]) + rejects → the committed manifest (a PCollection of one dict).

  `planned` is a PCollection of (split, shard count) for every planned split;
  `summary` a PCollection of one `InputSummary` (None: not checked), `features` one of `Features` when the schema is known only at run time; `append` a PCollection of one
  `AppendSummary` when the run appends (`Planned.append`).
  """

  def __init__(self, spec: OutputSpec, planned, summary=None, launcher_rejects: Sequence[Reject] = (),
               features=None, append=None):
    super().__init__()
    self._spec, self._planned, self._summary = spec, planned, summary
    self._launcher_rejects, self._features, self._append = tuple(launcher_rejects), features, append

  def expand(self, pcolls):
    results, rejects = pcolls["results"], pcolls["rejects"]
    return (
        results.pipeline
        | "FinalizeTrigger" >> beam.Create([None])
        | "Finalize" >> beam.ParDo(
            _FinalizeShardsFn(self._spec, self._launcher_rejects),
            results=beam.pvalue.AsList(results),
            planned=beam.pvalue.AsList(self._planned),
            rejects=beam.pvalue.AsList(rejects),
            summary=beam.pvalue.AsSingleton(self._summary) if self._summary is not None else None,
            features=beam.pvalue.AsSingleton(self._features) if self._features is not None else None,
            append=beam.pvalue.AsSingleton(self._append) if self._append is not None else None,
        ))


# ---------------------------------------------------------------- planning, either way

PLAN_MODES = ("auto", "launcher", "workers")
# Files the launcher lists before `--plan=auto` hands the listing to the workers. The launcher
# holds about 0.8 KB per file while it plans (ImageNet's 1.28 M files: 1.06 GB peak, measured by
# scripts/bench_plan.py; 2 M files: about 1.6 GB).
LAUNCHER_LISTING_LIMIT = 2_000_000


class ListedFile(NamedTuple):
  """One listed input file, as `Converter.plan_unit` receives it."""

  key: Any  # the key of the folder it was listed in (`Sources.folders`)
  file: inputs.InputFile
  size: int  # bytes, as listed
  split: str  # the key's split
  rel: str  # its path relative to the input root (`Sources.root`)


def split_of_key(key) -> str:
  """The split a listing key names: the key itself, or the first item of a tuple key."""
  return key[0] if isinstance(key, tuple) else key


def _listed_file(key, f: inputs.InputFile, size: int, prefix: str) -> ListedFile:
  return ListedFile(key, f, size, split_of_key(key), f.path[len(prefix):] if f.path.startswith(prefix) else f.path)


def _prefix(root: str | None) -> str:
  return inputs.printable(root).rstrip("/") + "/" if root else ""


class ListingCounts(NamedTuple):
  """A listing's accounting: files per key, the counts of files and rejects, and undecodable names."""

  per_key: Mapping[Any, int]
  files: int
  rejects: int
  undecodable: int


class _CountListing(beam.CombineFn):
  """("file" | "reject", key, undecodable) per listed entry → `ListingCounts` (also run in-process at launch)."""

  def create_accumulator(self):
    return collections.Counter(), 0, 0

  def add_input(self, acc, event):
    per_key, rejects, undecodable = acc
    kind, key, is_undecodable = event
    if kind == "file":
      per_key[key] += 1
    else:
      rejects += 1
    return per_key, rejects, undecodable + int(is_undecodable)

  def merge_accumulators(self, accs):
    per_key, rejects, undecodable = collections.Counter(), 0, 0
    for counts, r, u in accs:
      per_key.update(counts)
      rejects, undecodable = rejects + r, undecodable + u
    return per_key, rejects, undecodable

  def extract_output(self, acc):
    per_key, rejects, undecodable = acc
    return ListingCounts(dict(per_key), sum(per_key.values()), rejects, undecodable)


def _count_in_process(events: Iterable[tuple]) -> ListingCounts:
  fn = _CountListing()
  acc = fn.create_accumulator()
  for e in events:
    acc = fn.add_input(acc, e)
  return fn.extract_output(acc)


class ListedAtLaunch(NamedTuple):
  """The launcher's listing: the files, the rejects as (key, InputFile, reason), and its accounting."""

  files: list[ListedFile]
  rejects: list
  counts: ListingCounts


def list_at_launch(folders: Sequence[tuple[Any, str]], budget: float, input_root: str | None,
                   limit: int | None) -> ListedAtLaunch | None:
  """Lists `folders` ((key, location) each) at launch, or None once more than `limit` files are found.

  Args:
    folders: the folders to list, each with the key its files carry.
    budget: seconds to retry transient listing errors.
    input_root: the input root (relative paths start below it; a link into another part of it is a reject).
    limit: the most files listed here; None for no limit.

  Returns:
    The listing, or None when it would exceed `limit` (the workers list it instead).
  """
  files, rejects = [], []
  prefix = _prefix(input_root)
  progress = Progress("toolkit", "list_at_launch")
  for key, folder in folders:
    try:  # stops as soon as the limit is passed, not after the folder
      listing = inputs.list_tree(folder, budget, input_root, None if limit is None else limit - len(files))
    except inputs.TooManyFiles:
      _log.info("more than %d files: the workers list the input and plan the shards", limit)
      return None
    files.extend(_listed_file(key, f, size, prefix) for f, size in zip(listing.files, listing.sizes, strict=True))
    rejects.extend((key, f, reason) for f, reason in listing.rejects)
    progress.add(units=len(listing.files))
  counts = _count_in_process([*(("file", f.key, f.file.undecodable) for f in files),
                              *(("reject", key, f.undecodable) for key, f, _ in rejects)])
  return ListedAtLaunch(files, rejects, counts)


class ListedOnWorkers(NamedTuple):
  """The workers' listing: PCollections of `ListedFile`s, of rejects (key, InputFile, reason), and of one
  `ListingCounts`."""

  files: beam.PCollection
  rejects: beam.PCollection
  counts: beam.PCollection


def list_on_workers(p: beam.Pipeline, folders: Sequence[tuple[Any, str]], budget: float,
                    input_root: str | None) -> ListedOnWorkers:
  """Lists `folders` ((key, location) each) on the workers (`inputs.ListFiles`).

  Args:
    p: the pipeline.
    folders: the folders to list, each with the key its files carry.
    budget: seconds to retry transient listing errors.
    input_root: the input root, as for `list_at_launch`.

  Returns:
    The listing.
  """
  prefix = _prefix(input_root)
  listed = (p
            | "InputFolders" >> beam.Create([(key, inputs.InputFile.of(f)) for key, f in folders])
            | "ListFiles" >> inputs.ListFiles(budget, input_root=input_root, with_sizes=True))
  files = listed.files | "ListedFiles" >> beam.Map(lambda t, prefix: _listed_file(*t, prefix), prefix)
  counts = (
      (files | "FileEvents" >> beam.Map(lambda f: ("file", f.key, f.file.undecodable)),
       listed.rejects | "RejectEvents" >> beam.MapTuple(lambda key, f, _: ("reject", key, f.undecodable)))
      | "ListingEvents" >> beam.Flatten()
      | "CountListing" >> beam.CombineGlobally(_CountListing()))
  return ListedOnWorkers(files, listed.rejects, counts)


class AppendSummary(NamedTuple):
  """What `--mode=append` adds to Finalize's accounting.

  `adjust` is the listed input units the output already held (skipped: not converted again)
  minus the input units its carried shards account for; `warnings` name the inputs that
  changed or vanished since they were converted.
  """

  adjust: int
  warnings: tuple[str, ...] = ()


def _listed(keys: Sequence[str], limit: int = 5) -> str:
  shown = ", ".join(sorted(keys)[:limit])
  return shown + (", ..." if len(keys) > limit else "")


def append_warnings(changed: Sequence[str], vanished: Sequence[str]) -> tuple[str, ...]:
  """The manifest's warnings for inputs that changed or vanished since an appended-to output converted them."""
  out = []
  if changed:
    out.append(f"{len(changed)} inputs changed since they were converted; the output keeps them as converted "
               f"(--mode=rebuild converts them again): {_listed(changed)}")
  if vanished:
    out.append(f"{len(vanished)} inputs vanished since they were converted; the output keeps them as converted "
               f"(--mode=rebuild leaves them out): {_listed(vanished)}")
  return tuple(out)


def _classify(unit: PlanUnit, held: str | None, converter) -> tuple[str, int]:
  """('new' | 'same' | 'changed', the input units the summary counts for it) for a listed unit against
  what the output holds (`held`: its recorded version)."""
  if held is None:
    return "new", 0
  paths = converter.input_paths(unit.unit)
  if paths is None:
    raise RuntimeError(f"{type(converter).__name__} names no input paths: it cannot append")
  same = reuse.unit_version(reuse.input_versions(paths)) == held
  return ("same" if same else "changed"), converter.listed_units(unit.unit)


class _ClassifyFn(beam.DoFn):
  """((split, key), {"unit": [PlanUnit], "held": [unit_version]}) → new units (main), skipped counts, names."""

  def __init__(self, converter):
    self._converter = converter

  def process(self, element):
    (split, key), groups = element
    units, held = list(groups["unit"]), list(groups["held"])
    if not units:  # held, not listed any more
      yield beam.pvalue.TaggedOutput("vanished", f"{split}/{key}")
      return
    for u in units:
      kind, files = _classify(u, held[0] if held else None, self._converter)
      if kind == "new":
        yield u
      else:
        yield beam.pvalue.TaggedOutput("skipped", files)
        if kind == "changed":
          yield beam.pvalue.TaggedOutput("changed", f"{split}/{key}")


def _held_of_record(place: tuple[str, str], output: str):
  """((split, key), unit_version) of every unit a shard record of the output appended to lists."""
  rec = reuse.read_record(output, *place)
  if rec is None:  # read and checked at launch: changed since
    raise RuntimeError(f"{output}: the record of {place[0]}/{place[1]} changed during the append; nothing was "
                       "committed: run again")
  for key, version, _ in rec.inputs:
    yield (rec.split, key), version


def _carry_tasks(base: reuse.AppendBase, new_counts: Mapping[str, int]) -> list[ShardTask]:
  """Tasks copying every shard of `base` under its name in the output with `new_counts` more shards per split."""
  tasks = []
  for split, shards in sorted(base.shards.items()):
    total = len(shards) + new_counts.get(split, 0)
    for i, found in enumerate(shards):
      r = found.record  # shipped without its inputs list: the worker reads the record again
      tasks.append(ShardTask(split, i, total, r.num_units, r.shard.num_bytes, b"", b"",
                             dataclasses.replace(found, record=dataclasses.replace(r, inputs=()))))
  return tasks


def _offset(task: ShardTask, old: Mapping[str, int]) -> ShardTask:
  """A task of the appended part, placed after the split's shards of the output appended to."""
  n = old.get(task.split, 0)
  return task._replace(index=task.index + n, num_shards=task.num_shards + n)


class Planned(NamedTuple):
  """The plan as the pipeline holds it: the tasks, (split, shard count) per planned split, and the totals.

  With `--mode=append`, `append` is a PCollection of one `AppendSummary` for Finalize.
  """

  tasks: beam.PCollection
  planned: beam.PCollection
  totals: Any  # (units, estimated bytes): a tuple when planned at launch, a PCollection of one when on the workers
  append: beam.PCollection | None = None


def plan_shards(p: beam.Pipeline, units, spec: OutputSpec, workers: int, converter=None) -> Planned:
  """The shard plan of `units`: a list planned here, at launch; a PCollection planned on the workers.

  With `spec.mode == "append"` (and an output there), units the current output already holds are left out
  (an input that changed since is kept as converted, and named in the warnings), the
  rest are planned into new shards after each split's existing ones, and the existing
  shards are carried over under their new names (`ShardTask.carry`).

  Args:
    p: the pipeline.
    units: the `PlanUnit`s: a list (the launcher's listing) or a PCollection (the workers').
    spec: the output (seed, --num_shards, target shard size, mode).
    workers: the workers the run may use; automatic shard counts are at least 2 per worker.
    converter: the `UnitConverter` (needed to append: it names each unit's inputs).

  Returns:
    The `Planned` tasks.
  """
  min_shards = 2 * workers if workers > 1 else 1
  base = (reuse.append_base(spec.output, spec.fingerprint) if spec.mode == "append" and is_output(spec.output)
          else None)
  if base is not None and converter is None:
    raise TypeError("plan_shards(..., converter=) is needed to append")
  old = {split: len(shards) for split, shards in base.shards.items()} if base else {}
  if isinstance(units, beam.PCollection):
    append = None
    if base is not None:
      records = [(base.generation, r.record.shard.path) for rs in base.shards.values() for r in rs]
      held = (p | "AppendRecords" >> beam.Create(records)
              | "HeldInputs" >> beam.FlatMap(_held_of_record, spec.output))
      classified = (
          {"unit": units | "UnitKeys" >> beam.Map(lambda u: ((u.split, u.key), u)), "held": held}
          | "JoinHeld" >> beam.CoGroupByKey()
          | "Classify" >> beam.ParDo(_ClassifyFn(converter)).with_outputs("skipped", "changed", "vanished", main="new"))
      units = classified.new
      carried = base.carried_inputs

      def summarize(_, skipped, changed, vanished):
        return AppendSummary(sum(skipped) - carried, append_warnings(changed, vanished))

      append = (p | "AppendTrigger" >> beam.Create([None])
                | "AppendSummary" >> beam.Map(summarize, skipped=beam.pvalue.AsList(classified.skipped),
                                              changed=beam.pvalue.AsList(classified.changed),
                                              vanished=beam.pvalue.AsList(classified.vanished)))
    tasks, layouts = units | "PlanOnWorkers" >> PlanOnWorkers(
        spec.seed, spec.num_shards, spec.target_shard_bytes, min_shards)
    planned = layouts | "ShardCounts" >> beam.MapTuple(lambda split, layout: (split, layout.num_shards))
    totals = (layouts
              | "SplitTotals" >> beam.MapTuple(lambda split, layout: (layout.num_units, layout.nbytes))
              | "PlanTotals" >> beam.CombineGlobally(lambda ts: tuple(map(sum, zip(*ts))) or (0, 0)))
    if base is not None:
      new_counts = beam.pvalue.AsDict(planned)
      carry = (p | "CarryTrigger" >> beam.Create([None])
               | "CarryTasks" >> beam.FlatMap(lambda _, counts: _carry_tasks(base, counts), counts=new_counts))
      tasks = (tasks | "AfterCarried" >> beam.Map(_offset, old), carry) | "AllTasks" >> beam.Flatten()
      planned = (p | "CountTrigger" >> beam.Create([None])
                 | "AllShardCounts" >> beam.FlatMap(
                     lambda _, counts: sorted({s: old.get(s, 0) + counts.get(s, 0)
                                               for s in {*old, *counts}}.items()), counts=new_counts))
    return Planned(tasks, planned, totals, append)
  units = list(units)
  summary = None
  if base is not None:
    kept, skipped, changed, seen = [], 0, [], set()
    for u in units:
      kind, files = _classify(u, base.held.get((u.split, u.key)), converter)
      if kind == "new":
        kept.append(u)
        continue
      seen.add((u.split, u.key))
      skipped += files
      if kind == "changed":
        changed.append(f"{u.split}/{u.key}")
    vanished = [f"{s}/{k}" for s, k in base.held if (s, k) not in seen]
    summary = AppendSummary(skipped - base.carried_inputs, append_warnings(changed, vanished))
    _log.info("appending %d new inputs to %d held (%d changed, %d vanished)", len(kept), len(seen), len(changed),
              len(vanished))
    units = kept
  plan = plan_in_memory(units, spec.seed, spec.num_shards, spec.target_shard_bytes, min_shards)
  counts = collections.Counter()
  for t in plan:
    counts[t.split] = t.num_shards
  if base is not None:
    plan = [_offset(t, old) for t in plan] + _carry_tasks(base, counts)
    counts = collections.Counter({s: old.get(s, 0) + counts.get(s, 0) for s in {*old, *counts}})
  blob = sum(len(t.units_blob) for t in plan)
  _log.info("planned %d units into %d shards at launch (plan: %.1f MB compressed)", len(units), len(plan), blob / 1e6)
  return Planned(p | "ShardPlan" >> beam.Create(plan, reshuffle=False),
                 p | "ShardCounts" >> beam.Create(sorted(counts.items())),
                 (len(units), sum(u.nbytes for u in units)),
                 None if summary is None else p | "AppendSummary" >> beam.Create([summary]))
