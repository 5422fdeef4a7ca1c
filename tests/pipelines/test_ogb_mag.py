"""ogbn-mag as OGB lays it out (every relation with edge_reltype), scaled down by `write_mag`, converted
with `--add_reverse_relations` (and `--csc`): every relation and reverse stored, each reverse the exact
transpose of the generator's edges, in a `.graphbin` version 2 (its names exceed version 1's 56 bytes)."""

from __future__ import annotations

import filecmp
import os

import numpy as np
import pytest
from ogb.io import read_graph_raw

from formats.outputs import inspect
from formats.storage import files
from formats.graphbin import NAME_BYTES
from formats.manifest import Manifest
from formats.outputs.output import open_output
from loaders import graph as lg
from pipelines import ogb_graphs
from pipelines.ogb_graphs.reverse import reverse_relation_name
from scripts import make_sample_ogb as mo

SCALE = 0.001  # 736 papers, 1,135 authors, 21,111 edges (every count at least 10)
RELATIONS = ["___".join(t) for t in mo.MAG_RELATIONS]
REVERSES = [reverse_relation_name(r) for r in RELATIONS]


@pytest.fixture(scope="module")
def mag(tmp_path_factory) -> mo.OgbTruth:
  return mo.write_mag(str(tmp_path_factory.mktemp("mag") / "ogbn_mag"), seed=11, scale=SCALE)


def _run(truth: mo.OgbTruth, out: str, *flags: str) -> tuple[str, Manifest]:
  ogb_graphs.run([f"--input={truth.folder}", f"--output={out}", "--add_reverse_relations=true",
                  "--edges_per_partition=2000", *flags])  # several partitions per relation
  return out, Manifest.loads(files.read_bytes(files.join(out, "manifest.json")))


@pytest.fixture(scope="module")
def converted(mag, tmp_path_factory) -> tuple[str, Manifest]:
  return _run(mag, str(tmp_path_factory.mktemp("mag_out") / "mag"))


@pytest.fixture(scope="module")
def converted_csc(mag, tmp_path_factory) -> tuple[str, Manifest]:
  return _run(mag, str(tmp_path_factory.mktemp("mag_csc") / "mag"), "--csc=true")


def _csr(rows: np.ndarray, cols: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
  """The CSR of edges (rows[i], cols[i]): rows ascending, each row's columns in edge order."""
  indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=num_rows))])
  return indptr, cols[np.argsort(rows, kind="stable")]


# --------------------------------------------------------------------------- the generator


def test_write_mag_has_ogbn_mag_counts_times_the_scale(mag):
  assert mag.num_nodes_dict == {"author": 1135, "field_of_study": 60, "institution": 10, "paper": 736}  # 9 -> 10
  assert {r: e.shape[1] for r, e in mag.edge_index_dict.items()} == dict(zip(mo.MAG_RELATIONS,
                                                                             (1044, 7146, 5416, 7505)))
  assert mag.node_feat_dict["paper"].shape == (736, mo.MAG_FEAT_DIM)
  for relation in RELATIONS:
    assert f"raw/relations/{relation}/edge_reltype.csv.gz" in mag.files
  assert len(max((f"rel/{r}/edge/reltype" for r in REVERSES), key=len)) > NAME_BYTES[1]  # needs version 2


def test_write_mag_matches_ogbs_reader(mag):
  raw = os.path.join(mag.folder, "raw")
  ref = read_graph_raw.read_csv_heterograph_raw(raw, False, ["node_year"], ["edge_reltype"])[0]
  assert ref["num_nodes_dict"] == mag.num_nodes_dict
  for triplet, ei in mag.edge_index_dict.items():
    np.testing.assert_array_equal(ref["edge_index_dict"][triplet], ei)
    np.testing.assert_array_equal(ref["edge_reltype"][triplet], mag.edge_extra_dict["edge_reltype"][triplet])
  np.testing.assert_array_equal(ref["node_feat_dict"]["paper"], mag.node_feat_dict["paper"])
  np.testing.assert_array_equal(ref["node_year"]["paper"], mag.node_extra_dict["node_year"]["paper"])
  np.testing.assert_array_equal(read_graph_raw.read_node_label_hetero(raw)["paper"], mag.node_label_dict["paper"])


