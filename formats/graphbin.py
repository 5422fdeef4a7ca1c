"""`.graphbin`: a graph as named, checksummed, memory-mappable arrays. No pickle.

Layout, every integer little-endian::

    offset 0    header, 64 bytes            struct "<8sIIQQI28x"
                  magic          b"GRAPHBIN"
                  version        u32  (1 or 2: the size of a table entry)
                  num_sections   u32
                  table_offset   u64  where the section table starts
                  file_size      u64  total bytes (a truncated file is caught at open)
                  table_crc32c   u32  CRC32C of the section table bytes
    offset 64   sections, each starting at a multiple of 64 bytes (zero padding between)
    table       num_sections entries
                  version 1: 128 bytes, struct "<56s8sI4x4QQQI4x"   (names of at most 56 bytes)
                  version 2: 320 bytes, struct "<248s8sI4x4QQQI4x"  (names of at most 248 bytes)
                  name      utf-8, NUL-padded (e.g. "indptr", "node/feat", "split/time/train")
                  dtype     numpy dtype string, NUL-padded: "<i8", "<i4", "<f4", "<f2", "|u1", ...
                  ndim      u32 (0..4)
                  shape     4 x u64 (unused dimensions 0)
                  offset    u64 of the first byte
                  nbytes    u64
                  crc32c    u32 of the section's bytes

The two versions differ only in the width of an entry's name. A writer writes
version 1 when every name fits 56 bytes (so that a reader knowing only
version 1 opens those files) and version 2 otherwise; readers accept both.

The table sits after the data so a writer can stream sections of unknown size
and write the header last. A reader that fetches ranges (a gs:// download)
parses the first 64 bytes with `parse_header`, then the table's
`Header.table_nbytes` bytes at `Header.table_offset` with `parse_table`: the
same checks `GraphBin` makes. Section names and meanings are documented in
docs/graphbin.md; `meta` is a JSON object (uint8) describing the graph.
Readers open the file with `numpy.memmap`: sections are zero-copy views.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
import dataclasses
import hashlib
import json
import math
import os
import struct
from typing import Any, BinaryIO, NamedTuple

import google_crc32c
import numpy as np

from formats.errors import GraphBinError

MAGIC = b"GRAPHBIN"
VERSION = 1  # the version written while every section name fits ENTRY's 56 bytes
ALIGN = 64
HEADER = struct.Struct("<8sIIQQI28x")
NAME_BYTES = {1: 56, 2: 248}  # version -> the longest section name (UTF-8 bytes) its table entry holds
ENTRIES = {v: struct.Struct(f"<{n}s8sI4x4QQQI4x") for v, n in NAME_BYTES.items()}  # version -> table entry
ENTRY, ENTRY_V2 = ENTRIES[1], ENTRIES[2]
MAX_NAME_BYTES = NAME_BYTES[2]  # the longest section name a .graphbin holds
assert HEADER.size == 64 and ENTRY.size == 128 and ENTRY_V2.size == 320 and ENTRY_V2.size % ALIGN == 0
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


class Header(NamedTuple):
  """The fields of a .graphbin header after the magic (see the module docstring)."""

  version: int
  num_sections: int
  table_offset: int
  file_size: int
  table_crc32c: int

  @property
  def table_nbytes(self) -> int:
    """The size of the section table in bytes."""
    return self.num_sections * ENTRIES[self.version].size


def parse_header(data: bytes, path: str = "<graphbin>", size: int | None = None) -> Header:
  """Checks and parses the first 64 bytes of a .graphbin.

      h = parse_header(first_64_bytes, "gs://b/g.graphbin", size=blob_size)
      table = read_range(h.table_offset, h.table_nbytes)

  Args:
    data: the file's first HEADER.size bytes (more are ignored).
    path: the file's name, for error messages.
    size: the file's actual size, when known: checked against the header's, and the
      table must end inside it.

  Returns:
    The header's fields.

  Raises:
    GraphBinError: too short, a foreign magic, an unknown version, a size that differs
      (a truncated file), or a table that runs past the end.
  """
  if len(data) < HEADER.size:
    raise GraphBinError(f"{path}: {len(data)} bytes is too short for a .graphbin header")
  magic, version, count, table_offset, file_size, table_crc = HEADER.unpack_from(data)
  if magic != MAGIC:
    raise GraphBinError(f"{path}: not a .graphbin file (magic {magic!r} at offset 0)")
  if version not in ENTRIES:
    raise GraphBinError(f"{path}: .graphbin version {version} is not supported (expected one of {sorted(ENTRIES)})")
  if size is not None and file_size != size:
    raise GraphBinError(f"{path}: header says {file_size} bytes, the file has {size} (truncated?)")
  header = Header(version, count, table_offset, file_size, table_crc)
  if table_offset < HEADER.size:
    raise GraphBinError(f"{path}: section table at offset {table_offset} starts inside the {HEADER.size}-byte header")
  if table_offset % ALIGN:
    raise GraphBinError(f"{path}: section table at offset {table_offset}: the offset is not a multiple of {ALIGN}")
  if table_offset + header.table_nbytes > file_size:
    raise GraphBinError(f"{path}: section table at offset {table_offset} runs past the end")
  if table_offset + header.table_nbytes != file_size:
    raise GraphBinError(f"{path}: the section table ends at {table_offset + header.table_nbytes}, "
                        f"the file at {file_size}")
  return header


def parse_table(table: bytes, header: Header, path: str = "<graphbin>") -> dict[str, Section]:
  """Checks and parses the section table of a .graphbin.

  Args:
    table: the `header.table_nbytes` bytes at `header.table_offset`.
    header: what `parse_header` returned for the file (its version says the entry size).
    path: the file's name, for error messages.

  Returns:
    {name: Section} in table order.

  Raises:
    GraphBinError: the table's size or checksum is wrong, or a section runs into the
      table, has more than 4 dimensions, or has a shape that disagrees with its size.
  """
  if len(table) != header.table_nbytes:
    raise GraphBinError(f"{path}: section table at offset {header.table_offset} is {len(table)} bytes, "
                        f"the header says {header.table_nbytes}")
  if google_crc32c.value(table) != header.table_crc32c:
    raise GraphBinError(f"{path}: section table at offset {header.table_offset} fails its checksum")
  entry = ENTRIES[header.version]
  sections: dict[str, Section] = {}
  where: dict[str, int] = {}  # name -> its entry
  for i in range(header.num_sections):
    at = header.table_offset + i * entry.size
    raw_name, raw_dtype, ndim, *rest = entry.unpack_from(table, i * entry.size)
    name = _decode_name(raw_name, at, path)
    if ndim > 4:
      raise GraphBinError(f"{path}: section {name!r} in the table at offset {at}: {ndim} dimensions (at most 4)")
    shape, (offset, nbytes, crc) = tuple(int(d) for d in rest[:ndim]), rest[4:]
    s = Section(name, raw_dtype.rstrip(b"\0").decode("latin-1"), shape, int(offset), int(nbytes), int(crc))
    if name in sections:
      raise GraphBinError(f"{path}: section {name!r} at offset {s.offset}: the table lists it twice "
                          f"(entries {where[name]} and {i})")
    if s.offset < HEADER.size:
      raise GraphBinError(f"{path}: section {name!r} at offset {s.offset} starts inside the {HEADER.size}-byte header")
    if s.offset + s.nbytes > header.table_offset:
      raise GraphBinError(f"{path}: section {name!r} at offset {s.offset} runs into the table")
    if s.offset % ALIGN:
      raise GraphBinError(f"{path}: section {name!r} at offset {s.offset}: the offset is not a multiple of {ALIGN}")
    dtype = section_dtype(s.dtype)
    if dtype is None:
      raise GraphBinError(f"{path}: section {name!r} at offset {s.offset}: dtype {s.dtype!r} is not a little-endian "
                          f"numeric dtype (one of {', '.join(_ALLOWED_KINDS)}; 1 to 8 bytes)")
    size = dtype.itemsize * math.prod(s.shape)  # Python integers: a shape cannot wrap around to the size
    if size != s.nbytes:
      raise GraphBinError(f"{path}: section {name!r} at offset {s.offset}: shape and size disagree: shape {s.shape} "
                          f"of {s.dtype} is {size} bytes, the table says {s.nbytes}")
    sections[name], where[name] = s, i
  previous = None
  for s in sorted(sections.values(), key=lambda s: (s.offset, s.nbytes)):
    if previous is not None and s.offset < previous.offset + previous.nbytes:
      raise GraphBinError(f"{path}: section {s.name!r} at offset {s.offset} overlaps section {previous.name!r} "
                          f"(bytes [{previous.offset}, {previous.offset + previous.nbytes}))")
    previous = s
  return {name: sections[name] for name in sorted(sections, key=where.__getitem__)}


def _decode_name(raw: bytes, at: int, path: str) -> str:
  """A table entry's name: its UTF-8 bytes before the NUL padding, not empty."""
  try:
    name = raw.rstrip(b"\0").decode()
  except UnicodeDecodeError:
    raise GraphBinError(f"{path}: the section name in the table at offset {at} is not UTF-8") from None
  if not name:
    raise GraphBinError(f"{path}: the section name in the table at offset {at} is empty")
  return name


