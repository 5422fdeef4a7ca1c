"""`pipelines.ogb_graphs --add_reverse_relations`: `dst___rev_rel___src` stored like any relation."""

from __future__ import annotations

from collections import Counter
import gzip
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from formats.storage import files
from formats.manifest import Manifest
from formats.outputs.output import open_output
from loaders import graph as lg
from pipelines import ogb_graphs
from pipelines.core.errors import UsageError
from pipelines.ogb_graphs.reverse import reverse_relation_name
from scripts import make_sample_ogb as mo
from tests.conftest import REPO

RELATIONS = ["___".join(t) for t in mo.MAG_RELATIONS]
FEAT_RELATION = "paper___cites___paper"  # given a float edge-feat file below
ID_RELATION = "author___writes___paper"  # given an integer edge_id file below


def _rev(relation: str) -> str:
  return reverse_relation_name(relation)


def _run(folder: str, out: str, *flags: str) -> Manifest:
  ogb_graphs.run([f"--input={folder}", f"--output={out}", *flags])
  return Manifest.loads(files.read_bytes(files.join(out, "manifest.json")))


def _csr_pairs(indptr: np.ndarray, indices: np.ndarray) -> Counter:
  rows = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
  return Counter(zip(rows.tolist(), np.asarray(indices).tolist()))


LONG_RELATION = "author___affiliated_with___institution"  # its reverse's edge/reltype name is 59 bytes: .graphbin v2


@pytest.fixture(scope="module")
def mag(tmp_path_factory):
  """A MAG-shaped folder; one relation gets float edge features, another an integer edge file,
  each row unique so that their alignment with the reversed edges shows."""
  root = tmp_path_factory.mktemp("ogb_rev")
  truth = mo.write_heterogeneous_node(str(root / "ogbn_mag"), seed=5)
  e = truth.edge_index_dict[tuple(FEAT_RELATION.split("___"))].shape[1]
  feat = np.stack([np.arange(e) + 0.25, -np.arange(e) - 0.5], axis=1)
  mo.write_csv_gz(truth.folder / "raw" / "relations" / FEAT_RELATION / "edge-feat.csv.gz", feat, 2)
  e = truth.edge_index_dict[tuple(ID_RELATION.split("___"))].shape[1]
  ids = (np.arange(e) * 7 + 3)[:, None]
  mo.write_csv_gz(truth.folder / "raw" / "relations" / ID_RELATION / "edge_id.csv.gz", ids)
  return truth, {FEAT_RELATION: feat, ID_RELATION: ids}


@pytest.fixture(scope="module")
def converted(mag, tmp_path_factory):
  """(output folder, manifest): reverse relations, small partitions (several per relation), every
  relation with its edge_reltype file as OGB ships ogbn-mag."""
  truth, _ = mag
  root = tmp_path_factory.mktemp("ogb_rev_out")
  return str(root / "mag"), _run(str(truth.folder), str(root / "mag"), "--add_reverse_relations=true",
                                 "--edges_per_partition=300")


# --------------------------------------------------------------------------- pure


def test_reverse_name_rule():
  assert reverse_relation_name("author___writes___paper") == "paper___rev_writes___author"
  assert reverse_relation_name("paper___cites___paper") == "paper___rev_cites___paper"


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_every_reverse_edge_is_a_raw_edge_turned_around(mag, converted):
  truth, _ = mag
  g = lg.load(converted[0])
  for triplet, ei in truth.edge_index_dict.items():
    head, _, tail = triplet
    indptr, indices = g.relation(_rev("___".join(triplet)))
    assert len(indptr) == truth.num_nodes_dict[tail] + 1
    assert _csr_pairs(indptr, indices) == Counter(zip(ei[1].tolist(), ei[0].tolist()))  # with multiplicity
  assert any(len(v) for k, v in truth.anomalies.items() if k.endswith("/duplicates"))  # multiplicity is tested


