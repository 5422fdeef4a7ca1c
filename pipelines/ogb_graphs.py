"""Open Graph Benchmark data sets → a memory-mappable CSR blob (`.graphbin`), or shards.

    python -m pipelines.ogb_graphs --input=DIR_OR_GS --output=DIR_OR_GS [--name=ogbn-arxiv] \
        [--add_inverse_edges=auto|true|false] [--feature_dtype=float32|float16] [--csc=false] \
        [--allow_nonfinite=false] [--format=array_record|tfrecord] [any Beam option]

`--input` is the data set folder as OGB lays it out (holding `raw/` and
`split/`); nothing is downloaded. Node- and link-property data sets
(homogeneous CSV, heterogeneous mag-style, binary npz) become one `.graphbin`
(docs/graphbin.md); graph-property data sets (ogbg-*) become ArrayRecord or
TFRecord shards with one record per graph.

The CSR build never holds the whole edge list in one worker: edges are read
in chunks, keyed by source-node range (partition), each partition is sorted
into a part file, and one step streams the parts, the node arrays and the
splits into the final file. A bad row or cell, NaN/inf in a feature (unless
--allow_nonfinite=true), a row count that disagrees with OGB's count files or a
node id out of range fails the job with `file: line N: reason` (exit 1); no
manifest is written, so the output never looks complete (docs/ogb_graphs.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import dataclasses
import logging
import math
import os
import shutil
import tempfile
import zipfile

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions
import numpy as np

from formats import commit
from formats import files as fs
from formats.features import Features, Tensor
from formats.graphbin import GraphBin, GraphBinWriter
from formats.manifest import REJECTED_FILENAME, FileInfo, Manifest, Rejected, sha256_file
from pipelines import _cli, _fileio
from pipelines._csr import csr_from_coo, index_dtype, interleave_inverse
from pipelines._ogb import (
    NpzMember, OgbFormatError, OgbMissingFileError, check_ids, check_rows, dataset_info, first_nonfinite,
    load_pt_split, read_csv_all, read_csv_chunks, to_int64)
from pipelines._sink import InputSummary, OutputSpec, Record, WriteOutput

PIPELINE = "pipelines.ogb_graphs"
PARTS_DIR = "_parts"
DEFAULT_EDGES_PER_PARTITION = 1 << 24
_log = logging.getLogger(PIPELINE)


class OgbGraphsOptions(PipelineOptions):
  """Flags of `pipelines.ogb_graphs` beyond the shared ones (`_cli.ConverterOptions`)."""

  @classmethod
  def _add_argparse_args(cls, parser):
    parser.add_argument("--add_inverse_edges", default="auto",
                        help="auto (as OGB's master.csv says for --name), true or false.")
    parser.add_argument("--feature_dtype", default="float32", help="float32 or float16 for float node and edge features.")
    parser.add_argument("--csc", default="false", help="true: also store the reverse (in-neighbour) CSC.")
    parser.add_argument("--edges_per_partition", default=str(DEFAULT_EDGES_PER_PARTITION),
                        help="Edges per sort partition: bounds a worker's memory (~40 bytes/edge).")
    parser.add_argument("--allow_nonfinite", default="false",
                        help="true: keep NaN/inf feature cells (default: a NaN/inf cell fails the job; "
                             "an empty label cell is always a missing label).")


def _open(path: str):
  return FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)


# --------------------------------------------------------------------------- plan


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

  def nonfinite(self, section: str) -> str:
    """What a float cell of `section` may hold: see read_csv_chunks' `nonfinite`."""
    if self.allow_nonfinite:
      return "allow"
    return "nan" if section.rsplit("/", 1)[-1] == "label" else "error"


def _csv(root: str, *parts: str) -> str:
  return fs.join(root, *parts)


def _read_small(path: str, dtype: str, ncols: int | None = None, header: bool = False, nonfinite: str = "error"):
  if not fs.exists(path):
    raise OgbMissingFileError(f"{path}: missing file")
  with _open(path) as f:
    return read_csv_all(f, path, dtype, ncols, header=header, nonfinite=nonfinite)


def _read_counts(path: str) -> np.ndarray:
  """A num-node-list / num-edge-list file: one non-negative count per graph."""
  counts = _read_small(path, "int", 1)[:, 0]
  if len(counts) == 0:
    raise OgbFormatError(f"{path}: line 1: no rows (one count per graph expected)")
  negative = np.flatnonzero(counts < 0)
  if negative.size:
    raise OgbFormatError(f"{path}: line {int(negative[0]) + 1}: negative count {int(counts[negative[0]])}")
  return counts


def _list_dir(path: str) -> tuple[list[str], list[str]]:
  try:
    return fs.list_dir(path)
  except (FileNotFoundError, NotADirectoryError):
    return [], []


