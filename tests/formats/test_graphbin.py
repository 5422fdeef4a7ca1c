
import hashlib
import struct

import google_crc32c
import numpy as np
import pytest

from formats.graphbin import (ENTRY, ENTRY_V2, HEADER, MAX_NAME_BYTES, GraphBin, GraphBinError, GraphBinWriter,
                              parse_header, parse_table)
from tests.damage import flip_byte


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


# --------------------------------------------------------------------------- versions

# The version 1 file `_short_names` writes, byte for byte (what a reader knowing only version 1 reads).
V1_SHA256 = "02fdc75220debff88508044faf5a047b27ad19b10a244a0e60e1da1bda7ba4d1"
LONG = "rel/institution___rev_affiliated_with___author/edge/reltype"  # ogbn-mag's reverse: 59 bytes


def _short_names(path, last_name="n" * 56):
  with GraphBinWriter(path) as w:
    w.add("indptr", np.array([0, 2, 3, 3, 4], np.int64))
    w.add("indices", np.array([1, 2, 0, 3], np.int32))
    w.add(last_name, np.arange(6, dtype=np.float16).reshape(2, 3))
    w.add_meta({"num_nodes": 4})
  return path


def _version(path) -> int:
  return struct.unpack_from("<I", open(path, "rb").read(12), 8)[0]


def test_names_that_fit_56_bytes_write_version_1_byte_for_byte(tmp_path):
  path = _short_names(str(tmp_path / "v1.graphbin"))
  data = open(path, "rb").read()
  assert hashlib.sha256(data).hexdigest() == V1_SHA256
  assert _version(path) == 1 and GraphBin(path).header.table_nbytes == 4 * ENTRY.size


@pytest.mark.parametrize("name", ["x" * 57, "/".join(["a" * 49] * 4), "é" * 100], ids=["57", "199", "utf8_200"])
def test_a_longer_name_writes_version_2_and_round_trips(tmp_path, name):
  path = _short_names(str(tmp_path / "v2.graphbin"), last_name=name)
  assert _version(path) == 2
  g = GraphBin(path)
  assert list(g.sections) == ["indptr", "indices", name, "meta"] and g.meta == {"num_nodes": 4}
  np.testing.assert_array_equal(g[name], np.arange(6, dtype=np.float16).reshape(2, 3))
  np.testing.assert_array_equal(g["indptr"], [0, 2, 3, 3, 4])
  assert all(s.offset % 64 == 0 for s in g.sections.values()) and g.header.table_offset % 64 == 0
  assert g.header.table_nbytes == 4 * ENTRY_V2.size
  assert g.header.table_offset + g.header.table_nbytes == g.header.file_size == len(open(path, "rb").read())


def test_the_longest_name_is_248_bytes(tmp_path):
  path = _short_names(str(tmp_path / "ok.graphbin"), last_name="y" * MAX_NAME_BYTES)
  assert MAX_NAME_BYTES == 248 and "y" * 248 in GraphBin(path)
  with GraphBinWriter(str(tmp_path / "long.graphbin")) as w:
    with pytest.raises(ValueError, match=r"section name 'zzz.*' must be 1..248 bytes"):
      w.add("z" * 249, np.arange(3))
    with pytest.raises(ValueError, match="must be 1..248 bytes"):
      w.add("é" * 125, np.arange(3))  # 125 characters, 250 bytes


@pytest.mark.parametrize("version", [0, 3, 2**32 - 1])
def test_an_unknown_version_is_refused(tmp_path, version):
  path = _short_names(str(tmp_path / "v.graphbin"))
  with open(path, "r+b") as f:
    f.seek(8)
    f.write(struct.pack("<I", version))
  message = rf"v.graphbin: .graphbin version {version} is not supported \(expected one of \[1, 2\]\)"
  with pytest.raises(GraphBinError, match=message):
    GraphBin(path)


