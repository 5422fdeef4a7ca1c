"""Resumed conversions (pipelines/core/reuse.py): a rerun after a killed or failed run reuses the
shards that run published and commits an output byte-identical to a clean run's.

Every test checks the invariant, not only the exit status: the output verifies, its
fingerprint (tests/test_outputs_unchanged.py: every data file's bytes, the manifest
normalised) equals a clean run's, and a reused shard is never one whose bytes or inputs changed.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from formats import naming
from formats.outputs import commit
from formats.storage import files
from formats.manifest import Manifest, ShardInfo
from formats.outputs.output import verify as verify_output
from pipelines.core import reuse
from scripts import make_sample_images, make_sample_ogb as mo
from tests.conftest import upload_tree
from tests.pipelines.test_append import _run
from tests.test_outputs_unchanged import fingerprint

pytestmark = pytest.mark.slow

FLAGS = ("--num_shards=4", "--seed=3")  # 2 splits x 4 shards


def _summary(proc: subprocess.CompletedProcess) -> str:
  return next(line for line in proc.stdout.splitlines() if " records in " in line)


def _reused(proc: subprocess.CompletedProcess) -> int:
  line = _summary(proc)
  return int(line.split("(")[-1].split(" of ")[0]) if "shards reused" in line else 0


@pytest.fixture
def images(tmp_path) -> str:
  root = str(tmp_path / "pets")
  make_sample_images.make_folder(root, ["cat", "dog"], 8, ["train", "validation"], (64, 48), 2, seed=4)
  return root


@pytest.fixture
def clean(images, tmp_path) -> dict:
  """The fingerprint of a clean, uninterrupted run."""
  out = str(tmp_path / "clean")
  proc = _run(f"--input={images}", f"--output={out}", "--reuse_shards=false", *FLAGS)
  assert proc.returncode == 0, proc.stderr
  return fingerprint(out, images)


def _records(out: str) -> dict[str, list[str]]:
  """{generation: its shard records' file names}."""
  return {g: sorted(os.listdir(os.path.join(out, g, reuse.RECORDS_FOLDER))) for g in os.listdir(out)
          if naming.is_generation(g) and os.path.isdir(os.path.join(out, g, reuse.RECORDS_FOLDER))}


def test_a_rerun_after_a_kill_at_half_reuses_what_was_published_and_matches_a_clean_run(images, clean, tmp_path):
  out = str(tmp_path / "out")
  killed = _run(f"--input={images}", f"--output={out}", *FLAGS, fault="shards:published:4")
  assert killed.returncode == -9
  assert not os.path.exists(os.path.join(out, "manifest.json"))  # nothing committed
  (published,) = _records(out).values()
  assert len(published) == 4
  rerun = _run(f"--input={images}", f"--output={out}", *FLAGS)
  assert rerun.returncode == 0, rerun.stderr
  assert _reused(rerun) == 4, _summary(rerun)
  assert verify_output(out, Manifest.loads(files.read_bytes(os.path.join(out, "manifest.json")))) == 0
  assert fingerprint(out, images) == clean


def test_a_changed_input_or_flag_is_converted_again(images, tmp_path):
  out = str(tmp_path / "out")
  assert _run(f"--input={images}", f"--output={out}", *FLAGS).returncode == 0
  again = _run(f"--input={images}", f"--output={out}", "--overwrite=true", *FLAGS)
  assert _reused(again) == 8, _summary(again)  # nothing changed: every shard is the same plan
  victim = os.path.join(images, "train", "cat", sorted(os.listdir(os.path.join(images, "train", "cat")))[0])
  os.utime(victim, ns=(1, 1))  # same bytes, another version: its shard is converted again
  touched = _run(f"--input={images}", f"--output={out}", "--overwrite=true", *FLAGS)
  assert _reused(touched) == 7, _summary(touched)
  other_seed = _run(f"--input={images}", f"--output={out}", "--overwrite=true", "--num_shards=4", "--seed=4")
  assert _reused(other_seed) == 0, _summary(other_seed)
  off = _run(f"--input={images}", f"--output={out}", "--overwrite=true", "--reuse_shards=false", *FLAGS[:1],
             "--seed=4")
  assert off.returncode == 0
  assert _reused(off) == 0


def test_a_shard_whose_bytes_disagree_with_its_record_is_converted_again(images, clean, tmp_path):
  """A killed run's shard changed afterwards (or written by someone else) with its record left as it was,
  and a record overwritten with junk: neither shard is reused, both are converted again."""
  out = str(tmp_path / "out")
  assert _run(f"--input={images}", f"--output={out}", *FLAGS, fault="shards:published:4").returncode == -9
  (generation, names), = _records(out).items()
  shard = os.path.join(out, generation, names[0][:-len(".json")])
  with open(shard, "r+b") as f:  # same size, one byte flipped
    f.seek(100)
    b = f.read(1)
    f.seek(100)
    f.write(bytes([b[0] ^ 0xFF]))
  bad = os.path.join(out, generation, reuse.RECORDS_FOLDER, names[1])
  with open(bad, "w") as f:
    f.write('{"toolkit": "tpu-shards", "plan": "../../etc"}')
  rerun = _run(f"--input={images}", f"--output={out}", *FLAGS)
  assert rerun.returncode == 0, rerun.stderr
  assert _reused(rerun) == 2, rerun.stderr[-3000:]
  assert fingerprint(out, images) == clean


def test_a_record_that_lies_about_its_shard_is_refused():
  shard = ShardInfo("d-train.array_record-00001-of-00004", 3, 10, "b" * 64)
  good = reuse.ShardRecord("a" * 64, "train", 1, 4, shard, 3, 2, 1, (("x.jpg", "not an image", "train", 1),),
                           inputs=(("a.jpg", "v", 1), ("b.jpg", "v", 1), ("x.jpg", "v", 1)))
  assert reuse.ShardRecord.from_json(json.loads(json.dumps(good.to_json()))) == good
  for change in ({"index": 5}, {"num_shards": 1}, {"inputs_rejected": 0}, {"num_units": 9}, {"plan": "A" * 64},
                 {"rejects": [["x", "y", "train", -1]]}, {"shard": {**good.to_json()["shard"], "path": "../x"}},
                 {"shard": {**good.to_json()["shard"], "path": "d-train.array_record-00002-of-00004"}},
                 {"shard": {**good.to_json()["shard"], "num_bytes": -1}}, {"record_version": 99},
                 {"inputs": [["a.jpg", "v", 1], ["a.jpg", "v", 1], ["x.jpg", "v", 1]]}, {"inputs": []},
                 {"inputs": [["a.jpg", "v", 1], ["", "v", 1], ["x.jpg", "v", 1]]}):
    with pytest.raises(ValueError):
      reuse.ShardRecord.from_json({**good.to_json(), **change})


def test_a_resumed_run_on_gcs_reuses_by_server_side_copy(images, gcs_emulator, tmp_path):
  src = f"gs://{gcs_emulator}/resume/{tmp_path.name}/pets"
  upload_tree(images, src)
  base = f"gs://{gcs_emulator}/resume/{tmp_path.name}"
  clean_out, out = f"{base}/clean", f"{base}/out"
  assert _run(f"--input={src}", f"--output={clean_out}", "--reuse_shards=false", *FLAGS).returncode == 0
  killed = _run(f"--input={src}", f"--output={out}", *FLAGS, fault="shards:published:3")
  assert killed.returncode == -9
  rerun = _run(f"--input={src}", f"--output={out}", *FLAGS)
  assert rerun.returncode == 0, rerun.stderr
  assert _reused(rerun) == 3, _summary(rerun)

  def shards(o):
    m = Manifest.loads(files.read_bytes(files.join(o, "manifest.json")))
    assert verify_output(o, m) == 0
    return {k: [(s.path.split("/", 1)[1], s.sha256) for s in v.shards] for k, v in m.splits.items()}

  assert shards(out) == shards(clean_out)


def test_a_rerun_after_a_failed_run_reuses_its_shards(images, clean, tmp_path, monkeypatch, capsys):
  """A run that fails after its shards are published (here: in Finalize) keeps its generation,
  abandoned, for the retention period; the rerun reuses every shard."""
  from pipelines import image_folder
  from pipelines.core import shards

  out = str(tmp_path / "out")

  def crash(self, *a, **k):
    raise RuntimeError("worker lost")
    yield

  monkeypatch.setattr(shards._FinalizeShardsFn, "process", crash)
  with pytest.raises(Exception, match="worker lost"):
    image_folder.run([f"--input={images}", f"--output={out}", *FLAGS])
  monkeypatch.undo()
  assert not os.path.exists(os.path.join(out, "manifest.json"))
  (abandoned,) = [g for g in commit.list_generations(out) if g.state == "abandoned"]
  capsys.readouterr()
  image_folder.run([f"--input={images}", f"--output={out}", *FLAGS])
  assert "(8 of 8 shards reused from earlier runs)" in capsys.readouterr().out
  assert fingerprint(out, images) == clean


def test_the_job_graph_carries_only_where_reusable_shards_are(images, tmp_path):
  """What ConvertShards ships to the workers is (generation, shard file) per plan digest, not the records."""
  from pipelines.core import shards
  from pipelines.core.sink import OutputSpec
  from pipelines.image_folder.pipeline import image_features

  out = str(tmp_path / "out")
  assert _run(f"--input={images}", f"--output={out}", *FLAGS).returncode == 0
  spec = OutputSpec(output=out, name="pets", file_format="array_record", features=image_features(["cat"], _Opts()),
                    splits=("train",), generation="gen-20990101T000000-00000000")
  fn = shards.ConvertShards(object(), spec, "x")._fn
  assert len(fn._reusable) == 8
  assert all(
      isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p)
      for places in fn._reusable.values() for p in places)


