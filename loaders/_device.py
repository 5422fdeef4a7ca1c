"""A resumable torch_xla device loader over any host iterator that has grain's get_state()/set_state().

Both torch_xla feeders use it: loaders.xla (records → batches) and
loaders.graph.xla_loader (neighbour-sampled batches). torch and torch_xla are
imported when a loader is built, never at import: this module, like every
torch_xla path, never imports TensorFlow (they cannot share a process).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np


class DeviceLoader:
  """Iterable of device batches over the host dataset; resumable by state.

  The device loader prefetches ahead of the training loop, so the state is the
  host iterator's state recorded right after the last batch the loop received,
  not the (further advanced) live one. Over the toolkit's datasets
  (loaders._pinned) that state names the data read, and a state of other
  data is refused when the loader is built (StateMismatchError).

  A loop that stops early (`break`) and iterates again continues after the
  last batch it received: what torch_xla's thread read ahead is read again,
  never dropped, and a loop left (or a loader dropped) stops torch_xla's
  threads. An error reading the host dataset is raised in the loop once the
  batches before it are delivered (torch_xla's own thread would end the pass
  as if the data had run out). `close()` and `get_state()` may come from
  another thread or a signal handler (a preemption handler saving the state):
  a loop waiting meanwhile goes on from the last batch it received, and an
  interrupt (Ctrl-C) anywhere loses no batch.
  """

  def __init__(self, iter_dataset, device, state: dict | None, loader_prefetch_size: int = 8,
               device_prefetch_size: int = 4, **loader_kwargs):
    """Args:
      iter_dataset: an iterable whose iterator has get_state()/set_state() (a grain IterDataset)
        and yields dicts of numpy arrays.
      device: the XLA device.
      state: a get_state() of an earlier loader over the same dataset, to resume after it; None starts.
      loader_prefetch_size, device_prefetch_size: torch_xla ParallelLoader's queues (each at least 1).
      **loader_kwargs: passed to torch_xla's ParallelLoader too.

    Raises:
      ValueError: a prefetch size below 1 (torch_xla would hang, or end every pass at once).
      StateMismatchError: `state` names other data than `iter_dataset` reads (and it refuses those).
    """
    check_prefetch(loader_prefetch_size, device_prefetch_size)
    self._dataset, self._device = iter_dataset, device
    self._loader_kwargs = dict(loader_kwargs, loader_prefetch_size=loader_prefetch_size,
                               device_prefetch_size=device_prefetch_size)
    self._iter = iter(iter_dataset)
    if state is not None:
      self._iter.set_state(state)
    self._states: dict[int, dict] = {0: self._iter.get_state()}  # batches produced -> state after them
    self._produced = 0
    self._delivered = 0
    self._lock = threading.RLock()  # re-entrant: a signal handler may ask for the state while this thread holds it
    self._read_lock = threading.Lock()  # one reader of the host iterator at a time; a pass takes it over under it
    self._pass = 0  # the pass whose thread may read the host iterator; older threads stop before their next read
    self._parallel = None  # the ParallelLoader of the pass under way
    self._outcome: dict[int, object] = {}  # pass -> how its reading ended: _EXHAUSTED or the error raised

  def _host_batches(self, token: int):
    import torch

    while True:
      with self._read_lock:
        if token != self._pass:
          return  # a newer pass reads from here on
        try:
          batch = next(self._iter)
        except StopIteration:
          self._outcome[token] = _EXHAUSTED
          return
        except Exception as e:  # noqa: BLE001 - raised again in the loop's thread, after the batches before it
          self._outcome[token] = e
          return
        state = self._iter.get_state()
        with self._lock:
          self._produced += 1
          self._states[self._produced] = state
      yield {k: _tensor(torch, v) for k, v in batch.items()}

  def _start_pass(self) -> int:
    """Takes the host iterator over for a new pass, back at the last batch delivered; returns the pass."""
    with self._read_lock:  # no older thread is inside a read now, and none starts one
      self._pass += 1
      self._outcome.clear()  # how passes left unfinished (a break, a close) ended: nobody asks any more
      with self._lock:
        if self._produced != self._delivered:  # what older passes read ahead is read again
          self._iter.set_state(self._states[self._delivered])
        self._states = {self._delivered: self._states[self._delivered]}
        self._produced = self._delivered
      return self._pass

  def __iter__(self):
    from torch_xla.distributed.parallel_loader import ParallelLoader

    while True:
      token = self._start_pass()
      self._stop_parallel()
      parallel = None
      try:
        parallel = self._parallel = ParallelLoader(_TorchBatches(self, token), [self._device], **self._loader_kwargs)
        for batch in parallel.per_device_loader(self._device):
          with self._lock:
            self._delivered += 1
            for k in [k for k in self._states if k < self._delivered]:
              del self._states[k]
          yield batch
      finally:  # the loop ended, broke off or was dropped: torch_xla's threads stop
        if parallel is not None:
          parallel.close()
      outcome = self._outcome.pop(token, None)
      if outcome is _EXHAUSTED:
        return
      if outcome is not None:
        raise outcome
      # closed while the loop waited: go on from the last batch it received

  def _stop_parallel(self) -> None:
    parallel, self._parallel = self._parallel, None
    if parallel is not None:
      parallel.close()

  @property
  def identity(self):
    """The data read (a loaders._pinning.DataIdentity), or None over a dataset that does not name it."""
    return getattr(self._dataset, "identity", None)

  def close(self) -> None:
    """Stops torch_xla's reading thread and releases the dataset's lease (when it has `close()`); idempotent.
    A loop that iterates on reads on from the last batch it received."""
    self._stop_parallel()
    close = getattr(self._dataset, "close", None)
    if close is not None:
      close()

  def get_state(self) -> dict[str, Any]:
    """Where to resume so that the next batch is the one after the last batch received.

    Returns:
      A JSON-able dict for `state=` of a new loader over the same dataset.
    """
    with self._lock:
      return dict(self._states[self._delivered])


def check_prefetch(loader_prefetch_size: int, device_prefetch_size: int) -> None:
  """Refuses a torch_xla queue size below 1 (torch_xla would hang, or end every pass at once).

  Raises:
    ValueError: a size below 1.
  """
  for name, size in (("loader_prefetch_size", loader_prefetch_size), ("device_prefetch_size", device_prefetch_size)):
    if size < 1:
      raise ValueError(f"{name} must be >= 1, got {size}")


_EXHAUSTED = object()  # a pass read the host dataset to its end

# What XLA cannot hold as it is: unsigned types wider than a byte arrive signed (uint16 50000 as -15536).
_WIDER = {np.dtype(np.uint16): np.int32, np.dtype(np.uint32): np.int64, np.dtype(np.uint64): np.int64}


def _tensor(torch, value: np.ndarray):
  """A torch tensor sharing `value`'s memory; bfloat16 (ml_dtypes, unknown to torch.from_numpy) by its bits;
  uint16 and uint32 widened to int32 and int64, uint64 to int64 (a value past 2**63 - 1 is refused).

  Raises:
    ValueError: a uint64 value that int64 cannot hold.
  """
  value = np.ascontiguousarray(value)
  if value.dtype.name == "bfloat16":
    return torch.from_numpy(value.view(np.int16)).view(torch.bfloat16)
  if value.dtype == np.uint64 and value.size and int(value.max()) > np.iinfo(np.int64).max:
    raise ValueError("a uint64 value past 2**63 - 1, which XLA's int64 cannot hold")
  if value.dtype in _WIDER:
    return torch.from_numpy(value.astype(_WIDER[value.dtype]))
  return torch.from_numpy(value)


class _TorchBatches:
  """One pass's host batches, as torch_xla's ParallelLoader iterates them."""

  def __init__(self, owner: DeviceLoader, token: int):
    self._owner, self._token = owner, token

  def __iter__(self):
    return self._owner._host_batches(self._token)
