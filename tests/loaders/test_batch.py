"""loaders._batch.BatchFiller: bit for bit the batches of decode → transform → fill_batch, faster.

Outputs of every record kind are written with `formats` alone (no Beam): raw
and JPEG images (own size and fixed size, several modes), CT volumes,
"tensors" records and graph-property records, in ArrayRecord and TFRecord.
Each filled batch must equal, key by key (order, dtype, shape, bytes), what
the old path gives; damaged records must raise CorruptRecordError naming the
shard and the record; per-thread readers must all be closed.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from formats import example
from formats.errors import CorruptRecordError
from formats.features import ClassLabel, Features, Tensor
from formats.transforms import element_rng
from loaders import ExampleOptions, ShardedRecords, example_transform
from loaders import grain as grain_loader
from loaders._batch import ALIGNMENT, BatchFiller
from loaders._transforms import fill_batch  # the old path's batching: the reference
from tests.conftest import REPO
from tests.damage import flip_byte
from tests.loaders import make_outputs

CLASSES = make_outputs.CLASSES


def write_output(path: str, features: Features, payloads: list[bytes], kind: str, file_format: str = "array_record",
                 num_shards: int = 2) -> str:
  """A committed output at `path`: split "train" holding `payloads` (serialized Examples) over `num_shards`."""
  return make_outputs.write(path, features, {"train": payloads}, kind=kind, file_format=file_format,
                            num_shards=num_shards)


def tensors(rng, n):
  del rng
  return make_outputs.tensors(n)


ODD_TENSORS = Features({
    "be_values": Tensor((2,), ">i4", encoding="none"), "be_bytes": Tensor((2, 2), ">f8"), "half": Tensor((3,), "float16"),
    "flag": Tensor((), "bool"), "small": Tensor((2,), "uint8", encoding="none"), "label": ClassLabel(CLASSES),
})


def odd_tensors(rng, n):
  """Dtypes whose batch dtype is easy to get wrong: big-endian (values: as named; bytes: little-endian), half, bool."""
  return ODD_TENSORS, [ODD_TENSORS.encode({
      "be_values": rng.integers(-9, 9, 2).astype(">i4"), "be_bytes": rng.normal(size=(2, 2)).astype(">f8"),
      "half": rng.normal(size=3).astype(np.float16), "flag": np.asarray(i % 2 == 1),
      "small": rng.integers(0, 255, 2).astype(np.uint8), "label": i % 3}) for i in range(n)]


# name: (records, kind, options)
CASES = {
    "raw": (make_outputs.raw_images, "image", {}),
    "jpeg_resized": (make_outputs.jpeg_images, "image", {"image_size": (24, 20)}),
    "jpeg_fixed": (lambda rng, n: make_outputs.jpeg_images(rng, n, fixed=(16, 12)), "image", {}),
    "jpeg_fixed_resized": (lambda rng, n: make_outputs.jpeg_images(rng, n, fixed=(16, 12)), "image",
                           {"image_size": (9, 13)}),
    "ct_random": (make_outputs.volumes, "volume", {"patch_size": (4, 8, 16), "patch": "random"}),
    "ct_center": (make_outputs.volumes, "volume",
                  {"patch_size": (4, 8, 16), "patch": "center", "hu_window": (-200.0, 300.0)}),
    "tensors": (tensors, "tensors", {}),
    "odd_tensors": (odd_tensors, "tensors", {}),
    "graph": (make_outputs.graphs, "graph", {"max_nodes": 12, "max_edges": 20}),
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[tuple[str, str], str]:
  base = tmp_path_factory.mktemp("batch_outputs")
  out = {}
  for name, (make, kind, _) in CASES.items():
    features, payloads = make(np.random.default_rng(len(name)), 23)
    for fmt in ("array_record", "tfrecord"):
      out[name, fmt] = write_output(str(base / f"{name}_{fmt}"), features, payloads, kind, fmt)
  return out


def old_path(source, options, indices, batch_size, with_mask, seed=5, position=3):
  """What the loaders gave before the filler: decode, transform, fill_batch."""
  transform = example_transform(source.kind, source.features, options)
  rng = (lambda j: element_rng(seed, position, j)) if transform.needs_rng else (lambda j: None)
  return fill_batch((transform(source.get(int(i), copy=False), rng(j)) for j, i in enumerate(indices)),
                    batch_size, with_mask)


def fast_path(source, options, indices, batch_size, with_mask, seed=5, position=3):
  return BatchFiller(source, options, batch_size, with_mask)(indices, lambda j: element_rng(seed, position, j))


def assert_same_batch(got: dict, want: dict) -> None:
  assert list(got) == list(want)
  for key in want:
    assert (got[key].dtype, got[key].shape) == (want[key].dtype, want[key].shape), key
    assert got[key].tobytes() == want[key].tobytes(), key  # bit for bit, NaN payloads included


@pytest.mark.parametrize("fmt", ["array_record", "tfrecord"])
@pytest.mark.parametrize("case", list(CASES))
def test_filler_equals_the_old_path(outputs, case, fmt):
  source = ShardedRecords(outputs[case, fmt])
  options = ExampleOptions(**CASES[case][2])
  order = np.random.default_rng(0).permutation(len(source))
  batches = [(order[:8], 8, False), (order[8:16], 8, True), (order[16:], 8, True), (order[16:], 8, False),
             (order[:1], 1, True), (np.arange(len(source)), len(source), False)]
  for indices, size, mask in batches:  # full, short (padded with zeros), one, the whole split
    assert_same_batch(fast_path(source, options, indices, size, mask), old_path(source, options, indices, size, mask))


def test_every_kind_takes_its_fast_path(outputs):
  for case, (_, kind, options) in CASES.items():
    fill = BatchFiller(ShardedRecords(outputs[case, "array_record"]), ExampleOptions(**options), 4, False)
    assert (fill._plan is None) == (kind == "volume"), case  # volumes: decode, transform, copy


def test_every_batch_is_new_memory_aligned_for_zero_copy(outputs):
  """Two batches of one filler never share memory (nothing is reused: a device array that shares a batch's memory,
  as jax's CPU backend does, never sees it change), and every array starts on an ALIGNMENT-byte boundary (where
  that backend shares it instead of copying)."""
  for case, (_, kind, options) in CASES.items():
    fill = BatchFiller(ShardedRecords(outputs[case, "array_record"]), ExampleOptions(**options), 4, True)
    a, b = (fill(indices, lambda j: element_rng(5, 0, j)) for indices in (np.arange(4), np.arange(3)))
    for key in a:
      assert a[key].ctypes.data % ALIGNMENT == b[key].ctypes.data % ALIGNMENT == 0, (case, key)
      assert not np.shares_memory(a[key], b[key]), (case, key)


def test_random_patches_follow_the_slot_generators(outputs):
  source = ShardedRecords(outputs["ct_random", "array_record"])
  options = ExampleOptions(patch_size=(2, 4, 4))
  a = fast_path(source, options, np.arange(6), 6, False, seed=1)
  b = fast_path(source, options, np.arange(6), 6, False, seed=2)
  assert not np.array_equal(a["patch_start"], b["patch_start"])
  assert_same_batch(a, old_path(source, options, np.arange(6), 6, False, seed=1))


def test_threads_fill_the_same_batches(outputs):
  source = ShardedRecords(outputs["raw", "array_record"])
  options = ExampleOptions()
  fill = BatchFiller(source, options, 4, True)
  order = np.random.default_rng(1).permutation(len(source))
  chunks = [order[k:k + 4] for k in range(0, len(order), 4)]
  want = [old_path(source, options, c, 4, True) for c in chunks]
  got: dict[tuple[int, int], dict] = {}
  errors = []

  def work(t):
    try:
      for _ in range(5):
        for k in range(len(chunks))[t::2] if t < 2 else range(len(chunks)):
          got[t, k] = fill(chunks[k], lambda j: None)
    except Exception as e:  # noqa: BLE001 - reported below
      errors.append(e)

  threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors
  for (t, k), batch in got.items():
    assert_same_batch(batch, want[k])


def test_grain_batches_are_the_same_with_and_without_the_filler(outputs, monkeypatch):
  for case in ("raw", "jpeg_resized", "ct_random", "tensors", "graph"):
    options = CASES[case][2]
    runs = []
    for fast in (True, False):
      monkeypatch.setattr(grain_loader._ReadBatch, "FAST", fast)
      ds = grain_loader.dataset(outputs[case, "array_record"], batch_size=5, drop_remainder=False, seed=2,
                                num_epochs=2, num_threads=2, order="global", shard_count=1, **options)
      runs.append(list(ds))
    assert len(runs[0]) == len(runs[1]) == 2 * -(-23 // 5)
    for got, want in zip(*runs):
      assert_same_batch(got, want)


# ---- damaged records ------------------------------------------------------------------------------


def _shard_path(source: ShardedRecords, k: int = 0) -> str:
  return source._records.paths[k]


@pytest.mark.parametrize("case", list(CASES))
def test_a_batch_of_padding_only_has_every_key_and_shape(outputs, case):
  """A host's share of the last global step can be empty (drop_remainder=False, 11 records, 2 hosts of 4): every
  kind gave a batch holding `mask` alone, a KeyError in the step and another structure than the other hosts'
  batches."""
  _, kind, options = CASES[case]
  source = ShardedRecords(outputs[case, "array_record"])
  full = fast_path(source, ExampleOptions(**options), np.arange(4), 4, True)
  empty = fast_path(source, ExampleOptions(**options), np.arange(0), 4, True)
  assert {k: (v.dtype, v.shape) for k, v in empty.items()} == {k: (v.dtype, v.shape) for k, v in full.items()}
  assert not empty["mask"].any() and all(not v.any() for v in empty.values())


@pytest.mark.parametrize("case", ["raw", "ct_center", "graph"])
@pytest.mark.parametrize("read", [{}, dict(window_shards=1)], ids=["random-access", "windows"])
def test_the_empty_last_step_of_a_host_keeps_the_structure(outputs, case, read):
  """The same through loaders.grain.dataset (23 records, 2 hosts of 5: host 1's third batch is padding only):
  every batch of every host has one structure, also when a resumed iterator's first batch is the padding (read
  in windows, no record of an empty share is pinned: reading record 0 for the layout was a RuntimeError)."""
  _, _, options = CASES[case]
  signatures = set()
  for host in range(2):
    ds = grain_loader.dataset(outputs[case, "array_record"], batch_size=5, shard_index=host, shard_count=2,
                              drop_remainder=False, shuffle=False, **read, **options)
    it = iter(ds)
    batches = [next(it), next(it)]
    state = it.get_state()
    ds.close()
    resumed = grain_loader.dataset(outputs[case, "array_record"], batch_size=5, shard_index=host, shard_count=2,
                                   drop_remainder=False, shuffle=False, **read, **options)
    it = iter(resumed)
    it.set_state(state)
    batches += list(it)
    resumed.close()
    assert [int(b["mask"].sum()) for b in batches] == [5, 5, 3 - 3 * host]
    signatures |= {tuple(sorted((k, v.dtype.str, v.shape) for k, v in b.items())) for b in batches}
  assert len(signatures) == 1


def test_a_resumed_padding_only_batch_from_gcs_records(outputs, gcs_emulator, tmp_path):
  """The same from gs:// by ranged reads of records (fetch="records": a RecordStream)."""
  from tests.conftest import upload_tree

  _, _, options = CASES["ct_center"]
  gs = f"gs://{gcs_emulator}/batch/padding-only"
  upload_tree(outputs["ct_center", "array_record"], gs)
  opts = dict(batch_size=5, shard_index=1, shard_count=2, drop_remainder=False, shuffle=False, window_shards=1,
              fetch="records", cache_dir=str(tmp_path / "cache"), **options)
  ds = grain_loader.dataset(gs, **opts)
  it = iter(ds)
  first = next(it)
  next(it)
  state = it.get_state()
  ds.close()
  ds = grain_loader.dataset(gs, **opts)
  it = iter(ds)
  it.set_state(state)
  got = list(it)
  ds.close()
  assert len(got) == 1 and not got[0]["mask"].any()
  assert {k: (v.dtype, v.shape) for k, v in got[0].items()} == {k: (v.dtype, v.shape) for k, v in first.items()}


