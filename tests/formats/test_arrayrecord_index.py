"""formats.arrayrecord_index: record byte ranges from the tail alone, and verified ranged reads."""

from __future__ import annotations

import os
import pickle
import re

import numpy as np
import pytest
from array_record.python import array_record_module

from formats import arrayrecord
from formats import arrayrecord_index as ai
from formats.errors import CorruptRecordError

B = ai.BLOCK_SIZE


def _records(n: int, size: int | None, seed: int) -> list[bytes]:
  rng = np.random.default_rng(seed)
  return [rng.bytes(i % 31 if size is None else size) for i in range(n)]


# name -> (records, writer options or None for formats.arrayrecord.write_file)
SHARDS = {
    "tiny": (lambda: _records(10, None, 1), None),  # 0..9 bytes, an empty record first
    "100KB": (lambda: _records(5, 100_000, 2), None),  # chunks cross block boundaries
    "one": (lambda: _records(1, 7, 3), None),
    "empty": (lambda: [], None),
    "5000": (lambda: _records(5000, 40, 4), None),  # the footer crosses a block boundary
    "group3": (lambda: _records(7, 10, 5), "group_size:3,uncompressed"),
    "transposed": (lambda: _records(7, 10, 6), "group_size:2,transpose:true,uncompressed"),
}


class Shard:
  """A written file, its bytes and records, and a read_range that counts what it was asked for."""

  def __init__(self, path: str, records: list[bytes], options: str | None):
    if options is None:
      assert arrayrecord.write_file(path, records) == len(records)
    else:
      writer = array_record_module.ArrayRecordWriter(path, options)
      for record in records:
        writer.write(record)
      writer.close()
    self.path = path
    self.records = records
    with open(path, "rb") as f:
      self.data = f.read()
    self.calls: list[tuple[int, int]] = []

  def read_range(self, start: int, stop: int) -> bytes:
    assert 0 <= start <= stop <= len(self.data), (start, stop)
    self.calls.append((start, stop))
    return self.data[start:stop]

  def index(self, **kwargs) -> ai.RecordIndex:
    return ai.record_ranges(self.read_range, len(self.data), name=self.path, **kwargs)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Shard]:
  folder = tmp_path_factory.mktemp("arrayrecord_index")
  return {name: Shard(str(folder / f"{name}.array_record"), make(), options)
          for name, (make, options) in SHARDS.items()}


class GarbageFile:
  """A local file of the shard's size, 0xFF everywhere but the index's tail pieces, read by the C++ reader.

  `read(i, start, stop)` copies the shard's bytes [start, stop) in, reads
  record i and puts the garbage back: the record comes out right only if the
  C++ reader needs nothing outside the tail and [start, stop).
  """

  def __init__(self, path: str, shard: Shard, index: ai.RecordIndex):
    self.shard = shard
    self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    os.pwrite(self.fd, b"\xff" * len(shard.data), 0)
    for offset, piece in index.tail:
      assert shard.data[offset : offset + len(piece)] == piece
      os.pwrite(self.fd, piece, offset)
    self.reader = arrayrecord.open_reader(path)
    assert self.reader.ok() and self.reader.num_records() == len(shard.records)

  def read(self, i: int, start: int, stop: int) -> bytes:
    os.pwrite(self.fd, self.shard.data[start:stop], start)
    try:
      return self.reader.read([i])[0]
    finally:
      os.pwrite(self.fd, b"\xff" * (stop - start), start)

  def close(self) -> None:
    self.reader.close()
    os.close(self.fd)


@pytest.mark.parametrize("name", list(SHARDS))
def test_each_range_alone_gives_its_record_through_the_cpp_reader(shards, tmp_path, name):
  shard = shards[name]
  index = shard.index()
  assert len(index) == arrayrecord.num_records(shard.path) == len(shard.records)
  offsets = index.chunk_offsets
  # the ranges tile the chunks exactly: from after the signature chunk to the footer, no gaps
  if len(index):
    assert offsets[0] == 64 and np.all(np.diff(offsets) > 0)
  assert offsets[-1] == index.footer_offset
  ranges = index.ranges()
  garbage = GarbageFile(str(tmp_path / "garbage"), shard, index)
  try:
    for i, record in enumerate(shard.records):
      start, stop = index.byte_range(i)
      assert (start, stop, index.index_in_chunk(i)) == tuple(ranges[i])
      k = i // index.group_size
      assert (start, stop) == (offsets[k], offsets[k + 1])  # with the tiling above: no byte twice or never
      assert index.index_in_chunk(i) == i % index.group_size
      assert garbage.read(i, start, stop) == record, i
  finally:
    garbage.close()
  with pytest.raises(IndexError):
    index.byte_range(len(index))


