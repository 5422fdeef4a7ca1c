"""Graph files that lie with valid checksums: every shape `meta` and the sections imply is checked at load.

Each file here is written by the real `GraphBinWriter` (so every CRC is right) from arrays that contradict
each other or `meta`. `loaders.graph.load` and `Graph` refuse it with a GraphBinError naming the file, the
section and both numbers, before a sampler, the compiled kernel or a feature gather touches an array.
"""

from __future__ import annotations

import io
import json
import os
import re

import numpy as np
import pytest

from formats.errors import GraphBinError
from formats.graphbin import GraphBinWriter
from formats.manifest import MANIFEST_FILENAME
from formats.outputs import inspect, output as output_lib
from loaders import graph as lg
from loaders import load_graph
from pipelines import ogb_graphs
from scripts import make_sample_ogb as mo
from tests.loaders import make_outputs

N = 10  # nodes of the homogeneous graph
DROP = object()  # an override that leaves the section out


def _ring(n: int, k: int = 2) -> tuple[np.ndarray, np.ndarray]:
  """A CSR where node i points to i+1, ..., i+k (mod n)."""
  indptr = np.arange(0, n * k + 1, k, dtype=np.int64)
  indices = ((np.arange(n)[:, None] + np.arange(1, k + 1)) % n).reshape(-1).astype(np.int32)
  return indptr, indices


def _homogeneous_sections(n: int = N) -> dict[str, np.ndarray]:
  indptr, indices = _ring(n)
  return {
      "indptr": indptr, "indices": indices,
      "csc/indptr": indptr.copy(), "csc/indices": ((np.arange(n)[:, None] - np.arange(1, 3)) % n).reshape(-1)
      .astype(np.int32),
      "edge/feat": np.ones((len(indices), 2), np.float32),
      "node/feat": np.arange(n * 4, dtype=np.float32).reshape(n, 4),
      "node/label": (np.arange(n) % 3)[:, None].astype(np.int64),
      "node/year": np.full((n, 1), 2020, np.int64),
      "split/time/train": np.arange(0, n - 2, dtype=np.int64),
      "split/time/valid": np.array([n - 2], np.int64),
      "split/time/test": np.array([n - 1], np.int64),
  }


def _homogeneous_meta(n: int = N) -> dict:
  return {"format": "graphbin", "layout": "homogeneous", "task": "node", "num_nodes": {"": n}, "node_types": [""],
          "relations": [], "splits": ["split/time"]}


def _fill(w: GraphBinWriter, sections: dict, meta: dict, overrides: dict | None = None) -> None:
  """Writes `meta` and `sections`, with `overrides` ({name: array, or DROP}) applied."""
  arrays = dict(sections)
  for name, value in (overrides or {}).items():
    if value is DROP:
      arrays.pop(name)
    else:
      arrays[name] = value
  w.add_meta(meta)
  for name, arr in arrays.items():
    w.add(name, arr)


def _write(path: str, sections: dict, meta: dict, overrides: dict | None = None) -> str:
  """A .graphbin with correct CRCs: `sections`, with `overrides` ({name: array, or DROP}) applied."""
  with GraphBinWriter(path) as w:
    _fill(w, sections, meta, overrides)
  return path


def _refused(path: str, message: str) -> None:
  """`Graph(path)` and `load_graph(path)` both raise GraphBinError naming the file and matching `message`."""
  for opener in (lambda: lg.Graph(path), lambda: load_graph(path), lambda: lg.Graph(path, verify=False)):
    with pytest.raises(GraphBinError, match=message) as e:
      opener()
    assert str(e.value).startswith(f"{path}: "), str(e.value)
    assert "\n" not in str(e.value)


# ---- the example: an array shorter than the node count the others imply ---------------------------


def test_node_features_shorter_than_the_node_count_are_refused_before_sampling(tmp_path):
  path = _write(str(tmp_path / "short_feat.graphbin"), _homogeneous_sections(), _homogeneous_meta(),
                {"node/feat": np.ones((N - 1, 4), np.float32)})
  _refused(path, r"section 'node/feat': rows: expected 10 \(meta num_nodes\), found 9")
  with pytest.raises(GraphBinError, match="node/feat"):  # the sampler never gets a graph to gather from
    lg.NeighborSampler(lg.load(path), fanouts=[2], batch_size=4, seed_nodes=np.arange(N))


