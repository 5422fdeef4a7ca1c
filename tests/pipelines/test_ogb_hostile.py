"""Hostile OGB input: every malformed file ends as one `file: line N: reason`, exit 1, no manifest.

Lines count as OGB's files do: 1-based rows of the CSV (a header row counts).
Folders are tiny copies of scripts/make_sample_ogb.py's, broken one cell or row at a time.
"""

from __future__ import annotations

from collections.abc import Callable
import gzip
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from formats.outputs import inspect
from formats.storage import files
from formats.graphbin import GraphBin
from formats.manifest import Manifest
from pipelines import ogb_graphs
from pipelines.ogb_graphs.read import OgbFormatError
from scripts import make_sample_ogb as mo
from tests.conftest import REPO

REL = "___".join(mo.MAG_RELATIONS[0])  # author___affiliated_with___institution
ARXIV_NODES, ARXIV_EDGES = 40, 120
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
  root = tmp_path_factory.mktemp("hostile_src")
  return {
      "arxiv": str(mo.write_homogeneous_node(root / "ogbn_arxiv", 0, ARXIV_NODES, ARXIV_EDGES, feat_dim=3).folder),
      "mag": str(mo.write_heterogeneous_node(
          root / "ogbn_mag", 0, {"author": 20, "field_of_study": 10, "institution": 5, "paper": 30},
          {r: 25 for r in mo.MAG_RELATIONS}, feat_dim=3).folder),
      "papers": str(mo.write_binary_node(root / "ogbn_papers100M", 0, 40, 120, feat_dim=3).folder),
      "molhiv": str(mo.write_graph_property(root / "ogbg_molhiv", 0, num_graphs=10).folder),
  }


def _copy(sources: dict[str, str], kind: str, tmp_path) -> str:
  dst = str(tmp_path / os.path.basename(sources[kind]))
  shutil.copytree(sources[kind], dst)
  return dst


def _lines(path: str) -> list[bytes]:
  with gzip.open(path, "rb") as f:
    return f.read().split(b"\n")[:-1]


def _write_lines(path: str, lines: list[bytes]) -> None:
  with gzip.open(path, "wb") as f:
    f.write(b"".join(line + b"\n" for line in lines))


def _edit(folder: str, rel: str, edit: Callable[[list[bytes]], list[bytes]]) -> str:
  path = os.path.join(folder, rel)
  _write_lines(path, edit(_lines(path)))
  return path


def _set_line(line: int, text: bytes) -> Callable[[list[bytes]], list[bytes]]:
  def edit(lines: list[bytes]) -> list[bytes]:
    lines[line - 1] = text
    return lines
  return edit


def _first_cell(line: int, cell: bytes) -> Callable[[list[bytes]], list[bytes]]:
  def edit(lines: list[bytes]) -> list[bytes]:
    lines[line - 1] = b",".join([cell, *lines[line - 1].split(b",")[1:]])
    return lines
  return edit


def _run(folder: str, out: str, *flags: str) -> None:
  ogb_graphs.run([f"--input={folder}", f"--output={out}", "--add_inverse_edges=false", *flags])


def _refused(folder: str, out: str, pattern: str, *flags: str) -> None:
  """The conversion fails with OgbFormatError matching `pattern` and leaves no manifest."""
  with pytest.raises(OgbFormatError, match=pattern):
    _run(folder, out, *flags)
  assert not os.path.exists(os.path.join(out, "manifest.json"))


def _cli(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "pipelines.ogb_graphs", *args], capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": REPO}, timeout=300)


def _one_line_error(r: subprocess.CompletedProcess, text: str) -> None:
  """Exit 1, and stderr ends with the one line `prog: error: ...text...`, the only such line,
  with no traceback (Beam's own log of the failing step's traceback is filtered by core.launch.main)."""
  assert r.returncode == 1, r.stderr
  last = r.stderr.rstrip("\n").splitlines()[-1]
  assert last.startswith("pipelines.ogb_graphs: error: " + text), r.stderr
  assert "[while running" not in last, r.stderr
  assert r.stderr.count("pipelines.ogb_graphs: error:") == 1, r.stderr
  assert "Traceback" not in r.stderr, r.stderr
  assert " ERROR " not in r.stderr, r.stderr


# --------------------------------------------------------------------------- observed cases


