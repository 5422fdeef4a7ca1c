"""Every array `pipelines.ogb_graphs` writes has the dtype docs/graphbin.md documents.

The sample data sets (scripts/make_sample_ogb.py), extended with float edge
features and float extra files, are converted; each written section is matched
to its row of the doc's tables and checked for dtype, and for values equal to
what `ogb.io.read_graph_raw` (or pandas, read as OGB's dataset classes do) gives
after the documented cast.
"""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pandas as pd
from ogb.io import read_graph_raw
import pytest

from formats import arrayrecord
from formats.storage import files
from formats.graphbin import GraphBin
from formats.manifest import Manifest
from pipelines import ogb_graphs
from scripts import make_sample_ogb as mo
from tests.conftest import REPO

pytestmark = pytest.mark.slow

FEATURE_DTYPES = {"float32": "<f4", "float16": "<f2"}


# --------------------------------------------------------------------------- the doc's tables


def _doc_tables(doc: str) -> list[tuple[re.Pattern, str, str]]:
  """(name pattern, integer-input dtype, float-input dtype) of every table row naming an array."""
  with open(os.path.join(REPO, "docs", doc)) as f:
    text = f.read()
  rows = []
  for line in text.splitlines():
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
    if len(cells) != 5 or not cells[0].startswith("`"):
      continue
    name = cells[0].strip("`").replace("\\|", "|")
    pattern = re.escape(name)
    pattern = re.sub(r"<train\\\|valid\\\|test>", "(train|valid|test)", pattern)
    pattern = re.sub(r"<[^>]+>", "[^/]+", pattern)
    rows.append((re.compile(pattern + r"\Z"), _dtype_cell(cells[2]), _dtype_cell(cells[3])))
  return rows


def _dtype_cell(cell: str) -> str:
  """The first backticked token of a cell ("<i4 (<i8 when ids do not fit)" → "<i4"), "as stored" or "—"."""
  m = re.search(r"`([^`]+)`", cell)
  return m[1].replace("\\|", "|") if m else cell


GRAPHBIN_TABLE = _doc_tables("graphbin.md")


def documented_dtype(table, section: str, kind: str, feature_dtype: str, stored: np.dtype) -> np.dtype:
  rows = [r for r in table if r[0].match(section)]
  fewest = min((r[0].pattern.count("[^/]+") for r in rows), default=0)
  rows = [r for r in rows if r[0].pattern.count("[^/]+") == fewest]  # `edge/feat` wins over `edge/<name>`
  assert len(rows) == 1, f"{section}: {len(rows)} rows of the doc match"
  cell = rows[0][1] if kind in "iub" else rows[0][2]
  assert cell != "—", f"{section}: the doc says no {kind!r} input"
  if cell == "--feature_dtype":
    return np.dtype(FEATURE_DTYPES[feature_dtype])
  if cell == "as stored":
    return stored
  return np.dtype(cell)


# --------------------------------------------------------------------------- inputs


def _float_column(rng, rows: int, cols: int) -> np.ndarray:
  return np.round(rng.standard_normal((rows, cols)), mo.FEAT_DECIMALS)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  """The sample folders, plus float edge features and float extra files where OGB allows them."""
  root = tmp_path_factory.mktemp("ogb_dtypes")
  truths = {t.name: t for t in mo.write_all(str(root / "in"), seed=0)}
  rng = np.random.default_rng(7)
  # arxiv: float edge-feat, a float edge_* and a float node_* file.
  arxiv = str(truths["ogbn-arxiv"].folder)
  e, n = int(truths["ogbn-arxiv"].num_edges_list[0]), int(truths["ogbn-arxiv"].num_nodes_list[0])
  mo.write_csv_gz(os.path.join(arxiv, "raw", "edge-feat.csv.gz"), _float_column(rng, e, 3), mo.FEAT_DECIMALS)
  mo.write_csv_gz(os.path.join(arxiv, "raw", "edge_score.csv.gz"), _float_column(rng, e, 1), mo.FEAT_DECIMALS)
  mo.write_csv_gz(os.path.join(arxiv, "raw", "node_score.csv.gz"), _float_column(rng, n, 1), mo.FEAT_DECIMALS)
  # products (inverse edges added): float edge-feat, repeated for the inverse edges.
  products = str(truths["ogbn-products"].folder)
  e = int(truths["ogbn-products"].num_edges_list[0])
  mo.write_csv_gz(os.path.join(products, "raw", "edge-feat.csv.gz"), _float_column(rng, e, 2), mo.FEAT_DECIMALS)
  # mag: float edge-feat on one relation.
  mag = truths["ogbn-mag"]
  rel = ("paper", "cites", "paper")
  rel_dir = os.path.join(str(mag.folder), "raw", "relations", "___".join(rel))
  mo.write_csv_gz(os.path.join(rel_dir, "edge-feat.csv.gz"), _float_column(rng, mag.edge_index_dict[rel].shape[1], 2),
                  mo.FEAT_DECIMALS)
  # molhiv with float bond features.
  mol = truths["ogbg-molhiv"]
  float_mol = str(root / "in" / "ogbg_molhiv_float")
  shutil.copytree(str(mol.folder), float_mol)
  mo.write_csv_gz(os.path.join(float_mol, "raw", "edge-feat.csv.gz"), _float_column(rng, mol.edge_index.shape[1], 3),
                  mo.FEAT_DECIMALS)
  folders = {name: str(t.folder) for name, t in truths.items()}
  folders["ogbg-molhiv-float"] = float_mol
  return truths, folders


