"""`.graphbin`: a graph as named, checksummed, memory-mappable arrays. No pickle.

Layout, version 1, every integer little-endian::

    offset 0    header, 64 bytes            struct "<8sIIQQI28x"
                  magic          b"GRAPHBIN"
                  version        u32  (1)
                  num_sections   u32
                  table_offset   u64  where the section table starts
                  file_size      u64  total bytes (a truncated file is caught at open)
                  table_crc32c   u32  CRC32C of the section table bytes
    offset 64   sections, each starting at a multiple of 64 bytes (zero padding between)
    table       num_sections entries of 128 bytes, struct "<56s8sI4x4QQQI4x"
                  name      utf-8, NUL-padded (e.g. "indptr", "node/feat", "split/time/train")
                  dtype     numpy dtype string, NUL-padded: "<i8", "<i4", "<f4", "<f2", "|u1", ...
                  ndim      u32 (0..4)
                  shape     4 x u64 (unused dimensions 0)
                  offset    u64 of the first byte
                  nbytes    u64
                  crc32c    u32 of the section's bytes

The table sits after the data so a writer can stream sections of unknown size
and write the header last. Section names and meanings are documented in
docs/graphbin.md; `meta` is a JSON object (uint8) describing the graph.
Readers open the file with `numpy.memmap`: sections are zero-copy views.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
import dataclasses
import json
import os
import struct
from typing import Any, BinaryIO

import google_crc32c
import numpy as np

from formats.errors import GraphBinError

MAGIC = b"GRAPHBIN"
VERSION = 1
ALIGN = 64
HEADER = struct.Struct("<8sIIQQI28x")
ENTRY = struct.Struct("<56s8sI4x4QQQI4x")
assert HEADER.size == 64 and ENTRY.size == 128
META = "meta"
_ALLOWED_KINDS = "iufb"


@dataclasses.dataclass(frozen=True)
class Section:
  name: str
  dtype: str
  shape: tuple[int, ...]
  offset: int
  nbytes: int
  crc32c: int


def index_dtype(n: int) -> np.dtype:
  """The integer dtype of indices below `n`: int32 when every index fits, else int64.

  The one rule for the index arrays of a graph (CSR `indices`, sampled node
  ids): the writer and every reader pick the same width.

  Args:
    n: an upper bound of the values stored (a node or edge count).

  Returns:
    `np.dtype(np.int32)` when n < 2**31 - 1, else `np.dtype(np.int64)`.
  """
  return np.dtype(np.int32) if n < 2**31 - 1 else np.dtype(np.int64)


def _pad(n: int) -> int:
  return (-n) % ALIGN


class GraphBinWriter:
  """Writes sections one after the other; `close()` writes the table and the header.

      with GraphBinWriter(path) as w:
        w.add("indptr", indptr)
        with w.stream("indices", "<i4", (num_edges,)) as s:
          for chunk in chunks:
            s.write(chunk)
        w.add_meta({"num_nodes": n, ...})
  """

  def __init__(self, path: str):
    self._path = path
    self._f: BinaryIO = open(path, "wb")
    self._f.write(b"\0" * HEADER.size)
    self._sections: list[Section] = []
    self._open_stream = False

  def __enter__(self) -> GraphBinWriter:
    return self

  def __exit__(self, exc_type, *exc) -> None:
    if exc_type is None:
      self.close()
    else:
      self._f.close()

  def _check_name(self, name: str) -> None:
    if self._open_stream:
      raise RuntimeError("finish the open stream before adding a section")
    if not name or len(name.encode()) > 56:
      raise ValueError(f"section name {name!r} must be 1..56 bytes")
    if any(s.name == name for s in self._sections):
      raise ValueError(f"section {name!r} written twice")

  def add(self, name: str, array: np.ndarray) -> None:
    """Adds a whole array (C order, stored little-endian).

    Args:
      name: the section's name (1..56 bytes, unique).
      array: a numeric array (at most 4 dimensions).

    Raises:
      TypeError: the dtype is not numeric.
      ValueError: a bad or repeated name.
    """
    arr = np.asarray(array)
    if arr.dtype.kind not in _ALLOWED_KINDS:
      raise TypeError(f"section {name!r}: dtype {arr.dtype} is not numeric")
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    with self.stream(name, arr.dtype.str, arr.shape) as s:
      s.write(arr)

  def add_meta(self, meta: Mapping[str, Any]) -> None:
    """Adds the `meta` section: a JSON object describing the graph.

    Args:
      meta: JSON-serialisable values.
    """
    self.add(META, np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8))

  def stream(self, name: str, dtype: str, shape: tuple[int, ...]) -> _SectionStream:
    """A section written in chunks (each a C-ordered array of `dtype`).

    Args:
      name: the section's name.
      dtype: its numpy dtype string.
      shape: its full shape (at most 4 dimensions).

    Returns:
      A context manager whose `write(chunk)` appends data; on exit the size must match `shape`.

    Raises:
      ValueError: a bad or repeated name, or too many dimensions.
    """
    self._check_name(name)
    dt = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).itemsize > 1 else np.dtype(dtype)
    if len(shape) > 4:
      raise ValueError(f"section {name!r}: at most 4 dimensions, got {shape}")
    self._f.write(b"\0" * _pad(self._f.tell()))
    self._open_stream = True
    return _SectionStream(self, name, dt, tuple(int(d) for d in shape))

  def _finish(self, section: Section) -> None:
    self._sections.append(section)
    self._open_stream = False

  def close(self) -> None:
    """Writes the section table and the header, and closes the file (twice is fine)."""
    f = self._f
    if f.closed:
      return
    f.write(b"\0" * _pad(f.tell()))
    table_offset = f.tell()
    table = b"".join(
        ENTRY.pack(s.name.encode(), s.dtype.encode(), len(s.shape), *(list(s.shape) + [0] * (4 - len(s.shape))),
                   s.offset, s.nbytes, s.crc32c)
        for s in self._sections)
    f.write(table)
    size = f.tell()
    f.seek(0)
    f.write(HEADER.pack(MAGIC, VERSION, len(self._sections), table_offset, size, google_crc32c.value(table)))
    f.close()


class _SectionStream:
  def __init__(self, writer: GraphBinWriter, name: str, dtype: np.dtype, shape: tuple[int, ...]):
    self._w, self._name, self._dtype, self._shape = writer, name, dtype, shape
    self._offset = writer._f.tell()
    self._crc = 0
    self._nbytes = 0

  def __enter__(self) -> _SectionStream:
    return self

  def write(self, chunk: np.ndarray) -> None:
    data = np.ascontiguousarray(chunk, dtype=self._dtype).tobytes()
    self._crc = google_crc32c.extend(self._crc, data)
    self._nbytes += len(data)
    self._w._f.write(data)

  def __exit__(self, exc_type, *exc) -> None:
    if exc_type is not None:
      return
    expected = int(np.prod(self._shape, dtype=np.int64)) * self._dtype.itemsize
    if self._nbytes != expected:
      raise ValueError(f"section {self._name!r}: wrote {self._nbytes} bytes, shape {self._shape} needs {expected}")
    self._w._finish(Section(self._name, self._dtype.str, self._shape, self._offset, self._nbytes, self._crc))


class GraphBin:
  """An open .graphbin: `bin[name]` is a read-only numpy view into the memory-mapped file."""

  def __init__(self, path: str, verify: bool = True):
    self.path = path
    size = os.path.getsize(path)
    if size < HEADER.size:
      raise GraphBinError(f"{path}: {size} bytes is too short for a .graphbin header")
    self._mm = np.memmap(path, dtype=np.uint8, mode="r")
    magic, version, count, table_offset, file_size, table_crc = HEADER.unpack(bytes(self._mm[:HEADER.size]))
    if magic != MAGIC:
      raise GraphBinError(f"{path}: not a .graphbin file (magic {magic!r} at offset 0)")
    if version != VERSION:
      raise GraphBinError(f"{path}: .graphbin version {version} is not supported (expected {VERSION})")
    if file_size != size:
      raise GraphBinError(f"{path}: header says {file_size} bytes, the file has {size} (truncated?)")
    end = table_offset + count * ENTRY.size
    if end > size:
      raise GraphBinError(f"{path}: section table at offset {table_offset} runs past the end")
    table = bytes(self._mm[table_offset:end])
    if google_crc32c.value(table) != table_crc:
      raise GraphBinError(f"{path}: section table at offset {table_offset} fails its checksum")
    self.sections: dict[str, Section] = {}
    for i in range(count):
      name, dtype, ndim, *rest = ENTRY.unpack_from(table, i * ENTRY.size)
      shape, (offset, nbytes, crc) = tuple(rest[:ndim]), rest[4:]
      s = Section(name.rstrip(b"\0").decode(), dtype.rstrip(b"\0").decode(), tuple(int(d) for d in shape),
                  int(offset), int(nbytes), int(crc))
      if s.offset + s.nbytes > table_offset:
        raise GraphBinError(f"{path}: section {s.name!r} at offset {s.offset} runs into the table")
      if np.dtype(s.dtype).itemsize * int(np.prod(s.shape, dtype=np.int64)) != s.nbytes:
        raise GraphBinError(f"{path}: section {s.name!r} at offset {s.offset}: shape and size disagree")
      self.sections[s.name] = s
    if verify:
      self.verify()
    self.meta: dict[str, Any] = json.loads(bytes(self[META])) if META in self.sections else {}

  def verify(self, names: Iterable[str] | None = None) -> None:
    """Checks the CRC32C of sections (all by default); raises GraphBinError naming the bad one.

    Args:
      names: the sections checked (default: all).

    Raises:
      GraphBinError: a section fails its checksum.
    """
    for name in names or self.sections:
      s = self.sections[name]
      crc = 0
      step = 64 << 20
      for start in range(s.offset, s.offset + s.nbytes, step):
        crc = google_crc32c.extend(crc, self._mm[start:min(start + step, s.offset + s.nbytes)].tobytes())
      if crc != s.crc32c:
        raise GraphBinError(f"{self.path}: section {name!r} at offset {s.offset} fails its checksum")

  def __contains__(self, name: str) -> bool:
    return name in self.sections

  def __getitem__(self, name: str) -> np.ndarray:
    try:
      s = self.sections[name]
    except KeyError:
      raise KeyError(f"{self.path} has no section {name!r} (it has {sorted(self.sections)})") from None
    arr = self._mm[s.offset:s.offset + s.nbytes].view(np.dtype(s.dtype))
    return arr.reshape(s.shape)

  def names(self, prefix: str = "") -> list[str]:
    """The section names starting with `prefix`, sorted.

    Args:
      prefix: e.g. "split/".

    Returns:
      The names.
    """
    return sorted(n for n in self.sections if n.startswith(prefix))
