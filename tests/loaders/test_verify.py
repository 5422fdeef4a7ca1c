"""verify= through the loaders' entry points: what each level catches, and a shard hashed once per process."""

from __future__ import annotations

import os

import numpy as np
import pytest

from formats.outputs import integrity
from formats.errors import GraphBinError
from formats.graphbin import GraphBin, GraphBinWriter
from loaders import CorruptRecordError, ShardedRecords, load_graph
from loaders import grain as grain_loader
from tests.damage import flip_byte
from tests.loaders import make_outputs


def _output(tmp_path, fmt: str = "tfrecord") -> tuple[str, str]:
  """A fresh tensors output and the path of its first train shard."""
  out = make_outputs.write_tensors(str(tmp_path / fmt), fmt)
  records = ShardedRecords(out, verify="none")
  return out, records.output.shard_path(records.output.shards("train")[0])



def test_a_changed_byte_is_refused_at_sha256_naming_the_record(tmp_path):
  out, shard = _output(tmp_path)
  flip_byte(shard, 40)  # inside record 0's payload: the size is unchanged
  with pytest.raises(CorruptRecordError) as e:
    ShardedRecords(out)
  msg = str(e.value)
  assert msg.startswith(f"{shard}: sha256 ")
  assert "differs from the manifest's" in msg
  assert "record 0" in msg
  for verify in ("size", "none", False):  # the cheaper levels trust the bytes; the read still checks the CRC
    records = ShardedRecords(out, verify=verify)
    with pytest.raises(CorruptRecordError, match=rf"{os.path.basename(shard)}: record 0: bad data checksum"):
      records[0]


def test_a_truncated_shard_is_refused_at_size(tmp_path):
  out, shard = _output(tmp_path, "array_record")
  size = os.path.getsize(shard)
  with open(shard, "r+b") as f:
    f.truncate(size - 1)
  for verify in ("sha256", "size"):
    with pytest.raises(CorruptRecordError, match=rf"{shard}: {size - 1} bytes, the manifest says {size}"):
      grain_loader.dataset(out, batch_size=2, verify=verify)


def test_bad_levels_are_named(tmp_path):
  out, _ = _output(tmp_path)
  for load in (lambda v: ShardedRecords(out, verify=v), lambda v: grain_loader.dataset(out, batch_size=2, verify=v),
               lambda v: load_graph(out, verify=v)):
    for bad in ("md5", "SHA256", 1, None):
      with pytest.raises(ValueError, match=rf"verify must be .*got {bad!r}"):
        load(bad)


def test_sha256_is_computed_once_per_shard_per_process(tmp_path, monkeypatch):
  out, shard = _output(tmp_path)
  hashed = []
  real = integrity.sha256_file
  monkeypatch.setattr(integrity, "sha256_file", lambda p, *a, **k: hashed.append(p) or real(p, *a, **k))
  records = ShardedRecords(out)
  paths = sorted(records.output.shard_path(s) for s in records.output.shards("train"))
  for _ in range(2):
    ShardedRecords(out)
    grain_loader.dataset(out, batch_size=2)
  assert sorted(hashed) == paths
  st = os.stat(shard)
  os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))  # touched: proven again
  ShardedRecords(out)
  assert hashed[-1] == shard
  assert len(hashed) == len(paths) + 1


def test_a_bare_graphbin_is_proven_by_its_section_checksums(tmp_path):
  path = str(tmp_path / "g.graphbin")
  with GraphBinWriter(path) as w:
    w.add_meta({"num_nodes": {"": 4}})
    w.add("indptr", np.array([0, 1, 2, 3, 4], np.int64))
    w.add("indices", np.array([1, 2, 3, 0], np.int32))
  assert load_graph(path).num_edges == 4
  flip_byte(path, GraphBin(path).sections["indices"].offset)  # a section's data, not the table
  with pytest.raises(GraphBinError, match="fails its checksum"):
    load_graph(path)
  for verify in ("size", "none"):  # without a manifest there is nothing to compare the size with
    assert load_graph(path, verify=verify).num_nodes == 4
