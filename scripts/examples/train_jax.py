"""Training loops in plain jax + optax, fed global jax.Arrays by loaders.jax on a mesh of every local device.

    python scripts/examples/train_jax.py images OUTPUT [--steps=20] [--global_batch_size=8] [--checkpoint=DIR]
    python scripts/examples/train_jax.py graph GRAPH_OUTPUT [--steps=20] [--global_batch_size=64]
        [--fanouts=4,3] [--hidden=16] [--checkpoint=DIR]

`images`: a small convolutional classifier on an image output (the sample
flowers output, or any with `image` and `label`), through loaders.jax.dataset:
each batch's rows are split over the mesh axis "data" and the parameters are
replicated, so jax.jit runs the step data-parallel (the gradient's mean is an
all-reduce XLA inserts).

`graph`: an R-GCN on a MAG-shaped graph output (converted with
`--add_reverse_relations=true`), through loaders.jax.graph_dataset: one
neighbour-sampled subgraph per device, stacked on a leading axis that
jax.vmap maps the per-subgraph loss over. The model is train_rgcn_xla.py's:
a Linear over the features of types that have them, an embedding table for the
others, per layer a self loop plus per relation the mean of W_r·h_tail over the
sampled edges (masked), and a classifier on the seeds.

Every shape is static, so each step compiles once. --checkpoint=DIR resumes:
when DIR holds a checkpoint, the parameters, the optimizer's state and the
loader's state (DeviceIterator.get_state(): after the last batch the loop
received) are restored and training goes on at the saved step with the batch
that step would have read; at the end all three are written back. Prints a line
per step and, last:
    jax images: steps 3..5 (3 steps) on 8 cpu devices, resumed at step 3, last loss 1.0732
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from formats import load_manifest  # noqa: E402
from loaders import graph as lg, jax as lj  # noqa: E402

STATE_FILE = "state.json"  # in --checkpoint: {"step": next step, "loader": the loader's state}
ARRAYS_FILE = "train_state.npz"  # the leaves of (params, optimizer state), in tree order
IMAGE_SIZE = (32, 32)


def _dense(key, n_in: int, n_out: int) -> dict:
  return {"w": jax.random.normal(key, (n_in, n_out)) / np.sqrt(n_in), "b": jnp.zeros(n_out)}


# --------------------------------------------------------------------------- images


def init_cnn(key, num_classes: int, width: int = 16) -> dict:
  """Two 3x3 convolutions (stride 2) and a classifier over their global mean."""
  k1, k2, k3 = jax.random.split(key, 3)
  return {"conv1": jax.random.normal(k1, (3, 3, 3, width)) / np.sqrt(27),
          "conv2": jax.random.normal(k2, (3, 3, width, width)) / np.sqrt(9 * width),
          "out": _dense(k3, width, num_classes)}


def cnn_loss(params: dict, batch: dict) -> jax.Array:
  """Mean cross-entropy of uint8 images [B, H, W, 3] against their labels."""
  h = batch["image"].astype(jnp.float32) / 255.0
  for w in (params["conv1"], params["conv2"]):
    h = jax.nn.relu(jax.lax.conv_general_dilated(h, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
  logits = h.mean(axis=(1, 2)) @ params["out"]["w"] + params["out"]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


# --------------------------------------------------------------------------- graph


def init_rgcn(key, sampler: lg.HeteroNeighborSampler, feature_dims: dict[str, int], hidden: int,
              num_classes: int) -> dict:
  """Inputs (a Linear for types with features, an embedding table for the others), layers, classifier."""
  keys = iter(jax.random.split(key, 1 + len(sampler.types) * (1 + sampler.num_hops)
                               + len(sampler.relations) * sampler.num_hops))
  inputs = {t: _dense(next(keys), feature_dims[t], hidden) if t in feature_dims
            else jax.random.normal(next(keys), (sampler.num_nodes[t], hidden)) * 0.1 for t in sampler.types}
  layers = [{"self": {t: _dense(next(keys), hidden, hidden) for t in sampler.types},
             "relation": {r: jax.random.normal(next(keys), (hidden, hidden)) / np.sqrt(hidden)
                          for r in sampler.relations}} for _ in range(sampler.num_hops)]
  return {"inputs": inputs, "layers": layers, "out": _dense(next(keys), hidden, num_classes)}


def rgcn_loss(params: dict, g: dict, seed_type: str, batch_size: int) -> jax.Array:
  """Masked cross-entropy of one subgraph's seeds (padding weighs 0; no data-dependent shapes)."""
  types = sorted(params["inputs"])
  mask = {t: g[f"node_mask/{t}"][:, None].astype(jnp.float32) for t in types}
  h = {t: (g[f"x/{t}"].astype(jnp.float32) @ p["w"] + p["b"] if isinstance(p, dict) else p[g[f"node_ids/{t}"]])
          * mask[t] for t, p in params["inputs"].items()}
  for i, layer in enumerate(params["layers"]):
    out = {t: h[t] @ p["w"] + p["b"] for t, p in layer["self"].items()}
    for r, w in layer["relation"].items():
      hops = sorted(k for k in g if k.startswith(f"edge_index/{r}/"))
      if not hops:  # never sampled (its head type has no frontier at any hop)
        continue
      head, _, tail = r.split("___")
      index = jnp.concatenate([g[k] for k in hops], axis=1)
      weight = jnp.concatenate([g["edge_mask/" + k[len("edge_index/"):]] for k in hops]).astype(jnp.float32)
      messages = (h[tail][index[0]] @ w) * weight[:, None]
      total = jnp.zeros_like(out[head]).at[index[1]].add(messages)
      degree = jnp.zeros(out[head].shape[0]).at[index[1]].add(weight)
      out[head] = out[head] + total / jnp.maximum(degree, 1.0)[:, None]
    last = i == len(params["layers"]) - 1
    h = {t: (v if last else jax.nn.relu(v)) * mask[t] for t, v in out.items()}
  logits = h[seed_type][:batch_size] @ params["out"]["w"] + params["out"]["b"]
  live = g["seed_mask"].astype(jnp.float32)
  labels = jnp.where(g["seed_mask"], g["y"][:, 0], 0)  # padding's label could be out of range
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return (losses * live).sum() / jnp.maximum(live.sum(), 1.0)