def test_where_names_the_shard_and_record(outputs):
  source = ShardedRecords(outputs["raw", "array_record"])
  assert source.where(0) == f"{_shard_path(source, 0)}: record 0"
  assert source.where(13) == f"{_shard_path(source, 1)}: record 1"  # 12 records in shard 0
  with pytest.raises(IndexError):
    source.where(len(source))


@pytest.mark.parametrize("fmt", ["array_record", "tfrecord"])
def test_a_flipped_byte_in_a_shard_names_the_shard_and_record(outputs, tmp_path, fmt):
  out = str(tmp_path / "broken")
  shutil.copytree(outputs["raw", fmt], out)
  source = ShardedRecords(out, verify="none")
  shard = _shard_path(source, 1)
  data = open(shard, "rb").read()
  at = data.index(source.raw(len(source) - 1)[-200:])  # inside the last record's payload
  flip_byte(shard, at + 50)
  source = ShardedRecords(out, verify="none")
  fill = BatchFiller(source, ExampleOptions(), 4, False)
  fill(np.arange(4), lambda j: None)  # shard 0 is intact
  last = len(source) - 1
  with pytest.raises(CorruptRecordError, match=rf"^{shard}: record {last - 12}\b"):
    fill([0, last], lambda j: None)


def _one_bad_record(tmp_path, features, good: list[bytes], bad: bytes, kind="image", fmt="array_record"):
  """An output whose record 3 (shard 0) is `bad`; its source and the message prefix that names it."""
  payloads = list(good)
  payloads[3] = bad
  source = ShardedRecords(write_output(str(tmp_path / "out"), features, payloads, kind, fmt))
  return source, f"{_shard_path(source, 0)}: record 3"


