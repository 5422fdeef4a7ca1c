"""`pipelines.core.sink`: one shard written and published, the input accounting and the commit (no Beam)."""

import json
import os
import time

import pytest

from formats import tfrecord
from formats.features import Features, Text
from formats.manifest import Manifest, ShardInfo, SplitInfo
from formats.outputs import commit
from pipelines.core.records import InputSummary, Reject
from pipelines.core.shards import sort_key
from pipelines.core.sink import OutputSpec, commit_records, write_shard

FEATURES = Features({"t": Text()})


def _spec(out: str, splits=("train",), file_format="tfrecord", **kwargs) -> OutputSpec:
  generation, expected = commit.begin(out, {"pipeline": "tests"})
  return OutputSpec(out, "d", file_format, FEATURES, tuple(splits), generation=generation, expected=expected,
                    **kwargs)


def _commit(spec: OutputSpec, records: dict[str, list[str]], rejects=(), summary=None) -> Manifest:
  """Writes one shard per split holding `records[split]` (texts, in order), then commits."""
  splits = {}
  for split, texts in records.items():
    info = write_shard(spec, split, 0, 1, (FEATURES.encode({"t": t}) for t in texts))
    if info.num_records:
      splits[split] = SplitInfo((info,))
  used = sum(len(t) for t in records.values())
  return commit_records(spec, splits, set(spec.splits) | set(records), list(rejects), summary, used)


def test_sort_key_depends_on_seed_split_and_key_only():
  assert sort_key(1, "train", "a") == sort_key(1, "train", "a")
  assert len({sort_key(s, sp, k) for s in (0, 1) for sp in ("a", "b") for k in ("x", "y")}) == 8


def test_spec_validation(tmp_path):
  with pytest.raises(ValueError, match="format"):
    OutputSpec(str(tmp_path), "d", "csv", Features({}), ("train",))
  with pytest.raises(ValueError, match="num_shards"):
    OutputSpec(str(tmp_path), "d", "tfrecord", Features({}), ("train",), num_shards=-1)


def test_a_shard_holds_its_records_in_order_and_the_commit_lists_it(tmp_path):
  out = str(tmp_path / "out")
  spec = _spec(out, ("train", "test"))
  m = _commit(spec, {"train": ["r0", "r1", "r2"], "test": ["t0"]}, [Reject("/in/bad.jpg", "not an image: x", "train")],
              InputSummary(5))
  assert [s.num_records for s in m.splits["train"].shards] == [3]
  texts = [FEATURES.decode(r)["t"] for r in tfrecord.read_file(os.path.join(out, m.splits["train"].shards[0].path))]
  assert texts == ["r0", "r1", "r2"]
  errors = [json.loads(line) for line in open(os.path.join(out, m.rejected.path))]
  assert errors == [{"input": "/in/bad.jpg", "reason": "not an image: x", "split": "train"}]
  assert Manifest.loads(open(os.path.join(out, "manifest.json"), "rb").read()) == m


def test_records_and_rejects_that_miss_an_input_fail_the_commit(tmp_path):
  out = str(tmp_path / "out")
  with pytest.raises(RuntimeError, match="an input was lost"):
    _commit(_spec(out), {"train": ["a"]}, summary=InputSummary(2))
  assert not os.path.exists(os.path.join(out, "manifest.json"))


def test_root_shards_of_a_replaced_pre_generation_output_are_kept_for_the_retention_then_removed(tmp_path):
  """An output written before generations existed: its shards lie at the root and its manifest lists them. The
  commit that replaces it deleted them at once, under a reader of the old output (which holds no lease: there is
  no generation to lease); they are kept for the retention like a replaced generation, then exactly those go."""
  out = str(tmp_path / "out")
  os.makedirs(out)
  listed = "d-train.tfrecord-00000-of-00001"
  open(os.path.join(out, listed), "wb").write(b"old")
  old = Manifest("d", "tfrecord", FEATURES, {"train": SplitInfo((ShardInfo(listed, 1, 3, "0" * 64),))})
  open(os.path.join(out, "manifest.json"), "wb").write(old.dumps())
  unlisted = os.path.join(out, "d-train.tfrecord-00004-of-00005")  # no manifest names it: not ours to delete
  open(unlisted, "wb").write(b"user's")
  m = _commit(_spec(out), {"train": ["x"]})
  assert open(os.path.join(out, listed), "rb").read() == b"old"  # a reader of the old output still reads it
  assert os.path.exists(os.path.join(out, m.splits["train"].shards[0].path))
  commit.cleanup(out)  # within the retention: kept
  assert os.path.exists(os.path.join(out, listed))
  commit.cleanup(out, now=time.time() + commit.DEFAULT_KEEP_REPLACED_SECONDS + 60)
  assert not os.path.exists(os.path.join(out, listed))
  assert open(unlisted, "rb").read() == b"user's"
  assert not os.path.exists(os.path.join(out, m.splits["train"].shards[0].path.split("/")[0], commit.LEGACY_FILENAME))
  from formats.outputs.output import verify
  assert verify(out, m) == 0


