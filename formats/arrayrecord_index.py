"""Where each record of an ArrayRecord file lies, from the file's tail alone; verified ranged reads.

A host that wants only its own records of a gs:// shard reads the tail once
(`record_ranges`: 1 or 2 ranged reads), then one ranged read per record: the
byte range of the riegeli chunk holding it. `VerifiedRecordReader` checks each
fetched chunk with array_record's C++ reader (riegeli's 64-bit HighwayHash of
every chunk and block header), by placing the tail and the chunk at their
offsets in a sparse local file of the shard's size and freeing the chunk's
blocks after the read.

The bytes on disk (riegeli/records, google/riegeli
doc/riegeli_records_file_format.md; ArrayRecord, google/array_record
cpp/layout.proto, cpp/array_record_writer.cc), all integers little-endian:

  block header (24 bytes) at every multiple of 65536, inside whatever chunk
    is there: header_hash u64 | previous_chunk u64 (block - chunk begin) |
    next_chunk u64 (chunk end - block)
  chunk: header (40 bytes: header_hash u64 | data_size u64 | data_hash u64 |
    chunk_type u8 | num_records u56 | decoded_data_size u64), data_size bytes
    of data, padding; block headers interrupt it anywhere, header included
  simple chunk ('r') data: compression u8 (0: none) | varint sizes_len |
    num_records varint record sizes | the records, concatenated
  ArrayRecord file: signature chunk at 0 | user chunks | footer chunk at F |
    padding chunk | postscript chunk at size - 65536 | padding chunk
  postscript: simple chunk of 3 identical RiegeliPostscript protos
    {1: footer_offset F, 2: magic 0x71930e704fdae05e}
  footer: simple chunk of RiegeliFooterMetadata {1: {1: version 1,
    2: num_chunks, 3: num_records, 4: writer options}} then num_chunks
    ArrayRecordFooter protos {1: chunk_offset, 2: decoded_data_size,
    3: num_records}

Chunk k is the bytes [chunk_offset[k], chunk_offset[k + 1]) (F after the
last), exactly what the C++ reader reads for it; record i is record i % G of
chunk i // G, G the first chunk's record count, as the C++ reader computes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import os
import struct
import tempfile
import threading
from collections.abc import Callable

import numpy as np

from formats import protowire
from formats._closing import Closing
from formats.arrayrecord import RANDOM_ACCESS_READER_OPTIONS, open_checked
from formats.errors import CorruptRecordError, WireFormatError

__all__ = ["BLOCK_HEADER_SIZE", "BLOCK_SIZE", "CHUNK_HEADER_SIZE", "SIMPLE_CHUNK", "ChunkHeader", "ReadRange",
           "RecordIndex", "VerifiedRecordReader", "chunk_end", "file_position", "read_record", "record_ranges",
           "stream_position", "writes_plain_chunks"]

ReadRange = Callable[[int, int], bytes]
"""`read_range(start, stop)` returns exactly the bytes [start, stop) of the file (an HTTP Range read)."""

BLOCK_SIZE = 1 << 16
_BLOCK_HEADER = struct.Struct("<QQQ")  # header_hash, previous_chunk, next_chunk
# header_hash, data_size, data_hash, chunk_type | num_records << 8, decoded_data_size
_CHUNK_HEADER = struct.Struct("<QQQQQ")
_USABLE_BLOCK_SIZE = BLOCK_SIZE - _BLOCK_HEADER.size
_SIGNATURE_CHUNK_SIZE = 64  # the file signature chunk: block header + an empty chunk
_SIMPLE, _TRANSPOSED, _PADDING, _SIGNATURE, _METADATA = 0x72, 0x74, 0x70, 0x73, 0x6D
_COMPRESSIONS = {0x62: "brotli", 0x7A: "zstd", 0x73: "snappy"}  # riegeli's; 0 is none
_MAGIC = 0x71930E704FDAE05E
BLOCK_HEADER_SIZE = _BLOCK_HEADER.size
CHUNK_HEADER_SIZE = _CHUNK_HEADER.size
SIMPLE_CHUNK = _SIMPLE
_VERSION = 1
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


@dataclasses.dataclass(frozen=True, eq=False)
class RecordIndex:
  """The chunk byte ranges of an ArrayRecord file's records, and the tail bytes that vouch for them.

  Picklable: ship it to the hosts, each opens its own `VerifiedRecordReader`.

  Attributes:
    name: the file, for messages.
    size: the file's size in bytes.
    chunk_offsets: int64, the chunks' starts and, last, the footer's offset
      (num_chunks + 1 entries): chunk k is [chunk_offsets[k], chunk_offsets[k + 1]).
    group_size: records per chunk (the last chunk may hold fewer).
    num_records: the file's record count.
    tail: (offset, bytes) of the footer chunk and of the postscript chunk:
      what the C++ reader interprets when it opens the file.
    writer_options: the writer's options string from the footer ("" if absent).
  """

  name: str
  size: int
  chunk_offsets: np.ndarray
  group_size: int
  num_records: int
  tail: tuple[tuple[int, bytes], ...]
  writer_options: str = ""

  def __len__(self) -> int:
    return self.num_records

  @property
  def num_chunks(self) -> int:
    return len(self.chunk_offsets) - 1

  @property
  def footer_offset(self) -> int:
    return int(self.chunk_offsets[-1])

  @property
  def tail_bytes(self) -> int:
    """The bytes of the tail kept (footer chunk + postscript chunk)."""
    return sum(len(data) for _, data in self.tail)

  def _check(self, i: int) -> int:
    if not 0 <= i < self.num_records:
      raise IndexError(f"{self.name}: record {i} outside [0, {self.num_records})")
    return i // self.group_size

  def byte_range(self, i: int) -> tuple[int, int]:
    """[start, stop) of the file: the chunk holding record `i`."""
    k = self._check(i)
    return int(self.chunk_offsets[k]), int(self.chunk_offsets[k + 1])

  def index_in_chunk(self, i: int) -> int:
    """Where record `i` is among its chunk's records."""
    self._check(i)
    return i % self.group_size

  def ranges(self) -> np.ndarray:
    """int64 [num_records, 3]: each record's chunk start, chunk stop and index in the chunk."""
    i = np.arange(self.num_records, dtype=np.int64)
    k = i // self.group_size
    return np.stack([self.chunk_offsets[k], self.chunk_offsets[k + 1], i % self.group_size], axis=1)