@pytest.mark.slow
def test_neighbours_in_raw_file_order_with_edge_arrays_aligned(mag, converted):
  truth, extra = mag
  g = lg.load(converted[0])
  for triplet, ei in truth.edge_index_dict.items():
    relation, tail = "___".join(triplet), triplet[2]
    order = np.argsort(ei[1], kind="stable")  # rows by destination, file order within a row
    indptr, indices = g.relation(_rev(relation))
    np.testing.assert_array_equal(indptr, np.concatenate([[0], np.cumsum(np.bincount(ei[1], minlength=truth.num_nodes_dict[tail]))]))
    np.testing.assert_array_equal(indices, ei[0][order])
    prefix = f"rel/{_rev(relation)}/edge/"
    np.testing.assert_array_equal(g.bin[prefix + "reltype"], truth.edge_extra_dict["edge_reltype"][triplet][order])
    if relation == FEAT_RELATION:
      assert g.bin[prefix + "feat"].dtype == np.float32
      np.testing.assert_array_equal(g.bin[prefix + "feat"], extra[relation].astype(np.float32)[order])
    if relation == ID_RELATION:
      assert g.bin[prefix + "id"].dtype == np.int64
      np.testing.assert_array_equal(g.bin[prefix + "id"], extra[relation][order])
    np.testing.assert_array_equal(g.relation(relation)[1], ei[1][np.argsort(ei[0], kind="stable")])  # raw: as ever


@pytest.mark.slow
def test_with_csc_the_reverse_of_a_reverse_is_the_raw_csr(mag, tmp_path):
  truth, _ = mag
  out = str(tmp_path / "out")
  m = _run(str(truth.folder), out, "--add_reverse_relations=true", "--csc=true", "--edges_per_partition=300")
  g = lg.load(out)
  assert g.meta["relations"] == RELATIONS + [_rev(r) for r in RELATIONS]
  assert m.graph["csc"] is True
  assert f"csc/rel/{_rev(LONG_RELATION)}/indices" in g.bin  # 58 bytes: a version 2 table
  for relation in RELATIONS:
    np.testing.assert_array_equal(g.bin[f"csc/rel/{_rev(relation)}/indptr"], g.relation(relation)[0])
    np.testing.assert_array_equal(g.bin[f"csc/rel/{_rev(relation)}/indices"], g.relation(relation)[1])
    np.testing.assert_array_equal(g.bin[f"csc/rel/{relation}/indptr"], g.relation(_rev(relation))[0])
    np.testing.assert_array_equal(g.bin[f"csc/rel/{relation}/indices"], g.relation(_rev(relation))[1])
  assert open_output(out).verify() == 0


@pytest.mark.slow
def test_counts_and_names_in_manifest_and_meta(mag, converted):
  truth, _ = mag
  out, m = converted
  g = lg.load(out)
  added = {_rev(r): {"reverse_of": r, "num_edges": truth.edge_index_dict[tuple(r.split("___"))].shape[1]}
           for r in RELATIONS}
  assert "paper___rev_cites___paper" in added
  assert m.graph["reverse_relations"] == added
  assert g.meta["reverse_relations"] == added
  assert g.meta["relations"] == RELATIONS + [_rev(r) for r in RELATIONS]
  for relation in RELATIONS:
    e = truth.edge_index_dict[tuple(relation.split("___"))].shape[1]
    assert m.graph["num_edges"][relation] == m.graph["num_edges"][_rev(relation)] == e
    assert len(g.relation(_rev(relation))[1]) == e
  assert m.source["add_reverse_relations"] is True


@pytest.mark.slow
def test_output_verifies(converted):
  assert open_output(converted[0]).verify() == 0


@pytest.mark.slow
def test_without_the_flag_nothing_is_added(mag, tmp_path):
  truth, _ = mag
  out = str(tmp_path / "plain")
  m = _run(str(truth.folder), out, "--edges_per_partition=300")
  g = lg.load(out)
  assert g.meta["relations"] == RELATIONS
  assert "reverse_relations" not in g.meta
  assert "reverse_relations" not in m.graph
  assert "add_reverse_relations" not in m.source
  assert not [s for s in g.bin.names() if "rev_" in s]


# --------------------------------------------------------------------------- refused


def test_flag_on_a_homogeneous_set_is_a_usage_error(tmp_path):
  truth = mo.write_homogeneous_node(str(tmp_path / "ogbn_arxiv"), seed=0, num_nodes=50, num_edges=100)
  out = tmp_path / "out"
  with pytest.raises(UsageError, match=r"^--add_reverse_relations=true needs a heterogeneous data set"):
    ogb_graphs.run([f"--input={truth.folder}", f"--output={out}", "--add_reverse_relations=true"])
  assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
