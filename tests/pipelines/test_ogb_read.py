"""`pipelines.ogb_graphs.read`: OGB's files read without the `ogb` package, errors with file and line. No Beam."""

from __future__ import annotations

import gzip
import io
import zipfile

import numpy as np
import pytest
import torch

from pipelines.ogb_graphs.read import (
    NpzMember, OgbFormatError, check_ids, check_rows, load_pt_split, read_csv_all, read_csv_chunks, to_int64)


def _gz(text: str) -> io.BytesIO:
  return io.BytesIO(gzip.compress(text.encode()))


def _chunks(text: str, dtype: str, **kw) -> list[tuple[int, np.ndarray]]:
  return list(read_csv_chunks(_gz(text), "f.csv.gz", dtype, **kw))


# --------------------------------------------------------------------------- read_csv_chunks


@pytest.mark.parametrize("chunk_rows,starts", [(1, [1, 2, 3, 4, 5]), (2, [1, 3, 5]), (5, [1]), (100, [1])])
def test_chunks_hold_whole_rows_and_their_first_line(chunk_rows, starts):
  text = "".join(f"{i},{10 * i}\n" for i in range(5))
  chunks = _chunks(text, "int", ncols=2, chunk_rows=chunk_rows)
  assert [line for line, _ in chunks] == starts
  assert all(a.dtype == np.int64 and a.shape[1] == 2 for _, a in chunks)
  np.testing.assert_array_equal(np.concatenate([a for _, a in chunks]), [[i, 10 * i] for i in range(5)])


def test_a_header_row_is_skipped_and_lines_count_from_two():
  chunks = _chunks("a,b\n1,2\n3,4\n", "int", header=True, chunk_rows=1)
  assert [line for line, _ in chunks] == [2, 3]


def test_a_last_row_without_newline_and_crlf_endings_are_read():
  np.testing.assert_array_equal(_chunks("1,2\r\n3,4", "int")[0][1], [[1, 2], [3, 4]])


def test_an_empty_file_yields_nothing():
  assert _chunks("", "int") == []
  assert _chunks("", "float", header=True) == []


@pytest.mark.parametrize("chunk_rows", [1, 3, 1000])
def test_a_bad_cell_names_its_line_in_any_chunk(chunk_rows):
  text = "1,2\n3,4\n5,6\n7,x\n9,10\n"
  with pytest.raises(OgbFormatError, match=r"^f.csv.gz: line 4: 'x' is not a number$"):
    _chunks(text, "int", chunk_rows=chunk_rows)


@pytest.mark.parametrize("cell,why", [
    ("1.5", "'1.5' is not an integer"),
    ("99999999999999999999", "'99999999999999999999' is outside the int64 range"),
    ("", "empty cell"),
])
def test_int_cells_that_are_not_int64(cell, why):
  with pytest.raises(OgbFormatError, match=rf"^f.csv.gz: line 2: {why}$"):
    _chunks(f"1,2\n3,{cell}\n", "int")


@pytest.mark.parametrize("text,line,message", [
    ("1,2\n3,4,5\n6,7\n", 2, "3 cells, expected 2"),
    ("1,2\n3\n6,7\n", 2, "1 cells, expected 2"),
    ("1,2\n\n6,7\n", 2, "empty row"),
    ("1,2\n3,\xe9\n", 2, r"not an ASCII number \(byte 0xc3\)"),
])
def test_row_shape_errors_name_the_line(text, line, message):
  with pytest.raises(OgbFormatError, match=rf"^f.csv.gz: line {line}: {message}$"):
    _chunks(text, "int")


def test_the_column_count_is_given_or_decided_by_most_rows():
  with pytest.raises(OgbFormatError, match=r"line 1: 2 cells, expected 3"):
    _chunks("1,2\n3,4\n", "int", ncols=3)
  with pytest.raises(OgbFormatError, match=r"line 1: 1 cells, expected 2"):  # two rows of 2 outvote one of 1
    _chunks("1\n2,3\n4,5\n", "int")


def test_the_column_count_of_the_first_chunk_holds_for_the_rest():
  with pytest.raises(OgbFormatError, match=r"^f.csv.gz: line 3: 3 cells, expected 2$"):
    _chunks("1,2\n3,4\n5,6,7\n", "int", chunk_rows=2)


def test_int_float_and_auto():
  assert _chunks("1,2\n", "float")[0][1].dtype == np.float64
  assert _chunks("1,2\n", "auto")[0][1].dtype == np.int64
  assert _chunks("1,2.5\n", "auto")[0][1].dtype == np.float64
  np.testing.assert_array_equal(_chunks("1,2\n3,4\n", "str")[0][1], [["1", "2"], ["3", "4"]])
  with pytest.raises(OgbFormatError, match=r"line 1: '2.5' is not an integer"):
    _chunks("1,2.5\n", "int")
  with pytest.raises(OgbFormatError, match=r"line 2: 'a' is not a number"):
    _chunks("1\na\n", "auto")