def test_empty_edge_file_is_a_one_line_error(sources, tmp_path):
  folder = _copy(sources, "arxiv", tmp_path)
  _write_lines(os.path.join(folder, "raw", "edge.csv.gz"), [])
  r = _cli(f"--input={folder}", f"--output={tmp_path}/out", "--add_inverse_edges=false")
  _one_line_error(r, f"{folder}/raw/edge.csv.gz: line 1: file ends after 0 rows; {folder}/raw/num-edge-list.csv.gz "
                     "says 120 edges")
  assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_short_node_feature_row_is_refused(sources, tmp_path):
  folder = _copy(sources, "arxiv", tmp_path)
  mo.corrupt_bad_row(folder, "raw/node-feat.csv.gz", line=5, kind="missing_column")
  _refused(folder, str(tmp_path / "out"), r"node-feat.csv.gz: line 5: 2 cells, expected 3")


@pytest.mark.parametrize("cell", [b"nan", b"inf", b"-inf", b"NaN", b"", b"1e999"])
def test_nonfinite_feature_is_refused(sources, tmp_path, cell):
  folder = _copy(sources, "arxiv", tmp_path)
  _edit(folder, "raw/node-feat.csv.gz", _first_cell(9, cell))
  _refused(folder, str(tmp_path / "out"), r"node-feat.csv.gz: line 9: non-finite value")


def test_nonfinite_feature_is_kept_with_the_flag(sources, tmp_path):
  folder = _copy(sources, "arxiv", tmp_path)
  _edit(folder, "raw/node-feat.csv.gz", _first_cell(9, b"nan"))
  _edit(folder, "raw/node-feat.csv.gz", _first_cell(10, b"-inf"))
  out = str(tmp_path / "out")
  _run(folder, out, "--allow_nonfinite=true")
  m = Manifest.loads(files.read_bytes(os.path.join(out, "manifest.json")))
  feat = np.asarray(GraphBin(os.path.join(out, m.files[0].path))["node/feat"])
  assert np.isnan(feat[8, 0])
  assert feat[9, 0] == -np.inf
  assert np.isfinite(np.delete(feat, [8, 9], 0)).all()


def test_nonfinite_edge_feature_is_refused(sources, tmp_path):
  folder = _copy(sources, "arxiv", tmp_path)
  weights = [b"0.5"] * ARXIV_EDGES
  weights[2] = b"inf"
  _write_lines(os.path.join(folder, "raw", "edge_weight.csv.gz"), weights)
  _refused(folder, str(tmp_path / "out"), r"edge_weight.csv.gz: line 3: non-finite value")


@pytest.mark.parametrize("change,line", [("more", ARXIV_EDGES + 1), ("fewer", ARXIV_EDGES - 1)])
def test_edge_rows_must_match_num_edge_list(sources, tmp_path, change, line):
  folder = _copy(sources, "arxiv", tmp_path)
  _edit(folder, "raw/edge.csv.gz", (lambda ls: ls + [b"0,1"]) if change == "more" else (lambda ls: ls[:-2]))
  _refused(folder, str(tmp_path / "out"), rf"edge.csv.gz: line {line}: .*num-edge-list.csv.gz says \W*{ARXIV_EDGES} edges")


def test_edge_count_mismatch_leaves_the_previous_output_intact(sources, tmp_path):
  folder = _copy(sources, "arxiv", tmp_path)
  out = str(tmp_path / "out")
  _run(folder, out)
  before = files.read_bytes(os.path.join(out, "manifest.json"))
  _edit(folder, "raw/edge.csv.gz", lambda ls: ls + [b"0,1", b"1,2"])
  r = _cli(f"--input={folder}", f"--output={out}", "--add_inverse_edges=false", "--overwrite=true")
  _one_line_error(r, f"{folder}/raw/edge.csv.gz: line {ARXIV_EDGES + 1}: more rows than {folder}/raw/num-edge-list.csv.gz "
                     f"says ({ARXIV_EDGES} edges)")
  assert files.read_bytes(os.path.join(out, "manifest.json")) == before
  assert inspect.main([out, "--verify"]) == 0


@pytest.mark.parametrize("cell", [b"99999999999999999999", b"-9223372036854775809"])
def test_out_of_int64_id_names_its_line(sources, tmp_path, cell):
  folder = _copy(sources, "arxiv", tmp_path)
  _edit(folder, "raw/edge.csv.gz", _first_cell(7, cell))
  _refused(folder, str(tmp_path / "out"), r"edge.csv.gz: line 7: .* outside the int64 range")


# --------------------------------------------------------------------------- every CSV the converter reads