_INDICES = _ring(N)[1]
H = [  # (case, section, its array or DROP, the message)
    ("label_rows", "node/label", np.zeros((N + 1, 1), np.int64),
     r"section 'node/label': rows: expected 10 \(meta num_nodes\), found 11"),
    ("year_rows", "node/year", np.zeros(N - 3, np.int64),
     r"section 'node/year': rows: expected 10 \(meta num_nodes\), found 7"),
    ("indptr_short", "indptr", np.arange(0, 2 * N - 1, 2, dtype=np.int64),
     r"section 'indptr': length: expected 11 \(num_nodes \+ 1\), found 10"),
    ("indptr_first", "indptr", np.arange(1, 2 * N + 2, 2, dtype=np.int64)[:N + 1],
     r"section 'indptr': first value: expected 0, found 1"),
    ("indptr_decreasing", "indptr", np.array([0, 2, 4, 6, 5, 10, 12, 14, 16, 18, 20], np.int64),
     r"section 'indptr': decreases at row 4: 6 then 5"),
    ("indptr_last", "indptr", np.array([0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 19], np.int64),
     r"section 'indptr': last value: expected 20 \(entries of 'indices'\), found 19"),
    ("indptr_float", "indptr", np.arange(0, 2 * N + 1, 2, dtype=np.float64),
     r"section 'indptr': dtype: expected an integer dtype, found <f8"),
    ("indptr_2d", "indptr", np.arange(0, 2 * N + 2, dtype=np.int64).reshape(N + 1, 2),
     r"section 'indptr': dimensions: expected 1, found 2"),
    ("indices_high", "indices", np.where(np.arange(2 * N) == 7, N, _INDICES).astype(np.int32),
     r"section 'indices': indices outside \[0, 10\): found 10 at position 7"),
    ("indices_negative", "indices", np.where(np.arange(2 * N) == 3, -1, _INDICES).astype(np.int32),
     r"section 'indices': indices outside \[0, 10\): found -1 at position 3"),
    ("indices_float", "indices", _INDICES.astype(np.float32),
     r"section 'indices': dtype: expected an integer dtype, found <f4"),
    ("indices_missing", "indices", DROP, r"section 'indptr' has no 'indices' beside it"),
    ("relation_untyped", "rel/a___r___b/indptr", np.zeros(3, np.int64),
     r"section 'rel/a___r___b/indptr': a relation section, but meta num_nodes names no node types"),
    ("csc_indptr", "csc/indptr", np.arange(0, 2 * N + 3, 2, dtype=np.int64)[:N + 2],
     r"section 'csc/indptr': length: expected 11 \(num_nodes \+ 1\), found 12"),
    ("csc_indices", "csc/indices", np.full(2 * N, 12, np.int32),
     r"section 'csc/indices': indices outside \[0, 10\): found 12 at position 0"),
    ("edge_feat_rows", "edge/feat", np.ones((2 * N - 1, 2), np.float32),
     r"section 'edge/feat': rows: expected 20 \(entries of 'indices'\), found 19"),
    ("split_high", "split/time/train", np.array([0, 3, 10], np.int64),
     r"section 'split/time/train': ids outside \[0, 10\): found 10 at position 2"),
    ("split_negative", "split/time/valid", np.array([-4], np.int64),
     r"section 'split/time/valid': ids outside \[0, 10\): found -4 at position 0"),
    ("split_float", "split/time/test", np.array([1.0]),
     r"section 'split/time/test': dtype: expected an integer dtype, found <f8"),
    ("split_2d", "split/time/test", np.zeros((2, 2), np.int64),
     r"section 'split/time/test': dimensions: expected 1, found 2"),
]


@pytest.mark.parametrize("section,value,message", [c[1:] for c in H], ids=[c[0] for c in H])
def test_a_homogeneous_section_that_contradicts_the_others_is_refused(tmp_path, section, value, message):
  path = _write(str(tmp_path / "g.graphbin"), _homogeneous_sections(), _homogeneous_meta(), {section: value})
  _refused(path, message)
  with pytest.raises(GraphBinError):
    lg.NeighborSampler(lg.Graph(path), fanouts=[2], batch_size=4, seed_nodes=np.arange(N))


