"""Self-check of scripts/make_sample_ogb.py against the `ogb` package's own readers.

    .venv/bin/python tests/ogb_factory_selftest.py [--big=NODES,EDGES,FEAT]

A throwaway script (not collected by pytest). It writes every sample folder, then:
- OGB_META equals ogb's master.csv rows (add_inverse_edge, split, extra files, version);
- determinism: the same seed writes byte-identical files, another seed does not;
- each folder reads back with ogb.io.read_graph_raw's readers (exact calls
  below) and with OGB's dataset classes (NodePropPredDataset,
  LinkPropPredDataset, GraphPropPredDataset on a copy, with download and the
  stdin prompt patched to fail), and equals the truth;
- the corruption helpers break what they say, on the line they return;
- the malicious .pt is refused by torch.load(weights_only=True) without running.
With --big it times write_big_homogeneous and reads the result back with OGB.
"""

from __future__ import annotations

import argparse
import builtins
import hashlib
import io
import os
import shutil
import sys
import tempfile
import time
from contextlib import redirect_stdout, redirect_stderr
from pathlib import Path

import numpy as np
import pandas as pd
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import make_sample_ogb as mso  # noqa: E402  (scripts/ is not a package)

import ogb  # noqa: E402
import ogb.graphproppred.dataset as gds  # noqa: E402
import ogb.linkproppred.dataset as lds  # noqa: E402
import ogb.nodeproppred.dataset as nds  # noqa: E402
from ogb.io.read_graph_raw import (  # noqa: E402
  read_binary_graph_raw,
  read_csv_graph_raw,
  read_csv_heterograph_raw,
  read_node_label_hetero,
  read_nodesplitidx_split_hetero,
)

FAILS: list[str] = []


def check(ok: bool, what: str) -> None:
  print(("ok   " if ok else "FAIL ") + what)
  if not ok:
    FAILS.append(what)


def same(a, b) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  return a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


def quiet(fn, *args, **kwargs):
  """Runs an OGB call without its progress prints."""
  with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
    return fn(*args, **kwargs)


def inverse_interleaved(edge_index: np.ndarray) -> np.ndarray:
  """What OGB does with add_inverse_edge: each reverse edge right after its edge."""
  out = np.repeat(edge_index, 2, axis=1)
  out[0, 1::2] = edge_index[1]
  out[1, 1::2] = edge_index[0]
  return out


def no_network(*args, **kwargs):
  raise AssertionError("OGB tried to download")


def no_prompt(*args, **kwargs):
  raise AssertionError("OGB prompted on stdin (RELEASE_v*.txt missing?)")


def ogb_class(cls, name: str, folder: Path, tmp: Path):
  """Instantiates an OGB dataset class on a copy of `folder` (it writes processed/)."""
  root = Path(tempfile.mkdtemp(dir=tmp))
  shutil.copytree(folder, root / name.replace("-", "_"))
  return quiet(cls, name=name, root=str(root))


def check_meta() -> None:
  base = Path(ogb.__file__).parent
  for meta in mso.OGB_META.values():
    sub = {"node": "nodeproppred", "link": "linkproppred", "graph": "graphproppred"}[meta.kind]
    master = pd.read_csv(base / sub / "master.csv", index_col=0, keep_default_na=False)[meta.name]
    files = lambda key: () if master[key] == "None" else tuple(master[key].split(","))
    ok = (master["add_inverse_edge"] == str(meta.add_inverse_edge) and master["split"] == meta.split
          and files("additional node files") == meta.node_files and files("additional edge files") == meta.edge_files
          and int(master["version"]) == meta.version
          and (master["binary"] == "True") == (meta.layout == mso.BINARY)
          and master.get("is hetero", "False") == str(meta.layout == mso.HETEROGENEOUS))
    if meta.kind == "node":
      ok = ok and int(master["num classes"]) == meta.num_classes
    if meta.kind == "graph":
      ok = ok and int(master["num tasks"]) == meta.num_tasks
    check(ok, f"OGB_META[{meta.name}] matches ogb {ogb.__version__} master.csv")


