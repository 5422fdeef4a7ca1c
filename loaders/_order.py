"""Which seeds a sampler's batch holds: per host, or one global order that survives a change of host count.

Two orders, both a pure function of (seed, epoch) and the batch index:

* "host": each epoch's seeded permutation of the seeds is dealt to the
  `shard_count` hosts in turn (host h gets every shard_count-th seed from h
  on), and each host cuts its share into batches of `batch_size`. Every host
  has the same number of batches; the remainder of the division is left out
  of the epoch.
* "global": global step i takes the next `batch_size × shard_count` seeds of
  the epoch's permutation, and host h takes its slice
  [h × batch_size, (h + 1) × batch_size) of them. The seeds of a global step do
  not depend on the host count: a run that stops on 4 hosts can continue on 2
  or 8 (with `batch_size` set so that the global batch stays the same) from
  the same global step, and every step's seeds are exactly those of an
  uninterrupted run, on any number of hosts, one included. The last global
  step may be short: hosts past its end get batches of padding (all masked).

The neighbours drawn for a batch depend on the batch's seeds and its key
(seed, epoch, batch, host), so in "global" order the seeds of a step are the
same whatever the host count, and the sampled neighbourhoods are not.
"""

from __future__ import annotations

import hashlib
import math
import threading

import numpy as np

ORDERS = ("host", "global")


def per_host_batch_size(batch_size: int | None, shard_count: int, order: str, global_batch_size: int | None,
                        default: int | None = None) -> int:
  """The items per batch on one host: `batch_size`, or `global_batch_size` / `shard_count` (order "global").

  Args:
    batch_size: the per-host batch the caller gave (None: not given).
    shard_count: the number of hosts.
    order: "host" or "global".
    global_batch_size: the global batch the caller gave (None: not given).
    default: the per-host batch when neither is given (None: one is required).

  Returns:
    The per-host batch size.

  Raises:
    ValueError: an unknown order; global_batch_size without order="global", not divisible by
      shard_count, or disagreeing with a batch_size also given; no batch size at all; one below 1.
  """
  if order not in ORDERS:
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
  if global_batch_size is not None:
    if shard_count < 1:
      raise ValueError(f"shard_count must be >= 1, got {shard_count}")
    if order != "global":
      raise ValueError(f"global_batch_size needs order='global' (order is {order!r})")
    if global_batch_size < 1 or global_batch_size % shard_count:
      raise ValueError(f"global_batch_size {global_batch_size} is not divisible by shard_count {shard_count}: "
                       f"every host takes an equal slice of each global step")
    if batch_size is not None and batch_size * shard_count != global_batch_size:
      raise ValueError(f"batch_size {batch_size} and global_batch_size {global_batch_size} disagree on "
                       f"{shard_count} hosts ({global_batch_size} / {shard_count} = "
                       f"{global_batch_size // shard_count}): give one of them")
    return global_batch_size // shard_count
  batch_size = default if batch_size is None else batch_size
  if batch_size is None or batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  return batch_size


def seeds_name(seed_nodes: np.ndarray) -> str:
  """"seed_nodes:<sha256 prefix>": how a sampler's saved state names explicit seeds instead of a split name."""
  return "seed_nodes:" + hashlib.sha256(np.ascontiguousarray(seed_nodes, np.int64).tobytes()).hexdigest()[:16]


class SeedOrder:
  """The seeds of batch `i` of an epoch on this host, in one of ORDERS."""

  def __init__(self, seed_nodes: np.ndarray, batch_size: int, seed: int, shard_index: int, shard_count: int,
               order: str = "host"):
    """Args:
      seed_nodes: every seed of the split (the same on every host).
      batch_size: seeds per batch on this host.
      seed: fixes every epoch's permutation.
      shard_index, shard_count: this host and the number of hosts.
      order: "host" or "global" (module docstring).

    Raises:
      ValueError: an unknown order, a batch size below 1, a shard outside [0, shard_count), or (the host
        order) fewer seeds than hosts.
    """
    if order not in ORDERS:
      raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= shard_index < shard_count:
      raise ValueError(f"shard_index {shard_index} is outside [0, {shard_count})")
    self.seed_nodes, self.batch_size, self.seed = seed_nodes, batch_size, seed
    self.shard_index, self.shard_count, self.order = shard_index, shard_count, order
    n = len(seed_nodes)
    self.per_shard = n // shard_count  # "host": every host's share, equal on every host
    if order == "host":
      self.num_batches = math.ceil(self.per_shard / batch_size) if self.per_shard else 0
    else:
      self.num_batches = math.ceil(n / self.global_batch_size) if n else 0
    if n and not self.num_batches:  # the host order, fewer seeds than hosts
      raise ValueError(f"the {n} seed nodes give each of {shard_count} hosts {self.per_shard} (the host order "
                       "splits them evenly), so every epoch would be empty: use order='global' or fewer hosts")
    self._cache: tuple[int, np.ndarray] | None = None
    self._lock = threading.Lock()

  @property
  def global_batch_size(self) -> int:
    """Seeds per global step: batch_size × shard_count."""
    return self.batch_size * self.shard_count

  def _permuted(self, epoch: int) -> np.ndarray:
    with self._lock:
      if self._cache is None or self._cache[0] != epoch:
        perm = np.random.default_rng([self.seed, epoch, 0x5EED]).permutation(len(self.seed_nodes))
        if self.order == "host":
          perm = perm[self.shard_index:self.shard_count * self.per_shard:self.shard_count]
        self._cache = (epoch, self.seed_nodes[perm])
      return self._cache[1]

  def shard_seeds(self, epoch: int) -> np.ndarray:
    """This host's seeds of one epoch, in batch order.

    Args:
      epoch: the epoch.

    Returns:
      "host": the host's share (`per_shard` long); "global": its slices of every global step.
    """
    if self.order == "host":
      return self._permuted(epoch)
    return np.concatenate([self.batch(i, epoch) for i in range(self.num_batches)]) if self.num_batches else \
        self.seed_nodes[:0]

  def batch(self, index: int, epoch: int) -> np.ndarray:
    """The seeds of batch `index` of `epoch` on this host (shorter than batch_size at an epoch's end, maybe empty).

    Args:
      index: the batch (in "global" order: the global step).
      epoch: the epoch.

    Returns:
      The seeds.

    Raises:
      IndexError: `index` is outside the epoch.
    """
    if not 0 <= index < self.num_batches:
      raise IndexError(f"batch {index} outside [0, {self.num_batches})")
    seeds = self._permuted(epoch)
    if self.order == "host":
      return seeds[index * self.batch_size:(index + 1) * self.batch_size]
    start = index * self.global_batch_size + self.shard_index * self.batch_size
    return seeds[start:start + self.batch_size]