@pytest.mark.parametrize("meta,message", [
    ({"num_nodes": {"": -1}}, r"section 'meta': num_nodes\[''\]: expected a non-negative integer, found -1"),
    ({"num_nodes": {"": True}}, r"section 'meta': num_nodes\[''\]: expected a non-negative integer, found True"),
    ({"num_nodes": {"": 10.0}}, r"section 'meta': num_nodes\[''\]: expected a non-negative integer, found 10.0"),
    ({"num_nodes": 10}, r"section 'meta': num_nodes: expected an object \{node type: count\}, found 10"),
    ({"num_nodes": {"a": 2**62, "b": 2**62}},
     r"section 'meta': num_nodes: expected at most 4611686018427387904 nodes in all, found 9223372036854775808"),
    ([1, 2], r"section 'meta': expected a JSON object, found list"),
], ids=["negative", "bool", "float", "not_a_dict", "overflow", "list"])
def test_meta_counts_that_cannot_be_true_are_refused(tmp_path, meta, message):
  path = str(tmp_path / "m.graphbin")
  with GraphBinWriter(path) as w:
    w.add("meta", np.frombuffer(json.dumps(meta).encode(), np.uint8))
  _refused(path, message)


def test_meta_that_is_not_json_is_refused(tmp_path):
  path = str(tmp_path / "j.graphbin")
  with GraphBinWriter(path) as w:
    w.add("meta", np.frombuffer(b"{\"num_nodes\": ", np.uint8))
  _refused(path, r"section 'meta': not JSON \(")
  with GraphBinWriter(path) as w:
    w.add("meta", np.frombuffer(b"{}", np.uint8).astype(np.int16))
  _refused(path, r"section 'meta': dtype: expected \|u1 of 1 dimension, found <i2 of 1")


def test_a_scalar_where_rows_are_due_is_refused(tmp_path):
  path = str(tmp_path / "s.graphbin")
  with GraphBinWriter(path) as w:
    w.add_meta(_homogeneous_meta())
    with w.stream("node/feat", "<f4", ()) as s:
      s.write(np.array([3.0], np.float32))
  _refused(path, r"section 'node/feat': dimensions: expected at least 1, found 0")


def test_a_link_split_whose_edges_leave_the_graph_is_refused(tmp_path):
  sections = {k: v for k, v in _homogeneous_sections().items() if not k.startswith("split/")}
  meta = {**_homogeneous_meta(), "task": "link"}
  ok = _write(str(tmp_path / "ok.graphbin"), sections, meta, {"split/time/train/edge": np.array([[0, 1], [2, 3]]),
                                                               "split/time/train/weight": np.array([7.5, -1.0])})
  assert lg.load(ok).num_nodes == N
  bad = _write(str(tmp_path / "bad.graphbin"), sections, meta, {"split/time/valid/edge_neg": np.array([[0, 1], [2, 30]])})
  _refused(bad, r"section 'split/time/valid/edge_neg': ids outside \[0, 10\): found 30 at position 3")


# ---- heterogeneous graphs -----------------------------------------------------------------------------------

COUNTS = {"author": 4, "paper": 3}
REL, REV = "author___writes___paper", "paper___rev_writes___author"


def _hetero_sections() -> dict[str, np.ndarray]:
  return {
      f"rel/{REL}/indptr": np.array([0, 1, 2, 3, 4], np.int64),  # rows: authors; neighbours: papers
      f"rel/{REL}/indices": np.array([0, 1, 2, 0], np.int32),
      f"rel/{REL}/edge/reltype": np.zeros((4, 1), np.int64),
      f"csc/rel/{REL}/indptr": np.array([0, 2, 3, 4], np.int64),
      f"csc/rel/{REL}/indices": np.array([0, 3, 1, 2], np.int32),
      f"rel/{REV}/indptr": np.array([0, 2, 3, 4], np.int64),
      f"rel/{REV}/indices": np.array([0, 3, 1, 2], np.int32),
      "node/paper/feat": np.arange(6, dtype=np.float32).reshape(3, 2),
      "node/paper/label": np.array([[0], [1], [0]], np.int64),
      "node/paper/year": np.array([[2019], [2020], [2021]], np.int64),
      "node_type_offsets": np.array([0, 4, 7], np.int64),
      "split/time/paper/train": np.array([0, 1], np.int64),
      "split/time/paper/valid": np.array([2], np.int64),
  }


def _hetero_meta(**changes) -> dict:
  meta = {"format": "graphbin", "layout": "heterogeneous", "task": "node", "num_nodes": dict(COUNTS),
          "node_types": sorted(COUNTS), "relations": [REL, REV], "splits": ["split/time/paper"],
          "reverse_relations": {REV: {"num_edges": 4, "reverse_of": REL}}}
  meta.update(changes)
  return meta


