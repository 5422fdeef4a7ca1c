"""`pipelines.ogb_graphs` against the `ogb` package's own readers, on generated OGB folders."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
from ogb.io import read_graph_raw
import pytest

from formats import arrayrecord
from formats.outputs import inspect
from formats.storage import files
from formats.graphbin import GraphBin, GraphBinError
from formats.manifest import Manifest
from loaders import graph as lg
from pipelines import ogb_graphs
from pipelines.ogb_graphs.read import OgbFormatError
from scripts import make_sample_ogb as mo
from tests.conftest import REPO, upload_tree

pytestmark = pytest.mark.slow


def _expected_csr(src, dst, n):
  order = np.argsort(src, kind="stable")
  indptr = np.concatenate([[0], np.cumsum(np.bincount(src, minlength=n))])
  return indptr, dst[order], order


def convert(folder: str, out: str, *flags: str) -> Manifest:
  ogb_graphs.run([f"--input={folder}", f"--output={out}", *flags])
  return Manifest.loads(files.read_bytes(files.join(out, "manifest.json")))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  root = tmp_path_factory.mktemp("ogb")
  return {t.name: t for t in mo.write_all(str(root / "in"), seed=0)}


@pytest.fixture(scope="module")
def outputs(data, tmp_path_factory):
  root = tmp_path_factory.mktemp("ogb_out")
  out = {}
  for name, t in data.items():
    dest = str(root / name.replace("-", "_"))
    # small partitions: the multi-partition path runs even on small graphs
    out[name] = (dest, convert(t.folder, dest, "--edges_per_partition=700", "--csc=true"))
  return out


@pytest.mark.parametrize("name", ["ogbn-arxiv", "ogbn-products", "ogbl-collab"])
def test_homogeneous_matches_ogb_reader(data, outputs, name):
  t = data[name]
  g = lg.load(outputs[name][0])
  raw = os.path.join(t.folder, "raw")
  ref = read_graph_raw.read_csv_graph_raw(
      raw, t.add_inverse_edge, additional_node_files=list(t.node_extra),
      additional_edge_files=list(t.edge_extra))[0]
  n = ref["num_nodes"]
  indptr, indices, order = _expected_csr(ref["edge_index"][0], ref["edge_index"][1], n)
  assert g.num_nodes == n
  assert g.meta["add_inverse_edges"] == t.add_inverse_edge
  np.testing.assert_array_equal(g.indptr, indptr)
  np.testing.assert_array_equal(g.indices, indices)
  assert g.indices.dtype == np.int32
  np.testing.assert_array_equal(g.node_features, ref["node_feat"])
  if t.node_label is not None:
    np.testing.assert_array_equal(g.labels, t.node_label)
  for extra, values in t.node_extra.items():
    np.testing.assert_array_equal(g.bin[f"node/{extra[5:]}"], ref[extra])
    np.testing.assert_array_equal(ref[extra], values)  # OGB's reader agrees with the generator's truth
  for extra in t.edge_extra:
    np.testing.assert_array_equal(g.bin[f"edge/{extra[5:]}"], ref[extra][order])
  # reverse CSC: in-neighbours
  cindptr, cindices, _ = _expected_csr(ref["edge_index"][1], ref["edge_index"][0], n)
  np.testing.assert_array_equal(g.bin["csc/indptr"], cindptr)
  np.testing.assert_array_equal(g.bin["csc/indices"], cindices)


def test_node_splits_match(data, outputs):
  t = data["ogbn-arxiv"]
  g = lg.load(outputs["ogbn-arxiv"][0])
  for part in ("train", "valid", "test"):
    np.testing.assert_array_equal(g.split(part), t.split["time"][part])


def test_link_splits_from_pt_files(data, outputs):
  t = data["ogbl-collab"]
  g = lg.load(outputs["ogbl-collab"][0])
  for part, arrays in t.split[t.split_name].items():
    for key, value in arrays.items():
      np.testing.assert_array_equal(g.splits[f"{t.split_name}/{part}/{key}"], value)


def test_heterogeneous_matches_ogb_reader(data, outputs):
  t = data["ogbn-mag"]
  g = lg.load(outputs["ogbn-mag"][0])
  raw = os.path.join(t.folder, "raw")
  ref = read_graph_raw.read_csv_heterograph_raw(raw, False, ["node_year"], ["edge_reltype"])[0]
  assert g.meta["num_nodes"] == ref["num_nodes_dict"]
  for (h, r, tt), ei in ref["edge_index_dict"].items():
    indptr, indices, order = _expected_csr(ei[0], ei[1], ref["num_nodes_dict"][h])
    got_indptr, got_indices = g.relation(f"{h}___{r}___{tt}")
    np.testing.assert_array_equal(got_indptr, indptr)
    np.testing.assert_array_equal(got_indices, indices)
    np.testing.assert_array_equal(g.bin[f"rel/{h}___{r}___{tt}/edge/reltype"],
                                  ref["edge_reltype"][(h, r, tt)][order])
  np.testing.assert_array_equal(g.bin["node/paper/feat"], ref["node_feat_dict"]["paper"])
  np.testing.assert_array_equal(g.bin["node/paper/year"], ref["node_year"]["paper"])
  np.testing.assert_array_equal(g.bin["node/paper/label"], read_graph_raw.read_node_label_hetero(raw)["paper"])
  counts = [ref["num_nodes_dict"][k] for k in sorted(ref["num_nodes_dict"])]
  np.testing.assert_array_equal(g.bin["node_type_offsets"], np.concatenate([[0], np.cumsum(counts)]))
  for part in ("train", "valid", "test"):  # the generator's truth, checked against OGB's classes
    np.testing.assert_array_equal(g.splits[f"time/paper/{part}"], t.split["time"][part]["paper"])


def test_binary_matches_ogb_reader(data, outputs):
  t = data["ogbn-papers100M"]
  g = lg.load(outputs["ogbn-papers100M"][0])
  ref = read_graph_raw.read_binary_graph_raw(os.path.join(t.folder, "raw"), False)[0]
  indptr, indices, _ = _expected_csr(ref["edge_index"][0], ref["edge_index"][1], ref["num_nodes"])
  np.testing.assert_array_equal(g.indptr, indptr)
  np.testing.assert_array_equal(g.indices, indices)
  np.testing.assert_array_equal(g.node_features, ref["node_feat"])
  np.testing.assert_array_equal(g.bin["node/year"], ref["node_year"])
  np.testing.assert_array_equal(g.labels, t.node_label)  # NaN where unlabelled


@pytest.mark.parametrize("compressed", [False, True])
def test_binary_edge_members_are_stored_as_ogb_reads_them(data, tmp_path, compressed):
  """data.npz's edge_feat and edge_* members (OGB's read_binary_graph_raw reads them) are edge sections, in CSR
  order, never dropped; a member of another length is refused."""
  folder = str(tmp_path / "ogbn_papers100M")
  shutil.copytree(data["ogbn-papers100M"].folder, folder)
  npz = os.path.join(folder, "raw", "data.npz")
  arrays = dict(np.load(npz))
  e = arrays["edge_index"].shape[1]
  rng = np.random.default_rng(0)
  arrays["edge_feat"] = rng.standard_normal((e, 3)).astype(np.float32)
  arrays["edge_weight"] = rng.integers(0, 9, (e, 1))
  (np.savez_compressed if compressed else np.savez)(npz, **arrays)
  out = str(tmp_path / "out")
  convert(folder, out, "--edges_per_partition=700")
  g = lg.load(out)
  ref = read_graph_raw.read_binary_graph_raw(os.path.join(folder, "raw"), False)[0]
  _, _, order = _expected_csr(ref["edge_index"][0], ref["edge_index"][1], ref["num_nodes"])
  np.testing.assert_array_equal(g.bin["edge/feat"], ref["edge_feat"][order])
  np.testing.assert_array_equal(g.bin["edge/weight"], ref["edge_weight"][order])
  arrays["edge_weight"] = arrays["edge_weight"][:-1]
  np.savez(npz, **arrays)
  with pytest.raises(OgbFormatError, match=rf"edge_weight: shape \({e - 1}, 1\) for {e} edges \(edge_index\)"):
    convert(folder, str(tmp_path / "short"))


def test_a_binary_node_data_set_of_several_graphs_is_refused(data, tmp_path):
  folder = str(tmp_path / "ogbn_papers100M")
  shutil.copytree(data["ogbn-papers100M"].folder, folder)
  npz = os.path.join(folder, "raw", "data.npz")
  arrays = dict(np.load(npz))
  n, e = int(arrays["num_nodes_list"][0]), int(arrays["num_edges_list"][0])
  arrays["num_nodes_list"] = np.array([n - 5, 5])
  arrays["num_edges_list"] = np.array([e - 1, 1])
  np.savez(npz, **arrays)
  with pytest.raises(OgbFormatError, match=r"num_nodes_list: shape \(2,\): one graph expected in a node data set"):
    convert(folder, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out" / "manifest.json")


@pytest.mark.parametrize("name", ["ogbg-molhiv", "ogbg-molpcba"])
def test_graph_property_records_match_ogb_reader(data, outputs, name):
  t = data[name]
  out, m = outputs[name]
  ref = read_graph_raw.read_csv_graph_raw(os.path.join(t.folder, "raw"), t.add_inverse_edge)
  split_of = {int(g): part for part, ids in t.split[t.split_name].items() for g in ids}
  seen = {}
  for split_name, split in m.splits.items():
    for shard in split.shards:
      for rec in arrayrecord.read_file(os.path.join(out, shard.path)):
        v = m.features.decode(rec)
        key = (int(v["num_nodes"]), v["edge_index"].tobytes(), v["node_feat"].tobytes())
        seen[key] = (split_name, v)
  assert len(seen) == len(ref) == m.num_records
  for i, r in enumerate(ref):
    split_name, v = seen[(r["num_nodes"], r["edge_index"].tobytes(), r["node_feat"].tobytes())]
    assert split_name == split_of[i]
    np.testing.assert_array_equal(v["edge_feat"], r["edge_feat"])
    np.testing.assert_array_equal(v["label"], t.graph_label[i])


def test_inspect_verifies_and_catches_a_corrupted_section(outputs, tmp_path):
  out, m = outputs["ogbn-arxiv"]
  assert inspect.main([out, "--verify"]) == 0
  broken = str(tmp_path / "broken")
  shutil.copytree(out, broken)
  blob = os.path.join(broken, m.files[0].path)
  g = GraphBin(blob)
  offset = g.sections["indices"].offset
  del g
  with open(blob, "r+b") as f:
    f.seek(offset + 4)
    f.write(b"\x7f\x7f")
  with pytest.raises(GraphBinError, match=rf"section 'indices' at offset {offset} fails its checksum"):
    GraphBin(blob)
  assert inspect.main([broken, "--verify"]) == 1


# --------------------------------------------------------------------------- bad input


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "pipelines.ogb_graphs", *args], capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": REPO}, timeout=300)


@pytest.mark.parametrize("kind", ["non_numeric", "extra_column"])
def test_bad_csv_row_names_file_and_line(data, tmp_path, kind):
  folder = str(tmp_path / "ogbn_arxiv")
  line = mo.corrupt_bad_row(data["ogbn-arxiv"].folder, line=7, kind=kind, dst=folder)
  r = _cli(f"--input={folder}", f"--output={tmp_path}/out")
  assert r.returncode == 1
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("pipelines.ogb_graphs: error: "), last
  assert f"edge.csv.gz: line {line}" in last, last
  assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_node_id_out_of_range_names_the_line(data, tmp_path):
  folder = str(tmp_path / "ogbn_arxiv")
  line = mo.corrupt_out_of_range(data["ogbn-arxiv"].folder, dst=folder)
  with pytest.raises(OgbFormatError, match=rf"edge.csv.gz: line {line}: node id outside"):
    convert(folder, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_a_column_typed_from_its_first_rows_that_changes_later_is_refused(data, tmp_path):
  """The launcher types node-feat.csv.gz from its first 1000 rows (integers); a fraction further down makes the
  whole column float, as OGB's reader would: the records must not be float bytes under an int64 schema."""
  import gzip

  folder = str(tmp_path / "ogbg_molhiv")
  shutil.copytree(data["ogbg-molhiv"].folder, folder)
  path = os.path.join(folder, "raw", "node-feat.csv.gz")
  with gzip.open(path, "rt") as f:
    lines = f.read().splitlines()
  assert len(lines) > 1500 and "." not in "".join(lines)
  lines[1500] = ",".join(["0.5"] + lines[1500].split(",")[1:])
  with gzip.open(path, "wt") as f:
    f.write("\n".join(lines) + "\n")
  with pytest.raises(OgbFormatError, match=r"node-feat.csv.gz: its rows past the first 1000 change the column type "
                                           r"or width \(int64 \(None, 9\) from the first rows, float32 \(None, 9\)"):
    convert(folder, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out" / "manifest.json")


def _edit_gz(path: str, edit) -> None:
  import gzip

  with gzip.open(path, "rt") as f:
    lines = f.read().splitlines()
  with gzip.open(path, "wt") as f:
    f.write("\n".join(edit(lines)) + "\n")


def test_a_repeated_relation_is_refused_not_stored_twice(data, tmp_path):
  folder = str(tmp_path / "ogbn_mag")
  shutil.copytree(data["ogbn-mag"].folder, folder)
  _edit_gz(os.path.join(folder, "raw", "triplet-type-list.csv.gz"), lambda lines: lines + lines[:1])
  with pytest.raises(OgbFormatError, match=r"triplet-type-list.csv.gz: line \d+: repeated relation$"):
    convert(folder, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_a_finite_feature_too_large_for_the_feature_dtype_is_refused(data, tmp_path):
  """70000 is finite in the file and inf in float16: a value the file never held."""
  folder = str(tmp_path / "ogbn_arxiv")
  shutil.copytree(data["ogbn-arxiv"].folder, folder)
  _edit_gz(os.path.join(folder, "raw", "node-feat.csv.gz"),
           lambda lines: lines[:4] + [",".join(["70000.5"] + lines[4].split(",")[1:])] + lines[5:])
  with pytest.raises(OgbFormatError, match=r"node-feat.csv.gz: a finite value too large for float16 \(it would be "
                                           r"stored as inf\) \(--feature_dtype=float32 holds larger ones\)"):
    convert(folder, str(tmp_path / "out"), "--feature_dtype=float16")
  assert not os.path.exists(tmp_path / "out" / "manifest.json")
  convert(folder, str(tmp_path / "out32"))  # float32 holds it: the job runs
  assert os.path.exists(tmp_path / "out32" / "manifest.json")


def _broken_split(kind: str, arrays: dict) -> dict:
  import torch

  if kind == "edge_id":
    edge = arrays["edge"].clone()
    edge[3, 1] = 10**6
    return {**arrays, "edge": edge}
  if kind == "negative_id":
    return {**arrays, "edge_neg": arrays["edge_neg"] - 10**6}
  if kind == "bfloat16":
    return {**arrays, "weight": arrays["weight"].to(torch.bfloat16)}
  return {**arrays, "edge": arrays["edge"].reshape(-1, 1, 2)}


@pytest.mark.parametrize("kind,message", [
    ("edge_id", r"valid.pt: entry 'edge': row 3: node id outside \[0, 500\)"),
    ("negative_id", r"valid.pt: entry 'edge_neg': row 0: node id outside"),
    ("bfloat16", r"valid.pt: entry 'weight' is a torch.bfloat16 tensor, which numpy does not hold"),
    ("3d", r"valid.pt: entry 'edge': 3-D int64, expected 1-D or 2-D numbers"),
])
def test_a_link_split_that_cannot_be_loaded_is_refused(data, tmp_path, kind, message):
  """Node ids of a link split are checked at conversion: an output whose split names nodes the graph lacks
  would pass every checksum and fail in training."""
  import torch

  folder = str(tmp_path / "ogbl_collab")
  shutil.copytree(data["ogbl-collab"].folder, folder)
  pt = os.path.join(folder, "split", "time", "valid.pt")
  torch.save(_broken_split(kind, torch.load(pt, weights_only=True)), pt)
  with pytest.raises(OgbFormatError, match=message):
    convert(folder, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_two_files_of_one_split_part_are_refused(data, tmp_path):
  folder = str(tmp_path / "ogbn_arxiv")
  shutil.copytree(data["ogbn-arxiv"].folder, folder)
  import torch

  split = os.path.join(folder, "split", "time")
  torch.save({"edge": torch.zeros((2, 2), dtype=torch.int64)}, os.path.join(split, "train.pt"))  # loadable
  with pytest.raises(OgbFormatError, match=r"split/time/train.pt: a second file for split/time/train \(beside "
                                           r"train.csv.gz\)"):
    convert(folder, str(tmp_path / "out"))


@pytest.mark.parametrize("dataset,spelled,as_written", [
    ("ogbn-arxiv", "node-feat.csv.gz", "node_feat.csv.gz"),  # both are node/feat
    ("ogbn-arxiv", "node-label.csv.gz", "node_label.csv.gz"),  # both are node/label
])
def test_two_files_of_one_section_are_refused(data, tmp_path, dataset, spelled, as_written):
  """node_feat.csv.gz beside node-feat.csv.gz: two files for one section stopped the job with a
  FileNotFoundError (one piece path written twice)."""
  folder = str(tmp_path / dataset.replace("-", "_"))
  shutil.copytree(data[dataset].folder, folder)
  shutil.copy(os.path.join(folder, "raw", spelled), os.path.join(folder, "raw", as_written))
  with pytest.raises(OgbFormatError, match=rf"raw/{as_written}: a second file for node/\w+ \(beside {spelled}\)"):
    convert(folder, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out" / "manifest.json")


@pytest.mark.parametrize("dataset,folder,edit,message", [
    ("ogbn-arxiv", "split/time", lambda train, test: (train, test + train[2:3]),
     r"split/time/train.csv.gz: line 3: node \d+ is already in test.csv.gz"),  # a test node trained on
    ("ogbn-arxiv", "split/time", lambda train, test: (train + train[:1], test),
     r"split/time/train.csv.gz: line \d+: node \d+ is already earlier in this file"),
    ("ogbn-mag", "split/time/paper", lambda train, test: (train, test + train[:1]),
     r"split/time/paper/train.csv.gz: line 1: node \d+ is already in test.csv.gz"),
])
def test_a_node_in_two_parts_of_a_node_split_is_refused(data, tmp_path, dataset, folder, edit, message):
  """OGB's node splits are disjoint: a node in train and test (or twice in train) was stored as it came. The
  files are read in name order (test before train) and refused at launch, not at the end of the job."""
  import gzip

  root = str(tmp_path / dataset.replace("-", "_"))
  shutil.copytree(data[dataset].folder, root)
  split = os.path.join(root, *folder.split("/"))
  train, test = (gzip.open(os.path.join(split, f"{p}.csv.gz"), "rt").read().splitlines() for p in ("train", "test"))
  for part, lines in zip(("train", "test"), edit(train, test)):
    _edit_gz(os.path.join(split, f"{part}.csv.gz"), lambda _, lines=lines: lines)
  with pytest.raises(OgbFormatError, match=message + r" \(node splits must be disjoint\)$"):
    convert(root, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_a_split_file_outside_a_node_type_folder_is_not_dropped(data, tmp_path):
  """ogbn-mag's node splits are per node type (split/time/paper/); one in split/time/ itself is refused, as
  the biokg layout of link splits there is read, not skipped."""
  folder = str(tmp_path / "ogbn_mag")
  shutil.copytree(data["ogbn-mag"].folder, folder)
  split = os.path.join(folder, "split", "time")
  shutil.copy(os.path.join(split, "paper", "train.csv.gz"), os.path.join(split, "train.csv.gz"))
  with pytest.raises(OgbFormatError, match=r"split/time/train.csv.gz: a node split of a heterogeneous data set is "
                                           r"per node type"):
    convert(folder, str(tmp_path / "out"))


def test_a_graph_in_two_splits_is_refused(data, tmp_path):
  folder = str(tmp_path / "ogbg_molhiv")
  shutil.copytree(data["ogbg-molhiv"].folder, folder)
  split = os.path.join(folder, "split", "scaffold")
  first = []
  _edit_gz(os.path.join(split, "train.csv.gz"), lambda lines: first.append(lines[0]) or lines)
  _edit_gz(os.path.join(split, "valid.csv.gz"), lambda lines: lines + first)
  # split files are read in name order: test, train, valid
  with pytest.raises(OgbFormatError, match=rf"valid.csv.gz: line \d+: graph {first[0]} is already in split 'train'"):
    convert(folder, str(tmp_path / "out"))


def test_pickled_code_in_a_split_is_refused_and_not_run(data, tmp_path):
  folder = str(tmp_path / "ogbl_collab")
  shutil.copytree(data["ogbl-collab"].folder, folder)
  pt = os.path.join(folder, "split", "time", "valid.pt")
  marker = mo.write_malicious_pt(pt)
  with pytest.raises(OgbFormatError, match="valid.pt: not a plain tensor file"):
    convert(folder, str(tmp_path / "out"))
  assert not os.path.exists(marker)
  assert not os.path.exists(tmp_path / "out" / "manifest.json")


# --------------------------------------------------------------------------- gs://


@pytest.mark.gcs
def test_gcs_round_trip_and_cached_load(data, outputs, gcs_emulator, tmp_path):
  t = data["ogbn-arxiv"]
  src = f"gs://{gcs_emulator}/ogb/ogbn_arxiv"
  upload_tree(t.folder, src)
  out = f"gs://{gcs_emulator}/ogb/out_arxiv"
  m = convert(src, out, "--edges_per_partition=700", "--csc=true")
  local_m = outputs["ogbn-arxiv"][1]
  assert m.files[0].sha256 == local_m.files[0].sha256  # same bytes as the local conversion
  g = lg.load(out, cache_dir=str(tmp_path / "cache"))
  np.testing.assert_array_equal(g.indices, lg.load(outputs["ogbn-arxiv"][0]).indices)
  assert lg.load(out, cache_dir=str(tmp_path / "cache")).path == g.path  # fetched once


def sample_input(base: str) -> tuple[str, list[str]]:
  """A small input for registry-driven tests (tests/pipelines/test_registry.py): (folder, own flags)."""
  return str(mo.write_homogeneous_node(os.path.join(base, "ogbn_arxiv"), 0, num_nodes=200, num_edges=800).folder), []


@pytest.mark.parametrize("flag,message", [
    ("--mode=append", "--mode=append: ogb_graphs converts a data set whole"),
    ("--plan=workers", "--plan=workers: ogb_graphs makes no shard plan"),
])
def test_flags_a_whole_data_set_cannot_honour_are_refused(flag, message, tmp_path):
  from pipelines.core import UsageError, launch  # pylint: disable=import-outside-toplevel
  folder = mo.write_graph_property(str(tmp_path / "ogbg_molhiv"), 3, num_graphs=10).folder
  with pytest.raises(UsageError, match=message):
    launch.parse(ogb_graphs.CONVERTER, [f"--input={folder}", f"--output={tmp_path}/out", flag])
  assert not os.path.exists(tmp_path / "out")
