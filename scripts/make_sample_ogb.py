"""Writes small synthetic OGB data set folders with known ground truth, for tests and benchmarks.

    python scripts/make_sample_ogb.py OUT_DIR [--seed=0]
    python scripts/make_sample_ogb.py OUT_DIR --big=2400000,62000000,100 [--seed=0]
    python scripts/make_sample_ogb.py OUT_DIR --mag=1.0 [--seed=0]
    python scripts/make_sample_ogb.py OUT_DIR --papers=0.01 [--seed=0]

Each folder looks like an OGB download after unzip (the folder that holds
`raw/` and `split/`, e.g. `dataset/ogbn_arxiv`): gzip CSV without header,
`RELEASE_v<version>.txt` (without it OGB's dataset classes prompt on stdin),
an empty `processed/` and `mapping/README.md`, as `ogb.io.DatasetSaver` lays
them out. Without `--big` it writes one folder per layout under OUT_DIR, named
as OGB names them (`ogbn_arxiv`, ...), so `NodePropPredDataset(name, root=OUT_DIR)`
finds them. With `--big=NODES,EDGES,FEAT` it writes one products-like folder;
with `--mag=SCALE` one ogbn-mag-shaped folder, ogbn-mag's counts times SCALE.

Every writer returns an `OgbTruth` with the arrays in file order. Everything is
generated (no download); the same seed gives byte-identical files. Graphs keep
what real data has: self loops, duplicate edges, nodes without out-edges and
isolated nodes (see `OgbTruth.anomalies`).

CSV text is formatted with numpy (no per-value Python) and compressed in a
background thread, so `write_big_homogeneous` and `write_mag` handle products-
and MAG-sized graphs.
Floats are written with a fixed number of decimals ("-0.057943", as arxiv),
and the truth holds exactly the written values as float32.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import shutil
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

HOMOGENEOUS = "homogeneous"
HETEROGENEOUS = "heterogeneous"
BINARY = "binary"
GRAPHS = "graphs"

FEAT_DECIMALS = 6
_CHUNK_ROWS = 1 << 21  # rows formatted per step: ~30 MB of edge text
_SMALL_LEVEL = 6
_BIG_LEVEL = 1
_RELEASE_DATE = "2020-01-01"  # fixed, so that files are byte-identical across runs


@dataclasses.dataclass(frozen=True)
class OgbMeta:
  """The facts of one OGB data set that the files depend on (from ogb's master.csv files)."""

  name: str
  kind: str  # "node" | "link" | "graph"
  layout: str  # HOMOGENEOUS | HETEROGENEOUS | BINARY | GRAPHS
  split: str  # folder under split/
  add_inverse_edge: bool
  node_files: tuple[str, ...] = ()  # "additional node files"
  edge_files: tuple[str, ...] = ()  # "additional edge files"
  version: int = 1
  num_classes: int = -1  # node labels: classes; graph labels: -1
  num_tasks: int = 1

  @property
  def dir_name(self) -> str:
    """The folder name OGB's dataset classes look for under `root` ("ogbn-arxiv" -> "ogbn_arxiv")."""
    return self.name.replace("-", "_")


# Copied from ogb 1.3.6 {nodeproppred,linkproppred,graphproppred}/master.csv;
# the self-check compares them with the installed package.
OGB_META: dict[str, OgbMeta] = {m.name: m for m in [
  OgbMeta("ogbn-arxiv", "node", HOMOGENEOUS, "time", False, ("node_year",), num_classes=40),
  OgbMeta("ogbn-products", "node", HOMOGENEOUS, "sales_ranking", True, num_classes=47),
  OgbMeta("ogbn-mag", "node", HETEROGENEOUS, "time", False, ("node_year",), ("edge_reltype",),
          version=2, num_classes=349),
  OgbMeta("ogbn-papers100M", "node", BINARY, "time", False, ("node_year",), num_classes=172),
  OgbMeta("ogbg-molhiv", "graph", GRAPHS, "scaffold", True, num_tasks=1),
  OgbMeta("ogbg-molpcba", "graph", GRAPHS, "scaffold", True, num_tasks=128),
  OgbMeta("ogbl-collab", "link", HOMOGENEOUS, "time", True, (), ("edge_weight", "edge_year")),
  OgbMeta("ogbl-ddi", "link", HOMOGENEOUS, "target", True),
]}

# ogbn-mag's node types and relations (head, relation, tail).
MAG_NODE_TYPES = ("author", "field_of_study", "institution", "paper")
MAG_RELATIONS = (
  ("author", "affiliated_with", "institution"),
  ("author", "writes", "paper"),
  ("paper", "cites", "paper"),
  ("paper", "has_topic", "field_of_study"),
)
# ogbn-mag's sizes (ogb 1.3.6), which write_mag scales.
MAG_NUM_NODES = {"author": 1_134_649, "field_of_study": 59_965, "institution": 8_740, "paper": 736_389}
MAG_NUM_EDGES = dict(zip(MAG_RELATIONS, (1_043_998, 7_145_660, 5_416_271, 7_505_078)))
MAG_FEAT_DIM = 128
# write_mag's degree skew per relation, (source, destination): an endpoint is node
# `int(u ** p * n)` of a shuffled order, u uniform, so p > 1 makes hubs (p = 1: uniform).
# Prolific authors, highly cited papers, popular fields and large institutions.
MAG_SKEW = dict(zip(MAG_RELATIONS, ((1.0, 2.0), (1.5, 1.5), (1.5, 2.0), (1.0, 2.5))))
# Molecule feature vocabularies (ogb.utils.features: 9 atom, 3 bond features).
ATOM_FEATURE_SIZES = (119, 5, 12, 12, 10, 6, 6, 2, 2)
BOND_FEATURE_SIZES = (5, 6, 2)

Triplet = tuple[str, str, str]


@dataclasses.dataclass(frozen=True, eq=False)
class OgbTruth:
  """What a writer put on disk, arrays in file order (edges as written: no inverse edges added).

  Homogeneous, binary and graph layouts fill the flat fields (for graph data
  sets they are the concatenation over graphs, node ids local to each graph;
  see `per_graph`). The heterogeneous layout fills the `*_dict` fields, keyed
  by node type or (head, relation, tail). `split` maps the split name to
  {"train", "valid", "test"} -> int64 ids (node or graph ids), or for link
  data sets -> {"edge": [M, 2], "edge_neg": [K, 2], ...} as in the .pt files;
  for ogbn-mag -> {"paper": ids}.
  """

  name: str
  kind: str
  layout: str
  folder: Path
  add_inverse_edge: bool
  split_name: str
  files: tuple[str, ...] = ()  # relative paths of the files written, sorted
  num_nodes_list: np.ndarray | None = None  # [G] int64 (one entry for node/link data sets)
  num_edges_list: np.ndarray | None = None  # [G] int64
  edge_index: np.ndarray | None = None  # [2, E] int64
  node_feat: np.ndarray | None = None  # [N, F] float32 (int64 for molecules)
  edge_feat: np.ndarray | None = None  # [E, F] int64 (molecules)
  node_label: np.ndarray | None = None  # [N, 1] int64; float32 with NaN for papers100M
  graph_label: np.ndarray | None = None  # [G, T] int64; float32 with NaN for molpcba
  node_extra: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # "node_year" -> [N, 1]
  edge_extra: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # "edge_weight" -> [E, 1]
  split: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  num_nodes_dict: dict[str, int] = dataclasses.field(default_factory=dict)
  edge_index_dict: dict[Triplet, np.ndarray] = dataclasses.field(default_factory=dict)
  node_feat_dict: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  node_label_dict: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  node_extra_dict: dict[str, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)
  edge_extra_dict: dict[str, dict[Triplet, np.ndarray]] = dataclasses.field(default_factory=dict)
  # "self_loops" / "duplicates": edge positions; "no_out_edges" / "isolated": node ids
  # (degrees counted on the edges as written, before OGB adds inverse edges).
  anomalies: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

  @property
  def num_nodes(self) -> int:
    """Total node count (summed over graphs and node types)."""
    if self.num_nodes_dict:
      return sum(self.num_nodes_dict.values())
    return int(self.num_nodes_list.sum()) if self.num_nodes_list is not None else 0

  def per_graph(self) -> list[dict[str, Any]]:
    """Slices the flat arrays per graph, like OGB's graph list (without inverse edges)."""
    graphs = []
    n0 = e0 = 0
    for n, e in zip(self.num_nodes_list.tolist(), self.num_edges_list.tolist()):
      g: dict[str, Any] = {"num_nodes": n, "edge_index": self.edge_index[:, e0:e0 + e]}
      for key, arr in (("node_feat", self.node_feat), ("edge_feat", self.edge_feat)):
        if arr is not None:
          g[key] = arr[n0:n0 + n] if key.startswith("node") else arr[e0:e0 + e]
      graphs.append(g)
      n0, e0 = n0 + n, e0 + e
    return graphs


# ---------------------------------------------------------------- CSV text

_POW10 = 10 ** np.arange(19, dtype=np.int64)


def _num_digits(a: np.ndarray) -> np.ndarray:
  """Decimal digits of non-negative int64 values (1 for 0)."""
  return np.maximum(np.searchsorted(_POW10, a, side="right"), 1)


def format_csv(values: np.ndarray, decimals: int | None = None) -> bytes:
  """Rows of `values` ([R] or [R, C]) as CSV text, like pandas `to_csv(header=False, index=False)`.

  Integers are written as is; with `decimals`, floats are written in fixed
  point ("%.{decimals}f") and NaN as an empty cell. Vectorised: about
  100 MB of edge text per second on one core (pandas: about 30).
  """
  values = np.asarray(values)
  cols = 1 if values.ndim == 1 else values.shape[1]
  flat = values.reshape(-1)
  if decimals is None:
    if not np.issubdtype(flat.dtype, np.integer):
      raise ValueError(f"integer values expected without decimals, got {flat.dtype}")
    q = flat.astype(np.int64)
    nan = None
  else:
    nan = np.isnan(flat)
    q = np.rint(np.where(nan, 0.0, flat.astype(np.float64)) * 10.0 ** decimals).astype(np.int64)
  neg = q < 0
  mag = np.abs(q)
  digits = _num_digits(mag)
  if decimals:
    digits = np.maximum(digits, decimals + 1)  # "0.05" keeps its leading zero
  width = digits + neg + (1 if decimals else 0)
  if nan is not None:
    width[nan] = 0
  cell_end = np.cumsum(width + 1) - 1  # where each cell's separator goes
  total = int(cell_end[-1]) + 1 if len(flat) else 0
  buf = np.empty(total + 1, np.uint8)  # the extra byte takes writes of absent digits
  seps = np.full(len(flat), ord(","), np.uint8)
  seps[cols - 1::cols] = ord("\n")
  buf[cell_end] = seps
  last = cell_end - 1
  for k in range(int(digits.max()) if len(flat) else 0):
    mag, digit = np.divmod(mag, 10)
    pos = last - k - (1 if decimals and k >= decimals else 0)
    live = k < digits if nan is None else (k < digits) & ~nan
    buf[np.where(live, pos, total)] = digit.astype(np.uint8) + ord("0")
  if decimals:
    dots = last - decimals
    buf[dots if nan is None else dots[~nan]] = ord(".")
  if neg.any():
    buf[(cell_end - width)[neg]] = ord("-")
  return buf[:total].tobytes()


class GzipCsvWriter:
  """Writes one single-member gzip file, compressing in a background thread.

  The gzip header carries no name and mtime 0, so output is deterministic.
  Writes to `<path>.partial` and renames on `close()`.
  """

  def __init__(self, path: str | os.PathLike, level: int = _SMALL_LEVEL):
    self._path = Path(path)
    self._path.parent.mkdir(parents=True, exist_ok=True)
    self._tmp = self._path.with_name(self._path.name + ".partial")
    self._file = open(self._tmp, "wb")
    self._zip = zlib.compressobj(level, zlib.DEFLATED, 31)  # 31: gzip wrapper
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    self._pending: list[concurrent.futures.Future] = []

  def _compress(self, data: bytes) -> None:
    self._file.write(self._zip.compress(data))

  def write(self, data: bytes) -> None:
    """Queues raw text; at most two chunks wait, to bound memory."""
    while len(self._pending) >= 2:
      self._pending.pop(0).result()
    self._pending.append(self._pool.submit(self._compress, data))

  def write_rows(self, values: np.ndarray, decimals: int | None = None) -> None:
    """Formats rows in chunks (see `format_csv`) and queues them."""
    for start in range(0, len(values), _CHUNK_ROWS):
      self.write(format_csv(values[start:start + _CHUNK_ROWS], decimals))

  def close(self) -> None:
    for f in self._pending:
      f.result()
    self._pool.shutdown()
    self._file.write(self._zip.flush())
    self._file.close()
    os.replace(self._tmp, self._path)

  def __enter__(self) -> GzipCsvWriter:
    return self

  def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
    if exc_type is None:
      self.close()
    else:
      self._pool.shutdown(cancel_futures=True)
      self._file.close()
      self._tmp.unlink(missing_ok=True)


def write_csv_gz(path: str | os.PathLike, values: np.ndarray, decimals: int | None = None,
                 header: Sequence[str] | None = None, level: int = _SMALL_LEVEL) -> None:
  """Writes `values` as gzip CSV (no header unless given)."""
  with GzipCsvWriter(path, level) as w:
    if header is not None:
      w.write((",".join(header) + "\n").encode())
    w.write_rows(np.asarray(values), decimals)


def _write_text_gz(path: str | os.PathLike, text: str | bytes) -> None:
  with GzipCsvWriter(path) as w:
    w.write(text.encode() if isinstance(text, str) else text)


def _read_text_gz(path: str | os.PathLike) -> bytes:
  with open(path, "rb") as f:
    return zlib.decompress(f.read(), 47)  # 47: gzip or zlib header


# ---------------------------------------------------------------- folders


def _rng(seed: int, name: str) -> np.random.Generator:
  """A generator derived from the seed and the data set name; a seed is required."""
  if not isinstance(seed, (int, np.integer)):
    raise TypeError(f"seed must be an int, got {seed!r}")
  return np.random.default_rng([int(seed), zlib.crc32(name.encode())])


def _meta(name: str, layout: str) -> OgbMeta:
  meta = OGB_META.get(name)
  if meta is None or meta.layout != layout:
    known = sorted(n for n, m in OGB_META.items() if m.layout == layout)
    raise ValueError(f"{name!r} is not a known {layout} OGB data set; known: {known}")
  return meta


def _start(out: str | os.PathLike, meta: OgbMeta) -> tuple[Path, Path]:
  """Returns (final folder, staging folder); the final one must not exist or be empty."""
  out = Path(out)
  if out.exists() and any(out.iterdir()):
    raise FileExistsError(f"{out} exists and is not empty")
  stage = out.with_name(out.name + ".partial")
  shutil.rmtree(stage, ignore_errors=True)
  (stage / "raw").mkdir(parents=True)
  (stage / "processed").mkdir()  # OGB's zips ship it empty; its classes save there
  (stage / "mapping").mkdir()
  (stage / "mapping" / "README.md").write_text(
    f"# {meta.name}\n\nSynthetic sample from scripts/make_sample_ogb.py: no real ids to map.\n")
  (stage / f"RELEASE_v{meta.version}.txt").write_text(
    f"# Release note for {meta.name}\n\n### v{meta.version}: {_RELEASE_DATE}")
  return out, stage


def _finish(out: Path, stage: Path, meta: OgbMeta, **fields: Any) -> OgbTruth:
  """Moves the staged folder into place (written last) and records its files."""
  if out.exists():
    out.rmdir()
  os.replace(stage, out)
  files = tuple(sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()))
  return OgbTruth(name=meta.name, kind=meta.kind, layout=meta.layout, folder=out,
                  add_inverse_edge=meta.add_inverse_edge, split_name=meta.split, files=files, **fields)