def check_some_batch(batches_per_epoch: int, num_records: int, per_epoch: int, batch_size: int, shard_count: int,
                     global_order: bool, share: str = "") -> None:
  """Refuses an order whose epochs hold no batch although the split holds records (they would all be lost).

  Args:
    batches_per_epoch, num_records: the order's batches per epoch and the split's records.
    per_epoch, batch_size, shard_count, global_order: what the order reads per epoch, and how.
    share: how a host's records are chosen under the host order (default: each host's strided share).

  Raises:
    ValueError: the records read per epoch make no whole batch.
  """
  if not num_records or batches_per_epoch:
    return
  if global_order:
    what = f"the split's {num_records} records make no whole global batch of {batch_size * shard_count} " \
           f"({batch_size} x {shard_count} hosts)"
  else:
    share = share or f"each of {shard_count} hosts reads"
    what = f"the {per_epoch} records {share} (of the split's {num_records}) make no whole batch of {batch_size}"
  raise ValueError(f"{what}, so every epoch would be empty: pass a smaller batch size or fewer hosts")


class RecordOrder:
  """The split records of each batch position, at random over the whole split (loaders.grain and loaders.tfdata
  without windows; loaders._stream.WindowOrder is the windowed order, with the same interface).

  * "global": epoch e is one permutation of the whole split drawn from (seed, e); global step k takes its
    records [k·G, (k+1)·G), G = batch_size × shard_count, and host h the slice from h·batch_size. Random
    draws are keyed by the slot in the global batch (`first_slot` + slot), so a step does not depend on
    the host count.
  * "host": this shard's records (split records shard_index + shard_count·j, j < num_records // shard_count,
    the remainder trimmed so every shard has as many), in a permutation drawn from (seed, e), cut into
    batches of batch_size.

  Unshuffled, each epoch keeps record order. A position is a pure function of (seed, shard, position), so
  a loader's state is its next position.
  """

  _GLOBAL_TAG = 0x610BA1  # the key of the global permutation

  def __init__(self, num_records: int, batch_size: int, *, seed: int = 0, shuffle: bool = True,
               shard_index: int = 0, shard_count: int = 1, order: str = "global", drop_remainder: bool = True):
    if order not in ORDERS:
      raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
    self.shard_index, self.shard_count, self.order = shard_index, shard_count, order
    self.num_records, self.per_shard = num_records, num_records // shard_count
    per_epoch, step = (num_records, batch_size * shard_count) if order == "global" else (self.per_shard, batch_size)
    self.batches_per_epoch = per_epoch // step if drop_remainder else -(-per_epoch // step)
    check_some_batch(self.batches_per_epoch, num_records, per_epoch, batch_size, shard_count, order == "global")
    self.first_slot = shard_index * batch_size if order == "global" else 0
    self._orders: dict[int, np.ndarray] = {}
    self._lock = threading.Lock()

  def _epoch(self, epoch: int) -> np.ndarray:
    """The epoch's record order (drawn once; the last two epochs are kept)."""
    with self._lock:
      order = self._orders.get(epoch)
      if order is not None:
        return order
      if self.order == "global":  # the whole split's order: the same on every host, whatever their number
        n = self.num_records
        order = (np.random.default_rng([self.seed, epoch, self._GLOBAL_TAG]).permutation(n) if self.shuffle
                 else np.arange(n))
      else:
        local = (np.random.default_rng([self.seed, epoch]).permutation(self.per_shard) if self.shuffle
                 else np.arange(self.per_shard))
        order = self.shard_index + self.shard_count * local  # this shard's records: strided
      self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
      self._orders[epoch] = order
      return order

  def indices(self, position: int) -> np.ndarray:
    """The split record indices of this host's batch `position` (over all epochs); short at an epoch's end
    when the remainder is kept."""
    epoch, k = divmod(position, self.batches_per_epoch)
    if self.order == "global":
      start = k * self.batch_size * self.shard_count + self.first_slot
    else:
      start = k * self.batch_size
    return self._epoch(epoch)[start:start + self.batch_size]
