"""A `.graphbin` built from pieces: each worker writes the bytes of the sections it computed, one
step joins them. No Beam.

A piece is a run of bytes of one section (a partition's share of `indices`, a row range of
`node/feat`), written where the final file's folder is (`<generation>/_parts/`, local or gs://)
by the worker that computed it, with its size and CRC32C. The join lays the sections out exactly as
`formats.graphbin.GraphBinWriter` would (same order, same 64-byte alignment), so the file is byte for
byte what one writer streaming every section would write:

    header (64 bytes) | meta | pad | indptr: [0] piece piece ... | pad | indices: piece ... | ... | table

Section CRCs are combined from the pieces' CRCs (`formats.graphbin.crc32c_combine`), so nothing is
read to compute them. The bytes the join writes itself (the header, `meta`, padding, the leading 0 of
an `indptr`, small sections such as splits, the table) are "glue". Locally the join concatenates
pieces and glue into the final file, hashing as it copies and deleting each piece once copied. On
gs:// the glue is uploaded as small objects and everything is joined by object composition (at most
32 objects per request, in a tree: `formats.storage.files.compose`); the SHA-256 the manifest records is then
computed by reading the composed object back with parallel ranged reads, which also checks its
size, header and table. No worker holds the whole file on its disk or in memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import concurrent.futures
import dataclasses
import hashlib
import os

from apache_beam.io.filesystems import FileSystems
import google_crc32c
import numpy as np

from formats.storage import files as fs
from formats.storage import gcs_download, retry
from formats.graphbin import HEADER, Section, crc32c_combine, pack_tail, padding

_COPY_CHUNK = 16 << 20
_HASH_STREAMS = 8
_HASH_CHUNK = 32 << 20


@dataclasses.dataclass(frozen=True)
class Piece:
  """Bytes of one section of the final file, as the worker that wrote them reports them."""

  section: str
  order: int  # position among the section's pieces: partition number or first row
  path: str  # where the bytes are ("" when there are none)
  nbytes: int
  crc32c: int
  dtype: str  # the stored numpy dtype string ("" when the piece holds no rows)
  rows: int  # the first dimension
  inner: tuple[int, ...] = ()  # the shape after the first dimension
  source: str = ""  # the input file the rows came from, for messages


class PieceWriter:
  """Streams one piece to `dest` (local: a temp file renamed on `close`; gs://: one upload that
  completes on `close`), keeping its size and CRC32C (and SHA-256 with `sha256=True`: a piece a
  later run may reuse). Arrays are stored C-ordered, little-endian."""

  def __init__(self, dest: str, sha256: bool = False):
    self.dest = dest
    self.nbytes = 0
    self.crc32c = 0
    self._sha = hashlib.sha256() if sha256 else None
    if fs.is_gcs(dest):
      self._tmp = None
      self._f = FileSystems.create(dest, mime_type="application/octet-stream")
    else:
      self._tmp = fs.temp_beside(dest)
      self._f = open(self._tmp, "wb")

  def write(self, data) -> None:
    """Appends bytes (or anything with the buffer protocol)."""
    data = bytes(data) if not isinstance(data, bytes) else data
    self.crc32c = google_crc32c.extend(self.crc32c, data)
    if self._sha is not None:
      self._sha.update(data)
    self.nbytes += len(data)
    self._f.write(data)

  def write_array(self, arr: np.ndarray, dtype: str | np.dtype) -> None:
    """Appends an array as `dtype` (little-endian), C order."""
    self.write(np.ascontiguousarray(arr, dtype=stored_dtype(dtype)).tobytes())

  @property
  def sha256(self) -> str:
    """The hex SHA-256 of the bytes written (with `sha256=True`)."""
    return self._sha.hexdigest() if self._sha is not None else ""

  def close(self) -> None:
    """Completes the piece: after this, `dest` holds exactly the bytes written."""
    self._f.close()
    if self._tmp is not None:
      os.replace(self._tmp, self.dest)

  def abort(self) -> None:
    """Drops a piece that failed: locally the temp file is removed; on gs:// the upload is never completed."""
    if self._tmp is not None:
      self._f.close()
      if os.path.exists(self._tmp):
        os.remove(self._tmp)

  def __enter__(self) -> PieceWriter:
    return self

  def __exit__(self, exc_type, *exc) -> None:
    if exc_type is None:
      self.close()
    else:
      self.abort()


