"""Manifests that lie: paths that leave the output, impossible counts, digests and schemas.

An output lives in a bucket other teams can write to, so `manifest.json` is untrusted input. It is
refused when it is parsed (`Manifest.loads` / `from_json`), and so by every reader, by
`python -m formats.outputs.inspect` (`--verify`, `--repair`) and by the commit's clean-up, which all parse
it there. The errors are one line naming the field and the bad value.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from formats import arrayrecord
from formats.errors import CorruptRecordError
from formats.outputs import commit, inspect
from formats.features import ClassLabel, Features, Image, Tensor, Text
from formats.manifest import MANIFEST_FILENAME, FileInfo, Manifest, Rejected, ShardInfo, SplitInfo
from tests.conftest import REPO

GEN = "gen-20260101T000000-0123abcd"
SHA = "ab" * 32


def _good() -> dict:
  shards = tuple(ShardInfo(f"{GEN}/d-train.array_record-0000{i}-of-00002", 3, 100 + i, SHA) for i in range(2))
  m = Manifest("d", "array_record",
               Features({"image": Image(shape=(None, None, 3)), "label": ClassLabel(("cat", "dog")),
                         "pixels": Tensor(shape=(2, 3), dtype="float32"), "file_name": Text()}),
               {"train": SplitInfo(shards), "test": SplitInfo((ShardInfo(f"{GEN}/d-test.array_record-00000-of-00001",
                                                                         1, 50, SHA),))},
               Rejected(1, {"not an image": 1}, f"{GEN}/errors/rejected.jsonl"), source={"input": "/data/x"})
  return json.loads(m.dumps())


def _refused(d: dict, message: str) -> str:
  with pytest.raises(ValueError, match=message) as e:
    Manifest.from_json(d)
  with pytest.raises(ValueError, match=message):
    Manifest.loads(json.dumps(d))
  assert "\n" not in str(e.value)
  return str(e.value)


def test_the_good_manifest_round_trips():
  d = _good()
  assert Manifest.from_json(d).to_json() == d
  root = copy.deepcopy(d)  # an output written before generations: data files at the root
  for s in root["splits"]["train"]["shards"]:
    s["path"] = s["path"].split("/", 1)[1]
  root["rejected"]["path"] = "errors/rejected.jsonl"
  assert Manifest.from_json(root).to_json() == root


# ---- paths stay inside the output ---------------------------------------------------------------------------

BAD_PATHS = {
    "parent": "../elsewhere/d-train.array_record-00000-of-00002",
    "parent_inside": f"{GEN}/../../d-train.array_record-00000-of-00002",
    "absolute": "/etc/passwd",
    "gs": "gs://another-bucket/d-train.array_record-00000-of-00002",
    "file_scheme": "file:d-train.array_record-00000-of-00002",
    "dot": f"./{GEN}/x",
    "dot_inside": f"{GEN}/./x",
    "empty_segment": f"{GEN}//x",
    "trailing_slash": f"{GEN}/",
    "backslash": f"{GEN}\\..\\x",
    "nul": f"{GEN}/x\x00.array_record",
    "newline": f"{GEN}/x\n.array_record",
    "delete": f"{GEN}/x\x7f",
    "empty": "",
    "too_long": f"{GEN}/" + "x" * 1100,
}
FIELDS = {
    "splits.train.shards[1].path": lambda d, p: d["splits"]["train"]["shards"][1].__setitem__("path", p),
    "rejected.path": lambda d, p: d["rejected"].__setitem__("path", p),
    "files[0].path": lambda d, p: d.__setitem__("files", [{"path": p, "num_bytes": 1, "sha256": SHA,
                                                            "kind": "graphbin"}]),
}


@pytest.mark.parametrize("field", sorted(FIELDS))
@pytest.mark.parametrize("case", sorted(BAD_PATHS))
def test_a_path_that_leaves_the_output_is_refused(field, case):
  d = _good()
  FIELDS[field](d, BAD_PATHS[case])
  msg = _refused(d, rf"manifest {re.escape(field)}: path ")
  assert repr(BAD_PATHS[case])[:60] in msg


@pytest.mark.parametrize("value", [5, None, ["a"]])
def test_a_path_that_is_not_a_string_is_refused(value):
  d = _good()
  d["splits"]["train"]["shards"][0]["path"] = value
  _refused(d, re.escape(f"manifest splits.train.shards[0].path: expected a relative path, found {value!r}"))


def test_the_same_path_twice_is_refused():
  d = _good()
  d["splits"]["train"]["shards"][1]["path"] = d["splits"]["train"]["shards"][0]["path"]
  _refused(d, r"manifest splits.train.shards\[1\].path: path 'gen-.*-00000-of-00002' is also "
              r"splits.train.shards\[0\].path")
  d = _good()
  d["rejected"]["path"] = d["splits"]["train"]["shards"][1]["path"]
  _refused(d, r"manifest rejected.path: path .* is also splits.train.shards\[1\].path")
  d = _good()
  d["files"] = [{"path": d["rejected"]["path"], "num_bytes": 1, "sha256": SHA, "kind": "graphbin"}]
  _refused(d, r"manifest rejected.path: path .* is also files\[0\].path")
  d = _good()  # two splits naming one file: their SHA-256s prove or refute it when the shard is read
  d["splits"]["test"]["shards"][0]["path"] = d["splits"]["train"]["shards"][0]["path"]
  assert Manifest.from_json(d).splits["test"].shards[0].path == d["splits"]["train"]["shards"][0]["path"]


# ---- counts, digests, names and schemas ---------------------------------------------------------------------


def _set(path: str, value):
  def edit(d):
    *keys, last = path.split(".")
    for k in keys:
      d = d[int(k)] if k.isdigit() else d[k]
    d[last] = value
  return edit


CLAIMS = [
    ("shard_records_negative", _set("splits.train.shards.0.num_records", -1),
     r"manifest splits.train.shards\[0\].num_records: expected a non-negative integer, found -1"),
    ("shard_records_bool", _set("splits.train.shards.0.num_records", True),
     r"manifest splits.train.shards\[0\].num_records: expected a non-negative integer, found True"),
    ("shard_records_float", _set("splits.train.shards.0.num_records", 3.0),
     r"manifest splits.train.shards\[0\].num_records: expected a non-negative integer, found 3.0"),
    ("shard_bytes_huge", _set("splits.train.shards.1.num_bytes", 2**64),
     r"manifest splits.train.shards\[1\].num_bytes: expected a non-negative integer, found 18446744073709551616"),
    ("split_records", _set("splits.train.num_records", 99),
     r"manifest splits.train.num_records: 99 disagrees with its shards' sum, 6"),
    ("split_bytes", _set("splits.train.num_bytes", 5),
     r"manifest splits.train.num_bytes: 5 disagrees with its shards' sum, 201"),
    ("sha_upper", _set("splits.train.shards.0.sha256", "AB" * 32),
     r"manifest splits.train.shards\[0\].sha256: expected 64 lowercase hex digits, found 'ABAB"),
    ("sha_short", _set("splits.train.shards.0.sha256", "ab" * 31),
     r"manifest splits.train.shards\[0\].sha256: expected 64 lowercase hex digits, found 'abab"),
    ("sha_not_hex", _set("splits.train.shards.0.sha256", "zz" * 32),
     r"manifest splits.train.shards\[0\].sha256: expected 64 lowercase hex digits"),
    ("shard_extra_key", _set("splits.train.shards.0.offset", 7),
     r"manifest splits.train.shards\[0\]: unknown field 'offset'"),
    ("records_sum", lambda d: d["splits"]["train"].update(
        shards=[{**d["splits"]["train"]["shards"][0], "num_records": 2**62}] * 3),
     r"manifest splits.train.num_records: its shards' sum, \d+, is over"),  # len() of the split overflowed
    ("shard_missing_key", lambda d: d["splits"]["train"]["shards"][0].pop("sha256"),  # was a TypeError
     r"manifest splits.train.shards\[0\]: missing field 'sha256'"),
    ("shards_not_list", _set("splits.train.shards", {"path": "x"}),
     r"manifest splits.train.shards: expected a list, found dict"),
    ("rejected_count", _set("rejected.count", -2), r"manifest rejected.count: expected a non-negative integer, found -2"),
    ("by_reason", _set("rejected.by_reason", {"x": -1}),
     r"manifest rejected.by_reason\['x'\]: expected a non-negative integer, found -1"),
    ("tensor_dtype_object", _set("features.pixels.dtype", "object"),
     r"manifest features.pixels.dtype: expected one of bool, int8, .*, found 'object'"),
    ("tensor_dtype_bytes", _set("features.pixels.dtype", "S8"), r"manifest features.pixels.dtype: expected one of"),
    ("tensor_dtype_complex", _set("features.pixels.dtype", "<c8"), r"manifest features.pixels.dtype: expected one of"),
    ("tensor_dtype_odd_size", _set("features.pixels.dtype", ">i3"), r"manifest features.pixels.dtype: expected one of"),
    ("tensor_dtype_f1", _set("features.pixels.dtype", "<f1"), r"manifest features.pixels.dtype: expected one of"),
    ("tensor_dtype_code_and_junk", _set("features.pixels.dtype", "<i4\n"),
     r"manifest features.pixels.dtype: expected one of"),
    ("tensor_dim_negative", _set("features.pixels.shape", [2, -3]),
     r"manifest features.pixels.shape: expected a list of non-negative integers or null, found \[2, -3\]"),
    ("tensor_dim_bool", _set("features.pixels.shape", [True, 3]),
     r"manifest features.pixels.shape: expected a list of non-negative integers or null, found \[True, 3\]"),
    ("tensor_dim_float", _set("features.pixels.shape", [2.5, 3]), r"manifest features.pixels.shape: expected a list"),
    ("tensor_rank", _set("features.pixels.shape", [1] * 40),
     r"manifest features.pixels.shape: expected at most 32 dimensions, found 40"),
    ("tensor_overflow", _set("features.pixels.shape", [2**40, 2**40]),
     r"manifest features.pixels.shape: expected at most 2\*\*62 elements, found 1208925819614629174706176"),
    ("image_dim_negative", _set("features.image.shape", [None, -1, 3]),
     r"manifest features.image.shape: expected a list of non-negative integers or null, found \[None, -1, 3\]"),
    ("class_count", _set("features.label.num_classes", 5),
     r"manifest features.label.num_classes: 5 disagrees with its 2 names"),
    ("class_names", _set("features.label.names", ["cat", 3]),
     r"manifest features.label.names: expected a list of strings, found \['cat', 3\]"),
    ("unknown_kind", _set("features.pixels.kind", "pickle"), r"unknown feature kind 'pickle'"),
    ("feature_name_path", lambda d: d["features"].__setitem__("../../label", d["features"].pop("label")),
     r"feature name '../../label' must be 1..128 letters, digits, '_', '.' or '-'"),
    ("feature_name_slash", lambda d: d["features"].__setitem__("x/shape", d["features"].pop("pixels")),
     r"feature name 'x/shape' must be"),
    ("feature_name_long", lambda d: d["features"].__setitem__("f" * 129, d["features"].pop("pixels")),
     r"feature name 'fff.*' must be 1..128"),
    ("split_name_long", lambda d: d["splits"].__setitem__("s" * 129, d["splits"].pop("test")),
     r"split name 'sss.* is longer than 128 characters"),
    ("dataset_name_long", _set("name", "d" * 129), r"dataset name 'ddd.* is longer than 128 characters"),
    ("graph_nodes", _set("graph", {"num_nodes": {"": -5}}),
     r"manifest graph.num_nodes\[''\]: expected a non-negative integer, found -5"),
    ("warnings", _set("warnings", [3]), r"manifest warnings: expected a list of strings, found \[3\]"),
    ("source", _set("source", ["x"]), r"manifest source: expected an object, found list"),
    ("splits_not_dict", _set("splits", []), r"manifest splits: expected an object, found list"),
]


@pytest.mark.parametrize("edit,message", [c[1:] for c in CLAIMS], ids=[c[0] for c in CLAIMS])
def test_a_claim_that_cannot_be_true_is_refused(edit, message):
  d = _good()
  edit(d)
  _refused(d, message)


@pytest.mark.parametrize("data,message", [
    (b"[" * 100_000 + b"]" * 100_000, r"manifest.json is not JSON \(nested too deeply\)"),
    (b"[1, 2]", r"manifest.json: expected a JSON object, found list"),
])
def test_bytes_that_are_not_a_manifest_object_are_refused(data, message):
  with pytest.raises(ValueError, match=message):
    Manifest.loads(data)


# ---- every consumer refuses it: loaders, inspect (--verify, --repair), clean-up and repair -------------------


@pytest.fixture(scope="module")
def record_output(tmp_path_factory) -> str:
  """A committed output of 8x8 raw images in one shard, written with `formats` alone (tests/loaders/make_outputs)."""
  from tests.loaders import make_outputs

  features, payloads = make_outputs.raw_images(np.random.default_rng(0), 12, (8, 8))
  return make_outputs.write(str(tmp_path_factory.mktemp("hostile_manifest") / "out"), features, {"train": payloads},
                            kind="image")


@pytest.fixture(scope="module")
def converted_output(split_folder, tmp_path_factory) -> str:
  """image_folder's output of `split_folder` (its manifest names the input a rerun reads)."""
  from pipelines import image_folder

  out = str(tmp_path_factory.mktemp("hostile_converted") / "out")
  image_folder.run([f"--input={split_folder}", f"--output={out}", "--encoding=raw", "--image_size=8,8",
                    "--num_shards=1"])
  return out


