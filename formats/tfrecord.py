"""TFRecord framing, written and read without TensorFlow.

Each record on disk (``tensorflow/core/lib/io/record_writer.cc``)::

    uint64  length          little-endian
    uint32  masked_crc32c(length bytes)
    byte    data[length]
    uint32  masked_crc32c(data)

masked_crc(x) = ((crc >> 15) | (crc << 17)) + 0xa282ead8, modulo 2**32.
Files are uncompressed, which is what `tf.data.TFRecordDataset` reads by default.

The framing is written and checked here only: sequentially (`read_records`,
`read_file`), and for random access through an index of record offsets built
from the headers alone (`index`, `IndexedReader`). Every error is a
`TFRecordCorruptError` (a `CorruptRecordError`) naming the file, the record
and the byte.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
import os
import struct
from typing import BinaryIO

import google_crc32c

from formats._closing import Closing
from formats.errors import TFRecordCorruptError

_LEN = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_MASK_DELTA = 0xA282EAD8
_HEADER_SIZE = _LEN.size + _CRC.size  # length, its CRC
_FRAME_SIZE = _HEADER_SIZE + _CRC.size  # bytes of framing around each payload


def masked_crc32c(data: bytes) -> int:
  """The masked CRC32C TFRecord stores for `data`.

  Args:
    data: the bytes checked (a length field or a payload).

  Returns:
    The checksum as an unsigned 32-bit integer.
  """
  crc = google_crc32c.value(data)
  return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame(record: bytes) -> bytes:
  """One record with its length, CRCs and payload, ready to append to a file.

  Args:
    record: the payload.

  Returns:
    The framed record.
  """
  length = _LEN.pack(len(record))
  return length + _CRC.pack(masked_crc32c(length)) + record + _CRC.pack(masked_crc32c(record))


def write_records(f: BinaryIO, records: Iterable[bytes]) -> int:
  """Writes framed records to an open binary file.

  Args:
    f: a file open for binary writing.
    records: the payloads, in order.

  Returns:
    How many records were written.
  """
  n = 0
  for record in records:
    f.write(frame(record))
    n += 1
  return n


def read_records(f: BinaryIO, name: str = "<stream>", verify: bool = True) -> Iterator[bytes]:
  """Yields the records of a TFRecord stream, in order.

  Args:
    f: a file open for binary reading.
    name: what error messages call the stream (its path).
    verify: check both CRCs of every record.

  Yields:
    Each record's payload.

  Raises:
    TFRecordCorruptError: framing or a CRC is wrong; the message names `name`,
      the record index and its byte offset.
  """
  index = offset = 0
  while True:
    header = f.read(_HEADER_SIZE)
    if not header:
      return
    length, problem = _parse_header(header, verify)
    if problem:
      raise TFRecordCorruptError(f"{name}: record {index} at byte {offset}: {problem}")
    data = _read_at_most(f, length)
    footer = f.read(4)
    if len(data) < length or len(footer) < 4:
      raise TFRecordCorruptError(f"{name}: record {index} at byte {offset}: truncated data")
    if verify and masked_crc32c(data) != _CRC.unpack(footer)[0]:
      raise TFRecordCorruptError(f"{name}: record {index} at byte {offset}: bad data checksum")
    yield data
    index += 1
    offset += _FRAME_SIZE + length


def _parse_header(header: bytes, verify: bool) -> tuple[int, str | None]:
  """(payload length, None) from a record's header, or (_, "truncated header" / "bad length checksum")."""
  if len(header) < _HEADER_SIZE:
    return 0, "truncated header"
  (length,) = _LEN.unpack_from(header)
  if verify and masked_crc32c(header[:_LEN.size]) != _CRC.unpack_from(header, _LEN.size)[0]:
    return length, "bad length checksum"
  return length, None


def _read_at_most(f: BinaryIO, n: int, chunk: int = 16 << 20) -> bytes:
  """Up to `n` bytes, in chunks: a header claiming a huge length (its CRC may be forged)
  must not allocate that much before the stream runs out."""
  if n <= chunk:
    return f.read(n)
  parts, got = [], 0
  while got < n:
    part = f.read(min(chunk, n - got))
    if not part:
      break
    parts.append(part)
    got += len(part)
  return b"".join(parts)


def read_file(path: str, verify: bool = True) -> Iterator[bytes]:
  """`read_records` of a local TFRecord file, whose path its errors name.

  Args:
    path: a local file.
    verify: as `read_records`.

  Yields:
    The file's payloads, in order.

  Raises:
    TFRecordCorruptError: as `read_records`, naming `path`.
  """
  with open(path, "rb") as f:
    yield from read_records(f, name=path, verify=verify)


def index(path: str) -> tuple[list[int], list[int]]:
  """(payload offsets, payload lengths) of a local TFRecord file, from its framing alone.

  Reads only the 12-byte headers (each length's CRC is checked; the payloads'
  are checked when they are read).

  Args:
    path: a local file.

  Returns:
    The byte offset of every payload and its length, in record order.

  Raises:
    TFRecordCorruptError: a length checksum is wrong or the file is truncated;
      the message is "<path>: record <i>: <problem> at byte <offset>".
  """
  offsets, lengths = [], []
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    pos = 0
    while pos < size:
      length, problem = _parse_header(f.read(_HEADER_SIZE), True)
      if problem:
        raise TFRecordCorruptError(f"{path}: record {len(offsets)}: {problem} at byte {pos}")
      if pos + _FRAME_SIZE + length > size:
        raise TFRecordCorruptError(f"{path}: record {len(offsets)}: truncated data at byte {pos}")
      offsets.append(pos + _HEADER_SIZE)
      lengths.append(length)
      pos += _FRAME_SIZE + length
      f.seek(pos)
  return offsets, lengths


def locate_damage(path: str) -> str | None:
  """The first damaged record of a local TFRecord file, if any.

  Args:
    path: a local file.

  Returns:
    None when every record's framing and CRCs are right, else the problem
    without the path: "record <i> ...: <reason>".
  """
  try:
    index(path)  # the framing first: no read is longer than the file
    for _ in read_file(path):
      pass
  except TFRecordCorruptError as e:
    return str(e)[len(path) + 2:]
  return None


class IndexedReader(Closing):
  """Random access to the records of a local TFRecord file through an index of offsets.

  Each read is one `os.pread` of the payload and its CRC, which is checked.
  Safe to share between threads.

  Args:
    path: a local file.

  Raises:
    TFRecordCorruptError: the framing is damaged (from `index`).
  """

  def __init__(self, path: str):
    self.path = path
    self._fd: int | None = None
    self._offsets, self._lengths = index(path)
    self._fd = os.open(path, os.O_RDONLY)

  def __len__(self) -> int:
    return len(self._offsets)

  def read(self, i: int) -> bytes:
    """See adapters.RandomAccessFile.read.

    Raises:
      TFRecordCorruptError: the record's data checksum is wrong.
    """
    if not 0 <= i < len(self._offsets):
      raise IndexError(f"{self.path}: record {i} outside [0, {len(self._offsets)})")
    if self._fd is None:
      raise ValueError(f"{self.path}: read from a closed reader")
    n = self._lengths[i]
    data = os.pread(self._fd, n + _CRC.size, self._offsets[i])
    if len(data) != n + _CRC.size or masked_crc32c(data[:n]) != _CRC.unpack_from(data, n)[0]:
      raise TFRecordCorruptError(f"{self.path}: record {i}: bad data checksum")
    return data[:n]

  def close(self) -> None:
    """Closes the file (reads then fail); closing twice is fine."""
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None
