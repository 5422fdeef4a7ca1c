"""formats.storage.files: atomic writes, the verified download cache, local copies (local paths; gs:// is
exercised through the emulator by tests/formats/test_output.py and the loaders' tests)."""

from __future__ import annotations

import hashlib
import os

import pytest

from formats.storage import files


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def test_write_bytes_replaces_whole_files_and_leaves_no_temporary(tmp_path):
  path = str(tmp_path / "a" / "b.json")
  files.write_bytes(path, b"old")
  files.write_bytes(path, b"new contents")
  assert open(path, "rb").read() == b"new contents"
  assert os.listdir(tmp_path / "a") == ["b.json"]


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
