"""`--mode=append`: only the inputs an output does not hold are converted, into new shards of the same
splits; the existing shards are carried over byte for byte, label ids never change, and inputs that
changed or vanished since they were converted are named in the manifest's warnings.

Every test checks the invariant: the output verifies, it holds exactly the old records and the new
ones, the same sequence of runs gives the same bytes, and a kill leaves the previous output whole.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from formats import adapters
from formats.outputs import commit
from formats.storage import files
from formats.example import decode_example
from formats.manifest import Manifest
from formats.outputs.output import verify as verify_output
from scripts import make_sample_ct as ct, make_sample_images
from tests.conftest import REPO, run_module, upload_tree
from tests.test_outputs_unchanged import fingerprint

pytestmark = pytest.mark.slow


def _run(*flags: str, fault: str = "", module: str = "pipelines.image_folder") -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": REPO}
  env.pop(commit.FAULT_POINT_ENV, None)
  if fault:
    env[commit.FAULT_POINT_ENV] = fault
  return run_module(module, *flags, env=env)


def _manifest(out: str) -> Manifest:
  return Manifest.loads(files.read_bytes(files.join(out, "manifest.json")))


def _examples(out: str, split: str, shards=None, manifest: Manifest | None = None) -> list[dict]:
  """The decoded records of `split` of a local output (of the given shard indices only, when given)."""
  manifest = manifest or _manifest(out)
  found = []
  for i, s in enumerate(manifest.splits[split].shards):
    if shards is None or i in shards:
      found += [decode_example(p) for p in adapters.get(manifest.file_format).read_file(os.path.join(out, s.path))]
  return found


def _file_names(out: str, split: str, shards=None, manifest: Manifest | None = None) -> list[str]:
  return [ex["file_name"][0].decode() for ex in _examples(out, split, shards, manifest)]


def _add_images(root: str, classes: list[str], seed: int, per_class: int = 3) -> list[str]:
  """Adds `per_class` new images per class and split under `root`; returns their paths relative to it."""
  staging = root + f"-more-{seed}"
  make_sample_images.make_folder(staging, classes, per_class, ["train", "validation"], (64, 48), 0, seed=seed)
  added = []
  for folder, _, names in os.walk(staging):
    for n in names:
      rel = os.path.relpath(os.path.join(folder, n), staging)
      dest = os.path.join(root, os.path.dirname(rel), f"new{seed}-{n}")
      os.makedirs(os.path.dirname(dest), exist_ok=True)
      shutil.copy(os.path.join(folder, n), dest)
      added.append(os.path.relpath(dest, root))
  shutil.rmtree(staging)
  return sorted(added)


def _pets(base: str) -> str:
  root = os.path.join(base, "pets")
  make_sample_images.make_folder(root, ["cat", "dog"], 6, ["train", "validation"], (64, 48), 2, seed=5)
  return root


def test_append_converts_only_new_inputs_and_carries_the_shards_over(tmp_path):
  root, out = _pets(str(tmp_path)), str(tmp_path / "out")
  assert _run(f"--input={root}", f"--output={out}", "--num_shards=2").returncode == 0
  before = _manifest(out)
  added = _add_images(root, ["ant", "cat"], seed=8)  # a new class that sorts first
  proc = _run(f"--input={root}", f"--output={out}", "--mode=append")
  assert proc.returncode == 0, proc.stderr
  after = _manifest(out)
  assert verify_output(out, after) == 0
  assert after.features["label"].names == ("cat", "dog", "ant")  # ids 0 and 1 unchanged, the new class last
  assert all(after.features["label"].names[ex["label"][0]] == ex["file_name"][0].decode().split("/")[1]
             for split in after.splits for ex in _examples(out, split))
  for split in ("train", "validation"):
    old, new = before.splits[split].shards, after.splits[split].shards
    assert [(s.sha256, s.num_records) for s in new[:len(old)]] == [(s.sha256, s.num_records) for s in old]
    assert [s.path.rsplit("-of-", 1)[1] for s in new] == [f"{len(new):05d}"] * len(new)
    carried = _file_names(out, split, range(len(old)))
    appended = _file_names(out, split, range(len(old), len(new)))
    assert sorted(appended) == [a for a in added if a.startswith(split + "/")]
    assert sorted(carried) == sorted(_file_names(out, split, manifest=before))
  assert after.num_records == before.num_records + len(added)
  assert after.rejected.count == before.rejected.count  # the bad files are rejected once, not again
  assert not after.warnings or all("changed" not in w and "vanished" not in w for w in after.warnings)
  # Nothing new: the next append carries every shard and converts nothing.
  again = _run(f"--input={root}", f"--output={out}", "--mode=append")
  assert again.returncode == 0, again.stderr
  assert [s.sha256 for s in _manifest(out).splits["train"].shards] == [s.sha256 for s in after.splits["train"].shards]


def test_append_to_no_output_yet_converts_the_whole_input_as_rebuild_does(tmp_path):
  """A scheduled append's first run: nothing is held, so everything is new (the same bytes as a rebuild)."""
  root = _pets(str(tmp_path))
  first, rebuilt = str(tmp_path / "first"), str(tmp_path / "rebuilt")
  assert _run(f"--input={root}", f"--output={first}", "--mode=append", "--num_shards=2").returncode == 0
  assert _run(f"--input={root}", f"--output={rebuilt}", "--num_shards=2").returncode == 0
  assert fingerprint(first, root) == fingerprint(rebuilt, root)


