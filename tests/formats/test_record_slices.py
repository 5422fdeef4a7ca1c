"""formats.record_slices: a record's bytes read where they lie in an ArrayRecord file, the Example walked in place,
boxes of a stored array read row segment by row segment; every result checked against array_record's reader,
formats.example and numpy, on records larger than a 64 KiB block that start mid-block."""

from __future__ import annotations

import os

import numpy as np
import pytest

from formats import arrayrecord
from formats.arrayrecord_index import (BLOCK_HEADER_SIZE, BLOCK_SIZE, CHUNK_HEADER_SIZE, file_position,
                                       stream_position, writes_plain_chunks)
from formats.errors import CorruptRecordError, ExampleDecodeError
from formats.example import FeatureFinder, bytes_feature, decode_example, encode_example, float_feature, int64_feature
from formats.features import Features, Tensor, Text
from formats.record_slices import ArrayRecordFile, StoredArray, locate_example
from tests.damage import flip_byte

FEATURES = {
    "int16": Features({"volume": Tensor((None, None, None), "int16"), "spacing": Tensor((3,), "float32", "none"),
                       "name": Text()}),
    "float32": Features({"volume": Tensor((None, None, None), "float32"), "spacing": Tensor((3,), "float32", "none"),
                         "name": Text()}),
    "channels": Features({"volume": Tensor((None, None, None, 3), "uint8"),
                          "spacing": Tensor((3,), "float32", "none"), "name": Text()}),
    "uint16": Features({"volume": Tensor((None, None, None), "uint16"), "spacing": Tensor((3,), "float32", "none"),
                        "name": Text()}),
}


def _array(rng: np.random.Generator, kind: str, shape) -> np.ndarray:
  if kind == "channels":
    return rng.integers(0, 256, (*shape, 3)).astype(np.uint8)
  if kind == "float32":
    return rng.normal(0, 500, shape).astype(np.float32)
  info = np.iinfo(kind)
  return rng.integers(info.min, info.max, shape, endpoint=True).astype(kind)


def _shard(tmp_path, kind: str, n: int = 5, seed: int = 0):
  """A shard of `n` records (the first small, the others up to 260 KB: several blocks each, at odd offsets)."""
  rng = np.random.default_rng(seed)
  arrays, payloads = [], []
  for i in range(n):
    shape = (3, 4, 5) if i == 0 else (int(rng.integers(6, 14)), int(rng.integers(20, 70)), int(rng.integers(30, 97)))
    arrays.append(_array(rng, kind, shape))
    payloads.append(FEATURES[kind].encode({"volume": arrays[-1], "spacing": rng.random(3).astype(np.float32),
                                           "name": f"r{i}" * int(rng.integers(1, 9))}))
  path = str(tmp_path / f"{kind}.array_record")
  arrayrecord.write_file(path, payloads)
  return path, arrays, payloads


def test_stream_and_file_positions_are_inverse_and_skip_block_headers():
  q = np.arange(0, 5 * BLOCK_SIZE, 7, dtype=np.int64)
  p = file_position(q)
  assert np.all(p % BLOCK_SIZE >= BLOCK_HEADER_SIZE)  # never inside a block header
  assert np.all(np.diff(p) >= 7) and np.array_equal(stream_position(p), q)
  assert file_position(0) == BLOCK_HEADER_SIZE and file_position(BLOCK_SIZE - BLOCK_HEADER_SIZE) == BLOCK_SIZE + 24
  assert stream_position(BLOCK_SIZE) == BLOCK_SIZE - BLOCK_HEADER_SIZE  # a chunk at a block boundary


def test_writer_options_that_store_records_as_they_are():
  assert writes_plain_chunks("group_size:1,transpose:false,pad_to_block_boundary:false,uncompressed,max_parallelism:1")
  assert not writes_plain_chunks("group_size:1,transpose:false,zstd:3")
  assert not writes_plain_chunks("group_size:1,transpose:true,uncompressed")