@pytest.mark.parametrize("name", ["n" * 56, LONG], ids=["v1", "v2"])
def test_header_and_table_parse_from_ranged_reads(tmp_path, name):
  """What a ranged (gs://) reader does: 64 bytes, then the table, with the checks GraphBin makes."""
  path = _short_names(str(tmp_path / "r.graphbin"), last_name=name)
  data = open(path, "rb").read()
  h = parse_header(data[:HEADER.size], "gs://b/r.graphbin", size=len(data))
  version, count, table_offset, file_size, table_crc = h
  assert (version, count, file_size) == (1 if name == "n" * 56 else 2, 4, len(data))
  sections = parse_table(data[table_offset:table_offset + h.table_nbytes], h, "gs://b/r.graphbin")
  assert sections == GraphBin(path).sections
  with pytest.raises(GraphBinError, match=r"gs://b/r.graphbin: header says .* bytes, the file has .* \(truncated\?\)"):
    parse_header(data[:HEADER.size], "gs://b/r.graphbin", size=len(data) - 1)
  with pytest.raises(GraphBinError, match="gs://b/r.graphbin: 10 bytes is too short for a .graphbin header"):
    parse_header(data[:10], "gs://b/r.graphbin")
  with pytest.raises(GraphBinError, match=f"section table at offset {table_offset} is {h.table_nbytes - 1} bytes"):
    parse_table(data[table_offset:table_offset + h.table_nbytes - 1], h, "gs://b/r.graphbin")


def test_version_2_keeps_every_check(tmp_path):
  path = _short_names(str(tmp_path / "c.graphbin"), last_name=LONG)
  g = GraphBin(path)
  h, off = g.header, g.sections[LONG].offset
  del g
  flip_byte(path, off + 1)
  with pytest.raises(GraphBinError, match=f"section '{LONG}' at offset {off} fails its checksum"):
    GraphBin(path)
  flip_byte(path, off + 1)
  flip_byte(path, h.table_offset + 2 * ENTRY_V2.size + 100)  # inside the long name's entry
  with pytest.raises(GraphBinError, match=f"section table at offset {h.table_offset} fails its checksum"):
    GraphBin(path)
  flip_byte(path, h.table_offset + 2 * ENTRY_V2.size + 100)
  data = open(path, "rb").read()
  open(path, "wb").write(data[:-ENTRY_V2.size])
  with pytest.raises(GraphBinError, match="truncated"):
    GraphBin(path)


@pytest.mark.parametrize("field,value,message", [
    (2, 5, r"section 'rel/.*' in the table at offset \d+: 5 dimensions \(at most 4\)"),
    (8, 7, r"section 'rel/.*' at offset \d+: shape and size disagree"),
    (7, 10**6, r"section 'rel/.*' at offset 1000000 runs into the table"),
], ids=["ndim", "nbytes", "offset"])
def test_a_bad_entry_with_a_good_table_checksum_is_refused(tmp_path, field, value, message):
  """Entries of either version are checked alike: (name, dtype, ndim, 4 x shape, offset, nbytes, crc)."""
  path = _short_names(str(tmp_path / "e.graphbin"), last_name=LONG)
  data = bytearray(open(path, "rb").read())
  h = parse_header(bytes(data[:HEADER.size]))
  at = h.table_offset + 2 * ENTRY_V2.size
  entry = list(ENTRY_V2.unpack_from(data, at))
  entry[field] = value
  ENTRY_V2.pack_into(data, at, *entry)
  table_crc = google_crc32c.value(bytes(data[h.table_offset:]))
  struct.pack_into("<I", data, 32, table_crc)  # HEADER "<8sIIQQI": the table's CRC at byte 32
  open(path, "wb").write(bytes(data))
  with pytest.raises(GraphBinError, match=message):
    GraphBin(path, verify=False)


# --------------------------------------------------------------------------- hostile tables (valid CRCs)


def _entries(path):
  """(file bytes, header, [entry fields]) of a version 1 file."""
  data = bytearray(open(path, "rb").read())
  h = parse_header(bytes(data[:HEADER.size]))
  return data, h, [list(ENTRY.unpack_from(data, h.table_offset + i * ENTRY.size)) for i in range(h.num_sections)]


def _rewrite(path, entries, data=None, extra=b""):
  """Writes `entries` back as the table (its CRC recomputed), `extra` bytes after it."""
  old, h, _ = _entries(path)
  data = bytearray(old if data is None else data)
  table = b"".join(ENTRY.pack(*e) for e in entries)
  data[h.table_offset:] = table + extra
  HEADER.pack_into(data, 0, b"GRAPHBIN", 1, len(entries), h.table_offset, len(data), google_crc32c.value(table))
  open(path, "wb").write(bytes(data))


def _hostile(tmp_path):
  """indptr (40 bytes at 64), indices (16 bytes at 128), node/feat (24 bytes at 192), meta."""
  return _write(str(tmp_path / "h.graphbin"), indptr=np.array([0, 2, 3, 3, 4], np.int64),
                indices=np.array([1, 2, 0, 3], np.int32), node__feat=np.arange(12, dtype=np.float16).reshape(4, 3))


