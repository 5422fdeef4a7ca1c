"""Writes a small output of record kind "tensors" (what a generic converter writes) with `formats` alone."""

from __future__ import annotations

import os

import numpy as np

from formats import arrayrecord, tfrecord
from formats.features import ClassLabel, Features, Tensor, Text
from formats.manifest import MANIFEST_FILENAME, Manifest, ShardInfo, SplitInfo, sha256_file
from formats.naming import ShardName

FEATURES = Features({
    "x": Tensor((4, 3), "float32"),
    "ids": Tensor((5,), "int16"),
    "flag": Tensor((), "bool"),
    "spacing": Tensor((3,), "float32", encoding="none"),
    "count": Tensor((), "int64", encoding="none"),
    "label": ClassLabel(("a", "b", "c")),
    "name": Text(),
})


def record(i: int) -> dict:
  """Record i's values, a pure function of i."""
  rng = np.random.default_rng(i)
  return {"x": rng.normal(size=(4, 3)).astype(np.float32), "ids": rng.integers(-999, 999, 5).astype(np.int16),
          "flag": np.asarray(i % 2 == 0), "spacing": np.asarray([0.5, 0.5, i], np.float32),
          "count": np.asarray(i * 7, np.int64), "label": i % 3, "name": f"item {i}"}


def write(path: str, file_format: str, num_records: int = 22, num_shards: int = 2,
          features: Features = FEATURES) -> str:
  """A complete output at `path`: one "train" split of `num_records` records over `num_shards` shards."""
  os.makedirs(path)
  shards = []
  per = -(-num_records // num_shards)
  for k in range(num_shards):
    ids = range(k * per, min((k + 1) * per, num_records))
    name = ShardName("things", "train", file_format, k, num_shards).filename
    local = os.path.join(path, name)
    records = [features.encode({f: record(i)[f] for f in features}) for i in ids]
    if file_format == "tfrecord":
      with open(local, "wb") as f:
        tfrecord.write_records(f, records)
    else:
      arrayrecord.write_file(local, records)
    shards.append(ShardInfo(name, len(ids), os.path.getsize(local), sha256_file(local)))
  manifest = Manifest(name="things", file_format=file_format, features=features,
                      splits={"train": SplitInfo(tuple(shards))}, kind="tensors")
  with open(os.path.join(path, MANIFEST_FILENAME), "wb") as f:
    f.write(manifest.dumps())
  return path
