"""The shard sink: planning as pure functions, the transform with TestPipeline."""

import collections
import json
import os

import apache_beam as beam
from apache_beam.testing.test_pipeline import TestPipeline

TestPipeline.__test__ = False  # a Beam class, not a pytest test class
from apache_beam.testing.util import assert_that, equal_to
import cloudpickle
import pytest

from formats import tfrecord
from formats.features import Features, Text
from formats.manifest import Manifest, ShardInfo, SplitInfo
from pipelines.core.sink import OutputSpec, Record, Reject, WriteOutput, _WriteShardFn, plan_shards, shard_of, sort_key


@pytest.mark.parametrize("n,shards", [(10, 3), (7, 7), (1000, 16), (5, 1), (3, 10)])
def test_plan_spreads_records_evenly(n, shards):
  keys = [sort_key(0, "train", str(i)) for i in range(n)]
  layout = plan_shards(keys, 0, shards, 1)
  counts = collections.Counter(shard_of(layout, k) for k in keys)
  assert layout.num_shards == min(n, shards)
  assert sorted(counts) == list(range(layout.num_shards))
  assert max(counts.values()) - min(counts.values()) <= 1


def test_auto_shard_count_from_bytes():
  keys = [sort_key(0, "t", str(i)) for i in range(100)]
  assert plan_shards(keys, 1000, 0, 300).num_shards == 4
  assert plan_shards([], 0, 0, 300).num_shards == 0


def test_sort_key_depends_on_seed_split_and_key_only():
  assert sort_key(1, "train", "a") == sort_key(1, "train", "a")
  assert len({sort_key(s, sp, k) for s in (0, 1) for sp in ("a", "b") for k in ("x", "y")}) == 8


def test_dofns_survive_cloudpickle(tmp_path):
  spec = OutputSpec(str(tmp_path), "d", "tfrecord", Features({"t": Text()}), ("train",))
  fn = cloudpickle.loads(cloudpickle.dumps(_WriteShardFn(spec)))
  assert fn._spec == spec


def test_spec_validation(tmp_path):
  with pytest.raises(ValueError, match="format"):
    OutputSpec(str(tmp_path), "d", "csv", Features({}), ("train",))
  with pytest.raises(ValueError, match="num_shards"):
    OutputSpec(str(tmp_path), "d", "tfrecord", Features({}), ("train",), num_shards=-1)


def test_write_output_transform(tmp_path):
  features = Features({"t": Text()})
  out = str(tmp_path / "out")
  spec = OutputSpec(out, "d", "tfrecord", features, ("train", "test"), num_shards=3, seed=7)
  recs = [Record("train", f"k{i}", features.encode({"t": f"r{i}"})) for i in range(10)]
  recs += [Record("test", "only", features.encode({"t": "t0"}))]
  with TestPipeline() as p:
    manifest = {
        "records": p | "R" >> beam.Create(recs),
        "rejects": p | "E" >> beam.Create([Reject("/in/bad.jpg", "not an image: x", "train")]),
    } | WriteOutput(spec)
    assert_that(manifest | beam.Map(lambda m: (m["splits"]["train"]["num_records"], m["rejected"]["count"])),
                equal_to([(10, 1)]))
  m = Manifest.loads(open(os.path.join(out, "manifest.json"), "rb").read())
  assert [s.num_records for s in m.splits["train"].shards] == [3, 3, 4]
  assert len(m.splits["test"].shards) == 1  # never more shards than records
  texts = [features.decode(r)["t"] for s in m.splits["train"].shards
           for r in tfrecord.read_file(os.path.join(out, s.path))]
  assert sorted(texts) == sorted(f"r{i}" for i in range(10))
  assert texts == [f"r{i}" for i in sorted(range(10), key=lambda i: sort_key(7, "train", f"k{i}"))]
  errors = [json.loads(l) for l in open(os.path.join(out, m.rejected.path))]
  assert errors == [{"input": "/in/bad.jpg", "reason": "not an image: x", "split": "train"}]


def _write(out, spec_kwargs=None, records=(("train", "a", "x"),)):
  features = Features({"t": Text()})
  spec = OutputSpec(out, "d", "tfrecord", features, ("train",), num_shards=1, **(spec_kwargs or {}))
  with TestPipeline() as p:
    _ = {"records": p | "R" >> beam.Create([Record(s, k, features.encode({"t": t})) for s, k, t in records]),
         "rejects": p | "E" >> beam.Create([])} | WriteOutput(spec)
  return Manifest.loads(open(os.path.join(out, "manifest.json"), "rb").read())