def digest(folder: Path) -> dict[str, str]:
  return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(folder.rglob("*")) if p.is_file()}


def check_node_homogeneous(t: mso.OgbTruth, tmp: Path) -> None:
  meta = mso.OGB_META[t.name]
  raw = t.folder / "raw"
  g = quiet(read_csv_graph_raw, str(raw), add_inverse_edge=meta.add_inverse_edge,
            additional_node_files=list(meta.node_files), additional_edge_files=list(meta.edge_files))
  check(len(g) == 1 and g[0]["num_nodes"] == t.num_nodes, f"{t.name}: one graph, {t.num_nodes} nodes")
  want = inverse_interleaved(t.edge_index) if t.add_inverse_edge else t.edge_index
  check(same(g[0]["edge_index"], want), f"{t.name}: edge_index (add_inverse_edge={t.add_inverse_edge})")
  check(g[0]["node_feat"].dtype == np.float32 and same(g[0]["node_feat"], t.node_feat),
        f"{t.name}: node_feat float32 exact")
  for key, value in t.node_extra.items():
    check(same(g[0][key], value), f"{t.name}: {key}")
  check(set(k for k in g[0] if k.startswith("node_") and k != "node_feat") == set(t.node_extra),
        f"{t.name}: extra node files = {sorted(t.node_extra)}")
  label = pd.read_csv(raw / "node-label.csv.gz", compression="gzip", header=None).values
  check(same(label, t.node_label), f"{t.name}: node-label")
  ds = ogb_class(nds.NodePropPredDataset, t.name, t.folder, tmp)
  graph, labels = ds[0]
  check(same(graph["edge_index"], want) and same(labels, t.node_label), f"{t.name}: NodePropPredDataset graph+labels")
  split = ds.get_idx_split()
  check(all(same(split[k], t.split[t.split_name][k]) for k in ("train", "valid", "test")),
        f"{t.name}: get_idx_split ({t.split_name})")
  ids = np.concatenate([split[k] for k in ("train", "valid", "test")])
  check(len(np.unique(ids)) == len(ids), f"{t.name}: splits disjoint ({[len(split[k]) for k in split]})")
  an = t.anomalies
  deg_out = np.bincount(t.edge_index[0], minlength=t.num_nodes)
  check(len(an["self_loops"]) > 0 and len(an["duplicates"]) > 0 and len(an["isolated"]) > 0
        and len(an["no_out_edges"]) > len(an["isolated"]) and (deg_out[an["no_out_edges"]] == 0).all(),
        f"{t.name}: anomalies {{{', '.join(f'{k}: {len(v)}' for k, v in an.items())}}}")
  first = t.edge_index[:, an["duplicates"]]
  keys = t.edge_index[0] * t.num_nodes + t.edge_index[1]
  check(all(keys[p] in keys[:p] for p in an["duplicates"][:50]) and first.shape[1] == len(an["duplicates"]),
        f"{t.name}: duplicate positions repeat an earlier edge")


def check_hetero(t: mso.OgbTruth, tmp: Path) -> None:
  raw = t.folder / "raw"
  g = quiet(read_csv_heterograph_raw, str(raw), add_inverse_edge=False,
            additional_node_files=["node_year"], additional_edge_files=["edge_reltype"])[0]
  check(g["num_nodes_dict"] == t.num_nodes_dict, f"{t.name}: num_nodes_dict {t.num_nodes_dict}")
  check(set(g["edge_index_dict"]) == set(t.edge_index_dict)
        and all(same(g["edge_index_dict"][k], v) for k, v in t.edge_index_dict.items()),
        f"{t.name}: edge_index_dict ({len(t.edge_index_dict)} relations)")
  check(set(g["node_feat_dict"]) == {"paper"} and same(g["node_feat_dict"]["paper"], t.node_feat_dict["paper"]),
        f"{t.name}: node_feat_dict[paper]")
  check(same(g["node_year"]["paper"], t.node_extra_dict["node_year"]["paper"]), f"{t.name}: node_year[paper]")
  check(all(same(g["edge_reltype"][k], v) for k, v in t.edge_extra_dict["edge_reltype"].items()),
        f"{t.name}: edge_reltype per relation")
  labels = read_node_label_hetero(str(raw))
  check(set(labels) == {"paper"} and same(labels["paper"], t.node_label_dict["paper"]),
        f"{t.name}: read_node_label_hetero")
  tr, va, te = read_nodesplitidx_split_hetero(str(t.folder / "split" / "time"))
  want = t.split["time"]
  check(same(tr["paper"], want["train"]["paper"]) and same(va["paper"], want["valid"]["paper"])
        and same(te["paper"], want["test"]["paper"]), f"{t.name}: read_nodesplitidx_split_hetero")
  ds = ogb_class(nds.NodePropPredDataset, t.name, t.folder, tmp)
  graph, labels = ds[0]
  split = ds.get_idx_split()
  check(same(graph["edge_index_dict"][("paper", "cites", "paper")], t.edge_index_dict[("paper", "cites", "paper")])
        and same(split["train"]["paper"], want["train"]["paper"]), f"{t.name}: NodePropPredDataset + get_idx_split")