def test_a_consistent_heterogeneous_graph_loads_and_samples(tmp_path):
  path = _write(str(tmp_path / "ok.graphbin"), _hetero_sections(), _hetero_meta())
  sampler = lg.HeteroNeighborSampler(lg.load(path), fanouts=[2], batch_size=2)
  assert sampler.batch(0)["x/paper"].shape[1] == 2


X = {
    f"rel/{REL}/indptr": (np.array([0, 1, 2, 3], np.int64),
                          rf"section 'rel/{REL}/indptr': length: expected 5 \(num_nodes\['author'\] \+ 1\), found 4"),
    f"rel/{REL}/indices": (np.array([0, 1, 3, 0], np.int32),
                           rf"section 'rel/{REL}/indices': indices outside \[0, 3\): found 3 at position 2"),
    f"rel/{REL}/edge/reltype": (np.zeros((5, 1), np.int64),
                                rf"section 'rel/{REL}/edge/reltype': rows: expected 4 \(entries of 'rel/{REL}/indices'\), found 5"),
    f"csc/rel/{REL}/indptr": (np.array([0, 2, 3, 4, 4], np.int64),
                              rf"section 'csc/rel/{REL}/indptr': length: expected 4 \(num_nodes\['paper'\] \+ 1\), found 5"),
    f"csc/rel/{REL}/indices": (np.array([0, 4, 1, 2], np.int32),
                               rf"section 'csc/rel/{REL}/indices': indices outside \[0, 4\): found 4 at position 1"),
    "node/paper/feat": (np.zeros((2, 2), np.float32),
                        r"section 'node/paper/feat': rows: expected 3 \(meta num_nodes\['paper'\]\), found 2"),
    "node/paper/label": (np.zeros((4, 1), np.int64),
                         r"section 'node/paper/label': rows: expected 3 \(meta num_nodes\['paper'\]\), found 4"),
    "node/venue/feat": (np.zeros((3, 2), np.float32),
                        r"section 'node/venue/feat': node type 'venue' is not in meta num_nodes \['author', 'paper'\]"),
    "split/time/paper/train": (np.array([0, 3], np.int64),
                               r"section 'split/time/paper/train': ids outside \[0, 3\): found 3 at position 1"),
    "split/time/venue/train": (np.array([0], np.int64),
                               r"section 'split/time/venue/train': node type 'venue' is not in meta num_nodes"),
    "node_type_offsets": (np.array([0, 3, 7], np.int64),
                          r"section 'node_type_offsets': expected \[0, 4, 7\] \(meta num_nodes in type order\), "
                          r"found \[0, 3, 7\]"),
    "rel/author___cites___venue/indptr": (np.array([0, 0, 0, 0, 0], np.int64),
                                          r"section 'rel/author___cites___venue/indptr': node type 'venue' is not in "
                                          r"meta num_nodes"),
    "rel/author_cites_paper/indptr": (np.array([0], np.int64),
                                      r"section 'rel/author_cites_paper/indptr': relation 'author_cites_paper' is not "
                                      r"<head>___<relation>___<tail>"),
    f"rel/{REV}/indices": (DROP, rf"section 'rel/{REV}/indptr' has no 'rel/{REV}/indices' beside it"),
}


@pytest.mark.parametrize("name", sorted(X))
def test_a_heterogeneous_section_that_contradicts_the_others_is_refused(tmp_path, name):
  value, message = X[name]
  path = _write(str(tmp_path / "h.graphbin"), _hetero_sections(), _hetero_meta(), {name: value})
  _refused(path, message)
  with pytest.raises(GraphBinError):
    lg.HeteroNeighborSampler(lg.Graph(path), fanouts=[2], batch_size=2, seed_type="paper")


def test_node_type_offsets_of_another_length_are_refused_before_their_values_are_listed(tmp_path):
  """The section was turned into a Python list (and printed in the message) whatever its length: 8M entries
  took 320 MB and a 70 MB message."""
  path = _write(str(tmp_path / "h.graphbin"), _hetero_sections(), _hetero_meta(),
                {"node_type_offsets": np.zeros(1 << 20, np.int64)})
  _refused(path, r"section 'node_type_offsets': length: expected 3 \(node types \+ 1\), found 1048576$")


