"""Reading OGB data set folders as OGB lays them out, without the `ogb` package. No Beam.

Everything here streams: gzip CSVs are parsed in chunks with their line numbers
(a bad row is reported as `file:line`), `.npz` members are read by ranges, and
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
from typing import BinaryIO

import numpy as np
import pandas as pd

from pipelines._errors import InputDataError

DEFAULT_CHUNK_ROWS = 1 << 20


class OgbFormatError(InputDataError):
  """The folder does not hold what OGB's layout says; the message names file and line."""


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
  """master.csv facts for `name` (e.g. "ogbn-arxiv"), or None when ogb is absent or does not know it."""
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


def read_csv_chunks(fileobj: BinaryIO, name: str, dtype: str, ncols: int | None = None,
                    chunk_rows: int = DEFAULT_CHUNK_ROWS, header: bool = False
                    ) -> Iterator[tuple[int, np.ndarray]]:
  """Yields (line number of the chunk's first row, 2-D array) from a gzip CSV.

  `dtype` "int", "float" (empty cells are NaN) or "auto" (int64 when every cell of the
  chunk is an integer, as pandas infers it for OGB's readers, else float64). Raises OgbFormatError
  naming the file and line for a row with the wrong number of cells or a cell that
  is not a number.
  """
  stream = gzip.open(fileobj, "rt")
  line = 2 if header else 1
  try:
    reader = pd.read_csv(stream, header=0 if header else None, chunksize=chunk_rows, dtype=str,
                         keep_default_na=False, na_filter=False, skip_blank_lines=False)
    for chunk in reader:
      if ncols is not None and chunk.shape[1] != ncols:
        raise OgbFormatError(f"{name}: line {line}: expected {ncols} columns, found {chunk.shape[1]}")
      values = chunk.to_numpy()
      arr = None
      if dtype in ("int", "auto"):
        try:
          arr = values.astype(np.int64)
        except (ValueError, OverflowError):
          if dtype == "int":
            _raise_bad_cell(values, name, line, int)
      if arr is None:
        try:
          arr = np.where(values == "", "nan", values).astype(np.float64)
        except (ValueError, OverflowError):
          _raise_bad_cell(values, name, line, lambda c: float(c or "nan"))
      yield line, arr
      line += len(values)
  except pd.errors.ParserError as e:
    raise OgbFormatError(f"{name}: {_parser_message(e, ncols)}") from None
  except (EOFError, gzip.BadGzipFile, OSError, UnicodeDecodeError) as e:
    raise OgbFormatError(f"{name}: unreadable gzip CSV after line {line}: {e}") from None


def _raise_bad_cell(values: np.ndarray, name: str, line: int, parse) -> None:
  for i, row in enumerate(values):
    for cell in row:
      try:
        parse(cell)
      except (ValueError, OverflowError):
        raise OgbFormatError(f"{name}: line {line + i}: {cell!r} is not a number") from None
  raise OgbFormatError(f"{name}: unparsable rows after line {line}")


def _parser_message(e: Exception, ncols: int | None) -> str:
  text = str(e).strip()
  # "Error tokenizing data. C error: Expected 2 fields in line 7, saw 3"
  if "in line" in text:
    detail = text.split("C error: ")[-1]
    line = detail.split("in line ")[1].split(",")[0]
    return f"line {line}: {detail.rstrip()}"
  return text


def read_csv_all(fileobj: BinaryIO, name: str, dtype: str, ncols: int | None = None,
                 header: bool = False) -> np.ndarray:
  chunks = [a for _, a in read_csv_chunks(fileobj, name, dtype, ncols, header=header)]
  if not chunks:
    return np.zeros((0, ncols or 1), np.int64 if dtype == "int" else np.float64)
  return np.concatenate(chunks)


def check_ids(arr: np.ndarray, limit: int, name: str, first_line: int, unit: str = "line") -> None:
  """Node ids must lie in [0, limit); the error names the first bad line (or element)."""
  bad = np.nonzero((arr < 0) | (arr >= limit))[0]
  if bad.size:
    row = int(bad[0]) if arr.ndim == 1 else int(np.nonzero(((arr < 0) | (arr >= limit)).any(axis=1))[0][0])
    raise OgbFormatError(f"{name}: {unit} {first_line + row}: node id outside [0, {limit})")


# --------------------------------------------------------------------------- npz


class NpzMember:
  """One array of an uncompressed `.npz` (what np.savez writes), read by row ranges.

  A deflated member is read whole (np.savez_compressed); its size is then the limit.
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
    with zf.open(member) as m:
      version = np.lib.format.read_magic(m)
      read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
      shape, fortran, dtype = read_header(m)
      header_len = m.tell()
    if fortran:
      raise OgbFormatError(f"{self.name}: Fortran-ordered arrays are not supported")
    self.shape, self.dtype = tuple(shape), np.dtype(dtype)
    self._data_start = None
    if not self._compressed:
      # Offset of the member's data inside the zip: local header + name + extra.
      fileobj.seek(info.header_offset)
      local = fileobj.read(30)
      name_len, extra_len = int.from_bytes(local[26:28], "little"), int.from_bytes(local[28:30], "little")
      self._data_start = info.header_offset + 30 + name_len + extra_len + header_len

  def read(self, start: int, stop: int, row: int | None = None) -> np.ndarray:
    """Elements [start, stop) of the flattened array, or of row `row` of a 2-D array."""
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
  """A link-prediction split file as {key: array}; refuses anything but tensors and containers."""
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
      out[str(key)] = value.numpy()
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
      out[str(key)] = np.asarray(value)
    else:
      raise OgbFormatError(f"{name}: entry {key!r} is a {type(value).__name__}, not a tensor")
  return out
