"""The same conversion against a real GCS API server on loopback (gcp-storage-emulator)."""

from __future__ import annotations

import json
import os

import pytest

from formats.outputs import inspect
from formats.storage import files
from formats.manifest import Manifest
from pipelines import image_folder
from pipelines.core import UsageError
from tests.conftest import CLASSES, CORRUPT, PER_CLASS, upload_tree
from tests.pipelines.test_image_folder import convert, shard_digests

pytestmark = [pytest.mark.slow, pytest.mark.gcs]


@pytest.fixture(scope="module")
def gs_input(gcs_emulator, class_folder):
  root = f"gs://{gcs_emulator}/inputs/pets"
  assert upload_tree(class_folder, root) == len(CLASSES) * PER_CLASS + CORRUPT
  return root


@pytest.mark.parametrize("fmt", ["array_record", "tfrecord"])
def test_gcs_in_gcs_out_matches_a_local_run(gs_input, gcs_emulator, class_folder, tmp_path, fmt):
  out = f"gs://{gcs_emulator}/outputs/pets-{fmt}"
  image_folder.run([f"--input={gs_input}", f"--output={out}", f"--format={fmt}", "--num_shards=3"])
  m = Manifest.loads(files.read_bytes(files.join(out, "manifest.json")))
  assert m.splits["train"].num_records == len(CLASSES) * PER_CLASS
  assert m.rejected.count == CORRUPT
  errors = [json.loads(l) for l in files.read_bytes(files.join(out, m.rejected.path)).splitlines()]
  assert all(e["input"].startswith(gs_input + "/") for e in errors)
  assert len(errors) == CORRUPT
  folders, listed = files.list_dir(out)
  assert {"dataset_info.json", "features.json", "label.labels.txt", "manifest.json"} <= set(listed)
  assert not [f for f in listed if ".tmp-" in f]
  assert [f for f in folders if f.startswith("gen-")] == [m.splits["train"].shards[0].path.split("/")[0]]
  assert inspect.verify(out, m) == 0  # every shard downloaded, hashed and decoded

  # Same inputs, same options: the shards are byte-identical to a local run.
  local = str(tmp_path / "local")
  lm = convert(class_folder, local, f"--format={fmt}", "--num_shards=3")
  assert {os.path.basename(s.path): s.sha256 for s in lm.splits["train"].shards} == {
      os.path.basename(s.path): s.sha256 for s in m.splits["train"].shards}
  assert set(shard_digests(local).values()) == {s.sha256 for s in m.splits["train"].shards}


def test_gcs_output_refuses_to_clobber_without_overwrite(gs_input, gcs_emulator):
  out = f"gs://{gcs_emulator}/outputs/clobber"
  image_folder.run([f"--input={gs_input}", f"--output={out}", "--num_shards=1"])
  with pytest.raises(UsageError, match="already holds"):
    image_folder.run([f"--input={gs_input}", f"--output={out}"])


def test_missing_gcs_input_is_a_usage_error(gcs_emulator, tmp_path):
  with pytest.raises(UsageError, match="does not exist"):
    image_folder.run([f"--input=gs://{gcs_emulator}/nothing/here", f"--output={tmp_path}/o"])
