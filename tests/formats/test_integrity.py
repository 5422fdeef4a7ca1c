"""formats.outputs.integrity: the levels a local copy is checked at, and the once-per-process hash."""

from __future__ import annotations

import hashlib
import os

import pytest

from formats.outputs import integrity
from formats.errors import CorruptRecordError


@pytest.fixture
def data_file(tmp_path):
  path = tmp_path / "f.bin"
  path.write_bytes(b"x" * 100)
  return str(path), hashlib.sha256(b"x" * 100).hexdigest()


@pytest.mark.parametrize("verify, level", [(True, "sha256"), (False, "none"), ("size", "size")])
def test_levels(verify, level):
  assert integrity.verify_level(verify) == level


def test_an_unknown_level_is_refused():
  with pytest.raises(ValueError, match="verify must be one of"):
    integrity.verify_level("md5")


def test_each_level_checks_what_it_says(data_file):
  path, digest = data_file
  integrity.check_local_file(path, 100, digest, "sha256")
  integrity.check_local_file(path, 100, "0" * 64, "size")  # the digest is not looked at
  integrity.check_local_file(path, 7, "0" * 64, "none")
  with pytest.raises(CorruptRecordError, match="100 bytes, the manifest says 7"):
    integrity.check_local_file(path, 7, digest, "size")
  with pytest.raises(CorruptRecordError, match=r"differs from the manifest's 000000000000\.\.\. \(record 9: x\)"):
    integrity.check_local_file(path, 100, "0" * 64, "sha256", locate=lambda p: "record 9: x")


def test_a_changed_file_is_hashed_again(data_file):
  path, digest = data_file
  integrity.check_local_file(path, 100, digest, "sha256")
  with open(path, "r+b") as f:
    f.write(b"y")  # same size, new content
  os.utime(path, ns=(1, 1))  # a modification time that surely differs from the first check's
  with pytest.raises(CorruptRecordError, match="a changed, replaced or damaged file"):
    integrity.check_local_file(path, 100, digest, "sha256")
