"""Graph-property data sets (ogbg-*): one record per graph, in ArrayRecord or TFRecord shards.

Each graph is a unit of core's record path: `graph_units` plans them at launch from
the count and split files (split, key, estimated bytes), and `GraphUnits` converts a
shard's graphs on its worker, reading the data set's files (small) once per worker.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from formats.features import Features, Tensor
from pipelines.core.converter import UnitConverter
from pipelines.core.records import Record
from pipelines.core.shards import PlanUnit
from pipelines.ogb_graphs.csr import interleave_inverse
from pipelines.ogb_graphs.plan import (
    GraphPlan, cast_like_ogb, csv_path, list_dir, open_input, read_counts, read_graph_counts, read_small)
from pipelines.ogb_graphs.read import OgbFormatError, OgbMissingFileError, check_rows, read_csv_chunks


def graph_features(node_feat: np.ndarray | None, edge_feat: np.ndarray | None, label: np.ndarray) -> Features:
  """The record schema of one graph: `edge_index`, `num_nodes`, `label`, and the features present.

  Args:
    node_feat: node features (rows of them; their width and dtype are used), or None.
    edge_feat: edge features, likewise, or None.
    label: graph labels, [graphs, width].

  Returns:
    The `Features`.
  """
  specs = {
      "edge_index": Tensor(shape=(2, None), dtype="int64"),
      "num_nodes": Tensor(shape=(), dtype="int64", encoding="none"),
      "label": Tensor(shape=(label.shape[1],), dtype=str(label.dtype), encoding="none"),
  }
  if node_feat is not None:
    specs["node_feat"] = Tensor(shape=(None, node_feat.shape[1]), dtype=str(node_feat.dtype))
  if edge_feat is not None:
    specs["edge_feat"] = Tensor(shape=(None, edge_feat.shape[1]), dtype=str(edge_feat.dtype))
  return Features(specs)


def read_graph_property(plan: GraphPlan, feature_dtype: str):
  """(features, [(graph index, values)], {graph index: split}) of an ogbg-* folder.

  Args:
    plan: the launcher's plan (layout "graphs").
    feature_dtype: the dtype of float features (--feature_dtype).

  Returns:
    The schema, each graph's values (inverse edges interleaved when the plan adds
    them) and the split of each graph a split file names.

  Raises:
    OgbMissingFileError: a file the layout needs is absent.
    OgbFormatError: a malformed file, a row count that disagrees with the count
      files, or a node or graph id out of range.
  """
  raw = csv_path(plan.root, "raw")
  node_list, edge_list, num_nodes, num_edges = read_graph_counts(raw)
  _, raw_files = list_dir(raw)

  def read(file: str, dtype: str, ncols: int | None, expected: int, what: str, source: str, section: str,
           optional: bool = False):
    """A whole file, with one row per node, edge or graph as `source` says."""
    if optional and file not in raw_files:
      return None
    arr = read_small(csv_path(raw, file), dtype, ncols, nonfinite=plan.nonfinite(section))
    check_rows(csv_path(raw, file), len(arr), expected, what, source)
    return arr

  e_total, n_total = int(num_edges.sum()), int(num_nodes.sum())
  edges = read("edge.csv.gz", "int", 2, e_total, "edges", edge_list, "edge")
  node_feat = read("node-feat.csv.gz", "auto", None, n_total, "nodes", node_list, "node/feat", optional=True)
  edge_feat = read("edge-feat.csv.gz", "auto", None, e_total, "edges", edge_list, "edge/feat", optional=True)
  label = read("graph-label.csv.gz", "auto", None, len(num_nodes), "graphs", node_list, "graph/label")
  node_feat = None if node_feat is None else cast_like_ogb(node_feat, "float", feature_dtype,
                                                           csv_path(raw, "node-feat.csv.gz"))
  edge_feat = None if edge_feat is None else cast_like_ogb(edge_feat, "float", feature_dtype,
                                                           csv_path(raw, "edge-feat.csv.gz"))
  label = cast_like_ogb(label, "auto", "float32", csv_path(raw, "graph-label.csv.gz"))
  split_of = split_of_graphs(plan, len(num_nodes))
  features = graph_features(node_feat, edge_feat, label)
  graphs = []
  na = ea = 0
  for g, (n, e) in enumerate(zip(num_nodes, num_edges)):
    ei = edges[ea:ea + e].T.astype(np.int64)
    bad = np.nonzero((ei < 0) | (ei >= n))
    if bad[0].size:
      raise OgbFormatError(f"{csv_path(raw, 'edge.csv.gz')}: line {ea + int(bad[1][0]) + 1}: node id outside [0, {n}) of graph {g}")
    values = {"edge_index": ei, "num_nodes": int(n), "label": label[g]}
    ef = None if edge_feat is None else edge_feat[ea:ea + e]
    if plan.add_inverse:
      s, d = interleave_inverse(ei[0], ei[1])
      values["edge_index"] = np.stack([s, d])
      ef = None if ef is None else np.repeat(ef, 2, axis=0)
    if node_feat is not None:
      values["node_feat"] = node_feat[na:na + n]
    if ef is not None:
      values["edge_feat"] = ef
    graphs.append((g, values))
    na += n
    ea += e
  return features, graphs, split_of


UNASSIGNED = "unassigned"  # the split of a graph no split file names


def split_of_graphs(plan: GraphPlan, num_graphs: int) -> dict[int, str]:
  """{graph index: split} for every graph a split file names.

  Args:
    plan: the launcher's plan (layout "graphs").
    num_graphs: the data set's graph count (a split file's ids must be below it).

  Returns:
    The split of each named graph.

  Raises:
    OgbFormatError: a graph id out of range, or named twice (in one split file or two).
  """
  split_of = {}
  for prefix, path in plan.split_files:
    ids = read_small(path, "int", 1)[:, 0]
    bad = np.flatnonzero((ids < 0) | (ids >= num_graphs))
    if bad.size:
      raise OgbFormatError(f"{path}: line {int(bad[0]) + 1}: graph id outside [0, {num_graphs})")
    name = prefix.rsplit("/", 1)[1]
    for line, g in enumerate(ids.tolist(), 1):
      if g in split_of:  # a graph in two splits (or twice in one) would be one record of one of them
        raise OgbFormatError(f"{path}: line {line}: graph {g} is already in split {split_of[g]!r}")
      split_of[g] = name
  return split_of


def graph_units(plan: GraphPlan, features: Features) -> list[PlanUnit]:
  """One plan unit per graph (at launch, from the count and split files): its split, its key
  (the zero-padded graph index), the index itself, and its record's bytes estimated from the schema.

  Args:
    plan: the launcher's plan (layout "graphs").
    features: the record schema (`graph_features_from_plan`): its widths and dtypes size the estimate.

  Returns:
    The units, in graph order.

  Raises:
    OgbFormatError: a malformed count or split file, or a graph id out of range.
  """
  _, _, num_nodes, num_edges = read_graph_counts(csv_path(plan.root, "raw"))
  split_of = split_of_graphs(plan, len(num_nodes))

  def row_bytes(name: str) -> int:
    spec = features[name] if name in list(features) else None
    return 0 if spec is None else int(np.prod(spec.shape[1:])) * np.dtype(spec.dtype).itemsize

  edge_copies = 2 if plan.add_inverse else 1
  per_node, per_edge = row_bytes("node_feat"), row_bytes("edge_feat") + 16
  units = []
  for g, (n, e) in enumerate(zip(num_nodes, num_edges)):
    nbytes = 64 + int(n) * per_node + int(e) * edge_copies * per_edge
    units.append(PlanUnit(split_of.get(g, UNASSIGNED), f"{g:012d}", g, nbytes))
  return units


class GraphUnits(UnitConverter):
  """A graph index → its record, in the schema set at launch. The data set's files are read once per worker,
  at its first graph."""

  def __init__(self, plan: GraphPlan, feature_dtype: str, features: Features):
    self._plan, self._feature_dtype, self._features = plan, feature_dtype, features
    self._read = None

  def __getstate__(self):
    return {**self.__dict__, "_read": None}  # shipped without what a worker read

  def listed_units(self, unit) -> int:
    del unit
    return 1

  def convert(self, g: int) -> Iterable[Record]:
    """See UnitConverter.convert. Graphs no split file names are in split "unassigned".

    Args:
      g: the graph's index.

    Raises:
      OgbFormatError: as `read_graph_property`, or the whole files disagree with the schema the launcher read
        from their first rows (the whole data set fails, no rejects).
    """
    if self._read is None:
      features, graphs, split_of = read_graph_property(self._plan, self._feature_dtype)
      check_schema(self._features, features, self._plan)
      self._read = dict(graphs), split_of
    graphs, split_of = self._read
    yield Record(split_of.get(g, UNASSIGNED), f"{g:012d}", self._features.encode(graphs[g]))


def check_schema(planned: Features, found: Features, plan: GraphPlan) -> None:
  """Refuses files whose whole contents give another schema than their first rows gave the launcher (a column
  of integers that holds a fraction further down): the manifest would describe other bytes than the records.

  Raises:
    OgbFormatError: naming the first file that disagrees, and how.
  """
  files = {"node_feat": "node-feat.csv.gz", "edge_feat": "edge-feat.csv.gz", "label": "graph-label.csv.gz"}
  for name, file in files.items():
    a, b = (planned[name] if name in list(planned) else None), (found[name] if name in list(found) else None)
    if a != b:
      raise OgbFormatError(
          f"{csv_path(csv_path(plan.root, 'raw'), file)}: its rows past the first {SCHEMA_ROWS} change the "
          f"column type or width ({a.dtype if a else None} {a.shape if a else ''} from the first rows, "
          f"{b.dtype if b else None} {b.shape if b else ''} from the whole file)")


SCHEMA_ROWS = 1000  # the launcher types the columns from this many first rows; workers check the rest


def graph_features_from_plan(plan: GraphPlan, feature_dtype: str) -> Features:
  """The record schema of a graph-property data set, from the first rows of its files (at launch).

  Args:
    plan, feature_dtype: as `read_graph_property` takes them.

  Returns:
    The `Features`, as `graph_features` makes them.

  Raises:
    OgbMissingFileError: graph-label.csv.gz or a count file is absent.
    OgbFormatError: a malformed first chunk, or an empty file that should hold rows.
  """
  raw = csv_path(plan.root, "raw")
  _, raw_files = list_dir(raw)

  def first(name: str, section: str, expected: int, what: str, source: str):
    if name not in raw_files:
      return None
    with open_input(csv_path(raw, name)) as f:
      chunk = next(read_csv_chunks(f, csv_path(raw, name), "auto", None, SCHEMA_ROWS,
                                   nonfinite=plan.nonfinite(section)), None)
    if chunk is None:
      check_rows(csv_path(raw, name), 0, expected, what, csv_path(raw, source))
      return np.zeros((0, 1))
    return chunk[1]

  num_graphs = len(read_counts(csv_path(raw, "num-node-list.csv.gz")))
  nf = first("node-feat.csv.gz", "node/feat", plan.num_nodes[""], "nodes", "num-node-list.csv.gz")
  ef = first("edge-feat.csv.gz", "edge/feat", plan.num_edges[""], "edges", "num-edge-list.csv.gz")
  label = first("graph-label.csv.gz", "graph/label", num_graphs, "graphs", "num-node-list.csv.gz")
  if label is None:
    raise OgbMissingFileError(f"{csv_path(raw, 'graph-label.csv.gz')}: missing file")
  return graph_features(
      None if nf is None else cast_like_ogb(nf, "float", feature_dtype, csv_path(raw, "node-feat.csv.gz")),
      None if ef is None else cast_like_ogb(ef, "float", feature_dtype, csv_path(raw, "edge-feat.csv.gz")),
      cast_like_ogb(label, "auto", "float32", csv_path(raw, "graph-label.csv.gz")))