def check_binary(t: mso.OgbTruth, tmp: Path) -> None:
  raw = t.folder / "raw"
  g = quiet(read_binary_graph_raw, str(raw), add_inverse_edge=False)[0]
  check(same(g["edge_index"], t.edge_index) and g["num_nodes"] == t.num_nodes, f"{t.name}: edge_index, num_nodes")
  check(same(g["node_feat"], t.node_feat) and same(g["node_year"], t.node_extra["node_year"]),
        f"{t.name}: node_feat, node_year")
  label = np.load(raw / "node-label.npz")["node_label"]
  check(same(label, t.node_label) and np.isnan(label).any(),
        f"{t.name}: node_label with NaN ({np.isnan(label).mean():.0%})")
  ds = ogb_class(nds.NodePropPredDataset, t.name, t.folder, tmp)
  split = ds.get_idx_split()
  check(all(same(split[k], t.split["time"][k]) for k in split)
        and not np.isnan(label[np.concatenate(list(split.values())), 0]).any(),
        f"{t.name}: get_idx_split, labelled nodes only")


def check_graphs(t: mso.OgbTruth, tmp: Path) -> None:
  raw = t.folder / "raw"
  gs = quiet(read_csv_graph_raw, str(raw), add_inverse_edge=True)
  mine = t.per_graph()
  ok = len(gs) == len(mine)
  for a, b in zip(gs, mine):
    ok = ok and a["num_nodes"] == b["num_nodes"] and same(a["edge_index"], inverse_interleaved(b["edge_index"]))
    ok = ok and same(a["node_feat"], b["node_feat"]) and same(a["edge_feat"], np.repeat(b["edge_feat"], 2, axis=0))
  check(ok, f"{t.name}: {len(gs)} graphs (edges, inverse edges, node/edge feats int64)")
  check(gs[3]["num_nodes"] == 1 and gs[3]["edge_index"].shape == (2, 0), f"{t.name}: a one-atom graph")
  ds = ogb_class(gds.GraphPropPredDataset, t.name, t.folder, tmp)
  check(same(ds.labels, t.graph_label), f"{t.name}: GraphPropPredDataset labels {ds.labels.dtype} {ds.labels.shape}")
  split = ds.get_idx_split()
  check(all(same(split[k], t.split["scaffold"][k]) for k in split), f"{t.name}: get_idx_split (scaffold)")


