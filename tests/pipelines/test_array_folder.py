"""`pipelines.array_folder`: folders of .npy files → shards; the proof that a converter is a small, local addition."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re

import numpy as np
import pytest

from formats import arrayrecord, tfrecord
from formats.manifest import MANIFEST_FILENAME, Manifest
from pipelines import array_folder
from pipelines.array_folder import ArrayFolderConfig, load_array
from pipelines.core import UsageError

SHAPE = (3, 4)


def _npy(arr: np.ndarray) -> bytes:
  buf = io.BytesIO()
  np.save(buf, arr, allow_pickle=True)
  return buf.getvalue()


def _write(path: str, data: bytes) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb") as f:
    f.write(data)


def sample_input(base: str) -> tuple[str, list[str]]:
  """A small input for registry-driven tests (tests/pipelines/test_registry.py): (folder, own flags)."""
  root = os.path.join(base, "arrays")
  rng = np.random.default_rng(0)
  for split, n in (("train", 5), ("validation", 2)):
    for i in range(n):
      _write(os.path.join(root, split, f"a{i:02d}.npy"), _npy(rng.standard_normal(SHAPE).astype(np.float32)))
  _write(os.path.join(root, "train", "sub", "wrong_shape.npy"), _npy(np.zeros((2, 2), np.float32)))
  _write(os.path.join(root, "train", "wrong_dtype.npy"), _npy(np.zeros(SHAPE, np.float64)))
  _write(os.path.join(root, "train", "objects.npy"), _npy(np.array([{"a": 1}], dtype=object)))
  _write(os.path.join(root, "train", "notes.txt"), b"not an array")
  _write(os.path.join(root, "stray.npy"), _npy(np.zeros(SHAPE, np.float32)))
  return root, ["--shape=3,4", "--dtype=float32"]


def _records(output: str, m: Manifest, split: str) -> list[dict]:
  out = []
  for shard in m.splits[split].shards:
    path = os.path.join(output, shard.path)
    read = arrayrecord.read_file if m.file_format == "array_record" else tfrecord.read_file
    out += [m.features.decode(r) for r in read(path)]
  return out


@pytest.mark.slow
@pytest.mark.parametrize("file_format", ["array_record", "tfrecord"])
def test_arrays_become_records_and_bad_files_rejects(tmp_path, file_format):
  root, flags = sample_input(str(tmp_path))
  out = str(tmp_path / "out")
  array_folder.run([f"--input={root}", f"--output={out}", f"--format={file_format}", *flags])
  with open(os.path.join(out, MANIFEST_FILENAME), "rb") as f:
    m = Manifest.loads(f.read())
  assert m.kind == "tensors"
  assert sorted(m.splits) == ["train", "validation"]
  assert (m.splits["train"].num_records, m.splits["validation"].num_records) == (5, 2)
  train = _records(out, m, "train")
  for r in train:
    expected = np.load(os.path.join(root, "train", r["file_name"].split("/", 1)[1]))
    assert r["array"].dtype == np.float32
    assert np.array_equal(r["array"], expected)
  with open(os.path.join(out, m.rejected.path)) as f:
    rejects = {os.path.relpath(j["input"], root): j["reason"] for j in map(json.loads, f)}
  assert rejects == {
      "train/sub/wrong_shape.npy": "shape (2, 2) is not --shape (3, 4)",
      "train/wrong_dtype.npy": "dtype float64 is not --dtype float32",
      "train/objects.npy": "holds Python objects (not allowed)",
      "train/notes.txt": "not a .npy array",
      "stray.npy": "not inside a split folder",
  }
  assert m.rejected.count == 5


@pytest.mark.slow
def test_a_rerun_is_byte_identical(tmp_path):
  root, flags = sample_input(str(tmp_path))
  digests = []
  for out in ("a", "b"):
    array_folder.run([f"--input={root}", f"--output={tmp_path / out}", "--num_shards=2", *flags])
    m = Manifest.loads((tmp_path / out / MANIFEST_FILENAME).read_bytes())
    digests.append([s.sha256 for split in m.splits.values() for s in split.shards])
  assert digests[0] == digests[1]
  assert len(digests[0]) == 4


@pytest.mark.parametrize("flags,message", [
    ([], "--shape is required"),
    (["--shape=3,x", "--dtype=float32"], "--shape must be D0,D1,... with positive integers, got '3,x'"),
    (["--shape=3,0", "--dtype=float32"], "--shape must be D0,D1,... with positive integers, got '3,0'"),
    (["--shape=3,4"], "--dtype is required"),
    (["--shape=3,4", "--dtype=object"], "--dtype must be one of"),
])
def test_bad_flags_are_usage_errors(tmp_path, flags, message):
  root, _ = sample_input(str(tmp_path))
  with pytest.raises(UsageError, match=message):
    array_folder.run([f"--input={root}", f"--output={tmp_path / 'out'}", *flags])
  assert not (tmp_path / "out").exists()


def test_a_split_folder_that_is_no_split_name_is_a_usage_error(tmp_path):
  root, own = sample_input(str(tmp_path))
  _write(os.path.join(root, "dev-2", "a.npy"), _npy(np.zeros(SHAPE, np.float32)))
  with pytest.raises(UsageError, match="split folder: split name 'dev-2' must use letters, digits and '_' only"):
    array_folder.run([f"--input={root}", f"--output={tmp_path / 'out'}", *own])
  assert not (tmp_path / "out").exists()


def test_load_array_names_the_problem_not_the_values():
  config = ArrayFolderConfig(shape=(2,), dtype="int32")
  assert load_array(_npy(np.array([7, 8], np.int32)), config).tolist() == [7, 8]
  for data, reason in [(b"", "not a .npy array"), (_npy(np.array([1.5, 2.5])), "dtype float64"),
                       (_npy(np.array([1, 2, 3], np.int32)), "shape (3,)"),
                       (hashlib.sha256(b"x").digest(), "not a .npy array"),
                       # a damaged header: np.load raised TokenError or TypeError, which stopped the job
                       (_npy(np.array([7, 8], np.int32)).replace(b"'descr'", b"'des(r'"), "malformed header"),
                       (_npy(np.array([7, 8], np.int32)).replace(b"(2,)", b"(2,,"), "malformed header"),
                       (_npy(np.array([7, 8], np.int32)).replace(b"'<i4'", b"[1, 2]"), "malformed header"),
                       # a header claiming 36 TiB is refused from the header, never allocated
                       (_npy(np.array([7, 8], np.int32)).replace(b"(2,)", b"(9999999999999,)"),
                        "shape (9999999999999,)"),
                       (_npy(np.array([7, 8], np.int32))[:-1], "truncated")]:
    with pytest.raises(ValueError, match=re.escape(reason)) as e:
      load_array(data, config)
    assert "7" not in str(e.value)
  fortran = np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3))
  np.testing.assert_array_equal(load_array(_npy(fortran), ArrayFolderConfig(shape=(2, 3), dtype="int32")), fortran)
