import io

import pytest
import tensorflow as tf  # installed by the test command: the cross-check against TensorFlow

from formats import tfrecord

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


def test_a_forged_huge_length_is_truncated_data_not_a_huge_allocation(tmp_path):
  import struct
  import tracemalloc

  from formats.tfrecord import TFRecordCorruptError, masked_crc32c, read_file

  length = struct.pack("<Q", 1 << 36)  # 64 GiB, with a valid length CRC
  path = tmp_path / "forged.tfrecord"
  path.write_bytes(length + struct.pack("<I", masked_crc32c(length)) + b"x" * 100)
  tracemalloc.start()
  try:
    with pytest.raises(TFRecordCorruptError, match="record 0 at byte 0: truncated data"):
      list(read_file(str(path)))
    assert tracemalloc.get_traced_memory()[1] < 64 << 20
  finally:
    tracemalloc.stop()