def check_link(t: mso.OgbTruth, tmp: Path) -> None:
  meta = mso.OGB_META[t.name]
  raw = t.folder / "raw"
  g = quiet(read_csv_graph_raw, str(raw), add_inverse_edge=True, additional_node_files=[],
            additional_edge_files=list(meta.edge_files))[0]
  check(same(g["edge_index"], inverse_interleaved(t.edge_index)), f"{t.name}: edge_index with inverse edges")
  check((g["node_feat"] is None) == (t.node_feat is None)
        and (t.node_feat is None or same(g["node_feat"], t.node_feat)), f"{t.name}: node_feat")
  for key, value in t.edge_extra.items():
    check(same(g[key], np.repeat(value, 2, axis=0)), f"{t.name}: {key} (repeated for inverse edges)")
  ds = ogb_class(lds.LinkPropPredDataset, t.name, t.folder, tmp)
  split = ds.get_edge_split()
  want = t.split[meta.split]
  ok = set(split) == set(want)
  for part in want:
    ok = ok and set(split[part]) == set(want[part])
    ok = ok and all(split[part][k].dtype == torch.int64 and same(split[part][k].numpy(), v)
                    for k, v in want[part].items())
  check(ok, f"{t.name}: get_edge_split keys {{{', '.join(f'{p}: {sorted(split[p])}' for p in split)}}}")
  loaded = torch.load(t.folder / "split" / meta.split / "valid.pt", weights_only=True)
  check(isinstance(loaded, dict), f"{t.name}: split .pt loads with weights_only=True")


def check_corruptions(arxiv: mso.OgbTruth, molhiv: mso.OgbTruth, tmp: Path) -> None:
  for kind in ("non_numeric", "extra_column", "missing_column"):
    dst = tmp / f"bad_{kind}"
    line = mso.corrupt_bad_row(arxiv.folder, "raw/edge.csv.gz", line=7, kind=kind, dst=dst)
    text = mso._read_text_gz(dst / "raw/edge.csv.gz").split(b"\n")
    try:
      g = quiet(read_csv_graph_raw, str(dst / "raw"))[0]
      err = f"no error, reads edge {g['edge_index'][:, line - 1].tolist()}"
    except Exception as e:  # noqa: BLE001
      err = f"{type(e).__name__}: {str(e).strip()[:70]}"
    # A short row becomes NaN, and OGB's astype(np.int64) turns NaN into a garbage id without an error.
    expect_error = kind != "missing_column"
    check(line == 7 and text[6] != text[5] and err.startswith("no error") != expect_error,
          f"corrupt_bad_row({kind}) line {line} -> OGB {err}")
  dst = tmp / "bad_range"
  line = mso.corrupt_out_of_range(arxiv.folder, dst=dst)
  g = quiet(read_csv_graph_raw, str(dst / "raw"))[0]
  check(g["edge_index"][1, line - 1] == arxiv.num_nodes and (g["edge_index"] >= arxiv.num_nodes).sum() == 1,
        f"corrupt_out_of_range line {line}: OGB reads it silently (id {arxiv.num_nodes} >= num_nodes)")
  dst = tmp / "bad_range_graphs"
  line = mso.corrupt_out_of_range(molhiv.folder, line=10, dst=dst)
  gs = quiet(read_csv_graph_raw, str(dst / "raw"))
  bad = [i for i, g in enumerate(gs) if g["edge_index"].size and g["edge_index"].max() >= g["num_nodes"]]
  check(len(bad) == 1, f"corrupt_out_of_range on graphs line {line}: graph {bad} has a local id >= its num_nodes")
  dst = tmp / "no_edges"
  mso.remove_file(arxiv.folder, "raw/edge.csv.gz", dst=dst)
  try:
    quiet(read_csv_graph_raw, str(dst / "raw"))
    err = "no error"
  except RuntimeError as e:
    err = str(e)
  check(err == "No necessary file", f"remove_file(raw/edge.csv.gz) -> OGB RuntimeError({err!r})")
  dst = tmp / "no_feat"
  mso.remove_file(arxiv.folder, "raw/node-feat.csv.gz", dst=dst)
  g = quiet(read_csv_graph_raw, str(dst / "raw"))[0]
  check(g["node_feat"] is None, "remove_file(raw/node-feat.csv.gz) -> OGB silently gives node_feat None")
  check(tuple(digest(arxiv.folder)) == arxiv.files, "originals untouched (helpers broke copies)")


