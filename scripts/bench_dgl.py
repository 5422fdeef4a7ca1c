"""Times DGL's `NeighborSampler.sample_blocks` on a .graphbin's homogeneous CSR, from a side environment.

Contract (scripts/bench_graphs.py calls this with `--dgl_python=PYTHON` through subprocess):

    PYTHON scripts/bench_dgl.py GRAPHBIN [--fanouts=15,10,5] [--batch_size=1024] [--batches=20]
        [--warmup=2] [--seed=0] [--threads=1] [--idtype=int64] [--split=NAME] [--gather] [--json=OUT]

    Reads from GRAPHBIN the sections `indptr`, `indices`, `split/NAME/train` (without --split the
    first such section, sorted by name) and, with --gather, `node/feat`.
    Writes one JSON object to OUT (temp file, then rename) and prints it as the last line of stdout.
    Exit 0 with a result; 2 on bad flags; 1 on any error (a missing section, a failed check, no DGL).
    Keys of the JSON object:
      edges_per_s, batches_per_s, ms_per_batch   the rates over the timed batches (warmup excluded)
      sampled_edges, input_nodes                 totals over the timed batches (sum of block.num_edges())
      batches, warmup, batch_size, seed, threads, gather, idtype, split
      fanouts          as given: hop 0 first (the seeds' own neighbours), the toolkit's order
      dgl_fanouts      what NeighborSampler got: the same list reversed (DGL lists layers input-first
                       and samples the seeds with its LAST entry)
      load_s, build_s  reading the arrays into memory; dgl.graph(("csc", ...)) (neither in the rates)
      num_nodes, num_edges, path, fused (DGL's multi-threaded fused path, used when threads > 1)
      versions         {python, dgl, torch, numpy}

What is timed, per batch: `sample_blocks(g, seeds)` with `batch_size` training seeds (consecutive
slices of a seeded permutation of the train split), plus with --gather
`torch.index_select(feat, 0, input_nodes)` from the features held in memory. The graph is built as
CSC from the file's CSR arrays, so a node's in-neighbours in DGL are its row of `indices`: DGL samples
exactly the lists the toolkit's sampler samples. Before the warmup, one batch is checked (its seeds are
the output nodes; the seed hop's edges exist in the CSR, at most fanouts[0] per seed).

This script runs in DGL's side environment, never in the toolkit's (DGL is no dependency of the
toolkit). It imports formats/graphbin.py (numpy + google_crc32c) without the rest of `formats`.
The side environment at /tmp/dglenv was made with (DGL 2.1.0 ships libraries for torch 2.0.0 to
2.2.1; the registry's torch 2.2.1 is a CUDA build, ~5 GB installed, used here on the CPU):

    python3.11 -m venv /tmp/dglenv
    /tmp/dglenv/bin/pip install 'torch==2.2.1' 'numpy<2' google-crc32c
    /tmp/dglenv/bin/pip install 'dgl==2.1.0' 'torch==2.2.1' 'numpy<2' 'torchdata<0.8'
    /tmp/dglenv/bin/pip install 'pandas<2.3' pydantic pyyaml 'numpy<2' 'torch==2.2.1'  # imported, not declared

Example:

    /tmp/dglenv/bin/python scripts/bench_dgl.py bench_work/g/graph.graphbin --batches=10 --json=/tmp/dgl.json
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import importlib
import json
import os
import platform
import sys
import time
import types
from typing import Any

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def graphbin_module() -> types.ModuleType:
  """formats.graphbin (and formats.errors) alone: formats/__init__.py imports modules whose dependencies
  (array_record, ...) the side environment lacks, so `formats` is entered as a bare package."""
  if "formats" not in sys.modules:
    pkg = types.ModuleType("formats")
    pkg.__path__ = [os.path.join(REPO, "formats")]
    sys.modules["formats"] = pkg
  return importlib.import_module("formats.graphbin")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("graphbin", help="a .graphbin with indptr, indices and a split/<name>/train section")
  ap.add_argument("--fanouts", default="15,10,5", help="neighbours per hop, hop 0 (the seeds) first")
  ap.add_argument("--batch_size", type=int, default=1024)
  ap.add_argument("--batches", type=int, default=20, help="timed batches")
  ap.add_argument("--warmup", type=int, default=2, help="untimed batches first")
  ap.add_argument("--seed", type=int, default=0, help="seeds the permutation of the train split and DGL's RNG")
  ap.add_argument("--threads", type=int, default=1, help="OpenMP threads of torch and DGL")
  ap.add_argument("--idtype", choices=("int64", "int32"), default="int64", help="DGL graph id type")
  ap.add_argument("--split", default=None, help="split/<split>/train (default: the only one, or the first sorted)")
  ap.add_argument("--gather", action="store_true", help="also time torch.index_select of node/feat")
  ap.add_argument("--json", default=None, help="also write the result here")
  a = ap.parse_args(argv)
  try:
    a.fanouts = [int(f) for f in a.fanouts.split(",")]
  except ValueError:
    ap.error(f"--fanouts must be comma-separated integers, got {a.fanouts!r}")
  if not a.fanouts or any(f < 1 for f in a.fanouts):
    ap.error(f"--fanouts must be positive, got {a.fanouts}")
  if a.batch_size < 1 or a.batches < 1 or a.warmup < 0 or a.threads < 1:
    ap.error(f"need --batch_size, --batches, --threads >= 1 and --warmup >= 0, got {a.batch_size}, "
             f"{a.batches}, {a.threads}, {a.warmup}")
  return a


class SeedBatches:
  """Consecutive `batch_size` slices of a seeded permutation of `train`, reshuffled when used up."""

  def __init__(self, train: np.ndarray, batch_size: int, seed: int):
    if len(train) < batch_size:
      raise ValueError(f"the train split has {len(train)} nodes, fewer than --batch_size={batch_size}")
    self._train, self._size = train, batch_size
    self._rng = np.random.default_rng(seed)
    self._perm, self._pos = self._rng.permutation(train), 0

  def next(self) -> np.ndarray:
    if self._pos + self._size > len(self._perm):
      self._perm, self._pos = self._rng.permutation(self._train), 0
    out = self._perm[self._pos:self._pos + self._size]
    self._pos += self._size
    return out


def check_batch(dgl: Any, indptr: np.ndarray, indices: np.ndarray, seeds: Any, output_nodes: Any, blocks: list,
                fanout: int) -> None:
  """Raises RuntimeError unless the output nodes are the seeds and the seed hop's edges are CSR edges."""
  if not np.array_equal(output_nodes.numpy(), seeds.numpy()):
    raise RuntimeError("sample_blocks: the output nodes are not the seeds")
  last = blocks[-1]
  src, dst = last.edges()
  src = last.srcdata[dgl.NID][src].numpy()
  dst = last.dstdata[dgl.NID][dst].numpy()
  order = np.argsort(dst, kind="stable")
  src, dst = src[order], dst[order]
  nodes, starts, counts = np.unique(dst, return_index=True, return_counts=True)
  for d, s, c in zip(nodes, starts, counts):
    row = indices[indptr[d]:indptr[d + 1]]
    if c > min(fanout, len(row)):
      raise RuntimeError(f"sample_blocks: node {d} got {c} in-edges (degree {len(row)}, fanout {fanout})")
    if not np.isin(src[s:s + c], row).all():
      raise RuntimeError(f"sample_blocks: node {d} got in-edges that are not in its CSR row")


