"""Appended and resumed outputs load everywhere a user reads an output: TFDS (as_data_source and
as_dataset), grain, tf.data and torch_xla, each framework in its own process, with every record of
the old and the new shards read once and each label right.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from formats.storage import files
from formats.manifest import Manifest
from tests.conftest import REPO
from tests.pipelines.test_append import _add_images, _pets, _run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def appended(tmp_path_factory) -> dict[str, tuple[str, Manifest]]:
  """{file format: (an output converted, then appended to with new images and a new class, its manifest)}."""
  found = {}
  for fmt in ("array_record", "tfrecord"):
    base = str(tmp_path_factory.mktemp(f"appended-{fmt}"))
    root, out = _pets(base), os.path.join(base, "out")
    assert _run(f"--input={root}", f"--output={out}", f"--format={fmt}", "--num_shards=2").returncode == 0
    _add_images(root, ["ant", "dog"], seed=8)
    proc = _run(f"--input={root}", f"--output={out}", f"--format={fmt}", "--mode=append")
    assert proc.returncode == 0, proc.stderr
    found[fmt] = (out, Manifest.loads(files.read_bytes(os.path.join(out, "manifest.json"))))
  return found


def _python(code: str, **env) -> dict:
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                        env={**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "3", **env})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _expected(m: Manifest) -> dict:
  return {split: info.num_records for split, info in m.splits.items()}


def test_tfds_reads_every_record_of_an_appended_output(appended):
  reads = {"array_record": "(lambda src: [src[i] for i in range(len(src))])(b.as_data_source()[s])",
           "tfrecord": "list(tfds.as_numpy(b.as_dataset(split=s)))"}
  got = _python("import json, tensorflow_datasets as tfds\nfound = {}\n" + "".join(f"""
b = tfds.builder_from_directory({appended[fmt][0]!r})
names = b.info.features["label"].names
counts, ok = {{}}, True
for s in b.info.splits:
  rows = {read}
  counts[s] = len(rows)
  ok &= all(names[r["label"]] == r["file_name"].decode().split("/")[1] for r in rows)
found[{fmt!r}] = {{"counts": counts, "ok": bool(ok), "names": names}}
""" for fmt, read in reads.items()) + "print(json.dumps(found))")
  for fmt in reads:
    m = appended[fmt][1]
    assert got[fmt] == {"counts": _expected(m), "ok": True, "names": list(m.features["label"].names)}, fmt


# Every split of an output read in one process: {split: the record indices its batches held, sorted}.
_LOOP = """
import json
names = {names!r}
seen = {{}}
for split in {splits!r}:
  seen[split] = []
  for batch in {loader}:
    labels, files, idx = batch["label"], batch.get("file_name"), batch["record_index"]
    seen[split] += [int(i) for i in idx]
  seen[split].sort()
print(json.dumps(seen))
"""


def _every_record(m: Manifest) -> dict[str, list[int]]:
  return {split: list(range(n)) for split, n in _expected(m).items()}


def test_grain_reads_every_record_of_an_appended_output(appended):
  out, m = appended["array_record"]
  got = _python(_LOOP.format(names=list(m.features["label"].names), splits=list(m.splits), loader=(
      f"__import__('loaders.grain', fromlist=['x']).dataset({out!r}, split, batch_size=1, shuffle=False, "
      "image_size=(32, 32), num_threads=2)")))
  assert got == _every_record(m)


def test_tf_data_reads_every_record_of_an_appended_output(appended):
  out, m = appended["tfrecord"]
  got = _python(_LOOP.format(names=list(m.features["label"].names), splits=list(m.splits), loader=(
      f"__import__('tensorflow_datasets').as_numpy(__import__('loaders.tfdata', fromlist=['x']).dataset("
      f"{out!r}, split, batch_size=1, shuffle=False, image_size=(32, 32)))")))
  assert got == _every_record(m)


def test_torch_xla_reads_every_record_of_an_appended_output(appended):
  out, m = appended["array_record"]
  got = _python(_LOOP.format(names=list(m.features["label"].names), splits=list(m.splits), loader=(
      f"__import__('loaders.xla', fromlist=['x']).device_loader({out!r}, split, batch_size=1, shuffle=False, "
      "image_size=(32, 32), num_threads=2, shard_index=0, shard_count=1)")).replace(
          "seen[split] += [int(i) for i in idx]", "seen[split] += [int(i) for i in idx.cpu().tolist()]"),
      PJRT_DEVICE="CPU")
  assert got == _every_record(m)
