"""scripts/examples/train_seg_xla.py trains a 3D segmentation net on CT patches and masks on the XLA CPU device,
and resumes from its checkpoint where it stopped."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from tests.loaders import make_outputs

pytestmark = pytest.mark.slow  # subprocesses (torch_xla)
SCRIPT = os.path.join(REPO, "scripts", "examples", "train_seg_xla.py")
FINAL = re.compile(r"^seg: steps (\d+)\.\.(\d+) \((\d+) steps\) on (\S+), (fresh start|resumed at step \d+), "
                   r"last loss (\S+), foreground fraction (\S+)$", re.M)
STEP = re.compile(r"^step (\d+): loss (\S+) records (\[.*\])$", re.M)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, str]:
  """Labelled CT outputs, class ids and channels (the converter's labels arrive later; these are its schema)."""
  base = tmp_path_factory.mktemp("seg_example")
  out = {}
  for layout in ("classes", "channels"):
    features, payloads = make_outputs.labelled_volumes(np.random.default_rng(0), 8, layout)
    out[layout] = make_outputs.write(str(base / layout), features, {"train": payloads}, kind="volume")
  return out


def _train(path: str, *flags: str) -> tuple[re.Match, list[tuple[int, float, str]]]:
  r = subprocess.run([sys.executable, SCRIPT, path, *flags], capture_output=True, text=True,
                     env={**os.environ, "PJRT_DEVICE": "CPU"}, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  final = FINAL.search(r.stdout)
  assert final, r.stdout
  return final, [(int(s), float(loss), records) for s, loss, records in STEP.findall(r.stdout)]


def test_trains_on_masks_and_resumes_at_the_saved_step(outputs, tmp_path):
  checkpoint = str(tmp_path / "ckpt")
  path, flags = outputs["classes"], ("--num_classes=3", f"--checkpoint={checkpoint}", "--steps=3")
  first, first_steps = _train(path, *flags)
  assert first[5] == "fresh start"
  second, second_steps = _train(path, *flags)
  assert second[5] == "resumed at step 3"
  assert (int(second[1]), int(second[2]), int(second[3])) == (3, 5, 3)
  assert second[4].startswith("xla")
  for final in (first, second):
    assert math.isfinite(float(final[6]))
    assert float(final[7]) > 0  # the masks reached the model: some of the voxels it saw are foreground
  _, whole = _train(path, "--num_classes=3", "--steps=6")
  assert [s for s, _, _ in first_steps + second_steps] == list(range(6))
  assert [r for _, _, r in first_steps + second_steps] == [r for _, _, r in whole]  # the loader went on exactly
  # the weights came back too: the resumed steps' losses are the uninterrupted run's
  assert [loss for _, loss, _ in second_steps] == pytest.approx([loss for _, loss, _ in whole[3:]], abs=1e-3)
  assert whole[-1][1] < whole[0][1]  # it learns


def test_trains_on_channels(outputs):
  final, steps = _train(outputs["channels"], "--steps=3")
  assert final[5] == "fresh start"
  assert len(steps) == 3
  assert all(math.isfinite(loss) for _, loss, _ in steps)
  assert float(final[7]) > 0
