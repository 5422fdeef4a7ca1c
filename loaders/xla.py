"""Shards → torch_xla's `MpDeviceLoader`: dicts of tensors on the XLA device.

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

from formats.outputs.integrity import Verify
from loaders import grain as grain_loader
from loaders._device import DeviceLoader

__all__ = ["DeviceLoader", "device_loader"]


def device_loader(path: str, split: str = "train", *, batch_size: int | None = None, device=None, shuffle: bool = True,
                  seed: int = 0, shard_index: int | None = None, shard_count: int | None = None,
                  num_epochs: int = 1, num_threads: int = 16, state: dict | None = None,
                  loader_prefetch_size: int = 8, device_prefetch_size: int = 4, verify: Verify = "sha256",
                  order: str = "global", global_batch_size: int | None = None, window_shards: int | None = None,
                  cache_limit_bytes: int | None = None, cache_dir: str | None = None, run_records: int | None = None,
                  lease: bool = True, on_new_data: str = "error", **example_options) -> DeviceLoader:
  """torch_xla batches of `path`'s `split` on the device: static shapes, drop_remainder, resumable.

  Args:
    path, split, batch_size, shuffle, seed, num_epochs, num_threads, verify, order,
      global_batch_size, window_shards, cache_limit_bytes, cache_dir, run_records, lease, on_new_data,
      **example_options: as in
      loaders.grain.dataset (order="global": a state resumes on any number of hosts with the same
      global batch; window_shards: stream a gs:// split through a bounded cache).
    device: the XLA device (default torch_xla.device()).
    shard_index, shard_count: this replica's share (default torch_xla.runtime's
      global_ordinal() and world_size()).
    state: a DeviceLoader.get_state() of an earlier loader with the same
      arguments: continue after the last batch it delivered. A state saved on
      other data raises StateMismatchError (on_new_data="error") or starts
      its epoch over on this data (on_new_data="restart_epoch").
    loader_prefetch_size, device_prefetch_size: torch_xla MpDeviceLoader's queues.

  Returns:
    A DeviceLoader: iterate it for dicts of tensors on the device.

  Raises:
    ValueError, NotAnOutputError, KeyError, CorruptRecordError: as in loaders.grain.dataset.
    StateMismatchError: `state` was saved on other data and on_new_data="error".
  """
  import torch_xla
  import torch_xla.runtime as xr

  device = device or torch_xla.device()
  shard_index = xr.global_ordinal() if shard_index is None else shard_index
  shard_count = xr.world_size() if shard_count is None else shard_count
  ds = grain_loader.dataset(path, split, batch_size=batch_size, shuffle=shuffle, seed=seed,
                            shard_index=shard_index, shard_count=shard_count, num_epochs=num_epochs,
                            drop_remainder=True, num_threads=num_threads, verify=verify, order=order,
                            global_batch_size=global_batch_size, window_shards=window_shards,
                            cache_limit_bytes=cache_limit_bytes, cache_dir=cache_dir, run_records=run_records,
                            lease=lease,
                            on_new_data=on_new_data, **example_options)
  return DeviceLoader(ds, device, state, loader_prefetch_size=loader_prefetch_size,
                      device_prefetch_size=device_prefetch_size)
