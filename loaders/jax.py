"""Shards → dicts of global `jax.Array`s on a mesh: every process reads its rows, the arrays span the pod.

    mesh = jax.sharding.Mesh(jax.devices(), ("data",))
    it = loaders.jax.dataset("gs://bucket/imagenet", "train", mesh=mesh, global_batch_size=1024,
                             image_size=(224, 224))
    for batch in it:          # batch["image"]: uint8 [1024, 224, 224, 3], rows sharded over "data"
      params = train_step(params, batch)
    state = it.get_state()    # resume, on any number of processes: it.set_state(state)
    it.close()                # the lease on the generation read goes

Each process reads its slice of every global batch with loaders.grain.dataset
(shard index and count from jax.process_index() / jax.process_count(); the
global order, so a state saved on N processes resumes on M) and contributes
it through jax.make_array_from_process_local_data. A background thread makes
the global batches `prefetch` ahead of the training loop, so reading, the
host-to-device copies and the step overlap. Arrays of strings or objects stay
on the host, as numpy, in the same dict (this process's rows). jax turns
64-bit values into 32-bit ones unless `jax_enable_x64` is set; an integer
that would not fit is refused (ValueError), never wrapped.

`graph_dataset` does the same for the neighbour samplers, one subgraph per
slice of the mesh. Threads only; never imports TensorFlow or torch.
"""

from __future__ import annotations

from collections.abc import Callable
import copy
import dataclasses
import functools
import math
import queue
import threading
import weakref

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np

from loaders import grain as grain_loader, graph as graph_loader
from loaders._order import per_host_batch_size
from loaders.options import ExampleOptions, Fetching, Ordering, Reading, Sharding, settings

__all__ = ["DeviceIterator", "dataset", "graph_dataset"]

_END = object()  # the host dataset is exhausted


class DeviceIterator:
  """Global batches of a host dataset, made `prefetch` ahead in a background thread; resumable by state.

      it = DeviceIterator(loaders.grain.dataset(path, batch_size=32).map(f), NamedSharding(mesh, P("data")))

  Each process's host batch must hold its rows of the global batch, in order
  (what `dataset` and `graph_dataset` arrange), and nothing may write into it
  once it is yielded (the device arrays may share its memory: `_to_global`).
  `get_state()` is the host iterator's state right after the last batch the
  loop received, not the (further advanced) live one. An error making a batch
  (reading it, or an int64 or uint64 value that jax would wrap: 32 bits
  without jax_enable_x64, ValueError) is raised from `next`, and the next call
  tries that batch again; a refused `set_state` and `close` leave the position
  at the last batch received, so nothing read ahead is lost. `close` and
  `set_state` may come from another thread or a signal handler while `next`
  waits (a preemption handler saving the state): `next` then goes on from the
  position they left, and an interrupt (Ctrl-C) inside any of them loses no
  batch either. jax settings made with a context manager (`jax.enable_x64`)
  apply to the batches as they stand when `next` starts the thread.
  """

  def __init__(self, host_dataset, sharding: NamedSharding, prefetch: int = 2):
    """Args:
      host_dataset: an iterable of dicts of numpy arrays whose iterator has get_state()/set_state() (a grain
        IterDataset).
      sharding: how every array is laid out over the devices.
      prefetch: global batches waiting on the devices ahead of the loop (at least 1; the thread makes one more).

    Raises:
      ValueError: `prefetch` is below 1.
    """
    if prefetch < 1:
      raise ValueError(f"prefetch must be >= 1, got {prefetch}")
    self._dataset, self._prefetch = host_dataset, prefetch
    self._to_global = functools.partial(_to_global, sharding)
    self._iter = iter(host_dataset)
    self._state = self._iter.get_state()
    self._worker: _Worker | None = None  # running, or stopped and not yet joined (an interrupted _halt)
    self._stop_worker: weakref.finalize | None = None
    self._rewind = False  # the host iterator is past self._state (what a stopped worker read ahead)
    self._done = False
    self._lock = threading.RLock()  # re-entrant: a signal handler may close while this thread holds it

  def __iter__(self) -> DeviceIterator:
    return self

  def __next__(self) -> dict:
    while True:
      with self._lock:
        if self._worker is not None and self._worker.stopped:
          self._halt()  # one stopped from elsewhere, or a halt an interrupt cut short
        if self._done:
          raise StopIteration
        worker = self._worker
        if worker is None:  # the worker holds no reference to self: a dropped iterator stops it
          if self._rewind:
            self._iter.set_state(self._state)
            self._rewind = False
          worker = self._worker = _Worker(self._iter, self._to_global, self._prefetch)
          self._stop_worker = weakref.finalize(self, worker.stop)
      item = worker.get()  # no lock held while waiting: close() and set_state() may come meanwhile
      with self._lock:
        if item is _HALTED or worker is not self._worker:
          continue  # stopped by close() or set_state(): go on from where they left the position
        if item is _END:
          self._halt()
          self._done = True
          raise StopIteration
        if isinstance(item, BaseException):
          self._halt()  # the next call reads again from the batch that failed
          raise item
        batch, self._state = item
        return batch

  def _halt(self) -> None:
    """Stops the worker and waits for its thread; what it made ahead is dropped (the host iterator goes back to
    the last batch received before a worker starts again). An interrupt while waiting leaves the worker to the
    next call, which waits again."""
    worker = self._worker
    if worker is None:
      return
    self._rewind = True
    worker.stop()
    if self._stop_worker is not None:
      self._stop_worker.detach()
    self._worker = self._stop_worker = None

  @property
  def identity(self):
    """The data read (a loaders._pinning.DataIdentity), or None over a dataset that does not name it."""
    return getattr(self._dataset, "identity", None)

  def get_state(self) -> dict:
    """Where to resume so that the next batch is the one after the last batch received (JSON-able)."""
    return copy.deepcopy(self._state)

  def set_state(self, state: dict) -> None:
    """Continues after the batch `state` was saved at (by this or another iterator, on any process count).

    Raises:
      StateMismatchError: `state` names other data than the host dataset reads (and it refuses those).
    """
    with self._lock:
      self._halt()
      self._iter.set_state(state)
      self._state, self._rewind, self._done = self._iter.get_state(), False, False

  def close(self) -> None:
    """Stops the prefetching and releases the host dataset's lease (when it has `close()`); idempotent."""
    with self._lock:
      self._halt()
      close = getattr(self._dataset, "close", None)
      if close is not None:
        close()


