"""The launcher's look at an OGB data set folder: its layout, counts and every file the job reads.

`plan_graph` reads only small files (OGB's count files, master.csv, the
directory listing) and the shapes inside `.npz` headers; it returns a frozen
`GraphPlan` that the workers follow. Also the file helpers the other steps share.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import math
import zipfile

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
import numpy as np

from formats.storage import files as fs
from pipelines.core.errors import UsageError
from pipelines.ogb_graphs.read import (
    NpzMember, OgbFormatError, OgbMissingFileError, check_ids, check_rows, dataset_info, read_csv_all, to_int64)

PIPELINE = "pipelines.ogb_graphs"
NPZ_EDGE_RANGE = 1 << 22  # edges per EdgeSource of a stored data.npz edge_index


def open_input(path: str):
  """Opens an input file (local or gs://) as stored: gzip files are decompressed by their readers.

  Args:
    path: the file.

  Returns:
    A binary file object.

  Raises:
    OSError: the file cannot be opened.
  """
  return FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)





@dataclasses.dataclass(frozen=True)
class EdgeSource:
  """Edges of one relation ("" when homogeneous): a gzip CSV or a row range of an npz."""

  relation: str
  path: str
  num_rows: int  # nodes of the head type (CSR rows)
  num_cols: int  # nodes of the tail type
  extras: tuple[tuple[str, str], ...] = ()  # (section name, edge-aligned CSV) read in lockstep
  npz_range: tuple[int, int] | None = None
  reverse: bool = False  # key by destination: the CSC pass
  reverse_of: str = ""  # an added reverse relation: the raw relation whose files it reads, edges turned around
  num_edges: int = -1  # rows the CSV must hold, as `count_file` says (-1: not checked)
  count_file: str = ""


@dataclasses.dataclass(frozen=True)
class GraphPlan:
  """What the launcher found: the layout and every file the job will read."""

  root: str
  name: str
  layout: str  # "homogeneous", "heterogeneous", "binary" or "graphs"
  task: str  # "node", "link" or "graph"
  add_inverse: bool
  num_nodes: dict[str, int]  # node type ("" when homogeneous) -> count
  num_edges: dict[str, int]  # relation -> edges in the files
  node_files: tuple[tuple[str, str, str], ...]  # (section, path, dtype kind "int"/"float"/"auto")
  split_files: tuple[tuple[str, str], ...]  # (section prefix, path)
  edge_files: tuple[EdgeSource, ...]
  part_size: dict[str, int]  # relation -> nodes per partition
  node_count_file: str = ""  # the file that says how many nodes each type has
  allow_nonfinite: bool = False  # --allow_nonfinite
  edges_per_partition: int = 0  # --edges_per_partition (0: plans made without it size by `part_size` only)

  def __post_init__(self):
    """Refuses two files of one section (node-feat.csv.gz beside node_feat.csv.gz: both are node/feat)."""
    for files in ([(f[0], f[1]) for f in self.node_files], *(list(s.extras) for s in self.edge_files)):
      seen: dict[str, str] = {}
      for section, path in files:
        if section in seen:
          raise OgbFormatError(f"{path}: a second file for {section} (beside {seen[section].rsplit('/', 1)[-1]})")
        seen[section] = path

  def rows_per_partition(self, key: str) -> int:
    """Rows of one sort partition of the CSR `key` ("<relation>", or "csc:<relation>" for its CSC).

    A CSC's rows are the relation's tail type: sized by that type's node count, so that a partition
    holds about --edges_per_partition edges however many nodes the head type has.

    Args:
      key: the relation, prefixed "csc:" for the reverse (in-neighbour) CSR.

    Returns:
      The rows per partition, at least 1.
    """
    relation = key.removeprefix("csc:")
    head, tail = relation_types(relation)
    if key == relation or head == tail or not self.edges_per_partition:
      return self.part_size[relation]
    return nodes_per_partition(self.num_nodes[tail], self.num_edges[relation] * (2 if self.add_inverse else 1),
                               self.edges_per_partition)

  def nonfinite(self, section: str) -> str:
    """What a float cell of `section` may hold: see read_csv_chunks' `nonfinite`.

    Args:
      section: the node or edge section (e.g. "node/label").

    Returns:
      "allow" with --allow_nonfinite; else "nan" for labels (a missing label) and "error" for the rest.
    """
    if self.allow_nonfinite:
      return "allow"
    return "nan" if section.rsplit("/", 1)[-1] == "label" else "error"


def csv_path(root: str, *parts: str) -> str:
  """The path of a file of the data set folder (`formats.storage.files.join`).

  Args:
    root: the data set folder.
    *parts: the path below it (e.g. "raw", "edge.csv.gz").

  Returns:
    The joined path, local or gs://.
  """
  return fs.join(root, *parts)


def read_small(path: str, dtype: str, ncols: int | None = None, header: bool = False, nonfinite: str = "error"):
  """A small gzip CSV (counts, type lists) read whole, at launch or on one worker: `read_csv_all` of `path`.

  The arguments after `path` and the array returned are `read_csv_all`'s.

  Raises:
    OgbMissingFileError: the file does not exist.
    OgbFormatError: a malformed row or cell (the message names the line).
  """
  if not fs.exists(path):
    raise OgbMissingFileError(f"{path}: missing file")
  with open_input(path) as f:
    return read_csv_all(f, path, dtype, ncols, header=header, nonfinite=nonfinite)


def read_counts(path: str) -> np.ndarray:
  """A num-node-list / num-edge-list file: one non-negative count per graph.

  Args:
    path: the count file.

  Returns:
    The counts, one per graph (1-D int64).

  Raises:
    OgbMissingFileError: the file does not exist.
    OgbFormatError: no rows, a malformed row, or a negative count.
  """
  counts = read_small(path, "int", 1)[:, 0]
  if len(counts) == 0:
    raise OgbFormatError(f"{path}: line 1: no rows (one count per graph expected)")
  negative = np.flatnonzero(counts < 0)
  if negative.size:
    raise OgbFormatError(f"{path}: line {int(negative[0]) + 1}: negative count {int(counts[negative[0]])}")
  return counts


def read_graph_counts(raw: str) -> tuple[str, str, np.ndarray, np.ndarray]:
  """The per-graph counts of a CSV data set: raw/num-node-list.csv.gz and raw/num-edge-list.csv.gz.

  Args:
    raw: the data set's raw/ folder.

  Returns:
    (node count file, edge count file, nodes per graph, edges per graph).

  Raises:
    OgbMissingFileError: a count file does not exist.
    OgbFormatError: a count file that `read_counts` refuses, or the two count different numbers of graphs.
  """
  node_list, edge_list = csv_path(raw, "num-node-list.csv.gz"), csv_path(raw, "num-edge-list.csv.gz")
  num_nodes, num_edges = read_counts(node_list), read_counts(edge_list)
  if len(num_edges) != len(num_nodes):
    check_rows(edge_list, len(num_edges), len(num_nodes), "graphs", node_list)
  return node_list, edge_list, num_nodes, num_edges


def list_dir(path: str) -> tuple[list[str], list[str]]:
  """(folders, files) directly in `path`; both empty when it is absent (optional parts of the layout).

  Args:
    path: a folder, local or gs://.

  Returns:
    (folder names, file names), as `formats.storage.files.list_dir` gives them.
  """
  try:
    return fs.list_dir(path)
  except (FileNotFoundError, NotADirectoryError):
    return [], []


def _splits(root: str, type_dirs: Sequence[str] = ()) -> list[tuple[str, str]]:
  """(section prefix, file) of each split file: split/<name>/[<node type>/]{train,valid,test}.{csv.gz,pt}.

  Raises:
    OgbFormatError: two files of one split part (train.csv.gz beside train.pt): one section, two sources.
  """
  out = {}
  split_root = csv_path(root, "split")
  for split_name in list_dir(split_root)[0]:
    for t in ("", *type_dirs):  # a heterogeneous link split (ogbl-biokg) holds its files in split/<name>/
      folder = fs.join(split_root, split_name, t) if t else fs.join(split_root, split_name)
      for f in list_dir(folder)[1]:
        stem = f.split(".")[0]
        if stem in ("train", "valid", "test") and (f.endswith(".csv.gz") or f.endswith(".pt")):
          prefix = "/".join(x for x in ("split", split_name, t, stem) if x)
          if prefix in out:
            raise OgbFormatError(f"{fs.join(folder, f)}: a second file for {prefix} (beside "
                                 f"{out[prefix].rsplit('/', 1)[-1]})")
          out[prefix] = fs.join(folder, f)
  return sorted(out.items())


def plan_graph(root: str, name: str, add_inverse_flag: str, edges_per_partition: int,
               allow_nonfinite: bool = False) -> GraphPlan:
  """Reads the small files (counts, file lists) and decides what the job reads.

  Args:
    root: the data set folder (holding raw/ and split/).
    name: the OGB name (e.g. "ogbn-arxiv"), looked up in the ogb package's master.csv.
    add_inverse_flag: "auto" (as master.csv says), "true" or "false".
    edges_per_partition: the edges a partition aims to hold; sets the nodes per partition.
    allow_nonfinite: keep NaN/inf in float files (--allow_nonfinite).

  Returns:
    The frozen `GraphPlan`.

  Raises:
    UsageError: no raw/ folder, or "auto" for a name master.csv does not know.
    OgbMissingFileError: a file the layout needs is absent.
    OgbFormatError: a count file or `.npz` header is malformed or inconsistent.
  """
  plan = _plan_graph(root, name, add_inverse_flag, edges_per_partition)
  if plan.task == "node":
    check_node_splits(plan)
  return dataclasses.replace(plan, allow_nonfinite=allow_nonfinite, edges_per_partition=edges_per_partition)


def check_node_splits(plan: GraphPlan) -> None:
  """Reads a node-property set's split files at launch (not at the end of the job) and refuses an id out of
  range or a node named twice among the parts of one split (train, valid, test): in two parts a test node is
  trained on, twice in one it is read twice an epoch. OGB's node splits are disjoint.

  Raises:
    OgbFormatError: the file and line of the bad id, or of a node's second mention and the part of its first.
  """
  by_split: dict[tuple[str, str], list[tuple[str, np.ndarray]]] = {}
  for prefix, path in plan.split_files:
    parts = prefix.split("/")  # split/<name>/[<node type>/]<part>
    t = parts[2] if len(parts) == 4 else ""
    if path.endswith(".csv.gz") and t in plan.num_nodes:  # else refused when the job reads it
      ids = read_small(path, "int", 1)[:, 0]
      check_ids(ids, plan.num_nodes[t], path, 1)
      by_split.setdefault((parts[1], t), []).append((path, ids))
  for files in by_split.values():
    ids = np.concatenate([i for _, i in files])
    starts = np.cumsum([0] + [len(i) for _, i in files])
    order = np.argsort(ids, kind="stable")  # a repeated id: its mentions in file, then line order
    ranked = ids[order]
    repeats = np.flatnonzero(ranked[1:] == ranked[:-1])
    if repeats.size:
      first, again = int(order[repeats[0]]), int(order[repeats[0] + 1])
      (f, a) = (int(np.searchsorted(starts, k, "right")) - 1 for k in (first, again))
      held = "earlier in this file" if f == a else f"in {files[f][0].rsplit('/', 1)[-1]}"
      raise OgbFormatError(f"{files[a][0]}: line {again - starts[a] + 1}: node {int(ids[again])} is already "
                           f"{held} (node splits must be disjoint)")


def _plan_graph(root: str, name: str, add_inverse_flag: str, edges_per_partition: int) -> GraphPlan:
  raw = csv_path(root, "raw")
  if not fs.is_dir(raw):
    raise UsageError(f"--input {root!r} has no raw/ folder: not an OGB data set folder")
  info = dataset_info(name) or dataset_info(name.replace("_", "-"))
  if add_inverse_flag == "auto":
    if info is None:
      raise UsageError(f"--name {name!r} is not in the installed ogb package's master.csv: "
                            "pass --add_inverse_edges=true or false")
    add_inverse = info.add_inverse_edge
  else:
    add_inverse = add_inverse_flag == "true"
  raw_dirs, raw_files = list_dir(raw)
  task = info.task if info else ("graph" if "graph-label.csv.gz" in raw_files else "node")

  def parts(num_nodes: int, num_edges: int) -> int:
    return nodes_per_partition(num_nodes, num_edges * (2 if add_inverse else 1), edges_per_partition)

  if "num-node-dict.csv.gz" in raw_files:
    return _plan_hetero(root, name, task, add_inverse, info, parts)
  if "data.npz" in raw_files:
    npz = csv_path(raw, "data.npz")
    with open_input(npz) as f:
      edge_index = NpzMember(f, npz, "edge_index")
      num_nodes_list = NpzMember(f, npz, "num_nodes_list")
      if num_nodes_list.shape != (1,):  # as the CSV layout: a node or link data set is one graph
        raise OgbFormatError(f"{num_nodes_list.name}: shape {num_nodes_list.shape}: one graph expected in a "
                             f"{task} data set")
      n = _npz_count(num_nodes_list)
      num_edges_list = NpzMember(f, npz, "num_edges_list")
      if len(edge_index.shape) != 2 or edge_index.shape[0] != 2 or edge_index.dtype.kind not in "iu":
        raise OgbFormatError(f"{edge_index.name}: shape {edge_index.shape} of {edge_index.dtype}, "
                             "expected [2, E] integers")
      e = edge_index.shape[1]
      if e != _npz_count(num_edges_list):
        raise OgbFormatError(f"{edge_index.name}: {e} edges, num_edges_list says {_npz_count(num_edges_list)}")
      deflated = edge_index.compressed
    # A stored edge_index is read in parallel ranges; a deflated one cannot be entered mid-way: one
    # source streams it, inflating it once (each range reader would inflate everything before its range).
    with open_input(npz) as f:
      members = sorted(n[:-4] for n in zipfile.ZipFile(f).namelist())
      # edge_feat and edge_* hold one row per edge, stored beside the edges as the CSV layout's edge files
      edge_members = [k for k in members if k.startswith("edge_") and k != "edge_index"]
      for k in edge_members:
        m = NpzMember(f, npz, k)
        deflated = deflated or m.compressed
        if not m.shape or m.shape[0] != e:
          raise OgbFormatError(f"{m.name}: shape {m.shape} for {e} edges (edge_index)")
    extras = tuple((f"edge/{k[5:]}", f"{npz}#{k}") for k in edge_members)
    chunk = max(e, 1) if deflated else NPZ_EDGE_RANGE
    sources = tuple(EdgeSource("", npz, n, n, extras, npz_range=(a, min(e, a + chunk))) for a in range(0, e, chunk))
    node_files = [("node/feat", csv_path(raw, "data.npz") + "#node_feat", "float")] if "node_feat" in members else []
    node_files += [(f"node/{k[5:]}", csv_path(raw, "data.npz") + f"#{k}", "auto")
                   for k in members if k.startswith("node_") and k != "node_feat"]
    if "node-label.npz" in raw_files:
      node_files += [("node/label", csv_path(raw, "node-label.npz") + "#node_label", "auto")]
    return GraphPlan(root, name, "binary", task, add_inverse, {"": n}, {"": e}, tuple(node_files),
                     tuple(_splits(root)), sources, {"": parts(n, e)}, f"{npz}:num_nodes_list")
  node_list, edge_list, num_nodes, num_edges = read_graph_counts(raw)
  if task == "graph":
    return GraphPlan(root, name, "graphs", task, add_inverse, {"": int(num_nodes.sum())},
                     {"": int(num_edges.sum())}, (), tuple(_splits(root)), (), {}, node_list)
  if len(num_nodes) != 1:
    raise OgbFormatError(f"{node_list}: line 2: {len(num_nodes)} graphs in a {task} data set (one row expected)")
  n, e = int(num_nodes[0]), int(num_edges[0])
  extras = [("edge/feat", csv_path(raw, "edge-feat.csv.gz"))] if "edge-feat.csv.gz" in raw_files else []
  extras += [(f"edge/{f[5:-7]}", csv_path(raw, f)) for f in raw_files if f.startswith("edge_") and f.endswith(".csv.gz")]
  node_files = [("node/feat", csv_path(raw, "node-feat.csv.gz"), "float")] if "node-feat.csv.gz" in raw_files else []
  if "node-label.csv.gz" in raw_files:
    node_files.append(("node/label", csv_path(raw, "node-label.csv.gz"), "auto"))
  node_files += [(f"node/{f[5:-7]}", csv_path(raw, f), "auto") for f in raw_files
                 if f.startswith("node_") and f.endswith(".csv.gz")]
  source = EdgeSource("", csv_path(raw, "edge.csv.gz"), n, n, tuple(extras), num_edges=e, count_file=edge_list)
  return GraphPlan(root, name, "homogeneous", task, add_inverse, {"": n}, {"": e}, tuple(node_files),
                   tuple(_splits(root)), (source,), {"": parts(n, e)}, node_list)


def nodes_per_partition(num_rows: int, num_edges: int, edges_per_partition: int) -> int:
  """Rows of a CSR per sort partition, so that a partition holds about `edges_per_partition` edges.

  Args:
    num_rows: rows of the CSR (nodes of its head type).
    num_edges: edges the CSR stores (inverse edges included).
    edges_per_partition: the edges a partition aims to hold (--edges_per_partition).

  Returns:
    The rows per partition, at least 1.
  """
  count = max(1, math.ceil(num_edges / edges_per_partition))
  return max(1, math.ceil(num_rows / count))


def _npz_count(member: NpzMember) -> int:
  """The sum of a num_nodes_list / num_edges_list array: integers, none negative."""
  counts = member.read(0, member.shape[0]) if member.shape else np.zeros(0, np.int64)
  if member.dtype.kind not in "iu" or counts.ndim != 1:
    raise OgbFormatError(f"{member.name}: shape {member.shape} of {member.dtype}, expected [graphs] integers")
  if (counts < 0).any():
    raise OgbFormatError(f"{member.name}: element {int(np.flatnonzero(counts < 0)[0])}: negative count")
  return int(counts.sum())


def _plan_hetero(root, name, task, add_inverse, info, parts) -> GraphPlan:
  raw = csv_path(root, "raw")
  dict_path = csv_path(raw, "num-node-dict.csv.gz")
  table = read_small(dict_path, "str")
  if len(table) != 2:
    raise OgbFormatError(f"{dict_path}: line {min(len(table), 2) + 1}: expected a header row of node types "
                         "and one row of counts")
  counts = to_int64(table[1:], dict_path, 2)[0]
  if len(set(table[0])) != len(table[0]) or (counts < 0).any():
    raise OgbFormatError(f"{dict_path}: line {1 if len(set(table[0])) != len(table[0]) else 2}: "
                         "repeated node type or negative count")
  num_nodes = {t: int(c) for t, c in sorted(zip(table[0], counts))}
  triplet_path = csv_path(raw, "triplet-type-list.csv.gz")
  triplets = [tuple(row) for row in read_small(triplet_path, "str", 3)]
  if len(set(triplets)) != len(triplets):  # its edges would be stored twice
    line = next(i for i, t in enumerate(triplets) if t in triplets[:i])
    raise OgbFormatError(f"{triplet_path}: line {line + 1}: repeated relation")
  sources, num_edges, part_size = [], {}, {}
  for h, r, t in sorted(triplets):
    rel = f"{h}___{r}___{t}"
    if h not in num_nodes or t not in num_nodes:
      raise OgbFormatError(f"{triplet_path}: line {triplets.index((h, r, t)) + 1}: "
                           f"node type of {rel} not in num-node-dict")
    folder = csv_path(raw, "relations", rel)
    count_file = fs.join(folder, "num-edge-list.csv.gz")
    e = int(read_counts(count_file).sum())
    files = list_dir(folder)[1]
    extras = [("edge/feat", fs.join(folder, "edge-feat.csv.gz"))] if "edge-feat.csv.gz" in files else []
    extras += [(f"edge/{f[5:-7]}", fs.join(folder, f)) for f in files if f.startswith("edge_") and f.endswith(".csv.gz")]
    sources.append(EdgeSource(rel, fs.join(folder, "edge.csv.gz"), num_nodes[h], num_nodes[t], tuple(extras),
                              num_edges=e, count_file=count_file))
    num_edges[rel] = e
    part_size[rel] = parts(num_nodes[h], e)
  node_files = []
  for t in num_nodes:
    feat_dir = csv_path(raw, "node-feat", t)
    for f in list_dir(feat_dir)[1]:
      if f == "node-feat.csv.gz":
        node_files.append((f"node/{t}/feat", fs.join(feat_dir, f), "float"))
      elif f.startswith("node_") and f.endswith(".csv.gz"):
        node_files.append((f"node/{t}/{f[5:-7]}", fs.join(feat_dir, f), "auto"))
    label = csv_path(raw, "node-label", t, "node-label.csv.gz")
    if fs.exists(label):
      node_files.append((f"node/{t}/label", label, "auto"))
  return GraphPlan(root, name, "heterogeneous", task, add_inverse, num_nodes, num_edges, tuple(node_files),
                   tuple(_splits(root, sorted(num_nodes))), tuple(sources), part_size, dict_path)




def cast_like_ogb(arr: np.ndarray, kind: str, feature_dtype: str, where: str) -> np.ndarray:
  """As OGB's readers type them: integer files int64, float files float32 (features:
  `feature_dtype`).

  Args:
    arr: the values read; a 1-D array becomes one column.
    kind: the file's dtype kind, "float" for feature files (else "int" or "auto").
    feature_dtype: the dtype of float features (--feature_dtype).
    where: the file the values come from, for the error.

  Returns:
    A 2-D int64, float32 or `feature_dtype` array.

  Raises:
    OgbFormatError: a finite value too large for the float dtype (it would be stored as inf).
  """
  arr = np.asarray(arr)
  if arr.ndim == 1:
    arr = arr[:, None]
  if arr.dtype.kind != "f":
    return arr.astype(np.int64)
  dtype = np.dtype(feature_dtype if kind == "float" else np.float32)
  with np.errstate(over="ignore"):
    out = arr.astype(dtype)
  if arr.dtype != dtype and (np.isfinite(arr) & ~np.isfinite(out)).any():
    raise OgbFormatError(f"{where}: a finite value too large for {dtype} (it would be stored as inf)"
                         + (" (--feature_dtype=float32 holds larger ones)" if dtype == np.float16 else ""))
  return out



def relation_types(relation: str) -> tuple[str, str]:
  """(head type, tail type) of "head___relation___tail"; ("", "") when homogeneous.

  Args:
    relation: the relation's name, "" for a homogeneous graph.

  Returns:
    (head node type, tail node type).
  """
  if not relation:
    return "", ""
  h, _, t = relation.split("___")
  return h, t
