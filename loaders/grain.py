"""Shards → a grain `IterDataset` of fixed-shape batches, with threads only.

    ds = loaders.grain.dataset("gs://bucket/imagenet", "train", batch_size=256,
                               image_size=(224, 224), shard_index=host, shard_count=hosts)
    for batch in ds:            # {"image": uint8 [256, 224, 224, 3], "label": int64 [256]}
      ...
    it = iter(ds); state = it.get_state(); ...; it.set_state(state)   # resume (same data only)
    ds.close()                  # the lease on the generation read goes (collection does it too)

Records are split disjointly over `shard_count` (strided, after trimming the
split to a multiple of it, so every shard gets the same number of records and
batches), shuffled per shard with `seed`, reshuffled every epoch, transformed
by the record kind's transform (loaders.example_transform) and batched. Prefetching
runs on grain's thread pool (`ReadOptions(num_threads)`), never in worker
processes; ArrayRecord reads and JPEG decodes release the GIL.

The manifest is read once, when the dataset is made: every epoch reads the
generation it named, held by a lease while the dataset lives, and every
iterator state names that data (loaders._pinning): restoring a state saved
on other data raises StateMismatchError unless on_new_data="restart_epoch".

`records(path, split, ...)` gives the same examples one at a time, as a grain
MapDataset for grain's own `.map`, `.filter`, `.batch` and `.mix` (slower than
the fused batches of `dataset`; docs/loaders.md says by how much).
"""

from __future__ import annotations

import os

import grain
import numpy as np

from formats.storage import files
from formats.outputs.integrity import Verify
from formats.transforms import element_rng
from loaders._batch import BatchFiller
from loaders._order import RecordOrder, per_host_batch_size
from loaders._pinned import PinnedIterDataset, PinnedMapDataset
from loaders._pinning import DataIdentity, StateGuard, pin_output
from loaders._shards import ShardedRecords, check_fits
from loaders._stream import RecordStream, ShardStream, StreamedBatches, WindowOrder
from loaders._transforms import ExampleOptions, example_transform, fill_batch
from loaders.options import Fetching, Ordering, Reading, Sharding, settings

__all__ = ["data_source", "dataset", "map_dataset", "operations", "records"]


