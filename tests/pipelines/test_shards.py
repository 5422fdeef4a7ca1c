"""`pipelines.core.shards`: the shard plan (at launch and on the workers, in bounded memory),
one step per shard, and Finalize's accounting."""

from __future__ import annotations

import os
import random

import apache_beam as beam
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.testing.util import assert_that, equal_to
import numpy as np
import pytest

from formats import adapters
from formats.features import Features, Text
from formats.manifest import Manifest
from pipelines.core import shards
from pipelines.core.converter import UnitConverter
from pipelines.core.records import Event, Record, Reject
from pipelines.core.shards import sort_key
from pipelines.core.sink import OutputSpec


def _units(n_by_split: dict[str, int], seed: int = 0) -> list[shards.PlanUnit]:
  rng = random.Random(seed)
  return [shards.PlanUnit(split, f"{split}/file-{i:05d}.bin", (split, i), rng.randrange(1, 1000))
          for split, n in n_by_split.items() for i in range(n)]


def _plain_plan(units, seed, num_shards):
  """The plan by definition: per split, sort by sort key, cut at i*n//s."""
  out = {}
  for split in sorted({u.split for u in units}):
    keyed = sorted((sort_key(seed, split, u.key), u.unit) for u in units if u.split == split)
    n = len(keyed)
    s = min(num_shards, n)
    out[split] = [[u for _, u in keyed[i * n // s:(i + 1) * n // s]] for i in range(s)]
  return out


@pytest.mark.parametrize("num_shards", [1, 3, 7])
def test_plan_in_memory_is_the_sorted_order_cut_into_balanced_shards(num_shards):
  units = _units({"train": 50, "validation": 5})
  tasks = shards.plan_in_memory(units, seed=3, num_shards=num_shards, target_shard_bytes=1 << 30)
  got = {}
  for t in tasks:
    got.setdefault(t.split, []).append(list(t.units()))
    assert t.num_shards == min(num_shards, 50 if t.split == "train" else 5)
  assert got == _plain_plan(units, 3, num_shards)
  sizes = [t.num_units for t in tasks if t.split == "train"]
  assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 50


def test_automatic_shard_count_follows_bytes_and_workers_but_never_exceeds_units():
  assert shards.shard_count(100, 10 << 20, 0, 1 << 20) == 10
  assert shards.shard_count(100, 400 << 20, 0, 1 << 30, min_shards=8) == 8  # 2 per worker of 4
  assert shards.shard_count(100, 10 << 20, 0, 1 << 30, min_shards=8) == 3  # but no shard under 4 MB
  assert shards.shard_count(100, 10, 0, 1 << 20, min_shards=8) == 1
  assert shards.shard_count(3, 10 << 20, 0, 1 << 20, min_shards=8) == 3
  assert shards.shard_count(100, 10 << 20, 5, 1 << 20, min_shards=8) == 5  # --num_shards wins
  assert shards.shard_count(0, 0, 5, 1) == 0


def test_duplicate_record_keys_in_a_split_are_refused():
  units = [shards.PlanUnit("train", "a", 1), shards.PlanUnit("train", "a", 2)]
  with pytest.raises(ValueError, match="same record key 'a'"):
    shards.plan_in_memory(units, 0, 0, 1 << 20)


def _plan_by_histogram(keys: list[bytes], num_shards: int) -> list[bytes]:
  """The bounded-memory plan's boundaries, the way the workers make them."""
  counts = np.bincount([shards.bucket_of(k) for k in keys], minlength=shards.NUM_BUCKETS)
  layout = shards.layout_from_histogram(counts, 0, num_shards, 1 << 30)
  found = []
  for bucket, wanted in layout.located.items():
    found += shards.boundary_keys([k for k in keys if shards.bucket_of(k) == bucket], wanted)
  return [k for _, k in sorted(found)]


@pytest.mark.parametrize("n,num_shards", [(1000, 7), (10, 10), (5, 9), (3000, 64)])
def test_histogram_boundaries_equal_the_sorted_cut(n, num_shards):
  rng = random.Random(n)
  keys = [rng.randbytes(16) for _ in range(n)]
  s = min(n, num_shards)
  want = sorted(keys)
  assert _plan_by_histogram(keys, num_shards) == [want[i * n // s] for i in range(1, s)]


def test_histogram_boundaries_when_every_key_shares_one_bucket():
  rng = random.Random(1)
  keys = [b"\x12\x34" + rng.randbytes(14) for _ in range(500)]
  want = sorted(keys)
  assert _plan_by_histogram(keys, 4) == [want[125], want[250], want[375]]


@pytest.mark.slow  # runs a Beam pipeline
@pytest.mark.parametrize("num_shards,min_shards", [(0, 1), (4, 1), (0, 6)])
def test_plan_on_workers_equals_the_plan_at_launch(num_shards, min_shards):
  units = _units({"train": 300, "test": 40, "one": 1})
  want = sorted((t.split, t.index, t.num_shards, t.units())
                for t in shards.plan_in_memory(units, 9, num_shards, 4000, min_shards))
  with beam.Pipeline() as p:
    tasks, layouts = p | beam.Create(units) | shards.PlanOnWorkers(9, num_shards, 4000, min_shards)
    got = tasks | beam.Map(lambda t: (t.split, t.index, t.num_shards, t.units()))
    assert_that(got, equal_to(want))
  assert len({w[0] for w in want}) == 3 and max(w[2] for w in want) > 1


class _Echo(UnitConverter):
  """unit (split, i) → a record keyed like its plan unit; i % 5 == 0 rejected; i == 7 in split "bad" → nothing."""

  def convert(self, unit):
    split, i = unit
    if split == "lost" and i == 7:
      return
    if i % 5 == 0:
      yield Reject(f"{split}/{i}", "multiple of five", split)
      return
    if i % 3 == 0:
      yield Event("three")
    yield Record(split, f"{split}/file-{i:05d}.bin", f"{split}:{i}".encode())


def _spec(out):
  return OutputSpec(output=out, name="t", file_format="array_record", features=Features({"x": Text()}),
                    splits=("train",), num_shards=3, seed=2, generation="gen-x")


@pytest.mark.slow  # runs a Beam pipeline
def test_one_step_per_shard_writes_sorted_records_and_reports_rejects(tmp_path):
  out = str(tmp_path)
  units = _units({"train": 40})
  tasks = shards.plan_in_memory(units, 2, 3, 1 << 30)
  with beam.Pipeline() as p:
    done = p | beam.Create(tasks) | shards.ConvertShards(_Echo(), _spec(out), "tests.shards")
    assert_that(done.results | beam.Map(lambda r: (r.index, r.num_units, r.inputs_used)),
                equal_to([(t.index, t.num_units, sum(1 for _, i in t.units() if i % 5)) for t in tasks]),
                label="results")
    assert_that(done.rejects | beam.Map(lambda r: r.input), equal_to([f"train/{i}" for i in range(0, 40, 5)]),
                label="rejects")
    assert_that(done.events | beam.combiners.Count.Globally(), equal_to([len([i for i in range(40) if i % 5 and i % 3 == 0])]),
                label="events")
  for t in tasks:
    path = os.path.join(out, "gen-x", f"t-train.array_record-{t.index:05d}-of-00003")
    want = [f"train:{i}".encode() for _, i in t.units() if i % 5]  # units come in sort-key order
    assert list(adapters.get("array_record").read_file(path)) == want


@pytest.mark.slow  # runs a Beam pipeline
def test_a_unit_that_makes_neither_record_nor_reject_fails_the_shard(tmp_path):
  tasks = shards.plan_in_memory(_units({"lost": 10}), 2, 1, 1 << 30)
  with pytest.raises(Exception, match="made no record and no reject"):
    with beam.Pipeline() as p:
      _ = p | beam.Create(tasks) | shards.ConvertShards(_Echo(), _spec(str(tmp_path)), "tests.shards")


def test_finalize_refuses_a_missing_or_doubled_shard():
  from formats.manifest import ShardInfo
  info = ShardInfo("gen/x", 1, 10, "0" * 64)
  r = [shards.ShardResult("train", i, info, 1, 1, 0) for i in range(3)]
  assert [x.index for x in shards.check_shards({"train": 3}, r)["train"]] == [0, 1, 2]
  with pytest.raises(RuntimeError, match=r"expected shards 0..2, got \[0, 2\]"):
    shards.check_shards({"train": 3}, [r[0], r[2]])
  with pytest.raises(RuntimeError, match="shard 1 reported twice"):
    shards.check_shards({"train": 3}, [*r, r[1]])


class _Renamed(UnitConverter):
  """Records keyed otherwise than their plan units: the shard must still be in the records' sort order."""

  def convert(self, unit):
    split, i = unit
    yield Record(split, f"renamed-{i}", f"{i}".encode())


@pytest.mark.slow  # runs a Beam pipeline
def test_records_are_written_in_their_own_sort_key_order(tmp_path):
  tasks = shards.plan_in_memory(_units({"train": 30}), 2, 1, 1 << 30)
  with beam.Pipeline() as p:
    _ = p | beam.Create(tasks) | shards.ConvertShards(_Renamed(), _spec(str(tmp_path)), "tests.shards")
  got = list(adapters.get("array_record").read_file(str(tmp_path / "gen-x" / "t-train.array_record-00000-of-00001")))
  want = [f"{i}".encode() for i in sorted(range(30), key=lambda i: sort_key(2, "train", f"renamed-{i}"))]
  assert got == want and got != [f"{i}".encode() for _, i in tasks[0].units()]


class _Counted(UnitConverter):
  """Records keyed like their plan units (in order: streamed), or renamed (out of order: buffered);
  counts its calls in the process (the in-process DirectRunner runs it here)."""

  calls = 0

  def __init__(self, renamed: bool):
    self._renamed = renamed

  def convert(self, unit):
    type(self).calls += 1
    split, i = unit
    yield Record(split, f"renamed-{i}" if self._renamed else f"{split}/file-{i:05d}.bin", f"{i}".encode())


@pytest.mark.slow  # runs a Beam pipeline
@pytest.mark.parametrize("renamed", [False, True])
def test_records_in_order_are_streamed_and_others_redone_buffered(tmp_path, renamed):
  _Counted.calls = 0
  tasks = shards.plan_in_memory(_units({"train": 30}), 2, 1, 1 << 30)
  p = beam.Pipeline(argv=["--direct_running_mode=in_memory", "--direct_num_workers=1"])
  done = p | beam.Create(tasks) | shards.ConvertShards(_Counted(renamed), _spec(str(tmp_path)), "tests.shards")
  assert_that(done.results | beam.Map(lambda r: (r.info.num_records, r.inputs_used)), equal_to([(30, 30)]))
  result = p.run()
  result.wait_until_finish()
  # Streamed: each unit converted once. Out of order: found at the first such record, then all again, buffered.
  assert (_Counted.calls > 31) if renamed else (_Counted.calls == 30)
  # ...and the progress counts each unit and record once either way.
  counters = {r.key.metric.name: r.committed for r in result.metrics().query(
      MetricsFilter().with_namespace("tests.shards"))["counters"]}
  assert (counters["convert_shards_units"], counters["convert_shards_records"]) == (30, 30)
  path = str(tmp_path / "gen-x" / "t-train.array_record-00000-of-00001")
  keys = [f"renamed-{i}" if renamed else f"train/file-{i:05d}.bin" for i in range(30)]
  want = [f"{i}".encode() for i in sorted(range(30), key=lambda i: sort_key(2, "train", keys[i]))]
  assert list(adapters.get("array_record").read_file(path)) == want
  assert [n for n in os.listdir(tmp_path / "gen-x") if ".tmp-" in n] == []  # the abandoned streamed file is gone


class _Big(UnitConverter):
  """2 MB records keyed like their plan units (in sort-key order)."""

  def convert(self, unit):
    split, i = unit
    yield Record(split, f"{split}/file-{i:05d}.bin", bytes([i]) * (2 << 20))


@pytest.mark.slow  # runs a Beam pipeline
def test_a_streamed_shard_holds_one_record_not_the_shard(tmp_path):
  import tracemalloc

  tasks = shards.plan_in_memory(_units({"train": 30}), 2, 1, 1 << 30)
  tracemalloc.start()
  try:
    with beam.Pipeline(argv=["--direct_running_mode=in_memory", "--direct_num_workers=1"]) as p:
      _ = p | beam.Create(tasks) | shards.ConvertShards(_Big(), _spec(str(tmp_path)), "tests.shards")
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 30 << 20, f"peak {peak / 2**20:.0f} MiB for a 60 MiB shard of 2 MiB records"


def test_compacted_histograms_merge_to_the_dense_one():
  h = shards._Histogram()
  rng = random.Random(4)
  parts = [[(rng.randrange(shards.NUM_BUCKETS), rng.randrange(100)) for _ in range(n)] for n in (0, 1, 500, 3000)]
  accs = [h.add_inputs(h.create_accumulator(), part) for part in parts]
  compacted = [h.compact(a) for a in accs]
  assert all(c[0].nbytes + c[1].nbytes <= 12 * max(1, len(p)) for c, p in zip(compacted, parts))
  dense = h.extract_output(h.merge_accumulators(accs))
  mixed = h.extract_output(h.merge_accumulators([compacted[0], accs[1], compacted[2], compacted[3]]))
  want = np.bincount([b for p in parts for b, _ in p], minlength=shards.NUM_BUCKETS)
  assert np.array_equal(dense[0], want) and np.array_equal(mixed[0], want)
  assert dense[1] == mixed[1] == sum(size for p in parts for _, size in p)
  assert np.array_equal(h.extract_output(h.add_input(compacted[2], (7, 5)))[0], want_plus(accs[2], 7))


def want_plus(acc, bucket):
  counts = acc[0].copy()
  counts[bucket] += 1
  return counts


class _Twice(UnitConverter):
  """Unit 3 makes a record and is also rejected: counted twice."""

  def convert(self, unit):
    split, i = unit
    if i == 3:
      yield Reject(f"{split}/{i}", "also rejected", split)
    yield Record(split, f"k{i}", f"{i}".encode())


def _finalized(tmp_path, converter, n, num_inputs):
  from pipelines.core.records import InputSummary

  import dataclasses

  from formats.outputs import commit

  generation, expected = commit.begin(str(tmp_path), {"pipeline": "tests"})
  spec = dataclasses.replace(_spec(str(tmp_path)), generation=generation, expected=expected)
  units = [shards.PlanUnit("train", f"k{i}", ("train", i)) for i in range(n)]
  with beam.Pipeline() as p:
    planned = shards.plan_shards(p, units, spec, 1)
    done = planned.tasks | shards.ConvertShards(converter, spec, "tests.shards")
    summary = p | "Summary" >> beam.Create([InputSummary(num_inputs, ())])
    _ = {"results": done.results, "rejects": done.rejects} | shards.FinalizeShards(
        spec, planned.planned, summary=summary)
  return Manifest.loads(open(os.path.join(str(tmp_path), "manifest.json"), "rb").read())


@pytest.mark.slow  # runs a Beam pipeline
def test_finalize_refuses_an_input_counted_twice_or_lost(tmp_path):
  m = _finalized(tmp_path / "ok", _Renamed(), 10, 10)
  assert m.num_records == 10 and [s.num_records for s in m.splits["train"].shards] == [3, 3, 4]
  with pytest.raises(Exception, match="11 input units but 10 in records"):
    _finalized(tmp_path / "lost", _Renamed(), 10, 11)  # the listing found one more than the plan held
  with pytest.raises(Exception, match="lost or counted twice"):
    _finalized(tmp_path / "twice", _Twice(), 10, 10)
  assert not os.path.exists(tmp_path / "twice" / "manifest.json")