def _write_idx_split(split_dir: Path, split: dict[str, np.ndarray]) -> None:
  for part in ("train", "valid", "test"):
    write_csv_gz(split_dir / f"{part}.csv.gz", split[part])


def _year_split(years: np.ndarray, ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """OGB's time split: train <= 2017, valid 2018, test >= 2019 (ascending ids)."""
  years = years.reshape(-1)
  ids = np.arange(len(years), dtype=np.int64) if ids is None else ids
  y = years[ids]
  return {"train": ids[y <= 2017], "valid": ids[y == 2018], "test": ids[y >= 2019]}


def _ranked_split(rng: np.random.Generator, n: int, fractions: tuple[float, float]) -> dict[str, np.ndarray]:
  """A split in ranking order (not sorted), like products' sales ranking or a scaffold split."""
  order = rng.permutation(n).astype(np.int64)
  a = int(round(n * fractions[0]))
  b = a + int(round(n * fractions[1]))
  return {"train": order[:a], "valid": order[a:b], "test": order[b:]}


# ---------------------------------------------------------------- graphs


def _fill_edges(rng: np.random.Generator, src: np.ndarray, dst: np.ndarray, src_nodes: np.ndarray,
                dst_nodes: np.ndarray, offset: int, self_loops: bool,
                anomalies: dict[str, list[np.ndarray]], skew: tuple[float, float | None] = (2, None)) -> None:
  """Fills `src`/`dst` (views) with skewed random edges, some self loops and duplicates.

  Sources come from `src_nodes` (low positions are hubs: position `int(u ** skew[0] * n)`),
  destinations from `dst_nodes` (uniform when `skew[1]` is None, else like sources);
  nodes in neither get no edges. Positions are recorded from `offset`.
  """
  m = len(src)
  src[:] = src_nodes[(rng.random(m) ** skew[0] * len(src_nodes)).astype(np.int64)]
  if skew[1] is None:
    dst[:] = dst_nodes[rng.integers(0, len(dst_nodes), m)]
  else:
    dst[:] = dst_nodes[(rng.random(m) ** skew[1] * len(dst_nodes)).astype(np.int64)]
  if m < 4:
    return
  if self_loops:
    loops = rng.choice(m, size=max(1, m // 200), replace=False)
    dst[loops] = src[loops]
  dups = np.sort(rng.choice(np.arange(1, m), size=max(1, m // 100), replace=False))
  kept = np.ones(m, bool)
  kept[dups] = False
  kept = np.flatnonzero(kept)  # copy from positions that are not overwritten themselves
  first = kept[(rng.random(len(dups)) * np.searchsorted(kept, dups)).astype(np.int64)]
  src[dups] = src[first]
  dst[dups] = dst[first]
  anomalies["duplicates"].append(dups + offset)


def _random_edges(rng: np.random.Generator, num_edges: int, num_src: int, num_dst: int, *,
                  same_type: bool, chunk: int = _CHUNK_ROWS,
                  skew: tuple[float, float | None] = (2, None)) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """[2, E] int64 edges with hubs, self loops (if `same_type`), duplicates and edge-less nodes.

  About 5% of source-type nodes get no out-edges and, for `same_type`, about
  2% no edges at all; node ids are shuffled so they are not contiguous.
  `skew` is `_fill_edges`'s (the default: source hubs, uniform destinations).
  """
  perm = rng.permutation(num_src).astype(np.int64)
  no_out = max(1, num_src // 20)
  isolated = max(1, num_src // 50) if same_type else 0
  src_nodes = perm[:num_src - no_out - isolated]
  if same_type:
    dst_nodes = perm[:num_src - isolated]
  else:
    dst_nodes = rng.permutation(num_dst).astype(np.int64)[:max(1, num_dst - max(1, num_dst // 50))]
  edge_index = np.empty((2, num_edges), np.int64)
  found: dict[str, list[np.ndarray]] = {"duplicates": []}
  for start in range(0, num_edges, chunk):
    stop = min(start + chunk, num_edges)
    _fill_edges(rng, edge_index[0, start:stop], edge_index[1, start:stop], src_nodes, dst_nodes,
                start, same_type, found, skew)
  out_deg = np.bincount(edge_index[0], minlength=num_src)
  anomalies = {
    "self_loops": np.flatnonzero(edge_index[0] == edge_index[1]) if same_type else np.zeros(0, np.int64),
    "duplicates": np.concatenate(found["duplicates"]) if found["duplicates"] else np.zeros(0, np.int64),
    "no_out_edges": np.flatnonzero(out_deg == 0),
  }
  if same_type:
    in_deg = np.bincount(edge_index[1], minlength=num_src)
    anomalies["isolated"] = np.flatnonzero((out_deg == 0) & (in_deg == 0))
  return edge_index, anomalies


def _features(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
  """[rows, dim] float32 holding exactly the values written with FEAT_DECIMALS."""
  x = rng.standard_normal((rows, dim), dtype=np.float32) * np.float32(0.1)
  return np.round(x.astype(np.float64), FEAT_DECIMALS).astype(np.float32)


def _write_features(writer: GzipCsvWriter, rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
  """Generates and writes features chunk by chunk; returns the float32 truth."""
  out = np.empty((rows, dim), np.float32)
  step = max(1, _CHUNK_ROWS // max(1, dim // 2))
  for start in range(0, rows, step):
    stop = min(start + step, rows)
    chunk = rng.standard_normal((stop - start, dim), dtype=np.float32) * np.float32(0.1)
    chunk64 = np.round(chunk.astype(np.float64), FEAT_DECIMALS)
    out[start:stop] = chunk64
    writer.write(format_csv(chunk64, FEAT_DECIMALS))
  return out


def _write_homogeneous(out: str | os.PathLike, seed: int, num_nodes: int, num_edges: int,
                       feat_dim: int, name: str, level: int, meta: OgbMeta | None = None,
                       labelled: float | None = None) -> OgbTruth:
  meta = meta or _meta(name, HOMOGENEOUS)
  if meta.kind != "node":
    raise ValueError(f"{name} is a {meta.kind} data set; use write_link")
  if num_nodes < 10 or num_edges < 10:
    raise ValueError(f"need at least 10 nodes and edges, got {num_nodes}, {num_edges}")
  out, stage = _start(out, meta)
  raw = stage / "raw"
  rng = _rng(seed, name)
  edge_index, anomalies = _random_edges(rng, num_edges, num_nodes, num_nodes, same_type=True)
  with GzipCsvWriter(raw / "edge.csv.gz", level) as w:
    for start in range(0, num_edges, _CHUNK_ROWS):
      w.write(format_csv(edge_index[:, start:start + _CHUNK_ROWS].T))
  write_csv_gz(raw / "num-node-list.csv.gz", np.array([num_nodes]))
  write_csv_gz(raw / "num-edge-list.csv.gz", np.array([num_edges]))
  with GzipCsvWriter(raw / "node-feat.csv.gz", level) as w:
    node_feat = _write_features(w, rng, num_nodes, feat_dim)
  node_label = rng.integers(0, meta.num_classes, (num_nodes, 1))
  has_label = None
  write_csv_gz(raw / "node-label.csv.gz", node_label, level=level)
  # papers100M: only the `labelled` fraction of nodes is in a split (a one-column CSV has no empty cell
  # for a missing label: an empty line is an empty row)
  has_label = None if labelled is None else rng.random(num_nodes) < labelled
  node_extra = {}
  if "node_year" in meta.node_files:
    years = 2020 - np.minimum(rng.geometric(0.12, (num_nodes, 1)) - 1, 49)
    write_csv_gz(raw / "node_year.csv.gz", years, level=level)
    node_extra["node_year"] = years
    split = _year_split(years, None if has_label is None else np.flatnonzero(has_label))
  else:
    split = _ranked_split(rng, num_nodes, (0.08, 0.02))
  _write_idx_split(stage / "split" / meta.split, split)
  return _finish(out, stage, meta, num_nodes_list=np.array([num_nodes]), num_edges_list=np.array([num_edges]),
                 edge_index=edge_index, node_feat=node_feat, node_label=node_label, node_extra=node_extra,
                 split={meta.split: split}, anomalies=anomalies)


def write_homogeneous_node(out: str | os.PathLike, seed: int, num_nodes: int = 1000, num_edges: int = 5000,
                           feat_dim: int = 16, name: str = "ogbn-arxiv") -> OgbTruth:
  """An ogbn-arxiv (or, with name="ogbn-products", products) style folder.

  raw/{edge,num-node-list,num-edge-list,node-feat,node-label}.csv.gz plus the
  master.csv node files (arxiv: node_year.csv.gz), and
  split/<time|sales_ranking>/{train,valid,test}.csv.gz: arxiv by year
  (ascending ids), products in ranking order (8%/2%/90%, not sorted).
  """
  return _write_homogeneous(out, seed, num_nodes, num_edges, feat_dim, name, _SMALL_LEVEL)


def write_big_homogeneous(out: str | os.PathLike, num_nodes: int, num_edges: int, feat_dim: int, seed: int,
                          name: str = "ogbn-products") -> OgbTruth:
  """The same layout at benchmark size (products: 2_449_029 nodes, 61_859_140 edges, 100 features).

  Writes with gzip level 1; the returned arrays are the only full copies held.
  """
  return _write_homogeneous(out, seed, num_nodes, num_edges, feat_dim, name, _BIG_LEVEL)


# ogbn-papers100M's sizes (ogb 1.3.6): write_papers_csv scales them.
PAPERS_NUM_NODES = 111_059_956
PAPERS_NUM_EDGES = 1_615_685_872
PAPERS_FEAT_DIM = 128
PAPERS_LABELLED = 1_546_782 / PAPERS_NUM_NODES  # train + valid + test nodes


def write_papers_csv(out: str | os.PathLike, seed: int, scale: float = 0.01) -> OgbTruth:
  """An ogbn-papers100M-shaped folder in OGB's raw CSV layout, papers100M's counts times `scale`.

  The homogeneous layout (raw/edge.csv.gz, node-feat.csv.gz with 128 features,
  node-label.csv.gz, node_year.csv.gz, split/time by year over the 1.4 % of
  nodes papers100M labels), written with gzip level 1:
  `scale=0.01` gives about 1.11 M nodes and 16.2 M edges, the graph build's
  1/100 scale model. OGB ships papers100M as `data.npz`; this is the CSV form
  of the same shape, which the converter reads as it reads arxiv.
  """
  if not 0 < scale <= 1:
    raise ValueError(f"scale must be in (0, 1], got {scale}")
  meta = dataclasses.replace(OGB_META["ogbn-papers100M"], layout=HOMOGENEOUS)
  return _write_homogeneous(out, seed, max(10, round(PAPERS_NUM_NODES * scale)),
                            max(10, round(PAPERS_NUM_EDGES * scale)), PAPERS_FEAT_DIM, meta.name, _BIG_LEVEL,
                            meta=meta, labelled=PAPERS_LABELLED)


def write_heterogeneous_node(out: str | os.PathLike, seed: int, num_nodes: dict[str, int] | None = None,
                             num_edges: dict[Triplet, int] | None = None, feat_dim: int = 16) -> OgbTruth:
  """An ogbn-mag style folder (read by ogb's read_csv_heterograph_raw).

  raw/num-node-dict.csv.gz (header row = node types, one row of counts),
  raw/triplet-type-list.csv.gz (head,relation,tail rows),
  raw/relations/<h>___<r>___<t>/{edge,num-edge-list,edge_reltype}.csv.gz,
  raw/node-feat/paper/{node-feat,node_year}.csv.gz,
  raw/nodetype-has-label.csv.gz (header = node types, one row True/False),
  raw/node-label/paper/node-label.csv.gz, and
  split/time/nodetype-has-split.csv.gz + split/time/paper/{train,valid,test}.csv.gz.
  edge_reltype is the relation's position in sorted triplet order (0..3).
  """
  counts = {"author": 400, "field_of_study": 60, "institution": 30, "paper": 500}
  counts.update(num_nodes or {})
  edges = {MAG_RELATIONS[0]: 300, MAG_RELATIONS[1]: 1200, MAG_RELATIONS[2]: 2000, MAG_RELATIONS[3]: 1500}
  edges.update(num_edges or {})
  return _write_heterogeneous(out, seed, counts, edges, feat_dim, _SMALL_LEVEL, {})


def write_mag(out: str | os.PathLike, seed: int, scale: float = 1.0, feat_dim: int = MAG_FEAT_DIM) -> OgbTruth:
  """An ogbn-mag-shaped folder at ogbn-mag's size times `scale`, for tests (0.001) and benchmarks (1.0).

  The layout of `write_heterogeneous_node`, with ogbn-mag's node and edge counts
  (MAG_NUM_NODES, MAG_NUM_EDGES; each at least 10) times `scale`, power-law-ish
  degrees (MAG_SKEW) and `feat_dim` paper features (ogbn-mag: 128). The big files are written with gzip
  level 1. Full scale is 21.1M edges and about 1 GB of feature text.

      truth = write_mag("/tmp/ogbn_mag", seed=0, scale=0.001)  # 736 papers, 7,146 writes edges

  Raises:
    ValueError: `scale` is not positive or `feat_dim` is below 1.
  """
  if not scale > 0 or feat_dim < 1:
    raise ValueError(f"scale must be > 0 and feat_dim >= 1, got scale={scale!r}, feat_dim={feat_dim!r}")
  counts = {t: max(10, round(n * scale)) for t, n in MAG_NUM_NODES.items()}
  edges = {r: max(10, round(e * scale)) for r, e in MAG_NUM_EDGES.items()}
  return _write_heterogeneous(out, seed, counts, edges, feat_dim, _BIG_LEVEL, MAG_SKEW)


def _write_heterogeneous(out: str | os.PathLike, seed: int, counts: dict[str, int], edges: dict[Triplet, int],
                         feat_dim: int, level: int, skew: dict[Triplet, tuple[float, float | None]]) -> OgbTruth:
  """The ogbn-mag layout (see `write_heterogeneous_node`); `level` compresses the big files,
  `skew` maps a relation to `_random_edges`'s skew (the default where absent)."""
  meta = OGB_META["ogbn-mag"]
  if set(counts) != set(MAG_NODE_TYPES) or set(edges) != set(MAG_RELATIONS):
    raise ValueError(f"node types must be {MAG_NODE_TYPES} and relations {MAG_RELATIONS}")
  out, stage = _start(out, meta)
  raw = stage / "raw"
  rng = _rng(seed, meta.name)
  types = sorted(counts)
  write_csv_gz(raw / "num-node-dict.csv.gz", np.array([[counts[t] for t in types]]), header=types)
  triplets = sorted(edges)
  _write_text_gz(raw / "triplet-type-list.csv.gz", "".join(",".join(t) + "\n" for t in triplets))
  edge_index_dict: dict[Triplet, np.ndarray] = {}
  reltype_dict: dict[Triplet, np.ndarray] = {}
  anomalies: dict[str, np.ndarray] = {}
  for reltype, triplet in enumerate(triplets):
    head, _, tail = triplet
    ei, found = _random_edges(rng, edges[triplet], counts[head], counts[tail], same_type=head == tail,
                              skew=skew.get(triplet, (2, None)))
    folder = raw / "relations" / "___".join(triplet)
    write_csv_gz(folder / "edge.csv.gz", ei.T, level=level)
    write_csv_gz(folder / "num-edge-list.csv.gz", np.array([edges[triplet]]))
    reltype_dict[triplet] = np.full((edges[triplet], 1), reltype, np.int64)
    write_csv_gz(folder / "edge_reltype.csv.gz", reltype_dict[triplet], level=level)
    edge_index_dict[triplet] = ei
    for key, value in found.items():
      anomalies[f"{'___'.join(triplet)}/{key}"] = value
  n_paper = counts["paper"]
  with GzipCsvWriter(raw / "node-feat" / "paper" / "node-feat.csv.gz", level) as w:
    node_feat = _write_features(w, rng, n_paper, feat_dim)
  years = 2019 - np.minimum(rng.geometric(0.2, (n_paper, 1)) - 1, 9)
  write_csv_gz(raw / "node-feat" / "paper" / "node_year.csv.gz", years, level=level)
  has = np.array([[t == "paper" for t in types]])
  has_text = ",".join(types) + "\n" + ",".join(str(bool(b)) for b in has[0]) + "\n"
  _write_text_gz(raw / "nodetype-has-label.csv.gz", has_text)
  label = rng.integers(0, meta.num_classes, (n_paper, 1))
  write_csv_gz(raw / "node-label" / "paper" / "node-label.csv.gz", label, level=level)
  split_dir = stage / "split" / meta.split
  _write_text_gz(split_dir / "nodetype-has-split.csv.gz", has_text)
  split = _year_split(years)
  _write_idx_split(split_dir / "paper", split)
  return _finish(out, stage, meta, num_nodes_dict=counts, edge_index_dict=edge_index_dict,
                 node_feat_dict={"paper": node_feat}, node_label_dict={"paper": label},
                 node_extra_dict={"node_year": {"paper": years}},
                 edge_extra_dict={"edge_reltype": reltype_dict},
                 split={meta.split: {k: {"paper": v} for k, v in split.items()}}, anomalies=anomalies)


def write_binary_node(out: str | os.PathLike, seed: int, num_nodes: int = 1000, num_edges: int = 5000,
                      feat_dim: int = 16, labelled: float = 0.3) -> OgbTruth:
  """An ogbn-papers100M style folder (read by ogb's read_binary_graph_raw).

  raw/data.npz (np.savez_compressed: edge_index [2, E] int64, num_nodes_list
  [1], num_edges_list [1], node_feat [N, F] float32, node_year [N, 1] int64),
  raw/node-label.npz (node_label [N, 1] float32, NaN where unlabelled), and
  split/time/{train,valid,test}.csv.gz over labelled nodes only, by year.
  """
  meta = OGB_META["ogbn-papers100M"]
  out, stage = _start(out, meta)
  raw = stage / "raw"
  rng = _rng(seed, meta.name)
  edge_index, anomalies = _random_edges(rng, num_edges, num_nodes, num_nodes, same_type=True)
  node_feat = _features(rng, num_nodes, feat_dim)
  years = 2020 - np.minimum(rng.geometric(0.12, (num_nodes, 1)) - 1, 49)
  label = rng.integers(0, meta.num_classes, (num_nodes, 1)).astype(np.float32)
  has_label = rng.random(num_nodes) < labelled
  label[~has_label] = np.nan
  np.savez_compressed(raw / "data.npz", edge_index=edge_index, num_nodes_list=np.array([num_nodes], np.int64),
                      num_edges_list=np.array([num_edges], np.int64), node_feat=node_feat, node_year=years)
  np.savez_compressed(raw / "node-label.npz", node_label=label)
  split = _year_split(years, np.flatnonzero(has_label))
  _write_idx_split(stage / "split" / meta.split, split)
  return _finish(out, stage, meta, num_nodes_list=np.array([num_nodes]), num_edges_list=np.array([num_edges]),
                 edge_index=edge_index, node_feat=node_feat, node_label=label, node_extra={"node_year": years},
                 split={meta.split: split}, anomalies=anomalies)


def _molecule(rng: np.random.Generator, n: int) -> np.ndarray:
  """[2, E] local edges: a random tree (one direction per bond) plus an occasional ring bond."""
  if n < 2:
    return np.zeros((2, 0), np.int64)
  child = np.arange(1, n)
  parent = (rng.random(n - 1) * child).astype(np.int64)
  flip = rng.random(n - 1) < 0.5
  ei = np.stack([np.where(flip, child, parent), np.where(flip, parent, child)])
  if n >= 5 and rng.random() < 0.5:
    a, b = rng.choice(n, 2, replace=False)
    if not ((ei[0] == a) & (ei[1] == b) | (ei[0] == b) & (ei[1] == a)).any():
      ei = np.concatenate([ei, [[a], [b]]], axis=1)
  return ei


def write_graph_property(out: str | os.PathLike, seed: int, num_graphs: int = 200,
                         name: str = "ogbg-molhiv") -> OgbTruth:
  """An ogbg-mol* style folder: many small graphs, edges in local node ids.

  raw/{edge,num-node-list,num-edge-list,node-feat,edge-feat,graph-label}.csv.gz
  (9 int atom features, 3 int bond features; molhiv labels 0/1, molpcba 128
  tasks with empty cells for NaN) and split/scaffold/{train,valid,test}.csv.gz
  (graph ids, 80/10/10, not sorted). Graph 3 is a single atom without bonds.
  """
  meta = _meta(name, GRAPHS)
  if num_graphs < 10:
    raise ValueError(f"need at least 10 graphs, got {num_graphs}")
  out, stage = _start(out, meta)
  raw = stage / "raw"
  rng = _rng(seed, name)
  sizes = rng.integers(2, 31, num_graphs)
  sizes[3] = 1
  edges = [_molecule(rng, int(n)) for n in sizes]
  edge_index = np.concatenate(edges, axis=1)
  num_edges = np.array([e.shape[1] for e in edges], np.int64)
  num_nodes = sizes.astype(np.int64)
  node_feat = np.stack([rng.integers(0, k, int(num_nodes.sum())) for k in ATOM_FEATURE_SIZES], axis=1)
  edge_feat = np.stack([rng.integers(0, k, edge_index.shape[1]) for k in BOND_FEATURE_SIZES], axis=1)
  write_csv_gz(raw / "edge.csv.gz", edge_index.T)
  write_csv_gz(raw / "num-node-list.csv.gz", num_nodes)
  write_csv_gz(raw / "num-edge-list.csv.gz", num_edges)
  write_csv_gz(raw / "node-feat.csv.gz", node_feat)
  write_csv_gz(raw / "edge-feat.csv.gz", edge_feat)
  if meta.num_tasks == 1:
    label = rng.integers(0, 2, (num_graphs, 1))
    write_csv_gz(raw / "graph-label.csv.gz", label)
  else:
    label = rng.integers(0, 2, (num_graphs, meta.num_tasks)).astype(np.float32)
    label[rng.random(label.shape) < 0.3] = np.nan
    write_csv_gz(raw / "graph-label.csv.gz", label, decimals=0)
  split = _ranked_split(rng, num_graphs, (0.8, 0.1))
  _write_idx_split(stage / "split" / meta.split, split)
  return _finish(out, stage, meta, num_nodes_list=num_nodes, num_edges_list=num_edges, edge_index=edge_index,
                 node_feat=node_feat, edge_feat=edge_feat, graph_label=label, split={meta.split: split},
                 anomalies={"no_edges": np.flatnonzero(num_edges == 0)})


def write_link(out: str | os.PathLike, seed: int, name: str = "ogbl-collab", num_nodes: int = 500,
               num_edges: int = 3000, feat_dim: int = 16, num_eval: int = 150, num_neg: int = 500) -> OgbTruth:
  """An ogbl-collab (or ogbl-ddi) style folder; raw/ holds the training graph only.

  collab: raw/{edge,num-node-list,num-edge-list,node-feat,edge_weight,edge_year}.csv.gz
  and split/time/{train,valid,test}.pt, torch.save'd dicts of int64 tensors:
  train {"edge" [E, 2], "weight" [E], "year" [E]} (the raw edges, same order),
  valid/test {"edge" [M, 2], "weight", "year", "edge_neg" [K, 2]} (years 2018/2019).
  ddi: no node-feat or edge files; split/target/, train {"edge"}, valid/test {"edge", "edge_neg"}.
  """
  import torch  # only link splits need it

  meta = OGB_META.get(name)
  if meta is None or meta.kind != "link":
    raise ValueError(f"{name!r} is not a known link data set; known: "
                     f"{sorted(n for n, m in OGB_META.items() if m.kind == 'link')}")
  out, stage = _start(out, meta)
  raw = stage / "raw"
  rng = _rng(seed, name)
  edge_index, anomalies = _random_edges(rng, num_edges, num_nodes, num_nodes, same_type=True)
  write_csv_gz(raw / "edge.csv.gz", edge_index.T)
  write_csv_gz(raw / "num-node-list.csv.gz", np.array([num_nodes]))
  write_csv_gz(raw / "num-edge-list.csv.gz", np.array([num_edges]))
  node_feat = None
  edge_extra: dict[str, np.ndarray] = {}
  collab = name == "ogbl-collab"
  if collab:
    node_feat = _features(rng, num_nodes, feat_dim)
    write_csv_gz(raw / "node-feat.csv.gz", node_feat, FEAT_DECIMALS)
    edge_extra["edge_weight"] = rng.geometric(0.6, (num_edges, 1)).astype(np.int64)
    edge_extra["edge_year"] = 2017 - np.minimum(rng.geometric(0.15, (num_edges, 1)) - 1, 54)
    for key, value in edge_extra.items():
      write_csv_gz(raw / f"{key}.csv.gz", value)
  split: dict[str, dict[str, np.ndarray]] = {"train": {"edge": np.ascontiguousarray(edge_index.T)}}
  if collab:
    split["train"]["weight"] = edge_extra["edge_weight"][:, 0].copy()
    split["train"]["year"] = edge_extra["edge_year"][:, 0].copy()
  for part, year in (("valid", 2018), ("test", 2019)):
    split[part] = {"edge": rng.integers(0, num_nodes, (num_eval, 2))}
    if collab:
      split[part]["weight"] = rng.geometric(0.6, num_eval).astype(np.int64)
      split[part]["year"] = np.full(num_eval, year, np.int64)
    split[part]["edge_neg"] = rng.integers(0, num_nodes, (num_neg, 2))
  split_dir = stage / "split" / meta.split
  split_dir.mkdir(parents=True)
  for part, arrays in split.items():
    torch.save({k: torch.from_numpy(v) for k, v in arrays.items()}, split_dir / f"{part}.pt")
  return _finish(out, stage, meta, num_nodes_list=np.array([num_nodes]), num_edges_list=np.array([num_edges]),
                 edge_index=edge_index, node_feat=node_feat, edge_extra=edge_extra, split={meta.split: split},
                 anomalies=anomalies)


# ---------------------------------------------------------------- breaking folders


def _target(folder: str | os.PathLike, dst: str | os.PathLike | None) -> Path:
  """The folder to break: a fresh copy at `dst`, or `folder` itself."""
  if dst is None:
    return Path(folder)
  shutil.copytree(folder, dst)
  return Path(dst)


def _rewrite_line(path: Path, line: int, edit: Callable[[bytes], bytes]) -> None:
  lines = _read_text_gz(path).split(b"\n")
  if not 1 <= line <= len(lines) - 1:
    raise ValueError(f"{path} has {len(lines) - 1} lines; line {line} is out of range")
  lines[line - 1] = edit(lines[line - 1])
  _write_text_gz(path, b"\n".join(lines))


def corrupt_bad_row(folder: str | os.PathLike, file: str = "raw/edge.csv.gz", line: int = 3, *,
                    kind: str = "non_numeric", dst: str | os.PathLike | None = None) -> int:
  """Breaks one line of a gzip CSV; returns it as a 1-based line of the file.

  kind: "non_numeric" (first cell becomes "x<cell>"), "extra_column" (",7"
  appended) or "missing_column" (last cell dropped). With `dst`, breaks a copy.
  """
  edits = {
    "non_numeric": lambda row: b"x" + row,
    "extra_column": lambda row: row + b",7",
    "missing_column": lambda row: row.rsplit(b",", 1)[0],
  }
  if kind not in edits:
    raise ValueError(f"kind must be one of {sorted(edits)}, got {kind!r}")
  _rewrite_line(_target(folder, dst) / file, line, edits[kind])
  return line


def corrupt_out_of_range(folder: str | os.PathLike, line: int | None = None, *,
                         dst: str | os.PathLike | None = None) -> int:
  """Sets the target of one edge in raw/edge.csv.gz to its graph's node count; returns the line.

  Default line: the middle edge. Works for one graph or many (local ids).
  """
  root = _target(folder, dst)
  raw = root / "raw"
  num_nodes = np.array(_read_text_gz(raw / "num-node-list.csv.gz").split(), np.int64)
  num_edges = np.array(_read_text_gz(raw / "num-edge-list.csv.gz").split(), np.int64)
  total = int(num_edges.sum())
  if total == 0:
    raise ValueError(f"{raw / 'edge.csv.gz'} has no edges")
  line = total // 2 + 1 if line is None else line
  graph = int(np.searchsorted(np.cumsum(num_edges), line - 1, side="right"))
  bad = int(num_nodes[graph])
  _rewrite_line(raw / "edge.csv.gz", line, lambda row: row.split(b",")[0] + b"," + str(bad).encode())
  return line


def remove_file(folder: str | os.PathLike, rel: str, *, dst: str | os.PathLike | None = None) -> Path:
  """Deletes `rel` (a file) from the folder, or from a copy at `dst`; returns the removed path."""
  path = _target(folder, dst) / rel
  path.unlink()
  return path


class _OpensFileWhenUnpickled:
  """Unpickles as `open(marker, "w")`: harmless, but proof that code ran."""

  def __init__(self, marker: str):
    self.marker = marker

  def __reduce__(self) -> tuple[Callable[..., Any], tuple[str, str]]:
    return (open, (self.marker, "w"))


def write_malicious_pt(path: str | os.PathLike, marker: str | os.PathLike | None = None) -> Path:
  """A torch .pt file shaped like a split file whose pickle calls `open(marker, "w")`.

  torch.load(weights_only=True) refuses it (UnpicklingError) without running
  anything; weights_only=False creates the marker file. Returns the marker
  path (default `<path>.pwned`), which must not exist after a safe load.
  """
  import torch

  path = Path(path)
  marker = Path(marker) if marker is not None else path.with_name(path.name + ".pwned")
  payload = {"edge": torch.zeros((2, 2), dtype=torch.int64), "edge_neg": _OpensFileWhenUnpickled(str(marker))}
  torch.save(payload, path)
  return marker


# ---------------------------------------------------------------- command line


def write_all(out_dir: str | os.PathLike, seed: int = 0) -> list[OgbTruth]:
  """One folder per layout under `out_dir`, named as OGB's dataset classes expect."""
  out_dir = Path(out_dir)

  def at(name: str) -> Path:
    return out_dir / OGB_META[name].dir_name

  return [
    write_homogeneous_node(at("ogbn-arxiv"), seed),
    write_homogeneous_node(at("ogbn-products"), seed, name="ogbn-products"),
    write_heterogeneous_node(at("ogbn-mag"), seed),
    write_binary_node(at("ogbn-papers100M"), seed),
    write_graph_property(at("ogbg-molhiv"), seed),
    write_graph_property(at("ogbg-molpcba"), seed, name="ogbg-molpcba"),
    write_link(at("ogbl-collab"), seed),
    write_link(at("ogbl-ddi"), seed, name="ogbl-ddi"),
  ]


def _size(folder: Path, files: Iterable[str]) -> int:
  return sum((folder / f).stat().st_size for f in files)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("out_dir")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--big", default="", help="NODES,EDGES,FEAT: one products-like folder instead")
  parser.add_argument("--papers", type=float, default=None,
                      help="SCALE: one ogbn-papers100M-shaped folder in the raw CSV layout, its counts times SCALE")
  parser.add_argument("--mag", type=float, default=None,
                      help="SCALE: one ogbn-mag-shaped folder instead, ogbn-mag's counts times SCALE (1.0: full size)")
  args = parser.parse_args(argv)
  if sum((bool(args.big), args.mag is not None, args.papers is not None)) > 1:
    parser.error("--big, --mag and --papers each write one folder: give one of them")
  start = time.perf_counter()
  if args.papers is not None:
    truths = [write_papers_csv(Path(args.out_dir) / "ogbn_papers100M", args.seed, args.papers)]
  elif args.mag is not None:
    truths = [write_mag(Path(args.out_dir) / OGB_META["ogbn-mag"].dir_name, args.seed, args.mag)]
  elif args.big:
    nodes, edges, feat = (int(v) for v in args.big.split(","))
    truths = [write_big_homogeneous(Path(args.out_dir) / OGB_META["ogbn-products"].dir_name, nodes, edges, feat,
                                    args.seed)]
  else:
    truths = write_all(args.out_dir, args.seed)
  elapsed = time.perf_counter() - start
  for t in truths:
    print(f"{t.name:16s} {t.layout:14s} {len(t.files):3d} files {_size(t.folder, t.files) / 1e6:10.2f} MB  {t.folder}")
  print(f"{elapsed:.1f}s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