def _splits(root: str, task: str, type_dirs: Sequence[str] = ("",)) -> list[tuple[str, str]]:
  out = []
  split_root = _csv(root, "split")
  for split_name in _list_dir(split_root)[0]:
    for t in type_dirs:
      folder = fs.join(split_root, split_name, t) if t else fs.join(split_root, split_name)
      for f in _list_dir(folder)[1]:
        stem = f.split(".")[0]
        if stem in ("train", "valid", "test") and (f.endswith(".csv.gz") or f.endswith(".pt")):
          prefix = "/".join(x for x in ("split", split_name, t, stem) if x)
          out.append((prefix, fs.join(folder, f)))
  return sorted(out)


def plan_graph(root: str, name: str, add_inverse_flag: str, edges_per_partition: int,
               allow_nonfinite: bool = False) -> GraphPlan:
  """Reads the small files (counts, file lists) and decides what the job reads."""
  plan = _plan_graph(root, name, add_inverse_flag, edges_per_partition)
  return dataclasses.replace(plan, allow_nonfinite=allow_nonfinite)


def _plan_graph(root: str, name: str, add_inverse_flag: str, edges_per_partition: int) -> GraphPlan:
  raw = _csv(root, "raw")
  if not fs.is_dir(raw):
    raise _cli.UsageError(f"--input {root!r} has no raw/ folder: not an OGB data set folder")
  info = dataset_info(name) or dataset_info(name.replace("_", "-"))
  if add_inverse_flag == "auto":
    if info is None:
      raise _cli.UsageError(f"--name {name!r} is not in the installed ogb package's master.csv: "
                            "pass --add_inverse_edges=true or false")
    add_inverse = info.add_inverse_edge
  else:
    add_inverse = add_inverse_flag == "true"
  raw_dirs, raw_files = _list_dir(raw)
  task = info.task if info else ("graph" if "graph-label.csv.gz" in raw_files else "node")

  def parts(num_nodes: int, num_edges: int) -> int:
    count = max(1, math.ceil(num_edges * (2 if add_inverse else 1) / edges_per_partition))
    return max(1, math.ceil(num_nodes / count))

  if "num-node-dict.csv.gz" in raw_files:
    return _plan_hetero(root, name, task, add_inverse, info, parts)
  if "data.npz" in raw_files:
    npz = _csv(raw, "data.npz")
    with _open(npz) as f:
      edge_index = NpzMember(f, npz, "edge_index")
      n = _npz_count(NpzMember(f, npz, "num_nodes_list"))
      num_edges_list = NpzMember(f, npz, "num_edges_list")
      if len(edge_index.shape) != 2 or edge_index.shape[0] != 2 or edge_index.dtype.kind not in "iu":
        raise OgbFormatError(f"{edge_index.name}: shape {edge_index.shape} of {edge_index.dtype}, "
                             "expected [2, E] integers")
      e = edge_index.shape[1]
      if e != _npz_count(num_edges_list):
        raise OgbFormatError(f"{edge_index.name}: {e} edges, num_edges_list says {_npz_count(num_edges_list)}")
    chunk = 1 << 22
    sources = tuple(EdgeSource("", _csv(raw, "data.npz"), n, n, npz_range=(a, min(e, a + chunk)))
                    for a in range(0, e, chunk))
    with _open(_csv(raw, "data.npz")) as f:
      members = sorted(n[:-4] for n in zipfile.ZipFile(f).namelist())
    node_files = [("node/feat", _csv(raw, "data.npz") + "#node_feat", "float")] if "node_feat" in members else []
    node_files += [(f"node/{k[5:]}", _csv(raw, "data.npz") + f"#{k}", "auto")
                   for k in members if k.startswith("node_") and k != "node_feat"]
    if "node-label.npz" in raw_files:
      node_files += [("node/label", _csv(raw, "node-label.npz") + "#node_label", "auto")]
    return GraphPlan(root, name, "binary", task, add_inverse, {"": n}, {"": e}, tuple(node_files),
                     tuple(_splits(root, task)), sources, {"": parts(n, e)}, f"{npz}:num_nodes_list")
  node_list, edge_list = _csv(raw, "num-node-list.csv.gz"), _csv(raw, "num-edge-list.csv.gz")
  num_nodes, num_edges = _read_counts(node_list), _read_counts(edge_list)
  if len(num_edges) != len(num_nodes):
    check_rows(edge_list, len(num_edges), len(num_nodes), "graphs", node_list)
  if task == "graph":
    return GraphPlan(root, name, "graphs", task, add_inverse, {"": int(num_nodes.sum())},
                     {"": int(num_edges.sum())}, (), tuple(_splits(root, task)), (), {}, node_list)
  if len(num_nodes) != 1:
    raise OgbFormatError(f"{node_list}: line 2: {len(num_nodes)} graphs in a {task} data set (one row expected)")
  n, e = int(num_nodes[0]), int(num_edges[0])
  extras = [("edge/feat", _csv(raw, "edge-feat.csv.gz"))] if "edge-feat.csv.gz" in raw_files else []
  extras += [(f"edge/{f[5:-7]}", _csv(raw, f)) for f in raw_files if f.startswith("edge_") and f.endswith(".csv.gz")]
  node_files = [("node/feat", _csv(raw, "node-feat.csv.gz"), "float")] if "node-feat.csv.gz" in raw_files else []
  if "node-label.csv.gz" in raw_files:
    node_files.append(("node/label", _csv(raw, "node-label.csv.gz"), "auto"))
  node_files += [(f"node/{f[5:-7]}", _csv(raw, f), "auto") for f in raw_files
                 if f.startswith("node_") and f.endswith(".csv.gz")]
  source = EdgeSource("", _csv(raw, "edge.csv.gz"), n, n, tuple(extras), num_edges=e, count_file=edge_list)
  return GraphPlan(root, name, "homogeneous", task, add_inverse, {"": n}, {"": e}, tuple(node_files),
                   tuple(_splits(root, task)), (source,), {"": parts(n, e)}, node_list)