@pytest.mark.parametrize("kind", sorted(FEATURES))
def test_every_record_reads_as_array_records_reader_reads_it(tmp_path, kind):
  path, _, payloads = _shard(tmp_path, kind)
  starts = []
  with ArrayRecordFile(path) as f:
    assert len(f) == len(payloads)
    for i, want in enumerate(payloads):
      record = f.record(i)
      starts.append(file_position(record.start))
      assert len(record) == len(want)
      assert record[0:len(record)] == want
      rng = np.random.default_rng(i)
      for _ in range(40):  # slices and single bytes anywhere, across block headers too
        a = int(rng.integers(0, len(want)))
        b = int(rng.integers(a, min(len(want), a + 3 * BLOCK_SIZE) + 1))
        assert record[a:b] == want[a:b]
        assert record[a] == want[a]
      with pytest.raises(IndexError):
        record[len(want)]
  assert any(s % BLOCK_SIZE not in range(BLOCK_HEADER_SIZE, BLOCK_HEADER_SIZE + CHUNK_HEADER_SIZE + 8)
             for s in starts[1:])  # records begin mid-block
  assert any(s % 2 for s in starts)  # and at odd offsets: elements straddle block headers


@pytest.mark.parametrize("kind", sorted(FEATURES))
def test_boxes_and_planes_of_a_stored_array_are_numpys(tmp_path, kind):
  path, arrays, payloads = _shard(tmp_path, kind)
  dtype = FEATURES[kind]["volume"]._le_dtype
  straddled = 0
  with ArrayRecordFile(path) as f:
    for i, want in enumerate(arrays):
      record = f.record(i)
      layout = locate_example(record, {"volume/value"})
      a, b = layout.spans["volume/value"]
      assert b - a == want.nbytes
      stored = StoredArray(record, a, want.shape, dtype)
      assert len(stored) == len(want) and stored.shape == want.shape
      for z in (0, len(want) - 1, -1):
        assert np.array_equal(stored[z], want[z])
      assert np.array_equal(np.stack(list(stored)), want)
      assert np.array_equal(stored[0:len(want), 0:want.shape[1], 0:want.shape[2]], want)  # every row segment
      row = want[0, 0].nbytes
      rng = np.random.default_rng(i)
      for _ in range(60):  # boxes of 1..3 axes anywhere, past the far end too (clipped as numpy clips)
        axes = int(rng.integers(1, 4))
        start = [int(rng.integers(0, n + 1)) for n in want.shape[:axes]]
        key = tuple(slice(s, s + int(rng.integers(0, n + 3))) for s, n in zip(start, want.shape))
        got = stored[key]
        assert got.dtype == want.dtype and np.array_equal(got, want[key]), key
        assert stored.box_shape(key) == want[key].shape
        room = np.zeros(tuple(n + 2 for n in want[key].shape), np.float64)  # a region of a larger array
        region = room[tuple(slice(1, 1 + n) for n in want[key].shape)]
        stored.read_into(key, region)  # cast on the copy, as numpy's assignment casts
        assert np.array_equal(region, want[key].astype(np.float64)) and room.sum() == region.sum(), key
      for z in range(len(want)):  # count the rows of full-width boxes that a block header interrupts
        for y in range(want.shape[1]):
          p = file_position(record.start + a + (z * want.shape[1] + y) * row)
          straddled += (p % BLOCK_SIZE) + row > BLOCK_SIZE
  assert straddled >= 3  # rows that a block header interrupts were read (by the box of every row)
  with ArrayRecordFile(path) as f:
    stored = StoredArray(f.record(1), 0, arrays[1].shape, dtype)
    with pytest.raises(TypeError):
      stored[0:2, 0:2, 0:2, 0:1]
    with pytest.raises(TypeError):
      stored[::2]
    with pytest.raises(IndexError):
      stored[len(arrays[1])]
    with pytest.raises(IndexError):
      StoredArray(f.record(1), 10, (len(payloads[1]),), np.uint8)


