
import numpy as np
import pytest

from formats.graphbin import ENTRY, GraphBin, GraphBinError, GraphBinWriter


def _write(path, **arrays):
  with GraphBinWriter(path) as w:
    for name, arr in arrays.items():
      w.add(name.replace("__", "/"), arr)
    w.add_meta({"num_nodes": 4})
  return path


def test_round_trip_memory_mapped_and_aligned(tmp_path):
  path = _write(str(tmp_path / "g.graphbin"), indptr=np.array([0, 2, 3, 3, 4], np.int64),
                indices=np.array([1, 2, 0, 3], np.int32), node__feat=np.arange(12, dtype=np.float16).reshape(4, 3))
  g = GraphBin(path)
  assert g.meta == {"num_nodes": 4}
  np.testing.assert_array_equal(g["indptr"], [0, 2, 3, 3, 4])
  assert g["indices"].dtype == np.dtype("<i4") and g["node/feat"].shape == (4, 3)
  assert isinstance(g["indices"].base, np.memmap) or isinstance(g["indices"], np.memmap)
  assert all(s.offset % 64 == 0 for s in g.sections.values())
  with pytest.raises(ValueError):
    g["indices"][0] = 5  # read-only mapping


def test_streamed_section_and_size_check(tmp_path):
  path = str(tmp_path / "s.graphbin")
  with GraphBinWriter(path) as w:
    with w.stream("indices", "<i8", (6,)) as s:
      s.write(np.arange(3))
      s.write(np.arange(3, 6))
  np.testing.assert_array_equal(GraphBin(path)["indices"], np.arange(6))
  with pytest.raises(ValueError, match="needs"):
    with GraphBinWriter(str(tmp_path / "bad.graphbin")) as w:
      with w.stream("x", "<i8", (4,)) as s:
        s.write(np.arange(3))


def test_corrupted_section_names_section_and_offset(tmp_path):
  path = _write(str(tmp_path / "c.graphbin"), indptr=np.arange(100, dtype=np.int64))
  g = GraphBin(path)
  off = g.sections["indptr"].offset
  del g
  with open(path, "r+b") as f:
    f.seek(off + 10)
    f.write(b"\xff")
  with pytest.raises(GraphBinError, match=rf"section 'indptr' at offset {off} fails its checksum"):
    GraphBin(path)
  GraphBin(path, verify=False)  # opening without verification still works


def test_truncated_and_foreign_files(tmp_path):
  path = _write(str(tmp_path / "t.graphbin"), indptr=np.arange(10, dtype=np.int64))
  data = open(path, "rb").read()
  open(path, "wb").write(data[:-ENTRY.size])
  with pytest.raises(GraphBinError, match="truncated"):
    GraphBin(path)
  other = str(tmp_path / "o.graphbin")
  open(other, "wb").write(b"PK\x03\x04" + b"\0" * 100)
  with pytest.raises(GraphBinError, match="not a .graphbin"):
    GraphBin(other)


def test_index_dtype_is_int32_while_every_index_fits():
  import numpy as np

  from formats.graphbin import index_dtype

  assert index_dtype(0) == index_dtype(2**31 - 2) == np.int32
  assert index_dtype(2**31 - 1) == index_dtype(2**40) == np.int64
