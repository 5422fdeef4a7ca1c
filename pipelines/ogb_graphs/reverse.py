"""Reverse relations of a heterogeneous graph (`--add_reverse_relations`): `dst___rev_rel___src` for each
raw `src___rel___dst`, planned as one more edge source that reads the raw relation's files with every edge
turned around, so the partition sort, the part files and the assembly are those of any relation (and of
the CSC pass, which keys edges by destination the same way).
"""

from __future__ import annotations

import dataclasses

from formats.graphbin import MAX_NAME_BYTES
from pipelines.core.errors import UsageError
from pipelines.ogb_graphs.plan import GraphPlan, nodes_per_partition, relation_types

REVERSE_PREFIX = "rev_"


def reverse_relation_name(relation: str) -> str:
  """The name of a relation's reverse: `rev_` before the relation, head and tail swapped.

  Example: "author___writes___paper" → "paper___rev_writes___author".

  Args:
    relation: a heterogeneous relation, "<head>___<relation>___<tail>".

  Returns:
    "<tail>___rev_<relation>___<head>".
  """
  head, tail = relation_types(relation)
  return f"{tail}___{REVERSE_PREFIX}{relation.split('___')[1]}___{head}"


def add_reverse_relations(plan: GraphPlan, edges_per_partition: int, csc: bool = False) -> GraphPlan:
  """The plan with the reverse of every raw relation added after the raw ones.

  The reverse of a relation reads the relation's edge file and its edge files (`edge-feat`,
  `edge_*`) in lockstep, each edge turned around: its CSR rows are the raw tail type and each
  row's neighbours keep the file's order.

  Args:
    plan: a heterogeneous plan, as `plan_graph` returns it.
    edges_per_partition: the edges a partition aims to hold (--edges_per_partition).
    csc: the reverse CSRs are stored too (--csc): their section names must fit as well.

  Returns:
    The plan with one more `EdgeSource` per relation (`reverse_of` naming the raw one), and its
    edge count and partition size.

  Raises:
    UsageError: the plan is not heterogeneous, a raw relation is already named `rev_*` (its name
      could collide with an added one), or an added relation's section name is longer than a
      .graphbin holds (checked here, before the job reads anything).
  """
  if plan.layout != "heterogeneous":
    raise UsageError(f"--add_reverse_relations=true needs a heterogeneous data set (raw/num-node-dict.csv.gz): "
                     f"{plan.root} is {plan.layout}")
  raw = [s for s in plan.edge_files if not s.reverse_of]
  for s in raw:
    if s.relation.split("___")[1].startswith(REVERSE_PREFIX):
      raise UsageError(f"--add_reverse_relations=true: the data set already has a relation {s.relation}; "
                       f"added reverse relations are named {REVERSE_PREFIX}<relation> and would collide")
  num_edges, part_size = dict(plan.num_edges), dict(plan.part_size)
  added = []
  for s in raw:
    name = reverse_relation_name(s.relation)
    sections = [f"rel/{name}/{x}" for x in ("indptr", "indices", *(section for section, _ in s.extras))]
    sections += [f"csc/rel/{name}/{x}" for x in ("indptr", "indices")] if csc else []
    longest = max(sections, key=lambda x: len(x.encode()))
    if len(longest.encode()) > MAX_NAME_BYTES:
      raise UsageError(f"--add_reverse_relations=true: section {longest} would be {len(longest.encode())} bytes "
                       f"long; a .graphbin section name holds {MAX_NAME_BYTES}")
    added.append(dataclasses.replace(s, relation=name, num_rows=s.num_cols, num_cols=s.num_rows,
                                     reverse_of=s.relation))
    num_edges[name] = plan.num_edges[s.relation]
    part_size[name] = nodes_per_partition(s.num_cols, num_edges[name] * (2 if plan.add_inverse else 1),
                                          edges_per_partition)
  return dataclasses.replace(plan, edge_files=plan.edge_files + tuple(added), num_edges=num_edges,
                             part_size=part_size)


def reverse_relations(plan: GraphPlan) -> dict[str, dict]:
  """What the `.graphbin` meta and the manifest's `graph` section say about the added relations.

  Args:
    plan: the job's plan.

  Returns:
    {added relation: {"reverse_of": raw relation, "num_edges": edges stored}}, empty without them.
  """
  return {s.relation: {"reverse_of": s.reverse_of,
                       "num_edges": plan.num_edges[s.relation] * (2 if plan.add_inverse else 1)}
          for s in plan.edge_files if s.reverse_of}
