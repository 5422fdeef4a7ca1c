"""End to end: `pipelines.image_folder.run(argv)` on generated folders, locally."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os

import numpy as np
import pytest

from formats import arrayrecord, tfrecord
from formats.outputs import inspect
from formats.manifest import Manifest
from pipelines.core import UsageError
from pipelines import image_folder
from scripts import make_sample_images
from tests.conftest import CLASSES, CORRUPT, PER_CLASS

pytestmark = pytest.mark.slow


def convert(input_dir: str, output: str, *flags: str) -> Manifest:
  image_folder.run([f"--input={input_dir}", f"--output={output}", *flags])
  with open(os.path.join(output, "manifest.json"), "rb") as f:
    return Manifest.loads(f.read())


def read_split(output: str, m: Manifest, split: str) -> list[dict]:
  out = []
  for shard in m.splits[split].shards:
    path = os.path.join(output, shard.path)
    records = arrayrecord.read_file(path) if m.file_format == "array_record" else tfrecord.read_file(path)
    out += [m.features.decode(r) for r in records]
  return out


def shard_digests(output: str) -> dict[str, str]:
  """{shard file name: sha256} of the shards the output's manifest lists."""
  m = Manifest.loads(open(os.path.join(output, "manifest.json"), "rb").read())
  return {
      os.path.basename(s.path): hashlib.sha256(open(os.path.join(output, s.path), "rb").read()).hexdigest()
      for split in m.splits.values() for s in split.shards
  }


@pytest.fixture(scope="module")
def array_record_output(class_folder, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("ar") / "out")
  return out, convert(class_folder, out, "--num_shards=4")


def test_array_record_output_is_complete(array_record_output):
  out, m = array_record_output
  assert m.name == "pets"
  assert m.file_format == "array_record"
  assert m.splits["train"].num_records == len(CLASSES) * PER_CLASS
  assert sorted(s.num_records for s in m.splits["train"].shards) == [4, 4, 5, 5]
  assert m.features["label"].names == tuple(CLASSES)
  records = read_split(out, m, "train")
  for r in records:  # the label is the class folder's index
    assert CLASSES[r["label"]] == r["file_name"].split("/")[0]
  assert sorted(r["file_name"] for r in records) == sorted(
      os.path.relpath(p, m.source["input"]) for p in glob.glob(os.path.join(m.source["input"], "*", "*_000??.*")))
  assert {"dataset_info.json", "features.json", "label.labels.txt", "manifest.json"} <= set(os.listdir(out))
  assert not [f for f in os.listdir(out) if ".tmp-" in f]
  (generation,) = [d for d in os.listdir(out) if d.startswith("gen-")]  # this run's data files
  assert all(s.path.startswith(generation + "/") for s in m.splits["train"].shards)


def test_corrupt_inputs_are_listed_in_errors_and_counted(array_record_output):
  out, m = array_record_output
  errors = [json.loads(line) for line in open(os.path.join(out, m.rejected.path))]
  assert m.rejected.count == len(errors) == CORRUPT
  names = sorted(os.path.basename(e["input"]) for e in errors)
  assert names == ["empty_2.png", "notes_1.jpg", "truncated_0.jpg"]
  reasons = {os.path.basename(e["input"]): e["reason"] for e in errors}
  assert reasons["truncated_0.jpg"].startswith("corrupt or truncated image")
  assert reasons["notes_1.jpg"].startswith("not an image")
  assert sum(m.rejected.by_reason.values()) == CORRUPT


def test_images_are_rgb_and_orientation_applied(array_record_output):
  out, m = array_record_output
  from PIL import Image
  import io
  for r in read_split(out, m, "train"):
    im = Image.open(io.BytesIO(r["image"]))
    assert im.mode == "RGB"
    assert im.format == "JPEG"
    if r["file_name"].endswith("_00005.jpg"):  # variant 5 carries EXIF orientation 6 (90° turn)
      src = Image.open(os.path.join(m.source["input"], r["file_name"]))
      assert im.size == (src.height, src.width)


