"""An R-GCN trained on a MAG-shaped graph on an XLA device, fed by loaders.graph (runs on CPU with PJRT_DEVICE=CPU).

    PJRT_DEVICE=CPU python scripts/examples/train_rgcn_xla.py GRAPH_OUTPUT [--epochs=1] [--steps=N]
        [--batch_size=64] [--fanouts=4,3] [--hidden=64] [--lr=0.01] [--device_gather]
        [--feature_dtype=bfloat16] [--import_torch_xla_first]

GRAPH_OUTPUT is a graph output folder (local or gs://) converted from ogbn-mag
(or a folder of the same shape) with `--add_reverse_relations=true`, so that
paper seeds reach authors (`paper___rev_writes___author`) and, through them,
institutions. Batches come from `loaders.graph.HeteroNeighborSampler` through
`loaders.graph.xla_loader`: every tensor has the same shape in every batch, so
the training step is traced and compiled once (the CompileTime count printed
at the end stays put after the first steps).

The model, in plain torch (no PyG or DGL):
- inputs: a Linear over `x/<type>` for node types with features (paper); an
  `nn.Embedding(num_nodes[type], hidden)` indexed by `node_ids/<type>` for
  types without (author, institution, field_of_study): the batch's global ids
  within a type select rows of a learned table (ogbn-mag's author table at
  --hidden=64: 1.1M x 64 float32, 290 MB, and Adam keeps two more).
- L layers (L = the number of hops), each over every sampled edge of every
  relation and hop. For a relation head___rel___tail, row 0 of
  `edge_index/<relation>/<hop>` is the sampled tail-type node and row 1 the
  head-type node it was sampled for: messages W_r·h_tail[row 0], zeroed by
  `edge_mask`, are summed into head[row 1] (index_add) and divided by the
  masked in-degree per relation, plus a self loop W_self·h_head; ReLU between
  layers. Padding is handled by masks, never by boolean indexing (whose
  result shape depends on the data).
- a classifier on the seeds (the seed type's local ids 0..B-1) and a
  cross-entropy on `y[:, 0]` weighted by `seed_mask`.

Features reach the device one of two ways:
- host gather (default): the sampler puts `x/paper` in the batch, and the
  device loader copies it with the rest.
- `--device_gather`: the sampler is built with `gather_features=False`; the
  paper feature table (`graph.bin["node/paper/feat"]`) is copied to the device
  once, before training, and each step gathers `x = table[node_ids/paper]`
  there. Only the int64 ids cross to the device per batch: the way to go when
  the table fits in device memory.
`--feature_dtype=bfloat16` halves the features' bytes (host gather: the batch's
`x/paper` is bfloat16; device gather: the device table is); the model casts
them to float32 on the device.

numba (the sampler's kernel, imported when the sampler is built) and torch_xla
share this process. torch_xla is imported after the sampler is built, or
before the loaders with `--import_torch_xla_first`; both orders work. Nothing
here imports TensorFlow.

It prints three lines; the last sums the run up (ogbn-mag's shape at 1/1000, 5 epochs):
    rgcn: imports numba before torch_xla; features torch.float32 on the device; compiles after 3 steps 2, at the end 2
    rgcn: mean loss per epoch 5.956 5.600 5.295 5.017 4.512
    rgcn: 40 steps on xla:0, loss first 5.945 last 4.296, compiles 2, host gather
Two compiles: the training step, and the optimizer's first step (which
creates its state). A count that still grows after the first steps means some
shape or constant changes from batch to batch.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402  (torch alone: torch_xla is imported in main, in the order asked for)
from torch import nn  # noqa: E402

WARM_UP_STEPS = 3  # the step graph and the optimizer's first-step graph are compiled by then


class RGCN(nn.Module):
  """Relational GCN over a heterogeneous neighbour-sampled batch (static shapes throughout)."""

  def __init__(self, num_nodes: dict[str, int], feature_dims: dict[str, int], relations: list[str], hidden: int,
               num_classes: int, num_layers: int, seed_type: str, batch_size: int):
    """Builds the weights.

    Args:
      num_nodes: {node type: nodes in the graph} (the embedding tables' rows).
      feature_dims: {node type: feature width} for types with features.
      relations: the sampled relations, head___rel___tail.
      hidden: width of every hidden representation.
      num_classes: classes of the seed type's labels.
      num_layers: message-passing layers.
      seed_type: the seeds' node type.
      batch_size: seeds per batch (the seed type's first local ids).
    """
    super().__init__()
    self.types, self.relations = sorted(num_nodes), list(relations)
    self.seed_type, self.batch_size = seed_type, batch_size
    self.inputs = nn.ModuleDict({t: nn.Linear(feature_dims[t], hidden) if t in feature_dims
                                 else nn.Embedding(num_nodes[t], hidden) for t in self.types})
    self.featured = set(feature_dims)
    self.layers = nn.ModuleList(nn.ModuleDict({
        "relation": nn.ModuleDict({r: nn.Linear(hidden, hidden, bias=False) for r in self.relations}),
        "self": nn.ModuleDict({t: nn.Linear(hidden, hidden) for t in self.types}),
    }) for _ in range(num_layers))
    self.classifier = nn.Linear(hidden, num_classes)

  def forward(self, batch: dict[str, torch.Tensor], x: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits [B, classes] of the batch's seeds.

    Args:
      batch: the sampler's tensors on the device (node_ids/, node_mask/, edge_index/, edge_mask/).
      x: {node type: float32 features of its local nodes} for the types with features.
    """
    masks = {t: batch[f"node_mask/{t}"].unsqueeze(1).to(torch.float32) for t in self.types}
    h = {t: self.inputs[t](x[t] if t in self.featured else batch[f"node_ids/{t}"]) * masks[t] for t in self.types}
    edges = {r: _edges_of(batch, r) for r in self.relations}
    for i, layer in enumerate(self.layers):
      out = {t: layer["self"][t](h[t]) for t in self.types}
      for r, found in edges.items():
        if found is None:
          continue
        head, tail = r.split("___")[0], r.split("___")[2]
        index, weight = found
        messages = layer["relation"][r](h[tail].index_select(0, index[0])) * weight.unsqueeze(1)
        total = torch.zeros_like(out[head]).index_add(0, index[1], messages)
        degree = torch.zeros(out[head].shape[0], device=weight.device).index_add(0, index[1], weight)
        out[head] = out[head] + total / degree.clamp(min=1.0).unsqueeze(1)
      last = i == len(self.layers) - 1
      h = {t: (v if last else torch.relu(v)) * masks[t] for t, v in out.items()}
    return self.classifier(h[self.seed_type][:self.batch_size])


def _edges_of(batch: dict[str, torch.Tensor], relation: str) -> tuple[torch.Tensor, torch.Tensor] | None:
  """All hops of a relation: edge_index [2, E] int64 and the float edge mask [E]; None if it was never sampled."""
  hops = sorted(k.split("/")[2] for k in batch if k.startswith(f"edge_index/{relation}/"))
  if not hops:
    return None
  index = torch.cat([batch[f"edge_index/{relation}/{h}"] for h in hops], dim=1).to(torch.int64)
  mask = torch.cat([batch[f"edge_mask/{relation}/{h}"] for h in hops]).to(torch.float32)
  return index, mask


def masked_cross_entropy(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
  """Mean cross-entropy over the live seeds (padding weighs 0; no data-dependent shapes)."""
  weight = mask.to(logits.dtype)
  losses = nn.functional.cross_entropy(logits, y[:, 0].to(torch.int64), reduction="none")
  return (losses * weight).sum() / weight.sum().clamp(min=1.0)


def _parse(argv: list[str] | None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("graph_output", help="a MAG-shaped graph output converted with --add_reverse_relations=true")
  ap.add_argument("--epochs", type=int, default=1)
  ap.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: all epochs)")
  ap.add_argument("--batch_size", type=int, default=64)
  ap.add_argument("--fanouts", default="4,3", help="per hop, for every relation")
  ap.add_argument("--hidden", type=int, default=64)
  ap.add_argument("--lr", type=float, default=0.01)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--num_threads", type=int, default=2, help="grain's sampling threads")
  ap.add_argument("--device_gather", action="store_true", help="gather paper features on the device")
  ap.add_argument("--feature_dtype", default=None, help="e.g. bfloat16 (default: as stored)")
  ap.add_argument("--import_torch_xla_first", action="store_true", help="import torch_xla before the loaders")
  a = ap.parse_args(argv)
  a.fanouts = [int(k) for k in a.fanouts.split(",")]
  if a.epochs < 1 or (a.steps is not None and a.steps < 1):
    ap.error(f"--epochs and --steps must be >= 1, got --epochs={a.epochs} --steps={a.steps}")
  return a


def main(argv: list[str] | None = None) -> None:
  a = _parse(argv)
  if a.import_torch_xla_first:
    import torch_xla  # noqa: F401  (before numba)
  from loaders import graph as lg

  graph = lg.load(a.graph_output)
  sampler = lg.HeteroNeighborSampler(graph, fanouts=a.fanouts, batch_size=a.batch_size, seed=a.seed,
                                     gather_features=not a.device_gather, feature_dtype=a.feature_dtype)
  order = "torch_xla before numba" if "torch_xla" in sys.modules else "numba before torch_xla"
  assert "numba" in sys.modules  # building the sampler imported it
  import torch_xla
  import torch_xla.debug.metrics as met

  device = torch_xla.device()
  featured = [t for t in sampler.types if f"node/{t}/feat" in graph.bin]
  feature_dims = {t: graph.bin[f"node/{t}/feat"].shape[1] for t in featured}
  tables = {}
  if a.device_gather:  # once: the feature tables move to the device; batches carry only node_ids
    dtype = {"bf16": torch.bfloat16}.get(a.feature_dtype) or getattr(torch, a.feature_dtype or "", None)
    tables = {t: torch.from_numpy(np.array(graph.bin[f"node/{t}/feat"])).to(dtype=dtype).to(device) for t in featured}
  num_classes = int(np.asarray(graph.bin[f"node/{sampler.seed_type}/label"]).max()) + 1

  torch.manual_seed(a.seed)
  model = RGCN(sampler.num_nodes, feature_dims, sampler.relations, a.hidden, num_classes, sampler.num_hops,
               sampler.seed_type, a.batch_size).to(device)
  opt = torch.optim.Adam(model.parameters(), lr=a.lr)
  loader = lg.xla_loader(sampler, device=device, num_epochs=a.epochs, num_threads=a.num_threads)

  losses, warm = [], None
  for step, batch in enumerate(loader):
    if a.device_gather:
      raw = {t: tables[t][batch[f"node_ids/{t}"]] for t in featured}
    else:
      raw = {t: batch[f"x/{t}"] for t in featured}
    x = {t: v.to(torch.float32) for t, v in raw.items()}
    loss = masked_cross_entropy(model(batch, x), batch["y"], batch["seed_mask"])
    opt.zero_grad()
    loss.backward()
    opt.step()
    torch_xla.sync()
    losses.append(loss.detach())  # materialised by the sync: reading it later adds no graph
    if step + 1 == WARM_UP_STEPS:
      warm = met.metric_data("CompileTime")[0]
    if step + 1 == a.steps:
      break
  if not losses:
    raise SystemExit(f"{a.graph_output}: no training batches (the {sampler.seed_type!r} train split is empty)")
  values = [v.item() for v in losses]
  compiles = met.metric_data("CompileTime")[0]
  assert all(math.isfinite(v) for v in values), values
  assert "tensorflow" not in sys.modules
  per_epoch = [float(np.mean(values[i:i + len(sampler)])) for i in range(0, len(values), len(sampler))]
  dtypes = ", ".join(sorted({str(v.dtype) for v in raw.values()}))
  print(f"rgcn: imports {order}; features {dtypes} on the device; "
        f"compiles after {WARM_UP_STEPS} steps {warm}, at the end {compiles}")
  print("rgcn: mean loss per epoch " + " ".join(f"{v:.3f}" for v in per_epoch))
  print(f"rgcn: {len(values)} steps on {device}, loss first {values[0]:.3f} last {values[-1]:.3f}, "
        f"compiles {compiles}, {'device' if a.device_gather else 'host'} gather")


if __name__ == "__main__":
  main()