# entry fields: 0 name, 1 dtype, 2 ndim, 3..6 shape, 7 offset, 8 nbytes, 9 crc
HOSTILE_ENTRIES = [
    ("duplicate", 1, {0: b"indptr"}, r"section 'indptr' at offset 128: the table lists it twice \(entries 0 and 1\)"),
    ("overlap", 2, {7: 128}, r"section 'node/feat' at offset 128 overlaps section 'indices' \(bytes \[128, 144\)\)"),
    ("in_header", 0, {7: 0}, r"section 'indptr' at offset 0 starts inside the 64-byte header"),
    ("unaligned", 1, {7: 136}, r"section 'indices' at offset 136: the offset is not a multiple of 64"),
    ("bytes_dtype", 1, {1: b"|S4"}, r"section 'indices' at offset 128: dtype '\|S4' is not a little-endian "
                                    r"numeric dtype \(one of i, u, f, b; 1 to 8 bytes\)"),
    ("complex_dtype", 1, {1: b"<c8", 3: 2}, r"dtype '<c8' is not a little-endian numeric dtype"),
    ("big_endian", 1, {1: b">i4"}, r"dtype '>i4' is not a little-endian numeric dtype"),
    ("unknown_dtype", 1, {1: b"zz"}, r"dtype 'zz' is not a little-endian numeric dtype"),
    ("long_double", 2, {1: b"<f16", 3: 1, 4: 3, 8: 48}, r"dtype '<f16' is not a little-endian numeric dtype"),
    ("wrapping_shape", 1, {1: b"|u1", 2: 2, 3: 2**32, 4: 2**32, 8: 0},
     r"section 'indices' at offset 128: shape and size disagree: shape \(4294967296, 4294967296\) of \|u1 is "
     r"18446744073709551616 bytes, the table says 0"),
    ("not_utf8", 1, {0: b"\xff\xfeindices"}, r"the section name in the table at offset \d+ is not UTF-8"),
    ("empty_name", 1, {0: b""}, r"the section name in the table at offset \d+ is empty"),
]


@pytest.mark.parametrize("index,fields,message", [c[1:] for c in HOSTILE_ENTRIES], ids=[c[0] for c in HOSTILE_ENTRIES])
def test_a_table_entry_that_cannot_be_true_is_refused_though_its_checksum_is_right(tmp_path, index, fields, message):
  path = _hostile(tmp_path)
  data, h, entries = _entries(path)
  for field, value in fields.items():
    entries[index][field] = value
  _rewrite(path, entries)
  with pytest.raises(GraphBinError, match=message) as e:
    GraphBin(path, verify=False)
  assert str(e.value).startswith(f"{path}: ")


def test_bytes_after_the_table_are_refused(tmp_path):
  path = _hostile(tmp_path)
  _, h, entries = _entries(path)
  _rewrite(path, entries, extra=b"\0" * 64)
  end = h.table_offset + len(entries) * ENTRY.size
  with pytest.raises(GraphBinError, match=rf"h.graphbin: the section table ends at {end}, the file at {end + 64}"):
    GraphBin(path, verify=False)


@pytest.mark.parametrize("table_offset,message", [
    (32, r"section table at offset 32 starts inside the 64-byte header"),
    (100, r"section table at offset 100: the offset is not a multiple of 64"),
])
def test_a_header_whose_table_cannot_be_where_it_says_is_refused(table_offset, message):
  header = HEADER.pack(b"GRAPHBIN", 1, 0, table_offset, table_offset, google_crc32c.value(b""))
  with pytest.raises(GraphBinError, match=message):
    parse_header(header, "g.graphbin", size=table_offset)


@pytest.mark.parametrize("meta,message", [
    (b"[" * 100_000 + b"]" * 100_000, r"section 'meta': not JSON \(nested too deeply\)"),
    (b"\xff{}", r"section 'meta': not JSON \("),
    (b"\"x\"", r"section 'meta': expected a JSON object, found str"),
])
def test_meta_that_is_not_a_json_object_is_refused(tmp_path, meta, message):
  path = str(tmp_path / "m.graphbin")
  with GraphBinWriter(path) as w:
    w.add("meta", np.frombuffer(meta, np.uint8))
  with pytest.raises(GraphBinError, match=message):
    GraphBin(path)