def test_root_shards_of_a_replaced_pre_generation_output_are_removed(tmp_path):
  """An output written before generations existed: its shards lie at the root and its
  manifest lists them; the commit that replaces it removes exactly those."""
  out = str(tmp_path / "out")
  os.makedirs(out)
  listed = "d-train.tfrecord-00000-of-00001"
  open(os.path.join(out, listed), "wb").write(b"old")
  old = Manifest("d", "tfrecord", Features({"t": Text()}),
                 {"train": SplitInfo((ShardInfo(listed, 1, 3, "0" * 64),))})
  open(os.path.join(out, "manifest.json"), "wb").write(old.dumps())
  unlisted = os.path.join(out, "d-train.tfrecord-00004-of-00005")  # no manifest names it: not ours to delete
  open(unlisted, "wb").write(b"user's")
  m = _write(out)
  assert not os.path.exists(os.path.join(out, listed))
  assert open(unlisted, "rb").read() == b"user's"
  assert os.path.exists(os.path.join(out, m.splits["train"].shards[0].path))


def test_a_retried_shard_write_leaves_one_identical_file(tmp_path):
  """Beam may run a bundle twice: the shard is rewritten under the same name, same bytes."""
  features = Features({"t": Text()})
  out = str(tmp_path / "out")
  spec = OutputSpec(out, "d", "array_record", features, ("train",), num_shards=1)
  layout = plan_shards([sort_key(0, "train", "a"), sort_key(0, "train", "b")], 10, 1, 1)
  items = [(sort_key(0, "train", k), features.encode({"t": k})) for k in "ab"]
  fn = _WriteShardFn(spec)
  fn.setup()
  first = list(fn.process((("train", 0), [items]), {"train": layout}))
  second = list(fn.process((("train", 0), [items[1:], items[:1]]), {"train": layout}))
  fn.teardown()
  assert first == second and first[0][2].num_records == 2
  assert os.listdir(out) == ["d-train.array_record-00000-of-00001"]


def test_a_failed_shard_write_leaves_no_partial_file(tmp_path, monkeypatch):
  from pipelines.core import fileio

  features = Features({"t": Text()})
  out = str(tmp_path / "out")
  spec = OutputSpec(out, "d", "tfrecord", features, ("train",), num_shards=1)
  layout = plan_shards([sort_key(0, "train", "a")], 10, 1, 1)

  def fail(local, dest):
    raise OSError("disk full")

  monkeypatch.setattr(fileio, "publish", fail)
  fn = _WriteShardFn(spec)
  fn.setup()
  with pytest.raises(OSError, match="disk full"):
    list(fn.process((("train", 0), [[(sort_key(0, "train", "a"), b"x")]]), {"train": layout}))
  fn.teardown()
  assert os.listdir(out) == []


def test_an_empty_split_is_left_out_of_manifest_and_tfds_metadata_alike(tmp_path):
  """TFDS cannot open a split without records (not even one empty shard file: array_record's
  data source refuses no paths, as_dataset says "corresponds to no data"), so the manifest
  does not list one either, and says so in its warnings."""
  features = Features({"t": Text()})
  out = str(tmp_path / "out")
  spec = OutputSpec(out, "d", "array_record", features, ("test", "train", "validation"))
  with TestPipeline() as p:
    _ = {"records": p | "R" >> beam.Create([Record("train", "a", features.encode({"t": "x"}))]),
         "rejects": p | "E" >> beam.Create([Reject("/in/v.dcm", "not an image: x", "validation")])} | WriteOutput(spec)
  m = Manifest.loads(open(os.path.join(out, "manifest.json"), "rb").read())
  info = json.load(open(os.path.join(out, "dataset_info.json")))
  assert sorted(m.splits) == ["train"] == sorted(s["name"] for s in info["splits"])
  assert "empty splits left out: test, validation (no records)" in m.warnings
  assert m.rejected.count == 1


def test_an_output_whose_every_split_is_empty_lists_none(tmp_path):
  features = Features({"t": Text()})
  out = str(tmp_path / "out")
  spec = OutputSpec(out, "d", "tfrecord", features, ("train",))
  with TestPipeline() as p:
    _ = {"records": p | "R" >> beam.Create([]),
         "rejects": p | "E" >> beam.Create([Reject("/in/a", "not an image: x", "train")])} | WriteOutput(spec)
  m = Manifest.loads(open(os.path.join(out, "manifest.json"), "rb").read())
  assert dict(m.splits) == {} and m.num_records == 0
  assert "empty splits left out: train (no records)" in m.warnings
  assert json.load(open(os.path.join(out, "dataset_info.json")))["splits"] == []