def stored_dtype(dtype: str | np.dtype) -> np.dtype:
  """The dtype a section stores: `dtype` little-endian (as GraphBinWriter stores it)."""
  dt = np.dtype(dtype)
  return dt.newbyteorder("<") if dt.itemsize > 1 else dt


def glue_array(arr: np.ndarray, dtype: str | np.dtype | None = None) -> bytes:
  """An array's bytes as a section stores them, for sections the join writes itself."""
  arr = np.asarray(arr)
  return np.ascontiguousarray(arr, dtype=stored_dtype(dtype or arr.dtype)).tobytes()


@dataclasses.dataclass(frozen=True)
class SectionParts:
  """One section of the final file: its dtype and shape, and its bytes in order (pieces or glue)."""

  name: str
  dtype: str
  shape: tuple[int, ...]
  parts: tuple[Piece | bytes, ...]


Segment = Piece | bytes


def layout(sections: Sequence[SectionParts]) -> tuple[list[Segment], list[Section]]:
  """The final file as segments in order, and its section table.

  Adjacent glue is merged into one segment; pieces without bytes are left out. The first segment
  is the header, the last the table (as GraphBinWriter writes them for the same sections).

  Args:
    sections: the sections in file order.

  Returns:
    (segments, sections with their offsets, sizes and CRCs).

  Raises:
    ValueError: a section's bytes disagree with its dtype and shape (a piece missing or twice).
  """
  pos = HEADER.size
  segments: list[Segment] = [b""]  # the header, filled in below
  table: list[Section] = []

  def add(seg: Segment) -> None:
    if isinstance(seg, bytes) and isinstance(segments[-1], bytes) and len(segments) > 1:
      segments[-1] += seg
    elif isinstance(seg, bytes) or seg.nbytes:
      segments.append(seg)

  def align(at: int) -> int:
    """Adds the zeros that bring `at` to the next section boundary; returns the boundary."""
    pad = padding(at)
    if pad:
      add(b"\0" * pad)
    return at + pad

  for s in sections:
    pos = align(pos)
    crc, nbytes = 0, 0
    for part in s.parts:
      if isinstance(part, bytes):
        crc, nbytes = crc32c_combine(crc, google_crc32c.value(part), len(part)), nbytes + len(part)
      else:
        crc, nbytes = crc32c_combine(crc, part.crc32c, part.nbytes), nbytes + part.nbytes
      if isinstance(part, bytes) and not part:
        continue
      add(part)
    expected = int(np.prod(s.shape, dtype=np.int64)) * np.dtype(s.dtype).itemsize
    if nbytes != expected:
      raise ValueError(f"section {s.name!r}: its parts hold {nbytes} bytes, shape {s.shape} of {s.dtype} needs "
                       f"{expected}")
    table.append(Section(s.name, s.dtype, tuple(int(d) for d in s.shape), pos, nbytes, crc))
    pos += nbytes
  pos = align(pos)
  header, tail = pack_tail(table, pos)
  if len(segments) > 1 and isinstance(segments[1], bytes):  # the header joins the glue after it
    segments[0] = header + segments.pop(1)
  else:
    segments[0] = header
  add(tail)
  return segments, table


def file_size(segments: Sequence[Segment]) -> int:
  """The size of the file the segments make."""
  return sum(len(s) if isinstance(s, bytes) else s.nbytes for s in segments)


