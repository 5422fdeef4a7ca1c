"""CT patches read in place (loaders._batch._Patches): bit for bit the batches of the whole-record path.

Outputs of CT records larger than a 64 KiB block (int16 and float32 volumes; no label, class ids uint8 and
uint16, channels) over several ArrayRecord shards. Each batch filled from the records where they lie must
equal, key by key (order, dtype, shape, bytes), the batch of the same records read whole and decoded; only the
patch's bytes are read once a record is located; damaged records raise CorruptRecordError naming shard and
record; verify levels other than sha256, and TFRecord shards, read whole.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from formats.errors import CorruptRecordError
from formats.example import bytes_feature, decode_example, encode_example, float_feature, int64_feature
from formats.features import Features, Tensor
from formats.record_slices import ArrayRecordFile, locate_example
from formats.transforms import element_rng, foreground_counts, sampled_patch_start
from loaders import ExampleOptions, ShardedRecords, grain as grain_loader
from loaders import _batch
from loaders._batch import BatchFiller
from loaders._transforms import _cut
from tests.damage import flip_byte
from tests.loaders import make_outputs

PATCH = (6, 20, 24)
N = 9
CASES = ("int16", "float32", "int16-classes", "int16-classes300", "float32-channels")


def _records(case: str, seed: int) -> tuple[Features, list[bytes]]:
  """N records of `case` (volume dtype, label layout): depth 3..17, rows and columns 12..71 (up to 170 KB a
  volume, so most lie across block headers; some smaller than PATCH on an axis, for padding)."""
  dtype, _, label = case.partition("-")
  rng = np.random.default_rng(seed)
  if label:
    layout, classes = ("channels", 3) if label == "channels" else ("classes", int(label[7:] or 3))
    features, payloads = make_outputs.labelled_volumes(rng, N, layout, classes, depth=(3, 18), side=(12, 72),
                                                       blobs=(2, 6))
  else:
    features, payloads = make_outputs.volumes(rng, N, depth=(3, 18), side=(12, 72))
  if dtype == "int16":
    return features, payloads
  specs = dict(features.items())
  specs["volume"] = Tensor((None, None, None), "float32")
  float_features = Features(specs)
  out = []
  for data in payloads:
    rec = features.decode(data)
    rec["volume"] = rec["volume"].astype(np.float32) + rng.random(rec["volume"].shape, np.float32)
    out.append(float_features.encode(rec))
  return float_features, out


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, str]:
  base = tmp_path_factory.mktemp("patch_reads")
  out = {}
  for k, case in enumerate(CASES):
    features, payloads = _records(case, k)
    out[case] = make_outputs.write(str(base / case), features, {"train": payloads}, kind="volume", num_shards=3)
  return out


class _Whole:
  """A source of the same records without `record_bytes`: BatchFiller reads each whole (the reference)."""

  def __init__(self, source):
    self._source, self.kind, self.features = source, source.kind, source.features

  def raw(self, i):
    return self._source.raw(i)

  def where(self, i):
    return self._source.where(i)


class _NoWholeReads(ShardedRecords):
  """ShardedRecords whose whole-record reads fail: proves a batch came from the reads in place."""

  def raw(self, index):
    raise AssertionError(f"record {index} read whole")


def _equal(a: dict, b: dict) -> None:
  assert list(a) == list(b)
  for key in a:
    assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
    assert a[key].tobytes() == b[key].tobytes(), key


OPTIONS = {
    "center": dict(patch="center"),
    "random": dict(patch="random"),
    "positive": dict(patch="random", pos_fraction=0.5),
    "always positive": dict(patch="random", pos_fraction=1.0),
    "raw HU": dict(patch="random", normalize=False, hu_window=(-500.0, 900.0)),
    "patch larger than any volume": dict(patch="random", patch_size=(20, 80, 80)),
}


@pytest.mark.parametrize(("case", "name"), [(case, name) for case in CASES for name in sorted(OPTIONS)
                                             if "-" in case or "pos_fraction" not in OPTIONS[name]])
def test_patches_in_place_are_the_whole_record_patches(outputs, case, name):
  opts = {"patch_size": PATCH, **OPTIONS[name]}
  options = ExampleOptions(**opts)
  source = _NoWholeReads(outputs[case])
  in_place = BatchFiller(source, options, batch_size=4, with_mask=True)
  whole = BatchFiller(_Whole(ShardedRecords(outputs[case])), options, batch_size=4, with_mask=True)
  starts, padded = [], 0
  for position in range(8):  # every record, in several orders and draws; a short batch too
    indices = np.random.default_rng(position).permutation(N)[:4 if position % 3 else 3]
    got = in_place(indices, lambda j: element_rng(11, position, j))
    _equal(got, whole(indices, lambda j: element_rng(11, position, j)))
    for start, i in zip(got["patch_start"], indices):
      shape = np.array(source.features.decode(ShardedRecords(outputs[case]).raw(int(i)))["volume"].shape)
      starts.append((start, shape))
      padded += bool(np.any(start + options.patch_size > shape))
  assert padded  # patches that reach past the far end (padding)
  if options.patch == "random" and "larger" not in name:
    room = [np.maximum(shape - PATCH, 0) for _, shape in starts]
    assert any(np.any((s == r) & (r > 0)) for (s, _), r in zip(starts, room))  # at the far edge
    assert any(np.any((s == 0) & (r > 0)) for (s, _), r in zip(starts, room))  # at the near edge


def _reference_cut(array: np.ndarray, start, patch, fill, dtype) -> np.ndarray:
  """The specification's patch: `fill` everywhere, then the array's part at `start`."""
  part = array[tuple(slice(int(s), int(s) + p) for s, p in zip(start, patch))]
  out = np.full((*patch, *array.shape[3:]), fill, dtype)
  out[tuple(slice(0, n) for n in part.shape)] = part
  return out


@pytest.mark.parametrize("case", ["int16-classes", "float32-channels"])
def test_a_patch_at_every_corner_is_the_arrays_patch(outputs, case):
  source = ShardedRecords(outputs[case])
  for i in range(N):
    record, rec = source.record_bytes(i), source.get(i)
    layout = locate_example(record, {"volume/value", "label/value"})
    for name, fill, dtype in (("volume", -1024.0, np.float32), ("label", 0, np.int32)):
      array = rec[name]
      stored = _batch.StoredArray(record, layout.spans[f"{name}/value"][0], array.shape,
                                  source.features[name]._le_dtype)
      for patch in (PATCH, (1, 1, 1), tuple(d + 2 for d in array.shape[:3])):
        room = np.maximum(np.array(array.shape[:3]) - patch, 0)
        for corner in np.ndindex(2, 2, 2):
          start = np.array(corner) * room
          want = _reference_cut(array, start, patch, fill, dtype)
          assert np.array_equal(_cut(stored, start, patch, fill, dtype), want)
          slot = np.full(want.shape, 77, dtype)  # a batch slot holding another patch's values
          assert _cut(stored, start, patch, fill, dtype, slot) is slot and np.array_equal(slot, want)


def test_counts_given_to_sampled_patch_start_give_the_same_start():
  rng = np.random.default_rng(0)
  for _ in range(200):
    shape = tuple(int(v) for v in rng.integers(1, 12, 3))
    label = np.where(rng.random(shape) < rng.choice([0.0, 0.02, 0.3]), rng.integers(1, 4, shape), 0)
    for p in (None, 0.0, 0.4, 1.0):
      seed = int(rng.integers(0, 1 << 30))
      calls = []

      def counts():
        calls.append(1)
        return foreground_counts(label)
      want = sampled_patch_start(shape, PATCH, np.random.default_rng(seed), p, label)
      got = sampled_patch_start(shape, PATCH, np.random.default_rng(seed), p, label, counts)
      assert got.tolist() == want.tolist()
      assert len(calls) <= (p is not None and p > 0)


def test_a_located_record_reads_only_its_patch_and_counts_once(tmp_path, monkeypatch):
  """After the first batch, a batch reads exactly its boxes: per plane of a box, the bytes from its first row
  segment to the end of its last (volume and label), and the label plane holding the drawn foreground voxel."""
  features, payloads = _records("int16-classes", 1)  # a new output: none of its records located yet
  path = make_outputs.write(str(tmp_path / "out"), features, {"train": payloads}, kind="volume", num_shards=3)
  source = _NoWholeReads(path)
  records = [features.decode(ShardedRecords(path).raw(i)) for i in range(N)]
  read, located, counted = [], [], []
  pread, pread_into = ArrayRecordFile._pread, ArrayRecordFile.read_stream_into
  monkeypatch.setattr(ArrayRecordFile, "_pread", lambda self, a, b, what=None: read.append(b - a) or
                      pread(self, a, b, what))
  monkeypatch.setattr(ArrayRecordFile, "read_stream_into", lambda self, q, buf, what=None:
                      read.append(len(buf)) or pread_into(self, q, buf, what))
  locate = _batch.locate_example
  monkeypatch.setattr(_batch, "locate_example", lambda *a, **k: located.append(1) or locate(*a, **k))
  counts = _batch.foreground_counts
  monkeypatch.setattr(_batch, "foreground_counts", lambda label: counted.append(1) or counts(label))
  indices = [0, 1, 2, 4]
  assert all(records[i]["label"].any() for i in indices)  # pos_fraction=1: every patch centred on foreground

  def box_bytes(rec) -> int:
    d, h, w = rec["volume"].shape
    dz, dy, dx = min(d, PATCH[0]), min(h, PATCH[1]), min(w, PATCH[2])
    return sum(dz * ((dy - 1) * w * s + dx * s) for s in (2, 1)) + h * w  # volume, label, one label plane

  fill = BatchFiller(source, ExampleOptions(patch_size=PATCH, pos_fraction=1.0), batch_size=4, with_mask=False)
  for position in range(5):
    read.clear()
    fill(indices, lambda j: element_rng(2, position, j))
    if position == 0:  # located, and the labels streamed plane by plane to count their foreground
      assert sum(read) > sum(len(source.record_bytes(i)) for i in indices) // 3
    else:
      assert sum(read) == sum(box_bytes(records[i]) for i in indices)
  assert len(located) == 4 and len(counted) == 4  # each record located once, its label counted once
  again = BatchFiller(ShardedRecords(path), ExampleOptions(patch_size=PATCH, pos_fraction=1.0), 4, False)
  again(indices, lambda j: element_rng(2, 9, j))
  assert len(located) == 4 and len(counted) == 4  # and kept for the process: a new loader finds them


@pytest.mark.parametrize("case", ["int16", "float32-channels"])
def test_grain_batches_equal_the_decode_transform_path_and_resume(outputs, case, monkeypatch):
  path = outputs[case]
  opts = dict(batch_size=2, seed=3, num_epochs=2, num_threads=2, patch_size=PATCH)
  if "-" in case:
    opts["pos_fraction"] = 0.5
  fast = list(grain_loader.dataset(path, **opts))
  monkeypatch.setattr(grain_loader._ReadBatch, "FAST", False)  # source.get, the transform, fill_batch
  slow = list(grain_loader.dataset(path, **opts))
  monkeypatch.undo()
  assert len(fast) == len(slow) == 2 * (N // 2)
  for a, b in zip(fast, slow):
    _equal(a, b)
  ds = grain_loader.dataset(path, **opts)
  it = iter(ds)
  for _ in range(3):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  it2 = iter(grain_loader.dataset(path, **opts))
  it2.set_state(state)
  rest = list(it2)
  assert len(rest) == len(fast) - 3
  for a, b in zip(rest, fast[3:]):
    _equal(a, b)


def test_only_sha256_proven_array_record_shards_are_read_in_place(outputs, tmp_path):
  path = outputs["int16-classes"]
  assert ShardedRecords(path).record_bytes(0) is not None
  for level in ("size", "none", False):
    assert ShardedRecords(path, verify=level).record_bytes(0) is None
  features, payloads = _records("int16", 0)
  tf_path = make_outputs.write(str(tmp_path / "tf"), features, {"train": payloads}, kind="volume",
                               file_format="tfrecord")
  assert ShardedRecords(tf_path).record_bytes(0) is None
  opts = dict(batch_size=3, seed=1, patch_size=PATCH, pos_fraction=0.5, num_threads=1)
  want = list(grain_loader.dataset(path, **opts))
  for level in ("size", "none"):
    for a, b in zip(grain_loader.dataset(path, verify=level, **opts), want):
      _equal(a, b)


def _reencode(data: bytes, **changes: bytes) -> bytes:
  """The Example `data` with some features replaced (serialized Features), the rest as they were."""
  features = {}
  for key, value in decode_example(data).items():
    if isinstance(value, list):
      features[key] = bytes_feature(value)
    elif value.dtype == np.int64:
      features[key] = int64_feature(value)
    else:
      features[key] = float_feature(value)
  return encode_example({**features, **{k.replace("__", "/"): v for k, v in changes.items()}})


def _fill_both(path: str, options: ExampleOptions, indices) -> list[BaseException]:
  errors = []
  for source in (ShardedRecords(path), _Whole(ShardedRecords(path))):
    with pytest.raises(CorruptRecordError) as e:
      BatchFiller(source, options, batch_size=2, with_mask=False)(indices, lambda j: element_rng(0, 0, j))
    errors.append(e.value)
  return errors


def test_damaged_records_are_named_bad_records_in_place_as_whole(tmp_path):
  features, payloads = _records("int16-classes", 5)
  good = payloads[0]
  rec = features.decode(good)
  d, h, w = rec["volume"].shape
  layout = locate_example(good, {"volume/value"})
  a, _ = layout.spans["volume/value"]
  bad_tag = bytearray(good)
  bad_tag[a - 4] = 0x0B  # the BytesList's value tag (0x0a, then a 3-byte length): a group, not wire format
  bad_length = bytearray(good)
  assert bad_length[a - 1] < 0x7F
  bad_length[a - 1] += 1  # the value's length, one more: it runs past its BytesList
  damaged = {
      "a shape the bytes do not fill": _reencode(good, volume__shape=int64_feature([d, h, w + 1])),
      "a label of another shape": _reencode(good, label__shape=int64_feature([d, h + 1, w]),
                                            label__value=bytes_feature(np.zeros((d, h + 1, w), np.uint8).tobytes())),
      "a damaged tag": bytes(bad_tag),
      "a damaged length": bytes(bad_length),
      "a missing feature": encode_example({"volume/shape": int64_feature([d, h, w]),
                                           "volume/value": bytes_feature(rec["volume"].tobytes())}),
  }
  options = ExampleOptions(patch_size=PATCH, pos_fraction=0.5)
  for what, bad in damaged.items():
    path = make_outputs.write(str(tmp_path / what.replace(" ", "_")), features, {"train": [good, bad, good]},
                              kind="volume", num_shards=1)
    ShardedRecords(path).get(0)
    for e in _fill_both(path, options, [0, 1]):
      assert "record 1: " in str(e) and ".array_record" in str(e), (what, str(e))
      if what == "a missing feature":
        assert "record lacks features ['direction', " in str(e)
      assert "s0" not in str(e)  # no header value in the message
    with pytest.raises(CorruptRecordError, match="record 1: "):
      list(grain_loader.dataset(path, shuffle=False, batch_size=1, patch_size=PATCH, num_threads=1))


def test_a_shard_changed_or_truncated_under_the_loader_is_a_named_bad_record(outputs, tmp_path):
  features, payloads = _records("float32", 2)
  for damage in ("flip", "truncate"):
    path = make_outputs.write(str(tmp_path / damage), features, {"train": payloads}, kind="volume", num_shards=1)
    source = ShardedRecords(path)
    fill = BatchFiller(source, ExampleOptions(patch_size=PATCH), batch_size=2, with_mask=False)
    fill([0, 1], lambda j: element_rng(0, 0, j))
    shard = source.where(0).rpartition(": record")[0]
    if damage == "flip":
      flip_byte(shard, os.path.getsize(shard) // 2)
    else:
      os.truncate(shard, os.path.getsize(shard) // 2)
    with pytest.raises(CorruptRecordError, match=r"array_record-00000-of-00001: record \d+: the file changed"):
      fill([N - 1, 0], lambda j: element_rng(0, 1, j))