def test_the_shards_cover_the_layouts_they_are_meant_to(shards):
  big = shards["100KB"].index()
  assert all(a // B != (b - 1) // B for a, b in zip(big.chunk_offsets[:-1], big.chunk_offsets[1:]))
  many = shards["5000"].index()
  (_, postscript), (footer_at, footer) = many.tail
  assert footer_at // B != (footer_at + len(footer) - 1) // B  # the footer chunk holds a block header
  assert shards["group3"].index().group_size == 3
  assert shards["group3"].index().num_chunks == 3
  assert "transpose:true" in shards["transposed"].index().writer_options


@pytest.mark.parametrize("name", ["tiny", "100KB"])
def test_both_ends_of_each_range_are_needed(shards, tmp_path, name):
  shard = shards[name]
  index = shard.index()
  garbage = GarbageFile(str(tmp_path / "garbage"), shard, index)
  try:
    for i in range(len(index)):
      start, stop = index.byte_range(i)
      for missing in (start, stop - 1):
        os.pwrite(garbage.fd, shard.data[start:stop], start)
        os.pwrite(garbage.fd, bytes([shard.data[missing] ^ 0x01]), missing)
        with pytest.raises(RuntimeError, match="hash mismatch"):
          garbage.reader.read([i])
      assert garbage.read(i, start, stop) == shard.records[i]
  finally:
    garbage.close()


@pytest.mark.parametrize("name", list(SHARDS))
@pytest.mark.parametrize("first_read", [B, 2 * B, 4 * B])
def test_reads_only_the_tail(shards, name, first_read):
  shard = shards[name]
  shard.calls.clear()
  index = shard.index(first_read=first_read)
  size = len(shard.data)
  asked = sum(stop - start for start, stop in shard.calls)
  # the tail is [footer_offset, size): footer chunk, padding to a block boundary, postscript block
  tail = size - index.footer_offset
  assert asked == min(size, max(first_read, tail))
  footer_chunk = len(index.tail[1][1])
  assert asked <= max(first_read, B + footer_chunk + B)
  assert len(shard.calls) == (1 if min(size, first_read) >= tail else 2)
  assert shard.calls[0] == (max(0, size - first_read), size)
  if first_read == B:
    assert all(start >= index.footer_offset for start, _ in shard.calls)


def test_verified_reader_reads_one_range_per_record_and_frees_its_blocks(shards):
  shard = shards["100KB"]
  index = shard.index()
  with ai.VerifiedRecordReader(index, shard.read_range) as reader:
    empty = reader.allocated_bytes
    assert empty <= 2 * 4096  # the tail's blocks
    for i in [3, 0, 4, 1, 2, 3]:
      shard.calls.clear()
      assert reader.read(i) == shard.records[i]
      assert shard.calls == [index.byte_range(i)]
      assert reader.allocated_bytes == empty
  assert ai.read_record(index, 2, shard.read_range) == shard.records[2]


def test_verified_reader_frees_blocks_without_punch_hole(shards, monkeypatch):
  monkeypatch.setattr(ai, "_punch_hole", lambda fd, offset, length: False)
  shard = shards["100KB"]
  with ai.VerifiedRecordReader(shard.index(), shard.read_range) as reader:
    empty = reader.allocated_bytes
    for i in [4, 0, 2]:
      assert reader.read(i) == shard.records[i]
      assert reader.allocated_bytes == empty


def test_verified_reader_refuses_damaged_chunks(shards):
  shard = shards["100KB"]
  index = shard.index()

  def flipped(at):
    def fetch(start, stop):
      data = bytearray(shard.data[start:stop])
      data[at(start, stop)] ^= 0x01
      return bytes(data)
    return fetch

  for where in (lambda a, b: 0, lambda a, b: 30, lambda a, b: B - a % B + 5, lambda a, b: (b - a) // 2,
                lambda a, b: b - a - 1):  # header hash, header, a block header, data, the last byte
    with ai.VerifiedRecordReader(index, flipped(where)) as reader:
      with pytest.raises(CorruptRecordError, match=r"record 1 \(chunk bytes \[.*hash mismatch"):
        reader.read(1)
  with ai.VerifiedRecordReader(index, lambda a, b: shard.data[a : b - 1]) as reader:
    with pytest.raises(CorruptRecordError, match="fetched"):
      reader.read(1)
  with ai.VerifiedRecordReader(index, lambda a, b: shard.data[a + 1 : b + 1]) as reader:
    with pytest.raises(CorruptRecordError):
      reader.read(1)
    with pytest.raises(IndexError):
      reader.read(5)
  reader.close()
  with pytest.raises(ValueError, match="closed"):
    reader.read(0)


def test_index_pickles(shards):
  index = shards["5000"].index()
  copy = pickle.loads(pickle.dumps(index))
  assert np.array_equal(copy.ranges(), index.ranges()) and copy.tail == index.tail


def _same(a: ai.RecordIndex, b: ai.RecordIndex) -> bool:
  return (np.array_equal(a.chunk_offsets, b.chunk_offsets) and a.group_size == b.group_size
          and a.num_records == b.num_records)


def _flip_outcomes(shard: Shard, positions) -> dict[str, int]:
  """Flips each byte in turn: the index must be refused, or be the true one (then the C++ check refuses it)."""
  truth = shard.index()
  size = len(shard.data)
  outcomes = {"refused": 0, "refused by the C++ hash check": 0, "unread": 0}
  for at in positions:
    read_range = _flipped(shard.data, at)
    try:
      index = ai.record_ranges(read_range, size, verify=False)
    except CorruptRecordError:
      outcomes["refused"] += 1
      continue
    assert _same(index, truth), f"byte {at}: wrong ranges"
    covered = any(offset <= at < offset + len(piece) for offset, piece in truth.tail)
    if not covered:  # padding the C++ reader does not look at either
      outcomes["unread"] += 1
      continue
    with pytest.raises(CorruptRecordError, match=r"\(its tail\): the ArrayRecord reader refuses the file"):
      ai.record_ranges(read_range, size)
    outcomes["refused by the C++ hash check"] += 1
  return outcomes


def test_every_flipped_tail_byte_is_refused_or_harmless(shards):
  shard = shards["tiny"]
  index = shard.index()
  (postscript_at, postscript), (footer_at, footer) = index.tail
  positions = [*range(footer_at, footer_at + len(footer)), *range(postscript_at, postscript_at + len(postscript)),
               footer_at + len(footer) + 50, len(shard.data) - 1]
  outcomes = _flip_outcomes(shard, positions)
  assert outcomes["unread"] == 2
  assert outcomes["refused"] > 0 and outcomes["refused by the C++ hash check"] > 0


def test_flipped_bytes_in_a_footer_across_blocks_are_refused_or_harmless(shards):
  shard = shards["5000"]
  (_, _), (footer_at, footer) = shard.index().tail
  boundary = (footer_at // B + 1) * B
  positions = [*range(footer_at, footer_at + 64), *range(boundary - 4, boundary + 28),
               *range(footer_at + 200, footer_at + len(footer), 997), footer_at + len(footer) - 1]
  outcomes = _flip_outcomes(shard, positions)
  assert outcomes["unread"] == 0


def _flipped(data: bytes, at: int, mask: int = 0x01):
  damaged = bytearray(data)
  damaged[at] ^= mask
  return lambda a, b: bytes(damaged[a:b])


def test_damaged_structure_is_named_without_the_hash_check(shards):
  shard = shards["5000"]
  index = shard.index()
  (postscript_at, postscript), (footer_at, footer) = index.tail
  boundary = (footer_at // B + 1) * B
  size = len(shard.data)
  cases = {  # byte flipped -> what the message names
      postscript_at + 8: "block header at .* points to a chunk at",  # previous_chunk
      boundary + 16: "block header at .* points to a chunk at",  # the footer's own block header: next_chunk
      postscript_at + 24 + 8 + 3: "would end at .* past",  # the postscript's data_size, + 2**24
      postscript_at + len(postscript) - 1: "RiegeliPostscript copies that do not all agree",  # the last copy's magic
      footer_at + 24: "footer at .* is a signature chunk, not a simple chunk",  # chunk_type 'r' -> 's'
      footer_at + 25: "footer at .*: record sizes end at",  # num_records 5001 -> 5000
  }
  assert footer_at % B > 24 + 40  # the footer's header is not interrupted
  for at, message in cases.items():
    with pytest.raises(CorruptRecordError, match=message):
      ai.record_ranges(_flipped(shard.data, at), size, verify=False)
  # one copy's magic, then all three: only the last is a wrong magic
  magic = bytes.fromhex("10dec0ebfe84cec3c971")  # field 2, varint 0x71930e704fdae05e
  damaged = bytearray(shard.data)
  at = postscript_at
  for _ in range(3):
    at = shard.data.index(magic, at + 1)
    damaged[at + 1] ^= 0x01
  assert damaged[postscript_at:postscript_at + len(postscript)].count(magic) == 0
  damaged_range = lambda a, b: bytes(damaged[a:b])  # noqa: E731
  with pytest.raises(CorruptRecordError, match="magic"):
    ai.record_ranges(damaged_range, size, verify=False)


@pytest.mark.parametrize("cut", [1, 24, 1000, B - 1, B, B + 1000, 2 * B])
def test_truncated_files_are_refused(shards, cut):
  for name in ("tiny", "5000"):
    data = shards[name].data[: len(shards[name].data) - cut]
    with pytest.raises(CorruptRecordError):
      ai.record_ranges(lambda a, b: data[a:b], len(data))


def test_wrong_sizes_and_short_reads_are_refused(shards):
  data = shards["tiny"].data
  with pytest.raises(CorruptRecordError, match="at least 65536"):
    ai.record_ranges(lambda a, b: data[a:b], B - 1)
  with pytest.raises(ValueError, match="returned"):
    ai.record_ranges(lambda a, b: data[a : b - 1], len(data))
  with pytest.raises(CorruptRecordError):  # the postscript is not at size - 64 KiB
    ai.record_ranges(lambda a, b: (data + bytes(100))[a:b], len(data) + 100)


def test_compressed_footers_are_refused_as_unsupported(tmp_path):
  shard = Shard(str(tmp_path / "zstd.array_record"), _records(3, 10, 7), "group_size:1")
  with pytest.raises(ValueError, match="zstd-compressed") as raised:
    shard.index()
  assert not isinstance(raised.value, CorruptRecordError)


@pytest.mark.parametrize("message, why", [
    (b"\x08\xff", "a varint runs past its bytes or over 64 bits"),
    (b"\x08" + b"\xff" * 10, "a varint runs past its bytes or over 64 bits"),
    (b"\x0a\x05ab", "field 1 runs past the message's 4 bytes"),
    (b"\x0d\x01", "field 1 runs past the message's 2 bytes"),
    (b"\x0b", "field 1 has wire type 3"),
    (b"\x00\x01", "field number 0"),
])
def test_a_malformed_proto_in_the_tail_is_named(message, why):
  """The footer's and postscript's protos go through formats.protowire; its refusals keep their wording here."""
  with pytest.raises(CorruptRecordError, match=f"^footer: {re.escape(why)}$"):
    ai._fields(message, "footer")


def test_a_malformed_record_size_varint_is_named():
  chunk = ai._Chunk(0, 64, ai._SIMPLE, 1, 0, b"\x00\x80", b"")  # uncompressed, sizes_len cut short
  with pytest.raises(CorruptRecordError, match=r"^footer: a varint runs past its bytes or over 64 bits$"):
    ai._simple_records(chunk, "footer")


def test_a_footer_number_past_int64_is_named_not_an_overflow():
  """A chunk count of 2**63 (a valid varint) raised OverflowError storing it in the int64 index."""
  assert ai._uint({3: 2**63 - 1}, 3, "footer") == 2**63 - 1
  with pytest.raises(CorruptRecordError, match=r"^footer: field 3 is 9223372036854775808, beyond any file$"):
    ai._uint({3: 2**63}, 3, "footer")