def record_ranges(
    read_range: ReadRange,
    size: int,
    *,
    name: str = "ArrayRecord file",
    first_read: int = 2 * BLOCK_SIZE,
    verify: bool = True,
    scratch_dir: str | None = None,
) -> RecordIndex:
  """Reads an ArrayRecord file's postscript and footer and returns where each record lies.

  Reads the last `first_read` bytes, then, only if the footer starts before
  them, the bytes from the footer up to them: 1 round trip when the footer
  chunk starts in the block before the postscript's, else 2. With
  first_read=BLOCK_SIZE the bytes read are exactly [footer_offset, size).

  Example:
    index = record_ranges(lambda a, b: blob.download_as_bytes(start=a, end=b - 1), blob.size,
                          name=blob.name)
    start, stop = index.byte_range(i)  # then read_record(index, i, read_range)

  Args:
    read_range: returns exactly the bytes [start, stop) of the file.
    size: the file's size.
    name: the file, for messages.
    first_read: bytes to read from the end in the first request (>= BLOCK_SIZE).
    verify: also open the tail with array_record's C++ reader in a sparse
      local file, which checks the hashes of the postscript and footer chunks
      and their block headers, and compare its record count (a few ms; no
      bytes read beyond the tail).
    scratch_dir: where that sparse file is made (default: the temp folder).

  Returns:
    The index.

  Raises:
    CorruptRecordError: the tail is not an intact ArrayRecord tail; the
      message names the file, the structure and the offset.
    ValueError: an intact layout this module does not read (a footer
      compressed with brotli, zstd or snappy: writers' default), or
      `read_range` returned the wrong number of bytes.
  """
  if first_read < BLOCK_SIZE:
    raise ValueError(f"first_read={first_read}: must be at least BLOCK_SIZE ({BLOCK_SIZE})")
  if size < BLOCK_SIZE:
    raise CorruptRecordError(f"{name}: {size} bytes: an ArrayRecord file has at least {BLOCK_SIZE} (truncated?)")
  base = max(0, size - first_read)
  buf = _read(read_range, base, size, name)
  postscript_at = size - BLOCK_SIZE
  postscript = _read_chunk(buf, base, postscript_at, size, f"{name}: postscript")
  footer_offset = _parse_postscript(postscript, postscript_at, f"{name}: postscript at {postscript_at}")
  if footer_offset < base:
    buf = _read(read_range, footer_offset, base, name) + buf
    base = footer_offset
  footer = _read_chunk(buf, base, footer_offset, postscript_at, f"{name}: footer")
  index = _parse_footer(footer, name, size, (postscript, footer))
  if verify:
    VerifiedRecordReader(index, _no_fetch, scratch_dir=scratch_dir).close()
  return index