def test_inspect_verify_passes_then_fails_on_a_corrupted_shard(array_record_output, tmp_path, capsys):
  out, m = array_record_output
  assert inspect.main([out, "--verify", "--grid", str(tmp_path / "grid.png")]) == 0
  assert os.path.getsize(tmp_path / "grid.png") > 0
  import shutil
  broken = str(tmp_path / "broken")
  shutil.copytree(out, broken)
  victim = os.path.join(broken, m.splits["train"].shards[1].path)
  data = bytearray(open(victim, "rb").read())
  data[len(data) // 2] ^= 0xFF
  open(victim, "wb").write(bytes(data))
  capsys.readouterr()
  assert inspect.main([broken, "--verify"]) == 1
  report = capsys.readouterr().out
  assert f"BAD {m.splits['train'].shards[1].path}: sha256" in report
  assert "verify: 3/4 shards OK" in report


def test_inspect_on_incomplete_output_is_an_error(tmp_path, capsys):
  assert inspect.main([str(tmp_path)]) == 2
  assert "not a complete output" in capsys.readouterr().err


def test_split_layout_tfrecord_with_empty_class_folder(split_folder, tmp_path):
  out = str(tmp_path / "out")
  m = convert(split_folder, out, "--format=tfrecord", "--name=pets_split")
  assert sorted(m.splits) == ["train", "validation"]
  assert m.features["label"].names == tuple(sorted([*CLASSES, "yak"]))  # the empty class keeps its id
  for split in ("train", "validation"):
    assert m.splits[split].num_records == len(CLASSES) * PER_CLASS
    for r in read_split(out, m, split):
      assert r["file_name"].startswith(split + "/")
      assert m.features["label"].names[r["label"]] == r["file_name"].split("/")[1]
  assert m.rejected.count == 2 * CORRUPT
  assert any("empty class folder" in w and "yak" in w for w in m.warnings)
  assert os.path.basename(m.splits["train"].shards[0].path).startswith("pets_split-train.tfrecord-00000-of-")


def test_files_outside_class_folders_are_rejected_not_dropped(class_folder, tmp_path):
  import shutil
  src = str(tmp_path / "pets")
  shutil.copytree(class_folder, src)
  open(os.path.join(src, "README.txt"), "w").write("about these pets\n")
  m = convert(src, str(tmp_path / "out"))
  errors = [json.loads(l) for l in open(tmp_path / "out" / m.rejected.path)]
  assert {"input": os.path.join(src, "README.txt"), "reason": "not inside a class folder", "split": ""} in errors
  assert m.rejected.count == CORRUPT + 1
  assert m.splits["train"].num_records == len(CLASSES) * PER_CLASS


def test_raw_encoding_fixed_size(class_folder, tmp_path):
  out = str(tmp_path / "out")
  m = convert(class_folder, out, "--encoding=raw", "--image_size=24,32", "--format=tfrecord", "--num_shards=2")
  assert m.features["image"].to_json() == {"kind": "tensor", "shape": [24, 32, 3], "dtype": "uint8", "encoding": "bytes"}
  recs = read_split(out, m, "train")
  assert len(recs) == len(CLASSES) * PER_CLASS
  assert all(r["image"].shape == (24, 32, 3) and r["image"].dtype == np.uint8 for r in recs)


def test_reruns_are_byte_identical_whatever_the_parallelism(class_folder, tmp_path):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  convert(class_folder, a, "--num_shards=3", "--image_size=32,32", "--seed=5")
  convert(class_folder, b, "--num_shards=3", "--image_size=32,32", "--seed=5",
          "--direct_num_workers=2", "--direct_running_mode=multi_threading")
  da, db = shard_digests(a), shard_digests(b)
  assert len(da) == 3
  assert da == db
  def without_generation(out):  # each run writes its own generation folder; the rest is identical
    text = open(os.path.join(out, "manifest.json")).read()
    (generation,) = [d for d in os.listdir(out) if d.startswith("gen-")]
    return text.replace(generation + "/", "")
  assert without_generation(a) == without_generation(b)
  c = str(tmp_path / "c")
  convert(class_folder, c, "--num_shards=3", "--image_size=32,32", "--seed=6")
  assert shard_digests(c) != da  # another seed, another order


def test_existing_output_needs_overwrite_and_is_replaced_atomically(class_folder, tmp_path, monkeypatch):
  out = str(tmp_path / "out")
  old = convert(class_folder, out, "--num_shards=2")
  with pytest.raises(UsageError, match="already holds a complete output"):
    convert(class_folder, out)

  # A re-run that fails half-way leaves the previous output complete and intact.
  from pipelines.core import shards
  real = shards._FinalizeShardsFn.process

  def crash(self, *a, **k):
    raise RuntimeError("worker lost")
    yield

  monkeypatch.setattr(shards._FinalizeShardsFn, "process", crash)
  with pytest.raises(Exception, match="worker lost"):
    convert(class_folder, out, "--num_shards=1", "--overwrite=true")
  monkeypatch.setattr(shards._FinalizeShardsFn, "process", real)
  assert inspect.main([out, "--verify"]) == 0
  assert Manifest.loads(open(os.path.join(out, "manifest.json"), "rb").read()) == old

  m = convert(class_folder, out, "--num_shards=1", "--overwrite=true", "--keep_replaced=0")
  files_now = sorted(os.path.relpath(p, out) for p in glob.glob(os.path.join(out, "**"), recursive=True)
                     if os.path.isfile(p))
  shards = [f for f in files_now if ".array_record-" in f and "/_toolkit_shards/" not in f]
  assert [os.path.basename(f) for f in shards] == ["pets-train.array_record-00000-of-00001"]
  assert shards == [s.path for s in m.splits["train"].shards]  # old generations and the failed attempt are gone
  assert m.splits["train"].num_records == len(CLASSES) * PER_CLASS
  assert inspect.main([out, "--verify"]) == 0


def test_metrics_count_what_happened(class_folder, tmp_path):
  result = image_folder.run([f"--input={class_folder}", f"--output={tmp_path}/out", "--num_shards=2"])
  counters = {c.key.metric.name: c.committed for c in result.metrics().query()["counters"]}
  assert counters["images_read"] == len(CLASSES) * PER_CLASS + CORRUPT
  assert counters["images_converted"] == counters["records_written"] == len(CLASSES) * PER_CLASS
  assert counters["images_rejected"] == CORRUPT
  assert counters["shards_written"] == 2
  assert counters["bytes_written"] > 0
  assert counters["bytes_read"] > 0


def test_a_run_prints_a_summary(class_folder, tmp_path, capsys):
  out = str(tmp_path / "out")
  image_folder.run([f"--input={class_folder}", f"--output={out}", "--format=tfrecord"])
  summary = [l for l in capsys.readouterr().out.splitlines() if l.startswith("pipelines.image_folder:")]
  assert summary
  assert f"{len(CLASSES) * PER_CLASS} records" in summary[0]
  assert f"{CORRUPT} rejected" in summary[0]


def test_multi_frame_images_keep_their_first_frame_and_are_a_manifest_warning(tmp_path):
  from PIL import Image

  src = tmp_path / "in"
  for cls in ("anim", "still"):
    (src / cls).mkdir(parents=True)
  frames = [Image.new("RGB", (12, 10), c) for c in ("red", "green", "blue")]
  frames[0].save(src / "anim" / "a.gif", save_all=True, append_images=frames[1:], duration=40, loop=0)
  frames[0].save(src / "anim" / "b.tif", save_all=True, append_images=frames[1:])
  frames[1].save(src / "still" / "c.png")
  frames[1].save(src / "still" / "d.tif")
  out = str(tmp_path / "out")
  m = convert(str(src), out, "--image_size=10,12", "--encoding=raw")
  assert m.num_records == 4
  assert m.rejected.count == 0
  assert "2 multi-frame images: first frame kept" in m.warnings
  reds = [r for r in read_split(out, m, "train") if r["file_name"].startswith("anim/")]
  assert len(reds) == 2
  for r in reds:
    pixels = np.frombuffer(r["image"], np.uint8).reshape(10, 12, 3)
    assert pixels[..., 0].min() > 200
    assert pixels[..., 1].max() < 60  # red: the first frame
  still = tmp_path / "in2" / "still"
  still.mkdir(parents=True)
  frames[1].save(still / "c.png")
  frames[1].save(still / "d.tif")
  m = convert(str(still.parent), str(tmp_path / "still_out"))
  assert not any("multi-frame" in w for w in m.warnings)


def sample_input(base: str) -> tuple[str, list[str]]:
  """A small input for registry-driven tests (tests/pipelines/test_registry.py): (folder, own flags)."""
  root = os.path.join(base, "pets")
  make_sample_images.make_folder(root, CLASSES, 2, None, (64, 48), 1, seed=3)
  return root, []


@pytest.mark.parametrize("shards_flag", ["--num_shards=3", "--num_shards=0"])
def test_the_workers_plan_writes_the_launchers_bytes(class_folder, tmp_path, shards_flag):
  """--plan=workers (the distributed listing and bounded-memory plan) = --plan=launcher, byte for byte."""
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  ma = convert(class_folder, a, shards_flag, "--image_size=32,32", "--seed=5", "--plan=launcher")
  mb = convert(class_folder, b, shards_flag, "--image_size=32,32", "--seed=5", "--plan=workers")
  assert shard_digests(a) == shard_digests(b)
  assert len(shard_digests(a)) == (3 if shards_flag.endswith("3") else 1)
  assert ma.rejected == dataclasses.replace(mb.rejected, path=ma.rejected.path)
  assert ma.rejected.count >= CORRUPT
  assert ma.warnings == mb.warnings
  assert [s.num_records for s in ma.splits["train"].shards] == [s.num_records for s in mb.splits["train"].shards]


def test_two_workers_get_at_least_four_shards_when_automatic(class_folder, tmp_path, monkeypatch):
  from pipelines.core import shards

  one = convert(class_folder, str(tmp_path / "small"), "--image_size=16,16",
                "--direct_num_workers=2", "--direct_running_mode=multi_threading")
  assert len(one.splits["train"].shards) == 1  # 18 tiny images: no shard under MIN_SHARD_BYTES
  monkeypatch.setattr(shards, "MIN_SHARD_BYTES", 1)
  m = convert(class_folder, str(tmp_path / "o"), "--image_size=16,16",
              "--direct_num_workers=2", "--direct_running_mode=multi_threading")
  assert len(m.splits["train"].shards) == 4
  assert sum(s.num_records for s in m.splits["train"].shards) == len(CLASSES) * PER_CLASS


def test_a_split_whose_every_file_is_rejected_leaves_no_shard_behind(tmp_path):
  root = tmp_path / "in"
  make_sample_images.make_folder(str(root), ["cat"], 3, ["train"], (64, 48), 0, seed=1)
  for bad in ("a.jpg", "b.jpg"):
    os.makedirs(root / "validation" / "cat", exist_ok=True)
    (root / "validation" / "cat" / bad).write_bytes(b"not an image")
  out = str(tmp_path / "out")
  m = convert(str(root), out, "--num_shards=2")
  assert list(m.splits) == ["train"]
  assert m.rejected.count == 2
  assert any("empty splits left out: validation" in w for w in m.warnings)
  names = [os.path.basename(p) for p in glob.glob(os.path.join(out, "gen-*", "*"))]
  assert not [n for n in names if "validation" in n]
  assert inspect.main([out, "--verify"]) == 0


def test_plan_auto_hands_the_listing_to_the_workers_past_the_limit(class_folder, tmp_path, monkeypatch):
  from pipelines.core import inputs, shards

  listed = []
  real = inputs.list_tree
  # The launcher's listings (list_at_launch passes max_files; the workers' ListFiles does not).
  monkeypatch.setattr(inputs, "list_tree", lambda *a, **k: (len(a) == 4 and listed.append(a[3])) or real(*a, **k))
  a = str(tmp_path / "a")
  convert(class_folder, a, "--num_shards=3", "--image_size=16,16", "--plan=launcher")
  monkeypatch.setattr(shards, "LAUNCHER_LISTING_LIMIT", 5)
  b = str(tmp_path / "b")
  launcher_calls = len(listed)
  convert(class_folder, b, "--num_shards=3", "--image_size=16,16")  # --plan=auto
  assert shard_digests(a) == shard_digests(b)
  assert set(listed[:launcher_calls]) == {None}  # --plan=launcher: no limit
  assert listed[launcher_calls:] == [5]  # auto: bounded, and given up at the first folder (it holds more)
  with pytest.raises(inputs.TooManyFiles):
    real(os.path.join(class_folder, "cat"), 5, None, 2)


@pytest.mark.parametrize("runner", [None, "DirectRunner", "direct"])
def test_a_run_on_the_direct_runner_stays_in_this_process_never_on_a_downloaded_prism(class_folder, tmp_path,
                                                                                      monkeypatch, runner):
  """Beam's DirectRunner first tries Prism, a binary it downloads from GitHub (another engine; minutes of
  waiting where the network drops packets): a run on the DirectRunner (named or by default) goes straight to
  the in-process FnApiRunner, the engine the tests exercise. --runner=PrismRunner still asks for Prism."""
  from apache_beam.runners.portability import prism_runner
  from apache_beam.runners.portability.fn_api_runner import fn_runner

  tried = []

  def prism(self, pipeline, options):
    tried.append(pipeline)
    raise RuntimeError("Prism is not available here")

  monkeypatch.setattr(prism_runner.PrismRunner, "run_pipeline", prism)
  out = str(tmp_path / "out")
  result = image_folder.run([f"--input={class_folder}", f"--output={out}", *([f"--runner={runner}"] if runner else [])])
  assert tried == []
  assert isinstance(result, fn_runner.RunnerResult)
  assert inspect.main([out, "--verify"]) == 0
  with pytest.raises(RuntimeError, match="Prism is not available"):
    image_folder.run([f"--input={class_folder}", f"--output={tmp_path / 'prism'}", "--runner=PrismRunner"])
  assert len(tried) == 1
