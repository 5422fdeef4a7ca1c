"""The README's training-script examples run end to end on outputs the pipelines make."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipelines import image_folder
from tests.conftest import REPO

pytestmark = pytest.mark.slow
EXAMPLES = os.path.join(REPO, "scripts", "examples")


@pytest.fixture(scope="module")
def outputs(class_folder, tmp_path_factory):
  base = tmp_path_factory.mktemp("examples")
  image_folder.run([f"--input={class_folder}", f"--output={base / 'ar'}"])
  image_folder.run([f"--input={class_folder}", f"--output={base / 'tf'}", "--format=tfrecord"])
  return {"array_record": str(base / "ar"), "tfrecord": str(base / "tf")}


@pytest.mark.parametrize("script,fmt,env", [
    ("train_grain.py", "array_record", {}),
    ("train_xla.py", "array_record", {"PJRT_DEVICE": "CPU"}),
    ("train_tfdata.py", "tfrecord", {}),
])
def test_example_trains(outputs, script, fmt, env):
  r = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), outputs[fmt], "--steps=5"],
                     capture_output=True, text=True, env={**os.environ, **env}, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "5 steps" in r.stdout
  assert "last loss" in r.stdout