def section_dtype(dtype: str) -> np.dtype | None:
  """The numpy dtype of a section's dtype string, or None when a .graphbin cannot hold it.

  A section holds bools, integers or floats of 1 to 8 bytes, little-endian, named by numpy's
  canonical string (`np.dtype(...).str`, what the writer stores): "<i8", "|u1", "<f2", "|b1".

  Args:
    dtype: the string from the section table.

  Returns:
    The dtype, or None.
  """
  try:
    dt = np.dtype(dtype)
  except (TypeError, ValueError):
    return None
  if dt.kind not in _ALLOWED_KINDS or dt.itemsize not in (1, 2, 4, 8) or dt.str != dtype or dt.str[0] not in "<|":
    return None
  return dt


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


def padding(n: int) -> int:
  """The zero bytes a writer puts after `n` bytes so that the next section starts at a multiple of ALIGN.

  Args:
    n: the file's size so far.

  Returns:
    0..ALIGN-1.
  """
  return _pad(n)


def pack_tail(sections: list[Section], table_offset: int) -> tuple[bytes, bytes]:
  """(header, section table) of a file whose sections are `sections`, its table at `table_offset`.

  What `GraphBinWriter.close` writes; a writer that builds the file from parts written elsewhere
  (pipelines.ogb_graphs joins them) gets the same bytes from the same sections. Version 1 when
  every name fits its 56 bytes, else version 2.

  Args:
    sections: the sections in file order (offsets, sizes and CRCs final).
    table_offset: where the table starts (a multiple of ALIGN, after the last section).

  Returns:
    (the 64-byte header, the table); the file's size is `table_offset + len(table)`.
  """
  fits = all(len(s.name.encode()) <= NAME_BYTES[VERSION] for s in sections)
  version = VERSION if fits else 2
  entry = ENTRIES[version]
  table = b"".join(
      entry.pack(s.name.encode(), s.dtype.encode(), len(s.shape), *(list(s.shape) + [0] * (4 - len(s.shape))),
                 s.offset, s.nbytes, s.crc32c)
      for s in sections)
  header = HEADER.pack(MAGIC, version, len(sections), table_offset, table_offset + len(table),
                       google_crc32c.value(table))
  return header, table


