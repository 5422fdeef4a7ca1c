"""loaders._verify: the verify levels, and a file's SHA-256 computed once per process unless it changes."""

from __future__ import annotations

import hashlib
import os

import pytest

from loaders import CorruptRecordError, _verify


@pytest.fixture
def shard(tmp_path) -> tuple[str, int, str]:
  """(path, size, sha256) of a small file standing in for a shard."""
  path = str(tmp_path / "shard")
  data = bytes(range(256)) * 40
  with open(path, "wb") as f:
    f.write(data)
  return path, len(data), hashlib.sha256(data).hexdigest()


def test_levels_and_their_aliases():
  assert [_verify.verify_level(v) for v in ("sha256", "size", "none", True, False)] == [
      "sha256", "size", "none", "sha256", "none"]
  for bad in ("md5", "SHA256", 1, None):
    with pytest.raises(ValueError, match=rf"verify must be .*got {bad!r}"):
      _verify.verify_level(bad)


def test_size_catches_a_truncated_file_and_none_trusts_it(shard):
  path, size, digest = shard
  with pytest.raises(CorruptRecordError, match=rf"{size} bytes, the manifest says {size + 1}"):
    _verify.check_local_file(path, size + 1, digest, "size")
  _verify.check_local_file(path, size + 1, digest, "none")


def test_sha256_names_both_digests_and_the_damaged_record(shard):
  path, size, digest = shard
  wrong = "0" * 64
  _verify.check_local_file(path, size, wrong, "size")  # the size alone matches
  with pytest.raises(CorruptRecordError) as e:
    _verify.check_local_file(path, size, wrong, "sha256", locate=lambda p: "record 3: bad data checksum")
  msg = str(e.value)
  assert msg.startswith(f"{path}: sha256 {digest[:12]}") and wrong[:12] in msg and "record 3" in msg


def test_sha256_is_computed_once_per_file_per_process(shard, monkeypatch):
  path, size, digest = shard
  hashed = []
  real = _verify.sha256_file
  monkeypatch.setattr(_verify, "sha256_file", lambda p, *a, **k: hashed.append(p) or real(p, *a, **k))
  for _ in range(3):
    _verify.check_local_file(path, size, digest, "sha256")
  assert hashed == [path]
  st = os.stat(path)
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))  # touched: proven again
  _verify.check_local_file(path, size, digest, "sha256")
  assert hashed == [path, path]