# --------------------------------------------------------------------------- checkpoints


def load_checkpoint(folder: str | None, train_state):
  """(the step to start at, the loader state, the train state) from `folder`; (0, None, train_state) without one."""
  if not folder or not os.path.exists(os.path.join(folder, STATE_FILE)):
    return 0, None, train_state
  with open(os.path.join(folder, STATE_FILE)) as f:
    saved = json.load(f)
  with np.load(os.path.join(folder, ARRAYS_FILE)) as z:
    leaves = [z[f"arr_{i}"] for i in range(len(z.files))]
  return saved["step"], saved["loader"], jax.tree.unflatten(jax.tree.structure(train_state), leaves)


def save_checkpoint(folder: str, train_state, step: int, loader_state: dict) -> None:
  """Writes the arrays, then {"step", "loader"}: a checkpoint is whole once its state file exists."""
  os.makedirs(folder, exist_ok=True)
  np.savez(os.path.join(folder, ARRAYS_FILE), *[np.asarray(v) for v in jax.tree.leaves(train_state)])
  tmp = os.path.join(folder, STATE_FILE + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"step": step, "loader": loader_state}, f)
  os.replace(tmp, os.path.join(folder, STATE_FILE))


# --------------------------------------------------------------------------- the loop


def _parse(argv: list[str] | None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("task", choices=["images", "graph"])
  ap.add_argument("output", help="an image output, or a MAG-shaped graph output for `graph`")
  ap.add_argument("--steps", type=int, default=20, help="steps in this run")
  ap.add_argument("--global_batch_size", type=int, default=None,
                  help="images, or seeds over all subgraphs (default 8 images, 64 seeds)")
  ap.add_argument("--fanouts", default="4,3", help="graph: per hop, for every relation")
  ap.add_argument("--hidden", type=int, default=16, help="graph: width of every hidden representation")
  ap.add_argument("--lr", type=float, default=0.01)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--checkpoint", default=None, help="a folder to resume from and save to")
  a = ap.parse_args(argv)
  if a.steps < 1:
    ap.error(f"--steps must be >= 1, got {a.steps}")
  a.global_batch_size = a.global_batch_size or (8 if a.task == "images" else 64)
  return a


def main(argv: list[str] | None = None) -> None:
  a = _parse(argv)
  mesh = Mesh(np.array(jax.devices()), ("data",))
  key = jax.random.PRNGKey(a.seed)
  if a.task == "images":
    num_classes = load_manifest(a.output).features["label"].num_classes
    params = init_cnn(key, num_classes)
    loss_fn = cnn_loss
    it = lj.dataset(a.output, "train", mesh=mesh, global_batch_size=a.global_batch_size, image_size=IMAGE_SIZE,
                    num_epochs=1000, seed=a.seed, num_threads=2)
  else:
    graph = lg.load(a.output)
    fanouts = [int(k) for k in a.fanouts.split(",")]

    def make_sampler(slot: int, slots: int) -> lg.HeteroNeighborSampler:
      return lg.HeteroNeighborSampler(graph, fanouts=fanouts, global_batch_size=a.global_batch_size, seed=a.seed,
                                      shard_index=slot, shard_count=slots)

    sampler = make_sampler(0, 1)
    featured = {t: graph.bin[f"node/{t}/feat"].shape[1] for t in sampler.types if f"node/{t}/feat" in graph.bin}
    num_classes = int(np.asarray(graph.bin[f"node/{sampler.seed_type}/label"]).max()) + 1
    params = init_rgcn(key, sampler, featured, a.hidden, num_classes)
    per_slot = a.global_batch_size // len(jax.devices())

    def loss_fn(params, batch):  # one subgraph per slice of the leading axis
      return jax.vmap(lambda g: rgcn_loss(params, g, sampler.seed_type, per_slot))(batch).mean()

    it = lj.graph_dataset(make_sampler, mesh=mesh, num_epochs=1000, num_threads=2)

  opt = optax.adam(a.lr)
  start, loader_state, (params, opt_state) = load_checkpoint(a.checkpoint, (params, opt.init(params)))
  replicated = NamedSharding(mesh, PartitionSpec())
  params, opt_state = jax.device_put((params, opt_state), replicated)
  if loader_state is not None:
    it.set_state(loader_state)

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step, loss = start, None  # `step`: the next step to run
  for batch in itertools.islice(it, a.steps):
    params, opt_state, loss = train_step(params, opt_state, batch)
    print(f"step {step}: loss {float(loss)!r}", flush=True)
    step += 1
  if a.checkpoint:
    save_checkpoint(a.checkpoint, (params, opt_state), step, it.get_state())
  it.close()
  resumed = f"resumed at step {start}" if loader_state is not None else "fresh start"
  last = "no batch left" if loss is None else f"last loss {float(loss):.4f}"
  print(f"jax {a.task}: steps {start}..{step - 1} ({step - start} steps) on {len(jax.devices())} "
        f"{jax.devices()[0].platform} devices, {resumed}, {last}, compiles {train_step._cache_size()}")


if __name__ == "__main__":
  main()
