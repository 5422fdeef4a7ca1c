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
  never dropped. An error reading the host dataset is raised in the loop once
  the batches before it are delivered (torch_xla's own thread would end the
  pass as if the data had run out).
  """

  def __init__(self, iter_dataset, device, state: dict | None, **loader_kwargs):
    """Args:
      iter_dataset: an iterable whose iterator has get_state()/set_state() (a grain IterDataset)
        and yields dicts of numpy arrays.
      device: the XLA device.
      state: a get_state() of an earlier loader over the same dataset, to resume after it; None starts.
      **loader_kwargs: passed to torch_xla's ParallelLoader (loader_prefetch_size, device_prefetch_size, ...).

    Raises:
      StateMismatchError: `state` names other data than `iter_dataset` reads (and it refuses those).
    """
    self._dataset, self._device, self._loader_kwargs = iter_dataset, device, loader_kwargs
    self._iter = iter(iter_dataset)
    if state is not None:
      self._iter.set_state(state)
    self._states: dict[int, dict] = {0: self._iter.get_state()}  # batches produced -> state after them
    self._produced = 0
    self._delivered = 0
    self._lock = threading.Lock()
    self._parallel = None  # the ParallelLoader of the pass under way
    self._error: Exception | None = None  # what reading the host dataset raised in this pass

  def _host_batches(self):
    import torch

    try:
      for batch in self._iter:
        state = self._iter.get_state()
        with self._lock:
          self._produced += 1
          self._states[self._produced] = state
        yield {k: _tensor(torch, v) for k, v in batch.items()}
    except Exception as e:  # noqa: BLE001 - raised again in the loop's thread, after the batches before it
      self._error = e

  def __iter__(self):
    from torch_xla.distributed.parallel_loader import ParallelLoader

    if self._parallel is not None:  # an earlier pass: its thread stops, and reading goes on after the last delivered
      self._parallel.close()
      with self._lock:
        self._states = {self._delivered: self._states[self._delivered]}
        self._produced = self._delivered
      self._iter.set_state(self._states[self._delivered])
      self._error = None
    self._parallel = ParallelLoader(_TorchBatches(self), [self._device], **self._loader_kwargs)
    for batch in self._parallel.per_device_loader(self._device):
      with self._lock:
        self._delivered += 1
        for k in [k for k in self._states if k < self._delivered]:
          del self._states[k]
      yield batch
    if self._error is not None:
      raise self._error

  @property
  def identity(self):
    """The data read (a loaders._pinning.DataIdentity), or None over a dataset that does not name it."""
    return getattr(self._dataset, "identity", None)

  def close(self) -> None:
    """Stops torch_xla's reading thread and releases the dataset's lease (when it has `close()`); idempotent."""
    if self._parallel is not None:
      self._parallel.close()
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


def _tensor(torch, value: np.ndarray):
  """A torch tensor sharing `value`'s memory; bfloat16 (ml_dtypes, unknown to torch.from_numpy) by its bits."""
  value = np.ascontiguousarray(value)
  if value.dtype.name == "bfloat16":
    return torch.from_numpy(value.view(np.int16)).view(torch.bfloat16)
  return torch.from_numpy(value)


class _TorchBatches:
  def __init__(self, owner: DeviceLoader):
    self._owner = owner

  def __iter__(self):
    return self._owner._host_batches()
