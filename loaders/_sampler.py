"""Fixed-fanout uniform neighbour sampling with static shapes: `NeighborSampler` and its budgets. No framework.

Sampling is uniform with replacement and a fixed fanout per hop, in the
compiled kernel of loaders._kernel (numba, GIL released: sampler threads run
in parallel). Nodes found at each hop are de-duplicated and relabelled to
local ids: the seeds are local ids 0..B-1, then each hop's new nodes in order
of first draw. Every batch has the same shapes: each hop has a fixed budget of
frontier nodes and edges (padded, with masks), so XLA compiles once. A node
without neighbours yields masked padding edges. The draws of a batch come from
a counter-based random stream keyed by (seed, epoch, batch, shard, hop): a
batch is the same whichever thread samples it, in whatever order.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import math
import threading

import numpy as np

from formats.graphbin import index_dtype
from loaders._graph_file import Graph
from loaders._order import SeedOrder, per_host_batch_size, seeds_name


@dataclasses.dataclass(frozen=True)
class Budgets:
  """Static sizes of a batch: frontier nodes and edges per hop."""

  frontier: tuple[int, ...]  # nodes whose neighbours are sampled at hop i (hop 0: the seeds)
  edges: tuple[int, ...]  # frontier[i] * fanouts[i]
  nodes: int  # all local nodes: seeds + every hop's new nodes


def budgets(batch_size: int, fanouts: Sequence[int], num_nodes: int, node_budget: int | None = None) -> Budgets:
  """Worst-case static sizes of a batch.

  Args:
    batch_size: seeds per batch.
    fanouts: neighbours sampled per frontier node at each hop.
    num_nodes: nodes in the graph (no hop finds more).
    node_budget: caps the local nodes below the worst case (a batch that needs more raises), and
      with them the frontier and edges of every hop after the first.

  Returns:
    The frontier, edge and node budgets.

  Raises:
    ValueError: `node_budget` is smaller than `batch_size`.
  """
  if node_budget is not None and node_budget < batch_size:
    raise ValueError(f"node_budget {node_budget} is smaller than batch_size {batch_size}")
  # the nodes one hop finds are at most the graph's, and with a node budget at most what it leaves
  # after the seeds: so are the next hop's frontier and its edges
  most_new = num_nodes if node_budget is None else min(num_nodes, node_budget - batch_size)
  frontier = [batch_size]
  for k in fanouts[:-1]:
    frontier.append(min(most_new, frontier[-1] * k))
  edges = tuple(f * k for f, k in zip(frontier, fanouts))
  new_last = min(num_nodes, frontier[-1] * fanouts[-1])
  nodes = min(num_nodes + batch_size, sum(frontier) + new_last)
  if node_budget is not None:
    nodes = min(nodes, node_budget)
  return Budgets(tuple(frontier), edges, nodes)


class SeedSampler:
  """What both neighbour samplers share: a SeedOrder's batches by index, per-thread work space, labels.

  A subclass prepares its arrays and calls `_set_order`, and defines `_new_work` (one thread's
  global -> local tables, local -> global ids and kernel scratch), `_sample_hops` (every hop of one
  batch: its edge arrays, local -> global ids and the local ids used) and `_fill` (the batch's node
  arrays and features). It sets `_labels` (the seeds' labels, or None) and `_pools`.
  """

  def _set_order(self, graph: Graph, order: SeedOrder, split: str | None) -> None:
    """Samples the seeds of `order` from `graph`; `split` names them in saved states (None: by their digest)."""
    self.graph, self._order = graph, order
    self.seed_nodes, self.batch_size = order.seed_nodes, order.batch_size
    self.seed, self.shard_index, self.shard_count = order.seed, order.shard_index, order.shard_count
    self.order, self.per_shard, self.num_batches = order.order, order.per_shard, order.num_batches
    self.split = seeds_name(order.seed_nodes) if split is None else split
    self._local = threading.local()  # per thread: the work space of `_new_work`

  def __len__(self) -> int:
    return self.num_batches

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return self.batch(index)

  def shard_seeds(self, epoch: int) -> np.ndarray:
    """This host's seeds for one epoch, in batch order.

    Args:
      epoch: the epoch (each has its own seeded permutation).

    Returns:
      order="host": a disjoint slice of the permuted seeds, `per_shard` long on every host;
      order="global": this host's slice of every global step.
    """
    return self._order.shard_seeds(epoch)

  def batch(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
    """Batch `index` of `epoch`, a pure function of (seed, shard, epoch, index).

    Args:
      index: the batch within the epoch, 0 <= index < len(self).
      epoch: the epoch.

    Returns:
      The batch's numpy arrays (keys and shapes in the class docstring).

    Raises:
      IndexError: `index` is outside the epoch.
      RuntimeError: the batch needs more local nodes (of a type) than its node budget.
    """
    seeds = self._order.batch(index, epoch)
    out, node_ids, num_local = self._sample_hops(seeds, epoch, index)
    self._fill(out, len(seeds), node_ids, num_local)
    if self._labels is not None:
      y = np.zeros((self.batch_size, *self._labels.shape[1:]), self._labels.dtype)  # zeros in the padding
      y[:len(seeds)] = self._labels[seeds]
      out["y"] = y
    return out

  def _work(self):
    """This thread's work space (`_new_work`), made on its first batch and reused by every later one."""
    work = getattr(self._local, "work", None)
    if work is None:
      work = self._local.work = self._new_work()
    return work

  def _live(self, n_seeds: int, num_local: int, seed_type: bool = True) -> list[tuple[int, int]]:
    """The local ids in use: the seeds' and, after their padding, the hops' (seed type); else 0..num_local."""
    return [(0, n_seeds), (self.batch_size, num_local)] if seed_type else [(0, num_local)]

  def _draw(self, keys: tuple[str, str], f_lo: int, f_hi: int, fanout: int,
            out: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The edge arrays of one relation-hop from pools `keys`, put in `out`; the kernel fills every entry."""
    drawn = [(0, (f_hi - f_lo) * fanout)]
    if drawn[0][1] > self._pools[keys[1]].shape[0]:  # never: the budgets bound every frontier (the kernel
      raise AssertionError(f"{keys[0]}: {f_hi - f_lo} frontier nodes exceed the budget")  # has no bounds checks)
    out[keys[0]], out[keys[1]] = self._pools[keys[0]].take(drawn), self._pools[keys[1]].take(drawn)
    return out[keys[0]], out[keys[1]]

  def _local_nodes(self, keys: tuple[str, str], node_ids: np.ndarray,
                   live: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Every local node's global id as int64 (0 in the padding) and the mask of live ones, from pools `keys`."""
    ids, mask = self._pools[keys[0]].take(live), self._pools[keys[1]].take(live)
    for lo, hi in live:
      ids[lo:hi] = node_ids[lo:hi]
      mask[lo:hi] = True
    return ids, mask

  def _sampled_sizes(self, num_batches: int, epoch: int) -> list:
    """The local ids used (`_sample_hops`' third value) by `num_batches` batches spread over `epoch`."""
    picks = np.unique(np.linspace(0, max(self.num_batches - 1, 0), num_batches).astype(int))[:self.num_batches]
    return [self._sample_hops(self._order.batch(int(i), epoch), epoch, int(i))[2] for i in picks]


class NeighborSampler(SeedSampler):
  """Fixed-fanout uniform neighbour sampling over the seed nodes of a split.

  `sampler[i]` (or `sampler.batch(i, epoch)`) is batch i of an epoch: a dict of
  numpy arrays with the same shapes for every i:

    seeds [B] int64, seed_mask [B] bool            the batch's seed nodes (padding masked)
    node_ids [Nb] int64, node_mask [Nb] bool       global id of each local node
    x [Nb, F], y [B, ...]                          features of all local nodes, labels of the seeds
    edge_index_<h> [2, E_h] int32, edge_mask_<h>   hop h: row 0 the sampled neighbour, row 1 the
                                                   frontier node it was sampled for (local ids)
  Deterministic for (seed, epoch, i) whatever thread computes it; seeds are
  reshuffled every epoch and split disjointly over `shard_count` shards, each
  with the same number of batches: per host (order="host"), or as slices of
  global steps that do not depend on the host count (order="global", see
  loaders._order). With gather_features=False the batch has no
  `x`: gather on the accelerator from a feature table kept there (the host then
  moves ids, not features). `node_budget` shrinks the node dimension below the
  worst case (x is node_budget x F; `observed_node_budget` suggests one); a
  batch that would need more raises instead of truncating.

  `split` names the seeds in saved states: the split's name, or
  "seed_nodes:<sha256 prefix>" for explicit `seed_nodes`.

  `x` comes from a pool of reused buffers (loaders._features): it stays valid
  for as long as the caller holds it, and its memory is reused once nothing
  refers to it.
  """

  def __init__(self, graph: Graph, fanouts: Sequence[int] = (15, 10, 5), batch_size: int | None = None,
               seed: int = 0, shard_index: int = 0, shard_count: int = 1, split: str = "train",
               seed_nodes: np.ndarray | None = None, gather_features: bool = True,
               node_budget: int | None = None, feature_dtype=None, gather_threads: int = 1,
               in_memory: bool | None = None, order: str = "global", global_batch_size: int | None = None):
    """Prepares sampling over `split`'s seed nodes.

    Args:
      graph: a graph with a homogeneous CSR.
      fanouts: neighbours sampled per frontier node at each hop.
      batch_size: seeds per batch (default 1024, or global_batch_size / shard_count).
      seed: fixes the seed order of every epoch and every draw.
      shard_index, shard_count: this replica's disjoint share of the seeds.
      split: the graph's split whose ids are the seeds ("train", "valid", "test").
      seed_nodes: the seeds themselves, instead of `split`.
      gather_features: put node features (`x`) in the batch.
      node_budget: a node dimension below the worst case.
      feature_dtype: the dtype of `x` (default the file's); "bfloat16" halves the bytes gathered and moved.
      gather_threads: threads sharing each batch's feature gather.
      in_memory: copy the CSR and the features into process memory (default: when they take at most
        half of the available memory; False: always read through the memory-mapped file).
      order: "global" (the default: global step i takes the next batch_size × shard_count seeds and
        host h its slice: the seeds of a step do not depend on the host count, so a run resumes on
        another number of hosts; loaders._order) or "host" (each host's strided share of every epoch).
      global_batch_size: with order="global", the seeds per global step instead of batch_size (which
        becomes global_batch_size / shard_count).

    Raises:
      ValueError: a bad fanout, batch size, shard, node budget, thread count or order, a global batch
        the host count does not divide, seeds outside the graph, or a graph without a well-formed CSR.
      KeyError: the graph has no such split.
    """
    from loaders import _features

    if not fanouts or any(int(k) < 1 for k in fanouts):
      raise ValueError(f"fanouts must be positive integers, got {list(fanouts)}")
    batch_size = per_host_batch_size(batch_size, shard_count, order, global_batch_size, default=1024)
    if graph.indptr is None:
      raise ValueError(f"{graph.path} has no homogeneous CSR (indptr/indices) to sample from")
    seeds = np.asarray(graph.split(split) if seed_nodes is None else seed_nodes, np.int64)
    self._set_order(graph, SeedOrder(seeds, batch_size, seed, shard_index, shard_count, order),
                    split if seed_nodes is None else None)
    self.fanouts = tuple(int(k) for k in fanouts)
    self.gather_features = gather_features and graph.node_features is not None
    self.budgets = budgets(batch_size, self.fanouts, graph.num_nodes, node_budget)
    [(self._indptr, self._indices)] = _features.sampling_csrs(
        [(f"{graph.path} CSR", graph.indptr, graph.indices, graph.num_nodes, graph.num_nodes)], in_memory)
    _features.check_ids(self.seed_nodes, graph.num_nodes, "seed nodes")
    self._gather = (_features.FeatureGather(graph.node_features, self.budgets.nodes, feature_dtype,
                                            gather_threads, in_memory) if self.gather_features else None)
    self._labels = np.asarray(graph.labels) if graph.labels is not None else None
    # every array of a batch comes from a pool of reused ones (no page faults on fresh memory each batch)
    self._pools = dict(zip(("node_ids", "node_mask"), _features.node_pools(self.budgets.nodes)))
    for hop, e in enumerate(self.budgets.edges):
      self._pools.update(zip((f"edge_index_{hop}", f"edge_mask_{hop}"), _features.edge_pools(e)))
    self._id = index_dtype(graph.num_nodes)  # local ids and the global -> local table
    self._unknown = np.iinfo(self._id).max

  def _new_work(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A global -> local table (all unknown between batches), local -> global ids and kernel work space."""
    from loaders import _kernel

    size = max(_kernel.scratch_size(f, k) for f, k in zip(self.budgets.frontier, self.fanouts))
    return (np.full(self.graph.num_nodes, self._unknown, self._id), np.empty(self.budgets.nodes, self._id),
            np.empty(size, np.int64))

  def _fill(self, out: dict[str, np.ndarray], n_seeds: int, node_ids: np.ndarray, num_local: int) -> None:
    """The seeds, the local nodes and their features."""
    live = self._live(n_seeds, num_local)
    ids, node_mask = self._local_nodes(("node_ids", "node_mask"), node_ids, live)
    out["seeds"] = ids[:self.batch_size].copy()
    out["seed_mask"] = node_mask[:self.batch_size].copy()
    out["node_ids"], out["node_mask"] = ids, node_mask
    if self._gather is not None:
      out["x"] = self._gather(node_ids, live)

  def observed_node_budget(self, num_batches: int = 8, margin: float = 1.25, epoch: int = 0) -> int:
    """A node budget sized from sampled batches: the most local nodes any of them needed, times `margin`.

    Pass it as `node_budget` to a new sampler: `x` (and the host's gather and the transfer) shrinks to
    what batches need in practice; a rare batch that needs more still raises, naming the budget.

    Args:
      num_batches: batches of `epoch` sampled (spread over the epoch).
      margin: headroom over the largest batch seen.
      epoch: the epoch they are drawn from.

    Returns:
      The suggested node budget (at most the worst case).
    """
    most = max(self._sampled_sizes(num_batches, epoch), default=0)
    return min(self.budgets.nodes, max(self.batch_size, math.ceil(most * margin)))

  def _sample_hops(self, seeds: np.ndarray, epoch: int, index: int) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
    """Samples every hop out from `seeds`, relabelling the nodes found to local ids.

    Returns each hop's `edge_index_<h>`/`edge_mask_<h>`, the global id of
    every local node (seeds at 0..len(seeds)-1, the hops' new nodes from
    batch_size on; valid until this thread's next batch) and the end of the
    local ids used.
    """
    from loaders import _kernel

    B, idt = self.batch_size, self._id
    table, node_ids, scratch = self._work()
    out: dict[str, np.ndarray] = {}
    _kernel.place(seeds.astype(idt, copy=False), table, node_ids, 0)
    num_local = B  # seeds own local ids 0..B-1 (padding included)
    f_lo, f_hi = 0, len(seeds)  # the frontier is a contiguous range of local ids
    try:
      for hop, k in enumerate(self.fanouts):
        edge_index, edge_mask = self._draw((f"edge_index_{hop}", f"edge_mask_{hop}"), f_lo, f_hi, k, out)
        key = _kernel.stream_key(self.seed, epoch, index, self.shard_index, hop)
        n_new = _kernel.sample_hop(self._indptr, self._indices, node_ids[f_lo:f_hi], k, key, table, node_ids,
                                   num_local, self.budgets.nodes, self._unknown, edge_index[0], edge_index[1],
                                   edge_mask, f_lo, scratch)
        if n_new == _kernel.OVERFLOW:  # only with a node_budget below the worst case
          raise RuntimeError(f"batch {index}, hop {hop}: more than node_budget={self.budgets.nodes} local nodes; "
                             f"raise it (the worst case is "
                             f"{budgets(self.batch_size, self.fanouts, self.graph.num_nodes).nodes})")
        next_budget = self.budgets.frontier[hop + 1] if hop + 1 < len(self.fanouts) else n_new
        f_lo, f_hi = num_local, num_local + min(n_new, next_budget)
        num_local += n_new
    finally:  # the table is all unknown again for the thread's next batch
      for lo, hi in self._live(len(seeds), num_local):
        _kernel.reset(table, node_ids, lo, hi, self._unknown)
    return out, node_ids, num_local