def data_source(path: str, split: str = "train", cache_dir: str | None = None,
                verify: Verify = "sha256", *, lease: bool = True) -> ShardedRecords:
  """The split as a grain RandomAccessDataSource.

  Args:
    path: the output folder, local or gs://.
    split: the split to read.
    cache_dir: where gs:// shards are cached (default ~/.cache/tpu_shards/shards).
    verify: "sha256" (default), "size" or "none"; see docs/loaders.md.
    lease: hold a lease on the generation read while the source lives (see `dataset`).

  Returns:
    The records, decoded, each with its `record_index`.

  Raises:
    NotAnOutputError: `path` has no manifest.json.
    KeyError: the output has no such split.
    CorruptRecordError: a shard differs from the manifest.
    ValueError: `verify` is not a level, or the output holds no record shards.
  """
  return ShardedRecords(path, split, cache_dir=cache_dir, verify=verify, lease=lease)


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

  Args:
    source: the records (`data_source`).
    batch_size: examples per batch.
    drop_remainder: drop a last, short batch.
    **example_options: the fields of loaders.ExampleOptions (image_size, patch_size, ...).

  Returns:
    [the record kind's transform, grain's Batch].

  Raises:
    ValueError: the record kind has no transform, or needs an option that is missing.
  """
  transform = example_transform(source.kind, source.features, ExampleOptions(**example_options))
  return [_ToExample(transform), grain.transforms.Batch(batch_size=batch_size, drop_remainder=drop_remainder)]


class _ReadBatch:
  """Batch position → one batch of examples, each payload copied once into place.

  The records of a position come from loaders._order.RecordOrder (a seeded
  permutation per epoch, of the split or of this shard's records), so every
  epoch is shuffled differently and the sequence is a pure function of (seed,
  shard, position): grain's iterator state (the next position) is all a resume
  needs. Random draws (patch positions) use formats.transforms.element_rng(seed,
  position, slot), as loaders.tfdata does.

  A batch is filled by loaders._batch.BatchFiller (each record's features
  found in place and written once into the batch); fast=False (or FAST =
  False before construction) keeps the decode-transform-copy path, which
  gives the same batches more slowly (for benchmarks and tests).
  """

  FAST = True  # the default of `fast`

  def __init__(self, source: ShardedRecords, transform, batch_size: int, seed: int, shuffle: bool,
               shard_index: int, shard_count: int, drop_remainder: bool, order: str = "host",
               fast: bool | None = None):
    self._source, self._transform = source, transform
    self._batch_size, self._seed, self._drop = batch_size, seed, drop_remainder
    self._order = RecordOrder(len(source), batch_size, seed=seed, shuffle=shuffle, shard_index=shard_index,
                              shard_count=shard_count, order=order, drop_remainder=drop_remainder)
    self.batches_per_epoch = self._order.batches_per_epoch
    self._needs_rng = getattr(transform, "needs_rng", True)
    options = getattr(transform, "options", None)  # a transform of loaders.example_transform: the filler applies it
    use_filler = (self.FAST if fast is None else fast) and options is not None
    self._fill = (BatchFiller(source, options, batch_size, with_mask=not drop_remainder)
                  if use_filler and getattr(transform, "kind", None) == source.kind else None)

  def __call__(self, position: int, _) -> dict:
    indices, first_slot = self._order.indices(position), self._order.first_slot
    if self._fill is not None:
      return self._fill(indices, lambda j: element_rng(self._seed, position, first_slot + j))

    def examples():
      for j, i in enumerate(indices):
        rng = element_rng(self._seed, position, first_slot + j) if self._needs_rng else None
        yield self._transform(self._source.get(int(i), copy=False), rng)
    return fill_batch(examples(), self._batch_size, with_mask=not self._drop)


def _fill_records(source, options: ExampleOptions, batch_size: int, with_mask: bool, seed: int):
  """fill(source, indices, position, first_slot): records `indices` of `source` → one batch (BatchFiller: each
  example written once into place); draws keyed by (seed, position, first_slot + slot)."""
  filler = BatchFiller(source, options, batch_size, with_mask)

  def fill(_, indices, position: int, first_slot: int) -> dict:
    return filler(indices, lambda j: element_rng(seed, position, first_slot + j))
  return fill


def map_dataset(path: str, split: str = "train", *, batch_size: int | None = None,
                global_batch_size: int | None = None, ordering: Ordering | None = None,
                sharding: Sharding | grain.sharding.ShardOptions | None = None, fetching: Fetching | None = None,
                example: ExampleOptions | None = None, **fields) -> PinnedMapDataset:
  """The random-access form of `dataset`: a grain MapDataset whose element i is batch i.

  Its `to_iter_dataset()` iterators carry the data's identity in their states,
  as `dataset`'s do; `close()` releases the lease.

  Args:
    path, split, batch_size, global_batch_size, ordering, sharding, fetching, example, **fields: as in
      `dataset`.

  Returns:
    A MapDataset of batches (dicts of numpy arrays), `num_epochs` epochs long.

  Raises:
    ValueError, TypeError, NotAnOutputError, KeyError, CorruptRecordError: as in `dataset`.
  """
  s = settings("loaders.grain.map_dataset (iterate it with grain.ReadOptions)", ordering=ordering,
               sharding=sharding, fetching=fetching, example=example,
               read=("ordering", "sharding", "fetching", "example"), **fields)
  o, f = s.ordering, s.fetching
  if f.fetch != "auto" and o.window_shards is None:
    raise ValueError(f"fetch={f.fetch!r} chooses how windows are streamed: it needs window_shards")
  shard_index, shard_count = s.sharding.resolve(0, 1)
  batch_size = per_host_batch_size(batch_size, shard_count, o.order, global_batch_size)
  pin = pin_output(path, lease=f.lease, purpose=f"loaders.grain {split}")  # the one read of the manifest
  try:
    output = pin.output
    identity = DataIdentity.of(output, split)
    if o.window_shards is not None:  # the split in windows of shards, through a bounded cache when on gs://
      windows = WindowOrder.of([s.num_records for s in output.shards(split)], o, batch_size, shard_index,
                               shard_count)
      example_transform(output.kind, output.features, s.example)  # refuses missing options before anything starts
      positions = windows.batches_per_epoch * o.num_epochs
      fetch = f.fetch
      if fetch == "auto":  # each host reads only its own records: whole shards with the host order, else ranges
        fetch = ("records" if o.order == "global" and shard_count > 1 and output.file_format == "array_record"
                 else "shards")
      if fetch == "records" and files.is_gcs(path):
        stream = RecordStream(output, split, windows, positions, cache_dir=f.cache_dir,
                              cache_limit_bytes=f.cache_limit_bytes)
      else:
        stream = ShardStream(output, split, windows, positions, cache_dir=f.cache_dir,
                             cache_limit_bytes=f.cache_limit_bytes, verify=f.verify)
      read = StreamedBatches(stream, _fill_records(stream, s.example, batch_size, not o.drop_remainder, o.seed))
      source = stream
    else:
      check_fits(output, split, f.cache_dir, f.cache_limit_bytes)
      transform = example_transform(output.kind, output.features, s.example)  # refusals before a fetch
      source = ShardedRecords(output, split, cache_dir=f.cache_dir, verify=f.verify)
      read = _ReadBatch(source, transform, batch_size, o.seed, o.shuffle, shard_index, shard_count,
                        o.drop_remainder, o.order)
  except BaseException:
    pin.release()  # nothing will read it: its lease goes now, not when the traceback is dropped
    raise
  positions = read.batches_per_epoch * o.num_epochs
  batches = grain.MapDataset.range(positions).map_with_index(read)
  guard = StateGuard(identity, read.batches_per_epoch, o.on_new_data, positions,
                     order=o.stamp(batch_size, shard_count))
  return PinnedMapDataset(batches, guard, keep=(pin, source), close=(source.close, pin.release))


class _Example:
  """Record → the record kind's fixed-shape example (grain's map or random_map); keeps the Pin, so every
  dataset derived from `records` holds the lease of the generation it reads."""

  def __init__(self, transform, pin):
    self._transform, self._pin = transform, pin

  def __call__(self, record: dict, rng: np.random.Generator | None = None) -> dict:
    return self._transform(record, rng)


def records(path: str, split: str = "train", *, ordering: Ordering | None = None,
            sharding: Sharding | grain.sharding.ShardOptions | None = None, fetching: Fetching | None = None,
            example: ExampleOptions | None = None, **fields) -> PinnedMapDataset:
  """One epoch of fixed-shape examples as a grain MapDataset, for grain's own `.map`, `.filter`, `.batch`, `.mix`.

      ds = loaders.grain.records("gs://bucket/imagenet", "train", image_size=(224, 224), seed=0)
      ds = ds.repeat(3).map(augment).batch(256)      # 3 epochs, reshuffled every epoch
      for batch in ds.to_iter_dataset(grain.ReadOptions(num_threads=8)): ...

  Element i is one record's example (the record kind's transform, loaders.example_transform, with
  `record_index`), read through `data_source` (verified, pinned and leased as in `dataset`):
  `MapDataset.source` over the split, this shard's records (strided, as `dataset(order="host")` shares
  them), then `.shuffle(seed)`. Random draws (CT random patches) come from grain's `random_map`
  with `seed`, not from `dataset`'s per-slot draws. grain batches a `.filter`ed dataset only after
  `to_iter_dataset()`. `dataset` is faster (see docs/loaders.md).

  Args:
    path, split, ordering, fetching, example, **fields: as in `dataset`; of Ordering, records reads
      shuffle, seed, on_new_data and drop_remainder (here: trim the split to a multiple of shard_count
      first, so every shard has as many records), and of Fetching all but fetch.
    sharding: this replica's records: split records shard_index, shard_index + shard_count, ...; grain's
      ShardOptions gives its drop_remainder too.

  Returns:
    A MapDataset of dicts of numpy arrays; `identity` names the data, `close()` releases the lease.

  Raises:
    ValueError: a bad setting or one records does not read (num_epochs, order, window_shards, run_records,
      fetch: one epoch of random access; use `.repeat`), or a gs:// split that cannot fit on local disk.
    TypeError: as in loaders.options.settings.
    NotAnOutputError, KeyError, CorruptRecordError: as in `data_source` (CorruptRecordError also when
      a damaged record is read).
  """
  s = settings("loaders.grain.records", ordering=ordering, sharding=sharding, fetching=fetching, example=example,
               read=("shuffle", "seed", "on_new_data", "drop_remainder", "sharding", "cache_dir", "verify",
                     "cache_limit_bytes", "lease", "example"), **fields)
  o, f = s.ordering, s.fetching
  shard_index, shard_count = s.sharding.resolve(0, 1)
  drop_remainder = o.drop_remainder
  if hasattr(sharding, "drop_remainder"):  # grain's ShardOptions says its own
    given = fields.get("drop_remainder", getattr(ordering, "drop_remainder", None))
    if given is not None and given != sharding.drop_remainder:
      raise TypeError(f"drop_remainder={given} disagrees with the ShardOptions' drop_remainder="
                      f"{sharding.drop_remainder}: give it once")
    drop_remainder = sharding.drop_remainder
  pin = pin_output(path, lease=f.lease, purpose=f"loaders.grain records {split}")
  try:
    check_fits(pin.output, split, f.cache_dir, f.cache_limit_bytes)
    transform = example_transform(pin.output.kind, pin.output.features, s.example)  # refusals before a fetch
    source = ShardedRecords(pin.output, split, cache_dir=f.cache_dir, verify=f.verify)
  except BaseException:
    pin.release()
    raise
  end = len(source) - len(source) % shard_count if drop_remainder else len(source)
  ds = grain.MapDataset.source(source)[shard_index:end:shard_count]
  if o.shuffle:
    ds = ds.shuffle(seed=o.seed)
  example = _Example(transform, pin)
  ds = ds.random_map(example, seed=o.seed) if transform.needs_rng else ds.map(example)
  order = {"order": "records", "shuffle": o.shuffle, "seed": o.seed, "shards": [shard_index, shard_count]}
  guard = StateGuard(DataIdentity.of(pin.output, split), len(ds), o.on_new_data, order=order)
  return PinnedMapDataset(ds, guard, keep=(pin, source), close=(source.close, pin.release))


def dataset(path: str, split: str = "train", *, batch_size: int | None = None,
            global_batch_size: int | None = None, ordering: Ordering | None = None,
            sharding: Sharding | grain.sharding.ShardOptions | None = None, fetching: Fetching | None = None,
            example: ExampleOptions | None = None, reading: Reading | grain.ReadOptions | None = None,
            **fields) -> PinnedIterDataset:
  """A grain IterDataset of batches, read on a pool of threads (loaders.Reading), never in processes.

      ds = loaders.grain.dataset("gs://bucket/imagenet", "train", batch_size=256, image_size=(224, 224),
                                 sharding=grain.sharding.ShardByJaxProcess(), num_epochs=10)

  Args:
    path: the output folder, local or gs://.
    split: the split to read.
    batch_size: examples per batch on this host.
    global_batch_size: with order="global", the records per global step instead of batch_size (which
      becomes global_batch_size / shard_count).
    ordering: which records each step holds, and in what order (loaders.Ordering).
    sharding: this host's share (loaders.Sharding, or grain's ShardOptions; default the only host).
    fetching: how shards are proven and fetched from gs:// (loaders.Fetching).
    example: how records become fixed-shape examples (loaders.ExampleOptions).
    reading: host threads and read-ahead (loaders.Reading, or grain's ReadOptions).
    **fields: any field of those groups by its own name (seed=3, window_shards=8, image_size=(224, 224),
      num_threads=8).

  Returns:
    An IterDataset of dicts of numpy arrays with static shapes; its iterator
    has get_state()/set_state() for resuming (each state names the data:
    generation, manifest SHA-256, split, and the Ordering fields that fix the
    batches); `identity` names the data and `close()` releases the lease.

  Raises:
    ValueError: a bad setting or batch size, a global batch the host count does not divide, a window
      the cache limit cannot hold, or a gs:// split that cannot fit on local disk for random access.
    TypeError: a name that is no setting, or a setting given twice (loaders.options.settings).
    NotAnOutputError, KeyError, CorruptRecordError: as in `data_source`.
  """
  s = settings("loaders.grain.dataset", ordering=ordering, sharding=sharding, fetching=fetching, example=example,
               reading=reading, **fields)
  ds = map_dataset(path, split, batch_size=batch_size, global_batch_size=global_batch_size,
                   **{k: v for k, v in s.groups().items() if k != "reading"})
  threads = max(1, min(s.reading.num_threads, len(os.sched_getaffinity(0))))
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=s.reading.prefetch_buffer_size))