_HALTED = object()  # the worker was stopped while `get` waited


class _Worker:
  """A daemon thread that turns host batches into global ones, up to `depth` ahead of `get`, under the jax
  settings of the thread that starts it (jax keeps context-manager settings per thread)."""

  def __init__(self, host_iter, to_global: Callable[[dict], dict], depth: int):
    self._queue: queue.Queue = queue.Queue(depth)
    self._stop = threading.Event()
    self._x64 = jax.config.jax_enable_x64
    self._thread = threading.Thread(target=self._run, args=(host_iter, to_global), daemon=True,
                                    name="loaders.jax prefetch")
    self._thread.start()

  def _run(self, host_iter, to_global) -> None:
    try:
      with jax.enable_x64(self._x64):
        for batch in host_iter:
          if not self._put((to_global(batch), host_iter.get_state())):
            return
        self._put(_END)
    except BaseException as e:  # noqa: BLE001 - raised again in the loop's thread
      self._put(e)

  def _put(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        pass
    return False

  @property
  def stopped(self) -> bool:
    return self._stop.is_set()

  def get(self):
    """The next item the thread made, or _HALTED once `stop` was called."""
    while not self._stop.is_set():
      try:
        return self._queue.get(timeout=0.1)
      except queue.Empty:
        pass
    return _HALTED

  def stop(self) -> None:
    """Stops the thread and waits for it (again, after an interrupted wait)."""
    self._stop.set()
    self._thread.join()


def _to_global(sharding: NamedSharding, batch: dict) -> dict:
  """One host batch → the global batch: arrays of numbers become jax.Arrays, strings and objects stay as they are.

  On the CPU backend jax uses a host array whose data is 64-byte aligned in place, as the device array's memory
  (loaders._batch aligns the loaders' batches: no copy), and copies any other; a TPU or GPU copies it into device
  memory. Either way nothing may write into a host batch once it is handed over (`may_alias=False` does not stop
  the sharing for numpy arrays: jax-ml/jax#37830): the loaders' batches are new memory every time, and a pool
  that reuses a buffer only once nothing refers to it (loaders._features.BufferPool) is safe, as the device
  array refers to it.
  """
  local = {k: v for k, v in batch.items() if isinstance(v, np.ndarray) and v.dtype.kind not in "OSU"}
  for key, value in local.items():
    _check_fits(key, value)
  arrays = jax.make_array_from_process_local_data(sharding, local)
  return {k: arrays.get(k, v) for k, v in batch.items()}


def _check_fits(key: str, value: np.ndarray) -> None:
  """Refuses integers that jax would wrap: without jax_enable_x64 it stores int64 and uint64 in 32 bits.

  Raises:
    ValueError: `value` holds an integer outside the 32-bit type jax turns its type into.
  """
  stored = jax.dtypes.canonicalize_dtype(value.dtype)
  if stored == value.dtype or value.dtype.kind not in "iu" or not value.size:
    return
  bounds = np.iinfo(stored)
  if value.min() < bounds.min or value.max() > bounds.max:
    raise ValueError(f"{key!r} holds {value.dtype} values outside {stored}, the type jax stores them as without "
                     f"jax_enable_x64, so they would wrap: jax.config.update('jax_enable_x64', True) keeps them")


def _first_axes(partition: PartitionSpec) -> tuple[str, ...]:
  """The mesh axes that `partition`'s first entry shards the leading dimension over."""
  first = partition[0] if len(partition) else None
  return () if first is None else (first,) if isinstance(first, str) else tuple(first)


def _slices(mesh: Mesh, partition: PartitionSpec) -> int:
  """How many slices `partition` cuts the leading dimension into on `mesh`."""
  return math.prod(mesh.shape[a] for a in _first_axes(partition))


def _rows(mesh: Mesh, partition: PartitionSpec, n: int) -> list[int]:
  """The indices of a leading dimension of `n` that this process's devices hold under `partition`."""
  sharding = NamedSharding(mesh, PartitionSpec(partition[0] if len(partition) else None))
  return sorted({i for (s,) in sharding.addressable_devices_indices_map((n,)).values() for i in range(*s.indices(n))})


def _check_rows(mesh: Mesh, partition: PartitionSpec, per_host: int, shard_index: int, shard_count: int) -> None:
  """Refuses a mesh that asks this process for other rows of the global batch than its shard reads."""
  total, slices = per_host * shard_count, _slices(mesh, partition)
  if total % slices:
    raise ValueError(f"a global batch of {total} ({shard_count} x {per_host}) does not split into the {slices} "
                     f"slices that partition {partition} cuts on the mesh")
  rows = _rows(mesh, partition, total)
  want = list(range(shard_index * per_host, (shard_index + 1) * per_host))
  if rows == want:
    return
  if not rows:
    raise ValueError(f"on this mesh process {jax.process_index()} holds no rows of the global batch (none of "
                     f"its devices is on the mesh), but shard {shard_index} of {shard_count} reads rows "
                     f"[{want[0]}, {want[-1] + 1})")
  hint = ""
  if rows == list(range(rows[0], rows[0] + len(rows))) and rows[0] % len(rows) == 0:
    hint = f": pass shard_index={rows[0] // len(rows)}, shard_count={total // len(rows)}"
  raise ValueError(f"on this mesh process {jax.process_index()} holds rows [{rows[0]}, {rows[-1] + 1}) "
                   f"({len(rows)} rows) of each global batch of {total}, but shard {shard_index} of {shard_count} "
                   f"reads rows [{want[0]}, {want[-1] + 1}){hint}")


def dataset(path: str, split: str = "train", *, mesh: Mesh, partition: PartitionSpec = PartitionSpec("data"),
            batch_size: int | None = None, global_batch_size: int | None = None,
            ordering: Ordering | None = None, sharding: Sharding | None = None, fetching: Fetching | None = None,
            example: ExampleOptions | None = None, reading: Reading | None = None, prefetch: int = 2,
            **fields) -> DeviceIterator:
  """Global batches of `path`'s `split` on `mesh`: dicts of jax.Arrays of static shape, resumable.

  Args:
    path, split, ordering, fetching, example, reading, **fields: as in loaders.grain.dataset.
    mesh: the devices every array spans.
    partition: the layout of every array on `mesh`; its first entry shards the batch dimension (by default
      over the mesh axis "data").
    batch_size, global_batch_size: this process's rows of each global batch, or the global batch (as in
      loaders.grain.dataset).
    sharding: this process's slice of every global batch (loaders.Sharding or grain's ShardOptions, e.g.
      ShardByJaxProcess); what it leaves None is jax.process_index() and jax.process_count(). `mesh` must
      place exactly those rows on this process's devices.
    prefetch: global batches waiting on the devices ahead of the loop (DeviceIterator).

  Returns:
    A DeviceIterator; its get_state() resumes on any number of processes with the same global batch
    (order="global", the default).

  Raises:
    ValueError: a mesh that gives this process other rows than its shard reads, a global batch the
      partition's slices do not divide, `prefetch` below 1, or what loaders.grain.dataset refuses.
    TypeError: as in loaders.grain.dataset.
    NotAnOutputError, KeyError, CorruptRecordError: as in loaders.grain.data_source.
  """
  s = settings("loaders.jax.dataset", ordering=ordering, sharding=sharding, fetching=fetching, example=example,
               reading=reading, **fields)
  shard_index, shard_count = s.sharding.resolve(jax.process_index(), jax.process_count())
  per_host = per_host_batch_size(batch_size, shard_count, s.ordering.order, global_batch_size)
  _check_rows(mesh, partition, per_host, shard_index, shard_count)
  s = dataclasses.replace(s, sharding=Sharding(shard_index, shard_count))
  host = grain_loader.dataset(path, split, batch_size=per_host, **s.groups())
  try:
    return DeviceIterator(host, NamedSharding(mesh, partition), prefetch)
  except BaseException:
    host.close()
    raise


class _Subgraphs:
  """One sampler per subgraph slot this process holds, seen as one sampler whose batch i stacks theirs."""

  def __init__(self, samplers: list):
    self._samplers = samplers
    first = samplers[0]  # what loaders.graph.sampler_identity and sampler_order read
    self.graph, self.split, self.order, self.seed = first.graph, first.split, first.order, first.seed
    self.batch_size, self.shard_count = first.batch_size, first.shard_count

  def __len__(self) -> int:
    return len(self._samplers[0])

  def batch(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
    batches = [s.batch(index, epoch) for s in self._samplers]
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


def graph_dataset(make_sampler: Callable[[int, int], graph_loader.Sampler], *, mesh: Mesh,
                  partition: PartitionSpec = PartitionSpec("data"), ordering: Ordering | None = None,
                  reading: Reading | None = None, prefetch: int = 2, **fields) -> DeviceIterator:
  """Neighbour-sampled batches on `mesh`, one subgraph per slice of the leading axis: [slices, ...] arrays.

      it = graph_dataset(lambda i, n: loaders.graph.NeighborSampler(graph, [10, 5], global_batch_size=1024,
                                                                    shard_index=i, shard_count=n), mesh=mesh)
      for batch in it:   # batch["x"]: [8, Nb, F] on a mesh of 8 along "data": one subgraph per device
        params = train_step(params, batch)   # e.g. jax.vmap of the per-subgraph model

  A subgraph's local ids index only its own nodes, so subgraphs are stacked on
  a new leading axis (never concatenated); this process samples the slots its
  devices hold, each with its own sampler.

  Args:
    make_sampler: (slot, slots) -> the sampler of that slot (NeighborSampler or HeteroNeighborSampler with
      shard_index=slot, shard_count=slots; every slot over the same graph and seeds).
    mesh: the devices every array spans.
    partition: the layout of every array; its first entry shards the slots (by default over "data").
    ordering, reading, **fields: as in loaders.graph.grain_dataset (num_epochs, on_new_data, num_threads, ...).
    prefetch: global batches waiting on the devices ahead of the loop (DeviceIterator).

  Returns:
    A DeviceIterator; with order="global" (the samplers' default) and the same global batch, a state
    resumes on any number of processes; on the same mesh size the batches are the same.

  Raises:
    ValueError: a sampler whose shard is not its slot, or slots with different numbers of batches.
  """
  slots = _slices(mesh, partition)
  mine = _rows(mesh, partition, slots)
  if not mine:
    raise ValueError(f"on this mesh process {jax.process_index()} holds none of the {slots} subgraph slots "
                     "(none of its devices is on the mesh)")
  samplers = [make_sampler(i, slots) for i in mine]
  for i, s in zip(mine, samplers):
    if (s.shard_index, s.shard_count) != (i, slots):
      raise ValueError(f"make_sampler({i}, {slots}) made a sampler of shard {s.shard_index} of {s.shard_count}")
  if len({len(s) for s in samplers}) != 1:
    raise ValueError(f"the slots' samplers have different numbers of batches: {[len(s) for s in samplers]}")
  host = graph_loader.grain_dataset(_Subgraphs(samplers), ordering=ordering, reading=reading, **fields)
  return DeviceIterator(host, NamedSharding(mesh, partition), prefetch)
