"""Reading OGB data set folders as OGB lays them out, without the `ogb` package. No Beam.

Everything here streams: gzip CSVs are parsed in chunks with their line numbers
(a bad row is reported as `file: line N`, 1-based as OGB counts), `.npz` members are read by ranges, and
link-prediction `.pt` splits are loaded with `torch.load(weights_only=True)`,
which refuses pickled code.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
import dataclasses
import gzip
import importlib.util
import io
import os
import zipfile
import zlib
from typing import BinaryIO

import numpy as np
import pandas as pd

from formats.storage import retry
from pipelines.core.errors import InputDataError

DEFAULT_CHUNK_ROWS = 1 << 20


class OgbFormatError(InputDataError):
  """The folder does not hold what OGB's layout says; the message names file and line."""


class OgbMissingFileError(OgbFormatError):
  """A file the layout needs is absent: found at launch, a usage error (exit status 2)."""


# --------------------------------------------------------------------------- master.csv


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """The facts of one OGB data set from the `ogb` package's master.csv."""

  name: str
  task: str  # "node", "link" or "graph"
  add_inverse_edge: bool
  split: str
  additional_node_files: tuple[str, ...]
  additional_edge_files: tuple[str, ...]
  is_hetero: bool
  binary: bool


def _master_tables() -> Iterator[tuple[str, dict[str, dict[str, str]]]]:
  # Found without importing ogb: its __init__ checks PyPI for a newer version over the network.
  spec = importlib.util.find_spec("ogb")
  if spec is None or not spec.submodule_search_locations:
    return
  root = list(spec.submodule_search_locations)[0]
  for task, folder in (("node", "nodeproppred"), ("link", "linkproppred"), ("graph", "graphproppred")):
    try:
      with open(os.path.join(root, folder, "master.csv")) as f:
        text = f.read()
    except FileNotFoundError:
      continue
    rows = list(csv.reader(io.StringIO(text)))
    names = rows[0][1:]
    table = {name: {row[0]: row[i + 1] for row in rows[1:] if len(row) > i + 1} for i, name in enumerate(names)}
    yield task, table


def dataset_info(name: str) -> DatasetInfo | None:
  """master.csv facts for `name` (e.g. "ogbn-arxiv"), found without importing `ogb`.

  Args:
    name: the OGB data set name, with dashes.

  Returns:
    The `DatasetInfo`, or None when ogb is not installed or does not know the name.
  """
  for task, table in _master_tables():
    if name in table:
      row = table[name]

      def files(key: str) -> tuple[str, ...]:
        value = row.get(key, "None")
        return () if value in ("None", "") else tuple(value.split(","))

      return DatasetInfo(
          name=name, task=task, add_inverse_edge=row.get("add_inverse_edge") == "True",
          split=row.get("split", ""), additional_node_files=files("additional node files"),
          additional_edge_files=files("additional edge files"), is_hetero=row.get("is hetero") == "True",
          binary=row.get("binary") == "True")
  return None


# --------------------------------------------------------------------------- CSV


NONFINITE_POLICIES = ("error", "nan", "allow")
_READ_BYTES = 1 << 24