def test_the_same_sequence_of_runs_gives_the_same_bytes(tmp_path):
  outs = []
  for attempt in ("a", "b"):
    root, out = _pets(str(tmp_path / attempt)), str(tmp_path / attempt / "out")
    assert _run(f"--input={root}", f"--output={out}", "--num_shards=2").returncode == 0
    _add_images(root, ["cat", "eel"], seed=8)
    assert _run(f"--input={root}", f"--output={out}", "--mode=append").returncode == 0
    _add_images(root, ["dog"], seed=9)
    assert _run(f"--input={root}", f"--output={out}", "--mode=append", "--num_shards=1").returncode == 0
    outs.append(fingerprint(out, root))
  assert outs[0] == outs[1]


def test_changed_and_vanished_inputs_are_named_and_kept_as_converted(tmp_path):
  root, out = _pets(str(tmp_path)), str(tmp_path / "out")
  assert _run(f"--input={root}", f"--output={out}", "--num_shards=2").returncode == 0
  before = _manifest(out)
  cats = sorted(os.listdir(os.path.join(root, "train", "cat")))
  good = [n for n in cats if n.endswith(".jpg") or n.endswith(".png")]
  os.utime(os.path.join(root, "train", "cat", good[0]), ns=(1, 1))
  os.remove(os.path.join(root, "train", "cat", good[1]))
  proc = _run(f"--input={root}", f"--output={out}", "--mode=append")
  assert proc.returncode == 0, proc.stderr
  after = _manifest(out)
  assert after.num_records == before.num_records  # kept, neither dropped nor converted again
  changed = [w for w in after.warnings if "changed since they were converted" in w]
  vanished = [w for w in after.warnings if "vanished since they were converted" in w]
  assert changed
  assert changed[0].startswith("1 inputs")
  assert f"train/cat/{good[0]}" in changed[0]
  assert vanished
  assert vanished[0].startswith("1 inputs")
  assert f"train/cat/{good[1]}" in vanished[0]
  assert "changed" in proc.stdout
  assert "vanished" in proc.stdout  # the summary's warning lines


def test_append_refuses_what_it_cannot_do_and_writes_nothing(tmp_path):
  root, out = _pets(str(tmp_path)), str(tmp_path / "out")
  assert _run(f"--input={root}", f"--output={out}", "--num_shards=2").returncode == 0
  listing = sorted(os.listdir(out))
  other = _run(f"--input={root}", f"--output={out}", "--mode=append", "--image_size=16,16")
  assert other.returncode == 2
  assert "converted with other settings (image_size: None now [16, 16])" in other.stderr
  quality = _run(f"--input={root}", f"--output={out}", "--mode=append", "--jpeg_quality=50")
  assert quality.returncode == 2
  assert "(jpeg_quality: 95 now 50)" in quality.stderr
  fmt = _run(f"--input={root}", f"--output={out}", "--mode=append", "--format=tfrecord")
  assert fmt.returncode == 2
  assert "--mode=append" in fmt.stderr
  bad_mode = _run(f"--input={root}", f"--output={out}", "--mode=merge")
  assert bad_mode.returncode == 2
  assert "--mode must be rebuild or append" in bad_mode.stderr
  generation = _manifest(out).splits["train"].shards[0].path.split("/")[0]
  shutil.rmtree(os.path.join(out, generation, "_toolkit_shards"))  # as an output written before appends existed
  old = _run(f"--input={root}", f"--output={out}", "--mode=append")
  assert old.returncode == 2
  assert "run --mode=rebuild once" in old.stderr
  assert sorted(os.listdir(out)) == listing  # no generation claimed, nothing written