def test_ogbn_mag_names_are_written_as_graphbin_version_2(converted):
  """Without reverse relations every name fits version 1's 56 bytes (test_outputs_unchanged); with them
  ogbn-mag's `rel/institution___rev_affiliated_with___author/edge/reltype` is 59 bytes."""
  g = lg.load(converted[0])
  assert g.bin.header.version == 2
  assert f"rel/{_rev(LONG_RELATION)}/edge/reltype" in g.bin


# 207 characters: every raw section fits 248 bytes (the longest, rel/<raw>/edge/reltype, is 247),
# and its reverse's do not: rel/<reverse>/edge/reltype is 251 bytes, csc/rel/<reverse>/indices 250.
LONGEST = ("author", "a" * 207, "institution")


@pytest.mark.parametrize("flags", [(), ("--csc=true",)], ids=["edge_array", "csc"])
def test_too_long_section_name_is_refused(mag, tmp_path, flags):
  """A reverse relation whose section name would not fit a .graphbin's 248-byte names is refused before
  the job starts, nothing written."""
  truth, _ = mag
  folder = tmp_path / "ogbn_mag"
  shutil.copytree(truth.folder, folder)
  name = "___".join(LONGEST)
  mo.write_csv_gz(folder / "raw" / "relations" / name / "edge.csv.gz", np.array([[0, 0]]))
  mo.write_csv_gz(folder / "raw" / "relations" / name / "num-edge-list.csv.gz", np.array([[1]]))
  if not flags:
    mo.write_csv_gz(folder / "raw" / "relations" / name / "edge_reltype.csv.gz", np.array([[4]]))
  with gzip.open(folder / "raw" / "triplet-type-list.csv.gz", "at") as f:
    f.write(",".join(LONGEST) + "\n")
  out = tmp_path / "out"
  section = f"csc/rel/{_rev(name)}/indices" if flags else f"rel/{_rev(name)}/edge/reltype"
  assert len(section) == (250 if flags else 251)
  with pytest.raises(UsageError, match=f"section {section} would be {len(section)} bytes long; .* holds 248$"):
    ogb_graphs.run([f"--input={folder}", f"--output={out}", "--add_reverse_relations=true", *flags])
  assert not out.exists() or not any(out.iterdir())


def test_bad_flag_value_is_a_usage_error(tmp_path):
  (tmp_path / "in").mkdir()
  with pytest.raises(UsageError, match="--add_reverse_relations.*'maybe'"):
    ogb_graphs.run([f"--input={tmp_path}/in", f"--output={tmp_path}/out", "--add_reverse_relations=maybe"])


@pytest.mark.parametrize("triplet", [("paper", "rev_writes", "author"), ("paper", "rev_extra", "paper")],
                         ids=["collides", "rev_prefix"])
def test_a_raw_rev_relation_is_refused(mag, tmp_path, triplet):
  truth, _ = mag
  folder = tmp_path / "ogbn_mag"
  shutil.copytree(truth.folder, folder)
  name = "___".join(triplet)
  mo.write_csv_gz(folder / "raw" / "relations" / name / "edge.csv.gz", np.array([[0, 0]]))
  mo.write_csv_gz(folder / "raw" / "relations" / name / "num-edge-list.csv.gz", np.array([[1]]))
  with gzip.open(folder / "raw" / "triplet-type-list.csv.gz", "at") as f:
    f.write(",".join(triplet) + "\n")
  out = tmp_path / "out"
  with pytest.raises(UsageError, match=f"already has a relation {name};.*would collide"):
    ogb_graphs.run([f"--input={folder}", f"--output={out}", "--add_reverse_relations=true"])
  assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
def test_cli_usage_error_is_one_line_exit_2(tmp_path):
  truth = mo.write_homogeneous_node(str(tmp_path / "ogbn_arxiv"), seed=0, num_nodes=50, num_edges=100)
  out = tmp_path / "out"
  r = subprocess.run([sys.executable, "-m", "pipelines.ogb_graphs", f"--input={truth.folder}", f"--output={out}",
                      "--add_reverse_relations=true"], capture_output=True, text=True,
                     env={**os.environ, "PYTHONPATH": REPO}, timeout=300)
  assert r.returncode == 2, r.stderr
  lines = r.stderr.strip().splitlines()
  assert lines[-1].startswith("pipelines.ogb_graphs: error: --add_reverse_relations=true needs a heterogeneous"), r.stderr
  assert "Traceback" not in r.stderr
  assert not out.exists() or not any(out.iterdir())
