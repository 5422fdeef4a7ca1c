"""scripts/examples/train_jax.py trains both its models on a mesh of 8 CPU devices, each run in its own process
(jax reads XLA_FLAGS when it starts its backend), and a run resumed from its checkpoint ends where the
uninterrupted run ends, bit for bit."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from pipelines import image_folder, ogb_graphs
from scripts import make_sample_ogb as mo
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # subprocesses (jax)
SCRIPT = os.path.join(REPO, "scripts", "examples", "train_jax.py")
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
FINAL = re.compile(r"^jax (images|graph): steps (\d+)\.\.(\d+) \((\d+) steps\) on 8 cpu devices, "
                   r"(fresh start|resumed at step \d+), last loss (\S+), compiles (\d+)$", re.M)
STEP = re.compile(r"^step (\d+): loss (\S+)$", re.M)


@pytest.fixture(scope="module")
def outputs(class_folder, tmp_path_factory) -> dict[str, str]:
  """The sample image output (18 images, 3 classes) and ogbn-mag's shape at 1/1000, with reverse relations."""
  root = tmp_path_factory.mktemp("jax_example")
  image_folder.run([f"--input={class_folder}", f"--output={root / 'images'}"])
  truth = mo.write_mag(str(root / "ogbn_mag"), seed=0, scale=0.001)
  ogb_graphs.run([f"--input={truth.folder}", f"--output={root / 'graph'}", "--add_reverse_relations=true"])
  return {"images": str(root / "images"), "graph": str(root / "graph")}


def _train(task: str, path: str, *flags: str) -> tuple[re.Match, list[tuple[int, float]]]:
  r = subprocess.run([sys.executable, SCRIPT, task, path, *flags], capture_output=True, text=True,
                     env={**os.environ, **ENV}, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  final = FINAL.search(r.stdout)
  assert final, r.stdout
  return final, [(int(s), float(loss)) for s, loss in STEP.findall(r.stdout)]


def _arrays(checkpoint: str) -> list[np.ndarray]:
  with np.load(os.path.join(checkpoint, "train_state.npz")) as z:
    return [z[f"arr_{i}"] for i in range(len(z.files))]


@pytest.mark.parametrize("task,split,lr", [("images", 3, "0.01"), ("graph", 10, "0.03")])
def test_trains_and_resumes_bit_for_bit(outputs, tmp_path, task, split, lr):
  path, resumed, whole = outputs[task], str(tmp_path / "resumed"), str(tmp_path / "whole")
  first, first_steps = _train(task, path, f"--steps={split}", f"--lr={lr}", f"--checkpoint={resumed}")
  assert first[5] == "fresh start"
  second, second_steps = _train(task, path, f"--steps={split}", f"--lr={lr}", f"--checkpoint={resumed}")
  assert second[5] == f"resumed at step {split}"
  assert (int(second[2]), int(second[3]), int(second[4])) == (split, 2 * split - 1, split)
  final, whole_steps = _train(task, path, f"--steps={2 * split}", f"--lr={lr}", f"--checkpoint={whole}")
  assert [s for s, _ in whole_steps] == list(range(2 * split))
  assert all(math.isfinite(loss) for _, loss in whole_steps)
  assert int(final[7]) == 1  # static shapes: the step compiles once
  # the loader went on with the batch the saved step would have read, and the weights and Adam's state came back
  assert first_steps + second_steps == whole_steps
  got, want = _arrays(resumed), _arrays(whole)
  assert len(got) == len(want) > 0
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  if task == "graph":  # ~ln(349) at first, then it learns the train seeds (18 images teach the CNN little)
    losses = [loss for _, loss in whole_steps]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.3, losses
