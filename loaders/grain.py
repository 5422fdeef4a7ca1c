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
import threading

import grain
import numpy as np

from formats.storage import files
from formats.outputs.integrity import Verify, verify_level
from formats.outputs.output import DEFAULT_CACHE_ROOT, Output
from formats.transforms import element_rng
from loaders._batch import BatchFiller
from loaders._order import per_host_batch_size
from loaders._pinned import PinnedIterDataset, PinnedMapDataset
from loaders._pinning import ON_NEW_DATA, DataIdentity, StateGuard, check_on_new_data, pin_output
from loaders._shards import ShardedRecords
from loaders._stream import DEFAULT_RUN_RECORDS, RecordStream, ShardStream, StreamedBatches, WindowOrder
from loaders._transforms import ExampleOptions, example_transform, fill_batch

__all__ = ["FETCH_MODES", "ON_NEW_DATA", "data_source", "dataset", "map_dataset", "operations", "records"]

FETCH_MODES = ("auto", "shards", "records")  # how a streamed gs:// split is fetched (see `dataset`)


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

  The position gives the epoch and the batch within it; the epoch's order is a
  seeded permutation of this shard's records (computed once per epoch,
  vectorised), so every epoch is shuffled differently and the sequence is a
  pure function of (seed, shard, position): grain's iterator state (the next
  position) is all a resume needs. Random draws (patch positions) use
  formats.transforms.element_rng(seed, position, slot), as loaders.tfdata does.

  A batch is filled by loaders._batch.BatchFiller (each record's features
  found in place and written once into the batch); fast=False (or FAST =
  False before construction) keeps the decode-transform-copy path, which
  gives the same batches more slowly (for benchmarks and tests).
  """

  FAST = True  # the default of `fast`

  def __init__(self, source: ShardedRecords, transform, batch_size: int, seed: int, shuffle: bool,
               shard_index: int, shard_count: int, per_shard: int, drop_remainder: bool, order: str = "host",
               fast: bool | None = None):
    self._source, self._transform = source, transform
    self._batch_size, self._seed, self._shuffle = batch_size, seed, shuffle
    self._shard_index, self._shard_count, self._per_shard = shard_index, shard_count, per_shard
    self._drop, self._global = drop_remainder, order == "global"
    # "global": step k takes records [k*G, (k+1)*G) of the epoch's order over the whole split, host h its slice
    per_epoch, step = (len(source), batch_size * shard_count) if self._global else (per_shard, batch_size)
    self.batches_per_epoch = per_epoch // step if drop_remainder else -(-per_epoch // step)
    self._orders: dict[int, np.ndarray] = {}
    self._lock = threading.Lock()
    self._needs_rng = getattr(transform, "needs_rng", True)
    options = getattr(transform, "options", None)  # a transform of loaders.example_transform: the filler applies it
    use_filler = (self.FAST if fast is None else fast) and options is not None
    self._fill = (BatchFiller(source, options, batch_size, with_mask=not drop_remainder)
                  if use_filler and getattr(transform, "kind", None) == source.kind else None)

  def _order(self, epoch: int) -> np.ndarray:
    """The epoch's record order (computed once; the last two epochs are kept)."""
    with self._lock:
      order = self._orders.get(epoch)
      if order is not None:
        return order
      if self._global:  # the whole split's order: the same on every host, whatever their number
        n = len(self._source)
        order = np.random.default_rng([self._seed, epoch, 0x610BA1]).permutation(n) if self._shuffle else np.arange(n)
      else:
        local = (np.random.default_rng([self._seed, epoch]).permutation(self._per_shard) if self._shuffle
                 else np.arange(self._per_shard))
        order = self._shard_index + self._shard_count * local  # this shard's records: strided
      self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
      self._orders[epoch] = order
      return order

  def __call__(self, position: int, _) -> dict:
    epoch, k = divmod(position, self.batches_per_epoch)
    if self._global:  # this host's slice of global step k; draws keyed by the slot in the global batch
      start = k * self._batch_size * self._shard_count + self._shard_index * self._batch_size
      first_slot = self._shard_index * self._batch_size
    else:
      start, first_slot = k * self._batch_size, 0
    indices = self._order(epoch)[start:start + self._batch_size]
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