class _Opts:
  size = None
  encoding = "jpeg"


@pytest.mark.parametrize("writer", ["homogeneous", "binary"])
def test_a_graph_rerun_after_a_kill_reuses_the_node_pieces_and_matches_a_clean_run(writer, tmp_path):
  """ogb_graphs: the node arrays (features, labels: most of a large graph's input) are pieces with
  records; a run killed before the join leaves them in its generation, and the rerun copies them
  instead of reading the node files again. The .graphbin is byte for byte a clean run's."""
  name, make = {
      "homogeneous": ("ogbn_arxiv", lambda d: mo.write_homogeneous_node(d, 3, num_nodes=300, num_edges=1500)),
      "binary": ("ogbn_papers100M", lambda d: mo.write_binary_node(d, 3, num_nodes=300, num_edges=1200)),
  }[writer]
  root = str(make(str(tmp_path / name)).folder)
  clean_out, out = str(tmp_path / "clean"), str(tmp_path / "out")
  module = "pipelines.ogb_graphs"
  assert _run(f"--input={root}", f"--output={clean_out}", "--reuse_shards=false", module=module).returncode == 0
  killed = _run(f"--input={root}", f"--output={out}", fault="graph:assemble", module=module)
  assert killed.returncode == -9
  rerun = _run(f"--input={root}", f"--output={out}", module=module)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  line = next(x for x in rerun.stdout.splitlines() if ".graphbin (" in x)
  assert "pieces reused from earlier runs" in line, line
  assert not line.endswith("(0 pieces reused from earlier runs)"), line
  assert fingerprint(out, root) == fingerprint(clean_out, root)
  if writer != "homogeneous":
    return
  # A node file whose values changed since (same size): its piece is read again, the output follows it.
  import gzip
  feat = os.path.join(root, "raw", "node-feat.csv.gz")
  with gzip.open(feat, "rt") as f:
    text = f.read()
  with gzip.open(feat, "wt") as f:
    f.write(text.replace("1", "2") if "1" in text else text.replace("0", "3"))
  changed_clean = str(tmp_path / "changed-clean")
  assert _run(f"--input={root}", f"--output={changed_clean}", "--reuse_shards=false", module=module).returncode == 0
  assert fingerprint(changed_clean, root) != fingerprint(clean_out, root)
  again = _run(f"--input={root}", f"--output={out}", "--overwrite=true", fault="graph:assemble", module=module)
  assert again.returncode == -9
  final = _run(f"--input={root}", f"--output={out}", "--overwrite=true", module=module)
  assert final.returncode == 0, final.stderr[-3000:]
  assert fingerprint(out, root) == fingerprint(changed_clean, root)


