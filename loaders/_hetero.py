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

import numpy as np

from formats.graphbin import index_dtype
from loaders._graph_file import Graph
from loaders._order import SeedOrder, per_host_batch_size
from loaders._sampler import SeedSampler

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
    ValueError: a node budget below batch_size for the seed type, below 0, or for an unknown type.
  """
  hops = len(next(iter(fanouts.values())))
  types = sorted(num_nodes)
  base = {t: batch_size if t == seed_type else 0 for t in types}
  for t, b in (node_budget or {}).items():
    if t not in num_nodes:
      raise ValueError(f"node_budget: the graph has no node type {t!r} (it has {types})")
    if t == seed_type and b < batch_size:
      raise ValueError(f"node_budget[{t!r}] {b} is smaller than batch_size {batch_size}")
    if b < 0:
      raise ValueError(f"node_budget[{t!r}] must be >= 0, got {b}")
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


class HeteroNeighborSampler(SeedSampler):
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
    self.num_nodes = {t: int(n) for t, n in graph.meta.get("num_nodes", {}).items()}
    self.seed_type = seed_type or _default_seed_type(graph)
    if self.seed_type not in self.num_nodes:
      raise ValueError(f"seed_type {self.seed_type!r} is not a node type of {graph.path} ({sorted(self.num_nodes)})")
    self.fanouts = resolve_fanouts(fanouts, relations)
    self.relations = sorted(self.fanouts)
    self._relation_index = {r: i for i, r in enumerate(relations)}  # the random stream of a relation
    self.num_hops = len(next(iter(self.fanouts.values())))
    seeds = np.asarray(_seed_split(graph, self.seed_type, split) if seed_nodes is None else seed_nodes, np.int64)
    self._set_order(graph, SeedOrder(seeds, batch_size, seed, shard_index, shard_count, order),
                    f"{self.seed_type}/{split}" if seed_nodes is None else None)
    self.budgets = hetero_budgets(batch_size, self.seed_type, self.fanouts, self.num_nodes, node_budget)
    self.types = sorted(self.num_nodes)
    csrs = [(f"{graph.path} relation {r}", *graph.relation(r), *(self.num_nodes[t] for t in relation_types(r)))
            for r in self.relations]
    self._csr = dict(zip(self.relations, _features.sampling_csrs(csrs, in_memory)))
    _features.check_ids(self.seed_nodes, self.num_nodes[self.seed_type], f"seed nodes ({self.seed_type})")
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
      self._pools.update(zip((f"node_ids/{t}", f"node_mask/{t}"), _features.node_pools(self.budgets.nodes[t])))
      if t in self._years:
        self._pools[f"year/{t}"] = _features.BufferPool((self.budgets.nodes[t], *self._years[t].shape[1:]),
                                                        self._years[t].dtype)
    for r in self.relations:
      for h, e in enumerate(self.budgets.edges[r]):
        if e:
          self._pools.update(zip((f"edge_index/{r}/{h}", f"edge_mask/{r}/{h}"), _features.edge_pools(e)))
    label = f"node/{self.seed_type}/label"
    self._labels = np.asarray(graph.bin[label]) if label in graph.bin else None
    self._id = {t: index_dtype(n) for t, n in self.num_nodes.items()}

  def _new_work(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray]:
    """Global -> local tables (all unknown between batches) and local -> global ids per type, and the
    kernel's work space."""
    from loaders import _kernel

    size = max(_kernel.scratch_size(self.budgets.frontier[relation_types(r)[0]][h], self.fanouts[r][h])
               for r in self.relations for h in range(self.num_hops))
    return ({t: np.full(n, np.iinfo(self._id[t]).max, self._id[t]) for t, n in self.num_nodes.items()},
            {t: np.empty(self.budgets.nodes[t], self._id[t]) for t in self.types}, np.empty(size, np.int64))

  def _fill(self, out: dict[str, np.ndarray], n_seeds: int, node_ids: dict[str, np.ndarray],
            num_local: dict[str, int]) -> None:
    """Every type's local nodes, features and years, then the seeds."""
    B = self.batch_size
    for t in self.types:
      live = self._live(n_seeds, num_local[t], t == self.seed_type)
      out[f"node_ids/{t}"], out[f"node_mask/{t}"] = self._local_nodes((f"node_ids/{t}", f"node_mask/{t}"),
                                                                        node_ids[t], live)
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
          if self.budgets.edges[r][hop] == 0:
            continue
          head, tail = relation_types(r)
          f_lo, f_hi = frontier[head]
          k = self.fanouts[r][hop]
          edge_index, edge_mask = self._draw((f"edge_index/{r}/{hop}", f"edge_mask/{r}/{hop}"), f_lo, f_hi, k, out)
          indptr, indices = self._csr[r]
          key = _kernel.stream_key(self.seed, epoch, index, self.shard_index, hop, self._relation_index[r] + 1)
          n_new = _kernel.sample_hop(indptr, indices, node_ids[head][f_lo:f_hi], k, key, tables[tail],
                                     node_ids[tail], num_local[tail], self.budgets.nodes[tail],
                                     np.iinfo(self._id[tail]).max, edge_index[0], edge_index[1], edge_mask, f_lo,
                                     scratch)
          if n_new == _kernel.OVERFLOW:
            worst = hetero_budgets(B, st, self.fanouts, self.num_nodes).nodes[tail]
            raise RuntimeError(f"batch {index}, hop {hop}, relation {r}: more than node_budget[{tail!r}]="
                               f"{self.budgets.nodes[tail]} local nodes; raise it (the worst case is {worst})")
          num_local[tail] += n_new
        frontier = {t: (start[t], num_local[t]) for t in self.types}
    finally:  # the tables are all unknown again for the thread's next batch
      for t in self.types:
        for lo, hi in self._live(len(seeds), num_local[t], t == st):
          _kernel.reset(tables[t], node_ids[t], lo, hi, np.iinfo(self._id[t]).max)
    return out, node_ids, num_local

  def observed_node_budget(self, num_batches: int = 8, margin: float = 1.25, epoch: int = 0) -> dict[str, int]:
    """Node budgets sized from sampled batches: per type, the most local nodes any needed, times `margin`.

    Args: as NeighborSampler.observed_node_budget.

    Returns:
      {node type: budget} for `node_budget=` (each at most the worst case).
    """
    used = self._sampled_sizes(num_batches, epoch)
    floor = {t: self.batch_size if t == self.seed_type else 1 for t in self.types}
    return {t: min(self.budgets.nodes[t], max(floor[t], math.ceil(max((u[t] for u in used), default=0) * margin)))
            for t in self.types}


def _default_seed_type(graph: Graph) -> str:
  """The only node type with a split (the seeds' type when none is given)."""
  typed = sorted({n.split("/")[2] for n in graph.bin.names("split/") if len(n.split("/")) >= 4})
  if len(typed) != 1:
    raise ValueError(f"{graph.path}: pass seed_type (node types with a split: {typed or 'none'})")
  return typed[0]


def _seed_split(graph: Graph, seed_type: str, part: str) -> np.ndarray:
  """The ids of split `part` ("train", ...) of `seed_type`."""
  found = [n for n in graph.bin.names("split/") if n.endswith(f"/{seed_type}/{part}")]
  if len(found) != 1:
    raise KeyError(f"{graph.path}: split {part!r} of {seed_type!r} matches {found or 'nothing'} "
                   f"among {graph.bin.names('split/')}")
  return graph.bin[found[0]]
