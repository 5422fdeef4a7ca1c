"""The file-format adapter table: write, read back, random access, damage named by record."""

from __future__ import annotations

import gc

import pytest

from formats import adapters, tfrecord
from formats.errors import CorruptRecordError, TFRecordCorruptError
from tests.damage import flip_byte

PAYLOADS = [b"", b"a", b"hello" * 1000, bytes(range(256))]


@pytest.mark.parametrize("file_format", ["array_record", "tfrecord"])
def test_write_then_read_sequentially_and_by_index(tmp_path, file_format):
  adapter = adapters.get(file_format)
  assert adapter.name == adapter.suffix == file_format
  path = str(tmp_path / f"x.{adapter.suffix}")
  assert adapter.write_file(path, iter(PAYLOADS)) == len(PAYLOADS)
  assert list(adapter.read_file(path)) == PAYLOADS
  assert adapter.num_records(path) == len(PAYLOADS)
  with adapter.open_random(path) as f:
    assert isinstance(f, adapters.RandomAccessFile)
    assert len(f) == len(PAYLOADS)
    assert [f.read(i) for i in (3, 0, 2, 1)] == [PAYLOADS[i] for i in (3, 0, 2, 1)]
    with pytest.raises(IndexError, match="record 4 outside"):
      f.read(4)
  assert adapter.locate_damage(path) is None


@pytest.mark.parametrize("file_format", ["array_record", "tfrecord"])
def test_a_reader_closes_when_its_block_ends_and_when_it_is_collected(tmp_path, file_format, monkeypatch):
  adapter = adapters.get(file_format)
  path = str(tmp_path / f"x.{adapter.suffix}")
  adapter.write_file(path, PAYLOADS)
  with adapter.open_random(path) as f:
    f.read(1)
  with pytest.raises(ValueError, match="closed"):
    f.read(1)
  f.close()  # twice is fine
  closed = []
  reader = adapter.open_random(path)
  real_close = type(reader).close
  monkeypatch.setattr(type(reader), "close", lambda self: (closed.append(self.path), real_close(self)))
  del reader
  gc.collect()
  assert closed == [path]


def test_the_table_refuses_unknown_formats():
  with pytest.raises(ValueError, match="file format must be one of \\('array_record', 'tfrecord'\\), got 'parquet'"):
    adapters.get("parquet")


def _record_offsets(path: str) -> list[int]:
  return tfrecord.index(path)[0]


@pytest.fixture
def tfrecord_file(tmp_path):
  path = str(tmp_path / "x.tfrecord")
  adapters.get("tfrecord").write_file(path, PAYLOADS)
  return path



def test_a_flipped_payload_byte_is_named_by_record(tfrecord_file):
  adapter = adapters.get("tfrecord")
  flip_byte(tfrecord_file, _record_offsets(tfrecord_file)[2] + 7)
  with adapter.open_random(tfrecord_file) as f:  # the index reads headers only
    assert f.read(1) == PAYLOADS[1]
    with pytest.raises(CorruptRecordError, match=f"{tfrecord_file}: record 2: bad data checksum"):
      f.read(2)
  with pytest.raises(TFRecordCorruptError, match="record 2 at byte 33: bad data checksum"):
    list(adapter.read_file(tfrecord_file))
  assert adapter.locate_damage(tfrecord_file) == "record 2 at byte 33: bad data checksum"


def test_a_damaged_length_is_named_by_record_and_byte(tfrecord_file):
  at = _record_offsets(tfrecord_file)[3] - 12  # record 3's length field
  flip_byte(tfrecord_file, at)
  with pytest.raises(TFRecordCorruptError, match=f"{tfrecord_file}: record 3: bad length checksum at byte {at}"):
    adapters.get("tfrecord").open_random(tfrecord_file)
  assert adapters.get("tfrecord").locate_damage(tfrecord_file) == f"record 3: bad length checksum at byte {at}"


def test_a_truncated_file_is_named_by_record(tfrecord_file):
  with open(tfrecord_file, "r+b") as f:
    f.truncate(f.seek(0, 2) - 3)
  with pytest.raises(TFRecordCorruptError, match="record 3: truncated data at byte"):
    tfrecord.index(tfrecord_file)