def test_auto_decides_per_chunk():
  chunks = _chunks("1\n2\n3.5\n", "auto", chunk_rows=2)
  assert [a.dtype for _, a in chunks] == [np.int64, np.float64]


@pytest.mark.parametrize("cell", ["nan", "inf", "-inf", ""])
def test_nonfinite_error_refuses_nan_inf_and_empty_float_cells(cell):
  with pytest.raises(OgbFormatError, match=rf"^f.csv.gz: line 2: non-finite value '{cell}' in column 2 "):
    _chunks(f"1,2\n3,{cell}\n", "float")


def test_nonfinite_nan_keeps_nan_and_empty_cells_but_not_inf():
  arr = _chunks("1,\n2,nan\n", "float", nonfinite="nan")[0][1]
  assert np.isnan(arr[:, 1]).all()
  with pytest.raises(OgbFormatError, match=r"line 1: non-finite value '-inf' in column 1"):
    _chunks("-inf,1\n", "float", nonfinite="nan")


def test_nonfinite_allow_keeps_both():
  arr = _chunks("inf,nan\n,-inf\n", "float", nonfinite="allow")[0][1]
  assert np.isposinf(arr[0, 0])
  assert np.isnan(arr[0, 1])
  assert np.isnan(arr[1, 0])
  assert np.isneginf(arr[1, 1])


def test_bad_arguments_and_a_broken_gzip():
  with pytest.raises(ValueError, match="dtype 'bytes'"):
    _chunks("1\n", "bytes")
  with pytest.raises(ValueError, match="nonfinite 'ignore'"):
    _chunks("1\n", "float", nonfinite="ignore")
  with pytest.raises(OgbFormatError, match=r"^f.csv.gz: line 1: unreadable gzip stream"):
    list(read_csv_chunks(io.BytesIO(b"1,2\n"), "f.csv.gz", "int"))


def test_to_int64_names_the_line():
  np.testing.assert_array_equal(to_int64(np.array([["1"], ["2"]], dtype=object), "n.csv.gz", 1), [[1], [2]])
  with pytest.raises(OgbFormatError, match=r"^n.csv.gz: line 6: 'x' is not a number$"):
    to_int64(np.array([["1"], ["x"]], dtype=object), "n.csv.gz", 5)


# --------------------------------------------------------------------------- read_csv_all, checks


def test_read_csv_all_joins_the_chunks():
  text = "".join(f"{i}\n" for i in range(10))
  np.testing.assert_array_equal(read_csv_all(_gz(text), "f", "int"), np.arange(10).reshape(10, 1))


@pytest.mark.parametrize("dtype,expected", [("int", np.int64), ("float", np.float64), ("auto", np.float64),
                                            ("str", object)])
def test_read_csv_all_of_an_empty_file(dtype, expected):
  arr = read_csv_all(_gz(""), "f", dtype, ncols=3)
  assert arr.shape == (0, 3)
  assert arr.dtype == expected
  assert read_csv_all(_gz(""), "f", dtype).shape == (0, 1)


def test_check_rows():
  check_rows("e.csv.gz", 5, 5, "edges", "num-edge-list.csv.gz")
  with pytest.raises(OgbFormatError, match=r"^e.csv.gz: line 6: more rows than num-edge-list.csv.gz says \(5 edges\)$"):
    check_rows("e.csv.gz", 6, 5, "edges", "num-edge-list.csv.gz")
  with pytest.raises(OgbFormatError, match=r"^e.csv.gz: line 5: file ends after 3 rows; n says 5 edges$"):
    check_rows("e.csv.gz", 3, 5, "edges", "n", first_line=2)


def test_check_ids_names_the_first_bad_line_or_element():
  check_ids(np.array([0, 1, 4]), 5, "e", 1)
  with pytest.raises(OgbFormatError, match=r"^e: line 12: node id outside \[0, 5\)$"):
    check_ids(np.array([0, 1, 5, -1]), 5, "e", 10)
  with pytest.raises(OgbFormatError, match=r"^e: line 3: node id outside \[0, 5\)$"):
    check_ids(np.array([-1]), 5, "e", 3)
  with pytest.raises(OgbFormatError, match=r"^e: element 8: node id outside \[0, 3\)$"):
    check_ids(np.array([[0, 1], [2, 0], [1, 3]]), 3, "e", 6, unit="element")  # 2-D: the row is named


# --------------------------------------------------------------------------- NpzMember


@pytest.fixture(params=["stored", "deflated"])
def npz(request, tmp_path):
  """An .npz written by numpy (np.savez or np.savez_compressed), opened."""
  path = tmp_path / "data.npz"
  arrays = dict(edge_index=np.arange(20, dtype=np.int64).reshape(2, 10),
                node_feat=np.arange(12, dtype=np.float32).reshape(4, 3), empty=np.zeros(0, np.int32))
  (np.savez if request.param == "stored" else np.savez_compressed)(path, **arrays)
  with open(path, "rb") as f:
    yield f, arrays


