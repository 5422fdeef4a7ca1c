"""Graphs for training: a memory-mapped `.graphbin` and a static-shape neighbour sampler.

    graph = loaders.graph.load("gs://bucket/graphs/ogbn_products")   # fetched once, verified
    sampler = loaders.graph.NeighborSampler(graph, fanouts=[15, 10, 5], batch_size=1024,
                                            seed=0, shard_index=rank, shard_count=world)
    for batch in loaders.graph.grain_dataset(sampler, num_epochs=1):   # dicts of numpy arrays
      ...

Sampling is uniform with replacement and a fixed fanout per hop, vectorised
over the whole frontier (no Python loop per node). Nodes found at each hop
are de-duplicated and relabelled to local ids: the seeds are local ids
0..B-1, then each hop's new nodes. Every batch has the same shapes: each hop
has a fixed budget of frontier nodes and edges (padded, with masks), so XLA
compiles once. A node without neighbours yields masked padding edges.
Threads only: `grain_dataset` prefetches with grain's thread pool; `xla_loader`
wraps torch_xla's `MpDeviceLoader`. This module never imports TensorFlow.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import dataclasses
import math
import os
import threading

import numpy as np

from formats import files
from formats.graphbin import GraphBin
from formats.manifest import MANIFEST_FILENAME, Manifest
from loaders._verify import Verify, check_local_file, verify_level

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tpu_shards", "graphs")


class Graph:
  """A .graphbin opened for reading: arrays are read-only views of the mapped file."""

  def __init__(self, path: str, verify: bool = True):
    self.path = path
    self.bin = GraphBin(path, verify=verify)
    self.meta = self.bin.meta
    self.num_nodes: int = int(sum(self.meta.get("num_nodes", {}).values()))
    self.indptr = self.bin["indptr"] if "indptr" in self.bin else None
    self.indices = self.bin["indices"] if "indices" in self.bin else None
    self.node_features = self.bin["node/feat"] if "node/feat" in self.bin else None
    self.labels = self.bin["node/label"] if "node/label" in self.bin else None

  @property
  def num_edges(self) -> int:
    return 0 if self.indices is None else len(self.indices)

  @property
  def splits(self) -> dict[str, np.ndarray]:
    """{"<split name>/<train|valid|test>[/<key>]": ids}, e.g. {"time/train": ...}."""
    return {n[len("split/"):]: self.bin[n] for n in self.bin.names("split/")}

  def split(self, part: str = "train") -> np.ndarray:
    """The ids of `part` ("train", "valid", "test"); the data set's split name may be omitted."""
    matches = [v for k, v in self.splits.items() if k == part or k.endswith("/" + part)]
    if len(matches) != 1:
      raise KeyError(f"{self.path}: split {part!r} matches {len(matches)} of {sorted(self.splits)}")
    return matches[0]

  def relation(self, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(indptr, indices) of one relation of a heterogeneous graph ("paper___cites___paper")."""
    return self.bin[f"rel/{name}/indptr"], self.bin[f"rel/{name}/indices"]

  @property
  def node_type_offsets(self) -> dict[str, int]:
    """Heterogeneous graphs: global id = offset of the type + id within the type."""
    counts = self.meta.get("num_nodes", {})
    out, acc = {}, 0
    for t in sorted(counts):
      out[t], acc = acc, acc + counts[t]
    return out


def load(path: str, cache_dir: str | None = None, verify: Verify = "sha256") -> Graph:
  """Opens a graph output (its folder, or the .graphbin itself), local or gs://.

  A gs:// graph is downloaded once into `cache_dir` (default ~/.cache/tpu_shards/graphs)
  and its SHA-256 checked against the manifest; later loads reuse the verified copy.
  A local graph is checked at level `verify`: "sha256" (default; once per file per
  process, or every section's CRC when there is no manifest), "size" or "none".
  """
  level = verify_level(verify)
  folder, file_name = path, None
  if path.endswith(".graphbin"):
    folder, file_name = path.rsplit("/", 1)[0] if files.is_gcs(path) else os.path.dirname(path), os.path.basename(path)
  manifest_path = files.join(folder, MANIFEST_FILENAME)
  manifest = Manifest.loads(files.read_bytes(manifest_path)) if files.exists(manifest_path) else None
  if manifest is None and files.is_gcs(path):
    raise FileNotFoundError(f"{manifest_path} not found: {folder} is not a complete graph output")
  info = None
  if manifest is not None:
    blobs = [f for f in manifest.files
             if f.kind == "graphbin" and (file_name is None or os.path.basename(f.path) == file_name)]
    if len(blobs) != 1:
      raise FileNotFoundError(f"{manifest_path} lists no graph {file_name or ''}".rstrip())
    info = blobs[0]
    file_name = info.path
  if not files.is_gcs(folder):
    local = os.path.join(folder, file_name)
    if info is None:
      return Graph(local, verify=level == "sha256")
    check_local_file(local, info.num_bytes, info.sha256, level)
    return Graph(local, verify=False)
  marker = os.path.join(cache_dir or DEFAULT_CACHE, info.sha256[:16], os.path.basename(file_name) + ".sections-verified")
  local = files.cached_copy(files.join(folder, file_name), info.sha256, cache_dir or DEFAULT_CACHE)
  if not os.path.exists(marker):
    Graph(local, verify=True)  # every section's CRC, once
    open(marker, "w").close()
  return Graph(local, verify=False)


@dataclasses.dataclass(frozen=True)
class Budgets:
  """Static sizes of a batch: frontier nodes and edges per hop."""

  frontier: tuple[int, ...]  # nodes whose neighbours are sampled at hop i (hop 0: the seeds)
  edges: tuple[int, ...]  # frontier[i] * fanouts[i]
  nodes: int  # all local nodes: seeds + every hop's new nodes


def budgets(batch_size: int, fanouts: Sequence[int], num_nodes: int, node_budget: int | None = None) -> Budgets:
  """Worst-case static sizes; `node_budget` caps the local nodes (a batch that needs more raises)."""
  frontier = [batch_size]
  for k in fanouts[:-1]:
    frontier.append(min(num_nodes, frontier[-1] * k))
  edges = tuple(f * k for f, k in zip(frontier, fanouts))
  new_last = min(num_nodes, frontier[-1] * fanouts[-1])
  nodes = min(num_nodes + batch_size, sum(frontier) + new_last)
  if node_budget is not None:
    if node_budget < batch_size:
      raise ValueError(f"node_budget {node_budget} is smaller than batch_size {batch_size}")
    nodes = min(nodes, node_budget)
  return Budgets(tuple(frontier), edges, nodes)


class NeighborSampler:
  """Fixed-fanout uniform neighbour sampling over the seed nodes of a split.

  `sampler[i]` (or `sampler.batch(i, epoch)`) is batch i of an epoch: a dict of
  numpy arrays with the same shapes for every i:

    seeds [B] int64, seed_mask [B] bool            the batch's seed nodes (padding masked)
    node_ids [Nb] int64, node_mask [Nb] bool       global id of each local node
    x [Nb, F], y [B, ...]                          features of all local nodes, labels of the seeds
    edge_index_<h> [2, E_h] int32, edge_mask_<h>   hop h: row 0 the sampled neighbour, row 1 the
                                                   frontier node it was sampled for (local ids)
  Deterministic for (seed, epoch, i); seeds are reshuffled every epoch and split
  disjointly over `shard_count` shards, each with the same number of batches.
  With gather_features=False the batch has no `x`: gather on the accelerator from
  a feature table kept there (the host then moves ids, not features).
  `node_budget` shrinks the node dimension below the worst case (x is
  node_budget x F); a batch that would need more raises instead of truncating.
  """

  def __init__(self, graph: Graph, fanouts: Sequence[int] = (15, 10, 5), batch_size: int = 1024,
               seed: int = 0, shard_index: int = 0, shard_count: int = 1, split: str = "train",
               seed_nodes: np.ndarray | None = None, gather_features: bool = True,
               node_budget: int | None = None):
    if not fanouts or any(int(k) < 1 for k in fanouts):
      raise ValueError(f"fanouts must be positive integers, got {list(fanouts)}")
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= shard_index < shard_count:
      raise ValueError(f"shard_index {shard_index} is outside [0, {shard_count})")
    if graph.indptr is None:
      raise ValueError(f"{graph.path} has no homogeneous CSR (indptr/indices) to sample from")
    self.graph = graph
    self.fanouts = tuple(int(k) for k in fanouts)
    self.batch_size = batch_size
    self.seed, self.shard_index, self.shard_count = seed, shard_index, shard_count
    self.gather_features = gather_features and graph.node_features is not None
    self.seed_nodes = np.asarray(graph.split(split) if seed_nodes is None else seed_nodes, np.int64)
    self.per_shard = len(self.seed_nodes) // shard_count  # equal on every shard: XLA needs it
    self.num_batches = math.ceil(self.per_shard / batch_size) if self.per_shard else 0
    self.budgets = budgets(batch_size, self.fanouts, graph.num_nodes, node_budget)
    # plain ndarray views of the mapping: fancy indexing skips memmap.__getitem__
    self._indptr = np.asarray(graph.indptr)
    self._indices = np.asarray(graph.indices)
    self._features = np.asarray(graph.node_features) if graph.node_features is not None else None
    self._labels = np.asarray(graph.labels) if graph.labels is not None else None
    self._id = np.dtype(np.int32) if graph.num_nodes < 2**31 - 1 else np.dtype(np.int64)
    self._unknown = np.iinfo(self._id).max
    self._local = threading.local()  # per thread: global id -> local id table, reset after each batch
    self._epoch_cache: tuple[int, np.ndarray] | None = None
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return self.num_batches

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return self.batch(index)

  def shard_seeds(self, epoch: int) -> np.ndarray:
    """This shard's seeds for `epoch`: a seeded permutation, every shard a disjoint slice."""
    with self._lock:
      if self._epoch_cache is None or self._epoch_cache[0] != epoch:
        perm = np.random.default_rng([self.seed, epoch, 0x5EED]).permutation(len(self.seed_nodes))
        mine = perm[self.shard_index:self.shard_count * self.per_shard:self.shard_count]
        self._epoch_cache = (epoch, self.seed_nodes[mine])
      return self._epoch_cache[1]

  def _table(self) -> np.ndarray:
    table = getattr(self._local, "table", None)
    if table is None:
      table = self._local.table = np.full(self.graph.num_nodes, self._unknown, self._id)
    return table

  def batch(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
    if not 0 <= index < self.num_batches:
      raise IndexError(f"batch {index} outside [0, {self.num_batches})")
    seeds = self.shard_seeds(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
    rng = np.random.default_rng([self.seed, epoch, index, self.shard_index])
    b, B, idt = self.budgets, self.batch_size, self._id
    table = self._table()
    indptr, indices = self._indptr, self._indices
    out: dict[str, np.ndarray] = {}
    node_ids = np.zeros(b.nodes, idt)
    node_ids[:len(seeds)] = seeds
    table[seeds] = np.arange(len(seeds), dtype=idt)
    num_local = B  # seeds own local ids 0..B-1 (padding included)
    f_lo, f_hi = 0, len(seeds)  # the frontier is a contiguous range of local ids
    try:
      for hop, k in enumerate(self.fanouts):
        fglobal = node_ids[f_lo:f_hi]
        start = indptr[fglobal]
        deg = indptr[fglobal + 1] - start
        pos = (start[:, None] + (rng.random((len(fglobal), k), dtype=np.float32) * deg[:, None]).astype(np.int64))
        pos = pos.reshape(-1)
        has = deg > 0
        valid = None if has.all() else np.repeat(has, k)
        if valid is not None:
          np.minimum(pos, max(len(indices) - 1, 0), out=pos)
        nbr = indices[pos].astype(idt, copy=False) if len(indices) else np.zeros(len(pos), idt)
        loc = table[nbr]
        new = loc == self._unknown
        if valid is not None:
          new &= valid
        cand = nbr[new]
        order = np.arange(len(cand), dtype=idt)
        np.minimum.at(table, cand, order)  # the first occurrence of each new node wins
        new_global = cand[table[cand] == order]
        n_new = len(new_global)
        if num_local + n_new > b.nodes:  # only with a node_budget below the worst case
          raise RuntimeError(f"batch {index}, hop {hop}: {num_local + n_new} local nodes exceed "
                             f"node_budget={b.nodes}; raise it (the worst case is "
                             f"{budgets(B, self.fanouts, self.graph.num_nodes).nodes})")
        table[new_global] = np.arange(num_local, num_local + n_new, dtype=idt)
        loc[new] = table[cand]
        node_ids[num_local:num_local + n_new] = new_global
        e_budget, n_e = b.edges[hop], len(nbr)
        edge_index = np.zeros((2, e_budget), np.int32)
        edge_index[0, :n_e] = loc if valid is None else np.where(valid, loc, 0)
        edge_index[1, :n_e] = np.repeat(np.arange(f_lo, f_hi, dtype=np.int32), k)
        edge_mask = np.zeros(e_budget, bool)
        edge_mask[:n_e] = True if valid is None else valid
        out[f"edge_index_{hop}"], out[f"edge_mask_{hop}"] = edge_index, edge_mask
        next_budget = b.frontier[hop + 1] if hop + 1 < len(self.fanouts) else n_new
        f_lo, f_hi = num_local, num_local + min(n_new, next_budget)
        num_local += n_new
    finally:
      table[node_ids[:len(seeds)]] = self._unknown
      table[node_ids[B:num_local]] = self._unknown
    node_mask = np.zeros(b.nodes, bool)
    node_mask[:len(seeds)] = True
    node_mask[B:num_local] = True
    ids = np.zeros(b.nodes, np.int64)
    ids[:len(seeds)] = node_ids[:len(seeds)]
    ids[B:num_local] = node_ids[B:num_local]
    out["seeds"] = ids[:B].copy()
    out["seed_mask"] = node_mask[:B].copy()
    out["node_ids"], out["node_mask"] = ids, node_mask
    if self.gather_features:
      feats = self._features
      x = np.empty((b.nodes, feats.shape[1]), feats.dtype)
      x[len(seeds):B] = 0
      x[num_local:] = 0
      np.take(feats, node_ids[:len(seeds)], axis=0, out=x[:len(seeds)], mode="clip")
      np.take(feats, node_ids[B:num_local], axis=0, out=x[B:num_local], mode="clip")
      out["x"] = x
    if self._labels is not None:
      y = np.zeros((B, *self._labels.shape[1:]), self._labels.dtype)
      y[:len(seeds)] = self._labels[seeds]
      out["y"] = y
    return out

  def epoch(self, epoch: int = 0) -> Iterator[dict[str, np.ndarray]]:
    for i in range(self.num_batches):
      yield self.batch(i, epoch)


class _EpochSource:
  """grain RandomAccessDataSource over `num_epochs` epochs of a sampler (index → (epoch, batch))."""

  def __init__(self, sampler: NeighborSampler, num_epochs: int):
    self._sampler, self._epochs = sampler, num_epochs

  def __len__(self) -> int:
    return len(self._sampler) * self._epochs

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    n = len(self._sampler)
    return self._sampler.batch(index % n, index // n)

  def __repr__(self) -> str:
    return f"NeighborSamplerSource(batches={len(self._sampler)}, epochs={self._epochs})"


def grain_dataset(sampler: NeighborSampler, num_epochs: int = 1, num_threads: int = 4,
                  prefetch_buffer_size: int = 8):
  """A grain IterDataset of batches, built by a pool of threads (never processes).

  Its iterator supports get_state()/set_state() for resuming.
  """
  import grain

  return grain.MapDataset.source(_EpochSource(sampler, num_epochs)).to_iter_dataset(
      grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size))


def xla_loader(sampler: NeighborSampler, device=None, num_epochs: int = 1, num_threads: int = 4, **kwargs):
  """A torch_xla MpDeviceLoader yielding dicts of tensors on the XLA device."""
  import torch
  import torch_xla
  from torch_xla.distributed.parallel_loader import MpDeviceLoader

  device = device or torch_xla.device()

  class _Tensors:
    def __iter__(self):
      for batch in grain_dataset(sampler, num_epochs, num_threads):
        yield {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}

  return MpDeviceLoader(_Tensors(), device, **kwargs)