def _tree(root: str) -> dict[str, bytes]:
  return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
          for d, _, fs in os.walk(root) for f in fs}


def _escape(record_output: str, tmp_path) -> tuple[str, str]:
  """A copy of the output whose first train shard path leaves it: `../outside/<the same bytes>`."""
  out = str(tmp_path / "out")
  shutil.copytree(record_output, out)
  path = os.path.join(out, MANIFEST_FILENAME)
  m = json.load(open(path))
  shard = m["splits"]["train"]["shards"][0]
  os.makedirs(tmp_path / "outside")
  shutil.copy(os.path.join(out, shard["path"]), tmp_path / "outside" / os.path.basename(shard["path"]))
  shard["path"] = "../outside/" + os.path.basename(shard["path"])
  json.dump(m, open(path, "w"), indent=2)
  return out, shard["path"]


def test_readers_refuse_a_manifest_whose_shard_leaves_the_output(record_output, tmp_path):
  from loaders import ShardedRecords
  from loaders import grain as grain_loader

  out, bad = _escape(record_output, tmp_path)
  message = rf"manifest splits.train.shards\[0\].path: path '{bad}'"
  for open_it in (lambda: ShardedRecords(out), lambda: ShardedRecords(out, verify="none"),
                  lambda: grain_loader.data_source(out)):
    with pytest.raises(ValueError, match=message):
      open_it()