def check_malicious(tmp: Path) -> None:
  path = tmp / "evil" / "train.pt"
  path.parent.mkdir()
  marker = mso.write_malicious_pt(path)
  try:
    torch.load(path, weights_only=True)
    err = "loaded"
  except Exception as e:  # noqa: BLE001
    err = type(e).__name__
  check(err == "UnpicklingError" and not marker.exists(), f"malicious .pt: weights_only=True -> {err}, nothing ran")
  try:
    torch.load(path)  # torch 2.6+ defaults to weights_only=True
    err = "loaded"
  except Exception as e:  # noqa: BLE001
    err = type(e).__name__
  check(err == "UnpicklingError" and not marker.exists(), f"malicious .pt: torch.load default -> {err}")
  obj = torch.load(path, weights_only=False)
  obj["edge_neg"].close()
  check(marker.exists(), "malicious .pt: weights_only=False runs the payload (marker file created)")


def run_big(spec: str, tmp: Path) -> None:
  nodes, edges, feat = (int(v) for v in spec.split(","))
  start = time.perf_counter()
  t = mso.write_big_homogeneous(tmp / "ogbn_products", nodes, edges, feat, seed=0)
  took = time.perf_counter() - start
  sizes = {f: (t.folder / f).stat().st_size for f in t.files}
  print(f"big: {nodes} nodes, {edges} edges, {feat} features written in {took:.1f}s, "
        f"{sum(sizes.values()) / 1e9:.2f} GB: "
        + ", ".join(f"{f} {s / 1e6:.0f} MB" for f, s in sizes.items() if s > 1e6))
  start = time.perf_counter()
  g = quiet(read_csv_graph_raw, str(t.folder / "raw"), add_inverse_edge=False)[0]
  print(f"big: OGB read_csv_graph_raw took {time.perf_counter() - start:.1f}s")
  check(same(g["edge_index"], t.edge_index) and same(g["node_feat"], t.node_feat), "big: OGB reads the same arrays")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--big", default="", help="NODES,EDGES,FEAT for write_big_homogeneous")
  args = parser.parse_args(argv)
  for module in (nds, lds, gds):
    module.decide_download = no_network
    module.download_url = no_network
  builtins.input = no_prompt
  tmp = Path(tempfile.mkdtemp(prefix="ogb_selftest_"))
  try:
    check_meta()
    start = time.perf_counter()
    truths = {t.name: t for t in mso.write_all(tmp / "a", seed=0)}
    print(f"wrote {len(truths)} folders in {time.perf_counter() - start:.2f}s")
    for t in truths.values():
      print(f"  {t.name}: {', '.join(t.files)}")
    again = mso.write_all(tmp / "b", seed=0)
    check(all(digest(t.folder) == digest(u.folder) for t, u in zip(truths.values(), again)),
          "same seed: byte-identical folders")
    other = mso.write_homogeneous_node(tmp / "c", seed=1)
    check(digest(other.folder) != digest(truths["ogbn-arxiv"].folder), "another seed: different files")
    try:
      mso.write_homogeneous_node(tmp / "a" / "ogbn_arxiv", seed=0)
      check(False, "refuses a non-empty folder")
    except FileExistsError:
      check(True, "refuses a non-empty folder")
    check(all((t.folder / f"RELEASE_v{mso.OGB_META[t.name].version}.txt").exists() and (t.folder / "processed").is_dir()
              for t in truths.values()), "RELEASE_v*.txt and empty processed/ everywhere")
    work = tmp / "ogb_classes"
    work.mkdir()
    check_node_homogeneous(truths["ogbn-arxiv"], work)
    check_node_homogeneous(truths["ogbn-products"], work)
    check_hetero(truths["ogbn-mag"], work)
    check_binary(truths["ogbn-papers100M"], work)
    check_graphs(truths["ogbg-molhiv"], work)
    check_graphs(truths["ogbg-molpcba"], work)
    check_link(truths["ogbl-collab"], work)
    check_link(truths["ogbl-ddi"], work)
    check_corruptions(truths["ogbn-arxiv"], truths["ogbg-molhiv"], tmp)
    check_malicious(tmp)
    if args.big:
      run_big(args.big, tmp)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  print(f"{len(FAILS)} failures" if FAILS else "all checks passed")
  return 1 if FAILS else 0


if __name__ == "__main__":
  sys.exit(main())
