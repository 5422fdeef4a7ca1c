"""formats.files: atomic writes, the verified download cache, local copies (local paths; gs:// is
exercised through the emulator by tests/formats/test_output.py and the loaders' tests)."""

from __future__ import annotations

import hashlib
import os

import pytest

from formats import files


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def test_write_bytes_replaces_whole_files_and_leaves_no_temporary(tmp_path):
  path = str(tmp_path / "a" / "b.json")
  files.write_bytes(path, b"old")
  files.write_bytes(path, b"new contents")
  assert open(path, "rb").read() == b"new contents"
  assert os.listdir(tmp_path / "a") == ["b.json"]


def test_cached_copy_downloads_once_then_reuses_the_verified_copy(tmp_path):
  src = tmp_path / "shard"
  src.write_bytes(b"payload")
  cache = str(tmp_path / "cache")
  local = files.cached_copy(str(src), _sha(b"payload"), cache)
  assert open(local, "rb").read() == b"payload"
  assert local.startswith(cache) and os.path.exists(local + ".verified")
  src.write_bytes(b"changed at the source")  # a later call trusts the verified copy: no second download
  assert files.cached_copy(str(src), _sha(b"payload"), cache) == local
  assert open(local, "rb").read() == b"payload"


def test_cached_copy_refuses_bytes_that_do_not_match_and_keeps_nothing(tmp_path):
  src = tmp_path / "shard"
  src.write_bytes(b"tampered")
  cache = tmp_path / "cache"
  with pytest.raises(ValueError, match=r"shard: sha256 .* differs from the manifest's"):
    files.cached_copy(str(src), _sha(b"payload"), str(cache))
  assert [f for _, _, fs in os.walk(cache) for f in fs] == []  # neither the copy nor a marker


def test_copies_of_two_files_with_one_name_do_not_collide(tmp_path):
  (tmp_path / "x").mkdir()
  (tmp_path / "y").mkdir()
  (tmp_path / "x" / "shard").write_bytes(b"one")
  (tmp_path / "y" / "shard").write_bytes(b"two")
  cache = str(tmp_path / "cache")
  a = files.cached_copy(str(tmp_path / "x" / "shard"), _sha(b"one"), cache)
  b = files.cached_copy(str(tmp_path / "y" / "shard"), _sha(b"two"), cache)
  assert a != b and open(a, "rb").read() == b"one" and open(b, "rb").read() == b"two"


def test_local_copy_is_the_file_itself_when_local(tmp_path):
  path = tmp_path / "f"
  path.write_bytes(b"x")
  with files.LocalCopy(str(path)) as local:
    assert local == str(path)
  assert path.exists()


def test_listing_and_walking(tmp_path):
  (tmp_path / "d" / "e").mkdir(parents=True)
  (tmp_path / "d" / "f1").write_bytes(b"")
  (tmp_path / "d" / "e" / "f2").write_bytes(b"")
  assert files.list_dir(str(tmp_path / "d")) == (["e"], ["f1"])
  assert sorted(os.path.relpath(p, tmp_path) for p in files.walk(str(tmp_path / "d"))) == ["d/e/f2", "d/f1"]
  files.delete_many(files.walk(str(tmp_path / "d")))
  files.remove_empty_dirs(str(tmp_path / "d"))
  assert not (tmp_path / "d" / "e").exists()