_APPEND_FAULTS = ["shards:published:1", "shards:published:3", "finalize:start", "finalize:rejects_written",
                  "commit:before_switch", "commit:after_switch", "tfds:info_removed", "cleanup:done"]


@pytest.mark.parametrize("mode", ["append", "resume"])
def test_a_kill_at_every_fault_point_leaves_the_previous_output_and_the_next_run_completes_it(mode, tmp_path):
  """append: v1 converted, v2 = v1 + new inputs appended. resume: v2 rebuilt after a run killed half-way.
  At each fault point the run is killed: the output is the previous one or the new one, whole; the
  next run completes it to exactly the bytes of an uninterrupted sequence."""
  root, ref = _pets(str(tmp_path)), str(tmp_path / "ref")
  flags = ("--num_shards=2",)
  assert _run(f"--input={root}", f"--output={ref}", *flags).returncode == 0
  base = str(tmp_path / "base")
  shutil.copytree(ref, base)
  _add_images(root, ["cat", "eel"], seed=8)
  if mode == "append":
    second = (f"--input={root}", "--mode=append")
  else:
    second = (f"--input={root}", "--overwrite=true", *flags)
    killed = _run(*second, f"--output={base}", fault="shards:published:2")
    assert killed.returncode == -9
  assert _run(*second, f"--output={ref}").returncode == 0
  want, old = fingerprint(ref, root), _manifest(base)
  for point in _APPEND_FAULTS:
    out = str(tmp_path / f"out-{point.replace(':', '_')}")
    shutil.copytree(base, out)
    proc = _run(*second, f"--output={out}", fault=point)
    assert proc.returncode == -9, (point, proc.stderr[-2000:])
    now = _manifest(out)
    assert verify_output(out, now) == 0, point
    # ("cleanup:done" is first reached by the repair every run starts with, before it claims anything.)
    switched = point in ("commit:after_switch", "tfds:info_removed")
    assert (now.splits == old.splits) != switched, point  # the previous output until the switch, then the new
    # The retry (an Airflow task's): after the switch too, it finds its work done (every shard carried
    # or reused) and commits the same bytes again.
    rerun = _run(*second, f"--output={out}")
    assert rerun.returncode == 0, (point, rerun.stderr[-2000:])
    assert fingerprint(out, root) == want, point


def test_ct_append_keeps_every_patient_in_its_split(tmp_path):
  root, out = os.path.join(str(tmp_path), "dicom"), str(tmp_path / "out")
  ct.make_mixed_tree(root, seed=11)
  flags = ("--id_salt=s", "--splits=train=0.5,validation=0.5", "--num_shards=2")
  assert _run(f"--input={root}", f"--output={out}", *flags, module="pipelines.ct_volumes").returncode == 0
  before = _manifest(out)
  split_of = {ex["series_id"][0].decode(): (split, ex["patient_id"][0].decode())
              for split in before.splits for ex in _examples(out, split)}
  ct.write_series(os.path.join(root, "later", "p9"), patient_id="SYN0099", seed=5, num_slices=10)
  ct.write_series(os.path.join(root, "later", "p1-again"), patient_id="SYN0001", seed=6, num_slices=12)
  listing = sorted(os.listdir(out))
  for other, message in ((("--id_salt=t", *flags[1:]), "another --id_salt"),
                         (("--id_salt=s", "--splits=train=0.8,validation=0.2", "--num_shards=2"),
                          "converted with other settings (splits:")):
    refused = _run(f"--input={root}", f"--output={out}", *other, "--mode=append", module="pipelines.ct_volumes")
    assert refused.returncode == 2, refused.stderr[-1500:]
    assert message in refused.stderr, refused.stderr[-1500:]
    assert sorted(os.listdir(out)) == listing  # nothing claimed or written
  proc = _run(f"--input={root}", f"--output={out}", *flags, "--mode=append", module="pipelines.ct_volumes")
  assert proc.returncode == 0, proc.stderr
  after = _manifest(out)
  assert verify_output(out, after) == 0
  assert after.num_records == before.num_records + 2
  assert after.features == before.features
  seen = {ex["series_id"][0].decode(): (split, ex["patient_id"][0].decode())
          for split in after.splits for ex in _examples(out, split)}
  assert {k: v for k, v in seen.items() if k in split_of} == split_of  # old series where they were
  by_patient = {}
  for split, patient in seen.values():
    by_patient.setdefault(patient, set()).add(split)
  assert all(len(splits) == 1 for splits in by_patient.values())  # a patient's new series join its split


