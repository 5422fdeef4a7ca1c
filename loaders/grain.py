"""Shards → a grain `IterDataset` of fixed-shape batches, with threads only.

    ds = loaders.grain.dataset("gs://bucket/imagenet", "train", batch_size=256,
                               image_size=(224, 224), shard_index=host, shard_count=hosts)
    for batch in ds:            # {"image": uint8 [256, 224, 224, 3], "label": int64 [256]}
      ...
    it = iter(ds); state = it.get_state(); ...; it.set_state(state)   # resume

Records are split disjointly over `shard_count` (strided, after trimming the
split to a multiple of it, so every shard gets the same number of records and
batches), shuffled per shard with `seed`, reshuffled every epoch, transformed
by the record kind's transform (loaders._transforms) and batched. Prefetching
runs on grain's thread pool (`ReadOptions(num_threads)`), never in worker
processes; ArrayRecord reads and JPEG decodes release the GIL.
"""

from __future__ import annotations

import grain

from loaders._shards import ShardedRecords
from loaders._transforms import ExampleOptions, example_transform, pad_batch


def data_source(path: str, split: str = "train", cache_dir: str | None = None) -> ShardedRecords:
  """The split as a grain RandomAccessDataSource (records decoded, plus `record_index`)."""
  return ShardedRecords(path, split, cache_dir=cache_dir)


class _ToExample(grain.transforms.RandomMap):
  def __init__(self, transform):
    self._transform = transform

  def random_map(self, element, rng):
    return self._transform(element, rng)


def operations(source: ShardedRecords, *, batch_size: int, drop_remainder: bool = True,
               **example_options) -> list:
  """grain.DataLoader operations: records → fixed-shape examples → batches.

      loader = grain.DataLoader(data_source=source, operations=operations(source, batch_size=32, ...),
                                sampler=grain.samplers.IndexSampler(len(source), shuffle=True, seed=0,
                                    shard_options=grain.sharding.ShardOptions(i, n, drop_remainder=True)),
                                worker_count=0)   # threads only
  """
  transform = example_transform(source.features, ExampleOptions(**example_options))
  return [_ToExample(transform), grain.transforms.Batch(batch_size=batch_size, drop_remainder=drop_remainder)]


def map_dataset(path: str, split: str = "train", *, batch_size: int, shuffle: bool = True, seed: int = 0,
                shard_index: int = 0, shard_count: int = 1, num_epochs: int = 1, drop_remainder: bool = True,
                cache_dir: str | None = None, **example_options) -> grain.MapDataset:
  """The random-access form of `dataset` (a grain MapDataset of batches)."""
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index {shard_index} is outside [0, {shard_count})")
  if num_epochs < 1:
    raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")
  source = ShardedRecords(path, split, cache_dir=cache_dir)
  transform = example_transform(source.features, ExampleOptions(**example_options))
  per_shard = len(source) // shard_count
  ds = grain.MapDataset.source(source)[: per_shard * shard_count][shard_index::shard_count]
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs)
  ds = ds.random_map(lambda rec, rng: transform(rec, rng), seed=seed)
  if drop_remainder:
    return ds.batch(batch_size, drop_remainder=True)
  return ds.batch(batch_size, batch_fn=lambda examples: pad_batch(examples, batch_size))


def dataset(path: str, split: str = "train", *, batch_size: int, shuffle: bool = True, seed: int = 0,
            shard_index: int = 0, shard_count: int = 1, num_epochs: int = 1, drop_remainder: bool = True,
            num_threads: int = 16, prefetch_buffer_size: int = 64, cache_dir: str | None = None,
            **example_options) -> grain.IterDataset:
  """A grain IterDataset of batches (dicts of numpy arrays) read by `num_threads` threads.

  `example_options`: image_size, patch_size, patch, hu_window, normalize,
  max_nodes, max_edges (see loaders._transforms.ExampleOptions). With
  drop_remainder=False the last batch is padded and every batch carries `mask`.
  """
  ds = map_dataset(path, split, batch_size=batch_size, shuffle=shuffle, seed=seed, shard_index=shard_index,
                   shard_count=shard_count, num_epochs=num_epochs, drop_remainder=drop_remainder,
                   cache_dir=cache_dir, **example_options)
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size))