CASES = [  # (data set, --feature_dtype)
    ("ogbn-arxiv", "float32"), ("ogbn-arxiv", "float16"), ("ogbn-products", "float32"),
    ("ogbn-mag", "float32"), ("ogbn-mag", "float16"), ("ogbn-papers100M", "float32"),
    ("ogbn-papers100M", "float16"), ("ogbl-collab", "float32"),
]
GRAPH_CASES = [("ogbg-molhiv", "float32"), ("ogbg-molpcba", "float32"), ("ogbg-molhiv-float", "float32"),
               ("ogbg-molhiv-float", "float16")]


@pytest.fixture(scope="module")
def outputs(data, tmp_path_factory):
  _, folders = data
  root = tmp_path_factory.mktemp("ogb_dtypes_out")
  out = {}
  for name, feature_dtype in CASES + GRAPH_CASES:
    dest = str(root / f"{name.replace('-', '_')}_{feature_dtype}")
    base = name.removesuffix("-float")
    ogb_graphs.run([f"--input={folders[name]}", f"--output={dest}", f"--name={base}", "--csc=true",
                    f"--feature_dtype={feature_dtype}", "--edges_per_partition=700"])
    out[(name, feature_dtype)] = (dest, Manifest.loads(files.read_bytes(files.join(dest, "manifest.json"))))
  return out


# --------------------------------------------------------------------------- OGB's view of each array


def _pd(path: str) -> np.ndarray:
  """A headerless gzip CSV as OGB's dataset classes read it (pandas' inferred dtype)."""
  return pd.read_csv(path, compression="gzip", header=None).values


def _csr(src: np.ndarray, dst: np.ndarray, n: int):
  order = np.argsort(src, kind="stable")
  return np.concatenate([[0], np.cumsum(np.bincount(src, minlength=n))]), dst[order], order


def _add_csr(ref: dict, prefix: str, ei: np.ndarray, n_rows: int, n_cols: int, edge_arrays: dict) -> None:
  indptr, indices, order = _csr(ei[0], ei[1], n_rows)
  ref[prefix + "indptr"], ref[prefix + "indices"] = indptr, indices
  for key, value in edge_arrays.items():
    ref[prefix + key] = value[order]
  cindptr, cindices, _ = _csr(ei[1], ei[0], n_cols)
  ref["csc/" + prefix + "indptr"], ref["csc/" + prefix + "indices"] = cindptr, cindices


def _splits(ref: dict, folder: str, prefix: str = "split") -> None:
  split_root = os.path.join(folder, "split")
  for dirpath, _, names in os.walk(split_root):
    for f in names:
      stem = f.split(".")[0]
      rel = os.path.relpath(dirpath, split_root).replace(os.sep, "/")
      if f.endswith(".csv.gz") and stem in ("train", "valid", "test"):
        ref[f"{prefix}/{rel}/{stem}"] = _pd(os.path.join(dirpath, f)).T[0]
      elif f.endswith(".pt"):
        import torch

        for key, value in torch.load(os.path.join(dirpath, f), weights_only=True).items():
          ref[f"{prefix}/{rel}/{stem}/{key}"] = value.numpy()