def test_append_on_gcs(tmp_path, gcs_emulator):
  local = _pets(str(tmp_path))
  src, out = f"gs://{gcs_emulator}/append/{tmp_path.name}/pets", f"gs://{gcs_emulator}/append/{tmp_path.name}/out"
  upload_tree(local, src)
  assert _run(f"--input={src}", f"--output={out}", "--num_shards=2").returncode == 0
  before = _manifest(out)
  more = str(tmp_path / "more")
  os.makedirs(more)
  added = _add_images(local, ["cat"], seed=8)
  for rel in added:
    with open(os.path.join(local, rel), "rb") as f:
      files.write_bytes(f"{src}/{rel}", f.read())
  proc = _run(f"--input={src}", f"--output={out}", "--mode=append")
  assert proc.returncode == 0, proc.stderr
  after = _manifest(out)
  assert verify_output(out, after) == 0
  assert after.num_records == before.num_records + len(added)
  assert [s.sha256 for s in after.splits["train"].shards[:2]] == [s.sha256 for s in before.splits["train"].shards]


def test_kills_and_503s_on_gcs_leave_the_previous_output_and_the_retry_completes_the_append(tmp_path, gcs_faults):
  """Through the fault proxy: an append killed at its fault points, one after the other on the same
  gs:// output, then retried while the shard records' reads and the server-side copies answer 503
  (retried by the client): the output is always a whole one, and the last equals an uninterrupted append."""
  local = _pets(str(tmp_path))
  base = f"gs://{gcs_faults.bucket}/append-faults/{tmp_path.name}"
  src, out, ref = f"{base}/pets", f"{base}/out", f"{base}/ref"
  upload_tree(local, src)
  for o in (out, ref):
    assert _run(f"--input={src}", f"--output={o}", "--num_shards=2").returncode == 0
  old = _manifest(out)
  for rel in _add_images(local, ["cat", "eel"], seed=8):
    with open(os.path.join(local, rel), "rb") as f:
      files.write_bytes(f"{src}/{rel}", f.read())
  assert _run(f"--input={src}", f"--output={ref}", "--mode=append").returncode == 0
  want = _manifest(ref)

  def shards(m):
    return {k: [(s.path.split("/", 1)[1], s.sha256) for s in v.shards] for k, v in m.splits.items()}

  for point in ("shards:published:1", "shards:published:3", "finalize:rejects_written", "commit:before_switch"):
    proc = _run(f"--input={src}", f"--output={out}", "--mode=append", fault=point)
    assert proc.returncode == -9, (point, proc.stderr[-2000:])
    now = _manifest(out)
    assert verify_output(out, now) == 0, point
    assert shards(now) == shards(old), point
  gcs_faults.add_fault("_toolkit_shards", 503, times=3, method="GET")
  gcs_faults.add_fault("copyTo", 503, times=1)
  gcs_faults.add_fault("rewriteTo", 503, times=1)
  proc = _run(f"--input={src}", f"--output={out}", "--mode=append")
  assert proc.returncode == 0, proc.stderr[-3000:]
  now = _manifest(out)
  assert verify_output(out, now) == 0
  assert shards(now) == shards(want)
  assert now.features == want.features
  assert now.warnings == want.warnings