def _npz_count(member: NpzMember) -> int:
  """The sum of a num_nodes_list / num_edges_list array: integers, none negative."""
  counts = member.read(0, member.shape[0]) if member.shape else np.zeros(0, np.int64)
  if member.dtype.kind not in "iu" or counts.ndim != 1:
    raise OgbFormatError(f"{member.name}: shape {member.shape} of {member.dtype}, expected [graphs] integers")
  if (counts < 0).any():
    raise OgbFormatError(f"{member.name}: element {int(np.flatnonzero(counts < 0)[0])}: negative count")
  return int(counts.sum())


def _plan_hetero(root, name, task, add_inverse, info, parts) -> GraphPlan:
  raw = _csv(root, "raw")
  dict_path = _csv(raw, "num-node-dict.csv.gz")
  table = _read_small(dict_path, "str")
  if len(table) != 2:
    raise OgbFormatError(f"{dict_path}: line {min(len(table), 2) + 1}: expected a header row of node types "
                         "and one row of counts")
  counts = to_int64(table[1:], dict_path, 2)[0]
  if len(set(table[0])) != len(table[0]) or (counts < 0).any():
    raise OgbFormatError(f"{dict_path}: line {1 if len(set(table[0])) != len(table[0]) else 2}: "
                         "repeated node type or negative count")
  num_nodes = {t: int(c) for t, c in sorted(zip(table[0], counts))}
  triplet_path = _csv(raw, "triplet-type-list.csv.gz")
  triplets = [tuple(row) for row in _read_small(triplet_path, "str", 3)]
  sources, num_edges, part_size = [], {}, {}
  for h, r, t in sorted(triplets):
    rel = f"{h}___{r}___{t}"
    if h not in num_nodes or t not in num_nodes:
      raise OgbFormatError(f"{triplet_path}: line {triplets.index((h, r, t)) + 1}: "
                           f"node type of {rel} not in num-node-dict")
    folder = _csv(raw, "relations", rel)
    count_file = fs.join(folder, "num-edge-list.csv.gz")
    e = int(_read_counts(count_file).sum())
    files = _list_dir(folder)[1]
    extras = [("edge/feat", fs.join(folder, "edge-feat.csv.gz"))] if "edge-feat.csv.gz" in files else []
    extras += [(f"edge/{f[5:-7]}", fs.join(folder, f)) for f in files if f.startswith("edge_") and f.endswith(".csv.gz")]
    sources.append(EdgeSource(rel, fs.join(folder, "edge.csv.gz"), num_nodes[h], num_nodes[t], tuple(extras),
                              num_edges=e, count_file=count_file))
    num_edges[rel] = e
    part_size[rel] = parts(num_nodes[h], e)
  node_files = []
  for t in num_nodes:
    feat_dir = _csv(raw, "node-feat", t)
    for f in _list_dir(feat_dir)[1]:
      if f == "node-feat.csv.gz":
        node_files.append((f"node/{t}/feat", fs.join(feat_dir, f), "float"))
      elif f.startswith("node_") and f.endswith(".csv.gz"):
        node_files.append((f"node/{t}/{f[5:-7]}", fs.join(feat_dir, f), "auto"))
    label = _csv(raw, "node-label", t, "node-label.csv.gz")
    if fs.exists(label):
      node_files.append((f"node/{t}/label", label, "auto"))
  return GraphPlan(root, name, "heterogeneous", task, add_inverse, num_nodes, num_edges, tuple(node_files),
                   tuple(_splits(root, task, sorted(num_nodes))), tuple(sources), part_size, dict_path)


# --------------------------------------------------------------------------- read edges