def test_hostile_records_in_another_generation_are_ignored_not_fatal(images, clean, tmp_path):
  """A generation someone else wrote, with a toolkit marker, holding records nested too deep to parse,
  a FIFO named like a record, an oversized one, and a valid record of another shard's place under
  this shard's plan digest: the run ignores them all (no hang, no crash) and writes a clean run's bytes."""
  out = str(tmp_path / "out")
  assert _run(f"--input={images}", f"--output={out}", *FLAGS, fault="shards:published:2").returncode == -9
  (generation, names), = _records(out).items()
  forged = "gen-29990101T000000-0badf00d"  # sorts after every real generation
  records = os.path.join(out, forged, reuse.RECORDS_FOLDER)
  os.makedirs(records)
  with open(os.path.join(out, forged, commit.MARKER_FILENAME), "w") as f:
    json.dump({"toolkit": commit.TOOLKIT, "generation": forged, "state": "abandoned"}, f)
  with open(os.path.join(records, "deep.json"), "w") as f:
    f.write("[" * 100_000)
  os.mkfifo(os.path.join(records, "fifo.json"))
  with open(os.path.join(records, "big.json"), "wb") as f:
    f.truncate(reuse.MAX_RECORD_BYTES + 1)
  # The first real record, moved to another place: same plan digest, another split and index.
  real = json.load(open(os.path.join(out, generation, reuse.RECORDS_FOLDER, names[0])))
  other_split = "validation" if real["split"] == "train" else "train"
  moved = {**real, "split": other_split, "shard": {**real["shard"], "path": real["shard"]["path"].replace(
      f"-{real['split']}.", f"-{other_split}.")}}
  with open(os.path.join(records, moved["shard"]["path"] + ".json"), "w") as f:
    json.dump(moved, f)
  import shutil
  shutil.copy(os.path.join(out, generation, real["shard"]["path"]), os.path.join(out, forged, moved["shard"]["path"]))
  rerun = _run(f"--input={images}", f"--output={out}", *FLAGS)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert _reused(rerun) == 2, _summary(rerun)  # the killed run's two; nothing of the forged generation
  assert fingerprint(out, images) == clean