def reference(name: str, folder: str, add_inverse: bool) -> dict[str, np.ndarray]:
  """{section: OGB's array}, for every section the .graphbin of `name` should hold."""
  raw = os.path.join(folder, "raw")
  ref: dict[str, np.ndarray] = {}
  if name == "ogbn-mag":
    g = read_graph_raw.read_csv_heterograph_raw(raw, add_inverse, ["node_year"], ["edge_reltype"])[0]
    n = g["num_nodes_dict"]
    for (h, r, t), ei in g["edge_index_dict"].items():
      rel = f"{h}___{r}___{t}"
      arrays = {"edge/reltype": g["edge_reltype"][(h, r, t)]}
      feat = os.path.join(raw, "relations", rel, "edge-feat.csv.gz")
      if os.path.exists(feat):  # ogb 1.3.6 slices edge_feat_dict wrongly for one graph: read it as it does
        arrays["edge/feat"] = _pd(feat).astype(np.float32)
      _add_csr(ref, f"rel/{rel}/", ei, n[h], n[t], arrays)
    for t, feat in g["node_feat_dict"].items():
      ref[f"node/{t}/feat"] = feat
    for t, year in g["node_year"].items():
      ref[f"node/{t}/year"] = year
    for t, label in read_graph_raw.read_node_label_hetero(raw).items():
      ref[f"node/{t}/label"] = label
    ref["node_type_offsets"] = np.concatenate([[0], np.cumsum([n[t] for t in sorted(n)])])
    _splits(ref, folder)
    return ref
  if name == "ogbn-papers100M":
    g = read_graph_raw.read_binary_graph_raw(raw, False)[0]
    ref["node/feat"], ref["node/year"] = g["node_feat"], g["node_year"]
    ref["node/label"] = np.load(os.path.join(raw, "node-label.npz"))["node_label"]
    _add_csr(ref, "", g["edge_index"], g["num_nodes"], g["num_nodes"], {})
    _splits(ref, folder)
    return ref
  node_files = sorted(f[:-7] for f in os.listdir(raw) if f.startswith("node_") and f.endswith(".csv.gz"))
  edge_files = sorted(f[:-7] for f in os.listdir(raw) if f.startswith("edge_") and f.endswith(".csv.gz"))
  g = read_graph_raw.read_csv_graph_raw(raw, add_inverse, node_files, edge_files)[0]
  edge_arrays = {f"edge/{k[5:]}": g[k] for k in edge_files}
  if g["edge_feat"] is not None:
    edge_arrays["edge/feat"] = g["edge_feat"]
  _add_csr(ref, "", g["edge_index"], g["num_nodes"], g["num_nodes"], edge_arrays)
  if g["node_feat"] is not None:
    ref["node/feat"] = g["node_feat"]
  for k in node_files:
    ref[f"node/{k[5:]}"] = g[k]
  if os.path.exists(os.path.join(raw, "node-label.csv.gz")):
    ref["node/label"] = _pd(os.path.join(raw, "node-label.csv.gz"))
  _splits(ref, folder)
  return ref


@pytest.fixture(scope="module")
def references(data):
  truths, folders = data
  return {name: reference(name, folders[name], truths[name].add_inverse_edge) for name, _ in CASES}


def _sections(outputs, name, feature_dtype) -> tuple[GraphBin, list[str]]:
  dest, m = outputs[(name, feature_dtype)]
  g = GraphBin(os.path.join(dest, m.files[0].path))
  return g, [s for s in g.sections if s != "meta"]


# --------------------------------------------------------------------------- tests


def test_the_doc_documents_every_array_kind():
  names = {p.pattern for p, _, _ in GRAPHBIN_TABLE}
  assert len(GRAPHBIN_TABLE) >= 20, names
  for pattern, integer, floating in GRAPHBIN_TABLE:
    assert integer != "—" or floating != "—", pattern.pattern


@pytest.mark.parametrize("name,feature_dtype", CASES)
def test_every_section_has_a_reference(outputs, references, name, feature_dtype):
  """No written array escapes the per-array checks below, and none the reference has is missing."""
  _, sections = _sections(outputs, name, feature_dtype)
  assert sorted(sections) == sorted(references[name]), name


