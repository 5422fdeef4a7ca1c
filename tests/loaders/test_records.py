"""loaders.grain.records: per-example grain MapDatasets that compose (`.map`, `.filter`, `.batch`, `.mix`), on
outputs written without Beam (tests/loaders/make_outputs.py)."""

from __future__ import annotations

import os
import shutil

import grain
import numpy as np
import pytest

from loaders import CorruptRecordError, ShardedRecords, grain as grain_loader
from tests.damage import flip_byte
from tests.loaders import make_outputs

N = 18


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, str]:
  """Raw 8x6 images (3 shards) and JPEGs of their own sizes (2 shards), 18 records each."""
  base = tmp_path_factory.mktemp("records_outputs")
  rng = np.random.default_rng(0)
  return {key: make_outputs.write(str(base / key), *data, kind="image", num_shards=shards)
          for key, data, shards in (("raw", _train(make_outputs.raw_images(rng, N, size=(8, 6))), 3),
                                    ("jpeg", _train(make_outputs.jpeg_images(rng, N, mixed=False)), 2))}


def _train(data):
  features, payloads = data
  return features, {"train": payloads}


def _by_index(examples) -> dict[int, dict]:
  return {int(ex["record_index"]): ex for ex in examples}


def _equal(a: dict, b: dict) -> bool:
  return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


@pytest.mark.parametrize("key,options", [("raw", {}), ("jpeg", {"image_size": (10, 12)})])
def test_examples_and_batches_are_the_fused_paths(outputs, key, options):
  """Unshuffled, the examples batched by grain are the fused path's batches of order="host", bit for bit; shuffled,
  the same examples in another order."""
  fused = list(grain_loader.dataset(outputs[key], batch_size=4, shuffle=False, order="host", num_threads=1,
                                    **options))
  batched = list(grain_loader.records(outputs[key], shuffle=False, **options).batch(4, drop_remainder=True))
  assert len(batched) == len(fused) == N // 4
  assert all(_equal(a, b) for a, b in zip(batched, fused))
  shuffled = list(grain_loader.records(outputs[key], seed=3, **options))
  plain = _by_index(grain_loader.records(outputs[key], shuffle=False, **options))
  assert [int(ex["record_index"]) for ex in shuffled] != sorted(plain)
  assert _by_index(shuffled).keys() == plain.keys() == set(range(N))
  assert all(_equal(ex, plain[int(ex["record_index"])]) for ex in shuffled)


def test_map_filter_batch_chain(outputs):
  ds = grain_loader.records(outputs["raw"], seed=1)
  scaled = ds.filter(lambda ex: ex["label"] == 1).map(lambda ex: {**ex, "image": ex["image"] / 255.0})
  chained = scaled.to_iter_dataset().batch(2)  # grain batches a filtered MapDataset as an IterDataset
  batches = list(chained)
  want = {i for i in range(N) if i % len(make_outputs.CLASSES) == 1}  # record i has label i % 3
  assert sorted(int(i) for b in batches for i in b["record_index"]) == sorted(want)
  assert [len(b["label"]) for b in batches] == [2, 2, 2]
  assert all(b["image"].dtype == np.float64 and b["image"].shape == (2, 8, 6, 3) and b["image"].max() <= 1.0
             for b in batches)
  order = [int(ex["record_index"]) for ex in ds]
  assert order == [int(ex["record_index"]) for ex in grain_loader.records(outputs["raw"], seed=1)]  # seeded


def test_two_outputs_mixed_by_weight(outputs):
  """MapDataset.mix draws 3 of every 4 examples from the first output, whatever the seed of the order."""
  a = grain_loader.records(outputs["raw"], seed=5).map(lambda ex: {"source": 0, **ex})
  b = grain_loader.records(outputs["jpeg"], seed=6, image_size=(8, 6)).map(lambda ex: {"source": 1, **ex})
  mixed = grain.MapDataset.mix([a, b], weights=[0.75, 0.25])
  drawn = [mixed[i] for i in range(40)]
  assert [ex["source"] for ex in drawn].count(0) == 30
  assert {ex["image"].shape for ex in drawn} == {(8, 6, 3)}
  from_a = [int(ex["record_index"]) for ex in drawn if ex["source"] == 0]
  assert sorted(from_a[:N]) == list(range(N))  # the first output's records, each once per pass


def test_shards_partition_the_records(outputs):
  def ids(**shards):
    return [int(ex["record_index"]) for ex in grain_loader.records(outputs["raw"], seed=2, **shards)]
  parts = [ids(shard_index=i, shard_count=4) for i in range(4)]
  assert {len(p) for p in parts} == {N // 4}
  assert sorted(sum(parts, [])) == list(range(N - N % 4))
  assert sorted(parts[1]) == list(range(1, N - N % 4, 4))  # strided, as dataset(order="host") shares them
  uneven = [ids(sharding=grain.sharding.ShardOptions(i, 4, drop_remainder=False)) for i in range(4)]
  assert sorted(sum(uneven, [])) == list(range(N))
  with pytest.raises(ValueError, match=r"shard_index 4 is outside \[0, 4\)"):
    grain_loader.records(outputs["raw"], shard_index=4, shard_count=4)


def test_corrupt_record_raises_corrupt_record_error(outputs, tmp_path):
  broken = str(tmp_path / "raw")
  shutil.copytree(outputs["raw"], broken)
  shard = os.path.join(broken, ShardedRecords(broken).manifest.splits["train"].shards[0].path)
  flip_byte(shard, 200)
  with pytest.raises(CorruptRecordError, match="differs from the manifest"):  # verified when opened
    grain_loader.records(broken)
  ds = grain_loader.records(broken, verify="none", shuffle=False)
  with pytest.raises(CorruptRecordError, match=rf"{os.path.basename(shard)}: record \d+"):
    list(ds)