def _check_fits(output: Output, split: str, cache_dir: str | None, cache_limit_bytes: int | None) -> None:
  """Random access to a gs:// split copies all of it: refuse early (not after hours) when it cannot fit."""
  if not files.is_gcs(output.path):
    return
  total = sum(s.num_bytes for s in output.shards(split))
  if cache_limit_bytes is not None and total > cache_limit_bytes:
    where = f"cache_limit_bytes={cache_limit_bytes:,}"
  else:
    root = cache_dir or os.path.join(DEFAULT_CACHE_ROOT, "shards")
    missing = sum(s.num_bytes for s in output.shards(split)
                  if not os.path.exists(files.cache_path(output.shard_path(s), s.sha256, root) + ".verified"))
    free = files.free_bytes(root)
    if missing <= free:
      return
    where = f"the {free:,} bytes free in {root}"
  raise ValueError(f"{output.path} split {split!r} holds {total:,} bytes, more than {where}: random access needs "
                   f"all of it on local disk; pass window_shards=N to stream it in windows of N shards through a "
                   f"cache bounded by cache_limit_bytes (see docs/loaders.md)")


def map_dataset(path: str, split: str = "train", *, batch_size: int | None = None, shuffle: bool = True,
                seed: int = 0, shard_index: int = 0, shard_count: int = 1, num_epochs: int = 1,
                drop_remainder: bool = True, cache_dir: str | None = None, verify: Verify = "sha256",
                order: str = "global", global_batch_size: int | None = None, window_shards: int | None = None,
                cache_limit_bytes: int | None = None, fetch: str = "auto", run_records: int | None = None,
                lease: bool = True, on_new_data: str = "error", **example_options) -> PinnedMapDataset:
  """The random-access form of `dataset`: a grain MapDataset whose element i is batch i.

  Its `to_iter_dataset()` iterators carry the data's identity in their states,
  as `dataset`'s do; `close()` releases the lease.

  Args:
    path, split, batch_size, shuffle, seed, shard_index, shard_count, num_epochs,
    drop_remainder, cache_dir, verify, order, global_batch_size, window_shards,
    cache_limit_bytes, fetch, run_records, lease, on_new_data, **example_options: as in `dataset`.

  Returns:
    A MapDataset of batches (dicts of numpy arrays), `num_epochs` epochs long.

  Raises:
    ValueError: a bad batch size, shard, epoch count, verify level, window, cache limit, on_new_data or
      example option.
    NotAnOutputError, KeyError, CorruptRecordError: as in `data_source`.
  """
  batch_size = per_host_batch_size(batch_size, shard_count, order, global_batch_size)
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index {shard_index} is outside [0, {shard_count})")
  if num_epochs < 1:
    raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")
  if cache_limit_bytes is not None and cache_limit_bytes < 1:
    raise ValueError(f"cache_limit_bytes must be >= 1, got {cache_limit_bytes}")
  verify_level(verify)
  if fetch not in FETCH_MODES:
    raise ValueError(f"fetch must be one of {FETCH_MODES}, got {fetch!r}")
  check_on_new_data(on_new_data)
  pin = pin_output(path, lease=lease, purpose=f"loaders.grain {split}")  # the one read of the manifest
  try:
    output = pin.output
    identity = DataIdentity.of(output, split)
    if window_shards is not None:  # the split in windows of shards, through a bounded cache when on gs://
      counts = [s.num_records for s in output.shards(split)]
      if run_records is None:
        run_records = DEFAULT_RUN_RECORDS if order == "global" else 1
      windows = WindowOrder(counts, window_shards, batch_size, seed=seed, shuffle=shuffle, shard_index=shard_index,
                            shard_count=shard_count, order=order, drop_remainder=drop_remainder,
                            run_records=run_records)
      options = ExampleOptions(**example_options)
      example_transform(output.kind, output.features, options)  # refuses missing options before anything starts
      positions = windows.batches_per_epoch * num_epochs
      if fetch == "auto":  # each host reads only its own records: whole shards with the host order, else ranges
        fetch = ("records" if order == "global" and shard_count > 1 and output.file_format == "array_record"
                 else "shards")
      if fetch == "records" and files.is_gcs(path):
        stream = RecordStream(output, split, windows, positions, cache_dir=cache_dir,
                              cache_limit_bytes=cache_limit_bytes)
      else:
        stream = ShardStream(output, split, windows, positions, cache_dir=cache_dir,
                             cache_limit_bytes=cache_limit_bytes, verify=verify)
      read = StreamedBatches(stream, _fill_records(stream, options, batch_size, not drop_remainder, seed))
      source = stream
    else:
      _check_fits(output, split, cache_dir, cache_limit_bytes)
      source = ShardedRecords(output, split, cache_dir=cache_dir, verify=verify)
      transform = example_transform(source.kind, source.features, ExampleOptions(**example_options))
      read = _ReadBatch(source, transform, batch_size, seed, shuffle, shard_index, shard_count,
                        len(source) // shard_count, drop_remainder, order)
  except BaseException:
    pin.release()  # nothing will read it: its lease goes now, not when the traceback is dropped
    raise
  positions = read.batches_per_epoch * num_epochs
  batches = grain.MapDataset.range(positions).map_with_index(read)
  order_settings = {"order": order, "shuffle": shuffle, "seed": seed, "window_shards": window_shards,
                    "run_records": windows.run_records if window_shards is not None else None}
  guard = StateGuard(identity, read.batches_per_epoch, on_new_data, positions, order=order_settings)
  return PinnedMapDataset(batches, guard, keep=(pin, source), close=(source.close, pin.release))


class _Example:
  """Record → the record kind's fixed-shape example (grain's map or random_map); keeps the Pin, so every
  dataset derived from `records` holds the lease of the generation it reads."""

  def __init__(self, transform, pin):
    self._transform, self._pin = transform, pin

  def __call__(self, record: dict, rng: np.random.Generator | None = None) -> dict:
    return self._transform(record, rng)


def records(path: str, split: str = "train", *, shuffle: bool = True, seed: int = 0, shard_index: int = 0,
            shard_count: int = 1, shard_options: grain.sharding.ShardOptions | None = None,
            drop_remainder: bool = True, cache_dir: str | None = None, verify: Verify = "sha256",
            lease: bool = True, on_new_data: str = "error", **example_options) -> PinnedMapDataset:
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
    path, split, shuffle, seed, cache_dir, verify, lease, on_new_data, **example_options: as in `dataset`.
    shard_index, shard_count: this replica's records: split records shard_index, shard_index + shard_count, ...
    shard_options: grain's ShardOptions instead of shard_index, shard_count and drop_remainder.
    drop_remainder: trim the split to a multiple of shard_count first, so every shard has as many records.

  Returns:
    A MapDataset of dicts of numpy arrays; `identity` names the data, `close()` releases the lease.

  Raises:
    ValueError: a bad shard, verify level, on_new_data or example option, or a gs:// split that cannot
      fit on local disk.
    NotAnOutputError, KeyError, CorruptRecordError: as in `data_source` (CorruptRecordError also when
      a damaged record is read).
  """
  if shard_options is not None:
    shard_index, shard_count, drop_remainder = (shard_options.shard_index, shard_options.shard_count,
                                                shard_options.drop_remainder)
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index {shard_index} is outside [0, {shard_count})")
  verify_level(verify)
  check_on_new_data(on_new_data)
  pin = pin_output(path, lease=lease, purpose=f"loaders.grain records {split}")
  try:
    _check_fits(pin.output, split, cache_dir, None)
    source = ShardedRecords(pin.output, split, cache_dir=cache_dir, verify=verify)
    transform = example_transform(source.kind, source.features, ExampleOptions(**example_options))
  except BaseException:
    pin.release()
    raise
  end = len(source) - len(source) % shard_count if drop_remainder else len(source)
  ds = grain.MapDataset.source(source)[shard_index:end:shard_count]
  if shuffle:
    ds = ds.shuffle(seed=seed)
  example = _Example(transform, pin)
  ds = ds.random_map(example, seed=seed) if transform.needs_rng else ds.map(example)
  settings = {"order": "records", "shuffle": shuffle, "seed": seed, "shards": [shard_index, shard_count]}
  guard = StateGuard(DataIdentity.of(pin.output, split), len(ds), on_new_data, order=settings)
  return PinnedMapDataset(ds, guard, keep=(pin, source), close=(source.close, pin.release))


def dataset(path: str, split: str = "train", *, batch_size: int | None = None, shuffle: bool = True, seed: int = 0,
            shard_index: int = 0, shard_count: int = 1, num_epochs: int = 1, drop_remainder: bool = True,
            num_threads: int = 16, prefetch_buffer_size: int = 64, cache_dir: str | None = None,
            verify: Verify = "sha256", order: str = "global", global_batch_size: int | None = None,
            window_shards: int | None = None, cache_limit_bytes: int | None = None, fetch: str = "auto",
            run_records: int | None = None, lease: bool = True, on_new_data: str = "error",
            **example_options) -> PinnedIterDataset:
  """A grain IterDataset of batches read by up to `num_threads` threads (capped at the CPUs this process may use).

  Args:
    path: the output folder, local or gs://.
    split: the split to read.
    batch_size: examples per batch.
    shuffle: shuffle each epoch (seeded; reshuffled every epoch).
    seed: fixes the order and every random draw (patch positions).
    shard_index, shard_count: this replica's disjoint, equal share of the records.
    num_epochs: epochs in a row.
    drop_remainder: drop each epoch's last short batch; False pads it and every
      batch carries `mask`.
    num_threads: grain's reading threads.
    prefetch_buffer_size: batches read ahead.
    cache_dir: where gs:// shards are cached.
    verify: how local shards are proven against the manifest, "sha256" (default,
      once per shard per process), "size" or "none" (see docs/loaders.md).
    order: "global" (the default: global step k takes the next batch_size ×
      shard_count records of the epoch's order over the whole split, host h
      its slice; random draws keyed by the slot in the global batch: the
      batches of a step, and every sample's patch, do not depend on the host
      count, so a saved state resumes on any number of hosts with the same
      global batch) or "host" (each host's strided share, shuffled; what
      loaders.tfdata reads).
    global_batch_size: with order="global", the records per global step
      instead of batch_size (which becomes global_batch_size / shard_count).
    window_shards: read the split in windows of this many shards instead of
      at random: each epoch a seeded permutation of the shards, cut into
      windows, records shuffled within their window. A gs:// split is then
      streamed: shards are fetched ahead of need (parallel ranged reads, the
      SHA-256 checked as they arrive), kept in a private cache bounded by
      `cache_limit_bytes` and deleted after use; a local output is read in the
      same order from its files. None (default): random access over the
      whole split (a gs:// split is first copied whole into `cache_dir`, by
      parallel ranged reads).
    cache_limit_bytes: the most local disk the streamed shards may take
      (default: half the free space of the cache's disk, divided among the
      host's loader processes); with window_shards=None, a gs:// split larger
      than this is refused with advice instead of filling the disk.
    fetch: how a streamed gs:// split is fetched: "shards" (whole shards of
      the windows), "records" (ArrayRecord only: this host's records, one
      ranged read per run of neighbouring records, verified by their chunk
      hashes; at most cache_limit_bytes held in memory, ahead of 16
      batches), or "auto" (default): "records" with order="global" on
      several hosts (every host reads every window), else "shards". Either
      way every host reads about its share: one pass over the data in all.
    run_records: with window_shards, each window's records are shuffled as
      runs of this many consecutive records of a shard (see docs/loaders.md:
      what runs do to randomness); None (default): 8 with order="global"
      (a host's batch of B records is B / 8 ranged reads), 1 (every record on
      its own) with order="host". The batches depend on it: resume with the
      value the state was saved with.
    lease: hold a lease (formats.outputs.leases) on the generation read while the
      dataset lives, so that clean-up after a rerun does not remove it;
      released by `close()` or when the dataset and its iterators are
      collected. On read-only storage one warning is logged and the dataset
      reads without one. False: no lease.
    on_new_data: what `set_state` does with a state saved on other data (another generation, manifest or
      split): "error" (default) raises StateMismatchError naming both generations; "restart_epoch" keeps
      the state's epoch and starts that epoch over, from its first batch, in this data's order.
    **example_options: the fields of loaders.ExampleOptions (image_size,
      patch_size, patch, hu_window, normalize, pos_fraction, max_nodes, max_edges).

  Returns:
    An IterDataset of dicts of numpy arrays with static shapes; its iterator
    has get_state()/set_state() for resuming (each state names the data:
    generation, manifest SHA-256, split); `identity` names the data and
    `close()` releases the lease.

  Raises:
    ValueError: a bad batch size, shard, epoch count, verify level, order, window, cache limit, on_new_data
      or example option, a global batch the host count does not divide, or a gs:// split that cannot fit on
      local disk for random access.
    NotAnOutputError, KeyError, CorruptRecordError: as in `data_source`.
  """
  ds = map_dataset(path, split, batch_size=batch_size, shuffle=shuffle, seed=seed, shard_index=shard_index,
                   shard_count=shard_count, num_epochs=num_epochs, drop_remainder=drop_remainder,
                   cache_dir=cache_dir, verify=verify, order=order, global_batch_size=global_batch_size,
                   window_shards=window_shards, cache_limit_bytes=cache_limit_bytes, fetch=fetch,
                   run_records=run_records, lease=lease, on_new_data=on_new_data, **example_options)
  # More threads than cores only adds GIL contention for the Python parts of a batch.
  threads = max(1, min(num_threads, len(os.sched_getaffinity(0))))
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch_buffer_size))