SECTION_KINDS = [  # (data set, feature dtype, section): one test per array
    ("ogbn-arxiv", "float32", s) for s in (
        "indptr", "indices", "csc/indptr", "csc/indices", "edge/feat", "edge/score", "node/feat", "node/label",
        "node/year", "node/score", "split/time/train", "split/time/valid", "split/time/test")
] + [
    ("ogbn-arxiv", "float16", s) for s in ("edge/feat", "node/feat", "edge/score", "node/score", "node/label")
] + [
    ("ogbn-products", "float32", s) for s in ("indices", "edge/feat", "node/feat", "split/sales_ranking/train")
] + [
    ("ogbn-mag", fd, s) for fd in ("float32", "float16") for s in (
        "rel/paper___cites___paper/indptr", "rel/paper___cites___paper/indices",
        "rel/paper___cites___paper/edge/feat", "rel/paper___cites___paper/edge/reltype",
        "rel/author___writes___paper/edge/reltype", "csc/rel/author___writes___paper/indptr",
        "csc/rel/author___writes___paper/indices", "node/paper/feat", "node/paper/year", "node/paper/label",
        "node_type_offsets", "split/time/paper/train")
] + [
    ("ogbn-papers100M", fd, s) for fd in ("float32", "float16") for s in (
        "indptr", "indices", "node/feat", "node/year", "node/label", "split/time/valid")
] + [
    ("ogbl-collab", "float32", s) for s in (
        "indices", "edge/weight", "edge/year", "node/feat", "split/time/train/edge", "split/time/valid/edge_neg",
        "split/time/test/weight")
]


@pytest.mark.parametrize("name,feature_dtype,section", SECTION_KINDS)
def test_section_dtype_and_values_are_documented(outputs, references, name, feature_dtype, section):
  g, sections = _sections(outputs, name, feature_dtype)
  assert section in sections, f"{name}: no section {section!r} (has {sections})"
  ref = np.asarray(references[name][section])
  got = g[section]
  want = documented_dtype(GRAPHBIN_TABLE, section, ref.dtype.kind, feature_dtype, ref.dtype)
  assert got.dtype == want, f"{name} {section}: stored {got.dtype.str}, the doc says {want.str}"
  expected = ref.astype(want)
  if got.ndim == 2 and expected.ndim == 1:
    expected = expected[:, None]
  np.testing.assert_array_equal(got, expected)


RECORDS_TABLE = _doc_tables("graphbin.md")


@pytest.mark.parametrize("name,feature_dtype", GRAPH_CASES)
def test_graph_property_record_dtypes_and_values(data, outputs, name, feature_dtype):
  truths, folders = data
  dest, m = outputs[(name, feature_dtype)]
  raw = os.path.join(folders[name], "raw")
  ref = read_graph_raw.read_csv_graph_raw(raw, truths[name.removesuffix("-float")].add_inverse_edge)
  labels = _pd(os.path.join(raw, "graph-label.csv.gz"))
  specs = {k: f for k, f in m.features.items()}
  by_key = {}
  for split in m.splits.values():
    for shard in split.shards:
      for rec in arrayrecord.read_file(os.path.join(dest, shard.path)):
        v = m.features.decode(rec)
        by_key[(int(v["num_nodes"]), v["edge_index"].tobytes(), v["node_feat"].astype(np.float64).tobytes())] = v
  assert len(by_key) == len(ref)
  for key, kind in (("edge_index", "i"), ("num_nodes", "i"), ("node_feat", ref[0]["node_feat"].dtype.kind),
                    ("edge_feat", ref[0]["edge_feat"].dtype.kind), ("label", labels.dtype.kind)):
    want = documented_dtype(RECORDS_TABLE, key, kind, feature_dtype, None)
    assert np.dtype(specs[key].dtype) == want, f"{key}: schema says {specs[key].dtype}, the doc says {want.str}"
  for i, r in enumerate(ref):
    node_feat = r["node_feat"].astype(documented_dtype(RECORDS_TABLE, "node_feat", r["node_feat"].dtype.kind,
                                                       feature_dtype, None))
    v = by_key[(r["num_nodes"], r["edge_index"].astype(np.int64).tobytes(), node_feat.astype(np.float64).tobytes())]
    for key in ("node_feat", "edge_feat"):
      want = documented_dtype(RECORDS_TABLE, key, r[key].dtype.kind, feature_dtype, None)
      assert v[key].dtype == want, f"graph {i} {key}: {v[key].dtype.str}, the doc says {want.str}"
      np.testing.assert_array_equal(v[key], r[key].astype(want))
    want = documented_dtype(RECORDS_TABLE, "label", labels.dtype.kind, feature_dtype, None)
    assert v["label"].dtype == want
    np.testing.assert_array_equal(v["label"], labels[i].astype(want))
