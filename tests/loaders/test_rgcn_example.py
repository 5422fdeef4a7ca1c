"""scripts/examples/train_rgcn_xla.py trains an R-GCN on a MAG-shaped conversion on the XLA CPU device."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from loaders import graph as lg
from pipelines import ogb_graphs
from scripts import make_sample_ogb as mo
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # subprocesses (torch, torch_xla)
SCRIPT = os.path.join(REPO, "scripts", "examples", "train_rgcn_xla.py")
EPOCHS = 5
BATCH_SIZE = 64
STOP = 37  # a --steps that stops inside the last epoch
FINAL = re.compile(r"^rgcn: (\d+) steps on (\S+), loss first (\S+) last (\S+), compiles (\d+), (host|device) gather$",
                   re.M)


@pytest.fixture(scope="module")
def mag_output(tmp_path_factory) -> str:
  """ogbn-mag's shape at 1/1000 of its size (736 papers, 349 classes), converted with reverse relations."""
  root = tmp_path_factory.mktemp("rgcn")
  truth = mo.write_mag(str(root / "ogbn_mag"), seed=0, scale=0.001)
  out = str(root / "out")
  ogb_graphs.run([f"--input={truth.folder}", f"--output={out}", "--add_reverse_relations=true"])
  return out


def _train(path: str, *flags: str) -> str:
  r = subprocess.run([sys.executable, SCRIPT, path, f"--epochs={EPOCHS}", f"--batch_size={BATCH_SIZE}", *flags],
                     capture_output=True, text=True, env={**os.environ, "PJRT_DEVICE": "CPU"}, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout


@pytest.mark.parametrize("flags,gather,order,dtype", [
    pytest.param((), "host", "numba before torch_xla", "torch.float32", id="host_gather"),
    pytest.param(("--device_gather", "--import_torch_xla_first", f"--steps={STOP}"), "device",
                 "torch_xla before numba", "torch.float32", id="device_gather_torch_xla_first"),
    pytest.param(("--feature_dtype=bfloat16",), "host", "numba before torch_xla", "torch.bfloat16", id="bfloat16"),
])
def test_rgcn_trains_and_compiles_once(mag_output, flags, gather, order, dtype):
  out = _train(mag_output, *flags)
  m = FINAL.search(out)
  assert m, out
  steps, device, first, last, compiles = int(m[1]), m[2], float(m[3]), float(m[4]), int(m[5])
  batches = -(-len(lg.load(mag_output).split("train")) // BATCH_SIZE)
  assert steps == (STOP if f"--steps={STOP}" in flags else EPOCHS * batches)
  assert device.startswith("xla")
  assert m[6] == gather
  assert 5.0 < first < 7.0
  assert last < first - 1.0  # ~ln(349) at first, then it learns the train seeds
  epochs = [float(v) for v in re.search(r"^rgcn: mean loss per epoch (.*)$", out, re.M)[1].split()]
  assert len(epochs) == -(-steps // batches), epochs
  assert all(b < a for a, b in zip(epochs, epochs[1:])), epochs
  # the step graph and the optimizer's first step compile; every later batch reuses them
  assert 1 <= compiles <= 3, out
  assert re.search(rf"compiles after 3 steps {compiles}, at the end {compiles}$", out, re.M), out
  assert f"imports {order};" in out
  assert f"features {dtype} on the device" in out


_MODEL_SCRIPT = r"""
import importlib.util, json, sys
import numpy as np
import torch
spec = importlib.util.spec_from_file_location("train_rgcn_xla", sys.argv[1])
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)
from loaders import graph as lg

B, HIDDEN = 20, 8  # 465 train papers: the last batch has 5 seeds and 15 padded
s = lg.HeteroNeighborSampler(lg.load(sys.argv[2]), fanouts=[4, 3], batch_size=B, seed=0)
torch.manual_seed(0)
model = ex.RGCN(s.num_nodes, {"paper": s[0]["x/paper"].shape[1]}, s.relations, HIDDEN, 349, s.num_hops, "paper", B)

def run(batch):
  t = {k: torch.from_numpy(v) for k, v in batch.items()}
  with torch.no_grad():
    logits = model(t, {"paper": t["x/paper"]})
    return logits.numpy(), ex.masked_cross_entropy(logits, t["y"], t["seed_mask"]).item()

def reference(batch):
  # the same R-GCN over the live nodes and edges only, edge by edge: row 0 (tail) -> row 1 (head)
  w = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  mask = {t: batch[f"node_mask/{t}"][:, None] for t in s.types}
  h = {t: (batch["x/paper"] @ w["inputs.paper.weight"].T + w["inputs.paper.bias"] if t == "paper"
           else w[f"inputs.{t}.weight"][batch[f"node_ids/{t}"]]) * mask[t] for t in s.types}
  for i in range(s.num_hops):
    out = {t: h[t] @ w[f"layers.{i}.self.{t}.weight"].T + w[f"layers.{i}.self.{t}.bias"] for t in s.types}
    for r in s.relations:
      head, _, tail = r.split("___")
      total, degree = np.zeros_like(out[head]), np.zeros(len(out[head]))
      for key in [k for k in batch if k.startswith(f"edge_index/{r}/")]:
        live = batch["edge_mask/" + key[len("edge_index/"):]]
        for u, v in batch[key][:, live].T:
          total[v] += w[f"layers.{i}.relation.{r}.weight"] @ h[tail][u]
          degree[v] += 1
      out[head] += total / np.maximum(degree, 1)[:, None]
    h = {t: (v if i == s.num_hops - 1 else np.maximum(v, 0)) * mask[t] for t, v in out.items()}
  return h["paper"][:B] @ w["classifier.weight"].T + w["classifier.bias"]

def noisy(b, rng):
  # b with garbage wherever a mask says padding: masked edges point anywhere, padded nodes and seeds hold noise
  n = dict(b)
  for k in [k for k in b if k.startswith("edge_index/")]:
    head, _, tail = k.split("/")[1].split("___")
    dead, e = ~b["edge_mask/" + k[len("edge_index/"):]], b[k].copy()
    e[0, dead] = rng.integers(0, s.budgets.nodes[tail], dead.sum())
    e[1, dead] = rng.integers(0, s.budgets.nodes[head], dead.sum())
    n[k] = e
  for t in s.types:
    dead, ids = ~b[f"node_mask/{t}"], b[f"node_ids/{t}"].copy()
    ids[dead] = rng.integers(0, s.num_nodes[t], dead.sum())
    n[f"node_ids/{t}"] = ids
  dead, x = ~b["node_mask/paper"], b["x/paper"].copy()
  x[dead] = rng.normal(size=(dead.sum(), x.shape[1]))
  n["x/paper"] = x
  n["y"] = np.where(b["seed_mask"][:, None], b["y"], rng.integers(0, 349, b["y"].shape))
  return n

rng, got = np.random.default_rng(0), {"padded": 0, "masked_edges": 0, "reference": 0.0, "noise": 0.0, "loss": 0.0}
for i in (0, len(s) - 1):  # a full batch and the padded last one
  b = s[i]
  live = b["seed_mask"]
  (logits, loss), (noisy_logits, noisy_loss) = run(b), run(noisy(b, rng))
  got["padded"] += int((~live).sum())
  got["masked_edges"] += int(sum((~b[k]).sum() for k in b if k.startswith("edge_mask/")))
  got["reference"] = max(got["reference"], float(np.abs(logits[live] - reference(b)[live]).max()))
  got["noise"] = max(got["noise"], float(np.abs(logits[live] - noisy_logits[live]).max()))
  got["loss"] = max(got["loss"], abs(loss - noisy_loss))
print(json.dumps(got))
"""


def test_the_model_is_the_r_gcn_and_ignores_everything_masked(mag_output):
  """Logits match an edge-by-edge R-GCN over the live edges, and garbage under every mask changes nothing."""
  r = subprocess.run([sys.executable, "-c", _MODEL_SCRIPT, SCRIPT, mag_output], capture_output=True, text=True,
                     env={**os.environ, "PYTHONPATH": REPO}, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert got["padded"] > 0
  assert got["masked_edges"] > 0  # there is padding to ignore
  assert got["reference"] < 1e-4, got
  assert got["noise"] < 1e-5, got
  assert got["loss"] < 1e-6, got