def main(argv: Sequence[str] | None = None) -> int:
  a = parse_args(argv)
  os.environ["OMP_NUM_THREADS"] = str(a.threads)  # before torch and DGL load their OpenMP runtimes
  import torch  # the side environment's frameworks, imported once the thread count is set
  import dgl

  torch.set_num_threads(a.threads)
  dgl.utils.set_num_threads(a.threads)
  dgl.seed(a.seed)
  torch.manual_seed(a.seed)
  gb = graphbin_module()

  t0 = time.perf_counter()
  graph = gb.GraphBin(a.graphbin, verify=False)
  splits = [n for n in graph.names("split/") if n.endswith("/train")]
  train_name = f"split/{a.split}/train" if a.split else (splits[0] if splits else "split/<none>/train")
  used = ["indptr", "indices", train_name] + (["node/feat"] if a.gather else [])
  missing = [n for n in used if n not in graph]
  if missing:
    raise KeyError(f"{a.graphbin} lacks {missing} (it has {sorted(graph.sections)})")
  graph.verify(used)
  id_np = np.dtype(a.idtype)
  indptr = np.array(graph["indptr"], dtype=id_np)
  indices = np.array(graph["indices"], dtype=id_np)
  train = np.array(graph[train_name], dtype=id_np)
  feat = torch.from_numpy(np.array(graph["node/feat"])) if a.gather else None
  load_s = time.perf_counter() - t0
  num_nodes, num_edges = len(indptr) - 1, len(indices)

  t0 = time.perf_counter()
  g = dgl.graph(("csc", (torch.from_numpy(indptr), torch.from_numpy(indices), torch.tensor([], dtype=torch.int64))),
                num_nodes=num_nodes, idtype=getattr(torch, a.idtype))
  build_s = time.perf_counter() - t0

  dgl_fanouts = list(reversed(a.fanouts))
  sampler = dgl.dataloading.NeighborSampler(dgl_fanouts)
  batches = SeedBatches(train, a.batch_size, a.seed)
  seeds = torch.from_numpy(batches.next())
  _, output_nodes, blocks = sampler.sample_blocks(g, seeds)
  check_batch(dgl, indptr, indices, seeds, output_nodes, blocks, a.fanouts[0])

  def one_batch() -> tuple[int, int]:
    input_nodes, _, blocks = sampler.sample_blocks(g, torch.from_numpy(batches.next()))
    if feat is not None:
      torch.index_select(feat, 0, input_nodes)
    return sum(b.num_edges() for b in blocks), len(input_nodes)

  for _ in range(a.warmup):
    one_batch()
  edges = inputs = 0
  t0 = time.perf_counter()
  for _ in range(a.batches):
    e, n = one_batch()
    edges += e
    inputs += n
  seconds = time.perf_counter() - t0

  result = {
      "edges_per_s": edges / seconds, "batches_per_s": a.batches / seconds, "ms_per_batch": 1e3 * seconds / a.batches,
      "sampled_edges": edges, "input_nodes": inputs, "batches": a.batches, "warmup": a.warmup,
      "batch_size": a.batch_size, "seed": a.seed, "threads": a.threads, "gather": a.gather, "idtype": a.idtype,
      "split": train_name, "fanouts": a.fanouts, "dgl_fanouts": dgl_fanouts, "load_s": load_s, "build_s": build_s,
      "num_nodes": num_nodes, "num_edges": num_edges, "path": os.path.abspath(a.graphbin),
      "fused": a.threads > 1 and sampler.fused,
      "versions": {"python": platform.python_version(), "dgl": dgl.__version__, "torch": torch.__version__,
                   "numpy": np.__version__},
  }
  line = json.dumps(result, sort_keys=True)
  if a.json:
    tmp = f"{a.json}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
      f.write(line + "\n")
    os.replace(tmp, a.json)
  print(line, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
