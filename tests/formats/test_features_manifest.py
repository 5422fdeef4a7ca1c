import json

import numpy as np
import pytest

from formats import arrayrecord, tfds_metadata
from formats.features import ClassLabel, Features, Image, Tensor, Text
from formats.manifest import Manifest, Rejected, ShardInfo, SplitInfo

FEATURES = Features({
    "image": Image(shape=(None, None, 3)),
    "pixels": Tensor(shape=(2, 3, 3), dtype="uint8"),
    "label": ClassLabel(("cat", "dog")),
    "file_name": Text(),
})


def test_features_round_trip():
  pixels = np.arange(18, dtype=np.uint8).reshape(2, 3, 3)
  rec = FEATURES.encode({"image": b"jpg", "pixels": pixels, "label": 1, "file_name": "dog/ü.jpg"})
  got = FEATURES.decode(rec)
  assert got["image"] == b"jpg" and got["label"] == 1 and got["file_name"] == "dog/ü.jpg"
  np.testing.assert_array_equal(got["pixels"], pixels)


def test_features_validate_values():
  with pytest.raises(ValueError, match="outside"):
    FEATURES["label"].encode(2)
  with pytest.raises(ValueError, match="shape"):
    FEATURES["pixels"].encode_into("pixels", np.zeros((3, 3, 3), np.uint8))
  with pytest.raises(ValueError, match="missing"):
    FEATURES.encode({"image": b""})
  with pytest.raises(ValueError, match="unique"):
    ClassLabel(("a", "a"))


def test_features_json_round_trip():
  assert Features.from_json(json.loads(json.dumps(FEATURES.to_json()))) == FEATURES


def _manifest():
  shards = tuple(ShardInfo(f"d-train.tfrecord-0000{i}-of-00002", 3 - i, 100 + i, "ab" * 32) for i in range(2))
  return Manifest("d", "tfrecord", FEATURES, {"train": SplitInfo(shards)},
                  Rejected(2, {"not an image": 2}), source={"pipeline": "x"})


def test_manifest_round_trip_and_schema():
  m = _manifest()
  d = json.loads(m.dumps())
  assert d["splits"]["train"]["num_records"] == 5 and d["splits"]["train"]["num_bytes"] == 201
  assert d["splits"]["train"]["shards"][0]["path"] == "d-train.tfrecord-00000-of-00002"
  assert d["rejected"] == {"count": 2, "path": "errors/rejected.jsonl", "by_reason": {"not an image": 2}}
  assert Manifest.loads(m.dumps()) == m


def test_manifest_rejects_inconsistent_counts():
  d = json.loads(_manifest().dumps())
  d["splits"]["train"]["num_records"] = 99
  with pytest.raises(ValueError, match="disagrees"):
    Manifest.from_json(d)


def test_tfds_metadata_files():
  files = tfds_metadata.metadata_files(_manifest())
  info = json.loads(files["dataset_info.json"])
  assert info["fileFormat"] == "tfrecord" and info["splits"][0]["shardLengths"] == ["3", "2"]
  assert files["label.labels.txt"] == b"cat\ndog\n"
  feats = json.loads(files["features.json"])["featuresDict"]["features"]
  assert feats["pixels"]["tensor"]["encoding"] == "bytes"


def test_arrayrecord_write_read(tmp_path):
  path = str(tmp_path / "x.array_record")
  records = [bytes([i]) * i for i in range(50)]
  assert arrayrecord.write_file(path, records) == 50
  assert list(arrayrecord.read_file(path, batch=7)) == records
  reader = arrayrecord.open_reader(path)
  assert reader.read([49, 3]) == [records[49], records[3]]
  reader.close()


def test_tensor_kinds_round_trip():
  feats = Features({
      "volume": Tensor(shape=(None, None, None), dtype="int16"),
      "spacing": Tensor(shape=(3,), dtype="float32", encoding="none"),
      "direction": Tensor(shape=(3, 3), dtype="float32", encoding="none"),
      "num_slices": Tensor(shape=(), dtype="int64", encoding="none"),
  })
  vol = (np.arange(2 * 3 * 4) - 12).astype(np.int16).reshape(2, 3, 4)
  rec = feats.encode({"volume": vol, "spacing": [1.25, 0.7, 0.7], "direction": np.eye(3), "num_slices": 2})
  got = feats.decode(rec)
  np.testing.assert_array_equal(got["volume"], vol)
  assert got["volume"].dtype == np.int16
  np.testing.assert_allclose(got["spacing"], [1.25, 0.7, 0.7])
  assert got["direction"].shape == (3, 3) and int(got["num_slices"]) == 2
  assert Features.from_json(feats.to_json()) == feats
  with pytest.raises(ValueError, match="dtype"):
    feats["volume"].encode_into("volume", vol.astype(np.float32))
  with pytest.raises(ValueError, match="Tensor expects dtype int64, got float64"):  # not cut to 2
    feats.encode({"volume": vol, "spacing": [1, 1, 1], "direction": np.eye(3), "num_slices": 2.5})
  assert feats.decode(feats.encode({"volume": vol, "spacing": [1, 1, 1], "direction": np.eye(3),
                                    "num_slices": np.uint8(2)}))["num_slices"] == 2


def test_tensor_tfds_json():
  assert Tensor(shape=(), dtype="int64", encoding="none").to_tfds()["tensor"] == {
      "shape": {}, "dtype": "int64", "encoding": "none"}
  assert Tensor(shape=(None, None, None), dtype="int16").to_tfds()["tensor"]["shape"] == {
      "dimensions": ["-1", "-1", "-1"]}


def test_tensor_integer_values_round_trip_or_refuse_at_encode():
  """uint64 past 2**63 is stored wrapped (as TFDS does) and read back; a value the dtype cannot hold is refused
  when written, not found when read."""
  feats = Features({"ids": Tensor(shape=(3,), dtype="uint64", encoding="none"),
                    "small": Tensor(shape=(), dtype="int8", encoding="none")})
  ids = np.array([0, 2**63, 2**64 - 1], np.uint64)
  got = feats.decode(feats.encode({"ids": ids, "small": -128}))
  np.testing.assert_array_equal(got["ids"], ids)
  assert got["ids"].dtype == np.uint64 and int(got["small"]) == -128
  for small in (128, -129):
    with pytest.raises(ValueError, match="int8's range"):
      feats.encode({"ids": ids, "small": small})
  with pytest.raises(ValueError, match="uint64's range"):
    feats.encode({"ids": np.array([-1, 0, 0]), "small": 0})
