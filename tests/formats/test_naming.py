import pytest

from formats.naming import ShardName


def test_format_matches_tfds_template():
  assert str(ShardName("imagenette", "train", "array_record", 3, 16)) == (
      "imagenette-train.array_record-00003-of-00016"
  )


def test_parse_round_trip():
  for shard in ShardName.all_of("my_data.v2", "validation", "tfrecord", 3):
    assert ShardName.parse(shard.filename) == shard


@pytest.mark.parametrize("bad", [
    "x-train.parquet-00000-of-00001",
    "x-train.tfrecord-00000",
    "manifest.json",
    "x-train.tfrecord-00001-of-00001",  # index out of range
])
def test_parse_rejects_non_shards(bad):
  with pytest.raises(ValueError):
    ShardName.parse(bad)


def test_is_shard_of():
  assert ShardName.is_shard_of("pets-train.tfrecord-00000-of-00002", "pets")
  assert not ShardName.is_shard_of("pets2-train.tfrecord-00000-of-00002", "pets")
  assert not ShardName.is_shard_of("pets-train.tfrecord-00000-of-00002", "pets", "array_record")


@pytest.mark.parametrize("name", ["has-dash", "", "sp ace"])
def test_bad_dataset_names(name):
  with pytest.raises(ValueError, match="dataset name"):
    ShardName(name, "train", "tfrecord", 0, 1)


def test_bad_format_and_index():
  with pytest.raises(ValueError, match="file_format"):
    ShardName("a", "train", "parquet", 0, 1)
  with pytest.raises(ValueError, match="outside"):
    ShardName("a", "train", "tfrecord", 2, 2)


def test_pattern_matches_every_shard_of_one_split_only():
  import fnmatch

  pattern = ShardName.pattern("pets", "train", "tfrecord")
  assert pattern == "pets-train.tfrecord-*-of-*"
  assert all(fnmatch.fnmatch(s.filename, pattern) for s in ShardName.all_of("pets", "train", "tfrecord", 3))
  for other in (ShardName("pets", "test", "tfrecord", 0, 1), ShardName("pets", "train", "array_record", 0, 1)):
    assert not fnmatch.fnmatch(other.filename, pattern)
  with pytest.raises(ValueError, match="file_format"):
    ShardName.pattern("pets", "train", "parquet")


def test_tfds_template_and_its_folder():
  from formats import naming

  assert naming.tfds_template() == "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"
  assert naming.tfds_template("gen-1") == "gen-1/{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"
  assert naming.tfds_template_folder(naming.tfds_template("gen-1")) == "gen-1"
  assert naming.tfds_template_folder(naming.tfds_template()) == ""


def test_file_formats_are_the_adapter_table():
  from formats import adapters, naming

  assert naming.FILE_FORMATS == tuple(adapters.ADAPTERS) == ("array_record", "tfrecord")
