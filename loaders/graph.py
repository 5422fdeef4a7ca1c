"""Graphs for training: a memory-mapped `.graphbin`, a static-shape neighbour sampler, and its feeders.

    graph = loaders.graph.load("gs://bucket/graphs/ogbn_products")   # fetched once, verified
    sampler = loaders.graph.NeighborSampler(graph, fanouts=[15, 10, 5], batch_size=1024,
                                            seed=0, shard_index=rank, shard_count=world)
    for batch in loaders.graph.grain_dataset(sampler, num_epochs=1):   # dicts of numpy arrays
      ...
    loader = loaders.graph.xla_loader(sampler, num_epochs=1)          # tensors on the XLA device
    state = loader.get_state()                                        # resume: xla_loader(..., state=state)
    graph.pin.release()                                               # the lease (collection releases it too)

    mag = loaders.graph.load("gs://bucket/graphs/ogbn_mag")            # converted with --add_reverse_relations
    sampler = loaders.graph.HeteroNeighborSampler(mag, fanouts=[15, 10, 5], batch_size=1024)
    # per relation: fanouts={"cites": [15, 10, 5], "rev_writes": [10, 5, 5], "has_topic": [5, 5, 5]}

This is the public module; the graph file lives in loaders._graph_file, the
samplers in loaders._sampler (homogeneous) and loaders._hetero
(heterogeneous), both on the compiled kernel of loaders._kernel and the
feature gather of loaders._features. The feeders take either sampler. Threads only: `grain_dataset` prefetches with
grain's thread pool, and `xla_loader` moves its batches to the device with
loaders.xla's resumable DeviceLoader (torch_xla's ParallelLoader). grain and
torch_xla are imported only when those are called; this module never imports
TensorFlow.

`load` reads the output's manifest once and holds a lease on its generation
while the Graph lives (`graph.pin`, `graph.identity`); the feeders' states
name the graph (generation, manifest and file SHA-256) and the sampler's
seeds, and a state of another graph is refused (loaders._pinning).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from formats.storage import files
from formats.outputs.integrity import Verify
from formats.outputs.output import DEFAULT_CACHE_ROOT, Output, is_output
from loaders import _graph_file
from loaders._device import DeviceLoader
from loaders._graph_file import Graph
from loaders._hetero import HeteroBudgets, HeteroNeighborSampler, hetero_budgets
from loaders._pinning import PIN_ATTEMPTS, DataIdentity, StateGuard, pin_output
from loaders._sampler import Budgets, NeighborSampler, budgets
from loaders.options import GRAPH_DEFAULTS, Ordering, Reading, settings

__all__ = ["Budgets", "Graph", "HeteroBudgets", "HeteroNeighborSampler", "NeighborSampler", "budgets",
           "grain_dataset", "hetero_budgets", "load", "sampler_identity", "xla_loader"]

Sampler = NeighborSampler | HeteroNeighborSampler


def load(path: str, cache_dir: str | None = None, verify: Verify = "sha256", *, streams: int = 8,
         chunk_bytes: int = 32 << 20, progress: bool = True, lease: bool = True) -> Graph:
  """Opens a graph output (its folder, or the .graphbin in it), local or gs://, pinned to one generation.

  As loaders._graph_file.load (fetching, caching, verification), plus: the
  manifest is read once, the graph is the file that manifest lists, and with
  `lease` the generation is leased while the Graph lives (`graph.pin`;
  `graph.pin.release()` lets it go sooner). `graph.identity` names it.

      graph = load("gs://bucket/graphs/ogbn_products", streams=16)

  Args:
    path, cache_dir, verify, streams, chunk_bytes, progress: as loaders._graph_file.load.
    lease: hold a lease on the generation read (a read-only output logs one warning and loads without one).

  Returns:
    The mapped graph, with `pin` (None for a bare .graphbin) and `identity`.

  Raises:
    As loaders._graph_file.load.
  """
  folder, file_name = path, None
  if path.endswith(".graphbin"):
    folder = path.rsplit("/", 1)[0] if files.is_gcs(path) else os.path.dirname(path)
    file_name = os.path.basename(path)
    if not files.is_gcs(path) and not is_output(folder):  # a bare .graphbin: nothing to pin
      graph = _graph_file.load(path, cache_dir, verify, streams=streams, chunk_bytes=chunk_bytes, progress=progress)
      graph.pin, graph.identity = None, bare_identity(graph)
      return graph
  for _ in range(PIN_ATTEMPTS):
    pin = pin_output(folder, lease=lease, purpose="loaders.graph")
    infos = [f for f in pin.output.files
             if f.kind == "graphbin" and (file_name is None or os.path.basename(f.path) == file_name)]
    graph = _graph_file.load(path, cache_dir, verify, streams=streams, chunk_bytes=chunk_bytes, progress=progress)
    # _graph_file.load reads the manifest itself: keep its graph only if it is the file the pinned manifest lists
    if len(infos) == 1 and graph.path == _local_path(pin.output, infos[0], cache_dir):
      graph.pin, graph.identity = pin, pin.identity(None, infos[0])
      return graph
    pin.release()
  raise RuntimeError(f"{folder}: a new manifest was committed during each of {PIN_ATTEMPTS} loads; try again")


def _local_path(output: Output, info, cache_dir: str | None) -> str:
  """Where loaders._graph_file.load maps the graph `info` of `output` from: the file itself, or its gs:// cache."""
  src = output.shard_path(info)
  if not files.is_gcs(src):
    return src
  return files.cache_path(src, info.sha256, cache_dir or os.path.join(DEFAULT_CACHE_ROOT, "graphs"))


