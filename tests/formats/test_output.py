"""formats.outputs.output: opening an output, its shards' paths and local copies, random access, verification."""

from __future__ import annotations

import io
import os

import pytest

from formats import adapters, tfrecord
from formats.storage import files
from formats.errors import CorruptRecordError, NotAnOutputError
from formats.features import ClassLabel, Features, Image, Text
from formats.graphbin import GraphBinWriter
from formats.manifest import FileInfo, Manifest, ShardInfo, SplitInfo, sha256_file
from formats.naming import ShardName
from formats.outputs.output import Output, is_output, load_manifest, open_output
from tests.damage import flip_byte

FEATURES = Features({"image": Image(), "label": ClassLabel(("cat", "dog")), "file_name": Text()})


def _records(n: int, start: int = 0) -> list[bytes]:
  return [FEATURES.encode({"image": b"jpeg%d" % i, "label": i % 2, "file_name": f"{i}.jpg"})
          for i in range(start, start + n)]


def make_output(root: str, file_format: str = "tfrecord", sizes=(3, 2), kind: str = "") -> Manifest:
  """A committed output in `root`: one split "train" of len(sizes) shards, written by the adapter."""
  adapter = adapters.get(file_format)
  shards, start = [], 0
  for i, n in enumerate(sizes):
    rel = ShardName("d", "train", file_format, i, len(sizes)).filename
    path = os.path.join(root, rel)
    os.makedirs(root, exist_ok=True)
    adapter.write_file(path, _records(n, start))
    start += n
    shards.append(ShardInfo(rel, n, os.path.getsize(path), sha256_file(path)))
  manifest = Manifest("d", file_format, FEATURES, {"train": SplitInfo(tuple(shards))}, kind=kind)
  files.write_bytes(os.path.join(root, "manifest.json"), manifest.dumps())
  return manifest



def test_a_folder_without_a_manifest_is_not_an_output(tmp_path):
  path = str(tmp_path)
  assert not is_output(path)
  message = f"{os.path.join(path, 'manifest.json')} not found: {path} is not a complete output"
  with pytest.raises(NotAnOutputError) as e:
    open_output(path)
  assert str(e.value) == message
  assert isinstance(e.value, FileNotFoundError)
  with pytest.raises(NotAnOutputError):
    load_manifest(str(tmp_path / "missing"))
  (tmp_path / "a_file").write_bytes(b"x")
  with pytest.raises(NotAnOutputError):
    load_manifest(str(tmp_path / "a_file"))


@pytest.mark.parametrize("file_format", ["array_record", "tfrecord"])
def test_open_output_paths_and_records(tmp_path, file_format):
  root = str(tmp_path / "out")
  manifest = make_output(root, file_format)
  out = open_output(root)
  assert is_output(root)
  assert out == Output(root, manifest)
  assert (out.kind, out.file_format, sorted(out.splits)) == ("image", file_format, ["train"])
  assert out.adapter is adapters.get(file_format)
  shards = out.shards("train")
  assert [s.num_records for s in shards] == [3, 2]
  assert out.shard_path(shards[1]) == os.path.join(root, shards[1].path)
  assert out.local_copy(shards[1]) == out.shard_path(shards[1])  # a local output is its own copy
  records = out.open_records("train")
  assert len(records) == 5
  assert records.locate(3) == (1, 0)
  assert [FEATURES.decode(records.read(i))["file_name"] for i in range(5)] == [f"{i}.jpg" for i in range(5)]
  with pytest.raises(IndexError, match="record 5 outside"):
    records.read(5)
  records.close()
  with pytest.raises(KeyError, match="has no split 'test'"):
    out.shards("test")
  assert out.verify(io.StringIO()) == 0


def test_the_recorded_kind_is_the_outputs_kind(tmp_path):
  make_output(str(tmp_path), kind="tensors")
  assert open_output(str(tmp_path)).kind == "tensors"


def test_verify_finds_a_flipped_byte(tmp_path):
  root = str(tmp_path)
  manifest = make_output(root)
  shard = manifest.splits["train"].shards[1]
  path = os.path.join(root, shard.path)
  flip_byte(path, tfrecord.index(path)[0][1] + 2)  # inside record 1's payload
  report = io.StringIO()
  assert open_output(root).verify(report) == 1
  lines = report.getvalue().splitlines()
  assert lines[0].startswith(f"BAD {shard.path}: sha256 ")
  assert "record 1 at byte" in lines[0]
  assert lines[-1] == "verify: 1/2 shards OK"


def test_local_copy_names_the_damaged_record(tmp_path):
  root = str(tmp_path)
  make_output(root)
  out = open_output(root)
  shard = out.shards("train")[0]
  path = out.shard_path(shard)
  flip_byte(path, os.path.getsize(path) - 1)  # the last record's data checksum
  assert out.local_copy(shard, verify="size") == path
  with pytest.raises(CorruptRecordError, match=r"record 2 at byte \d+: bad data checksum"):
    out.local_copy(shard)
  with pytest.raises(CorruptRecordError, match="record 2: bad data checksum"):
    out.open_records("train", verify="none").read(2)


