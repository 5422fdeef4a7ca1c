"""Sort partitions hold about --edges_per_partition edges, the CSC pass included: a worker's memory bound."""

from __future__ import annotations

import gzip
import os

import numpy as np

from pipelines.ogb_graphs import plan_graph
from scripts import make_sample_ogb as mo


def _edges(folder: str, relation: str) -> np.ndarray:
  with gzip.open(os.path.join(folder, "raw", "relations", relation, "edge.csv.gz"), "rt") as f:
    return np.loadtxt(f, delimiter=",", dtype=np.int64, ndmin=2)


def test_csc_partitions_are_sized_by_the_tail_type(tmp_path):
  folder = str(mo.write_heterogeneous_node(tmp_path / "ogbn_mag", 0).folder)
  epp = 200
  plan = plan_graph(folder, "ogbn-mag", "auto", epp)
  for relation in plan.num_edges:
    head, _, tail = relation.split("___")
    edges = _edges(folder, relation)
    for key, rows, column in ((relation, plan.num_nodes[head], 0), ("csc:" + relation, plan.num_nodes[tail], 1)):
      per_part = plan.rows_per_partition(key)
      counts = np.bincount(edges[:, column] // per_part)
      num_parts = -(-rows // per_part)
      # about epp edges a partition: never all of a relation's edges in one when they are many
      assert num_parts >= min(rows, -(-len(edges) // epp)), (key, per_part, num_parts)
      assert counts.max() < len(edges) or len(edges) <= epp, (key, counts.max())