def test_npz_member_reads_shape_dtype_and_row_ranges(npz):
  f, arrays = npz
  m = NpzMember(f, "data.npz", "node_feat")
  assert m.name == "data.npz:node_feat"
  assert m.shape == (4, 3)
  assert m.dtype == np.float32
  np.testing.assert_array_equal(m.read(0, 4), arrays["node_feat"])
  np.testing.assert_array_equal(m.read(1, 3), arrays["node_feat"][1:3])
  e = NpzMember(f, "data.npz", "edge_index")
  np.testing.assert_array_equal(e.read(2, 7, row=0), arrays["edge_index"][0, 2:7])
  np.testing.assert_array_equal(e.read(2, 7, row=1), arrays["edge_index"][1, 2:7])
  assert NpzMember(f, "data.npz", "empty").read(0, 0).shape == (0,)


def test_a_missing_key_names_the_keys_there_are(npz):
  f, _ = npz
  keys = r"\['edge_index', 'empty', 'node_feat'\]"
  with pytest.raises(OgbFormatError, match=rf"^data.npz: no array 'labels' \(it has {keys}\)$"):
    NpzMember(f, "data.npz", "labels")


def _zip(path, members: dict[str, bytes]) -> None:
  with zipfile.ZipFile(path, "w") as z:
    for name, data in members.items():
      z.writestr(name, data)


def test_a_member_that_is_not_an_array_is_a_format_error(tmp_path):
  path = tmp_path / "bad.npz"
  _zip(path, {"x.npy": b"this is not an npy header at all"})
  with open(path, "rb") as f, pytest.raises(OgbFormatError, match=r"^bad.npz:x: not a .npy array"):
    NpzMember(f, "bad.npz", "x")


def test_an_object_array_is_a_format_error_not_unpickled(tmp_path):
  path = tmp_path / "obj.npz"
  np.savez(path, x=np.array([{"a": 1}, None], dtype=object))
  with open(path, "rb") as f, pytest.raises(OgbFormatError, match=r"^obj.npz:x: an array of Python objects"):
    NpzMember(f, "obj.npz", "x")


def test_a_truncated_stored_member_is_named(tmp_path):
  path = tmp_path / "t.npz"
  np.savez(path, x=np.arange(100, dtype=np.int64))
  with io.BytesIO(path.read_bytes()) as f:
    m = NpzMember(f, "t.npz", "x")
    f.truncate(m._data_start + 80)  # noqa: SLF001 (cut inside the array's data)
    with pytest.raises(OgbFormatError, match=r"^t.npz:x: truncated \(wanted elements 5..20\)$"):
      m.read(5, 20)


# --------------------------------------------------------------------------- .pt splits


def test_load_pt_split_reads_tensors_and_number_lists():
  buf = io.BytesIO()
  torch.save({"edge": torch.arange(6).reshape(3, 2), "weight": [1.0, 2.5]}, buf)
  buf.seek(0)
  out = load_pt_split(buf, "valid.pt")
  np.testing.assert_array_equal(out["edge"], np.arange(6).reshape(3, 2))
  np.testing.assert_array_equal(out["weight"], [1.0, 2.5])


@pytest.mark.parametrize("obj,message", [
    ([torch.zeros(1)], r"^valid.pt: expected a dict of tensors, got list$"),
    ({"x": "text"}, r"^valid.pt: entry 'x' is a str, not a tensor$"),
])
def test_load_pt_split_refuses_anything_else(obj, message):
  buf = io.BytesIO()
  torch.save(obj, buf)
  buf.seek(0)
  with pytest.raises(OgbFormatError, match=message):
    load_pt_split(buf, "valid.pt")


def test_load_pt_split_of_a_damaged_file():
  with pytest.raises(OgbFormatError, match=r"^valid.pt: not a plain tensor file \(refused without running it\)"):
    load_pt_split(io.BytesIO(b"PK\x03\x04 not really"), "valid.pt")


class _DroppedAfter(io.RawIOBase):
  """A gs:// stream whose connection drops after `n` bytes."""

  def __init__(self, data: bytes, n: int, error: Exception):
    self._data, self._n, self._error, self._pos = data, n, error, 0

  def readable(self):
    return True

  def readinto(self, b):
    if self._pos >= self._n:
      raise self._error
    chunk = self._data[self._pos:min(self._n, self._pos + len(b))]
    b[:len(chunk)] = chunk
    self._pos += len(chunk)
    return len(chunk)


@pytest.mark.parametrize("error", [ConnectionResetError("reset by peer"), TimeoutError("timed out")])
def test_a_connection_that_drops_mid_file_is_transient_not_a_format_error(error):
  data = gzip.compress(b"".join(b"%d,%d\n" % (i, i + 1) for i in range(20000)))
  with pytest.raises(type(error)):
    list(read_csv_chunks(io.BufferedReader(_DroppedAfter(data, len(data) // 2, error)), "f.csv.gz", "int",
                         chunk_rows=1000))
