"""Outputs of record kind "tensors" (a generic converter's) load with the generic transform in every loader."""

from __future__ import annotations

import os

import numpy as np
import pytest

from formats.features import ClassLabel, Features, Tensor
from loaders import ShardedRecords, grain as grain_loader, tfdata
from pipelines import array_folder
from tests.loaders import make_outputs


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, str]:
  base = tmp_path_factory.mktemp("tensors")
  return {fmt: make_outputs.write_tensors(str(base / fmt), fmt) for fmt in ("array_record", "tfrecord")}


def _check_batch(batch: dict, n: int) -> None:
  """The first `n` examples of `batch` are the records its record_index names, as stored."""
  for slot in range(n):
    want = make_outputs.tensor_record(int(batch["record_index"][slot]))
    for name in ("x", "ids", "flag", "spacing", "count"):
      np.testing.assert_array_equal(batch[name][slot], want[name], err_msg=name)
    assert batch["label"][slot] == want["label"]


@pytest.mark.parametrize("fmt", ["array_record", "tfrecord"])
def test_grain_batches_hold_every_tensor_and_label_as_stored(outputs, fmt):
  records = ShardedRecords(outputs[fmt])
  assert records.kind == "tensors"
  batches = list(grain_loader.dataset(outputs[fmt], batch_size=4, shuffle=False, num_threads=2))
  assert len(batches) == len(records) // 4
  assert {k: (v.dtype, v.shape) for k, v in batches[0].items()} == {
      "x": (np.dtype(np.float32), (4, 4, 3)), "ids": (np.dtype(np.int16), (4, 5)), "flag": (np.dtype(bool), (4,)),
      "spacing": (np.dtype(np.float32), (4, 3)), "count": (np.dtype(np.int64), (4,)),
      "label": (np.dtype(np.int64), (4,)), "record_index": (np.dtype(np.int64), (4,))}
  assert [int(i) for b in batches for i in b["record_index"]] == list(range(len(batches) * 4))
  for b in batches:
    _check_batch(b, 4)


def test_grain_pads_the_last_tensors_batch(outputs):
  batches = list(grain_loader.dataset(outputs["array_record"], batch_size=5, shuffle=False, drop_remainder=False))
  n = len(ShardedRecords(outputs["array_record"]))
  assert len(batches) == -(-n // 5)
  assert int(batches[-1]["mask"].sum()) == n % 5
  _check_batch(batches[-1], n % 5)


def test_tfdata_equals_grain_on_tensors(outputs):
  got = list(tfdata.dataset(outputs["tfrecord"], batch_size=4, shuffle=False).as_numpy_iterator())
  want = list(grain_loader.dataset(outputs["tfrecord"], batch_size=4, shuffle=False, num_threads=2))
  assert len(got) == len(want) > 0
  for g, w in zip(got, want):
    assert sorted(g) == sorted(w)
    for k in w:
      assert g[k].dtype == w[k].dtype, k
      assert np.array_equal(g[k], w[k]), k


def test_a_tensor_without_a_static_shape_is_refused_by_name(tmp_path):
  features = Features({"x": Tensor((None, 3), "float32"), "label": ClassLabel(("a", "b", "c"))})
  out = {fmt: make_outputs.write_tensors(str(tmp_path / fmt), fmt, features=features)
         for fmt in ("array_record", "tfrecord")}
  assert len(ShardedRecords(out["array_record"])) == 22  # records are still readable one at a time
  for load in (lambda: grain_loader.dataset(out["array_record"], batch_size=2),
               lambda: tfdata.dataset(out["tfrecord"], batch_size=2)):
    with pytest.raises(ValueError, match=r"feature 'x' has shape \(None, 3\).*static shapes"):
      load()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["array_record", "tfrecord"])
def test_a_generic_converters_output_loads(tmp_path, fmt):
  """pipelines.array_folder writes kind "tensors" (`array`, `file_name`): batches hold each source array."""
  rng = np.random.default_rng(1)
  arrays = {}
  for i in range(9):
    name = f"a{i}.npy"
    arrays[f"train/{name}"] = rng.integers(-50, 50, (3, 4)).astype(np.int16)
    os.makedirs(tmp_path / "in" / "train", exist_ok=True)
    np.save(tmp_path / "in" / "train" / name, arrays[f"train/{name}"])
  out = str(tmp_path / "out")
  array_folder.run([f"--input={tmp_path / 'in'}", f"--output={out}", f"--format={fmt}", "--shape=3,4",
                    "--dtype=int16", "--num_shards=2"])
  records = ShardedRecords(out)
  assert records.kind == "tensors"
  assert len(records) == len(arrays)
  loaders = [list(grain_loader.dataset(out, batch_size=4, shuffle=False, num_threads=2))]
  if fmt == "tfrecord":
    loaders.append(list(tfdata.dataset(out, batch_size=4, shuffle=False).as_numpy_iterator()))
  for batches in loaders:
    assert len(batches) == len(arrays) // 4
    for b in batches:
      assert sorted(b) == ["array", "record_index"]
      assert b["array"].dtype == np.int16
      for i, arr in zip(b["record_index"], b["array"]):
        np.testing.assert_array_equal(arr, arrays[records[int(i)]["file_name"]])
