"""The outputs load where users already work: TFDS, tf.data and array_record's data source."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tests.conftest import CLASSES, PER_CLASS
from tests.pipelines.test_image_folder import convert

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def outputs(split_folder, tmp_path_factory):
  base = tmp_path_factory.mktemp("interop")
  ar = str(base / "ar")
  tr = str(base / "tr")
  raw = str(base / "raw")
  return {
      "array_record": (ar, convert(split_folder, ar, "--num_shards=3")),
      "tfrecord": (tr, convert(split_folder, tr, "--format=tfrecord", "--num_shards=2")),
      "raw": (raw, convert(split_folder, raw, "--format=tfrecord", "--encoding=raw", "--image_size=16,20")),
  }


def _label_ok(names, label, file_name):
  return names[label] == file_name.split("/")[1]


def test_tfds_as_data_source_reads_array_record(outputs):
  out, m = outputs["array_record"]
  builder = tfds.builder_from_directory(out)
  assert builder.info.features["label"].names == list(m.features["label"].names)
  assert builder.info.splits["train"].num_examples == len(CLASSES) * PER_CLASS
  for split in ("train", "validation"):
    source = builder.as_data_source()[split]
    assert len(source) == m.splits[split].num_records
    for i in range(len(source)):
      ex = source[i]
      assert ex["image"].ndim == 3
      assert ex["image"].shape[2] == 3
      assert _label_ok(m.features["label"].names, ex["label"], ex["file_name"].decode())


def test_tfds_as_dataset_reads_tfrecord(outputs):
  out, m = outputs["tfrecord"]
  builder = tfds.builder_from_directory(out)
  for split in ("train", "validation"):
    rows = list(tfds.as_numpy(builder.as_dataset(split=split)))
    assert len(rows) == m.splits[split].num_records
    for ex in rows:
      assert ex["image"].dtype == np.uint8
      assert ex["image"].shape[2] == 3
      assert _label_ok(m.features["label"].names, ex["label"], ex["file_name"].decode())


def test_tfds_reads_raw_tensors(outputs):
  out, _ = outputs["raw"]
  ds = tfds.builder_from_directory(out).as_dataset(split="train")
  shapes = {tuple(ex["image"].shape) for ex in tfds.as_numpy(ds)}
  assert shapes == {(16, 20, 3)}


def test_tf_data_reads_tfrecord_shards(outputs):
  out, m = outputs["tfrecord"]
  paths = [os.path.join(out, s.path) for s in m.splits["train"].shards]
  spec = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64),
          "file_name": tf.io.FixedLenFeature([], tf.string)}
  ds = tf.data.TFRecordDataset(paths).map(lambda r: tf.io.parse_single_example(r, spec))
  ds = ds.map(lambda ex: {**ex, "image": tf.io.decode_jpeg(ex["image"], channels=3)})
  labels = collections.Counter()
  for ex in ds.as_numpy_iterator():
    assert _label_ok(m.features["label"].names, ex["label"], ex["file_name"].decode())
    labels[int(ex["label"])] += 1
  assert sum(labels.values()) == m.splits["train"].num_records
  assert sorted(labels) == [0, 1, 3]  # yak (id 2) has no images at all


def test_array_record_data_source_reads_shards(outputs):
  from array_record.python.array_record_data_source import ArrayRecordDataSource

  out, m = outputs["array_record"]
  paths = [os.path.join(out, s.path) for s in m.splits["validation"].shards]
  source = ArrayRecordDataSource(paths)
  assert len(source) == m.splits["validation"].num_records
  labels = [m.features.decode(source[i])["label"] for i in range(len(source))]
  assert collections.Counter(labels) == {0: PER_CLASS, 1: PER_CLASS, 3: PER_CLASS}


@pytest.mark.parametrize("file_format", ["array_record", "tfrecord"])
def test_a_split_without_records_is_absent_from_manifest_tfds_and_loaders_alike(tmp_path, file_format):
  """validation/ holds an empty class folder and one corrupt file: no records. TFDS cannot open
  such a split (tried: one empty shard file with shardLengths ["0"] is refused by as_data_source
  and as_dataset), so no view lists it; every split a view lists opens in every other."""
  from PIL import Image

  from formats.outputs import inspect
  from loaders import grain as lgrain
  from loaders import ShardedRecords

  src = tmp_path / "in"
  for cls in ("cat", "dog"):
    (src / "train" / cls).mkdir(parents=True)
    (src / "validation" / cls).mkdir(parents=True)
    Image.new("RGB", (8, 6), cls == "cat" and "red" or "blue").save(src / "train" / cls / "a.png")
  (src / "validation" / "dog" / "broken.jpg").write_bytes(b"not a jpeg")
  out = str(tmp_path / "out")
  m = convert(str(src), out, f"--format={file_format}")
  assert sorted(m.splits) == ["train"]
  assert m.rejected.count == 1
  assert any("empty splits left out: validation" in w for w in m.warnings)
  builder = tfds.builder_from_directory(out)
  assert sorted(builder.info.splits) == sorted(m.splits)
  for split in m.splits:
    if file_format == "array_record":
      assert len(builder.as_data_source(split)) == m.splits[split].num_records
    else:
      assert len(list(builder.as_dataset(split=split))) == m.splits[split].num_records
  with pytest.raises(Exception, match="Unknown split"):
    builder.as_dataset(split="validation")
  assert inspect.main([out, "--verify"]) == 0
  assert len(ShardedRecords(out, "train")) == 2
  with pytest.raises(KeyError, match=r"has no split 'validation' \(it has \['train'\]\)"):
    ShardedRecords(out, "validation")
  with pytest.raises(KeyError, match="has no split 'validation'"):
    lgrain.data_source(out, "validation")


@pytest.mark.parametrize("file_format", ["array_record", "tfrecord"])
def test_shards_left_empty_by_rejects_open_in_tfds_and_the_loaders(tmp_path, file_format):
  """Shards are planned before conversion: a shard whose every input was rejected is an empty
  file, listed with 0 records. TFDS (as_data_source, as_dataset), ShardedRecords and --verify
  read around it and see every record once."""
  from PIL import Image

  from formats.outputs import inspect
  from loaders import ShardedRecords

  src = tmp_path / "in" / "train" / "cat"
  src.mkdir(parents=True)
  for i in range(4):
    Image.new("RGB", (8, 6), (60 * i, 0, 0)).save(src / f"good{i}.png")
    (src / f"bad{i}.jpg").write_bytes(b"not a jpeg")
  out = str(tmp_path / "out")
  m = convert(str(tmp_path / "in"), out, f"--format={file_format}", "--num_shards=8")
  counts = [s.num_records for s in m.splits["train"].shards]
  assert len(counts) == 8
  assert sum(counts) == 4
  assert 0 in counts
  assert m.rejected.count == 4
  builder = tfds.builder_from_directory(out)
  if file_format == "array_record":
    source = builder.as_data_source("train")
    assert len(source) == 4
    assert sorted(int(source[i]["label"]) for i in range(4)) == [0, 0, 0, 0]
    assert len(ShardedRecords(out, "train")) == 4
  else:
    assert len(list(builder.as_dataset(split="train"))) == 4
  assert inspect.main([out, "--verify"]) == 0