def bare_identity(graph: Graph) -> DataIdentity:
  """The identity of a graph no manifest lists (a bare .graphbin, or a Graph opened directly): its file's
  fingerprint (formats.graphbin.GraphBin.fingerprint) stands in for the manifest's digest, so that a state
  saved on it is refused on another graph at that path."""
  return DataIdentity(graph.path, None, None, None, os.path.basename(graph.path),
                      "sections:" + graph.bin.fingerprint())


def sampler_identity(sampler: Sampler) -> DataIdentity:
  """The data a sampler's batches come from: its graph's identity (`load`) and its seeds (`sampler.split`)."""
  graph = sampler.graph
  base = getattr(graph, "identity", None) or bare_identity(graph)
  return dataclasses.replace(base, split=sampler.split)


def sampler_order(sampler: Sampler) -> dict:
  """What fixes the seeds of each batch position, as a saved state records it (loaders._pinning.StateGuard):
  the order, the seed and the step (the global batch; with order="host", the host's batch and the host count)."""
  out = {"order": sampler.order, "seed": int(sampler.seed)}
  if sampler.order == "global":
    out["batch"] = sampler.batch_size * sampler.shard_count  # the same on any number of hosts
  else:
    out["batch"], out["hosts"] = sampler.batch_size, sampler.shard_count
  return out


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


def grain_dataset(sampler: Sampler, *, ordering: Ordering | None = None, reading: Reading | None = None,
                  **fields):
  """A grain IterDataset of the sampler's batches, built by a pool of threads (never processes).

  Args:
    sampler: the batches of one epoch (it holds its own seed, order and shard).
    ordering: of loaders.Ordering, num_epochs (epochs in a row, each reshuffling the seeds) and on_new_data
      (what set_state does with a state saved on another graph or other seeds).
    reading: host threads and read-ahead (loaders.Reading, or grain's ReadOptions; by default
      loaders.options.GRAPH_DEFAULTS': 4 threads, 8 batches ahead).
    **fields: those fields by name (num_epochs=2, num_threads=4).

  Returns:
    A grain IterDataset of dicts of numpy arrays; its iterator supports
    get_state()/set_state() for resuming, and every state names the graph
    and the seeds (`sampler_identity`).

  Raises:
    ValueError, TypeError: a bad setting, or one the sampler holds (seed, order, shard: set them on it).
  """
  import grain

  from loaders._pinned import PinnedMapDataset

  s = settings("loaders.graph.grain_dataset (the sampler holds its seed, order and shard)", ordering=ordering,
               reading=reading, read=("num_epochs", "on_new_data", "reading"), defaults=GRAPH_DEFAULTS, **fields)
  source = grain.MapDataset.source(_EpochSource(sampler, s.ordering.num_epochs))
  guard = StateGuard(sampler_identity(sampler), len(sampler), s.ordering.on_new_data, len(source),
                     order=sampler_order(sampler))
  threads = max(1, min(s.reading.num_threads, len(os.sched_getaffinity(0))))
  return PinnedMapDataset(source, guard, keep=(sampler,)).to_iter_dataset(
      grain.ReadOptions(num_threads=threads, prefetch_buffer_size=s.reading.prefetch_buffer_size))


def xla_loader(sampler: Sampler, device=None, *, state: dict | None = None, ordering: Ordering | None = None,
               reading: Reading | None = None, loader_prefetch_size: int = 8, device_prefetch_size: int = 4,
               **fields) -> DeviceLoader:
  """The sampler's batches as dicts of tensors on the XLA device, resumable.

  Args:
    sampler: the batches of one epoch.
    device: the XLA device (default torch_xla.device()).
    state: a get_state() of an earlier loader over the same sampler and epochs: continue after it.
    ordering, reading, **fields: as in `grain_dataset`.
    loader_prefetch_size, device_prefetch_size: torch_xla ParallelLoader's queues.

  Returns:
    A DeviceLoader (see loaders.xla): iterate it for batches; get_state() says where to resume.

  Raises:
    StateMismatchError: `state` was saved on another graph or other seeds and on_new_data="error".
  """
  import torch_xla

  return DeviceLoader(grain_dataset(sampler, ordering=ordering, reading=reading, **fields),
                      device or torch_xla.device(), state, loader_prefetch_size=loader_prefetch_size,
                      device_prefetch_size=device_prefetch_size)