@pytest.mark.slow  # a subprocess (inspect --repair)
def test_inspect_refuses_it_and_exits_non_zero(record_output, tmp_path, capsys):
  out, bad = _escape(record_output, tmp_path)
  for flags in ([], ["--verify"]):
    assert inspect.main([out, *flags]) == 2
    assert f"splits.train.shards[0].path: path '{bad}'" in capsys.readouterr().err
  before = _tree(str(tmp_path))
  r = subprocess.run([sys.executable, "-m", "formats.outputs.inspect", out, "--repair"], capture_output=True, text=True,
                     cwd=REPO, timeout=300)
  assert r.returncode == 2 and r.stderr.startswith("inspect: error: "), r.stderr[-2000:]
  assert f"splits.train.shards[0].path: path '{bad}'" in r.stderr
  assert _tree(str(tmp_path)) == before


@pytest.mark.slow  # runs converters in subprocesses
@pytest.mark.parametrize("mode", ["--overwrite=true", "--mode=append"])
def test_a_run_on_it_refuses_in_one_line_and_writes_nothing(converted_output, tmp_path, mode):
  """A rebuild or an append over an output whose manifest lies is refused before anything is written
  (no generation claimed, no clean-up, no TFDS sync): the operator must look at it first."""
  out, bad = _escape(converted_output, tmp_path)
  source = json.load(open(os.path.join(out, MANIFEST_FILENAME)))["source"]["input"]
  before = _tree(str(tmp_path))
  r = subprocess.run([sys.executable, "-m", "pipelines.image_folder", f"--input={source}", f"--output={out}", mode],
                     capture_output=True, text=True, cwd=REPO, timeout=300)
  assert r.returncode == 2, r.stderr[-2000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("pipelines.image_folder: error: --output") and "not a valid manifest" in last
  assert f"path '{bad}'" in last
  assert _tree(str(tmp_path)) == before


def test_cleanup_and_repair_refuse_it_and_delete_nothing(record_output, tmp_path):
  out, bad = _escape(record_output, tmp_path)
  dead = os.path.join(out, "gen-20000101T000000-deadbeef")  # a killed run's generation, long without heartbeat
  os.makedirs(dead)
  open(os.path.join(dead, commit.MARKER_FILENAME), "w").write(json.dumps(
      {"toolkit": commit.TOOLKIT, "generation": os.path.basename(dead), "state": "abandoned"}))
  open(os.path.join(dead, "d-train.array_record-00000-of-00001"), "wb").write(b"old")
  os.utime(os.path.join(dead, commit.MARKER_FILENAME), (0, 0))
  before = _tree(str(tmp_path))
  for clean in (lambda: commit.cleanup(out), lambda: commit.cleanup(out, lease_seconds=0),
                lambda: commit.repair(out)):
    with pytest.raises(ValueError, match=rf"manifest splits.train.shards\[0\].path: path '{bad}'"):
      clean()
    assert _tree(str(tmp_path)) == before


@pytest.mark.slow  # an end-to-end ogb_graphs run (Beam)
def test_the_graph_loader_refuses_a_graph_file_outside_the_output(tmp_path):
  from scripts import make_sample_ogb as mo

  from loaders import graph as lg
  from pipelines import ogb_graphs

  truth = mo.write_homogeneous_node(str(tmp_path / "ogb" / "ogbn_arxiv"), 1, num_nodes=100, num_edges=300)
  out = str(tmp_path / "graph")
  ogb_graphs.run([f"--input={truth.folder}", f"--output={out}"])
  path = os.path.join(out, MANIFEST_FILENAME)
  m = json.load(open(path))
  src = os.path.join(out, m["files"][0]["path"])
  shutil.copy(src, tmp_path / "elsewhere.graphbin")
  m["files"][0]["path"] = os.path.abspath(tmp_path / "elsewhere.graphbin")
  json.dump(m, open(path, "w"))
  with pytest.raises(ValueError, match=r"manifest files\[0\].path: path '/"):
    lg.load(out)


# ------------------------------------------------------------------ a damaged ArrayRecord file


def _damaged_array_record(tmp_path, damage: str) -> str:
  path = str(tmp_path / f"{damage}.array_record")
  arrayrecord.write_file(path, [bytes([i]) * 3000 for i in range(40)])
  data = open(path, "rb").read()
  with open(path, "wb") as f:
    f.write({"zeros": bytes(200 << 10), "cut": data[:-10], "tiny": data[:5]}[damage])
  return path


@pytest.mark.parametrize("damage", ["zeros", "cut", "tiny"])
def test_a_damaged_array_record_file_is_a_corrupt_record_error_not_an_empty_file(tmp_path, damage):
  """array_record's reader opens a damaged file without raising, ok() False and 0 records, and raises its
  reason (RuntimeError) only on close: the file read as empty, then a RuntimeError from close or at exit."""
  path = _damaged_array_record(tmp_path, damage)
  for read in (lambda: arrayrecord.RandomAccessReader(path), lambda: arrayrecord.num_records(path),
               lambda: list(arrayrecord.read_file(path))):
    with pytest.raises(CorruptRecordError, match=rf"^{re.escape(path)}: the ArrayRecord reader refuses the file"):
      read()


def test_a_missing_array_record_file_is_not_reported_as_damage(tmp_path):
  """The C++ reader says RuntimeError for a missing file as for a damaged one: it was a CorruptRecordError."""
  path = str(tmp_path / "gone.array_record")
  for read in (lambda: arrayrecord.RandomAccessReader(path), lambda: arrayrecord.num_records(path)):
    with pytest.raises(FileNotFoundError):
      read()


@pytest.mark.parametrize("info", [
    b"[" * 100_000 + b"]" * 100_000,  # RecursionError in json
    b'{"splits": [{"filepathTemplate": 5}]}',  # TypeError in the template's parse
])
def test_a_hostile_dataset_info_does_not_stop_listing_or_cleanup(record_output, tmp_path, info):
  out = str(tmp_path / "out")
  shutil.copytree(record_output, out)
  with open(os.path.join(out, "dataset_info.json"), "wb") as f:
    f.write(info)
  assert commit.tfds_metadata_lags(out)  # the TFDS view names no generation: it lags the manifest
  assert [g.name for g in commit.list_generations(out)]
  commit.cleanup(out)
  assert inspect.main([out, "--verify"]) == 0