def join_local(segments: Sequence[Segment], dest: str) -> tuple[str, int]:
  """Concatenates the segments into the local file `dest` (built beside it, renamed when complete),
  hashing as it copies; each piece file is deleted once copied, so the disk holds the file once
  (plus the pieces not yet copied).

  Args:
    segments: what `layout` returned.
    dest: the final local path.

  Returns:
    (hex SHA-256, size) of the file.
  """
  h = hashlib.sha256()
  size = 0
  with fs.replacing(dest) as tmp, open(tmp, "wb") as out:
    for seg in segments:
      if isinstance(seg, bytes):
        h.update(seg)
        out.write(seg)
        size += len(seg)
        continue
      with open(seg.path, "rb") as f:
        copied = 0
        while block := f.read(_COPY_CHUNK):
          h.update(block)
          out.write(block)
          copied += len(block)
      if copied != seg.nbytes:
        raise RuntimeError(f"{seg.path}: {copied} bytes, its writer reported {seg.nbytes}")
      size += copied
      os.remove(seg.path)
  return h.hexdigest(), size


def join_gcs(segments: Sequence[Segment], dest: str, scratch: str, max_sources: int | None = None,
             policy: retry.Policy | None = None) -> tuple[str, int]:
  """Composes the segments into the gs:// object `dest`; returns its (hex SHA-256, size).

  Glue segments are uploaded to `<scratch>/glue-<i>` first. After the compose, the object is read
  back by parallel ranged reads: its SHA-256, and a check that its size, header and table are the
  ones laid out (a compose that went wrong is caught here, before any manifest names the file).
  Each compose request and each ranged read is retried on transient errors by `policy`, and only
  there (nothing here retries).

  Args:
    segments: what `layout` returned (pieces already on gs://, in `dest`'s bucket).
    dest: the final gs:// object.
    scratch: a gs:// folder in the same bucket for glue and intermediate objects (the caller
      deletes it afterwards).
    max_sources: objects per compose request (formats.storage.files.compose); None: `fs.COMPOSE_MAX_SOURCES`
      as it is when called (tests lower it to build a deeper tree).
    policy: the retry policy (a pipeline's deadline is --transient_retry_seconds); None: the process's,
      `formats.storage.retry.default()`.

  Returns:
    (hex SHA-256, size) of the composed object.

  Raises:
    RuntimeError: the composed object is not what was laid out.
  """
  sources = []
  for i, seg in enumerate(segments):
    if isinstance(seg, bytes):
      name = fs.join(scratch, f"glue-{i:06d}")
      with FileSystems.create(name, mime_type="application/octet-stream") as f:
        f.write(seg)
      sources.append(name)
    else:
      sources.append(seg.path)
  policy = policy or retry.default()
  fs.compose(sources, dest, scratch, max_sources or fs.COMPOSE_MAX_SOURCES, policy)
  size = file_size(segments)
  obj = gcs_download.remote_object(dest)
  if obj.size != size:
    raise RuntimeError(f"{dest}: composed object holds {obj.size} bytes, its parts {size}")
  head, tail = segments[0], segments[-1]
  h = hashlib.sha256()
  options = gcs_download.DownloadOptions(retries=None, retry_seconds=policy.timeout, progress=False)
  for start, data in _ranges(obj, size, options):
    if start == 0 and data[:len(head)] != head[:len(data)]:
      raise RuntimeError(f"{dest}: composed object does not start with the header written")
    h.update(data)
    last = data
  if isinstance(tail, bytes) and size and not last.endswith(tail[-min(len(tail), len(last)):]):
    raise RuntimeError(f"{dest}: composed object does not end with the section table written")
  return h.hexdigest(), size


def _ranges(obj: gcs_download.RemoteObject, size: int, options: gcs_download.DownloadOptions
            ) -> Iterator[tuple[int, bytes]]:
  """(start, bytes) of the object's chunks in order, fetched `_HASH_STREAMS` at a time."""
  starts = list(range(0, size, _HASH_CHUNK))
  with concurrent.futures.ThreadPoolExecutor(_HASH_STREAMS) as pool:
    pending: dict[int, concurrent.futures.Future] = {}
    for k, start in enumerate(starts):
      for j in range(k, min(len(starts), k + _HASH_STREAMS)):
        if j not in pending:
          pending[j] = pool.submit(gcs_download.read_range, obj, starts[j], min(size, starts[j] + _HASH_CHUNK),
                                   options)
      yield start, pending.pop(k).result()