# CRC32C (Castagnoli), reflected: combining the CRCs of two byte strings into the CRC of their
# concatenation, as zlib's crc32_combine does for its polynomial (x^(8 len) mod P, by squaring).
_CRC32C_POLY = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
  m, p = 1 << 31, 0
  while True:
    if a & m:
      p ^= b
      if (a & (m - 1)) == 0:
        return p
    m >>= 1
    b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
  p, table = 1 << 30, []  # x^1
  for _ in range(32):
    table.append(p)
    p = _multmodp(p, p)
  return table


_X2N = _x2n_table()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
  """The CRC32C of `a + b` from crc32c(a), crc32c(b) and len(b), without reading the bytes.

      crc32c_combine(value(a), value(b), len(b)) == value(a + b)

  Args:
    crc1: CRC32C of the first part.
    crc2: CRC32C of the second part.
    len2: the second part's length in bytes.

  Returns:
    The CRC32C of the concatenation.
  """
  if len2 <= 0:
    return crc1
  p, n, k = 1 << 31, len2, 3  # x^0; x^(8 * len2) = x^(len2 * 2^3)
  while n:
    if n & 1:
      p = _multmodp(_X2N[k & 31], p)
    n >>= 1
    k += 1
  return _multmodp(p, crc1) ^ crc2


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
    if not name or len(name.encode()) > MAX_NAME_BYTES:
      raise ValueError(f"section name {name!r} must be 1..{MAX_NAME_BYTES} bytes")
    if any(s.name == name for s in self._sections):
      raise ValueError(f"section {name!r} written twice")

  def add(self, name: str, array: np.ndarray) -> None:
    """Adds a whole array (C order, stored little-endian).

    Args:
      name: the section's name (1..MAX_NAME_BYTES bytes of UTF-8, unique; over 56 the file is version 2).
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
    """Writes the section table and the header, and closes the file (twice is fine).

    Version 1 when every name fits its 56 bytes, else version 2.
    """
    f = self._f
    if f.closed:
      return
    f.write(b"\0" * _pad(f.tell()))
    table_offset = f.tell()
    header, table = pack_tail(self._sections, table_offset)
    f.write(table)
    f.seek(0)
    f.write(header)
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
    self.header = parse_header(bytes(self._mm[:HEADER.size]), path, size)
    start = self.header.table_offset
    self.sections: dict[str, Section] = parse_table(bytes(self._mm[start:start + self.header.table_nbytes]),
                                                    self.header, path)
    if verify:
      self.verify()
    self.meta: dict[str, Any] = self._read_meta() if META in self.sections else {}

  def _read_meta(self) -> dict[str, Any]:
    """`meta`: a 1-D uint8 section holding a UTF-8 JSON object."""
    s = self.sections[META]
    if s.dtype != "|u1" or len(s.shape) != 1:
      raise GraphBinError(f"{self.path}: section {META!r}: dtype: expected |u1 of 1 dimension, found {s.dtype} of "
                          f"{len(s.shape)}")
    try:
      meta = json.loads(bytes(self[META]).decode("utf-8"))
    except RecursionError:
      raise GraphBinError(f"{self.path}: section {META!r}: not JSON (nested too deeply)") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError
      raise GraphBinError(f"{self.path}: section {META!r}: not JSON ({e})") from None
    if not isinstance(meta, dict):
      raise GraphBinError(f"{self.path}: section {META!r}: expected a JSON object, found {type(meta).__name__}")
    return meta

  def fingerprint(self) -> str:
    """The SHA-256 of the header and the section table (every section's name, place, shape and CRC32C): what
    tells one file's contents from another's without reading them, for a file no manifest lists."""
    h = self.header
    return hashlib.sha256(bytes(self._mm[:HEADER.size]) +
                          bytes(self._mm[h.table_offset:h.table_offset + h.table_nbytes])).hexdigest()

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


# --------------------------------------------------------------------------- what a graph's sections claim

MAX_NODES = 2**62  # nodes of all types together: every id, count and `indptr` entry fits int64 with room
_SPLIT_PARTS = ("train", "valid", "test")
_LINK_ID_KEYS = ("edge", "edge_neg")  # link-prediction split arrays that hold node ids
_SCAN_ROWS = 1 << 22  # rows compared at a time by the monotonicity scan (bounds its temporary memory)


def check_listed(gb: GraphBin, listed: Mapping[str, int] | None) -> None:
  """Refuses a file whose node counts are not the ones its manifest's `graph` entry states (when it states them).

  Raises:
    GraphBinError: meta's num_nodes differ from `listed`.
  """
  found = gb.meta.get("num_nodes", {})
  if listed is not None and dict(listed) != found:
    raise GraphBinError(f"{gb.path}: section 'meta': num_nodes: expected {dict(listed)} (the manifest's graph), "
                        f"found {found}")


def check_graph(gb: GraphBin, values: bool = True) -> None:
  """Checks every shape and value range that `meta` and the sections imply (docs/graphbin.md's table).

  A writer controls every byte of a file, its CRCs included: this is what a reader checks before
  a compiled kernel or a gather trusts the arrays. `meta["num_nodes"]` ({type: count}, type ""
  when homogeneous) fixes the node counts; then

    * `indptr`/`indices` and `csc/...` are CSRs over all nodes: integer, 1-D, len(indptr) = N + 1,
      indptr starts at 0, never decreases and ends at len(indices); indices in [0, N);
    * `edge/<name>` has a row per edge, `node/<name>` a row per node, `node/<type>/<name>` a row
      per node of its type; `split/<s>/<part>` and `split/<s>/<type>/<part>` are 1-D integer ids
      below their node count, link splits' `edge`/`edge_neg` ids too;
    * heterogeneous graphs (a type other than ""): each `rel/<head>___<rel>___<tail>` names node
      types of meta, its CSR has N_head rows over N_tail columns (`csc/rel/...` the reverse), its
      `edge/...` a row per edge; meta's `relations`, `reverse_relations` and `node_type_offsets`
      agree with the sections.

  The value scans (index ranges, indptr order) are vectorised numpy over the mapped arrays: one
  pass for the range of each index array, one (in blocks) for each indptr's order; everything else
  reads the table and a few entries.

  Args:
    gb: the open file (its `meta` parsed).
    values: also scan the values (False: shapes, dtypes, counts and indptr's ends only).

  Raises:
    GraphBinError: "<file>: section '<name>': <what>: expected <x>, found <y>" for the first
      section that disagrees.
  """
  _GraphCheck(gb, values).run()


class _GraphCheck:
  """The checks of `check_graph`, over one file."""

  def __init__(self, gb: GraphBin, values: bool):
    self.gb, self.path, self.values = gb, gb.path, values
    self.counts = self._counts(gb.meta)
    self.total = sum(self.counts.values())
    self.typed = any(t != "" for t in self.counts)

  def fail(self, name: str, what: str) -> GraphBinError:
    return GraphBinError(f"{self.path}: section {name!r}: {what}")

  def _counts(self, meta: Mapping[str, Any]) -> dict[str, int]:
    counts = meta.get("num_nodes", {})
    if not isinstance(counts, dict):
      raise self.fail(META, f"num_nodes: expected an object {{node type: count}}, found {counts!r}")
    for t, n in counts.items():
      if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise self.fail(META, f"num_nodes[{t!r}]: expected a non-negative integer, found {n!r}")
    if sum(counts.values()) > MAX_NODES:
      raise self.fail(META, f"num_nodes: expected at most {MAX_NODES} nodes in all, found {sum(counts.values())}")
    return dict(counts)

  def run(self) -> None:
    names = self.gb.sections
    edges = self.csr("indptr", "indices", self.total, self.total, "num_nodes + 1")
    csc_edges = self.csr("csc/indptr", "csc/indices", self.total, self.total, "num_nodes + 1")
    if edges is not None and csc_edges is not None and csc_edges != edges:
      raise self.fail("csc/indices", f"entries: expected {edges} (entries of 'indices'), found {csc_edges}")
    relations = self.relations() if self.typed else {}
    stray = next((n for n in names if not self.typed and n.split("/")[0] in ("rel", "csc") and "rel/" in n), None)
    if stray is not None:
      raise self.fail(stray, "a relation section, but meta num_nodes names no node types")
    for name in names:
      parts = name.split("/")
      if parts[0] == "edge" and len(parts) >= 2:
        if edges is None:
          raise self.fail(name, "edge rows without 'indices' to follow")
        self.rows(name, edges, "entries of 'indices'")
      elif parts[0] == "node" and len(parts) == 2:
        self.rows(name, self.total, "meta num_nodes")
      elif parts[0] == "node" and len(parts) >= 3:
        t = self.node_type(name, parts[1])
        self.rows(name, self.counts[t], f"meta num_nodes[{t!r}]")
      elif parts[0] == "split":
        self.split(name, parts)
      elif name == "node_type_offsets":
        self.type_offsets(name)
    for name in names:  # one pass: a loop over the relations per section grew as relations x sections
      parts = name.split("/", 3)
      if parts[0] == "rel" and len(parts) == 4 and parts[2] == "edge" and parts[1] in relations:
        self.rows(name, relations[parts[1]], f"entries of 'rel/{parts[1]}/indices'")

  # ---- pieces

  def array(self, name: str, ndim: int | None = 1, integer: bool = True) -> np.ndarray:
    arr = self.gb[name]
    if integer and arr.dtype.kind not in "iu":
      raise self.fail(name, f"dtype: expected an integer dtype, found {arr.dtype.str}")
    if ndim is not None and arr.ndim != ndim:
      raise self.fail(name, f"dimensions: expected {ndim}, found {arr.ndim}")
    return arr

  def rows(self, name: str, expected: int, why: str) -> None:
    s = self.gb.sections[name]
    if not s.shape:
      raise self.fail(name, "dimensions: expected at least 1, found 0")
    if s.shape[0] != expected:
      raise self.fail(name, f"rows: expected {expected} ({why}), found {s.shape[0]}")

  def in_range(self, name: str, arr: np.ndarray, n: int, noun: str) -> None:
    """Every value of `arr` in [0, n): one min and one max over the array, the position only on failure."""
    if arr.size == 0 or not self.values:
      return
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= n:
      flat = arr.reshape(-1)
      at = int(np.flatnonzero((flat < 0) | (flat >= n))[0])
      raise self.fail(name, f"{noun} outside [0, {n}): found {int(flat[at])} at position {at}")

  def csr(self, indptr_name: str, indices_name: str, rows: int, cols: int, why: str) -> int | None:
    """Checks one CSR (absent: both sections absent) and returns its number of entries."""
    has_indptr, has_indices = indptr_name in self.gb, indices_name in self.gb
    if not has_indptr and not has_indices:
      return None
    if not has_indices:
      raise GraphBinError(f"{self.path}: section {indptr_name!r} has no {indices_name!r} beside it")
    if not has_indptr:
      raise GraphBinError(f"{self.path}: section {indices_name!r} has no {indptr_name!r} beside it")
    indptr, indices = self.array(indptr_name), self.array(indices_name)
    if len(indptr) != rows + 1:
      raise self.fail(indptr_name, f"length: expected {rows + 1} ({why}), found {len(indptr)}")
    if int(indptr[0]) != 0:
      raise self.fail(indptr_name, f"first value: expected 0, found {int(indptr[0])}")
    for start in range(0, len(indptr) - 1 if self.values else 0, _SCAN_ROWS):
      block = indptr[start:start + _SCAN_ROWS + 1]
      down = block[1:] < block[:-1]
      if down.any():
        row = start + int(np.argmax(down)) + 1
        raise self.fail(indptr_name, f"decreases at row {row}: {int(indptr[row - 1])} then {int(indptr[row])}")
    if int(indptr[-1]) != len(indices):
      raise self.fail(indptr_name, f"last value: expected {len(indices)} (entries of {indices_name!r}), "
                                   f"found {int(indptr[-1])}")
    self.in_range(indices_name, indices, cols, "indices")
    return len(indices)

  def node_type(self, name: str, t: str) -> str:
    if t not in self.counts:
      raise self.fail(name, f"node type {t!r} is not in meta num_nodes {sorted(self.counts)}")
    return t

  def split(self, name: str, parts: list[str]) -> None:
    if len(parts) == 3 and parts[2] in _SPLIT_PARTS:  # split/<s>/<part>: node ids
      self.in_range(name, self.array(name), self.total, "ids")
    elif len(parts) == 4 and parts[3] in _SPLIT_PARTS:  # split/<s>/<type>/<part>: ids within the type
      t = self.node_type(name, parts[2])
      self.in_range(name, self.array(name), self.counts[t], "ids")
    elif len(parts) == 4 and parts[2] in _SPLIT_PARTS and parts[3] in _LINK_ID_KEYS:  # link pairs
      self.in_range(name, self.array(name, ndim=None), self.total, "ids")

  def type_offsets(self, name: str) -> None:
    found = self.array(name)
    expected = [0]
    for t in sorted(self.counts):
      expected.append(expected[-1] + self.counts[t])
    if len(found) != len(expected):  # before any value is read: the section may be of any size
      raise self.fail(name, f"length: expected {len(expected)} (node types + 1), found {len(found)}")
    if not np.array_equal(found, expected):
      raise self.fail(name, f"expected {expected} (meta num_nodes in type order), found {found.tolist()}")

  def relations(self) -> dict[str, int]:
    """Checks every relation of a heterogeneous graph; returns {relation: its number of edges}."""
    names = self.gb.sections
    found: dict[str, str] = {}  # relation -> the first section naming it
    for name in names:
      prefix = "csc/rel/" if name.startswith("csc/rel/") else "rel/" if name.startswith("rel/") else None
      if prefix is not None:
        found.setdefault(name[len(prefix):].split("/", 1)[0], name)
    edges: dict[str, int] = {}
    for r, first in found.items():
      head, tail = self.endpoints(first, r)
      e = self.csr(f"rel/{r}/indptr", f"rel/{r}/indices", self.counts[head], self.counts[tail],
                   f"num_nodes[{head!r}] + 1")
      csc = self.csr(f"csc/rel/{r}/indptr", f"csc/rel/{r}/indices", self.counts[tail], self.counts[head],
                     f"num_nodes[{tail!r}] + 1")
      if e is None:
        raise self.fail(first, f"relation {r!r} has no 'rel/{r}/indptr'")
      if csc is not None and csc != e:
        raise self.fail(f"csc/rel/{r}/indices", f"entries: expected {e} (entries of 'rel/{r}/indices'), found {csc}")
      edges[r] = e
    meta = self.gb.meta
    listed = meta.get("relations")
    if listed is not None:
      if not isinstance(listed, list) or not all(isinstance(r, str) for r in listed):
        raise self.fail(META, f"relations: expected a list of names, found {listed!r}")
      for r in listed:
        if r not in edges:
          raise self.fail(META, f"relations lists {r!r}, the file has no 'rel/{r}/indptr'")
      listed_set = set(listed)
      for r in edges:
        if r not in listed_set:
          raise self.fail(f"rel/{r}/indptr", f"relation {r!r} is not in meta relations")
    reverse = meta.get("reverse_relations", {})
    if not isinstance(reverse, dict):
      raise self.fail(META, f"reverse_relations: expected an object, found {reverse!r}")
    for r, info in reverse.items():
      n = info.get("num_edges") if isinstance(info, dict) else None
      if r not in edges:
        raise self.fail(META, f"reverse_relations names {r!r}, the file has no 'rel/{r}/indptr'")
      if n != edges[r]:
        raise self.fail(META, f"reverse_relations[{r!r}]['num_edges']: expected {edges[r]} "
                              f"(entries of 'rel/{r}/indices'), found {n!r}")
    return edges

  def endpoints(self, name: str, relation: str) -> tuple[str, str]:
    parts = relation.split("___")
    if len(parts) != 3:
      raise self.fail(name, f"relation {relation!r} is not <head>___<relation>___<tail>")
    return self.node_type(name, parts[0]), self.node_type(name, parts[2])
