import io

import pytest

from formats import tfrecord

tf = pytest.importorskip("tensorflow")

RECORDS = [b"", b"a", b"hello" * 1000, bytes(range(256))]


def test_tf_data_reads_our_files(tmp_path):
  path = str(tmp_path / "x.tfrecord")
  with open(path, "wb") as f:
    assert tfrecord.write_records(f, RECORDS) == len(RECORDS)
  got = [r.numpy() for r in tf.data.TFRecordDataset(path)]
  assert got == RECORDS


def test_we_read_tensorflows_files(tmp_path):
  path = str(tmp_path / "y.tfrecord")
  with tf.io.TFRecordWriter(path) as w:
    for r in RECORDS:
      w.write(r)
  assert list(tfrecord.read_file(path)) == RECORDS
  with open(path, "rb") as f:
    assert f.read() == b"".join(tfrecord.frame(r) for r in RECORDS)


def test_corruption_names_record_and_offset():
  data = bytearray(b"".join(tfrecord.frame(r) for r in [b"first", b"second"]))
  data[16 + 5 + 12 + 2] ^= 0xFF  # a byte inside the second record's payload
  with pytest.raises(tfrecord.TFRecordCorruptError, match=r"s1: record 1 at byte 21: bad data checksum"):
    list(tfrecord.read_records(io.BytesIO(bytes(data)), name="s1"))


def test_truncation_is_an_error():
  data = tfrecord.frame(b"payload")[:-3]
  with pytest.raises(tfrecord.TFRecordCorruptError, match="truncated"):
    list(tfrecord.read_records(io.BytesIO(data)))