def _fill_all(source, **options):
  return BatchFiller(source, ExampleOptions(**options), len(source), False)(np.arange(len(source)), lambda j: None)


def test_a_raw_image_of_the_wrong_length_is_named(tmp_path):
  features, good = make_outputs.raw_images(np.random.default_rng(0), 8)
  bad = features.encode({"image": b"\x01" * 359, "label": 0, "file_name": "x"})  # 12x10x3 is 360
  source, where = _one_bad_record(tmp_path, features, good, bad)
  with pytest.raises(CorruptRecordError, match=rf"^{where}: feature 'image': 359 bytes, not the 360"):
    _fill_all(source)
  with pytest.raises(CorruptRecordError, match=rf"^{where}: "):  # the old path refuses it too
    source.get(3)


@pytest.mark.parametrize("damage,why", [
    (lambda r: r[:len(r) // 2], "runs past the end"),  # truncated
    (lambda r: r[:5] + b"\xff" + r[6:], ""),  # a length or tag changed
    (lambda r: b"\x0a\x00", r"record lacks features \['file_name', 'image', 'label'\]"),
])
def test_a_record_that_does_not_parse_is_named(tmp_path, damage, why):
  features, good = make_outputs.raw_images(np.random.default_rng(0), 8)
  source, where = _one_bad_record(tmp_path, features, good, damage(good[3]))
  with pytest.raises(CorruptRecordError, match=rf"^{where}: .*{why}"):
    _fill_all(source)
  with pytest.raises(CorruptRecordError, match=rf"^{where}: "):
    source.get(3)


def test_reasons_name_the_feature_not_its_value(tmp_path):
  features, good = make_outputs.raw_images(np.random.default_rng(0), 8)
  secret = "patient-0042-\udcff".encode("utf-8", "surrogateescape")  # not UTF-8
  bad = example.encode_example({"image": features["image"].encode_into("image", np.zeros((12, 10, 3), np.uint8))["image"],
                                "label": example.int64_feature([1]), "file_name": example.bytes_feature(secret)})
  source, where = _one_bad_record(tmp_path, features, good, bad)
  with pytest.raises(CorruptRecordError, match=rf"^{where}: feature 'file_name': not UTF-8") as e:
    _fill_all(source)
  assert "patient" not in str(e.value)
  with pytest.raises(CorruptRecordError):
    source.get(3)  # the old path refused it as well


def test_an_image_that_does_not_decode_is_named(tmp_path):
  features, good = make_outputs.jpeg_images(np.random.default_rng(0), 8)
  bad = features.encode({"image": b"\xff\xd8 not a jpeg", "label": 1, "file_name": "x"})
  source, where = _one_bad_record(tmp_path, features, good, bad)
  with pytest.raises(CorruptRecordError, match=rf"^{where}: feature 'image': does not decode as an image"):
    _fill_all(source, image_size=(8, 8))


@pytest.mark.parametrize("entries,why", [
    ({"label": example.float_feature([2.0])}, r"feature 'label': ValueError: ClassLabel: 1 float values, expected "
                                              r"one int64 value"),
    ({"label": example.int64_feature([2, 1])}, r"feature 'label': .*2 int64 values"),
    ({"label": example.int64_feature([3])}, r"feature 'label': ValueError: label 3 is outside \[0, 3\)"),
    ({"label": example.int64_feature([-1])}, r"feature 'label': ValueError: label -1 is outside \[0, 3\)"),
    ({"image": example.bytes_feature([b"\x00" * 360, b"second"])}, r"feature 'image': .*2 bytes values"),
    ({"image": example.bytes_feature([])}, r"feature 'image': .*0 bytes values"),
    ({"file_name": example.bytes_feature([])}, r"feature 'file_name': .*0 bytes values"),
])
def test_a_record_that_contradicts_its_schema_is_refused(tmp_path, entries, why):
  """A label in a FloatList, two labels, a label past the class names, an image of two values or none: each
  came back as data (the first value, a cut float, an id no class names; an empty list stopped a plain `for`
  over the records as if the split had ended). TFDS's parser refuses them as well."""
  features, good = make_outputs.raw_images(np.random.default_rng(0), 8)
  fields = {"image": example.bytes_feature(b"\x00" * 360), "label": example.int64_feature([1]),
            "file_name": example.bytes_feature("x"), **entries}
  source, where = _one_bad_record(tmp_path, features, good, example.encode_example(fields))
  with pytest.raises(CorruptRecordError, match=rf"^{where}: {why}"):
    _fill_all(source)
  with pytest.raises(CorruptRecordError, match=rf"^{where}: "):  # the old path refuses it too
    source.get(3)
  with pytest.raises(CorruptRecordError, match=rf"^{where}: "):  # iterating raises, never ends early
    list(source)


_FIXED = Features({"v": Tensor((), "int64"), "s": Tensor((), "uint8", encoding="none"), "label": ClassLabel(CLASSES)})
_DYNAMIC = Features({"d": Tensor((None, None, 3), "uint8"), "label": ClassLabel(CLASSES)})


@pytest.mark.parametrize("features,entries,why", [
    (_FIXED, {"v": example.int64_feature([-7])}, r"feature 'v': .*1 int64 values, expected one bytes value"),
    (_FIXED, {"s": example.int64_feature([300])}, r"feature 's': .*a value outside uint8's range"),  # was 44
    (_FIXED, {"s": example.float_feature([3.0])}, r"feature 's': .*1 float values, expected int64 values"),
    (_DYNAMIC, {"d/shape": example.int64_feature([4, 2])}, r"feature 'd': .*2 int64 values, expected 3 int64"),
    (_DYNAMIC, {"d/shape": example.int64_feature([2, 2, 1])}, r"feature 'd': .*stored shape \(2, 2, 1\), "
                                                              r"expected \(None, None, 3\)"),
])
def test_a_tensor_that_contradicts_its_spec_is_refused(tmp_path, features, entries, why):
  """A bytes Tensor in an Int64List (its int64's bytes were viewed as the array), an integer the dtype cannot
  hold (wrapped), a stored shape of another rank or other fixed sides (returned as stored)."""
  good = {"v": np.int64(1), "s": np.uint8(1), "d": np.zeros((1, 2, 3), np.uint8), "label": 1}
  payloads = [features.encode({k: good[k] for k in features}) for _ in range(8)]
  fields = {"v": example.bytes_feature(np.int64(3).tobytes()), "s": example.int64_feature([3]),
            "d/shape": example.int64_feature([1, 2, 3]), "d/value": example.bytes_feature(bytes(6)),
            "label": example.int64_feature([1]), **entries}
  bad = example.encode_example({k: v for k, v in fields.items() if k.split("/")[0] in features})
  source, where = _one_bad_record(tmp_path, features, payloads, bad, kind="tensors")
  if features is _FIXED:  # a dynamic shape is not batched: records one at a time
    with pytest.raises(CorruptRecordError, match=rf"^{where}: {why}"):
      _fill_all(source)
  with pytest.raises(CorruptRecordError, match=rf"^{where}: .*{why.split(': ', 1)[1]}"):
    source.get(3)


def test_a_graph_over_its_budget_raises_the_transforms_error(tmp_path):
  rng = np.random.default_rng(0)
  payloads = [make_outputs.GRAPH_FEATURES.encode(make_outputs.graph(rng, 3, 4)) for _ in range(6)]
  payloads[2] = make_outputs.GRAPH_FEATURES.encode(make_outputs.graph(rng, 5, 30))
  source = ShardedRecords(write_output(str(tmp_path / "g"), make_outputs.GRAPH_FEATURES, payloads, "graph"))
  options = {"max_nodes": 8, "max_edges": 10}
  with pytest.raises(ValueError) as old:
    old_path(source, ExampleOptions(**options), np.arange(6), 6, False)
  with pytest.raises(ValueError) as new:
    _fill_all(source, **options)
  assert type(new.value) is type(old.value)
  assert str(new.value) == str(old.value)
  assert "exceeds max_nodes=8, max_edges=10" in str(new.value)


# ---- readers ------------------------------------------------------------------------------------


def _open_fds() -> int:
  """Open descriptors of shard files (the process also holds other tests' sockets and pipes, which may
  close while a test counts)."""
  count = 0
  for fd in os.listdir("/proc/self/fd"):
    try:
      count += ".array_record-" in os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # closed since listed
      pass
  return count


def _read_all_from_threads(source, threads: int) -> None:
  barrier = threading.Barrier(threads)

  def work():
    barrier.wait()
    for i in range(len(source)):
      source.raw(i)
  ts = [threading.Thread(target=work) for _ in range(threads)]
  for t in ts:
    t.start()
  for t in ts:
    t.join()


def test_each_thread_reads_through_its_own_readers(outputs):
  source = ShardedRecords(outputs["raw", "array_record"])
  records = source._records
  mine = records.shard(0)
  assert records.shard(0) is mine
  assert records.shard(1) is not mine
  other = []
  t = threading.Thread(target=lambda: other.append(records.shard(0)))
  t.start()
  t.join()
  assert other[0] is not mine
  shared = ShardedRecords(outputs["raw", "tfrecord"])._records  # TFRecord: one os.pread reader for all threads
  t = threading.Thread(target=lambda: other.append(shared.shard(0)))
  t.start()
  t.join()
  assert other[1] is shared.shard(0)


def test_readers_are_closed(outputs):
  gc.collect()
  before = _open_fds()
  source = ShardedRecords(outputs["raw", "array_record"])
  source.raw(0)
  source.raw(len(source) - 1)
  turns = [threading.Event() for _ in range(4)]

  def long_lived():  # like grain's pool threads: alive when the source is closed, and reading after
    source.raw(0)
    turns[0].set()
    turns[1].wait()
    source.raw(len(source) - 1)
    turns[2].set()
    turns[3].wait()
  t = threading.Thread(target=long_lived, daemon=True)
  t.start()
  try:
    turns[0].wait()
    assert _open_fds() == before + 3  # main thread: 2 shards; the other: 1
    source.close()
    assert _open_fds() == before
    assert source.raw(1) == source.raw(1)  # reopened on demand
    turns[1].set()
    turns[2].wait()
    assert _open_fds() == before + 2
    source.close()  # the readers the other thread opened after the first close are closed too
    assert _open_fds() == before
  finally:
    for turn in turns:
      turn.set()
    t.join()
  source.raw(0)
  del source
  gc.collect()
  assert _open_fds() == before


def test_threads_that_end_take_their_readers_along(outputs):
  gc.collect()
  before = _open_fds()
  source = ShardedRecords(outputs["raw", "array_record"])
  for _ in range(30):  # many short-lived threads: the count of open files stays flat
    _read_all_from_threads(source, 3)
    assert _open_fds() <= before + 2 * 3
  gc.collect()
  assert _open_fds() == before  # every thread has ended: none of their readers is left
  del source
  gc.collect()
  assert _open_fds() == before


def test_a_thread_keeps_within_its_share_of_the_descriptor_limit(tmp_path, monkeypatch):
  features, payloads = make_outputs.raw_images(np.random.default_rng(0), 12)
  source = ShardedRecords(write_output(str(tmp_path / "four"), features, payloads, "image", num_shards=4))
  records = source._records
  monkeypatch.setattr(records, "_budget", 2)  # as if the process could open very few files
  gc.collect()
  before = _open_fds()
  for i in range(len(source)):  # 4 shards, read in turn
    source.raw(i)
  assert _open_fds() == before + 2
  assert list(records._local.readers.readers) == [2, 3]  # the most recent two
  source.raw(6)  # shard 2 again, then 0: shard 3 is the least recently used
  source.raw(0)
  assert _open_fds() == before + 2
  assert list(records._local.readers.readers) == [2, 0]
  assert [source.raw(i) for i in range(len(source))] == payloads
  source.close()
  assert _open_fds() == before


_XLA_GRAPHS = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from loaders import grain, xla
runs = []
for fast in (True, False):
  grain._ReadBatch.FAST = fast
  loader = xla.device_loader(sys.argv[2], batch_size=8, max_nodes=12, max_edges=20, num_threads=2, seed=1,
                             shard_index=0, shard_count=1)
  runs.append([{k: v.cpu().numpy() for k, v in b.items()} for b in loader])
same = all(list(a) == list(b) and all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)
           for a, b in zip(*runs))
print(json.dumps({"batches": [len(r) for r in runs], "same": same,
                  "keys": {k: [list(v.shape), str(v.dtype)] for k, v in runs[0][0].items()}}))
"""


@pytest.mark.slow
def test_xla_device_loader_reads_graph_records_through_the_filler(outputs):
  """torch_xla's loader goes through grain: graph records, masks included, reach the device the same on both paths."""
  env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
  r = subprocess.run([sys.executable, "-c", _XLA_GRAPHS, REPO, outputs["graph", "array_record"]], capture_output=True,
                     text=True, env=env, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert got["batches"] == [23 // 8, 23 // 8]
  assert got["same"]
  assert got["keys"]["node_mask"] == [[8, 12], "bool"]
  assert got["keys"]["edge_index"] == [[8, 2, 20], "int64"]
