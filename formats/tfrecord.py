"""TFRecord framing, written and read without TensorFlow.

Each record on disk (``tensorflow/core/lib/io/record_writer.cc``)::

    uint64  length          little-endian
    uint32  masked_crc32c(length bytes)
    byte    data[length]
    uint32  masked_crc32c(data)

masked_crc(x) = ((crc >> 15) | (crc << 17)) + 0xa282ead8, modulo 2**32.
Files are uncompressed, which is what `tf.data.TFRecordDataset` reads by default.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
import struct
from typing import BinaryIO

import google_crc32c

from formats.errors import TFRecordCorruptError

_LEN = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_MASK_DELTA = 0xA282EAD8


def masked_crc32c(data: bytes) -> int:
  crc = google_crc32c.value(data)
  return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame(record: bytes) -> bytes:
  """One record with its length, CRCs and payload, ready to append to a file."""
  length = _LEN.pack(len(record))
  return length + _CRC.pack(masked_crc32c(length)) + record + _CRC.pack(masked_crc32c(record))


def write_records(f: BinaryIO, records: Iterable[bytes]) -> int:
  """Writes framed records to an open binary file; returns how many."""
  n = 0
  for record in records:
    f.write(frame(record))
    n += 1
  return n


def read_records(f: BinaryIO, name: str = "<stream>", verify: bool = True) -> Iterator[bytes]:
  """Yields the records of a TFRecord stream; raises TFRecordCorruptError naming
  `name`, the record index and the byte offset when framing or a CRC is wrong."""
  index = offset = 0
  while True:
    header = f.read(12)
    if not header:
      return
    if len(header) < 12:
      raise TFRecordCorruptError(f"{name}: record {index} at byte {offset}: truncated header")
    (length,) = _LEN.unpack_from(header)
    (length_crc,) = _CRC.unpack_from(header, 8)
    if verify and masked_crc32c(header[:8]) != length_crc:
      raise TFRecordCorruptError(f"{name}: record {index} at byte {offset}: bad length checksum")
    data = _read_at_most(f, length)
    footer = f.read(4)
    if len(data) < length or len(footer) < 4:
      raise TFRecordCorruptError(f"{name}: record {index} at byte {offset}: truncated data")
    if verify and masked_crc32c(data) != _CRC.unpack(footer)[0]:
      raise TFRecordCorruptError(f"{name}: record {index} at byte {offset}: bad data checksum")
    yield data
    index += 1
    offset += 16 + length


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
  """Yields the records of a local TFRecord file."""
  with open(path, "rb") as f:
    yield from read_records(f, name=path, verify=verify)
