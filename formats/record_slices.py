"""Parts of the records of a local ArrayRecord file, read where they lie: a few bytes, not the whole record.

A CT loader wants a patch of a record's volume: a few hundred KB of an
84 MB record. array_record's reader reads the whole chunk, checks its hash
and copies it for every record it serves; here a record is read in parts:

- `ArrayRecordFile(path)` opens a file written with uncompressed simple
  chunks (formats.arrayrecord: `group_size:1,uncompressed`) and finds record
  i from the file's footer (formats.arrayrecord_index.record_ranges), its
  chunk header and the simple chunk's record sizes (a few dozen bytes). Its
  bytes are a run of riegeli's stream (the file without the 24-byte block
  headers at every multiple of 65536; `arrayrecord_index.stream_position`);
  `record(i)` returns them as a `RecordBytes`.
- `locate_example(record, in_place)` walks the serialized tf.train.Example
  through formats.protowire, reading its tags, lengths and keys: the values
  of the keys named `in_place` are located (their spans, not their bytes),
  the other features (small ones) read and decoded as formats.example does.
- `StoredArray` is a little-endian C-order array lying in a record: `a[z]`
  reads one plane, `a[z0:z1, y0:y1, x0:x1]` one box: per plane of the box
  one os.preadv of the bytes from its first row segment to the end of its
  last (the block headers among them read aside), then one strided copy of
  the segments.

Reads are os.pread on one descriptor, which threads share; a file that ends
early is a CorruptRecordError (never a crash, as a mapped file that shrinks
would be). Nothing here checks hashes: a caller reads in parts only a file
whose bytes it has proven (its SHA-256 against the manifest); what is
checked is the structure read: the chunk header against the footer's chunk
ranges, the record sizes against the chunk, and the Example's wire format
(`CorruptRecordError` naming file and record, `ExampleDecodeError` for the
Example). `check_unchanged()` tells a file changed since it was opened.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from formats import protowire
from formats._closing import Closing
from formats.arrayrecord_index import (BLOCK_HEADER_SIZE, BLOCK_SIZE, CHUNK_HEADER_SIZE, SIMPLE_CHUNK, ChunkHeader,
                                       RecordIndex, chunk_end, file_position, record_ranges, stream_position,
                                       writes_plain_chunks)
from formats.errors import CorruptRecordError, WireFormatError
from formats.example import decode_error, decode_example, encode_example

__all__ = ["ArrayRecordFile", "ExampleLayout", "RecordBytes", "StoredArray", "locate_example"]

# Bytes read at once where a walk reads byte by byte (tags, lengths, keys).
WINDOW_BYTES = 4096
# The largest value of a feature not read in place that locate_example reads and decodes; a larger one
# makes the record one to read whole.
SMALL_FEATURE_BYTES = 1 << 20
# Room for a simple chunk's compression byte, sizes_len and record sizes (10 bytes a varint) per record.
_VARINT_MAX = 10
_LEN_1, _LEN_2 = protowire.tag(1, protowire.LEN), protowire.tag(2, protowire.LEN)


class ArrayRecordFile(Closing):
  """A local ArrayRecord file of uncompressed simple chunks, its records read in parts by os.pread.

      with ArrayRecordFile(path) as f:
        record = f.record(3)                      # RecordBytes: nothing of the payload read yet
        head = record[0:16]                       # bytes 0..15 of record 3

  Thread-safe (pread on one descriptor; where each record lies is found once and kept).

  Args:
    path: a local file.

  Attributes:
    path: the file.
    index: its record index (formats.arrayrecord_index.RecordIndex).

  Raises:
    CorruptRecordError: the file's tail is not an ArrayRecord tail, or the file is shorter than it says.
    ValueError: the writer's options do not promise uncompressed simple chunks (read such files whole).
  """

  def __init__(self, path: str):
    self.path = path
    self._fd = -1
    self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    self._identity = _identity(os.fstat(self._fd))
    size = self._identity[2]
    self.index: RecordIndex = record_ranges(self._pread, size, name=path, verify=False)
    if not writes_plain_chunks(self.index.writer_options):
      self.close()
      raise ValueError(f"{path}: written with options {self.index.writer_options!r}: records are read in parts "
                       f"only from uncompressed, untransposed chunks")
    self._spans: dict[int, tuple[int, int]] = {}

  def __len__(self) -> int:
    return self.index.num_records

  @property
  def identity(self) -> tuple[int, int, int, int, int]:
    """(device, inode, size, mtime_ns, ctime_ns) of the file as it was opened."""
    return self._identity

  def check_unchanged(self, what: str | None = None) -> None:
    """Raises CorruptRecordError when the open file's size, mtime or ctime differ from when it was opened;
    `what` names what was to be read in the message (default: the file)."""
    if _identity(os.fstat(self._descriptor())) != self._identity:
      raise CorruptRecordError(f"{what or self.path}: the file changed (size, mtime or ctime) since it was "
                               f"opened and checked")

  def record(self, i: int) -> RecordBytes:
    """Record `i`'s bytes where they lie (found from its chunk's header the first time, then kept).

    Raises:
      IndexError: `i` is not a record of the file.
      CorruptRecordError: the chunk header or record sizes disagree with the footer; names file and record.
    """
    span = self._spans.get(i)
    if span is None:
      span = self._spans[i] = self._locate(i)
    return RecordBytes(self, i, *span)

  def _locate(self, i: int) -> tuple[int, int]:
    """(stream position, size) of record i, from its chunk's header and record sizes."""
    begin, end = self.index.byte_range(i)
    k, j = i // self.index.group_size, self.index.index_in_chunk(i)
    what = f"{self.path}: record {i} (chunk at {begin})"
    records = min(self.index.group_size, self.index.num_records - k * self.index.group_size)
    q = stream_position(begin)
    header = ChunkHeader.parse(self.read_stream(q, CHUNK_HEADER_SIZE, what))
    if header.chunk_type != SIMPLE_CHUNK or header.num_records != records:
      raise CorruptRecordError(f"{what}: chunk type {header.chunk_type:#x} with {header.num_records} records, "
                               f"not a simple chunk of {records}")
    if chunk_end(begin, header.data_size, header.num_records) != end:
      raise CorruptRecordError(f"{what}: {header.data_size} data bytes end the chunk at "
                               f"{chunk_end(begin, header.data_size, header.num_records)}, the footer says {end}")
    data = q + CHUNK_HEADER_SIZE
    head = self.read_stream(data, min(header.data_size, 1 + _VARINT_MAX * (records + 1)), what)
    if not head or head[0] != 0:
      raise CorruptRecordError(f"{what}: not stored uncompressed (compression byte "
                               f"{head[0] if head else None}), as the writer's options say")
    try:
      sizes_len, pos = protowire.varint(head, 1, len(head))
      sizes_end = pos + sizes_len
      sizes = []
      for _ in range(records):
        n, pos = protowire.varint(head, pos, min(sizes_end, len(head)))
        sizes.append(n)
    except WireFormatError:
      raise CorruptRecordError(f"{what}: its record sizes are not varints") from None
    total = sum(sizes)
    if pos != sizes_end or sizes_end + total != header.data_size or total != header.decoded_data_size:
      raise CorruptRecordError(f"{what}: record sizes end at {pos} of {sizes_end} and sum to {total}; "
                               f"{header.data_size} data bytes, decoded_data_size {header.decoded_data_size}")
    return data + sizes_end + sum(sizes[:j]), sizes[j]

  def read_stream(self, q: int, n: int, what: str | None = None) -> bytes:
    """The `n` stream bytes from stream position `q` (the file's bytes, block headers skipped); `what` names
    them in the error of a file that ends early (default: the file)."""
    if n <= 0:
      return b""
    first, stop = file_position(q), file_position(q + n - 1) + 1
    raw = self._pread(first, stop, what)
    if stop - first == n:
      return raw
    view, parts, pos = memoryview(raw), [], first
    while pos < stop:
      if pos % BLOCK_SIZE == 0:
        pos += BLOCK_HEADER_SIZE
      cut = min(stop, (pos // BLOCK_SIZE + 1) * BLOCK_SIZE)
      parts.append(view[pos - first:cut - first])
      pos = cut
    return b"".join(parts)

  def read_stream_into(self, q: int, buf: memoryview, what: str | None = None) -> None:
    """Fills `buf` (writable bytes) with the stream bytes from stream position `q`: one os.preadv of the file's
    bytes they span, each block header among them read into a scratch buffer; `what` as in `read_stream`."""
    n = len(buf)
    if n == 0:
      return
    first, stop = file_position(q), file_position(q + n - 1) + 1
    parts, pos, at = [], first, 0
    for header in range(-(-first // BLOCK_SIZE) * BLOCK_SIZE, stop, BLOCK_SIZE):
      parts.append(buf[at:at + header - pos])
      parts.append(memoryview(bytearray(BLOCK_HEADER_SIZE)))
      at += header - pos
      pos = header + BLOCK_HEADER_SIZE
    parts.append(buf[at:])
    fd, offset = self._descriptor(), first
    while parts:
      got = os.preadv(fd, parts, offset)
      if got == 0:
        raise CorruptRecordError(f"{what or self.path}: the file ends at {offset}, bytes [{first}, {stop}) wanted "
                                 f"(truncated?)")
      offset += got
      while parts and got >= len(parts[0]):  # preadv may read less: go on after what it read
        got -= len(parts.pop(0))
      if parts:
        parts[0] = parts[0][got:]

  def _pread(self, start: int, stop: int, what: str | None = None) -> bytes:
    """Exactly the file's bytes [start, stop)."""
    fd, n = self._descriptor(), stop - start
    data = os.pread(fd, n, start)
    while len(data) < n:  # pread may return less; only the end of the file stops it
      more = os.pread(fd, n - len(data), start + len(data))
      if not more:
        raise CorruptRecordError(f"{what or self.path}: the file ends at {start + len(data)}, bytes [{start}, "
                                 f"{stop}) wanted (truncated?)")
      data += more
    return data

  def _descriptor(self) -> int:
    if self._fd < 0:
      raise ValueError(f"{self.path}: read from a closed file")
    return self._fd

  def close(self) -> None:
    """Closes the file; closing twice is fine."""
    fd, self._fd = getattr(self, "_fd", -1), -1
    if fd >= 0:
      os.close(fd)


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
  return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class RecordBytes:
  """The bytes of one record, 0..len-1 as in the record, read from where they lie in its file.

  `r[k]` is byte k (an int) and `r[a:b]` bytes a..b-1, read through a window
  of WINDOW_BYTES, so formats.protowire walks a record in place; `copy_rows`
  copies many row segments at once. Not shared between threads (the window).

  Attributes:
    file: the ArrayRecordFile.
    record: the record's number in it.
    start: its first byte's stream position.
  """

  __slots__ = ("file", "record", "start", "_size", "_w0", "_window")

  def __init__(self, file: ArrayRecordFile, record: int, start: int, size: int):
    self.file, self.record, self.start, self._size = file, record, start, size
    self._w0, self._window = 0, b""

  def __len__(self) -> int:
    return self._size

  @property
  def name(self) -> str:
    """"<file>: record <i>", as messages name it."""
    return f"{self.file.path}: record {self.record}"

  def __getitem__(self, key):
    if isinstance(key, slice):
      a, b, step = key.indices(self._size)
      if step != 1:
        raise ValueError("RecordBytes slices have step 1")
      return self.read(a, max(0, b - a))
    k = int(key)
    if not 0 <= k < self._size:
      raise IndexError(f"{self.name}: byte {k} outside [0, {self._size})")
    w = k - self._w0
    if not 0 <= w < len(self._window):
      self._w0, self._window = k, self.read(k, min(WINDOW_BYTES, self._size - k))
      w = 0
    return self._window[w]

  def read(self, offset: int, n: int) -> bytes:
    """Bytes [offset, offset + n) of the record."""
    if offset < 0 or n < 0 or offset + n > self._size:
      raise IndexError(f"{self.name}: bytes [{offset}, {offset + n}) outside [0, {self._size})")
    return self.file.read_stream(self.start + offset, n, self.name)

  def copy_rows(self, starts: np.ndarray, length: int, stride: int, out: np.ndarray, dtype=None) -> None:
    """Copies row segments of the record into `out`: out[g, r] = the record's bytes [starts[g, r], + length).

    Rows of a group lie `stride` bytes apart (starts[g, r + 1] - starts[g, r] == stride); each group is one
    os.preadv of the file from its first row to the end of its last, its block headers read aside (so the
    bytes land as they are in the record), then one strided copy (a cast when `out` has another dtype).

    Args:
      starts: int64 [groups, rows], offsets in the record, each group's first row first.
      length: bytes per row segment.
      stride: bytes from one row of a group to the next (>= length).
      out: [groups, rows, *row], written; a row segment holds the `row` elements of `dtype` (length bytes).
      dtype: what the bytes are (default: out's dtype).

    Raises:
      IndexError: a segment outside the record.
      CorruptRecordError: the file ends before a segment.
    """
    groups, rows = starts.shape
    if groups == 0 or rows == 0 or length == 0:
      return
    if int(starts.min()) < 0 or int(starts.max()) + length > self._size:
      raise IndexError(f"{self.name}: row segments outside [0, {self._size})")
    dtype = out.dtype if dtype is None else np.dtype(dtype)
    row, strides = out.shape[2:], [dtype.itemsize]
    for n in reversed(row[1:]):
      strides.insert(0, strides[0] * n)
    span = (rows - 1) * stride + length
    # Each group's bytes its rows, of out's dtype and in its layout: read straight into `out`.
    straight = (stride == length or rows == 1) and out.dtype == dtype and out[0].flags.c_contiguous
    buf = None if straight else np.empty(span, np.uint8)
    for g, first in enumerate(starts[:, 0].tolist()):
      if straight:
        self.file.read_stream_into(self.start + first, memoryview(out[g]).cast("B"), self.name)
      else:
        self.file.read_stream_into(self.start + first, memoryview(buf), self.name)
        out[g] = np.ndarray((rows, *row), dtype, buffer=buf, strides=(stride, *strides[:len(row)]))


@dataclasses.dataclass(frozen=True)
class ExampleLayout:
  """Where a serialized Example's features lie (`locate_example`).

  Attributes:
    spans: key → (start, stop) of its one bytes value in the record, for the keys read in place.
    values: key → its value as formats.example.decode_example gives it (copied), for the other keys.
  """

  spans: dict[str, tuple[int, int]]
  values: dict[str, object]

  def keys(self) -> set[str]:
    """Every key of the Example."""
    return set(self.spans) | set(self.values)


def locate_example(record, in_place, small_limit: int = SMALL_FEATURE_BYTES) -> ExampleLayout | None:
  """Walks a serialized Example in place: the payload spans of the keys `in_place`, the other features decoded.

  Reads the Example's tags, lengths and keys, and the values of the keys not
  in place (each at most `small_limit` bytes, decoded by
  formats.example.decode_example); of an in-place key, only the tags and
  lengths of its Feature and BytesList. Returns None for an Example this walk
  does not read but decode_example may: one not in the form
  formats.example.encode_example writes (one Features, entries of a key and
  a value, keys unique), an in-place key whose Feature is not a BytesList of
  exactly one value, or a larger value of another key. Such a record is read
  whole.

  Args:
    record: the serialized Example: bytes, or a RecordBytes read in place.
    in_place: the keys whose bytes value is located, not read.
    small_limit: the largest value of another key that is read.

  Returns:
    The layout, or None as above.

  Raises:
    ExampleDecodeError: the bytes are not a well-formed Example (as decode_example would say).
  """
  end = len(record)
  try:
    if end == 0:
      return ExampleLayout({}, {})
    t, a, pos = protowire.field(record, 0, end)
    if t != _LEN_1 or pos != end:
      return None
    spans: dict[str, tuple[int, int]] = {}
    values: dict[str, object] = {}
    while a < end:  # Features: entries at field 1, each a key (1) then a value (2)
      t, e, a = protowire.field(record, a, end)
      if t != _LEN_1 or e == a:
        return None
      t, kx, ke = protowire.field(record, e, a)
      if t != _LEN_1 or ke == a:
        return None
      t, vx, ve = protowire.field(record, ke, a)
      if t != _LEN_2 or ve != a:
        return None
      key = str(record[kx:ke], "utf-8")
      if key in spans or key in values:
        return None
      if key in in_place:
        span = _one_bytes_value(record, vx, ve)
        if span is None:
          return None
        spans[key] = span
      elif ve - vx > small_limit:
        return None
      else:
        values[key] = decode_example(encode_example({key: record[vx:ve]}))[key]
  except (UnicodeDecodeError, WireFormatError) as e:
    raise decode_error(e) from None
  return ExampleLayout(spans, values)


def _one_bytes_value(record, pos: int, end: int) -> tuple[int, int] | None:
  """The span of the one value of the Feature in record[pos:end], when it is a BytesList of one value."""
  if pos == end:
    return None
  t, a, b = protowire.field(record, pos, end)
  if t != _LEN_1 or b != end or a == b:  # one BytesList, nothing else
    return None
  t, x, y = protowire.field(record, a, b)
  return (x, y) if t == _LEN_1 and y == b else None


class StoredArray:
  """A little-endian C-order array lying in a record, read in parts as a numpy array's leading axes index it.

      volume = StoredArray(record, offset, (160, 512, 512), np.dtype("<i2"))
      plane = volume[80]                            # int16 [512, 512]: one plane read
      box = volume[10:42, 100:228, 0:128]           # int16 [32, 128, 128]: clipped to the shape, as numpy clips

  Indexing takes an int (one plane along the first axis, negative from the
  end) or a tuple of step-1 slices over up to three leading axes (the axes
  after them whole); iterating yields the planes. Each call reads only the bytes of what
  it returns (`RecordBytes.copy_rows`).

  Args:
    record: the RecordBytes the array lies in.
    offset: where its first byte is in the record.
    shape: its shape.
    dtype: its dtype (little-endian).

  Raises:
    IndexError: (on construction) the array's bytes run past the record.
  """

  __slots__ = ("record", "offset", "shape", "dtype", "_strides")

  def __init__(self, record: RecordBytes, offset: int, shape: tuple[int, ...], dtype: np.dtype):
    self.record, self.offset, self.shape, self.dtype = record, offset, tuple(shape), np.dtype(dtype)
    strides, step = [], self.dtype.itemsize
    for n in reversed(self.shape):
      strides.append(step)
      step *= n
    self._strides = tuple(reversed(strides))
    if offset < 0 or offset + step > len(record):
      raise IndexError(f"{record.name}: an array of {step} bytes at {offset} runs past the record's {len(record)}")

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

  def __len__(self) -> int:
    return self.shape[0]

  def __iter__(self):
    for z in range(self.shape[0]):
      yield self[z]

  def __getitem__(self, key) -> np.ndarray:
    if isinstance(key, slice):
      key = (key,)
    if isinstance(key, tuple):
      return self._box(key)
    z = int(key)
    if z < 0:
      z += self.shape[0]
    if not 0 <= z < self.shape[0]:
      raise IndexError(f"index {int(key)} is out of bounds for axis 0 with size {self.shape[0]}")
    return self._box((slice(z, z + 1),)).reshape(self.shape[1:])

  def _box(self, key: tuple) -> np.ndarray:
    """The box of step-1 slices `key` over the leading axes, clipped as numpy clips."""
    out = np.empty(self.box_shape(key), self.dtype)
    self.read_into(key, out)
    return out

  def box_shape(self, key: tuple) -> tuple[int, ...]:
    """The shape of `self[key]` for step-1 slices `key` (numpy's clipping), nothing read."""
    self._check(key)
    return (*(len(range(*s.indices(n))) for s, n in zip(key, self.shape)), *self.shape[len(key):])

  def read_into(self, key: tuple, out: np.ndarray) -> None:
    """Writes `self[key]` into `out` (of `box_shape(key)`, any layout; cast to its dtype), reading only its bytes.

    Raises:
      TypeError: `key` is not step-1 slices of at most three axes.
      ValueError: `out` has another shape.
    """
    shape = self.box_shape(key)
    if out.shape != shape:
      raise ValueError(f"out has shape {out.shape}, the box {shape}")
    if out.size == 0:
      return
    ranges = [s.indices(n)[:2] for s, n in zip(key, self.shape)]
    k = len(key)
    # Row segments: the last sliced axis' run (with the axes after it whole) is contiguous in the record;
    # groups are the first axis (one group when k == 1), rows the second (one row when k <= 2).
    length = shape[k - 1] * self._strides[k - 1]
    base = self.offset + sum(a * s for (a, _), s in zip(ranges, self._strides))
    if k == 1:
      starts, stride, out = np.array([[base]], np.int64), length, out[None, None]
    else:
      rows = np.arange(shape[1], dtype=np.int64) * self._strides[1] if k == 3 else np.zeros(1, np.int64)
      starts = base + self._strides[0] * np.arange(shape[0], dtype=np.int64)[:, None] + rows[None, :]
      stride, out = (self._strides[1], out) if k == 3 else (length, out[:, None])
    self.record.copy_rows(starts, length, stride, out, self.dtype)

  def _check(self, key: tuple) -> None:
    most = min(3, self.ndim)
    if not 0 < len(key) <= most or not all(isinstance(s, slice) and s.step in (None, 1) for s in key):
      raise TypeError(f"StoredArray takes an int or step-1 slices of at most {most} axes, got {key!r}")
