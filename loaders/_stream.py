"""Reading a split in windows of shards: a bounded local cache over gs://, and the order that allows it.

    order = WindowOrder(counts, window_shards=4, batch_size=64, seed=0, ...)
    stream = ShardStream(output, split, order, cache_limit_bytes=8 << 30)
    with stream.batch(position) as indices:       # the position's shards are local and pinned
      ... stream.raw(i) for i in indices ...

Random access over a whole split needs the whole split on local disk. When the
split is larger than the disk, the loaders read it in *windows*: each epoch
a seeded permutation of the shards is cut into windows of `window_shards`
shards, and the records of one window are shuffled among themselves
(`WindowOrder`, a pure function of (seed, epoch), so a saved position resumes
exactly). Only the shards of the windows being read and of the next ones
need to be local: `ShardStream` fetches them ahead of need (parallel ranged
reads through formats.storage.gcs_download, the manifest's SHA-256 checked while the
bytes arrive, each read retried by formats.storage.retry's policy and nothing above it), keeps them in a private folder whose
size never exceeds `cache_limit_bytes`, and deletes each shard once no batch
still to be read needs it. A local output is read in the same order straight
from its files: the batches of a streamed gs:// output equal those of its
local copy.

Who fetches what: shards are fetched in the order the batches need them,
starting from the lowest batch position being read, as far ahead as the limit
allows; a batch waits only for its own shards. Readers pin the shards of
their batch, so a shard is never deleted under a reader (its space is freed
when it is deleted: every reader of it is closed first).
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import fcntl
import itertools
import logging
import os
import re
import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Callable

import numpy as np

from formats.storage import files, retry
from formats.errors import CorruptRecordError
from formats.storage.gcs_download import DownloadOptions, RemoteObject, download, read_range, read_range_into
from formats.outputs.integrity import Verify, check_local_file
from formats.outputs.output import DEFAULT_CACHE_ROOT, Output
from loaders._host import local_processes
from loaders._order import check_some_batch
from loaders._shards import decoded
from loaders.options import Ordering

__all__ = ["DEFAULT_CACHE_FRACTION", "ShardStream", "WindowOrder", "default_cache_limit"]

logger = logging.getLogger(__name__)

# By default a streaming loader's cache may take this fraction of the free space of its disk, shared
# between the loader processes of the host (PJRT_LOCAL_PROCESS_COUNT / LOCAL_WORLD_SIZE).
DEFAULT_CACHE_FRACTION = 0.5
_BLOCK = 4096
# Disk counted per cached shard beyond its size rounded up to a block: a block each for the download's stamp
# (.fetched), its sidecar (.partial.json) and the sidecar's replacement being written (.partial.json.tmp); the
# lock file is empty. One more block is counted for the private folder itself.
_FILE_OVERHEAD = 3 * _BLOCK
_SHARD_TAG, _WINDOW_TAG, _PHASE_TAG = 0x5748, 0x5749, 0x574A  # keys of the shard and window permutations and of
# the runs' phases (apart from other draws)
_OPEN_SHARDS = 16  # shards whose readers stay open (at least 4 windows' worth)
# A ShardStream downloads _FETCHERS shards at once, each in ranged reads of _CHUNK_BYTES, _STREAMS at a time: up
# to 32 requests and 64 MiB in flight. Sized for GCS from a VM in its region (20-50 ms to the first byte, ~100
# MB/s per connection): a 2 MiB read then takes ~50 ms, so 32 of them carry ~1.3 GB/s, more than one host's
# loader decodes; fewer or larger reads left the link idle between shards (docs/loaders.md has the figures).
_FETCHERS = 4
_STREAMS = 8
_CHUNK_BYTES = 2 << 20


def default_cache_limit(cache_dir: str) -> int:
  """DEFAULT_CACHE_FRACTION of the free space on `cache_dir`'s disk, divided among the host's loader processes."""
  existing = os.path.abspath(cache_dir)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  return int(shutil.disk_usage(existing).free * DEFAULT_CACHE_FRACTION) // local_processes()


class WindowOrder:
  """Which records each batch position holds when a split is read in windows of shards.

  Epoch e: the shards (all of them with order="global"; with order="host"
  shard s belongs to host s mod shard_count) in a permutation drawn from
  (seed, e), cut into windows of `window_shards`. Each shard's records are cut
  into *runs* of `run_records` consecutive records, the cuts shifted by a
  phase drawn from (seed, e, shard) in [0, run_records) (so the first and last
  run of a shard may be shorter), and each window's runs are put in a
  permutation drawn from (seed, e, window). The epoch's stream is the windows
  one after the other, each run's records in shard order. With run_records=1
  every record is a run: the window's records in one permutation.

  order="global": global step k takes stream records [k·G, (k+1)·G), G =
  batch_size × shard_count, and host h the slice [k·G + h·B, k·G + (h+1)·B):
  the batches of a step do not depend on the host count. order="host": host
  h's batch k is records [k·B, (k+1)·B) of its own stream; every host gets the
  same number of batches (the smallest host's share; the rest of the larger
  shares is dropped each epoch).

  Randomness of runs: the converters write every shard's records in a seeded
  random order, so a run is a random sample of its shard, and a batch of B
  records is about B / run_records runs from random shards of the window at
  random places. What runs give up: records next to each other in a shard
  land in the same batch far more often than chance, in every epoch (the
  phase moves the cuts, so a pair of neighbours is split in about 1 epoch in
  run_records). What they buy: a host reading only its own records
  (fetch="records") fetches a run with one ranged read instead of one per
  record. The whole order is a pure function of (seed, epoch, counts,
  window_shards, run_records) and never of the host count.

  Attributes:
    batches_per_epoch: batches each host reads per epoch.
    num_shards: the shards this host reads.
    first_slot: the slot of this host's first example in the global batch (keys random draws).
    run_records: records per run.
  """

  @classmethod
  def of(cls, counts, ordering: Ordering, batch_size: int, shard_index: int, shard_count: int) -> WindowOrder:
    """The windows `ordering` asks for (its window_shards and runs), for this host's share."""
    return cls(counts, ordering.window_shards, batch_size, seed=ordering.seed, shuffle=ordering.shuffle,
               shard_index=shard_index, shard_count=shard_count, order=ordering.order,
               drop_remainder=ordering.drop_remainder, run_records=ordering.runs)

  def __init__(self, counts, window_shards: int, batch_size: int, *, seed: int = 0, shuffle: bool = True,
               shard_index: int = 0, shard_count: int = 1, order: str = "host", drop_remainder: bool = True,
               run_records: int = 1):
    if window_shards < 1:
      raise ValueError(f"window_shards must be >= 1, got {window_shards}")
    if not isinstance(run_records, (int, np.integer)) or run_records < 1:
      raise ValueError(f"run_records must be an integer >= 1, got {run_records!r}")
    self.run_records = int(run_records)
    self.counts = np.asarray(counts, np.int64)
    self.starts = np.concatenate([[0], np.cumsum(self.counts)])
    self.window, self.batch_size, self.seed, self.shuffle = window_shards, batch_size, seed, shuffle
    self.shard_index, self.shard_count, self.global_order = shard_index, shard_count, order == "global"
    if self.global_order:
      self._mine = np.arange(len(self.counts))
      per_epoch, step = int(self.counts.sum()), batch_size * shard_count
    else:
      self._mine = np.arange(shard_index, len(self.counts), shard_count)
      shares = [int(self.counts[h::shard_count].sum()) for h in range(shard_count)]
      per_epoch, step = (min(shares) if drop_remainder else max(shares)), batch_size
    self.batches_per_epoch = per_epoch // step if drop_remainder else -(-per_epoch // step)
    check_some_batch(self.batches_per_epoch, int(self.counts.sum()), per_epoch, batch_size, shard_count,
                     self.global_order, f"in the smallest share of {len(self.counts)} shards dealt whole to "
                                        f"{shard_count} hosts")
    self.first_slot = shard_index * batch_size if self.global_order else 0
    self.num_shards = len(self._mine)
    self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    self._lock = threading.Lock()

  def shards_of_epoch(self, epoch: int) -> np.ndarray:
    """This host's shards in the order epoch `epoch` reads them."""
    if not self.shuffle:
      return self._mine
    return self._mine[np.random.default_rng([self.seed, epoch, _SHARD_TAG]).permutation(len(self._mine))]

  def _windows(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(this host's shards in the epoch's order, each window's first stream position and the end): cheap."""
    shards = self.shards_of_epoch(epoch)
    sizes = [int(self.counts[shards[w:w + self.window]].sum()) for w in range(0, len(shards), self.window)]
    return shards, np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])

  def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shards, window bounds, the record stream) of an epoch; the last two epochs are kept."""
    with self._lock:
      cached = self._epochs.get(epoch)
      if cached is not None:
        return cached
    shards, bounds = self._windows(epoch)
    parts = []
    phases = None
    if self.shuffle and self.run_records > 1:  # every shard's, drawn at once (the same on every host)
      phases = np.random.default_rng([self.seed, epoch, _PHASE_TAG]).integers(self.run_records, size=len(self.counts))
    for w in range(len(bounds) - 1):
      window = shards[w * self.window:(w + 1) * self.window]
      if not self.shuffle:
        parts.append(np.concatenate([np.arange(self.starts[s], self.starts[s + 1]) for s in window]))
        continue
      run_starts, run_lengths = self._runs(window, phases)
      perm = np.random.default_rng([self.seed, epoch, w, _WINDOW_TAG]).permutation(len(run_starts))
      parts.append(_expand(run_starts[perm], run_lengths[perm]))
    out = (shards, bounds, np.concatenate(parts) if parts else np.zeros(0, np.int64))
    with self._lock:
      self._epochs = {e: v for e, v in self._epochs.items() if e >= epoch - 1}
      self._epochs[epoch] = out
    return out

  def _runs(self, window: np.ndarray, phases: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(first record, length) of every run of the window's shards, in shard and record order."""
    starts, lengths = [], []
    r = self.run_records
    for s in window:
      a, n = int(self.starts[s]), int(self.counts[s])
      if n == 0:
        continue
      phase = int(phases[s]) if phases is not None else 0
      cuts = np.concatenate([[0], np.arange(phase or r, n, r), [n]]) if r > 1 else np.arange(n + 1)
      starts.append(a + cuts[:-1])
      lengths.append(np.diff(cuts))
    if not starts:
      return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(starts).astype(np.int64), np.concatenate(lengths).astype(np.int64)

  def _span(self, position: int) -> tuple[int, int, int]:
    """(epoch, first stream position, stop) of this host's records of batch `position`."""
    epoch, k = divmod(position, self.batches_per_epoch)
    if self.global_order:
      start = k * self.batch_size * self.shard_count + self.shard_index * self.batch_size
    else:
      start = k * self.batch_size
    return epoch, start, start + self.batch_size

  def indices(self, position: int) -> np.ndarray:
    """The split record indices of this host's batch `position` (fewer at a padded epoch end)."""
    epoch, start, stop = self._span(position)
    return self._epoch(epoch)[2][start:stop]

  def shards(self, position: int) -> list[int]:
    """The shards batch `position` reads from (every shard of the windows its records come from)."""
    epoch, start, stop = self._span(position)
    shards, bounds = self._windows(epoch)
    stop = min(stop, int(bounds[-1]))
    if stop <= start:
      return []
    first = bisect.bisect_right(bounds, start) - 1
    last = bisect.bisect_right(bounds, stop - 1) - 1
    return [int(s) for s in shards[first * self.window:(last + 1) * self.window]]

  def shards_from(self, position: int, num_positions: int):
    """Shards in the order batches `position`, `position`+1, ... (up to `num_positions`) first need them.

    Yields whole windows from the one holding `position`'s first record; a shard
    may come again (a later epoch).
    """
    if position >= num_positions:
      return
    epoch, start, _ = self._span(position)
    last_epoch = (num_positions - 1) // self.batches_per_epoch
    shards, bounds = self._windows(epoch)
    w = max(0, bisect.bisect_right(bounds, start) - 1)
    for e in range(epoch, last_epoch + 1):
      if e != epoch:
        shards, bounds = self._windows(e)
        w = 0
      for s in shards[w * self.window:]:
        yield int(s)


