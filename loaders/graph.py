"""Graphs for training: a memory-mapped `.graphbin`, a static-shape neighbour sampler, and its feeders.

    graph = loaders.graph.load("gs://bucket/graphs/ogbn_products")   # fetched once, verified
    sampler = loaders.graph.NeighborSampler(graph, fanouts=[15, 10, 5], batch_size=1024,
                                            seed=0, shard_index=rank, shard_count=world)
    for batch in loaders.graph.grain_dataset(sampler, num_epochs=1):   # dicts of numpy arrays
      ...
    loader = loaders.graph.xla_loader(sampler, num_epochs=1)          # tensors on the XLA device
    state = loader.get_state()                                        # resume: xla_loader(..., state=state)

    mag = loaders.graph.load("gs://bucket/graphs/ogbn_mag")            # converted with --add_reverse_relations
    sampler = loaders.graph.HeteroNeighborSampler(mag, fanouts=[15, 10, 5], batch_size=1024)
    # per relation: fanouts={"cites": [15, 10, 5], "rev_writes": [10, 5, 5], "has_topic": [5, 5, 5]}

This is the public module; the graph file lives in loaders._graph_file, the
samplers in loaders._sampler (homogeneous) and loaders._hetero
(heterogeneous), both on the compiled kernel of loaders._kernel and the
feature gather of loaders._features. The feeders take either sampler. Threads only: `grain_dataset` prefetches with
grain's thread pool, and `xla_loader` moves its batches to the device with
loaders.xla's resumable DeviceLoader (torch_xla's MpDeviceLoader). grain and
torch_xla are imported only when those are called; this module never imports
TensorFlow.
"""

from __future__ import annotations

import numpy as np

from loaders._device import DeviceLoader
from loaders._graph_file import Graph, load
from loaders._hetero import HeteroBudgets, HeteroNeighborSampler, hetero_budgets
from loaders._sampler import Budgets, NeighborSampler, budgets

__all__ = ["Budgets", "Graph", "HeteroBudgets", "HeteroNeighborSampler", "NeighborSampler", "budgets",
           "grain_dataset", "hetero_budgets", "load", "xla_loader"]

Sampler = NeighborSampler | HeteroNeighborSampler


class _EpochSource:
  """grain RandomAccessDataSource over `num_epochs` epochs of a sampler (index → (epoch, batch))."""

  def __init__(self, sampler: Sampler, num_epochs: int):
    self._sampler, self._epochs = sampler, num_epochs

  def __len__(self) -> int:
    return len(self._sampler) * self._epochs

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    n = len(self._sampler)
    return self._sampler.batch(index % n, index // n)

  def __repr__(self) -> str:
    return f"NeighborSamplerSource(batches={len(self._sampler)}, epochs={self._epochs})"


def grain_dataset(sampler: Sampler, num_epochs: int = 1, num_threads: int = 4,
                  prefetch_buffer_size: int = 8):
  """A grain IterDataset of the sampler's batches, built by a pool of threads (never processes).

  Args:
    sampler: the batches of one epoch.
    num_epochs: epochs in a row (each reshuffles the seeds).
    num_threads: grain's reading threads.
    prefetch_buffer_size: batches read ahead.

  Returns:
    A grain IterDataset of dicts of numpy arrays; its iterator supports
    get_state()/set_state() for resuming.
  """
  import grain

  return grain.MapDataset.source(_EpochSource(sampler, num_epochs)).to_iter_dataset(
      grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size))


def xla_loader(sampler: Sampler, device=None, num_epochs: int = 1, num_threads: int = 4,
               state: dict | None = None, **kwargs) -> DeviceLoader:
  """The sampler's batches as dicts of tensors on the XLA device, resumable.

  Args:
    sampler: the batches of one epoch.
    device: the XLA device (default torch_xla.device()).
    num_epochs: epochs in a row.
    num_threads: grain's reading threads on the host.
    state: a get_state() of an earlier loader over the same sampler and epochs: continue after it.
    **kwargs: passed to torch_xla's MpDeviceLoader (loader_prefetch_size, device_prefetch_size, ...).

  Returns:
    A DeviceLoader (see loaders.xla): iterate it for batches; get_state() says where to resume.
  """
  import torch_xla

  return DeviceLoader(grain_dataset(sampler, num_epochs, num_threads), device or torch_xla.device(), state, **kwargs)