CASES = {
    # name: (data set, file, edit, expected message)
    "node_label_empty_row": ("arxiv", "raw/node-label.csv.gz", _set_line(4, b""), r"line 4: empty row"),
    "node_label_inf": ("arxiv", "raw/node-label.csv.gz", _set_line(4, b"inf"), r"line 4: non-finite value"),
    "node_year_fewer_rows": ("arxiv", "raw/node_year.csv.gz", lambda ls: ls[:-1],
                             rf"line {ARXIV_NODES}: file ends after {ARXIV_NODES - 1} rows; .* {ARXIV_NODES} nodes"),
    "node_feat_more_rows": ("arxiv", "raw/node-feat.csv.gz", lambda ls: ls + [ls[0]],
                            rf"line {ARXIV_NODES + 1}: more rows than .*num-node-list.csv.gz says \({ARXIV_NODES} nodes\)"),
    "node_feat_empty": ("arxiv", "raw/node-feat.csv.gz", lambda ls: [], r"line 1: file ends after 0 rows"),
    "split_out_of_int64": ("arxiv", "split/time/train.csv.gz", _set_line(2, b"18446744073709551616"),
                           r"line 2: .* outside the int64 range"),
    "num_edge_list_negative": ("arxiv", "raw/num-edge-list.csv.gz", _set_line(1, b"-5"),
                               r"line 1: negative count"),
    "relation_more_edges": ("mag", f"raw/relations/{REL}/edge.csv.gz", lambda ls: ls + [b"0,0"],
                            r"line 26: more rows than .*num-edge-list.csv.gz says \(25 edges\)"),
    "relation_reltype_empty_row": ("mag", f"raw/relations/{REL}/edge_reltype.csv.gz", _set_line(3, b""),
                                   r"line 3: empty row"),
    "mag_feat_nan": ("mag", "raw/node-feat/paper/node-feat.csv.gz", _first_cell(2, b"nan"),
                     r"line 2: non-finite value"),
    "num_node_dict_not_a_number": ("mag", "raw/num-node-dict.csv.gz", _first_cell(2, b"x"),
                                   r"line 2: 'x' is not a number"),
    "triplet_short_row": ("mag", "raw/triplet-type-list.csv.gz", _set_line(2, b"author,writes"),
                          r"line 2: 2 cells, expected 3"),
    "graphs_edge_more_rows": ("molhiv", "raw/edge.csv.gz", lambda ls: ls + [b"0,0"],
                              r"line \d+: more rows than .*num-edge-list.csv.gz says \(\d+ edges\)"),
    "graphs_edge_feat_fewer_rows": ("molhiv", "raw/edge-feat.csv.gz", lambda ls: ls[:-1],
                                    r"line \d+: file ends after \d+ rows; .*num-edge-list.csv.gz says"),
    "graphs_node_feat_short_row": ("molhiv", "raw/node-feat.csv.gz", _set_line(3, b"1,2"),
                                   r"line 3: 2 cells, expected 9"),
    "graphs_node_feat_empty": ("molhiv", "raw/node-feat.csv.gz", lambda ls: [], r"line 1: file ends after 0 rows"),
    "graphs_split_out_of_range": ("molhiv", "split/scaffold/test.csv.gz", _set_line(1, b"10"),
                                  r"line 1: graph id outside \[0, 10\)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_csv_is_checked(sources, tmp_path, case):
  kind, rel, edit, message = CASES[case]
  folder = _copy(sources, kind, tmp_path)
  path = _edit(folder, rel, edit)
  _refused(folder, str(tmp_path / "out"), re.escape(path) + ": " + message)


# --------------------------------------------------------------------------- binary data.npz


def _rewrite_npz(folder: str, edit: Callable[[dict[str, np.ndarray]], None]) -> str:
  path = os.path.join(folder, "raw", "data.npz")
  with np.load(path) as z:
    arrays = {k: z[k] for k in z.files}
  edit(arrays)
  np.savez_compressed(path, **arrays)
  return path


def test_npz_nonfinite_feature_is_refused(sources, tmp_path):
  folder = _copy(sources, "papers", tmp_path)
  path = _rewrite_npz(folder, lambda a: a["node_feat"].__setitem__((5, 1), np.nan))
  _refused(folder, str(tmp_path / "out"), re.escape(path) + r":node_feat: row 5: non-finite value")


def test_npz_edge_count_must_match_num_edges_list(sources, tmp_path):
  folder = _copy(sources, "papers", tmp_path)
  path = _rewrite_npz(folder, lambda a: a.__setitem__("num_edges_list", a["num_edges_list"] + 3))
  _refused(folder, str(tmp_path / "out"), re.escape(path) + r":edge_index: 120 edges, num_edges_list says 123")
