"""Shards → torch_xla's `ParallelLoader` (what `MpDeviceLoader` wraps): dicts of tensors on the XLA device.

    loader = loaders.xla.device_loader("gs://bucket/imagenet", "train", batch_size=128,
                                       image_size=(224, 224))
    for batch in loader:          # batch["image"]: uint8 [128, 224, 224, 3] on xla:0
      ...
    state = loader.get_state()    # resume: device_loader(..., state=state); names the data it was saved on
    loader.close()                # the lease on the generation read goes (collection does it too)

Host-side reading is loaders.grain's thread pool; torch_xla's loader moves
batches to the device in its own background thread. Shard index and count
default to `torch_xla.runtime.global_ordinal()` / `world_size()`. This module
never imports TensorFlow (it cannot share a process with torch_xla).
"""

from __future__ import annotations

import dataclasses

from loaders import grain as grain_loader
from loaders._device import DeviceLoader, check_prefetch
from loaders.options import ExampleOptions, Fetching, Ordering, Reading, Sharding, settings

__all__ = ["DeviceLoader", "device_loader"]


def device_loader(path: str, split: str = "train", *, batch_size: int | None = None,
                  global_batch_size: int | None = None, ordering: Ordering | None = None,
                  sharding: Sharding | None = None, fetching: Fetching | None = None,
                  example: ExampleOptions | None = None, reading: Reading | None = None, device=None,
                  state: dict | None = None, loader_prefetch_size: int = 8, device_prefetch_size: int = 4,
                  **fields) -> DeviceLoader:
  """torch_xla batches of `path`'s `split` on the device: static shapes, drop_remainder, resumable.

  Args:
    path, split, batch_size, global_batch_size, ordering, fetching, example, reading, **fields: as in
      loaders.grain.dataset (with order="global", the default, a state resumes on any number of hosts
      with the same global batch).
    sharding: this replica's share (loaders.Sharding or grain's ShardOptions); what it leaves None is
      torch_xla.runtime's global_ordinal() and world_size().
    device: the XLA device (default torch_xla.device()).
    state: a DeviceLoader.get_state() of an earlier loader with the same settings: continue after the
      last batch it delivered. A state saved on other data raises StateMismatchError
      (on_new_data="error") or starts its epoch over on this data (on_new_data="restart_epoch").
    loader_prefetch_size, device_prefetch_size: torch_xla ParallelLoader's queues.

  Returns:
    A DeviceLoader: iterate it for dicts of tensors on the device.

  Raises:
    ValueError, TypeError, NotAnOutputError, KeyError, CorruptRecordError: as in loaders.grain.dataset;
      drop_remainder=False is refused (torch_xla needs every batch whole), and a prefetch size below 1.
    StateMismatchError: `state` was saved on other data and on_new_data="error".
  """
  import torch_xla
  import torch_xla.runtime as xr

  check_prefetch(loader_prefetch_size, device_prefetch_size)
  s = settings("loaders.xla.device_loader", ordering=ordering, sharding=sharding, fetching=fetching,
               example=example, reading=reading, **fields)
  if not s.ordering.drop_remainder:
    raise ValueError("loaders.xla reads whole batches only: drop_remainder must be True")
  index, count = s.sharding.resolve(xr.global_ordinal(), xr.world_size())
  s = dataclasses.replace(s, sharding=Sharding(index, count))
  device = device or torch_xla.device()
  ds = grain_loader.dataset(path, split, batch_size=batch_size, global_batch_size=global_batch_size, **s.groups())
  try:
    return DeviceLoader(ds, device, state, loader_prefetch_size=loader_prefetch_size,
                        device_prefetch_size=device_prefetch_size)
  except BaseException:
    ds.close()  # a refused state: the lease goes now
    raise