def test_a_shard_is_copied_under_a_lease_on_its_source(images, tmp_path, monkeypatch):
  """While a shard is copied from an earlier generation, a clean-up without retention (another run's)
  must not remove the source; the lease goes once the copy is made."""
  from formats.outputs import leases

  out = str(tmp_path / "out")
  assert _run(f"--input={images}", f"--output={out}", *FLAGS, fault="shards:published:2").returncode == -9
  (killed,), seen = _records(out), []
  real = reuse.copy_verified

  def copy_and_clean(src, dest, num_bytes, sha256):
    seen.append(killed in leases.held_generations(out))
    os.utime(os.path.join(out, killed, commit.MARKER_FILENAME), (0, 0))  # long dead, retention over
    commit.cleanup(out, keep_replaced_seconds=0)
    return real(src, dest, num_bytes, sha256)

  monkeypatch.setattr(reuse, "copy_verified", copy_and_clean)
  g = "gen-20991231T000000-00000001"
  commit.claim(out, g)
  found = reuse.find_reusable(out, exclude=g)
  (first, *_), = list(found.values())[:1]
  info = reuse.adopt(out, g, first)
  assert seen == [True]
  assert info is not None
  assert os.path.isdir(os.path.join(out, killed))
  assert killed not in leases.held_generations(out)  # released after the copy