def test_root_shards_go_at_once_with_keep_replaced_0_or_with_the_generation_that_replaced_them(tmp_path):
  for keep in (0, None):
    out = str(tmp_path / f"out-{keep}")
    os.makedirs(out)
    listed = "d-train.tfrecord-00000-of-00001"
    open(os.path.join(out, listed), "wb").write(b"old")
    old = Manifest("d", "tfrecord", FEATURES, {"train": SplitInfo((ShardInfo(listed, 1, 3, "0" * 64),))})
    open(os.path.join(out, "manifest.json"), "wb").write(old.dumps())
    first = _commit(_spec(out), {"train": ["x"]})
    if keep == 0:
      commit.cleanup(out, replaced=old, keep_replaced_seconds=0)
    else:  # the generation that replaced them is replaced and removed in its turn: they go with it
      assert os.path.exists(os.path.join(out, listed))
      _commit(_spec(out), {"train": ["y"]})
      commit.cleanup(out, keep_replaced_seconds=0)
      assert not os.path.exists(os.path.join(out, first.splits["train"].shards[0].path.split("/")[0]))
    assert not os.path.exists(os.path.join(out, listed))


def test_a_retried_shard_write_leaves_one_identical_file(tmp_path):
  """Beam may run a bundle twice: the shard is rewritten under the same name, same bytes."""
  out = str(tmp_path / "out")
  spec = _spec(out, file_format="array_record")
  payloads = [FEATURES.encode({"t": k}) for k in "ab"]
  first = write_shard(spec, "train", 0, 1, iter(payloads))
  second = write_shard(spec, "train", 0, 1, iter(payloads))
  assert first == second
  assert first.num_records == 2
  shards = [n for n in os.listdir(os.path.join(out, spec.generation)) if not n.startswith("_toolkit")]
  assert shards == ["d-train.array_record-00000-of-00001"]


def test_a_failed_shard_write_leaves_no_partial_file(tmp_path):
  out = str(tmp_path / "out")
  spec = _spec(out)

  def payloads():
    yield b"x"
    raise OSError("disk full")

  with pytest.raises(OSError, match="disk full"):
    write_shard(spec, "train", 0, 1, payloads())
  assert [n for n in os.listdir(os.path.join(out, spec.generation)) if not n.startswith("_toolkit")] == []


def test_an_empty_split_is_left_out_of_manifest_and_tfds_metadata_alike(tmp_path):
  """TFDS cannot open a split without records (not even one empty shard file: array_record's
  data source refuses no paths, as_dataset says "corresponds to no data"), so the manifest
  does not list one either, and says so in its warnings."""
  out = str(tmp_path / "out")
  spec = _spec(out, ("test", "train", "validation"), file_format="array_record")
  m = _commit(spec, {"train": ["x"]}, [Reject("/in/v.dcm", "not an image: x", "validation")])
  info = json.load(open(os.path.join(out, "dataset_info.json")))
  assert sorted(m.splits) == ["train"]
  assert sorted(s["name"] for s in info["splits"]) == ["train"]
  assert "empty splits left out: test, validation (no records)" in m.warnings
  assert m.rejected.count == 1


def test_an_output_whose_every_split_is_empty_lists_none(tmp_path):
  out = str(tmp_path / "out")
  m = _commit(_spec(out), {}, [Reject("/in/a", "not an image: x", "train")])
  assert dict(m.splits) == {}
  assert m.num_records == 0
  assert "empty splits left out: train (no records)" in m.warnings
  assert json.load(open(os.path.join(out, "dataset_info.json")))["splits"] == []