def read_csv_chunks(fileobj: BinaryIO, name: str, dtype: str, ncols: int | None = None,
                    chunk_rows: int = DEFAULT_CHUNK_ROWS, header: bool = False, nonfinite: str = "error"
                    ) -> Iterator[tuple[int, np.ndarray]]:
  """Yields (line number of the chunk's first row, 2-D array) from a gzip CSV.

  Every check is vectorised over the chunk; an empty file yields nothing.

  Args:
    fileobj: the gzip CSV, opened in binary.
    name: the file's name, for error messages.
    dtype: "int", "float" (empty cells are NaN), "auto" (int64 when every cell of the
      chunk is an integer, as pandas infers it for OGB's readers, else float64) or
      "str" (the cells as text).
    ncols: the cells every row must have; None: as many as most rows of the first chunk.
    chunk_rows: rows per chunk.
    header: skip the first line.
    nonfinite: "error" refuses NaN/inf cells, "nan" refuses only ±inf (OGB marks a
      missing label with an empty cell), "allow" keeps both.

  Yields:
    (1-based line of the chunk's first row, [rows, ncols] array).

  Raises:
    OgbFormatError: an empty, short or long row, a cell that is not a number, an
      integer outside int64, a refused non-finite value, or a broken gzip stream;
      the message names the file and its 1-based line.
    ValueError: an unknown `dtype` or `nonfinite`.
  """
  if dtype not in ("int", "float", "auto", "str") or nonfinite not in NONFINITE_POLICIES:
    raise ValueError(f"dtype {dtype!r} / nonfinite {nonfinite!r}")
  line = 1
  try:
    stream = gzip.open(fileobj, "rb")
    if header:
      if not stream.readline():
        return
      line = 2
    for block, rows in _line_blocks(stream, chunk_rows):
      # Fast path: pandas parses plain numbers; a block it takes whole, rows of `ncols` numbers each (the
      # first line's count when not known yet) without a non-finite value, passes every check below
      # (a short or empty row would hold NaN, a long one fails the parse, a stray byte is >= 128).
      arr = None
      if dtype != "str" and np.frombuffer(block, np.uint8).max(initial=0) < 128:
        guess = ncols or block[:block.find(b"\n")].count(b",") + 1
        arr = _fast_numbers(block, rows, guess, dtype)
        if arr is not None and arr.dtype.kind == "f" and not np.isfinite(arr).all():
          arr = None
        ncols = guess if arr is not None else ncols
      if arr is None:
        rows, ncols = _check_block(block, name, line, ncols)
        values = _cells(block, name, line, rows, ncols)  # the text of each cell: the checks' messages quote it
        if dtype == "str":
          arr = values
        else:
          arr = _to_numbers(values, name, line, dtype)
          if arr.dtype.kind == "f" and nonfinite != "allow":
            bad = ~np.isfinite(arr) if nonfinite == "error" else np.isinf(arr)
            if bad.any():
              i, j = np.argwhere(bad)[0]
              raise OgbFormatError(f"{name}: line {line + i}: non-finite value {values[i, j]!r} in column {j + 1} "
                                   "(--allow_nonfinite=true keeps NaN/inf)")
      yield line, arr
      line += len(arr)
  except (EOFError, OSError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
    if isinstance(e, retry.RetryExhausted) or retry.is_transient(e):
      raise  # the network's fault, not the file's: the job fails as transient (never a format error)
    raise OgbFormatError(f"{name}: line {line}: unreadable gzip stream: {e}") from None


def _line_blocks(stream: BinaryIO, rows: int) -> Iterator[tuple[bytes, int]]:
  """(block, lines) of exactly `rows` whole lines (fewer in the last), each line ending in a newline.

  Newlines are counted per read; only the read where a block ends is searched for its cut.
  """
  pending: list[bytes] = []
  counts: list[int] = []
  count, eof = 0, False
  while True:
    while count < rows and not eof:
      data = stream.read(_READ_BYTES)
      if data:
        pending.append(data)
        counts.append(data.count(b"\n"))
        count += counts[-1]
      else:
        eof = True
    if count < rows:
      buf = b"".join(pending)
      if buf and not buf.endswith(b"\n"):
        buf += b"\n"
        count += 1
      if buf:
        yield buf, count
      return
    need, i = rows, 0
    while counts[i] < need:
      need -= counts[i]
      i += 1
    piece = pending[i]
    cut = int(np.flatnonzero(np.frombuffer(piece, np.uint8) == 10)[need - 1]) + 1
    block = b"".join(pending[:i] + [piece[:cut]])
    rest = piece[cut:]
    pending = ([rest] if rest else []) + pending[i + 1:]  # the reads are dropped before the block is used
    counts = ([counts[i] - need] if rest else []) + counts[i + 1:]
    count -= rows
    del piece
    yield block, rows
    del block


def _split_block(block: bytes, name: str, line: int, ncols: int | None) -> tuple[np.ndarray, int]:
  """The cells of whole lines as a [rows, ncols] array of str, after the shape checks."""
  rows, ncols = _check_block(block, name, line, ncols)
  return _cells(block, name, line, rows, ncols), ncols


def _check_block(block: bytes, name: str, line: int, ncols: int | None) -> tuple[int, int]:
  """(rows, cells per row) of whole lines, after the shape checks: ASCII, no empty row, `ncols` cells each."""
  b = np.frombuffer(block, np.uint8)
  high = np.flatnonzero(b >= 128)
  ends = np.flatnonzero(b == 10)
  if high.size:
    row = int(np.searchsorted(ends, high[0]))
    raise OgbFormatError(f"{name}: line {line + row}: not an ASCII number (byte 0x{b[high[0]]:02x})")
  starts = np.concatenate([[0], ends[:-1] + 1])
  lengths = ends - starts - (b[np.maximum(ends - 1, 0)] == 13)  # "\r\n" endings
  cells = np.diff(np.concatenate([[0], np.searchsorted(np.flatnonzero(b == 44), ends)])) + 1
  blank = np.flatnonzero(lengths <= 0)
  if blank.size:
    raise OgbFormatError(f"{name}: line {line + int(blank[0])}: empty row")
  if ncols is None:
    ncols = int(np.bincount(cells).argmax())  # most rows decide; the odd row is the one named
  wrong = np.flatnonzero(cells != ncols)
  if wrong.size:
    row = int(wrong[0])
    raise OgbFormatError(f"{name}: line {line + row}: {cells[row]} cells, expected {ncols}")
  return len(ends), ncols


def _cells(block: bytes, name: str, line: int, rows: int, ncols: int) -> np.ndarray:
  """The cells of a checked block as a [rows, ncols] array of str."""
  frame = pd.read_csv(io.BytesIO(block), header=None, dtype=object, keep_default_na=False, na_filter=False,
                      quoting=csv.QUOTE_NONE, skip_blank_lines=False, engine="c")
  values = frame.to_numpy()
  if values.shape != (rows, ncols):  # the checks above make this unreachable
    raise OgbFormatError(f"{name}: lines {line}..{line + rows - 1}: unparsable rows")
  return values


_PARSE_BYTES = 64 << 20  # pandas parses a block in runs of whole lines of about this size (bounds its buffers)


def _fast_numbers(block: bytes, rows: int, ncols: int, dtype: str) -> np.ndarray | None:
  """A checked block parsed by pandas' own number parser, or None where the text path must decide.

  The same numbers `_to_numbers` gives from the cells' text (pandas parses floats correctly rounded,
  as Python does: tests/pipelines/test_ogb_pieces.py compares them bit for bit), at a fraction of
  the cost: no Python string per cell. None for anything but plain int64 / float64 columns (an empty
  cell, a word, an integer outside int64): the text path then gives the value or names the cell.
  The block is parsed in runs of whole lines (`_PARSE_BYTES`), so pandas' own buffers stay small;
  the block is integers when every run is, else every run is taken as float64, as one parse of the
  whole block would give it.
  """
  runs, at = [], 0
  while at < len(block):
    cut = block.find(b"\n", min(len(block), at + _PARSE_BYTES) - 1) + 1 or len(block)
    try:
      frame = pd.read_csv(io.BytesIO(block[at:cut]), header=None, na_filter=False, quoting=csv.QUOTE_NONE,
                          skip_blank_lines=False, engine="c", low_memory=False)
    except (ValueError, OverflowError, pd.errors.ParserError):
      return None
    kinds = {str(t) for t in frame.dtypes}
    if frame.shape[1] != ncols or not kinds <= {"int64", "float64"}:
      return None
    runs.append(frame.to_numpy(np.int64 if kinds == {"int64"} else np.float64))
    del frame
    at = cut
  if sum(len(r) for r in runs) != rows:
    return None
  if all(r.dtype == np.int64 for r in runs) and dtype in ("int", "auto"):
    out = np.concatenate(runs) if len(runs) != 1 else runs[0]
    return out
  if dtype == "int":
    return None  # a float cell in an integer file: the text path names it
  out = np.empty((rows, ncols), np.float64)
  i = 0
  for r in runs:
    out[i:i + len(r)] = r
    i += len(r)
  return out


def _to_numbers(values: np.ndarray, name: str, line: int, dtype: str) -> np.ndarray:
  if dtype in ("int", "auto"):
    try:
      return values.astype(np.int64)
    except (ValueError, OverflowError):
      if dtype == "int":
        _raise_bad_cell(values, name, line, _as_int)
  try:
    return _as_float(values)
  except (ValueError, OverflowError):
    _raise_bad_cell(values, name, line, _as_float)
  raise AssertionError("unreachable")


def _as_int(values: np.ndarray) -> np.ndarray:
  return values.astype(np.int64)


def _as_float(values: np.ndarray) -> np.ndarray:
  return np.where(values == "", "nan", values).astype(np.float64)


def _raise_bad_cell(values: np.ndarray, name: str, line: int, convert) -> None:
  """Finds the first row `convert` refuses by bisection (numpy calls only), then its cell."""
  lo, hi = 0, len(values)
  while hi - lo > 1:
    mid = (lo + hi) // 2
    try:
      convert(values[lo:mid])
    except (ValueError, OverflowError):
      hi = mid
    else:
      lo = mid
  for cell in values[lo]:
    try:
      convert(np.array([[cell]], dtype=object))
    except (ValueError, OverflowError):
      raise OgbFormatError(f"{name}: line {line + lo}: {_why_not_a_number(cell, convert is _as_int)}") from None
  raise OgbFormatError(f"{name}: line {line + lo}: unparsable row")


def _why_not_a_number(cell: str, integer: bool) -> str:
  shown = repr(cell if len(cell) <= 40 else cell[:40] + "...")
  if cell.strip() == "":
    return "empty cell"
  try:
    int(cell)
    return f"{shown} is outside the int64 range"
  except ValueError:
    pass
  try:
    float(cell)
    return f"{shown} is not an integer" if integer else f"{shown} is not a number"
  except ValueError:
    return f"{shown} is not a number"


def to_int64(values: np.ndarray, name: str, line: int) -> np.ndarray:
  """Text cells (as read_csv_chunks' "str" gives them) as int64.

  Args:
    values: a 2-D array of text cells.
    name: the file's name, for error messages.
    line: the 1-based line of the first row.

  Returns:
    The cells as an int64 array of the same shape.

  Raises:
    OgbFormatError: a cell is not an integer or is outside int64 (the message names its line).
  """
  return _to_numbers(np.asarray(values, dtype=object), name, line, "int")


def read_csv_all(fileobj: BinaryIO, name: str, dtype: str, ncols: int | None = None,
                 header: bool = False, nonfinite: str = "error") -> np.ndarray:
  """A whole (small) gzip CSV as one array: `read_csv_chunks` joined.

  Args:
    fileobj: the gzip CSV, opened in binary.
    name: the file's name, for error messages.
    dtype: as in `read_csv_chunks`.
    ncols: as in `read_csv_chunks`.
    header: skip the first line.
    nonfinite: as in `read_csv_chunks`.

  Returns:
    A [rows, ncols] array; an empty file gives [0, ncols or 1].

  Raises:
    OgbFormatError: as `read_csv_chunks`.
  """
  chunks = [a for _, a in read_csv_chunks(fileobj, name, dtype, ncols, header=header, nonfinite=nonfinite)]
  if not chunks:
    empty = {"int": np.int64, "str": object}.get(dtype, np.float64)
    return np.zeros((0, ncols or 1), empty)
  return np.concatenate(chunks)


def check_rows(name: str, rows: int, expected: int, what: str, source: str, first_line: int = 1) -> None:
  """A file's row count must be what `source` says.

  Args:
    name: the file checked.
    rows: the rows it holds.
    expected: the rows `source` says it must hold.
    what: what a row is, for the message (e.g. "edges").
    source: the file that gives the count.
    first_line: the 1-based line of the first row (2 after a header).

  Raises:
    OgbFormatError: the counts differ; the message names the first line too many or missing.
  """
  if rows > expected:
    raise OgbFormatError(f"{name}: line {first_line + expected}: more rows than {source} says "
                         f"({expected} {what})")
  if rows < expected:
    raise OgbFormatError(f"{name}: line {first_line + rows}: file ends after {rows} rows; "
                         f"{source} says {expected} {what}")


def first_nonfinite(arr: np.ndarray, nonfinite: str) -> int | None:
  """Index along axis 0 of the first row holding a value `nonfinite` refuses, or None.

  Args:
    arr: the values; integer arrays never hold one.
    nonfinite: the policy, as in `read_csv_chunks`.

  Returns:
    The first refused row's index, or None.
  """
  if arr.dtype.kind != "f" or nonfinite == "allow":
    return None
  bad = ~np.isfinite(arr) if nonfinite == "error" else np.isinf(arr)
  rows = np.flatnonzero(bad.reshape(len(arr), -1).any(axis=1))
  return int(rows[0]) if rows.size else None


def check_ids(arr: np.ndarray, limit: int, name: str, first_line: int, unit: str = "line") -> None:
  """Node ids must lie in [0, limit).

  Args:
    arr: node ids, 1-D or one row per edge.
    limit: the number of nodes.
    name: the file's name, for the message.
    first_line: the line (or element) number of the first row.
    unit: what the message calls a row ("line" or "element").

  Raises:
    OgbFormatError: an id is out of range; the message names the first bad row.
  """
  bad = np.nonzero((arr < 0) | (arr >= limit))[0]
  if bad.size:
    row = int(bad[0]) if arr.ndim == 1 else int(np.nonzero(((arr < 0) | (arr >= limit)).any(axis=1))[0][0])
    raise OgbFormatError(f"{name}: {unit} {first_line + row}: node id outside [0, {limit})")


# --------------------------------------------------------------------------- npz


class NpzMember:
  """One array of an `.npz`, read by row ranges (`read`) or streamed (`chunks`).

  A stored member (np.savez) is read in place, any range at any time. A deflated member
  (np.savez_compressed) cannot be entered in the middle: `chunks` streams it, decompressing
  from its start once; `read` of a deflated member decompresses it whole each call.
  """

  def __init__(self, fileobj: BinaryIO, name: str, key: str):
    self._f = fileobj
    self.name = f"{name}:{key}"
    zf = zipfile.ZipFile(fileobj)
    member = key + ".npy"
    if member not in zf.namelist():
      raise OgbFormatError(f"{name}: no array {key!r} (it has {sorted(n[:-4] for n in zf.namelist())})")
    info = zf.getinfo(member)
    self._zf, self._member, self._compressed = zf, member, info.compress_type != zipfile.ZIP_STORED
    try:
      with zf.open(member) as m:
        version = np.lib.format.read_magic(m)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(m)
        header_len = m.tell()
    except (ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:  # numpy quotes the bytes it found
      raise OgbFormatError(f"{self.name}: not a .npy array ({type(e).__name__})") from None
    if fortran:
      raise OgbFormatError(f"{self.name}: Fortran-ordered arrays are not supported")
    if np.dtype(dtype).hasobject:  # pickled Python objects: never unpickled
      raise OgbFormatError(f"{self.name}: an array of Python objects, not numbers")
    self.shape, self.dtype = tuple(shape), np.dtype(dtype)
    self._header_len = header_len
    self._data_start = None
    if not self._compressed:
      # Offset of the member's data inside the zip: local header + name + extra.
      fileobj.seek(info.header_offset)
      local = fileobj.read(30)
      name_len, extra_len = int.from_bytes(local[26:28], "little"), int.from_bytes(local[28:30], "little")
      self._data_start = info.header_offset + 30 + name_len + extra_len + header_len

  @property
  def compressed(self) -> bool:
    """Whether the member is deflated (np.savez_compressed): it is then streamed, never entered mid-way."""
    return self._compressed

  def chunks(self, start: int, stop: int, step: int, row: int | None = None) -> Iterator[np.ndarray]:
    """Rows (or elements of row `row`) [start, stop) in pieces of `step`, as `read` gives them.

    A deflated member is decompressed once, from its start to `stop` (what lies before `start`
    is decompressed and dropped); a stored one is read in place.

    Args:
      start: the first row (or element).
      stop: the row (or element) after the last.
      step: rows (or elements) per piece.
      row: stream inside this row of a 2-D array; None streams whole rows.

    Yields:
      Arrays of at most `step` rows (elements), in order.

    Raises:
      OgbFormatError: the member is truncated or its stream is damaged.
    """
    if not self._compressed:
      for a in range(start, stop, step):
        yield self.read(a, min(stop, a + step), row)
      return
    inner = int(np.prod(self.shape[1:], dtype=np.int64)) if row is None else 1
    base = 0 if row is None else row * self.shape[1]
    size = self.dtype.itemsize
    try:
      with self._zf.open(self._member) as m:
        m.seek(self._header_len + (base + start) * inner * size)
        for a in range(start, stop, step):
          b = min(stop, a + step)
          data = m.read((b - a) * inner * size)
          if len(data) != (b - a) * inner * size:
            raise OgbFormatError(f"{self.name}: truncated (wanted elements {a}..{b})")
          out = np.frombuffer(data, dtype=self.dtype)
          yield out if row is not None else out.reshape((b - a, *self.shape[1:]))
    except (EOFError, zipfile.BadZipFile, zlib.error) as e:
      raise OgbFormatError(f"{self.name}: unreadable compressed member ({type(e).__name__}: {e})") from None

  def read(self, start: int, stop: int, row: int | None = None) -> np.ndarray:
    """Rows [start, stop) of the array, or elements [start, stop) of row `row` of a 2-D array.

    Args:
      start: the first row (or element) read.
      stop: the row (or element) after the last.
      row: read inside this row of a 2-D array; None reads whole rows.

    Returns:
      [stop - start, *shape[1:]] values, or a 1-D array of stop - start values with `row`.

    Raises:
      OgbFormatError: the member is truncated.
    """
    inner = int(np.prod(self.shape[1:], dtype=np.int64)) if row is None else 1
    base = 0 if row is None else row * self.shape[1]
    count = (stop - start) * inner
    if self._data_start is None:
      with self._zf.open(self._member) as m:
        arr = np.lib.format.read_array(m)
      flat = arr.reshape(-1)
      out = flat[(base + start) * inner:(base + start) * inner + count]
      return out if row is not None else out.reshape((stop - start, *self.shape[1:]))
    self._f.seek(self._data_start + (base + start * inner) * self.dtype.itemsize)
    data = self._f.read(count * self.dtype.itemsize)
    if len(data) != count * self.dtype.itemsize:
      raise OgbFormatError(f"{self.name}: truncated (wanted elements {start}..{stop})")
    out = np.frombuffer(data, dtype=self.dtype)
    return out if row is not None else out.reshape((stop - start, *self.shape[1:]))


# --------------------------------------------------------------------------- .pt splits


def load_pt_split(fileobj: BinaryIO, name: str) -> dict[str, np.ndarray]:
  """A link-prediction split file as {key: array}; refuses anything but tensors and containers.

  Loaded with `torch.load(weights_only=True)`: pickled code is refused, never run.

  Args:
    fileobj: the `.pt` file, opened in binary.
    name: the file's name, for error messages.

  Returns:
    {key: array} for each tensor or list of numbers in the file's dict.

  Raises:
    OgbFormatError: not a plain tensor file, not a dict, or an entry that is neither.
  """
  import torch  # only link-prediction data sets need it

  try:
    obj = torch.load(io.BytesIO(fileobj.read()), map_location="cpu", weights_only=True)
  except Exception as e:  # UnpicklingError for pickled code, RuntimeError for a damaged zip
    raise OgbFormatError(f"{name}: not a plain tensor file (refused without running it): "
                         f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
  if not isinstance(obj, dict):
    raise OgbFormatError(f"{name}: expected a dict of tensors, got {type(obj).__name__}")
  out = {}
  for key, value in obj.items():
    if isinstance(value, torch.Tensor):
      try:
        arr = value.numpy()
      except (TypeError, RuntimeError):  # bfloat16, a quantized or sparse tensor: nothing numpy holds
        raise OgbFormatError(f"{name}: entry {key!r} is a {value.dtype} tensor, which numpy does not hold") from None
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
      arr = np.asarray(value)
    else:
      raise OgbFormatError(f"{name}: entry {key!r} is a {type(value).__name__}, not a tensor")
    if arr.ndim > 2 or arr.dtype.kind not in "iufb":  # OGB's split entries are id lists and [E, k] id tables
      raise OgbFormatError(f"{name}: entry {key!r}: {arr.ndim}-D {arr.dtype}, expected 1-D or 2-D numbers")
    out[str(key)] = arr
  return out


# Entries of a link split that hold node ids (ogbl-collab, -ddi, -ppa: edge, edge_neg; -citation2: source_node,
# target_node, target_node_neg; -wikikg2 and -biokg: head, tail, head_neg, tail_neg).
LINK_ID_ENTRIES = frozenset({"edge", "edge_neg", "source_node", "target_node", "target_node_neg", "head", "tail",
                             "head_neg", "tail_neg"})