def test_write_mag_is_deterministic_and_skewed(mag, tmp_path):
  again = mo.write_mag(str(tmp_path / "again"), seed=11, scale=SCALE)
  assert again.files == mag.files
  _, mismatch, errors = filecmp.cmpfiles(mag.folder, again.folder, mag.files, shallow=False)
  assert not mismatch
  assert not errors
  cites = mag.edge_index_dict[("paper", "cites", "paper")]
  in_degree = np.sort(np.bincount(cites[1], minlength=736))[::-1]
  assert in_degree[:8].sum() > 0.1 * cites.shape[1]  # the top 1% of papers hold over 10% of the citations


@pytest.mark.parametrize("scale", [0, -1.0, float("nan")])
def test_write_mag_refuses_a_bad_scale(tmp_path, scale):
  with pytest.raises(ValueError, match=f"scale must be > 0 .* got scale={scale!r}"):
    mo.write_mag(str(tmp_path / "m"), seed=0, scale=scale)


# --------------------------------------------------------------------------- converted


@pytest.mark.slow
def test_every_relation_and_reverse_is_stored(mag, converted):
  out, m = converted
  g = lg.load(out)
  assert g.bin.header.version == 2
  assert g.meta["relations"] == RELATIONS + REVERSES
  assert m.graph["reverse_relations"] == {
      reverse_relation_name(r): {"reverse_of": r, "num_edges": mag.edge_index_dict[t].shape[1]}
      for r, t in zip(RELATIONS, mo.MAG_RELATIONS)}
  for relation in RELATIONS + REVERSES:
    assert {f"rel/{relation}/{x}" for x in ("indptr", "indices", "edge/reltype")} <= set(g.bin.names("rel/"))


@pytest.mark.slow
def test_each_reverse_csr_is_the_transpose_of_the_raw_edges(mag, converted):
  g = lg.load(converted[0])
  for triplet, ei in mag.edge_index_dict.items():
    head, _, tail = triplet
    relation = "___".join(triplet)
    reltype = mag.edge_extra_dict["edge_reltype"][triplet]
    for name, rows, cols, num_rows in ((relation, ei[0], ei[1], mag.num_nodes_dict[head]),
                                       (reverse_relation_name(relation), ei[1], ei[0], mag.num_nodes_dict[tail])):
      indptr, indices = _csr(rows, cols, num_rows)
      got_indptr, got_indices = g.relation(name)
      np.testing.assert_array_equal(got_indptr, indptr)
      np.testing.assert_array_equal(got_indices, indices)
      np.testing.assert_array_equal(g.bin[f"rel/{name}/edge/reltype"], reltype[np.argsort(rows, kind="stable")])


@pytest.mark.slow
def test_paper_features_labels_years_and_splits(mag, converted):
  g = lg.load(converted[0])
  np.testing.assert_array_equal(g.bin["node/paper/feat"], mag.node_feat_dict["paper"])
  np.testing.assert_array_equal(g.bin["node/paper/label"], mag.node_label_dict["paper"])
  np.testing.assert_array_equal(g.bin["node/paper/year"], mag.node_extra_dict["node_year"]["paper"])
  for part in ("train", "valid", "test"):
    np.testing.assert_array_equal(g.bin[f"split/time/paper/{part}"], mag.split["time"][part]["paper"])
  assert g.meta["num_nodes"] == mag.num_nodes_dict


@pytest.mark.slow
def test_with_csc_every_relation_has_its_transpose(mag, converted_csc):
  out, m = converted_csc
  g = lg.load(out)
  assert m.graph["csc"] is True
  assert g.bin.header.version == 2
  for relation, reverse in zip(RELATIONS, REVERSES):
    for name, other in ((relation, reverse), (reverse, relation)):
      np.testing.assert_array_equal(g.bin[f"csc/rel/{name}/indptr"], g.relation(other)[0])
      np.testing.assert_array_equal(g.bin[f"csc/rel/{name}/indices"], g.relation(other)[1])


@pytest.mark.slow
@pytest.mark.parametrize("which", ["converted", "converted_csc"])
def test_output_verifies(request, which):
  out, _ = request.getfixturevalue(which)
  assert open_output(out).verify() == 0
  assert inspect.main([out, "--verify"]) == 0