def _expand(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """The records of runs (first record, length), one run after the other."""
  if not len(starts):
    return np.zeros(0, np.int64)
  offsets = np.cumsum(lengths) - lengths  # where each run begins in the output
  return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


class _Entry:
  """One shard of the stream: where it is, who reads it, what became of its download."""

  def __init__(self, k: int, reserved: int):
    self.k, self.reserved = k, reserved
    self.path: str | None = None  # set once the verified file is local
    self.pins = 0
    self.error: BaseException | None = None
    self.failed_at = 0.0  # when its download failed (time.monotonic)
    self.fetching = False
    self.readers: list = []  # idle random-access readers (one per reading thread at most)


class _Reading:
  """The batches a stream's `batch` blocks are reading (position -> blocks in it) and the position last
  asked for: where the stream's fetching ahead starts (the stream's condition held)."""

  def __init__(self):
    self.counts: dict[int, int] = {}
    self.next = 0  # one past the position last asked for

  def enter(self, position: int) -> None:
    self.counts[position] = self.counts.get(position, 0) + 1
    self.next = position + 1  # the last asked for, not the highest: a new pass or a set_state goes back

  def leave(self, position: int) -> bool:
    """Counts one block of batch `position` out; True when it was the last."""
    n = self.counts.pop(position) - 1
    if n:
      self.counts[position] = n
    return not n

  def low(self) -> int:
    """The lowest batch position still to be read: the least in flight, else the next one."""
    return min(self.counts) if self.counts else self.next


class ShardStream:
  """The shards of one split, made local in windows: fetched ahead, bounded on disk, deleted after use.

  For a gs:// output the shards go to a private folder under `cache_dir`
  (removed by close(), at exit, or by the next stream that finds its process
  gone); a local output's shards are read where they are (checked at the
  `verify` level once per process), in the same order.

  Attributes:
    peak_bytes: the most bytes the folder held (counted as each shard's size
      rounded up to a 4 KiB block plus _FILE_OVERHEAD, reserved before its
      download starts, and a block for the folder).
    bytes_fetched: bytes downloaded so far.
  """

  def __init__(self, output: Output, split: str, order: WindowOrder, num_positions: int, *,
               cache_dir: str | None = None, cache_limit_bytes: int | None = None, verify: Verify = "sha256",
               streams: int = _STREAMS, chunk_bytes: int = _CHUNK_BYTES):
    self.output, self.split, self.order = output, split, order
    self._infos = output.shards(split)
    self._adapter = output.adapter
    self._num_positions = num_positions
    self._remote = files.is_gcs(output.path)
    self._verify = verify
    # No fsync: the private folder is deleted with the stream, and after a crash by the next one.
    self._options = DownloadOptions(streams=streams, chunk_bytes=chunk_bytes, progress=False, durable=False)
    self._sizes = [-(-s.num_bytes // _BLOCK) * _BLOCK + _FILE_OVERHEAD for s in self._infos]
    root = os.path.join(cache_dir or DEFAULT_CACHE_ROOT, "stream")
    self.limit = default_cache_limit(root) if cache_limit_bytes is None else int(cache_limit_bytes)
    if self._remote:
      self._check_limit(output.path, split)
    self.peak_bytes = 0
    self.bytes_fetched = 0
    self._cond = threading.Condition()
    self._entries: dict[int, _Entry] = {}
    self._recent: collections.OrderedDict[int, None] = collections.OrderedDict()  # shards by last read
    self._reading = _Reading()
    self._closed = False
    self._fatal: BaseException | None = None
    self._fetchers: list[threading.Thread] = []
    self._objects: dict[int, object] = {}  # shard -> its RemoteObject (size and pinned generation)
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # the ranged reads of every download
    self._folder = None
    if self._remote:
      self._folder, self._finalizer = _private_folder(self, root)

  def _check_limit(self, path: str, split: str) -> None:
    """Refuses a limit below what one batch may need plus the next window (a bound from the shard sizes)."""
    order, w = self.order, self.order.window
    mine = [int(k) for k in order.shards_of_epoch(0)]
    largest = sum(sorted((self._sizes[k] for k in mine), reverse=True)[:w])
    fewest = max(1, sum(sorted(int(order.counts[k]) for k in mine)[:len(mine) % w or w]))
    spans = max(2, -(-order.batch_size // fewest) + 1)  # windows a batch's records may come from
    need = _BLOCK + spans * largest
    if self.limit < need:
      raise ValueError(
          f"cache_limit_bytes={self.limit:,} cannot hold {spans} windows of {w} shard(s) of {path} split {split!r} "
          f"({need:,} bytes: the windows one batch of {order.batch_size} records may come from, and the next one "
          f"fetched); raise cache_limit_bytes, or lower window_shards or batch_size")

  # ------------------------------------------------------------------ readers

  @contextlib.contextmanager
  def batch(self, position: int):
    """Makes batch `position`'s shards local and pins them while the block runs; yields its record indices.

    A shard whose download gave up on transient errors before this call asked for it (it was
    fetched ahead) is fetched once more for it; one that fails while this call waits is raised.

    Raises:
      CorruptRecordError: a shard differs from the manifest.
      formats.storage.retry.RetryExhausted, SourceChangedError: a shard could not be fetched.
    """
    asked, again = time.monotonic(), set()
    shards = self.order.shards(position)
    if not self._remote:  # a local shard is checked once (outside the lock: hashing takes a while)
      for k in shards:
        if k not in self._entries:
          self._local_entry(k)
    with self._cond:
      self._reading.enter(position)
      self._start_fetcher()
      self._cond.notify_all()
      try:
        while True:
          if self._closed:
            raise RuntimeError("the stream was closed")
          if self._fatal is not None:
            raise RuntimeError(f"the shard fetcher stopped: {type(self._fatal).__name__}: {self._fatal}")
          entries = [self._entry(k) for k in shards]
          failed = next((e for e in entries if e.error is not None), None)
          if failed is not None:
            error = failed.error
            failed.error = None  # the fetcher downloads it again, for this reader or the next
            self._forget(failed)
            if failed.failed_at < asked and failed.k not in again and _gave_up(error):
              again.add(failed.k)
              self._cond.notify_all()
              continue
            raise error
          if all(e.path is not None for e in entries):
            break
          self._cond.wait(1.0)
        for e in entries:
          e.pins += 1
      except BaseException:
        self._leave(position)
        raise
    try:
      yield self.order.indices(position)
    finally:
      with self._cond:
        for e in entries:
          e.pins -= 1
          self._recent[e.k] = None
          self._recent.move_to_end(e.k)
        self._close_idle_readers()
        self._leave(position)

  def pin_one_record(self):
    """A block that pins one record of this host and yields its index (what a batch of padding only reads its
    layout from)."""
    return _pin_one_record(self)

  def raw(self, index: int) -> bytes:
    """The bytes of record `index` of the split, whose shard a running `batch` block has pinned.

    Raises:
      CorruptRecordError: the record is damaged; the message names the shard and the record.
    """
    k = int(np.searchsorted(self.order.starts, index, side="right")) - 1
    if not 0 <= k < len(self._infos):
      raise IndexError(f"record {index} outside [0, {int(self.order.starts[-1])})")
    local = index - int(self.order.starts[k])
    with self._cond:
      e = self._entries.get(k)
      if e is None or e.path is None or e.pins == 0:
        raise RuntimeError(f"record {index}: its shard {self._infos[k].path} is not pinned by a batch")
      reader = e.readers.pop() if e.readers else None
    try:
      if reader is None:
        reader = self._adapter.open_random(e.path)
        if len(reader) != self._infos[k].num_records:
          n = len(reader)
          reader.close()
          reader = None
          raise CorruptRecordError(f"{self.where_shard(k)}: {n} records, the manifest says "
                                   f"{self._infos[k].num_records}")
      try:
        return reader.read(local)
      except CorruptRecordError:
        raise
      except Exception as err:  # noqa: BLE001 - the C++ reader's own error: name the shard and the record
        raise CorruptRecordError(f"{self.where_shard(k)}: record {local}: {type(err).__name__}: {err}") from None
    finally:
      if reader is not None:
        with self._cond:
          e.readers.append(reader)

  def get(self, index: int, copy: bool = True) -> dict:
    """Record `index` decoded (as ShardedRecords.get), plus its `record_index`; its shard must be pinned.

    Raises:
      CorruptRecordError: the record is damaged or does not parse against the schema.
    """
    return decoded(self, index, copy)

  @property
  def features(self):
    """The records' schema."""
    return self.output.features

  @property
  def kind(self) -> str:
    """The output's record kind."""
    return self.output.kind

  def __len__(self) -> int:
    return int(self.order.starts[-1])

  def where(self, index: int) -> str:
    """"<shard path>: record <k>" of split record `index` (names a bad record)."""
    k = int(np.searchsorted(self.order.starts, index, side="right")) - 1
    return f"{self.where_shard(k)}: record {index - int(self.order.starts[k])}"

  def where_shard(self, k: int) -> str:
    return self.output.shard_path(self._infos[k])

  def close(self) -> None:
    """Stops fetching, closes every reader and deletes the private folder. Closing twice is fine."""
    _stop(self)
    for t in self._fetchers:
      if t is not threading.current_thread():
        t.join()
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)
    with self._cond:
      for e in self._entries.values():
        for r in e.readers:
          r.close()
        e.readers.clear()
      self._entries.clear()
    if self._folder is not None:
      self._finalizer()

  # ------------------------------------------------------------------ bookkeeping (self._cond held)

  def _entry(self, k: int) -> _Entry:
    e = self._entries.get(k)
    return e if e is not None else _Entry(k, self._sizes[k])  # not fetched yet: the reader waits

  def _local_entry(self, k: int) -> None:
    info = self._infos[k]
    path = self.output.shard_path(info)
    check_local_file(path, info.num_bytes, info.sha256, self._verify, locate=self._adapter.locate_damage)
    e = _Entry(k, 0)
    e.path = path
    with self._cond:
      self._entries.setdefault(k, e)

  def _close_idle_readers(self) -> None:
    """Keeps readers open for the most recently read shards only, so that open files stay bounded whatever
    the split's shard count (a local output's shards are never evicted) (self._cond held)."""
    keep = max(_OPEN_SHARDS, 4 * self.order.window)
    while len(self._recent) > keep:
      k, _ = self._recent.popitem(last=False)
      e = self._entries.get(k)
      if e is not None and e.pins:
        self._recent[k] = None  # still read: it stays open; try the next oldest later
        break
      if e is not None:
        for r in e.readers:
          r.close()
        e.readers.clear()

  def _forget(self, e: _Entry) -> None:
    if self._entries.get(e.k) is e:
      del self._entries[e.k]

  def _leave(self, position: int) -> None:
    self._reading.leave(position)
    self._cond.notify_all()

  def _cached_bytes(self) -> int:
    return _BLOCK + sum(e.reserved for e in self._entries.values() if e.reserved)  # the folder, and each shard

  # ------------------------------------------------------------------ the fetcher

  def _start_fetcher(self) -> None:
    if self._remote and not self._fetchers:
      self._pool = concurrent.futures.ThreadPoolExecutor(_FETCHERS * self._options.streams,
                                                         thread_name_prefix="shard-stream-read")
      for i in range(_FETCHERS):
        t = threading.Thread(target=_worker, args=(weakref.ref(self), ShardStream._fetch_one, False),
                             name=f"shard-stream-{i}", daemon=True)
        t.start()
        self._fetchers.append(t)

  def _plan(self, low: int) -> tuple[list[int], int]:
    """The shards to keep: those batches `low`, `low`+1, ... need first, as many as the limit holds.

    Returns (the shards, how many of them batch `low` itself needs).
    """
    first = self.order.shards(low) if low < self._num_positions else []
    wanted, seen, total = [], set(), _BLOCK
    for k in itertools.chain(first, self.order.shards_from(low, self._num_positions)):
      if len(seen) == self.order.num_shards:  # every shard this host reads is already kept
        break
      if k in seen:
        continue
      if total + self._sizes[k] > self.limit:
        if len(wanted) < len(set(first)):
          raise ValueError(f"cache_limit_bytes={self.limit:,} cannot hold the shards batch {low} reads "
                           f"({sum(self._sizes[j] for j in set(first)):,} bytes); raise cache_limit_bytes or "
                           f"lower window_shards")
        break
      wanted.append(k)
      seen.add(k)
      total += self._sizes[k]
    return wanted, len(set(first))

  def _next_fetch(self) -> int | None:
    """Evicts what the plan drops; the next shard to download, or None (self._cond held)."""
    low = self._reading.low()
    try:
      wanted, _ = self._plan(low)
    except ValueError as e:  # one batch needs more than the limit: tell its waiting readers
      for k in self.order.shards(low):
        if k not in self._entries:
          self._entries[k] = _Entry(k, 0)
          self._entries[k].error = e
      return None
    keep = set(wanted)
    for k, e in list(self._entries.items()):  # no batch still to be read needs it soon: delete it
      if k not in keep and e.pins == 0 and e.path is not None:
        self._evict(e)
    if sum(e.fetching for e in self._entries.values()) >= _FETCHERS:
      return None  # a few shards at a time (each with its ranges in parallel), the earliest need first
    for k in wanted:
      e = self._entries.get(k)
      if e is None:
        return k if self._cached_bytes() + self._sizes[k] <= self.limit else None
    return None

  def _fetch_one(self) -> bool | None:
    """Evicts, then downloads one shard: True; nothing to do yet: False; closed: None."""
    with self._cond:
      if self._closed:
        return None
      k = self._next_fetch()
      if k is None:
        return False
      e = self._entries[k] = _Entry(k, self._sizes[k])
      e.fetching = True
      self.peak_bytes = max(self.peak_bytes, self._cached_bytes())
    try:
      path, error = self._download(k), None
    except BaseException as err:  # noqa: BLE001 - handed to the readers of this shard
      path, error = None, err
    with self._cond:
      e.fetching = False
      if error is None:
        e.path = path
      else:  # its files go; the entry stays only to carry the error to the next reader of the shard
        self._evict(e)
        e.reserved, e.error, e.failed_at = 0, error, time.monotonic()
        self._entries[k] = e
      self._cond.notify_all()
    return True

  def _download(self, k: int) -> str:
    """Downloads shard k once (each of its ranged reads retried by the stream's retry policy); returns its path."""
    info = self._infos[k]
    src = self.output.shard_path(info)
    dest = os.path.join(self._folder, f"{k:06d}-{os.path.basename(info.path)}")
    obj = self._objects.get(k)
    if obj is None:  # its first read pins the generation: later epochs fetch the same one (a replaced object
      obj = self._objects[k] = RemoteObject(src, info.num_bytes)  # is refused), no metadata request
    try:
      stats = download(obj, dest, info.sha256, options=self._options, pool=self._pool)
    except FileNotFoundError:
      raise FileNotFoundError(f"{src}: the manifest lists this shard but it is gone") from None
    self.bytes_fetched += stats.bytes_fetched
    return dest

  def _evict(self, e: _Entry) -> None:
    """Closes the shard's readers and deletes its files (self._cond held, the shard unpinned)."""
    for r in e.readers:
      r.close()
    e.readers.clear()
    if self._remote and self._folder is not None:
      dest = os.path.join(self._folder, f"{e.k:06d}-{os.path.basename(self._infos[e.k].path)}")
      for suffix in ("", ".fetched", ".lock", ".partial", ".partial.json"):
        with contextlib.suppress(FileNotFoundError):
          os.remove(dest + suffix)
    self._forget(e)


class _Piece:
  """Records [first, stop) of shard k: one ranged read, verified as a whole, kept until its batch is read."""

  __slots__ = ("k", "first", "stop", "records")

  def __init__(self, k: int, first: int, stop: int):
    self.k, self.first, self.stop = k, first, stop
    self.records: list[bytes] = []


class RecordStream:
  """This host's records of a gs:// ArrayRecord split, fetched as few ranged reads of whole runs.

  With order="global" every host's batches come from every shard of a
  window; fetching whole shards would make each host read the whole split.
  Here a host reads only its own records: each shard's tail once
  (formats.arrayrecord_index.record_ranges: 1 or 2 ranged reads, ~128 KiB,
  its hashes checked), then its batches' records, grouped into *pieces*:
  records of one shard that lie next to each other (a run of the
  WindowOrder, or neighbouring runs) are one ranged read of their chunks,
  `streams` at a time, for the batches from the lowest one being read up to
  `ahead` batches on (and no more than `cache_limit_bytes` held). Each piece
  is verified by array_record's C++ reader (its riegeli hashes) through a
  sparse file holding only the shard's tail (VerifiedRecordReader.read_run)
  as soon as it arrives, in the fetching thread; its records are kept until
  their batch has been read. The manifest's SHA-256 covers whole shards and
  cannot be checked record by record: each shard's object is pinned to the
  generation that answered first, its size is checked against the manifest
  by every answer and its record count by its footer, and every byte read is
  covered by a chunk hash.

  Same interface and batches as ShardStream (the order is the WindowOrder's).

  Attributes:
    requests: ranged reads sent (tails and pieces).
    bytes_fetched: bytes they brought.
    peak_bytes: the most bytes of pieces held at once (the manifest's mean record size per record).
  """

  def __init__(self, output: Output, split: str, order: WindowOrder, num_positions: int, *,
               cache_dir: str | None = None, cache_limit_bytes: int | None = None, streams: int = 32,
               ahead: int = 16, piece_bytes: int = 16 << 20):
    if output.file_format != "array_record":
      raise ValueError(f"{output.path}: ranged reads of single records need ArrayRecord shards (their footer "
                       f"indexes the records), not {output.file_format}")
    self.output, self.split, self.order = output, split, order
    self._infos = output.shards(split)
    self._num_positions, self._ahead, self._piece_bytes = num_positions, ahead, piece_bytes
    self._options = DownloadOptions(progress=False)
    root = os.path.join(cache_dir or DEFAULT_CACHE_ROOT, "stream")
    self.limit = default_cache_limit(root) if cache_limit_bytes is None else int(cache_limit_bytes)
    self._folder, self._finalizer = _private_folder(self, root)
    self.peak_bytes = 0
    self.bytes_fetched = 0
    self.requests = 0
    self._cond = threading.Condition()
    self._pool = concurrent.futures.ThreadPoolExecutor(streams, thread_name_prefix="record-stream")
    self._shards: dict[int, tuple] = {}  # k -> (RemoteObject, RecordIndex)
    self._shard_locks = collections.defaultdict(threading.Lock)
    self._readers: collections.OrderedDict[int, object] = collections.OrderedDict()  # k -> VerifiedRecordReader
    # position -> record -> the future of its piece (a piece's records share one future)
    self._started: dict[int, dict[int, concurrent.futures.Future]] = {}
    self._held = 0
    self._reading = _Reading()
    self._closed = False
    self._fatal: BaseException | None = None
    self._fetcher: threading.Thread | None = None
    self._count_lock = threading.Lock()
    self._reader_users: dict[int, int] = {}  # shard -> threads reading through its reader now
    self._tls = threading.local()

  features = ShardStream.features
  kind = ShardStream.kind
  get = ShardStream.get
  __len__ = ShardStream.__len__

  def where(self, index: int) -> str:
    """"<shard path>: record <k>" of split record `index`."""
    k = int(np.searchsorted(self.order.starts, index, side="right")) - 1
    return f"{self.output.shard_path(self._infos[k])}: record {index - int(self.order.starts[k])}"

  def _locate(self, index: int) -> tuple[int, int]:
    k = int(np.searchsorted(self.order.starts, index, side="right")) - 1
    if not 0 <= k < len(self._infos):
      raise IndexError(f"record {index} outside [0, {int(self.order.starts[-1])})")
    return k, index - int(self.order.starts[k])

  def _shard(self, k: int):
    """(the pinned object, the record index) of shard k: its tail read once."""
    from formats.arrayrecord_index import record_ranges

    got = self._shards.get(k)
    if got is not None:
      return got
    with self._shard_locks[k]:
      got = self._shards.get(k)
      if got is None:
        info = self._infos[k]
        src = self.output.shard_path(info)
        obj = RemoteObject(src, info.num_bytes)  # the tail's read pins the generation (and checks the size)

        def read(a: int, b: int) -> bytes:
          self._count(0)
          try:
            return read_range(obj, a, b, self._options)
          except FileNotFoundError:
            raise FileNotFoundError(f"{src}: the manifest lists this shard but it is gone") from None
        index = record_ranges(read, obj.size, name=src, scratch_dir=self._folder)
        if len(index) != info.num_records:
          raise CorruptRecordError(f"{src}: {len(index)} records, the manifest says {info.num_records}")
        got = self._shards[k] = (obj, index)
    return got

  def _fetch_piece(self, piece: _Piece) -> _Piece:
    """Reads the piece's chunks with one ranged read and verifies them (a pool thread)."""
    obj, ri = self._shard(piece.k)
    start, stop = ri.byte_range(piece.first)[0], ri.byte_range(piece.stop - 1)[1]
    buffer = getattr(self._tls, "buffer", None)  # one per fetching thread, reused: no allocation, no copy
    if buffer is None or len(buffer) < stop - start:
      buffer = self._tls.buffer = bytearray(max(stop - start, 1 << 20))
    data = memoryview(buffer)[:stop - start]
    self._count(0)
    read_range_into(obj, start, data, self._options)
    self._count(len(data))
    reader = self._reader(piece.k)
    try:
      piece.records = reader.read_run(piece.first, piece.stop, data)
    finally:
      with self._cond:
        self._reader_users[piece.k] -= 1
        self._close_unused_readers()
    return piece

  def _count(self, nbytes: int) -> None:
    """One more request (nbytes=0, when it is sent), or the bytes one brought."""
    with self._count_lock:
      if nbytes:
        self.bytes_fetched += nbytes
      else:
        self.requests += 1

  def _pieces(self, indices: np.ndarray) -> list[_Piece]:
    """The batch's records as pieces: each a run of neighbours in one shard, at most piece_bytes long."""
    idx = np.unique(np.asarray(indices, np.int64))
    if not len(idx):
      return []
    shard = np.searchsorted(self.order.starts, idx, side="right") - 1
    local = idx - self.order.starts[shard]
    breaks = np.flatnonzero((np.diff(shard) != 0) | (np.diff(local) != 1)) + 1
    pieces = []
    for run_shard, run_local in zip(np.split(shard, breaks), np.split(local, breaks)):
      k = int(run_shard[0])
      info = self._infos[k]
      per = max(1, -(-info.num_bytes // max(1, info.num_records)))  # the shard's mean record size
      most = max(1, self._piece_bytes // per)
      first, stop = int(run_local[0]), int(run_local[-1]) + 1
      for a in range(first, stop, most):
        pieces.append(_Piece(k, a, min(a + most, stop)))
    return pieces

  def _start(self, position: int) -> None:
    """Submits the piece reads of batch `position` (self._cond held)."""
    indices = self.order.indices(position)
    futures: dict[int, concurrent.futures.Future] = {}
    for piece in self._pieces(indices):
      f = self._pool.submit(self._fetch_piece, piece)
      first = int(self.order.starts[piece.k])
      for local in range(piece.first, piece.stop):
        futures[first + local] = f
    self._started[position] = futures
    self._held += self._estimate(indices)
    self.peak_bytes = max(self.peak_bytes, self._held)

  def _estimate(self, indices) -> int:
    """Bytes the records of `indices` take (the manifest's mean record size per shard)."""
    total = 0
    for i in indices:
      info = self._infos[int(np.searchsorted(self.order.starts, int(i), side="right")) - 1]
      total += -(-info.num_bytes // max(1, info.num_records))
    return total

  @contextlib.contextmanager
  def batch(self, position: int):
    """Waits for batch `position`'s pieces (fetching them now if the prefetcher has not); yields its indices.

    A piece whose read gave up on transient errors before this call asked for it (it was read
    ahead) is read once more for it; one that fails while this call waits is raised by `raw`.
    """
    with self._cond:
      if self._fatal is not None:
        raise RuntimeError(f"the record prefetcher stopped: {type(self._fatal).__name__}: {self._fatal}")
      self._reading.enter(position)
      if self._fetcher is None:
        self._fetcher = threading.Thread(target=_worker, args=(weakref.ref(self), RecordStream._prefetch_step, True),
                                         name="record-stream", daemon=True)
        self._fetcher.start()
      # Within the limit: a batch starts when its records fit beside those held, or when it is the lowest one
      # being read (which always may, so that reading goes on): threads asking ahead wait for room.
      while (position not in self._started and self._started and position != self._reading.low()
             and self._held + self._estimate(self.order.indices(position)) > self.limit):
        self._cond.wait(1.0)
        if self._fatal is not None or self._closed:
          self._leave(position)
          raise RuntimeError("the record stream was closed" if self._fatal is None else
                             f"the record prefetcher stopped: {type(self._fatal).__name__}: {self._fatal}")
      if position not in self._started:
        self._start(position)
      futures = self._started[position]
      for f in {id(f): f for f in futures.values()}.values():
        if f.done() and f.exception() is not None and _gave_up(f.exception()):
          piece = self._piece_of(f, futures)
          again = self._pool.submit(self._fetch_piece, piece)
          for i, g in futures.items():
            if g is f:
              futures[i] = again
      self._cond.notify_all()
    try:
      concurrent.futures.wait(list({id(f): f for f in futures.values()}.values()))
      yield self.order.indices(position)
    finally:
      with self._cond:
        self._leave(position)

  def _piece_of(self, future: concurrent.futures.Future, futures: dict) -> _Piece:
    """The piece a failed future read (rebuilt from the records it was to bring)."""
    records = sorted(i for i, f in futures.items() if f is future)
    k, first = self._locate(records[0])
    return _Piece(k, first, first + len(records))

  def pin_one_record(self):
    """As ShardStream.pin_one_record."""
    return _pin_one_record(self)

  def raw(self, index: int) -> bytes:
    """Record `index`, from the piece its batch fetched (verified by the C++ reader when it arrived).

    Raises:
      CorruptRecordError: the piece fails its hashes; the message names the shard, records and bytes.
      ConnectionError, SourceChangedError: the piece could not be read.
    """
    k, local = self._locate(index)
    piece = self._chunk_of(index).result()
    return piece.records[local - piece.first]

  def _reader(self, k: int):
    """Shard k's VerifiedRecordReader, counted as in use until the caller gives it back."""
    from formats.arrayrecord_index import VerifiedRecordReader

    with self._cond:
      reader = self._readers.get(k)
      if reader is not None:
        self._readers.move_to_end(k)
        self._reader_users[k] = self._reader_users.get(k, 0) + 1
        return reader
    _, ri = self._shard(k)
    made = VerifiedRecordReader(ri, _given_only, scratch_dir=self._folder)  # outside the lock: it writes the tail
    with self._cond:
      reader = self._readers.setdefault(k, made)
      self._readers.move_to_end(k)
      self._reader_users[k] = self._reader_users.get(k, 0) + 1
    if reader is not made:
      made.close()
    return reader

  def _close_unused_readers(self) -> None:
    """Closes the least recently used readers beyond the cap that no thread is using (self._cond held)."""
    cap = max(_OPEN_SHARDS, 4 * self.order.window)
    for k in list(self._readers):
      if len(self._readers) <= cap:
        break
      if not self._reader_users.get(k):
        self._readers.pop(k).close()
        self._reader_users.pop(k, None)

  def _chunk_of(self, index: int) -> concurrent.futures.Future:
    with self._cond:
      for p in sorted(self._reading.counts):
        f = self._started.get(p, {}).get(index)
        if f is not None:
          return f
    raise RuntimeError(f"record {index} is not in a batch being read")

  def _leave(self, position: int) -> None:
    if self._reading.leave(position) and position in self._started:
      self._held -= self._estimate(list(self._started.pop(position)))
    self._cond.notify_all()

  def _prefetch_step(self) -> bool | None:
    """One round of the prefetcher (self._cond held): None once closed, else False (then it waits)."""
    if self._closed:
      return None
    self._prefetch()
    return False

  def _prefetch(self) -> None:
    """Starts the reads of the batches from the lowest one being read up to `ahead` on (self._cond held).

    A started batch is dropped once it is `ahead` batches behind the one last
    asked for and nobody reads it (grain's threads ask slightly out of order:
    a batch just below the lowest one being read is usually about to be read).
    """
    low = self._reading.low()
    for p in list(self._started):
      if p not in self._reading.counts and (p < self._reading.next - self._ahead or p >= low + 2 * self._ahead):
        self._held -= self._estimate(list(self._started.pop(p)))
    for p in range(low, min(low + self._ahead, self._num_positions)):
      if p not in self._started:
        if self._held + self._estimate(self.order.indices(p)) > self.limit and self._started:
          break
        self._start(p)

  def close(self) -> None:
    """Stops prefetching, closes the readers and deletes the private folder. Closing twice is fine."""
    _stop(self)
    self._pool.shutdown(wait=True, cancel_futures=True)
    with self._cond:
      readers, self._readers = list(self._readers.values()), collections.OrderedDict()
    for r in readers:
      r.close()
    self._finalizer()


def _given_only(start: int, stop: int) -> bytes:
  raise RuntimeError(f"bytes [{start}, {stop}) asked for: a RecordStream hands every piece's bytes to its reader")


_FOLDER = re.compile(r"stream-(\d+)-[0-9a-f]{12}")
_OWNER = ".owner.lock"  # locked by the folder's stream for its whole life


def _private_folder(owner, root: str) -> tuple[str, weakref.finalize]:
  """A new folder `<root>/stream-<pid>-<hex>`, locked while `owner` lives, removed when it is collected or at exit."""
  os.makedirs(root, exist_ok=True)
  _remove_stale(root)
  folder = os.path.join(root, f"stream-{os.getpid()}-{uuid.uuid4().hex[:12]}")
  making = folder + ".new"  # a name _remove_stale never touches, until the lock is held
  os.makedirs(making)
  fd = os.open(os.path.join(making, _OWNER), os.O_RDWR | os.O_CREAT, 0o644)
  fcntl.flock(fd, fcntl.LOCK_EX)
  os.rename(making, folder)
  return folder, weakref.finalize(owner, _drop_folder, folder, fd)


def _drop_folder(folder: str, fd: int) -> None:
  shutil.rmtree(folder, ignore_errors=True)
  os.close(fd)  # the lock goes last: nobody else deletes a folder that is still being removed


def _remove_stale(root: str) -> None:
  """Deletes the private folders of streams that are gone (a killed process): those whose lock is free.

  Only names this module makes are touched; a folder whose owner still holds
  its lock (any process, any pid namespace on this file system, this one too:
  a flock is held per open file, so this process's own streams keep theirs)
  is kept. A dead folder with this process's pid is removed too (a restarted
  container's process often gets the pid of the one that was killed).
  """
  for name in os.listdir(root):
    if _FOLDER.fullmatch(name) is None:
      continue
    folder = os.path.join(root, name)
    try:
      fd = os.open(os.path.join(folder, _OWNER), os.O_RDWR)
    except FileNotFoundError:
      continue  # being created (the lock comes right after the folder), or being removed
    except OSError:
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      continue
    try:
      shutil.rmtree(folder, ignore_errors=True)
    finally:
      os.close(fd)


def _gave_up(e: BaseException) -> bool:
  """Whether a read ahead failed for the network's sake (its policy gave up): worth one more for a reader."""
  return isinstance(e, retry.RetryExhausted) or retry.is_transient(e)


def _stop(stream) -> None:
  """Marks a stream closed and wakes its fetchers and readers, which then end."""
  with stream._cond:
    stream._closed = True
    stream._cond.notify_all()


def _worker(ref: weakref.ref, step: Callable[[object], bool | None], locked: bool) -> None:
  """A stream's fetcher thread: `step(stream)` until it returns None; after a step that returns False it waits
  (0.5 s at most) on the stream's condition, held through the step and the wait when `locked`. It holds the
  stream only weakly, and never while waiting, so a stream nobody uses is collected and the thread ends; an
  error in a step reaches the stream's readers (`_fatal`) instead of a hang."""
  while True:
    stream = ref()
    if stream is None:
      return
    cond = stream._cond
    try:
      with cond if locked else contextlib.nullcontext():
        more = step(stream)
        del stream
        if more is False:
          with contextlib.nullcontext() if locked else cond:
            cond.wait(0.5)
    except BaseException as e:  # noqa: BLE001 - a bug here must not leave readers waiting forever
      stream = ref()
      if stream is not None:
        with cond:
          stream._fatal = e
          cond.notify_all()
      return
    if more is None:
      return


@contextlib.contextmanager
def _pin_one_record(stream):
  """Pins the first batch position of the epoch holding records of this host; yields one of its indices."""
  for position in range(stream.order.batches_per_epoch):
    if len(stream.order.indices(position)):
      with stream.batch(position) as indices:
        yield int(indices[0])
      return
  raise ValueError("this host has no record in the split")


class StreamedBatches:
  """Batch position → one batch of examples, read from a ShardStream in its WindowOrder (grain's map function).

  Random draws (patch positions) use element_rng(seed, position, slot), the
  slot counted in the global batch with order="global", as the random-access
  reader does.
  """

  def __init__(self, stream: ShardStream, fill):
    """`fill(source, indices, position, first_slot)` reads records `indices` of `source` into one batch."""
    self.stream, self._fill = stream, fill
    self.batches_per_epoch = stream.order.batches_per_epoch

  def __call__(self, position: int, _=None) -> dict:
    with self.stream.batch(position) as indices:
      return self._fill(self.stream, indices, position, self.stream.order.first_slot)
