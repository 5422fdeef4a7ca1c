"""The TF-free tf.train.Example codec, cross-checked against TensorFlow's protos."""

import numpy as np
import pytest
import tensorflow as tf  # installed by the test command: the cross-check against TensorFlow

from formats import example as ex


def _tf_example(d):
  feats = {}
  for k, v in d.items():
    if isinstance(v, list) and v and isinstance(v[0], bytes):
      feats[k] = tf.train.Feature(bytes_list=tf.train.BytesList(value=v))
    elif np.asarray(v).dtype.kind == "f":
      feats[k] = tf.train.Feature(float_list=tf.train.FloatList(value=list(np.asarray(v).ravel())))
    else:
      feats[k] = tf.train.Feature(int64_list=tf.train.Int64List(value=list(np.asarray(v).ravel())))
  return tf.train.Example(features=tf.train.Features(feature=feats))


CASES = {
    "bytes": [b"\x00\xffjpeg bytes", b""],
    "ints": np.array([0, 1, -1, 2**62, -(2**63), 127, 128, 300], np.int64),
    "floats": np.array([0.0, -1.5, 3.25, 1e30], np.float32),
    "empty_ints": np.zeros(0, np.int64),
}


def _ours(d):
  feats = {}
  for k, v in d.items():
    if isinstance(v, list):
      feats[k] = ex.bytes_feature(v)
    elif v.dtype.kind == "f":
      feats[k] = ex.float_feature(v)
    else:
      feats[k] = ex.int64_feature(v)
  return ex.encode_example(feats)


def test_encoding_is_byte_identical_to_tensorflow():
  assert _ours(CASES) == _tf_example(CASES).SerializeToString(deterministic=True)


def test_tensorflow_parses_ours():
  parsed = tf.train.Example.FromString(_ours(CASES))
  f = parsed.features.feature
  assert list(f["bytes"].bytes_list.value) == CASES["bytes"]
  assert list(f["ints"].int64_list.value) == CASES["ints"].tolist()
  np.testing.assert_array_equal(np.array(f["floats"].float_list.value, np.float32), CASES["floats"])


def test_we_parse_tensorflows_including_unpacked_lists():
  data = _tf_example(CASES).SerializeToString()
  got = ex.decode_example(data)
  assert got["bytes"] == CASES["bytes"]
  np.testing.assert_array_equal(got["ints"], CASES["ints"])
  np.testing.assert_array_equal(got["floats"], CASES["floats"])
  assert got["empty_ints"].size == 0 or len(got["empty_ints"]) == 0
  # unpacked repeated int64/float (legal protobuf, written by some producers)
  unpacked = ex._len_field(1, ex._len_field(1, ex._len_field(1, b"k") + ex._len_field(
      2, ex._len_field(3, ex._varint(8) + ex._varint(5) + ex._varint(8) + ex._varint(7)))))
  np.testing.assert_array_equal(ex.decode_example(unpacked)["k"], [5, 7])


def test_tf_parse_single_example_reads_ours():
  data = _ours({"image": [b"abc"], "label": np.array([4])})
  parsed = tf.io.parse_single_example(data, {
      "image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)})
  assert parsed["image"].numpy() == b"abc" and parsed["label"].numpy() == 4


@pytest.mark.parametrize("garbage", [b"\x0a\xff", b"\x0a\x05abc", b"\x0f", b"\x0a\x02\x0a\x80"])
def test_malformed_bytes_raise_decode_error(garbage):
  with pytest.raises(ex.ExampleDecodeError):
    ex.decode_example(garbage)


def test_int64_feature_refuses_floats():
  with pytest.raises(TypeError):
    ex.int64_feature([1.5])