def test_a_shard_with_fewer_records_than_the_manifest_is_refused(tmp_path):
  root = str(tmp_path)
  manifest = make_output(root, "array_record")
  shard = manifest.splits["train"].shards[0]
  adapters.get("array_record").write_file(os.path.join(root, shard.path), _records(2))
  records = open_output(root).open_records("train", verify="none")
  with pytest.raises(CorruptRecordError, match="2 records, the manifest says 3"):
    records.read(0)


def test_a_graph_output_has_files_not_shards(tmp_path):
  root = str(tmp_path)
  path = os.path.join(root, "g.graphbin")
  os.makedirs(root, exist_ok=True)
  with GraphBinWriter(path) as w:
    w.add_meta({"num_nodes": {"n": 1}})
  info = FileInfo("g.graphbin", os.path.getsize(path), sha256_file(path), "graphbin")
  manifest = Manifest("g", "graphbin", Features({}), {}, files=(info,))
  files.write_bytes(os.path.join(root, "manifest.json"), manifest.dumps())
  out = open_output(root)
  assert out.kind == "graphbin"
  assert out.files == (info,)
  assert out.local_copy(info) == path
  with pytest.raises(ValueError, match="holds a graphbin output, not record shards"):
    out.open_records("train")
  assert out.verify(io.StringIO()) == 0
  flip_byte(path, 70)
  report = io.StringIO()
  assert out.verify(report) == 1
  assert "fails its checksum" in report.getvalue()


@pytest.mark.gcs
@pytest.mark.slow
def test_a_gs_output_is_copied_once_and_checked(tmp_path, gcs_emulator):
  from tests.conftest import upload_tree

  local_root = str(tmp_path / "out")
  make_output(local_root)
  gs_root = f"gs://{gcs_emulator}/formats-output-test"
  upload_tree(local_root, gs_root)
  out = open_output(gs_root)
  shard = out.shards("train")[0]
  assert out.shard_path(shard) == f"{gs_root}/{shard.path}"
  cache = str(tmp_path / "cache")
  local = out.local_copy(shard, cache_dir=cache)
  assert local.startswith(cache)
  assert sha256_file(local) == shard.sha256
  assert [len(out.open_records("train", cache_dir=cache))] == [5]
  assert out.verify(io.StringIO()) == 0
  files.write_bytes(out.shard_path(out.shards("train")[1]), b"not the shard")  # replaced behind the manifest
  with pytest.raises(CorruptRecordError, match="bytes, the manifest says"):
    out.local_copy(out.shards("train")[1], cache_dir=str(tmp_path / "cache2"))
  with pytest.raises(NotAnOutputError):
    open_output(f"gs://{gcs_emulator}/formats-no-output")


@pytest.mark.gcs
@pytest.mark.slow
def test_a_gs_splits_shards_are_fetched_in_parallel_once_and_a_lying_one_keeps_nothing(tmp_path, gcs_faults):
  """local_copies: every shard of a gs:// split fetched by parallel ranged reads, several at once, its SHA-256
  checked as it arrives; a second call fetches nothing; a shard whose bytes differ from the manifest (same size,
  other bytes, as a writer of the bucket could leave) is refused and leaves nothing in the cache."""
  from tests.conftest import upload_tree

  local_root = str(tmp_path / "out")
  make_output(local_root, sizes=(3, 2, 4, 1, 2))
  gs_root = f"gs://{gcs_faults.bucket}/formats-output-parallel"
  upload_tree(local_root, gs_root)
  out = open_output(gs_root)
  shards = out.shards("train")
  cache = str(tmp_path / "cache")
  media = lambda: gcs_faults.requests_seen("formats-output-parallel/", method="GET") - gcs_faults.requests_seen(
      "manifest.json", method="GET")
  before = media()
  paths = out.local_copies(shards, cache_dir=cache)
  assert [open(p, "rb").read() for p in paths] == [open(os.path.join(local_root, s.path), "rb").read() for s in shards]
  assert all(os.path.exists(p + ".verified") and p.startswith(cache) for p in paths)
  fetched = media() - before
  assert fetched >= len(shards)
  assert out.local_copies(shards, cache_dir=cache) == paths
  assert media() - before == fetched  # reused, not fetched
  victim = shards[2]
  with open(os.path.join(local_root, victim.path), "rb") as f:
    data = bytearray(f.read())
  data[len(data) // 2] ^= 0xFF
  files.write_bytes(out.shard_path(victim), bytes(data))
  fresh = str(tmp_path / "fresh")
  with pytest.raises(CorruptRecordError, match="sha256 .* differs from the manifest's"):
    out.local_copies(shards, cache_dir=fresh)
  left = [f for _, _, fs in os.walk(fresh) for f in fs if os.path.basename(victim.path) in f]
  assert [f for f in left if not f.endswith(".lock")] == []  # no copy, partial or marker of the liar
  assert files.cache_path("gs://b/x/shard", "ab" * 32, cache) != files.cache_path("gs://b/y/shard", "cd" * 32, cache)