def test_row_segments_at_every_offset_around_a_block_header(tmp_path):
  """Segments ending just before, at and just after each block boundary, and straddling it by 1 to length - 1
  bytes, in groups of strided rows: each is the record's bytes."""
  payload = np.random.default_rng(3).integers(0, 256, 5 * BLOCK_SIZE, dtype=np.uint8).tobytes()
  path = str(tmp_path / "one.array_record")
  arrayrecord.write_file(path, [b"x" * 1001, payload])
  with ArrayRecordFile(path) as f:
    record = f.record(1)
    for length in (1, 2, 7, 300):
      for block in (1, 2, 4):
        boundary = block * BLOCK_SIZE
        starts = []
        for d in range(-length - 2, 3):  # the segment's first byte relative to the boundary
          p = boundary + d if d < 0 else boundary + BLOCK_HEADER_SIZE + d
          starts.append(stream_position(p) - record.start)
        starts = np.array(starts, np.int64)
        out = np.empty((len(starts), 1, length), np.uint8)
        record.copy_rows(starts[:, None], length, length, out)
        for s, row in zip(starts.tolist(), out[:, 0]):
          assert row.tobytes() == payload[s:s + length], (length, block, s)
        for stride in (length, length + 5, 4099):  # strided groups that cross the boundary
          group = starts[0] - 3 * stride + stride * np.arange(8, dtype=np.int64)
          out = np.empty((1, 8, length), np.uint8)
          record.copy_rows(group[None, :], length, stride, out)
          assert [r.tobytes() for r in out[0]] == [payload[s:s + length] for s in group.tolist()]


def test_locate_example_finds_what_decode_example_finds(tmp_path):
  path, _, payloads = _shard(tmp_path, "int16")
  with ArrayRecordFile(path) as f:
    for i, data in enumerate(payloads):
      for record in (data, f.record(i)):
        layout = locate_example(record, {"volume/value"})
        whole = decode_example(data)
        assert layout.keys() == set(whole)
        (kind, spans), = FeatureFinder(["volume/value"])(data)
        assert layout.spans == {"volume/value": spans[0]}
        for key, value in layout.values.items():
          want = whole[key]
          assert (np.array_equal(value, want) if isinstance(want, np.ndarray) else value == want), key


def _varint(n: int) -> bytes:
  out = bytearray()
  while n > 0x7F:
    out.append(n & 0x7F | 0x80)
    n >>= 7
  return bytes(out) + bytes([n])


def _field(number: int, payload: bytes) -> bytes:
  """A LEN field of wire format."""
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _entry(key: str, feature: bytes | None) -> bytes:
  """A Features map entry: key, then value (none when `feature` is None)."""
  return _field(1, _field(1, key.encode()) + (b"" if feature is None else _field(2, feature)))


def test_forms_the_walk_does_not_read_are_left_to_decode_example():
  value = bytes_feature(b"\x01\x02" * 40)
  shape = int64_feature([2, 4, 10])
  good = encode_example({"v": value, "s": shape})
  assert good == _field(1, _entry("s", shape) + _entry("v", value))
  assert locate_example(good, {"v"}).spans == {"v": (len(good) - 80, len(good))}
  forms = {
      "a key twice": _field(1, _entry("v", value) * 2 + _entry("s", shape)),
      "two Features fields": _field(1, _entry("v", value)) + _field(1, _entry("s", shape)),
      "an unknown field first": b"\x10\x01" + good,
      "two values in the BytesList": encode_example({"v": bytes_feature([b"ab", b"cd"]), "s": shape}),
      "the in-place key as a FloatList": encode_example({"v": float_feature([1.0, 2.0]), "s": shape}),
      "an entry without a value": _field(1, _entry("v", value) + _entry("s", None)),
      "an entry's value before its key": _field(1, _field(1, _field(2, value) + _field(1, b"v"))),
  }
  for what, data in forms.items():
    decode_example(data)  # valid wire format: decode_example reads each
    assert locate_example(data, {"v"}) is None, what
  assert locate_example(encode_example({"v": value, "big": bytes_feature(b"x" * 5000)}), {"v"}, 1000) is None


def test_damaged_examples_are_refused_as_decode_example_refuses_them():
  """Every single-byte change of a small Example's structure: the walk refuses it exactly when decode_example
  does, leaves it to decode_example, or finds what decode_example finds."""
  data = encode_example({"volume/value": bytes_feature(bytes(range(60))), "volume/shape": int64_feature([3, 4, 5]),
                         "spacing": float_feature([1.0, 2.0, 3.0]), "name": bytes_feature("abc")})
  refused = found = 0
  for at in range(len(data)):
    for value in (0x00, 0x7F, 0x80, 0xFF, data[at] ^ 0x01, data[at] + 2 & 0xFF):
      bad = bytearray(data)
      bad[at] = value
      bad = bytes(bad)
      try:
        want = decode_example(bad)
      except ExampleDecodeError:
        want = None
      try:
        got = locate_example(bad, {"volume/value"})
      except ExampleDecodeError:
        assert want is None, (at, value)
        refused += 1
        continue
      if got is None:
        continue
      assert want is not None, (at, value)
      assert got.keys() == set(want), (at, value)
      for key, (a, b) in got.spans.items():
        assert bytes(want[key][0]) == bad[a:b]
      found += 1
  assert refused > 50 and found > 50