class VerifiedRecordReader(Closing):
  """Reads single records by ranged reads of their chunks, each verified by array_record's C++ reader.

  Keeps an unlinked sparse file of the shard's size holding only the tail
  (postscript and footer chunks); `read(i)` writes the fetched chunk at its
  offset, reads record i with the C++ reader (which checks the chunk's header,
  data and block header hashes, reading nothing but that chunk) and frees the
  chunk's blocks (FALLOC_FL_PUNCH_HOLE; where a file system lacks it, by
  truncating the file and writing the tail back). Disk held between reads:
  the tail's blocks only. Reads are serialized by a lock (fetches are not):
  threads that want parallel reads open a reader each. Not picklable; the
  index is.

  Measured with array_record 0.8.6 (strace, and tests that fill everything
  but the tail and the chunk with 0xFF): opening reads the file's last
  min(size, 1 MiB) in one read() but interprets only the postscript and
  footer chunks; each record is one pread() of exactly its chunk's range,
  never served from an earlier buffer. A damaged tail does not make the
  constructor raise: the reader opens with ok() False, 0 records, and raises
  its reason on close().

  Args:
    index: from `record_ranges`.
    fetch: returns exactly the bytes [start, stop) of the same file.
    scratch_dir: where the sparse file is made (default: the temp folder);
      needs sparse files.

  Raises:
    CorruptRecordError: the C++ reader refuses the tail (a hash mismatch) or
      counts other records than the index.
  """

  def __init__(self, index: RecordIndex, fetch: ReadRange, scratch_dir: str | None = None):
    self.index = index
    self._fetch = fetch
    self._lock = threading.Lock()
    self._fd = -1
    self._reader = None
    self._fd, path = tempfile.mkstemp(prefix="arrayrecord_index_", suffix=".array_record", dir=scratch_dir)
    try:
      os.ftruncate(self._fd, index.size)
      self._block = os.fstat(self._fd).st_blksize
      self._write_tail()
      self._reader = open_checked(path, RANDOM_ACCESS_READER_OPTIONS, f"{index.name} (its tail)")
    except BaseException:
      self.close()
      raise
    finally:
      os.unlink(path)  # both handles stay open; nothing is left behind
    if self._reader.num_records() != index.num_records:
      n = self._reader.num_records()
      self.close()
      raise CorruptRecordError(f"{index.name}: the C++ reader counts {n} records, the footer {index.num_records}")

  def _write_tail(self) -> None:
    for offset, data in self.index.tail:
      os.pwrite(self._fd, data, offset)

  @property
  def allocated_bytes(self) -> int:
    """Disk the sparse file holds now (st_blocks * 512)."""
    return os.fstat(self._fd).st_blocks * 512

  def read(self, i: int) -> bytes:
    """Fetches record `i`'s chunk (one ranged read) and returns the record, verified.

    Raises:
      IndexError: `i` is not a record of the file.
      CorruptRecordError: the fetched chunk fails the C++ reader's checks (the
        message names the file, record and byte range), or `fetch` returned
        the wrong number of bytes.
    """
    return self.read_run(i, i + 1)[0]

  def read_run(self, first: int, stop: int, data=None) -> list[bytes]:
    """Records [first, stop), whose chunks are one byte range: fetched by one ranged read (or given), verified.

    Args:
      first: the first record.
      stop: one past the last record.
      data: the bytes of their chunks, [byte_range(first)[0], byte_range(stop - 1)[1]) of the file; fetched
        when None.

    Returns:
      The records, in order.

    Raises:
      IndexError: a record outside the file.
      CorruptRecordError: as `read`; or `data` is not the run's length.
    """
    if not first < stop:
      return []
    start, end = self.index.byte_range(first)[0], self.index.byte_range(stop - 1)[1]
    if data is None:
      data = self._fetch(start, end)
    if len(data) != end - start:
      raise CorruptRecordError(f"{self.index.name}: records [{first}, {stop}): fetched {len(data)} bytes for "
                               f"[{start}, {end})")
    with self._lock:
      if self._reader is None:
        raise ValueError(f"{self.index.name}: read from a closed reader")
      try:
        os.pwrite(self._fd, data, start)
        try:
          return self._reader.read(list(range(first, stop)))
        except Exception as e:  # the C++ reader's own error: name the file, the first bad record and its range
          i = self._first_bad(first, stop)
          a, b = self.index.byte_range(i)
          raise CorruptRecordError(
              f"{self.index.name}: record {i} (chunk bytes [{a}, {b})): {type(e).__name__}: {e}") from None
      finally:
        self._free(start, end)

  def _first_bad(self, first: int, stop: int) -> int:
    """The first of records [first, stop) (their chunks written) the C++ reader refuses on its own (lock held)."""
    for i in range(first, stop):
      try:
        self._reader.read([i])
      except Exception:  # noqa: BLE001 - the C++ reader's own error
        return i
    return first

  def _free(self, start: int, stop: int) -> None:
    # Whole file system blocks, or those the chunk shares with its neighbours stay allocated (zeroed).
    # Nothing but this chunk lies before the tail, so rounding out frees only its bytes.
    start -= start % self._block
    stop = min(-(-stop // self._block) * self._block, self.index.footer_offset)
    if _punch_hole(self._fd, start, stop - start):
      return
    os.ftruncate(self._fd, start)
    os.ftruncate(self._fd, self.index.size)
    self._write_tail()

  def close(self) -> None:
    """Closes the C++ reader and the sparse file; closing twice is fine."""
    with self._lock:
      reader, fd, self._reader, self._fd = self._reader, self._fd, None, -1
      try:
        if reader is not None:
          reader.close()
      finally:
        if fd >= 0:
          os.close(fd)


def read_record(index: RecordIndex, i: int, fetch: ReadRange, scratch_dir: str | None = None) -> bytes:
  """Record `i`, fetched by one ranged read and verified; see `VerifiedRecordReader` to read many."""
  with VerifiedRecordReader(index, fetch, scratch_dir) as reader:
    return reader.read(i)


def _no_fetch(start: int, stop: int) -> bytes:
  raise AssertionError("record_ranges(verify=True) reads no records")


def _read(read_range: ReadRange, start: int, stop: int, name: str) -> bytes:
  data = read_range(start, stop)
  if len(data) != stop - start:
    raise ValueError(f"{name}: read_range({start}, {stop}) returned {len(data)} bytes, not {stop - start}")
  return bytes(data)


_libc = None


def _punch_hole(fd: int, offset: int, length: int) -> bool:
  """Frees the blocks of [offset, offset + length) (zeros read there); False where unsupported."""
  global _libc
  if _libc is None:
    _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if hasattr(_libc, "fallocate"):
      _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
  if length <= 0:
    return True
  if not hasattr(_libc, "fallocate"):  # not Linux
    return False
  if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.EOPNOTSUPP, errno.ENOSYS):
    return False
  raise OSError(err, f"fallocate(PUNCH_HOLE, {offset}, {length}): {os.strerror(err)}")


# Riegeli framing.


def stream_position(pos):
  """Where file position `pos` (a chunk boundary, or any byte outside the block headers) lies in riegeli's
  stream: the file's bytes without its block headers. A chunk at file position c holds stream bytes
  [stream_position(c), ...) in order. Works on ints and int64 numpy arrays alike."""
  return pos - BLOCK_HEADER_SIZE * (-(-pos // BLOCK_SIZE))


def file_position(q):
  """The file position of stream byte `q` (`stream_position`'s inverse): past the block header of its block.
  Works on ints and int64 numpy arrays alike."""
  return q + BLOCK_HEADER_SIZE * (q // _USABLE_BLOCK_SIZE + 1)


@dataclasses.dataclass(frozen=True)
class ChunkHeader:
  """A chunk's 40-byte header (its hashes left out): data_size, chunk_type, num_records, decoded_data_size."""

  data_size: int
  chunk_type: int
  num_records: int
  decoded_data_size: int

  @classmethod
  def parse(cls, raw: bytes) -> ChunkHeader:
    """The header from its 40 bytes (as they read once block headers are skipped)."""
    _, data_size, _, type_and_count, decoded_data_size = _CHUNK_HEADER.unpack(raw)
    return cls(data_size, type_and_count & 0xFF, type_and_count >> 8, decoded_data_size)


def chunk_end(begin: int, data_size: int, num_records: int) -> int:
  """Where a chunk at file position `begin` with `data_size` data bytes and `num_records` records ends (riegeli's
  formula: block headers and padding included); the next chunk, or the footer, begins there."""
  return _chunk_end(begin, data_size, num_records)


def writes_plain_chunks(writer_options: str) -> bool:
  """Whether a footer's writer options promise simple chunks stored as they are (`uncompressed`, not transposed):
  a record's bytes then lie in the file, interrupted only by block headers."""
  options = dict(option.partition(":")[::2] for option in writer_options.split(","))
  return "uncompressed" in options and options.get("transpose", "false") == "false"




def _chunk_end(begin: int, data_size: int, num_records: int) -> int:
  """Where a chunk that begins at `begin` ends (riegeli's formula, with block headers and padding)."""

  def add_with_overhead(pos: int, n: int) -> int:
    blocks = (n + (pos + _USABLE_BLOCK_SIZE - 1) % BLOCK_SIZE) // _USABLE_BLOCK_SIZE
    return pos + n + blocks * _BLOCK_HEADER.size

  def round_up_to_possible_chunk_boundary(pos: int) -> int:
    remaining_in_block = BLOCK_SIZE - 1 - (pos + BLOCK_SIZE - 1) % BLOCK_SIZE
    return pos + max(remaining_in_block - (_USABLE_BLOCK_SIZE - 1), 0)

  return max(
      add_with_overhead(begin, _CHUNK_HEADER.size + data_size),
      round_up_to_possible_chunk_boundary(begin + num_records),
  )


def _is_chunk_boundary(pos: int) -> bool:
  """Whether a chunk may begin at `pos`: not inside nor right after a block header."""
  return pos % BLOCK_SIZE == 0 or pos % BLOCK_SIZE > _BLOCK_HEADER.size


def _strip_block_headers(buf: bytes, base: int, pos: int, n: int, what: str) -> tuple[bytes, int]:
  """The `n` chunk bytes from file position `pos` on, skipping block headers, and where they end."""
  parts = []
  while n > 0:
    if pos % BLOCK_SIZE == 0:
      pos += _BLOCK_HEADER.size
    take = min(n, BLOCK_SIZE - pos % BLOCK_SIZE)
    if pos + take > base + len(buf):
      raise CorruptRecordError(f"{what}: chunk bytes run past {base + len(buf)}")
    parts.append(buf[pos - base : pos - base + take])
    pos += take
    n -= take
  return b"".join(parts), pos


@dataclasses.dataclass(frozen=True)
class _Chunk:
  begin: int
  end: int
  chunk_type: int
  num_records: int
  decoded_data_size: int
  data: bytes
  raw: bytes  # the file's bytes [begin, end)


def _read_chunk(buf: bytes, base: int, begin: int, limit: int, what: str) -> _Chunk:
  """Parses the chunk at file position `begin` of `buf` (the file's bytes from `base`), to end by `limit`."""
  if not base <= begin < limit or not _is_chunk_boundary(begin):
    raise CorruptRecordError(f"{what}: no chunk can begin at {begin} (expected one in [{base}, {limit}))")
  header, data_at = _strip_block_headers(buf, base, begin, _CHUNK_HEADER.size, what)
  _, data_size, _, type_and_count, decoded_data_size = _CHUNK_HEADER.unpack(header)
  chunk_type, num_records = type_and_count & 0xFF, type_and_count >> 8
  end = _chunk_end(begin, data_size, num_records)
  if end > limit:
    raise CorruptRecordError(
        f"{what}: chunk at {begin} ({data_size} data bytes, {num_records} records) would end at {end}, past {limit}"
    )
  data, _ = _strip_block_headers(buf, base, data_at, data_size, what)
  for block in range(-(-begin // BLOCK_SIZE) * BLOCK_SIZE, end, BLOCK_SIZE):
    _, previous_chunk, next_chunk = _BLOCK_HEADER.unpack_from(buf, block - base)
    if (previous_chunk, next_chunk) != (block - begin, end - block):
      raise CorruptRecordError(
          f"{what}: block header at {block} points to a chunk at {block - previous_chunk} ending at"
          f" {block + next_chunk}, not the chunk at {begin} ending at {end}"
      )
  return _Chunk(begin, end, chunk_type, num_records, decoded_data_size, data, buf[begin - base : end - base])


def _simple_records(chunk: _Chunk, what: str) -> list[bytes]:
  """The records of an uncompressed simple chunk."""
  if chunk.chunk_type != _SIMPLE:
    kind = {_TRANSPOSED: "a transposed chunk", _PADDING: "a padding chunk", _SIGNATURE: "a signature chunk",
            _METADATA: "a metadata chunk"}.get(chunk.chunk_type, f"chunk type {chunk.chunk_type:#x}")
    raise CorruptRecordError(f"{what}: chunk at {chunk.begin} is {kind}, not a simple chunk of records")
  data = chunk.data
  if not data:
    raise CorruptRecordError(f"{what}: chunk at {chunk.begin} has no data")
  if data[0] in _COMPRESSIONS:
    raise ValueError(
        f"{what}: chunk at {chunk.begin} is {_COMPRESSIONS[data[0]]}-compressed: only uncompressed"
        " footers are read (write with 'uncompressed')"
    )
  if data[0] != 0:
    raise CorruptRecordError(f"{what}: chunk at {chunk.begin}: unknown compression type {data[0]:#x}")
  try:
    sizes_len, pos = protowire.varint(data, 1, len(data))
    sizes_end = pos + sizes_len
    if sizes_end > len(data) or chunk.num_records > sizes_len:
      raise CorruptRecordError(
          f"{what}: chunk at {chunk.begin}: {sizes_len} bytes of sizes for {chunk.num_records} records"
          f" in {len(data)} bytes of data"
      )
    sizes = []
    for _ in range(chunk.num_records):
      n, pos = protowire.varint(data, pos, sizes_end)
      sizes.append(n)
  except WireFormatError:
    raise CorruptRecordError(f"{what}: {_BAD_VARINT}") from None
  if pos != sizes_end or sum(sizes) != len(data) - sizes_end or sum(sizes) != chunk.decoded_data_size:
    raise CorruptRecordError(
        f"{what}: chunk at {chunk.begin}: record sizes end at {pos} of {sizes_end} and sum to {sum(sizes)};"
        f" {len(data) - sizes_end} value bytes, decoded_data_size {chunk.decoded_data_size}"
    )
  records, pos = [], sizes_end
  for n in sizes:
    records.append(data[pos : pos + n])
    pos += n
  return records


# Protocol buffer wire format (formats.protowire): the few varint and message fields of cpp/layout.proto.


_BAD_VARINT = "a varint runs past its bytes or over 64 bits"


def _fields(buf: bytes, what: str) -> dict[int, int | bytes]:
  """A message's fields by number (the last value of a repeated one)."""
  fields: dict[int, int | bytes] = {}
  pos, end = 0, len(buf)
  try:
    while pos < end:
      tag, a, pos = protowire.field(buf, pos, end)
      if tag >> 3 == 0:
        raise CorruptRecordError(f"{what}: field number 0")
      fields[tag >> 3] = a if tag & 7 == protowire.VARINT else buf[a:pos]
  except WireFormatError as e:
    if e.field is None:
      raise CorruptRecordError(f"{what}: {_BAD_VARINT}") from None
    if e.wire_type is not None:
      raise CorruptRecordError(f"{what}: field {e.field} has wire type {e.wire_type}") from None
    raise CorruptRecordError(f"{what}: field {e.field} runs past the message's {len(buf)} bytes") from None
  return fields


def _uint(fields: dict[int, int | bytes], number: int, what: str) -> int:
  value = fields.get(number)
  if not isinstance(value, int):
    raise CorruptRecordError(f"{what}: field {number} is {'missing' if value is None else 'not a varint'}")
  if value >= 2**63:  # no offset or count of a file comes near; an int64 array could not hold it
    raise CorruptRecordError(f"{what}: field {number} is {value}, beyond any file")
  return value


# ArrayRecord's postscript and footer.


def _parse_postscript(chunk: _Chunk, at: int, what: str) -> int:
  """The footer offset that the postscript's copies agree on."""
  copies = _simple_records(chunk, what)
  if not copies or any(copy != copies[0] for copy in copies):
    raise CorruptRecordError(f"{what}: {len(copies)} RiegeliPostscript copies that do not all agree")
  fields = _fields(copies[0], what)
  magic = _uint(fields, 2, what)
  if magic != _MAGIC:
    raise CorruptRecordError(f"{what}: magic {magic:#x}, not ArrayRecord's {_MAGIC:#x}")
  footer_offset = _uint(fields, 1, what)
  if not _SIGNATURE_CHUNK_SIZE <= footer_offset < at:
    raise CorruptRecordError(f"{what}: footer offset {footer_offset} outside [{_SIGNATURE_CHUNK_SIZE}, {at})")
  return footer_offset


def _is_packed(writer_options: str) -> bool:
  """Whether the writer wrote uncompressed simple chunks with no padding between them."""
  options = dict(option.partition(":")[::2] for option in writer_options.split(","))
  return "uncompressed" in options and options.get("transpose") == options.get("pad_to_block_boundary") == "false"


def _chunk_ends(offset: int, num_records: int, decoded_data_size: int | None) -> tuple[int, int]:
  """Where a chunk at `offset` can end, [earliest, latest]; exact only for an uncompressed simple chunk.

  Its data are a compression byte, varint sizes_len, one varint size per record
  (1 to varint_len(decoded_data_size) bytes each) and decoded_data_size bytes.
  """
  if decoded_data_size is None:  # any encoding: a header, and at least as many bytes as records
    return _chunk_end(offset, 0, num_records), 2**64
  least, most = num_records, num_records * _varint_len(decoded_data_size)
  return (_chunk_end(offset, 1 + _varint_len(least) + least + decoded_data_size, num_records),
          _chunk_end(offset, 1 + _varint_len(most) + most + decoded_data_size, num_records))


def _varint_len(value: int) -> int:
  return max(1, -(-value.bit_length() // 7))


def _parse_footer(footer: _Chunk, name: str, size: int, tail_chunks: tuple[_Chunk, ...]) -> RecordIndex:
  what = f"{name}: footer at {footer.begin}"
  records = _simple_records(footer, what)
  if not records:
    raise CorruptRecordError(f"{what}: no RiegeliFooterMetadata")
  metadata = _fields(records[0], f"{what}: RiegeliFooterMetadata")
  inner = metadata.get(1)
  if not isinstance(inner, bytes):
    raise CorruptRecordError(f"{what}: RiegeliFooterMetadata has no array_record_metadata")
  inner_what = f"{what}: ArrayRecordMetadata"
  array_record = _fields(inner, inner_what)
  version = _uint(array_record, 1, inner_what)
  if version != _VERSION:
    raise CorruptRecordError(f"{inner_what}: version {version}, not {_VERSION} (the only one array_record reads)")
  num_chunks = _uint(array_record, 2, inner_what)
  num_records = _uint(array_record, 3, inner_what)
  writer_options = array_record.get(4, b"")
  writer_options = writer_options.decode("utf-8", "replace") if isinstance(writer_options, bytes) else ""
  if num_chunks != len(records) - 1:
    raise CorruptRecordError(f"{what}: {num_chunks} chunks announced, {len(records) - 1} ArrayRecordFooter records")
  offsets = np.empty(num_chunks + 1, dtype=np.int64)
  counts = np.empty(num_chunks, dtype=np.int64)
  offsets[num_chunks] = footer.begin
  # The toolkit's layout (uncompressed simple chunks, one after the other) fixes each chunk's end from
  # its footer entry, up to the record sizes' varints: a damaged offset or size cannot pass unseen.
  packed = _is_packed(writer_options)
  earliest, latest = _SIGNATURE_CHUNK_SIZE, 2**64  # where the next chunk may begin
  for k, record in enumerate(records[1:]):
    chunk_what = f"{what}: ArrayRecordFooter {k}"
    fields = _fields(record, chunk_what)
    offset, count = _uint(fields, 1, chunk_what), _uint(fields, 3, chunk_what)
    if not earliest <= offset < footer.begin or not _is_chunk_boundary(offset):
      raise CorruptRecordError(
          f"{chunk_what}: chunk offset {offset} is not a chunk boundary in [{earliest}, {footer.begin})"
      )
    if offset > latest:
      raise CorruptRecordError(
          f"{chunk_what}: chunk offset {offset}, but the chunk before, at {offsets[k - 1]}, ends in"
          f" [{earliest}, {latest}]"
      )
    offsets[k], counts[k] = offset, count
    earliest, latest = _chunk_ends(offset, count, _uint(fields, 2, chunk_what) if packed else None)
  if not earliest <= footer.begin <= latest:
    raise CorruptRecordError(
        f"{what}: the last chunk, at {offsets[num_chunks - 1]}, ends in [{earliest}, {latest}], not at the footer"
    )
  if int(counts.sum()) != num_records:
    raise CorruptRecordError(f"{what}: the chunks hold {int(counts.sum())} records, the metadata says {num_records}")
  group_size = int(counts[0]) if num_chunks else 1
  if num_chunks and (group_size < 1 or np.any(counts[:-1] != group_size) or not 1 <= counts[-1] <= group_size):
    raise CorruptRecordError(
        f"{what}: chunks of {sorted(set(counts.tolist()))} records: the C++ reader maps record i to chunk"
        f" i // {group_size}, so all but the last must hold {group_size}"
    )
  offsets.flags.writeable = False
  tail = tuple((chunk.begin, chunk.raw) for chunk in tail_chunks)
  return RecordIndex(name, size, offsets, group_size, num_records, tail, writer_options)