def _edge_chunks(source: EdgeSource, chunk_rows: int, nonfinite: str = "error"
                 ) -> Iterator[tuple[int, np.ndarray, np.ndarray, dict]]:
  """(first edge index, src, dst, {extra section: rows}) in file order.

  The edge CSV must hold as many rows as its num-edge-list says, and every extra file
  as many as the edge CSV: the first line that disagrees is named.
  """
  if source.npz_range is not None:
    a, b = source.npz_range
    with _open(source.path) as f:
      member = NpzMember(f, source.path, "edge_index")
      src, dst = member.read(a, b, row=0).astype(np.int64), member.read(a, b, row=1).astype(np.int64)
    check_ids(src, source.num_rows, f"{source.path}:edge_index[0]", a, unit="element")
    check_ids(dst, source.num_cols, f"{source.path}:edge_index[1]", a, unit="element")
    yield a, src, dst, {}
    return
  handles = [_open(source.path)] + [_open(p) for _, p in source.extras]
  try:
    edges = read_csv_chunks(handles[0], source.path, "int", 2, chunk_rows)
    extra_iters = [read_csv_chunks(h, p, "auto", None, chunk_rows, nonfinite=nonfinite)
                   for h, (_, p) in zip(handles[1:], source.extras)]
    total = 0
    for line, arr in edges:
      total += len(arr)
      if 0 <= source.num_edges < total:
        check_rows(source.path, total, source.num_edges, "edges", source.count_file)
      check_ids(arr[:, 0], source.num_rows, source.path, line)
      check_ids(arr[:, 1], source.num_cols, source.path, line)
      extras = {}
      for (section, path), it in zip(source.extras, extra_iters):
        _, rows = next(it, (line, arr[:0]))
        if len(rows) != len(arr):  # chunks are cut at the same rows: only the file's end differs
          raise OgbFormatError(f"{path}: line {line + len(rows)}: file ends before {source.path} does")
        extras[section] = rows
      yield line - 1, arr[:, 0], arr[:, 1], extras
    if source.num_edges >= 0:
      check_rows(source.path, total, source.num_edges, "edges", source.count_file)
    for (section, path), it in zip(source.extras, extra_iters):
      if next(it, None) is not None:
        raise OgbFormatError(f"{path}: line {total + 1}: more rows than the {total} of {source.path}")
  finally:
    for h in handles:
      h.close()


class _ReadEdgesFn(beam.DoFn):
  """An EdgeSource → ((relation, partition), chunk) with OGB's inverse edges interleaved."""

  def __init__(self, plan: GraphPlan, feature_dtype: str = "float32", chunk_rows: int = 1 << 21):
    self._plan = plan
    self._feature_dtype = feature_dtype
    self._chunk_rows = chunk_rows

  def setup(self):
    self._edges = Metrics.counter(PIPELINE, "edges_read")

  def process(self, source: EdgeSource):
    part_size = self._plan.part_size[source.relation]
    key_rel = ("csc:" if source.reverse else "") + source.relation
    for first, src, dst, extras in _edge_chunks(source, self._chunk_rows, self._plan.nonfinite("edge/feat")):
      self._edges.inc(len(src))
      # As the section stores them (docs/graphbin.md): `edge/feat` as features, other edge files as OGB types them.
      extras = {k: _cast(v, "float" if k == "edge/feat" else "auto", self._feature_dtype) for k, v in extras.items()}
      pos = np.arange(first, first + len(src), dtype=np.int64)
      if self._plan.add_inverse:
        src, dst = interleave_inverse(src, dst)
        pos = np.repeat(pos * 2, 2)
        pos[1::2] += 1
        extras = {k: np.repeat(v, 2, axis=0) for k, v in extras.items()}
      if source.reverse:
        src, dst, extras = dst, src, {}
      part = src // part_size
      order = np.argsort(part, kind="stable")
      for p in np.unique(part):
        idx = order[np.searchsorted(part[order], p, "left"):np.searchsorted(part[order], p, "right")]
        yield (key_rel, int(p)), (int(pos[idx[0]]), src[idx], dst[idx], pos[idx],
                                  {k: v[idx] for k, v in extras.items()})


class _BuildPartFn(beam.DoFn):
  """All chunks of one partition → a part file (local CSR of its node range)."""

  def __init__(self, plan: GraphPlan, parts_dir: str):
    self._plan = plan
    self._parts_dir = parts_dir

  def process(self, element):
    # One temp folder per part, removed here: runners do not promise to call teardown.
    tmp = tempfile.mkdtemp(prefix="ogb-parts-")
    try:
      yield self._build(element, tmp)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)

  def _build(self, element, tmp: str):
    (key_rel, p), chunks = element
    chunks = sorted(chunks, key=lambda c: c[0])  # file order, whatever order the shuffle gave
    relation = key_rel.removeprefix("csc:")
    part_size = self._plan.part_size[relation]
    src = np.concatenate([c[1] for c in chunks])
    dst = np.concatenate([c[2] for c in chunks])
    extras = {}
    for k in chunks[0][4]:
      kinds = {c[4][k].dtype.kind for c in chunks}
      if len(kinds) > 1:  # one chunk all integers, another not: never widen silently
        raise OgbFormatError(f"{dict(self._plan_extras(relation))[k]}: integer and non-integer rows mixed "
                             f"(section {k})")
      extras[k] = np.concatenate([c[4][k] for c in chunks])
    start = p * part_size
    head, tail = _relation_types(relation)
    rows_total = self._plan.num_nodes[tail if key_rel.startswith("csc:") else head]
    rows = min(part_size, rows_total - start)
    cols = self._plan.num_nodes[head if key_rel.startswith("csc:") else tail]
    indptr, indices, order = csr_from_coo(src - start, dst, rows, cols)
    dest = _fileio.join(self._parts_dir, f"{key_rel.replace(':', '_') or 'graph'}-{p:06d}.graphbin")
    local = _fileio.local_staging_path(dest, tmp)
    with GraphBinWriter(local) as w:
      w.add("indptr", indptr)
      w.add("indices", indices.astype(index_dtype(cols), copy=False))
      for name, values in sorted(extras.items()):
        w.add(name, values[order])
    _fileio.publish(local, dest)
    return key_rel, p, len(src), dest


  def _plan_extras(self, relation: str) -> tuple[tuple[str, str], ...]:
    return next((s.extras for s in self._plan.edge_files if s.relation == relation), ())


