"""Neighbour sampling over a heterogeneous `.graphbin` (OGB-MAG and the like), with static shapes. No framework.

Seeds are nodes of one type (`paper` for MAG). At every hop, each node type's
frontier draws a fixed fanout of neighbours along every relation whose head is
that type (uniformly, with replacement), through the same compiled kernel as
the homogeneous sampler (loaders._kernel). A relation `head___rel___tail` is
stored as a CSR whose rows are head-type ids and whose neighbours are
tail-type ids, so sampling it for a head-type frontier finds tail-type nodes,
and messages flow from the sampled tail node to the head frontier node. MAG's
raw relations point away from papers for authors (`author___writes___paper`):
convert with `--add_reverse_relations=true` to sample authors from papers
(`paper___rev_writes___author`).

Every node type has its own local ids. The seed type's local ids 0..B-1 are
the seeds (padding included), and each hop's new nodes follow in order of
first draw; other types start at 0. The nodes found at hop h of a type are its
frontier at hop h+1. Budgets are static per type (nodes) and per relation and
hop (edges), derived from fanouts and batch size in the worst case; smaller
node budgets are allowed and loud on overflow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import math
import threading

import numpy as np

from formats.graphbin import index_dtype
from loaders._graph_file import Graph
from loaders._order import SeedOrder, per_host_batch_size, seeds_name

Fanouts = Sequence[int] | Mapping[str, Sequence[int]]


@dataclasses.dataclass(frozen=True)
class HeteroBudgets:
  """Static sizes of a heterogeneous batch."""

  frontier: dict[str, tuple[int, ...]]  # node type -> frontier nodes per hop (hop 0: the seeds of the seed type)
  edges: dict[str, tuple[int, ...]]  # relation -> edges per hop (0: not sampled at that hop)
  nodes: dict[str, int]  # node type -> all its local nodes


def relation_types(relation: str) -> tuple[str, str]:
  """(head type, tail type) of `head___rel___tail`."""
  parts = relation.split("___")
  if len(parts) != 3:
    raise ValueError(f"relation {relation!r} is not <head>___<relation>___<tail>")
  return parts[0], parts[2]


def relations_of(graph: Graph) -> list[str]:
  """The relations stored in a heterogeneous graph (raw and reverse), sorted."""
  return sorted(n[len("rel/"):-len("/indptr")] for n in graph.bin.names("rel/") if n.endswith("/indptr"))


def resolve_fanouts(fanouts: Fanouts, relations: Sequence[str]) -> dict[str, tuple[int, ...]]:
  """{relation: fanout per hop} from the user's form: one list for every relation, or a dict.

  A dict is keyed by full relation names or by unambiguous middle names (`"cites"`,
  `"rev_writes"`); relations it leaves out are not sampled.

  Raises:
    ValueError: unknown or ambiguous relation names, hop counts that differ, non-positive fanouts
      in the short form, negative ones in the dict.
  """
  if not isinstance(fanouts, Mapping):
    hops = tuple(int(k) for k in fanouts)
    if not hops or any(k < 1 for k in hops):
      raise ValueError(f"fanouts must be positive integers, got {list(fanouts)}")
    return {r: hops for r in relations}
  by_middle: dict[str, list[str]] = {}
  for r in relations:
    by_middle.setdefault(r.split("___")[1], []).append(r)
  out: dict[str, tuple[int, ...]] = {}
  for name, hops in fanouts.items():
    if name in relations:
      full = name
    elif len(by_middle.get(name, [])) == 1:
      full = by_middle[name][0]
    else:
      found = by_middle.get(name, [])
      raise ValueError(f"fanouts: relation {name!r} is {'ambiguous: ' + str(found) if found else 'not in the graph'}"
                       f" (it has {relations})")
    if full in out:
      raise ValueError(f"fanouts: relation {full} given twice")
    out[full] = tuple(int(k) for k in hops)
  lengths = {len(h) for h in out.values()}
  if len(lengths) != 1 or 0 in lengths:
    raise ValueError(f"fanouts: every relation needs the same number of hops (at least one), got {out}")
  if any(k < 0 for h in out.values() for k in h):
    raise ValueError(f"fanouts must not be negative, got {out}")
  return out


def hetero_budgets(batch_size: int, seed_type: str, fanouts: Mapping[str, Sequence[int]],
                   num_nodes: Mapping[str, int], node_budget: Mapping[str, int] | None = None) -> HeteroBudgets:
  """Worst-case static sizes of a heterogeneous batch.

  Args:
    batch_size: seeds per batch.
    seed_type: the seeds' node type.
    fanouts: {relation: fanout per hop}.
    num_nodes: {node type: nodes in the graph} (no hop finds more).
    node_budget: {node type: local nodes} below the worst case (a batch that needs more raises); it
      caps that type's frontier, and the edges drawn from it, at every hop after the first.

  Returns:
    The frontier, edge and node budgets.

  Raises:
    ValueError: a node budget below batch_size for the seed type, or for an unknown type.
  """
  hops = len(next(iter(fanouts.values())))
  types = sorted(num_nodes)
  base = {t: batch_size if t == seed_type else 0 for t in types}
  for t, b in (node_budget or {}).items():
    if t not in num_nodes:
      raise ValueError(f"node_budget: the graph has no node type {t!r} (it has {types})")
    if t == seed_type and b < batch_size:
      raise ValueError(f"node_budget[{t!r}] {b} is smaller than batch_size {batch_size}")
  # the nodes of a type one hop finds are at most the graph's, and with a node budget at most what it
  # leaves after the seeds: so are that type's next frontier and the edges drawn from it
  most_new = {t: min(num_nodes[t], int((node_budget or {}).get(t, num_nodes[t] + base[t])) - base[t])
              for t in types}
  frontier = {t: [base[t]] for t in types}
  edges: dict[str, list[int]] = {r: [] for r in sorted(fanouts)}
  nodes = dict(base)
  for h in range(hops):
    new = dict.fromkeys(types, 0)
    for r in sorted(fanouts):
      head, tail = relation_types(r)
      e = frontier[head][h] * fanouts[r][h]
      edges[r].append(e)
      new[tail] += e
    for t in types:
      nodes[t] += min(num_nodes[t], new[t])
      if h + 1 < hops:
        frontier[t].append(min(most_new[t], new[t]))
  nodes = {t: min(n, num_nodes[t] + base[t], int((node_budget or {}).get(t, n))) for t, n in nodes.items()}
  return HeteroBudgets({t: tuple(f) for t, f in frontier.items()}, {r: tuple(e) for r, e in edges.items()}, nodes)


class HeteroNeighborSampler:
  """Fixed-fanout uniform neighbour sampling over the seeds of one node type of a heterogeneous graph.

  `sampler[i]` (or `sampler.batch(i, epoch)`) is batch i of an epoch: a dict of numpy arrays with the
  same keys and shapes for every i:

    seeds [B] int64, seed_mask [B] bool         the seeds (ids within the seed type; padding masked)
    y [B, ...]                                  the seeds' labels (when the seed type has labels)
    node_ids/<type> [N_t] int64                 id within its type of each local node (for embedding
    node_mask/<type> [N_t] bool                   tables of types without features); mask of live ones
    x/<type> [N_t, F_t]                         features of the local nodes (types that have them)
    year/<type> [N_t, 1]                        years of the local nodes (types that have them)
    edge_index/<relation>/<h> [2, E] int32      hop h of a relation head___rel___tail: row 0 the sampled
    edge_mask/<relation>/<h> [E] bool             tail-type node, row 1 the head-type frontier node it was
                                                  sampled for (local ids of their types)

  The seed type's local ids 0..B-1 are the seeds. Relation-hops with no budget (their head type has no
  frontier at that hop, or a zero fanout) are absent from every batch. Deterministic for (seed, epoch, i)
  whatever thread computes it; seeds reshuffled every epoch and split disjointly over `shard_count`, per
  host or in a global order that survives a change of host count (`order`, as NeighborSampler).
  """

  def __init__(self, graph: Graph, fanouts: Fanouts = (15, 10, 5), batch_size: int | None = None,
               seed_type: str | None = None, seed: int = 0, shard_index: int = 0, shard_count: int = 1,
               split: str = "train", seed_nodes: np.ndarray | None = None, gather_features: bool = True,
               node_budget: Mapping[str, int] | None = None, feature_dtype=None, gather_threads: int = 1,
               in_memory: bool | None = None, order: str = "global", global_batch_size: int | None = None):
    """Prepares sampling over `split`'s seeds of `seed_type`.

    Args:
      graph: a heterogeneous graph (rel/<relation>/{indptr,indices} sections).
      fanouts: per hop, for every relation ([15, 10, 5]); or {relation: per hop} (full names or
        unambiguous middle names like "cites"; relations left out are not sampled).
      batch_size: seeds per batch (default 1024, or global_batch_size / shard_count).
      seed_type: the seeds' node type (default: the only type with a split, e.g. "paper").
      seed, shard_index, shard_count: as NeighborSampler.
      split: "train", "valid" or "test" of the seed type's split.
      seed_nodes: the seeds themselves (ids within the seed type), instead of `split`.
      gather_features: put `x/<type>` in the batch for types that have features.
      node_budget: {type: local nodes} below the worst case (`observed_node_budget` suggests one).
      feature_dtype, gather_threads, in_memory, order, global_batch_size: as NeighborSampler.

    Raises:
      ValueError: not a heterogeneous graph or a malformed relation; bad fanouts, batch size, shard,
        budgets, seed type or seeds.
      KeyError: the seed type has no such split.
    """
    from loaders import _features

    relations = relations_of(graph)
    if not relations:
      raise ValueError(f"{graph.path} has no heterogeneous relations (rel/<relation>/indptr) to sample from")
    batch_size = per_host_batch_size(batch_size, shard_count, order, global_batch_size, default=1024)
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= shard_index < shard_count:
      raise ValueError(f"shard_index {shard_index} is outside [0, {shard_count})")
    self.graph = graph
    self.num_nodes = {t: int(n) for t, n in graph.meta.get("num_nodes", {}).items()}
    self.seed_type = seed_type or self._default_seed_type()
    if self.seed_type not in self.num_nodes:
      raise ValueError(f"seed_type {self.seed_type!r} is not a node type of {graph.path} ({sorted(self.num_nodes)})")
    self.fanouts = resolve_fanouts(fanouts, relations)
    self.relations = sorted(self.fanouts)
    self._relation_index = {r: i for i, r in enumerate(relations)}  # the random stream of a relation
    self.num_hops = len(next(iter(self.fanouts.values())))
    self.batch_size = batch_size
    self.seed, self.shard_index, self.shard_count = seed, shard_index, shard_count
    self.seed_nodes = np.asarray(self._seed_split(split) if seed_nodes is None else seed_nodes, np.int64)
    self.split = f"{self.seed_type}/{split}" if seed_nodes is None else seeds_name(self.seed_nodes)
    self._order = SeedOrder(self.seed_nodes, batch_size, seed, shard_index, shard_count, order)
    self.order, self.per_shard, self.num_batches = order, self._order.per_shard, self._order.num_batches
    self.budgets = hetero_budgets(batch_size, self.seed_type, self.fanouts, self.num_nodes, node_budget)
    self.types = sorted(self.num_nodes)
    csr = {r: graph.relation(r) for r in self.relations}
    resident = _features.keep_in_memory(sum(a.nbytes + b.nbytes for a, b in csr.values()), in_memory)
    self._csr = {r: tuple(_features.to_memory(a) if resident else np.asarray(a) for a in pair)
                 for r, pair in csr.items()}
    for r, (indptr, indices) in self._csr.items():
      head, tail = relation_types(r)
      if len(indptr) != self.num_nodes.get(head, -1) + 1:
        raise ValueError(f"{graph.path}: relation {r} has {len(indptr) - 1} rows, {head} has "
                         f"{self.num_nodes.get(head)} nodes")
      _features.check_csr(indptr, indices, self.num_nodes.get(tail, 0), f"{graph.path} relation {r}")
    _features.check_ids(self.seed_nodes, self.num_nodes[self.seed_type], f"seed nodes ({self.seed_type})")
    self._csr = {r: (p, i if len(i) else np.zeros(1, i.dtype)) for r, (p, i) in self._csr.items()}
    self._gather = {}
    if gather_features:
      for t in self.types:
        if f"node/{t}/feat" in graph.bin:
          self._gather[t] = _features.FeatureGather(graph.bin[f"node/{t}/feat"], self.budgets.nodes[t],
                                                    feature_dtype, gather_threads, in_memory)
    self._years = {t: np.asarray(graph.bin[f"node/{t}/year"]) for t in self.types if f"node/{t}/year" in graph.bin}
    # every array of a batch comes from a pool of reused ones (no page faults on fresh memory each batch)
    self._pools = {}
    for t in self.types:
      self._pools[f"node_ids/{t}"] = _features.BufferPool((self.budgets.nodes[t],), np.int64)
      self._pools[f"node_mask/{t}"] = _features.BufferPool((self.budgets.nodes[t],), bool)
      if t in self._years:
        self._pools[f"year/{t}"] = _features.BufferPool((self.budgets.nodes[t], *self._years[t].shape[1:]),
                                                        self._years[t].dtype)
    for r in self.relations:
      for h, e in enumerate(self.budgets.edges[r]):
        if e:
          self._pools[f"edge_index/{r}/{h}"] = _features.BufferPool((2, e), np.int32, axis=1)
          self._pools[f"edge_mask/{r}/{h}"] = _features.BufferPool((e,), bool)
    label = f"node/{self.seed_type}/label"
    self._labels = np.asarray(graph.bin[label]) if label in graph.bin else None
    self._id = {t: index_dtype(n) for t, n in self.num_nodes.items()}
    self._local = threading.local()

  def _default_seed_type(self) -> str:
    typed = sorted({n.split("/")[2] for n in self.graph.bin.names("split/") if len(n.split("/")) >= 4})
    if len(typed) != 1:
      raise ValueError(f"{self.graph.path}: pass seed_type (node types with a split: {typed or 'none'})")
    return typed[0]

  def _seed_split(self, part: str) -> np.ndarray:
    found = [n for n in self.graph.bin.names("split/") if n.endswith(f"/{self.seed_type}/{part}")]
    if len(found) != 1:
      raise KeyError(f"{self.graph.path}: split {part!r} of {self.seed_type!r} matches {found or 'nothing'} "
                     f"among {self.graph.bin.names('split/')}")
    return self.graph.bin[found[0]]

  def __len__(self) -> int:
    return self.num_batches

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return self.batch(index)

  def shard_seeds(self, epoch: int) -> np.ndarray:
    """This host's seeds for one epoch, in batch order (as NeighborSampler.shard_seeds)."""
    return self._order.shard_seeds(epoch)

  def _work(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray]:
    """This thread's global -> local tables (all unknown between batches) and local -> global ids per
    type, and the kernel's work space, reused by every batch of the thread."""
    from loaders import _kernel

    work = getattr(self._local, "work", None)
    if work is None:
      size = max(_kernel.scratch_size(self.budgets.frontier[relation_types(r)[0]][h], self.fanouts[r][h])
                 for r in self.relations for h in range(self.num_hops))
      work = self._local.work = ({t: np.full(n, np.iinfo(self._id[t]).max, self._id[t])
                                  for t, n in self.num_nodes.items()},
                                 {t: np.empty(self.budgets.nodes[t], self._id[t]) for t in self.types},
                                 np.empty(size, np.int64))
    return work

  def batch(self, index: int, epoch: int = 0) -> dict[str, np.ndarray]:
    """Batch `index` of `epoch`, a pure function of (seed, shard, epoch, index).

    Args:
      index: the batch within the epoch, 0 <= index < len(self).
      epoch: the epoch.

    Returns:
      The batch's numpy arrays (keys and shapes in the class docstring).

    Raises:
      IndexError: `index` is outside the epoch.
      RuntimeError: the batch needs more local nodes of a type than its node budget.
    """
    seeds = self._order.batch(index, epoch)
    out, node_ids, num_local = self._sample_hops(seeds, epoch, index)
    B, n_seeds = self.batch_size, len(seeds)
    for t in self.types:
      live = self._live(t, n_seeds, num_local[t])
      ids, mask = self._pools[f"node_ids/{t}"].take(live), self._pools[f"node_mask/{t}"].take(live)
      for lo, hi in live:
        ids[lo:hi] = node_ids[t][lo:hi]
        mask[lo:hi] = True
      out[f"node_ids/{t}"], out[f"node_mask/{t}"] = ids, mask
      if t in self._gather:
        out[f"x/{t}"] = self._gather[t](node_ids[t], live)
      if t in self._years:
        years = self._years[t]
        year = self._pools[f"year/{t}"].take(live)
        for lo, hi in live:
          year[lo:hi] = years[node_ids[t][lo:hi]]
        out[f"year/{t}"] = year
    out["seeds"] = out[f"node_ids/{self.seed_type}"][:B].copy()
    out["seed_mask"] = out[f"node_mask/{self.seed_type}"][:B].copy()
    if self._labels is not None:
      y = np.zeros((B, *self._labels.shape[1:]), self._labels.dtype)
      y[:n_seeds] = self._labels[seeds]
      out["y"] = y
    return out

  def _live(self, node_type: str, n_seeds: int, num_local: int) -> list[tuple[int, int]]:
    if node_type == self.seed_type:
      return [(0, n_seeds), (self.batch_size, num_local)]
    return [(0, num_local)]

  def _sample_hops(self, seeds: np.ndarray, epoch: int,
                   index: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, int]]:
    """Samples every hop; returns the edge arrays, each type's local -> id table (valid until the thread's
    next batch) and its used local ids."""
    from loaders import _kernel

    B, st = self.batch_size, self.seed_type
    tables, node_ids, scratch = self._work()
    _kernel.place(seeds.astype(self._id[st], copy=False), tables[st], node_ids[st], 0)
    num_local = {t: B if t == st else 0 for t in self.types}
    frontier = {t: (0, len(seeds)) if t == st else (0, 0) for t in self.types}
    out: dict[str, np.ndarray] = {}
    try:
      for hop in range(self.num_hops):
        start = dict(num_local)
        for r in self.relations:
          e_budget = self.budgets.edges[r][hop]
          if e_budget == 0:
            continue
          head, tail = relation_types(r)
          f_lo, f_hi = frontier[head]
          if (f_hi - f_lo) * self.fanouts[r][hop] > e_budget:  # never: the budgets bound every frontier (the
            raise AssertionError(f"{r}, hop {hop}: {f_hi - f_lo} frontier nodes exceed the budget")  # kernel has
          drawn = [(0, (f_hi - f_lo) * self.fanouts[r][hop])]  # no bounds checks); it writes every draw's entries
          edge_index = self._pools[f"edge_index/{r}/{hop}"].take(drawn)
          edge_mask = self._pools[f"edge_mask/{r}/{hop}"].take(drawn)
          indptr, indices = self._csr[r]
          key = _kernel.stream_key(self.seed, epoch, index, self.shard_index, hop, self._relation_index[r] + 1)
          n_new = _kernel.sample_hop(indptr, indices, node_ids[head][f_lo:f_hi], self.fanouts[r][hop], key,
                                     tables[tail], node_ids[tail], num_local[tail], self.budgets.nodes[tail],
                                     np.iinfo(self._id[tail]).max, edge_index[0], edge_index[1], edge_mask, f_lo,
                                     scratch)
          if n_new == _kernel.OVERFLOW:
            worst = hetero_budgets(B, st, self.fanouts, self.num_nodes).nodes[tail]
            raise RuntimeError(f"batch {index}, hop {hop}, relation {r}: more than node_budget[{tail!r}]="
                               f"{self.budgets.nodes[tail]} local nodes; raise it (the worst case is {worst})")
          num_local[tail] += n_new
          out[f"edge_index/{r}/{hop}"], out[f"edge_mask/{r}/{hop}"] = edge_index, edge_mask
        frontier = {t: (start[t], num_local[t]) for t in self.types}
    finally:  # the tables are all unknown again for the thread's next batch
      for t in self.types:
        unknown = np.iinfo(self._id[t]).max
        if t == st:
          _kernel.reset(tables[t], node_ids[t], 0, len(seeds), unknown)
          _kernel.reset(tables[t], node_ids[t], B, num_local[t], unknown)
        else:
          _kernel.reset(tables[t], node_ids[t], 0, num_local[t], unknown)
    return out, node_ids, num_local

  def observed_node_budget(self, num_batches: int = 8, margin: float = 1.25, epoch: int = 0) -> dict[str, int]:
    """Node budgets sized from sampled batches: per type, the most local nodes any needed, times `margin`.

    Args:
      num_batches: batches of `epoch` sampled (spread over the epoch).
      margin: headroom over the largest batch seen.
      epoch: the epoch they are drawn from.

    Returns:
      {node type: budget} for `node_budget=` (each at most the worst case).
    """
    picks = np.unique(np.linspace(0, max(self.num_batches - 1, 0), num_batches).astype(int))[:self.num_batches]
    most = dict.fromkeys(self.types, 0)
    for i in picks:
      seeds = self._order.batch(int(i), epoch)
      _, _, used = self._sample_hops(seeds, epoch, int(i))
      most = {t: max(most[t], used[t]) for t in self.types}
    floor = {t: self.batch_size if t == self.seed_type else 1 for t in self.types}
    return {t: min(self.budgets.nodes[t], max(floor[t], math.ceil(most[t] * margin))) for t in self.types}
