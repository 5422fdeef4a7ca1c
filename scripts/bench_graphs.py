"""Benchmarks the graph toolkit on a random graph the size of ogbn-products: CSR build and sampling.

    python scripts/bench_graphs.py [--work=bench_work] [--num_nodes=2449029]
        [--num_edges=61859140] [--feat_dim=100] [--seed=0] [--batches=20]
        [--repeats=1] [--profile=0] [--json=results.json]

Generates in memory (untimed, the same for a given seed) `--num_edges` distinct
directed edges between uniform random nodes, in random order, as int64 arrays.
Then, in order:
 1. times the CSR build: scipy's `coo_matrix(...).tocsr()` (the baseline,
    which also sorts rows and sums duplicates) against `pipelines.ogb_graphs.csr.csr_from_coo`
    (the pipeline's per-partition build), and checks they agree: same indptr and,
    rows sorted, the same neighbours;
 2. writes (once, cached under --work) a .graphbin with that CSR, float32
    features [N, feat_dim], int64 labels [N, 1] and a train split of ~8% of the
    nodes (as ogbn-products), and opens it with `loaders.graph.Graph`;
 3. times `NeighborSampler(fanouts=[15, 10, 5], batch_size=1024).batch(i)` in
    one thread (after 2 warm-up batches), on the graph and on the same graph
    with its features hidden (the difference is the cost of the feature
    gather), then iterates `grain_dataset(num_threads=2)` for information.
Sampled edges are the edges a batch keeps (the sum of its `edge_mask_<h>`).
Prints a table and the two targets; exits 0 whether they are met or not (this
is a report), non-zero on errors and failed checks.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import cProfile
import dataclasses
import gc
import io
import json
import logging
import os
import pstats
import resource
import shutil
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import scipy.sparse  # noqa: E402

from formats.graphbin import GraphBinWriter  # noqa: E402
from loaders.graph import Graph, NeighborSampler, grain_dataset  # noqa: E402
from pipelines.ogb_graphs.csr import csr_from_coo  # noqa: E402

PRODUCTS_NODES = 2_449_029
PRODUCTS_EDGES = 61_859_140
PRODUCTS_TRAIN_FRACTION = 196_615 / PRODUCTS_NODES  # ogbn-products' sales_ranking train split
NUM_CLASSES = 47
FANOUTS = (15, 10, 5)
BATCH_SIZE = 1024
WARMUP_BATCHES = 2
GRAIN_THREADS = 2
FEATURE_CHUNK_ROWS = 1 << 18
SAMPLING_TARGET = 25e6  # sampled edges/s, one process
PYG_PUBLISHED = 1.84e6  # PyG NeighborLoader on ogbn-products, sampled edges/s (published, not measured)


@dataclasses.dataclass(frozen=True)
class BuildResult:
  variant: str
  seconds: float  # best of the repeats
  edges: int

  @property
  def edges_per_s(self) -> float:
    return self.edges / self.seconds


@dataclasses.dataclass(frozen=True)
class SampleResult:
  variant: str
  seconds: float
  batches: int
  edges: int  # sampled edges kept (sum of the edge masks)

  @property
  def edges_per_s(self) -> float:
    return self.edges / self.seconds

  @property
  def batches_per_s(self) -> float:
    return self.batches / self.seconds

  @property
  def ms_per_batch(self) -> float:
    return 1e3 * self.seconds / self.batches


def _distinct(a: np.ndarray) -> np.ndarray:
  """Sorted distinct values (np.unique, but a sort: numpy 2.4's np.unique takes ~90s on 62M int64)."""
  a = np.sort(a)
  return a[np.concatenate([[True], a[1:] != a[:-1]])] if len(a) else a


def random_edges(num_nodes: int, num_edges: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """(src, dst) int64: `num_edges` distinct uniform random edges, in random order."""
  rng = np.random.default_rng([seed, 0xED6E])
  space = num_nodes * num_nodes
  keys = _distinct(rng.integers(0, space, num_edges, dtype=np.int64))  # sorted, distinct
  while len(keys) < num_edges:  # a few hundred collisions at ogbn-products' size
    extra = _distinct(rng.integers(0, space, num_edges - len(keys), dtype=np.int64))
    pos = np.searchsorted(keys, extra)
    fresh = extra[(pos == len(keys)) | (keys[np.minimum(pos, len(keys) - 1)] != extra)]
    keys = np.insert(keys, np.searchsorted(keys, fresh), fresh)
  rng.shuffle(keys)
  src, dst = np.divmod(keys, num_nodes)
  return src, dst


def best_of(repeats: int, fn: Callable[[], Any]) -> tuple[float, Any]:
  """Runs `fn()` `repeats` times (dropping each result before the next); best time, last result."""
  times, out = [], None
  for _ in range(repeats):
    out = None
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
  return min(times), out


def check_csr(ref: scipy.sparse.csr_matrix, indptr: np.ndarray, indices: np.ndarray, order: np.ndarray,
              dst: np.ndarray) -> list[tuple[str, bool]]:
  """csr_from_coo against scipy: nnz, indptr, indices == dst[order], and rows once sorted."""
  e = len(dst)
  checks = [(f"scipy kept every edge (nnz {ref.nnz} == {e}: no duplicates summed)", ref.nnz == e),
            ("csr_from_coo indptr == scipy's", np.array_equal(indptr, ref.indptr))]
  checks.append(("csr_from_coo indices == dst[order]", np.array_equal(indices, dst[order])))
  # scipy sorts each row; sort ours the same way (in C++, in place on a copy) and compare
  mine = scipy.sparse.csr_matrix((order, indices.copy(), indptr), shape=ref.shape)
  mine.sort_indices()
  checks.append(("csr_from_coo rows hold the same neighbours as scipy's (rows sorted)",
                 np.array_equal(mine.indptr, ref.indptr) and np.array_equal(mine.indices, ref.indices)))
  return checks


def ensure_graph(work: str, indptr: np.ndarray, indices: np.ndarray, feat_dim: int, seed: int) -> str:
  """The cached .graphbin of this CSR with random features, labels and train split (written on first use)."""
  n = len(indptr) - 1
  folder = os.path.join(work, f"graph_{n}n_{len(indices)}e_{feat_dim}f_seed{seed}")
  path = os.path.join(folder, "graph.graphbin")
  done = folder + ".done"  # beside the folder
  if os.path.exists(done):
    return path
  shutil.rmtree(folder, ignore_errors=True)
  os.makedirs(folder)
  t0 = time.perf_counter()
  rng = np.random.default_rng([seed, 0xFEA7])
  num_train = max(1, round(n * PRODUCTS_TRAIN_FRACTION))
  tmp = path + ".tmp"
  with GraphBinWriter(tmp) as w:
    w.add_meta({"format": "graphbin", "name": "random_products_like", "layout": "homogeneous", "task": "node",
                "num_nodes": {"": n}, "node_types": [""], "relations": [], "add_inverse_edges": False,
                "csc": False, "splits": ["split/random"]})
    w.add("indptr", indptr)
    w.add("indices", indices)
    with w.stream("node/feat", "<f4", (n, feat_dim)) as s:
      for start in range(0, n, FEATURE_CHUNK_ROWS):
        s.write(rng.standard_normal((min(FEATURE_CHUNK_ROWS, n - start), feat_dim), dtype=np.float32))
    w.add("node/label", rng.integers(0, NUM_CLASSES, (n, 1), dtype=np.int64))
    w.add("split/random/train", np.sort(rng.choice(n, num_train, replace=False)).astype(np.int64))
  os.replace(tmp, path)
  with open(done, "w") as f:
    f.write(f"{os.path.getsize(path)}\n")
  print(f"wrote {path} ({os.path.getsize(path) / 1e9:.2f} GB, {time.perf_counter() - t0:.1f}s)", flush=True)
  return path


def _index(sampler: NeighborSampler, k: int) -> tuple[int, int]:
  """Batch k of the run as (index, epoch): wraps into later epochs on a small graph."""
  return k % len(sampler), k // len(sampler)


def sampled_edges(batch: dict[str, np.ndarray]) -> int:
  return sum(int(batch[f"edge_mask_{h}"].sum()) for h in range(len(FANOUTS)))


def time_batches(variant: str, sampler: NeighborSampler, count: int) -> SampleResult:
  """`sampler.batch` in this thread: warm-up batches, then `count` timed ones."""
  for k in range(WARMUP_BATCHES):
    sampler.batch(*_index(sampler, k))
  edges, elapsed = 0, 0.0
  for k in range(WARMUP_BATCHES, WARMUP_BATCHES + count):
    t0 = time.perf_counter()
    b = sampler.batch(*_index(sampler, k))
    elapsed += time.perf_counter() - t0
    edges += sampled_edges(b)  # untimed
    del b
  return SampleResult(variant, elapsed, count, edges)


def time_grain(variant: str, sampler: NeighborSampler, count: int) -> SampleResult:
  """`grain_dataset(num_threads=GRAIN_THREADS)`: warm-up + `count` batches, timed from the iterator's start."""
  total = WARMUP_BATCHES + count
  epochs = -(-total // len(sampler))
  edges = 0
  t0 = time.perf_counter()
  it = iter(grain_dataset(sampler, num_epochs=epochs, num_threads=GRAIN_THREADS))
  for _ in range(total):
    edges += sampled_edges(next(it))
  elapsed = time.perf_counter() - t0
  del it
  return SampleResult(variant, elapsed, total, edges)


def check_batch(graph: Graph, sampler: NeighborSampler, max_edges: int = 2000) -> list[tuple[str, bool]]:
  """On batch 0: shapes as the budgets say, sampled edges exist in the CSR (a subset), features match."""
  b = sampler.batch(0)
  bud = sampler.budgets
  shapes_ok = (b["node_ids"].shape == (bud.nodes,) and b["x"].shape == (bud.nodes, graph.node_features.shape[1])
               and all(b[f"edge_index_{h}"].shape == (2, bud.edges[h]) for h in range(len(FANOUTS))))
  rng = np.random.default_rng(0)
  edges_ok = True
  for h in range(len(FANOUTS)):
    ei = b[f"edge_index_{h}"][:, b[f"edge_mask_{h}"]]
    for j in rng.choice(ei.shape[1], min(max_edges, ei.shape[1]), replace=False):
      nbr, node = b["node_ids"][ei[0, j]], b["node_ids"][ei[1, j]]
      edges_ok &= bool(nbr in graph.indices[graph.indptr[node]:graph.indptr[node + 1]])
  live = np.nonzero(b["node_mask"])[0]
  feats_ok = np.array_equal(b["x"][live], graph.node_features[b["node_ids"][live]])
  return [("batch 0: shapes match the budgets", shapes_ok),
          (f"batch 0: sampled edges exist in the graph ({max_edges} per hop checked)", edges_ok),
          ("batch 0: x == features of node_ids", feats_ok)]


def profile_batches(sampler: NeighborSampler, count: int, top: int = 15) -> str:
  """cProfile of `count` calls of `sampler.batch` (after the warm-up ones), top functions by tottime."""
  prof = cProfile.Profile()
  prof.enable()
  for k in range(WARMUP_BATCHES, WARMUP_BATCHES + count):
    sampler.batch(*_index(sampler, k))
  prof.disable()
  text = io.StringIO()
  pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
  return text.getvalue().strip("\n")


def peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB on Linux


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--work", default="bench_work", help="cache of the .graphbin (git-ignored)")
  ap.add_argument("--num_nodes", type=int, default=PRODUCTS_NODES)
  ap.add_argument("--num_edges", type=int, default=PRODUCTS_EDGES)
  ap.add_argument("--feat_dim", type=int, default=100)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--batches", type=int, default=20, help="timed sampler batches, after 2 warm-up ones")
  ap.add_argument("--repeats", type=int, default=1, help="CSR builds: best of this many")
  ap.add_argument("--profile", type=int, default=0, help="also print a cProfile of this many sampler batches")
  ap.add_argument("--json", default=None, help="also write the results here")
  a = ap.parse_args(argv)
  if a.num_nodes < 2 or a.num_nodes >= 2**31 or a.feat_dim < 1 or a.batches < 1 or a.repeats < 1 or a.profile < 0:
    ap.error("need 2 <= --num_nodes < 2**31, --feat_dim, --batches and --repeats >= 1, --profile >= 0")
  if not 1 <= a.num_edges <= a.num_nodes * a.num_nodes // 2:
    ap.error(f"--num_edges must be in [1, num_nodes**2 / 2], got {a.num_edges}")
  logging.basicConfig(level=logging.WARNING)
  for noisy in ("apache_beam", "absl", "grain"):
    logging.getLogger(noisy).setLevel(logging.ERROR)

  work = os.path.abspath(a.work)
  os.makedirs(work, exist_ok=True)
  n, e = a.num_nodes, a.num_edges
  t0 = time.perf_counter()
  src, dst = random_edges(n, e, a.seed)
  ones = np.ones(e, np.float32)
  print(f"random graph: {n} nodes, {e} distinct directed edges (int64, random order, generated in "
        f"{time.perf_counter() - t0:.1f}s), seed={a.seed} repeats={a.repeats} cpus={os.cpu_count()}", flush=True)

  # 1. CSR build on the same in-memory edge arrays
  t_ref, ref = best_of(a.repeats, lambda: scipy.sparse.coo_matrix((ones, (src, dst)), shape=(n, n)).tocsr())
  t_mine, (indptr, indices, order) = best_of(a.repeats, lambda: csr_from_coo(src, dst, n))
  builds = [BuildResult("scipy coo_matrix(...).tocsr()", t_ref, e), BuildResult("csr_from_coo", t_mine, e)]
  del ones, src
  gc.collect()
  checks = check_csr(ref, indptr, indices, order, dst)
  del ref, order, dst
  gc.collect()

  # 2. the .graphbin
  path = ensure_graph(work, indptr, indices, a.feat_dim, a.seed)
  t0 = time.perf_counter()
  graph = Graph(path)
  t_open = time.perf_counter() - t0
  checks.append((".graphbin CSR == the CSR built", np.array_equal(graph.indptr, indptr)
                 and np.array_equal(graph.indices, indices)))
  del indptr, indices
  gc.collect()
  bare = Graph(path, verify=False)
  bare.node_features = None  # the same graph with its features hidden: no feature gather
  print(f"{path}: {os.path.getsize(path) / 1e9:.2f} GB, opened and verified in {t_open:.1f}s; "
        f"train split {len(graph.split('train'))} nodes", flush=True)

  # 3. sampling
  sampler = NeighborSampler(graph, fanouts=FANOUTS, batch_size=BATCH_SIZE, seed=0)
  checks += check_batch(graph, sampler)
  samples = [
      time_batches("sampler.batch, 1 thread", sampler, a.batches),
      time_batches("sampler.batch, 1 thread, no features", NeighborSampler(bare, FANOUTS, BATCH_SIZE, seed=0),
                   a.batches),
      time_grain(f"grain_dataset, {GRAIN_THREADS} threads (incl. start)", sampler, a.batches),
  ]
  profile = profile_batches(sampler, a.profile) if a.profile else ""

  base = builds[0].seconds
  print()
  print(f"{'CSR build':<42} {'seconds':>8} {'M edges/s':>10} {'ratio':>6}")
  for r in builds:
    print(f"{r.variant:<42} {r.seconds:8.2f} {r.edges_per_s / 1e6:10.1f} {r.seconds / base:6.2f}")
  print()
  print(f"sampling: fanouts {list(FANOUTS)}, batch_size {BATCH_SIZE}, budgets {sampler.budgets.edges} edges "
        f"and {sampler.budgets.nodes} nodes per batch")
  print(f"{'variant':<42} {'batches':>7} {'ms/batch':>9} {'batches/s':>9} {'M edges/s':>10}")
  for r in samples:
    print(f"{r.variant:<42} {r.batches:7d} {r.ms_per_batch:9.1f} {r.batches_per_s:9.2f} {r.edges_per_s / 1e6:10.2f}")
  full, bare_r = samples[0], samples[1]
  gather = max(full.ms_per_batch - bare_r.ms_per_batch, 0.0)
  print(f"time split per batch: sampling and relabelling {bare_r.ms_per_batch:.1f} ms, "
        f"feature gather ~{gather:.1f} ms ({100 * gather / full.ms_per_batch:.0f}%, by difference)")
  print()
  for text, ok in checks:
    print(f"{'ok  ' if ok else 'FAIL'}  {text}")
  ratio = builds[1].seconds / base
  targets = [("CSR build at least as fast as scipy", f"ratio {ratio:.2f}", ratio <= 1.0),
             (f"sampling >= {SAMPLING_TARGET / 1e6:.0f} M sampled edges/s in one process",
              f"{full.edges_per_s / 1e6:.2f} M/s", full.edges_per_s >= SAMPLING_TARGET)]
  print()
  for text, got, ok in targets:
    print(f"{'PASS' if ok else 'MISS'}  {text} ({got})")
  print(f"info  without the feature gather: {bare_r.edges_per_s / 1e6:.2f} M sampled edges/s; "
        f"grain, {GRAIN_THREADS} threads: {samples[2].edges_per_s / 1e6:.2f} M/s")
  print(f"info  PyG NeighborLoader on ogbn-products: ~{PYG_PUBLISHED / 1e6:.2f} M sampled edges/s "
        "(published figure, not measured here)")
  print(f"info  peak RSS {peak_rss_gb():.1f} GB (mapped .graphbin pages included)")
  if profile:
    print()
    print(f"cProfile of {a.profile} sampler.batch calls, top 15 by tottime:")
    print(profile)

  if a.json:
    report = {
        "num_nodes": n, "num_edges": e, "feat_dim": a.feat_dim, "seed": a.seed, "repeats": a.repeats,
        "cpus": os.cpu_count(), "fanouts": list(FANOUTS), "batch_size": BATCH_SIZE,
        "csr_build": [{"variant": r.variant, "seconds": r.seconds, "edges_per_s": r.edges_per_s,
                       "ratio": r.seconds / base} for r in builds],
        "sampling": [{"variant": r.variant, "seconds": r.seconds, "batches": r.batches, "sampled_edges": r.edges,
                      "edges_per_s": r.edges_per_s, "batches_per_s": r.batches_per_s} for r in samples],
        "feature_gather_ms_per_batch": gather, "peak_rss_gb": peak_rss_gb(),
        "checks": [{"check": t, "pass": ok} for t, ok in checks],
        "targets": [{"check": t, "value": got, "pass": ok} for t, got, ok in targets],
    }
    with open(a.json, "w") as f:
      json.dump(report, f, indent=2)
  return 0 if all(ok for _, ok in checks) else 1  # a wrong result is an error, a slow one is not


if __name__ == "__main__":
  sys.exit(main())