def _relation_types(relation: str) -> tuple[str, str]:
  if not relation:
    return "", ""
  h, _, t = relation.split("___")
  return h, t


# --------------------------------------------------------------------------- assemble


def _node_array_chunks(path: str, kind: str, feature_dtype: str, n: int, nonfinite: str = "error",
                       count_file: str = "num-node-list") -> Iterator[np.ndarray]:
  """Rows of a node file (CSV or `file.npz#key`), cast as the section will store them.

  The file must hold one row per node and no value that `nonfinite` refuses.
  """
  if "#" in path:
    file, key = path.split("#", 1)
    with _open(file) as f:
      member = NpzMember(f, file, key)
      if not member.shape or member.shape[0] != n:
        raise OgbFormatError(f"{member.name}: shape {member.shape} for {n} nodes ({count_file})")
      step = 1 << 20
      for a in range(0, n, step):
        arr = member.read(a, min(n, a + step))
        bad = first_nonfinite(arr, nonfinite)
        if bad is not None:
          raise OgbFormatError(f"{member.name}: row {a + bad}: non-finite value "
                               "(--allow_nonfinite=true keeps NaN/inf)")
        yield _cast(arr, kind, feature_dtype)
    return
  rows = 0
  with _open(path) as f:
    for line, arr in read_csv_chunks(f, path, "auto", nonfinite=nonfinite):
      rows += len(arr)
      if rows > n:
        check_rows(path, rows, n, "nodes", count_file)
      yield _cast(arr, kind, feature_dtype)
  check_rows(path, rows, n, "nodes", count_file)


def _cast(arr: np.ndarray, kind: str, feature_dtype: str) -> np.ndarray:
  """As OGB's readers type them: integer files int64, float files float32 (features:
  `feature_dtype`)."""
  arr = np.asarray(arr)
  if arr.ndim == 1:
    arr = arr[:, None]
  if arr.dtype.kind == "f":
    return arr.astype(feature_dtype if kind == "float" else np.float32)
  return arr.astype(np.int64)