def _damaged_copy(tmp_path, path: str, at: int, value: bytes) -> str:
  bad = str(tmp_path / "bad.array_record")
  with open(path, "rb") as f:
    data = bytearray(f.read())
  data[at:at + len(value)] = value
  with open(bad, "wb") as f:
    f.write(data)
  return bad


def test_a_chunk_header_or_record_size_that_disagrees_with_the_footer_names_file_and_record(tmp_path):
  path, _, payloads = _shard(tmp_path, "int16")
  with ArrayRecordFile(path) as f:
    begin = f.index.byte_range(2)[0]
  header = file_position(stream_position(begin))  # the chunk header's first byte
  data_size_at = header + 8
  with open(path, "rb") as f:
    f.seek(data_size_at)
    data_size = int.from_bytes(f.read(8), "little")
  bad = _damaged_copy(tmp_path, path, data_size_at, (data_size + 1).to_bytes(8, "little"))
  with ArrayRecordFile(bad) as f:
    assert f.record(1)[0:10] == payloads[1][:10]  # its neighbours read as before
    with pytest.raises(CorruptRecordError, match=r"bad.array_record: record 2 \(chunk at \d+\): \d+ data bytes end"):
      f.record(2)
  sizes_at = header + CHUNK_HEADER_SIZE + 1  # compression byte, then sizes_len
  bad = _damaged_copy(tmp_path, path, sizes_at + 1, b"\x05")  # the record's size, shortened
  with ArrayRecordFile(bad) as f:
    with pytest.raises(CorruptRecordError, match=r"record 2 .*: record sizes end at"):
      f.record(2)
  bad = _damaged_copy(tmp_path, path, header + 24, b"\x74")  # chunk type: transposed
  with ArrayRecordFile(bad) as f:
    with pytest.raises(CorruptRecordError, match=r"record 2 .*: chunk type 0x74 .* not a simple chunk"):
      f.record(2)
  bad = _damaged_copy(tmp_path, path, header + CHUNK_HEADER_SIZE, b"\x7a")  # compression: zstd
  with ArrayRecordFile(bad) as f:
    with pytest.raises(CorruptRecordError, match=r"record 2 .*: not stored uncompressed"):
      f.record(2)


def test_a_truncated_file_is_refused_at_open_and_while_read(tmp_path):
  path, arrays, _ = _shard(tmp_path, "float32")
  short = _damaged_copy(tmp_path, path, 0, b"")
  os.truncate(short, os.path.getsize(short) - 100)
  with pytest.raises(CorruptRecordError):
    ArrayRecordFile(short)
  with ArrayRecordFile(path) as f:
    record = f.record(len(arrays) - 1)
    f.check_unchanged()
    layout = locate_example(record, {"volume/value"})
    stored = StoredArray(record, layout.spans["volume/value"][0], arrays[-1].shape, np.dtype("<f4"))
    os.truncate(path, f.index.byte_range(1)[0])  # shrinks under the open file
    with pytest.raises(CorruptRecordError, match=r"float32.array_record: the file changed"):
      f.check_unchanged()
    with pytest.raises(CorruptRecordError, match=rf"float32.array_record: record {len(arrays) - 1}: the file ends"):
      stored[0:2, 0:5, 0:5]


def test_a_changed_file_is_told_by_check_unchanged(tmp_path):
  path, _, _ = _shard(tmp_path, "int16")
  with ArrayRecordFile(path) as f:
    f.check_unchanged()
    os.utime(path, ns=(1, 1))
    flip_byte(path, 100)
    with pytest.raises(CorruptRecordError, match="changed"):
      f.check_unchanged()


def test_compressed_files_are_left_to_array_records_reader(tmp_path):
  path = str(tmp_path / "zstd.array_record")
  writer = arrayrecord.array_record_module.ArrayRecordWriter(path, "group_size:1,zstd")
  writer.write(b"x" * 1000)
  writer.close()
  with pytest.raises(ValueError, match="uncompressed"):
    ArrayRecordFile(path)