@pytest.mark.parametrize("meta,message", [
    (_hetero_meta(relations=[REL, REV, "paper___cites___paper"]),
     r"section 'meta': relations lists 'paper___cites___paper', the file has no 'rel/paper___cites___paper/indptr'"),
    (_hetero_meta(relations=[REL]), rf"section 'rel/{REV}/indptr': relation '{REV}' is not in meta relations"),
    (_hetero_meta(reverse_relations={REV: {"num_edges": 9, "reverse_of": REL}}),
     rf"section 'meta': reverse_relations\['{REV}'\]\['num_edges'\]: expected 4 \(entries of "
     rf"'rel/{REV}/indices'\), found 9"),
], ids=["listed_but_absent", "present_but_unlisted", "reverse_count"])
def test_heterogeneous_meta_that_contradicts_the_sections_is_refused(tmp_path, meta, message):
  _refused(_write(str(tmp_path / "h.graphbin"), _hetero_sections(), meta), message)


# ---- the manifest's claims about the graph -----------------------------------------------------------------


def _convert(tmp_path, name: str, write, *flags, **kw) -> str:
  truth = write(str(tmp_path / "ogb" / name), 1, **kw)
  out = str(tmp_path / f"out_{name}")
  ogb_graphs.run([f"--input={truth.folder}", f"--output={out}", *flags])
  return out


@pytest.mark.slow  # end-to-end converter runs: what ogb_graphs writes, the loader accepts
@pytest.mark.parametrize("name,write,flags,kw", [
    ("ogbn_arxiv", mo.write_homogeneous_node, ["--csc=true"], {"num_nodes": 120, "num_edges": 500}),
    ("ogbn_mag", mo.write_heterogeneous_node, ["--add_reverse_relations=true", "--csc=true"], {}),
    ("ogbl_collab", mo.write_link, [], {"num_nodes": 100, "num_edges": 300}),
    ("ogbn_papers100M", mo.write_binary_node, [], {"num_nodes": 150, "num_edges": 600}),
], ids=["homogeneous", "heterogeneous", "link", "binary"])
def test_every_layout_the_converter_writes_passes_the_checks(tmp_path, name, write, flags, kw):
  out = _convert(tmp_path, name, write, *flags, **kw)
  graph = lg.load(out)
  assert graph.num_nodes == sum(json.load(open(os.path.join(out, MANIFEST_FILENAME)))["graph"]["num_nodes"].values())


def test_verify_finds_what_the_loader_refuses(tmp_path):
  """`inspect --verify` checked only the CRCs and the SHA-256: a file whose checksums match (the writer made
  them) but whose indices pass the node count, or whose node counts are not the manifest's, was 'OK'."""
  summary = {"layout": "homogeneous", "task": "node", "num_nodes": {"": N}, "num_edges": {"": 2 * N}}
  bad = np.where(np.arange(2 * N) == 7, N, _INDICES).astype(np.int32)
  for name, overrides, listed, message in [
      ("indices", {"indices": bad}, N, r"section 'indices': indices outside \[0, 10\)"),
      ("counts", {}, 121, r"num_nodes: expected \{'': 121\} \(the manifest's graph\)")]:
    out = make_outputs.write_graph(str(tmp_path / name), lambda w, o=overrides: _fill(
        w, _homogeneous_sections(), _homogeneous_meta(), o), graph={**summary, "num_nodes": {"": listed}})
    report = io.StringIO()
    assert output_lib.verify(out, output_lib.load_manifest(out), report) == 1
    assert re.search(message, report.getvalue()) and "verify: 0/1 files OK" in report.getvalue()
    assert inspect.main([out, "--verify"]) != 0
  good = make_outputs.write_graph(str(tmp_path / "good"), lambda w: _fill(w, _homogeneous_sections(),
                                                                          _homogeneous_meta()), graph=summary)
  assert inspect.main([good, "--verify"]) == 0


def test_a_manifest_whose_node_counts_differ_from_the_file_is_refused(tmp_path):
  summary = {"layout": "homogeneous", "task": "node", "num_nodes": {"": N}, "num_edges": {"": 2 * N}}
  out = make_outputs.write_graph(str(tmp_path / "graph"),
                                 lambda w: _fill(w, _homogeneous_sections(), _homogeneous_meta()), graph=summary)
  assert lg.load(out).num_nodes == N
  path = os.path.join(out, MANIFEST_FILENAME)
  m = json.load(open(path))
  m["graph"]["num_nodes"][""] = 121
  json.dump(m, open(path, "w"))
  graphbin = os.path.join(out, m["files"][0]["path"])
  with pytest.raises(GraphBinError, match=rf"{re.escape(graphbin)}: section 'meta': num_nodes: expected "
                                          rf"\{{'': 121\}} \(the manifest's graph\), found \{{'': {N}\}}"):
    lg.load(out)