class _AssembleFn(beam.DoFn):
  """Streams parts, node arrays and splits into the .graphbin, then writes the manifest."""

  def __init__(self, plan: GraphPlan, output: str, file_name: str, feature_dtype: str, csc: bool, source: dict,
               generation: str, expected: commit.Version | None):
    self._plan, self._output, self._file = plan, output, file_name
    self._generation, self._expected = generation, expected
    self._feature_dtype, self._csc, self._source = feature_dtype, csc, source

  def process(self, _, parts):
    plan = self._plan
    by_rel: dict[str, dict[int, tuple[int, str]]] = {}
    for key_rel, p, count, path in parts:
      by_rel.setdefault(key_rel, {})[p] = (count, path)
    tmp = tempfile.mkdtemp(prefix="ogb-assemble-")
    try:
      local = os.path.join(tmp, self._file)
      meta = self._meta()
      with GraphBinWriter(local) as w:
        w.add_meta(meta)
        for source in plan.edge_files if plan.layout != "binary" else plan.edge_files[:1]:
          self._write_csr(w, source.relation, by_rel.get(source.relation, {}), source.extras, reverse=False)
          if self._csc:
            self._write_csr(w, source.relation, by_rel.get("csc:" + source.relation, {}), (), reverse=True)
        for section, path, kind in plan.node_files:
          t = section.split("/")[1] if plan.layout == "heterogeneous" else ""
          n = plan.num_nodes[t]
          chunks = _node_array_chunks(path, kind, self._feature_dtype, n, plan.nonfinite(section),
                                      plan.node_count_file)
          first = next(chunks, None)
          if first is None:  # a type without nodes
            continue
          with w.stream(section, first.dtype.str, (n, first.shape[1])) as s:
            s.write(first)
            for c in chunks:
              if c.dtype.kind != first.dtype.kind:
                raise OgbFormatError(f"{path}: integer and non-integer rows mixed (section {section})")
              s.write(c.astype(first.dtype, copy=False))
        if plan.layout == "heterogeneous":
          counts = [plan.num_nodes[t] for t in sorted(plan.num_nodes)]
          w.add("node_type_offsets", np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
        for prefix, path in plan.split_files:
          self._write_split(w, prefix, path)
      digest, size = sha256_file(local), os.path.getsize(local)
      GraphBin(local, verify=False)  # the file parses: header, table, shapes
      _fileio.publish(local, _fileio.join(self._output, self._relative(self._file)))
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
    manifest = Manifest(
        name=_cli.dataset_name(plan.name.replace("-", "_"), plan.root), file_format="graphbin",
        features=Features({}), splits={}, source=self._source,
        files=(FileInfo(self._relative(self._file), size, digest, "graphbin"),),
        rejected=Rejected(0, {}, self._relative(REJECTED_FILENAME)),
        graph={"layout": plan.layout, "task": plan.task, "num_nodes": plan.num_nodes,
               "num_edges": {k: v * (2 if plan.add_inverse else 1) for k, v in plan.num_edges.items()},
               "add_inverse_edges": plan.add_inverse, "csc": self._csc})
    _fileio.write_bytes(_fileio.join(self._output, manifest.rejected.path), b"")
    parts_dir = _fileio.join(self._output, self._relative(PARTS_DIR))
    fs.delete_many(fs.walk(parts_dir))  # the parts live in this run's generation
    fs.remove_empty_dirs(parts_dir)
    replaced = commit.commit(self._output, self._generation, manifest, self._expected)  # the switch
    commit.cleanup(self._output, replaced=replaced, log=logging.info)
    yield manifest.to_json()

  def _relative(self, name: str) -> str:
    return f"{self._generation}/{name}" if self._generation else name

  def _meta(self) -> dict:
    plan = self._plan
    return {"format": "graphbin", "name": plan.name, "layout": plan.layout, "task": plan.task,
            "num_nodes": plan.num_nodes, "node_types": sorted(plan.num_nodes),
            "relations": [s.relation for s in plan.edge_files if s.relation] if plan.layout == "heterogeneous" else [],
            "add_inverse_edges": plan.add_inverse, "csc": self._csc,
            "splits": sorted({p.rsplit("/", 1)[0] for p, _ in plan.split_files})}

  def _write_csr(self, w: GraphBinWriter, relation: str, parts: dict[int, tuple[int, str]],
                 extras: Sequence[tuple[str, str]], reverse: bool) -> None:
    plan = self._plan
    head, tail = _relation_types(relation)
    rows_type, cols_type = (tail, head) if reverse else (head, tail)
    n_rows, n_cols = plan.num_nodes[rows_type], plan.num_nodes[cols_type]
    part_size = plan.part_size[relation]
    num_parts = max(1, math.ceil(n_rows / part_size))
    total = sum(c for c, _ in parts.values())
    prefix = ("csc/" if reverse else "") + (f"rel/{relation}/" if relation else "")
    opened: dict[int, GraphBin] = {}
    tmp = tempfile.mkdtemp(prefix="ogb-part-")

    def part(p: int) -> GraphBin | None:
      if p not in parts:
        return None
      if p not in opened:
        opened.clear()
        path = parts[p][1]
        local = path if _fileio.is_local(path) else os.path.join(tmp, os.path.basename(path))
        if local != path:
          fs.download(path, local)
        opened[p] = GraphBin(local)
      return opened[p]

    try:
      with w.stream(prefix + "indptr", "<i8", (n_rows + 1,)) as s:
        s.write(np.zeros(1, np.int64))
        offset = 0
        for p in range(num_parts):
          rows = min(part_size, n_rows - p * part_size)
          g = part(p)
          local = np.zeros(rows, np.int64) if g is None else np.asarray(g["indptr"][1:])
          s.write(local + offset)
          offset += 0 if g is None else int(g["indptr"][-1])
      if offset != total:
        raise RuntimeError(f"{relation or 'graph'}: parts hold {total} edges, indptr ends at {offset}")
      idtype = index_dtype(n_cols).str
      with w.stream(prefix + "indices", idtype, (total,)) as s:
        for p in range(num_parts):
          g = part(p)
          if g is not None:
            s.write(g["indices"])
      for section, path in extras:
        first = next((part(p)[section] for p in range(num_parts) if part(p) is not None), None)
        if first is None:
          continue
        with w.stream(prefix + section, first.dtype.str, (total, *first.shape[1:])) as s:
          for p in range(num_parts):
            g = part(p)
            if g is not None:
              if g[section].dtype != first.dtype:
                raise OgbFormatError(f"{path}: integer and non-integer rows mixed (section {prefix + section})")
              s.write(g[section])
    finally:
      opened.clear()
      shutil.rmtree(tmp, ignore_errors=True)

  def _write_split(self, w: GraphBinWriter, prefix: str, path: str) -> None:
    if path.endswith(".pt"):
      with _open(path) as f:
        arrays = load_pt_split(f, path)
      for key, arr in sorted(arrays.items()):
        w.add(f"{prefix}/{key}", np.asarray(arr))
      return
    t = prefix.split("/")[2] if self._plan.layout == "heterogeneous" else ""
    ids = _read_small(path, "int", 1)[:, 0]
    check_ids(ids, self._plan.num_nodes[t] if self._plan.task == "node" else 2**62, path, 1)
    w.add(prefix, ids.astype(np.int64))


# --------------------------------------------------------------------------- graph property


def graph_features(node_feat: np.ndarray | None, edge_feat: np.ndarray | None, label: np.ndarray) -> Features:
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
  """(features, [(graph index, values)], {graph index: split}) of an ogbg-* folder."""
  raw = _csv(plan.root, "raw")
  node_list, edge_list = _csv(raw, "num-node-list.csv.gz"), _csv(raw, "num-edge-list.csv.gz")
  num_nodes, num_edges = _read_counts(node_list), _read_counts(edge_list)
  if len(num_edges) != len(num_nodes):
    check_rows(edge_list, len(num_edges), len(num_nodes), "graphs", node_list)
  _, raw_files = _list_dir(raw)

  def read(file: str, dtype: str, ncols: int | None, expected: int, what: str, source: str, section: str,
           optional: bool = False):
    """A whole file, with one row per node, edge or graph as `source` says."""
    if optional and file not in raw_files:
      return None
    arr = _read_small(_csv(raw, file), dtype, ncols, nonfinite=plan.nonfinite(section))
    check_rows(_csv(raw, file), len(arr), expected, what, source)
    return arr

  e_total, n_total = int(num_edges.sum()), int(num_nodes.sum())
  edges = read("edge.csv.gz", "int", 2, e_total, "edges", edge_list, "edge")
  node_feat = read("node-feat.csv.gz", "auto", None, n_total, "nodes", node_list, "node/feat", optional=True)
  edge_feat = read("edge-feat.csv.gz", "auto", None, e_total, "edges", edge_list, "edge/feat", optional=True)
  label = read("graph-label.csv.gz", "auto", None, len(num_nodes), "graphs", node_list, "graph/label")
  node_feat = None if node_feat is None else _cast(node_feat, "float", feature_dtype)
  edge_feat = None if edge_feat is None else _cast(edge_feat, "float", feature_dtype)
  label = _cast(label, "auto", "float32")
  split_of = {}
  for prefix, path in plan.split_files:
    ids = _read_small(path, "int", 1)[:, 0]
    bad = np.flatnonzero((ids < 0) | (ids >= len(num_nodes)))
    if bad.size:
      raise OgbFormatError(f"{path}: line {int(bad[0]) + 1}: graph id outside [0, {len(num_nodes)})")
    for g in ids:
      split_of[int(g)] = prefix.rsplit("/", 1)[1]
  features = graph_features(node_feat, edge_feat, label)
  graphs = []
  na = ea = 0
  for g, (n, e) in enumerate(zip(num_nodes, num_edges)):
    ei = edges[ea:ea + e].T.astype(np.int64)
    bad = np.nonzero((ei < 0) | (ei >= n))
    if bad[0].size:
      raise OgbFormatError(f"{_csv(raw, 'edge.csv.gz')}: line {ea + int(bad[1][0]) + 1}: node id outside [0, {n}) of graph {g}")
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


class _GraphRecordsFn(beam.DoFn):
  def __init__(self, plan: GraphPlan, feature_dtype: str):
    self._plan, self._feature_dtype = plan, feature_dtype

  def process(self, _):
    features, graphs, split_of = read_graph_property(self._plan, self._feature_dtype)
    for g, values in graphs:
      yield Record(split_of.get(g, "unassigned"), f"{g:012d}", features.encode(values))


# --------------------------------------------------------------------------- CLI


def _parse(argv: Sequence[str] | None) -> tuple[PipelineOptions, dict]:
  options = _cli.parse_options(argv, [OgbGraphsOptions])
  c, o = options.view_as(_cli.ConverterOptions), options.view_as(OgbGraphsOptions)
  root, output, overwrite = _cli.check_input_output(c.input, c.output, c.overwrite,
                                                    "an OGB data set folder holding raw/ and split/")
  if o.add_inverse_edges not in ("auto", "true", "false"):
    raise _cli.UsageError(f"--add_inverse_edges must be auto, true or false, got {o.add_inverse_edges!r}")
  if o.feature_dtype not in ("float32", "float16"):
    raise _cli.UsageError(f"--feature_dtype must be float32 or float16, got {o.feature_dtype!r}")
  _cli.check_file_format(c.file_format)
  name = c.name or os.path.basename(root.rstrip("/")).replace("_", "-")
  return options, dict(
      root=root, output=output, overwrite=overwrite, name=name, file_format=c.file_format,
      num_shards=_cli.int_flag("num_shards", c.num_shards, 0), seed=_cli.int_flag("seed", c.seed, 0),
      add_inverse=o.add_inverse_edges, feature_dtype=o.feature_dtype, csc=_cli.bool_flag("csc", o.csc),
      edges_per_partition=_cli.int_flag("edges_per_partition", o.edges_per_partition, 1),
      allow_nonfinite=_cli.bool_flag("allow_nonfinite", o.allow_nonfinite))


def build(p: beam.Pipeline, args: dict):
  """Adds the conversion to pipeline `p`; returns the PCollection of the manifest."""
  try:
    plan = plan_graph(args["root"], args["name"], args["add_inverse"], args["edges_per_partition"],
                      args.get("allow_nonfinite", False))
  except OgbMissingFileError as e:  # a malformed file stays an OgbFormatError: exit status 1
    raise _cli.UsageError(str(e)) from None
  source = {"pipeline": PIPELINE, "input": args["root"], "ogb_name": args["name"], "layout": plan.layout,
            "add_inverse_edges": plan.add_inverse, "feature_dtype": args["feature_dtype"]}
  if plan.allow_nonfinite:
    source["allow_nonfinite"] = True
  file_name = _cli.dataset_name(args["name"].replace("-", "_"), args["root"]) + ".graphbin"
  if plan.layout == "graphs":
    records = p | "Start" >> beam.Create([None]) | "ReadGraphs" >> beam.ParDo(_GraphRecordsFn(plan, args["feature_dtype"]))
    spec_features = _graph_features_from_plan(plan, args["feature_dtype"])
    split_names = tuple(sorted({pfx.rsplit("/", 1)[1] for pfx, _ in plan.split_files})) or ("train",)
    spec = OutputSpec(
        output=args["output"], name=_cli.dataset_name(args["name"].replace("-", "_"), args["root"]),
        file_format=args["file_format"], features=spec_features, splits=split_names,
        num_shards=args["num_shards"], seed=args["seed"], source=source, generation=args.get("generation", ""), expected=args.get("expected"),
        description=f"OGB graph-property data set {args['name']}, one record per graph ({PIPELINE}).")
    num_graphs = len(_read_counts(_csv(plan.root, "raw", "num-node-list.csv.gz")))
    summary = p | "Summary" >> beam.Create([InputSummary(num_graphs)])
    return {"records": records, "rejects": p | "NoRejects" >> beam.Create([])} | "Write" >> WriteOutput(
        spec, summary=summary)
  parts_dir = _fileio.join(args["output"], args["generation"], PARTS_DIR)
  sources = list(plan.edge_files)
  if args["csc"]:
    sources += [dataclasses.replace(s, reverse=True, extras=()) for s in plan.edge_files]
  parts = (
      p
      | "EdgeSources" >> beam.Create(sources)
      | "SpreadSources" >> beam.Reshuffle()
      | "ReadEdges" >> beam.ParDo(_ReadEdgesFn(plan, args["feature_dtype"]))
      | "GroupByPartition" >> beam.GroupByKey()
      | "SortPartitions" >> beam.ParDo(_BuildPartFn(plan, parts_dir))
  )
  return (
      p
      | "AssembleTrigger" >> beam.Create([None])
      | "Assemble" >> beam.ParDo(
          _AssembleFn(plan, args["output"], file_name, args["feature_dtype"], args["csc"], source,
                      args["generation"], args["expected"]),
          parts=beam.pvalue.AsList(parts))
  )


def _graph_features_from_plan(plan: GraphPlan, feature_dtype: str) -> Features:
  """The record schema of a graph-property data set, from the first rows of its files."""
  raw = _csv(plan.root, "raw")
  _, raw_files = _list_dir(raw)

  def first(name: str, section: str, expected: int, what: str, source: str):
    if name not in raw_files:
      return None
    with _open(_csv(raw, name)) as f:
      chunk = next(read_csv_chunks(f, _csv(raw, name), "auto", None, 1000, nonfinite=plan.nonfinite(section)), None)
    if chunk is None:
      check_rows(_csv(raw, name), 0, expected, what, _csv(raw, source))
      return np.zeros((0, 1))
    return chunk[1]

  num_graphs = len(_read_counts(_csv(raw, "num-node-list.csv.gz")))
  nf = first("node-feat.csv.gz", "node/feat", plan.num_nodes[""], "nodes", "num-node-list.csv.gz")
  ef = first("edge-feat.csv.gz", "edge/feat", plan.num_edges[""], "edges", "num-edge-list.csv.gz")
  label = first("graph-label.csv.gz", "graph/label", num_graphs, "graphs", "num-node-list.csv.gz")
  if label is None:
    raise OgbMissingFileError(f"{_csv(raw, 'graph-label.csv.gz')}: missing file")
  return graph_features(None if nf is None else _cast(nf, "float", feature_dtype),
                        None if ef is None else _cast(ef, "float", feature_dtype), _cast(label, "auto", "float32"))


def run(argv: Sequence[str] | None = None) -> beam.runners.runner.PipelineResult:
  """Parses flags, runs the conversion and waits for it; raises UsageError on bad flags."""
  options, args = _parse(argv)
  return _cli.run_pipeline(options, args, build, PIPELINE)


if __name__ == "__main__":
  _cli.main(run, PIPELINE)
