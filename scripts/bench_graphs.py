"""Benchmarks the graph toolkit: CSR build, homogeneous and heterogeneous sampling, .graphbin download.

    python scripts/bench_graphs.py [--work=bench_work] [--parts=csr,homo,hetero,download]
        [--num_nodes=2449029] [--num_edges=61859140] [--feat_dim=100] [--seed=0]
        [--batches=10] [--rounds=3] [--repeats=1] [--mag_scale=1.0] [--hetero_batches=3]
        [--download_mb=256] [--download_streams=8] [--dgl_python=/tmp/dglenv/bin/python]
        [--profile=0] [--json=results.json]

Parts, in order (each a ratio within this one run; the machine is shared and swings between runs):
 1. csr: generates in memory (untimed, the same for a given seed) `--num_edges` distinct directed
    edges between uniform random nodes, in random order; times scipy's `coo_matrix(...).tocsr()`
    (the baseline) against `pipelines.ogb_graphs.csr.csr_from_coo` and checks they agree; writes
    (once, cached under --work) an ogbn-products-sized .graphbin with that CSR, float32 features
    [N, feat_dim], labels and a train split of ~8 % of the nodes.
 2. homo: fanouts [15, 10, 5], batch 1024, on that graph. Variants, alternated in every round (the
    order rotated), `--batches` batches each, median over `--rounds`: a bare numpy fixed-fanout loop
    without relabelling (the baseline), the compiled sampler without the host gather on 1 and 2
    threads, with the host gather (float32 and bfloat16) on 2 threads, and DGL's `sample_blocks`
    (with and without `index_select`) through scripts/bench_dgl.py in a side environment when
    `--dgl_python` is given (DGL is not a dependency of the toolkit).
 3. hetero: a MAG-shaped graph (ogbn-mag's counts times --mag_scale) written in ogb's raw layout by
    scripts/make_sample_ogb.py and converted with `--add_reverse_relations=true` (once, cached);
    `HeteroNeighborSampler` with [15, 10, 5] for every relation and 1024 paper seeds on 1 and 2
    threads without the gather and on 2 threads with it.
 4. download: a .graphbin from the GCS emulator, parallel ranged reads vs one stream
    (scripts/bench_graph_download.py).
 5. convert (only when named): the whole `ogb_graphs` conversion of an ogbn-papers100M-shaped CSV
    folder (papers100M x --convert_scale) against pandas + scipy + GraphBinWriter in one process,
    alternated rounds, medians; each step's peak RSS alone (scripts/bench_convert_graph.py).
Sampled edges are the edges a batch keeps (the sum of its edge masks; the numpy loop counts the
edges it draws). Checks: sampled edges exist in the graph, features match, batches are the same on
1 and 2 threads. Prints tables and the targets; exits 0 whether they are met or not (this is a
report), non-zero on errors and failed checks.
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
import threading
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

import numpy as np  # noqa: E402
import scipy.sparse  # noqa: E402

from formats.graphbin import GraphBinWriter  # noqa: E402
from loaders.graph import Graph, HeteroNeighborSampler, NeighborSampler, load  # noqa: E402
from pipelines.ogb_graphs.csr import csr_from_coo  # noqa: E402

PRODUCTS_NODES = 2_449_029
PRODUCTS_EDGES = 61_859_140
PRODUCTS_TRAIN_FRACTION = 196_615 / PRODUCTS_NODES  # ogbn-products' sales_ranking train split
NUM_CLASSES = 47
FANOUTS = (15, 10, 5)
BATCH_SIZE = 1024
WARMUP_BATCHES = 2
FEATURE_CHUNK_ROWS = 1 << 18


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


Sampler = NeighborSampler | HeteroNeighborSampler


def sampled_edges(batch: dict[str, np.ndarray]) -> int:
  """The edges a batch keeps: the sum of its edge masks (homogeneous `edge_mask_<h>`, heterogeneous `edge_mask/...`)."""
  return sum(int(v.sum()) for k, v in batch.items() if k.startswith("edge_mask"))


def time_sampler(variant: str, sampler: Sampler, count: int, threads: int, start: int) -> SampleResult:
  """`count` batches from `start` on, split over `threads` threads calling `sampler.batch` (after warm-up)."""
  n = len(sampler)
  for k in range(WARMUP_BATCHES):  # compiles the kernel, fills the buffer pool, per-thread tables follow
    sampler.batch(k % n, k // n)
  edges = [0] * threads

  def work(t: int) -> None:
    for k in range(start + t, start + count, threads):
      b = sampler.batch(k % n, k // n)
      edges[t] += sampled_edges(b)
      del b

  gc.collect()
  t0 = time.perf_counter()
  if threads == 1:
    work(0)
  else:
    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
      th.start()
    for th in pool:
      th.join()
  return SampleResult(variant, time.perf_counter() - t0, count, sum(edges))


def numpy_fixed_fanout(indptr: np.ndarray, indices: np.ndarray, seeds: np.ndarray, fanouts: Sequence[int],
                       rng: np.random.Generator) -> int:
  """The bare baseline: fixed-fanout uniform draws per hop, vectorised numpy, no relabelling, no padding.

  Each hop's frontier is every node drawn at the previous hop (duplicates included). Returns the edges
  drawn (frontier nodes without neighbours draw none).
  """
  frontier, edges = seeds, 0
  for k in fanouts:
    start = indptr[frontier]
    deg = indptr[frontier + 1] - start
    pos = start[:, None] + (rng.random((len(frontier), k), dtype=np.float32) * deg[:, None]).astype(np.int64)
    has = np.repeat(deg > 0, k)
    frontier = indices[np.minimum(pos.reshape(-1), len(indices) - 1)][has]
    edges += len(frontier)
  return edges


def time_numpy_loop(variant: str, sampler: NeighborSampler, count: int, start: int) -> SampleResult:
  """The numpy baseline over the sampler's own (in-memory) CSR and seed batches, in this thread."""
  indptr, indices = sampler._indptr, sampler._indices
  seeds = sampler.shard_seeds(0)
  n = len(sampler)

  def batch_seeds(k: int) -> np.ndarray:
    i = k % n
    return seeds[i * BATCH_SIZE:(i + 1) * BATCH_SIZE]

  for k in range(WARMUP_BATCHES):
    numpy_fixed_fanout(indptr, indices, batch_seeds(k), FANOUTS, np.random.default_rng(k))
  edges = 0
  gc.collect()
  t0 = time.perf_counter()
  for k in range(start, start + count):
    edges += numpy_fixed_fanout(indptr, indices, batch_seeds(k), FANOUTS, np.random.default_rng(k))
  return SampleResult(variant, time.perf_counter() - t0, count, edges)


def alternate(variants: dict[str, Callable[[int], SampleResult]], rounds: int, count: int) -> dict[str, list]:
  """Runs every variant once per round, in turn (the order rotated each round): {variant: [results]}.

  Each call gets a different `start` batch, so rounds do not replay the same batches.
  """
  names = list(variants)
  out: dict[str, list] = {v: [] for v in names}
  for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for v in order:
      out[v].append(variants[v](WARMUP_BATCHES + r * count))
      print(f"  round {r + 1}: {v:<44} {out[v][-1].edges_per_s / 1e6:8.2f} M edges/s", flush=True)
  return out


def median_rate(results: list) -> float:
  return float(np.median([r.edges_per_s for r in results]))


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


def check_hetero_batch(graph: Graph, sampler: HeteroNeighborSampler, max_edges: int = 500) -> list[tuple[str, bool]]:
  """On batch 0 of the heterogeneous sampler: sampled edges exist in their relation (a subset per relation-hop)."""
  b = sampler.batch(0)
  rng = np.random.default_rng(0)
  ok = True
  for key in [k for k in b if k.startswith("edge_index/")]:
    _, r, hop = key.split("/")
    head, _, tail = r.split("___")
    indptr, indices = graph.relation(r)
    ei = b[key][:, b[f"edge_mask/{r}/{hop}"]]
    for j in rng.choice(ei.shape[1], min(max_edges, ei.shape[1]), replace=False):
      u, v = b[f"node_ids/{head}"][ei[1, j]], b[f"node_ids/{tail}"][ei[0, j]]
      ok &= bool(v in indices[indptr[u]:indptr[u + 1]])
  return [(f"MAG batch 0: sampled edges exist in their relations ({max_edges} per relation-hop checked)", ok)]


def thread_independence(sampler: Sampler, batches: int = 4) -> list[tuple[str, bool]]:
  """Batches sampled alone and by two threads at once, in reverse order, are identical."""
  alone = [sampler.batch(i) for i in range(batches)]
  got: dict[int, dict] = {}

  def work(ids: list[int]) -> None:
    for i in ids:
      got[i] = sampler.batch(i)

  pool = [threading.Thread(target=work, args=(list(range(batches))[::-1][t::2],)) for t in range(2)]
  for th in pool:
    th.start()
  for th in pool:
    th.join()
  same = all(sorted(alone[i]) == sorted(got[i]) and all(np.array_equal(alone[i][k], got[i][k]) for k in alone[i])
             for i in range(batches))
  return [(f"{type(sampler).__name__}: batches identical on 1 and 2 threads", same)]


def peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB on Linux


def ensure_mag(work: str, scale: float, seed: int) -> str:
  """The cached MAG-shaped output: ogb's raw layout from make_sample_ogb.write_mag, converted by
  pipelines.ogb_graphs (DirectRunner) with --add_reverse_relations=true (done on first use)."""
  import make_sample_ogb
  from pipelines import ogb_graphs

  out = os.path.join(work, f"mag_{scale:g}_seed{seed}")
  done = out + ".done"
  if os.path.exists(done):
    return out
  raw = out + "_raw"
  shutil.rmtree(raw, ignore_errors=True)
  shutil.rmtree(out, ignore_errors=True)
  t0 = time.perf_counter()
  truth = make_sample_ogb.write_mag(raw, seed, scale)
  t1 = time.perf_counter()
  ogb_graphs.run([f"--input={truth.folder}", f"--output={out}", "--name=ogbn-mag", "--add_reverse_relations=true"])
  t2 = time.perf_counter()
  shutil.rmtree(raw, ignore_errors=True)
  with open(done, "w") as f:
    f.write(f"generated {t1 - t0:.1f}s converted {t2 - t1:.1f}s\n")
  print(f"MAG-shaped data (scale {scale:g}): raw layout written in {t1 - t0:.0f}s, converted with reverse "
        f"relations in {t2 - t1:.0f}s -> {out}", flush=True)
  return out


def dgl_variant(python: str, path: str, count: int, gather: bool) -> Callable[[int], SampleResult]:
  """A variant that runs scripts/bench_dgl.py in DGL's side environment (one process per round)."""
  import subprocess
  import tempfile

  def run(start: int) -> SampleResult:
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "dgl.json")
      cmd = [python, os.path.join(REPO, "scripts", "bench_dgl.py"), path, "--fanouts=" + ",".join(map(str, FANOUTS)),
             f"--batch_size={BATCH_SIZE}", f"--batches={count}", f"--warmup={WARMUP_BATCHES}", f"--json={out}",
             f"--seed={start}"] + (["--gather"] if gather else [])
      subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
      with open(out) as f:
        got = json.load(f)
    return SampleResult("dgl", count / got["batches_per_s"], count, round(got["edges_per_s"] * count / got["batches_per_s"]))

  return run


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--work", default="bench_work", help="cache of the generated graphs (git-ignored)")
  ap.add_argument("--parts", default="csr,homo,hetero,download",
                  help="which benchmarks, comma-separated (also: convert)")
  ap.add_argument("--convert_scale", type=float, default=0.01,
                  help="convert: papers100M's counts times this (scripts/bench_convert_graph.py)")
  ap.add_argument("--num_nodes", type=int, default=PRODUCTS_NODES)
  ap.add_argument("--num_edges", type=int, default=PRODUCTS_EDGES)
  ap.add_argument("--feat_dim", type=int, default=100)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--batches", type=int, default=10, help="homogeneous batches per variant and round")
  ap.add_argument("--rounds", type=int, default=3, help="rounds; the variants alternate within each")
  ap.add_argument("--repeats", type=int, default=1, help="CSR builds: best of this many")
  ap.add_argument("--mag_scale", type=float, default=1.0, help="MAG-shaped graph: ogbn-mag's counts times this")
  ap.add_argument("--hetero_batches", type=int, default=3, help="heterogeneous batches per variant and round")
  ap.add_argument("--download_mb", type=int, default=256, help="size of the .graphbin downloaded from the emulator")
  ap.add_argument("--download_streams", type=int, default=8)
  ap.add_argument("--download_cap_mb_s", type=float, default=100,
                  help="also download with the benchmark bucket capping each connection at this rate (0: no)")
  ap.add_argument("--dgl_python", default=None, help="python of a side environment with DGL (scripts/bench_dgl.py)")
  ap.add_argument("--profile", type=int, default=0, help="also print a cProfile of this many sampler batches")
  ap.add_argument("--json", default=None, help="also write the results here")
  a = ap.parse_args(argv)
  parts = set(a.parts.split(","))
  if parts - {"csr", "homo", "hetero", "download", "convert"}:
    ap.error(f"--parts: unknown {sorted(parts - {'csr', 'homo', 'hetero', 'download', 'convert'})}")
  if a.num_nodes < 2 or a.num_nodes >= 2**31 or a.feat_dim < 1 or a.batches < 1 or a.repeats < 1 or a.profile < 0:
    ap.error("need 2 <= --num_nodes < 2**31, --feat_dim, --batches and --repeats >= 1, --profile >= 0")
  if a.rounds < 1 or a.hetero_batches < 1 or not 0 < a.mag_scale <= 1:
    ap.error("need --rounds >= 1, --hetero_batches >= 1 and 0 < --mag_scale <= 1")
  if not 1 <= a.num_edges <= a.num_nodes * a.num_nodes // 2:
    ap.error(f"--num_edges must be in [1, num_nodes**2 / 2], got {a.num_edges}")
  logging.basicConfig(level=logging.WARNING)
  for noisy in ("apache_beam", "absl", "grain"):
    logging.getLogger(noisy).setLevel(logging.ERROR)

  work = os.path.abspath(a.work)
  os.makedirs(work, exist_ok=True)
  report: dict[str, Any] = {"cpus": os.cpu_count(), "rounds": a.rounds, "fanouts": list(FANOUTS),
                            "batch_size": BATCH_SIZE}
  checks: list[tuple[str, bool]] = []
  targets: list[tuple[str, str, bool]] = []
  lines: list[str] = []
  n, e = a.num_nodes, a.num_edges
  path = os.path.join(work, f"graph_{n}n_{e}e_{a.feat_dim}f_seed{a.seed}", "graph.graphbin")

  # 1. CSR build on the same in-memory edge arrays (and the products-sized .graphbin, once)
  if "csr" in parts or ("homo" in parts and not os.path.exists(os.path.dirname(path) + ".done")):
    t0 = time.perf_counter()
    src, dst = random_edges(n, e, a.seed)
    print(f"random graph: {n} nodes, {e} distinct directed edges (generated in {time.perf_counter() - t0:.1f}s), "
          f"seed={a.seed} cpus={os.cpu_count()}", flush=True)
    ones = np.ones(e, np.float32)
    t_ref, ref = best_of(a.repeats, lambda: scipy.sparse.coo_matrix((ones, (src, dst)), shape=(n, n)).tocsr())
    t_mine, (indptr, indices, order) = best_of(a.repeats, lambda: csr_from_coo(src, dst, n))
    builds = [BuildResult("scipy coo_matrix(...).tocsr()", t_ref, e), BuildResult("csr_from_coo", t_mine, e)]
    del ones, src
    gc.collect()
    checks += check_csr(ref, indptr, indices, order, dst)
    del ref, order, dst
    gc.collect()
    path = ensure_graph(work, indptr, indices, a.feat_dim, a.seed)
    del indptr, indices
    gc.collect()
    lines.append(f"{'CSR build':<44} {'seconds':>8} {'M edges/s':>10} {'ratio':>6}")
    lines += [f"{r.variant:<44} {r.seconds:8.2f} {r.edges_per_s / 1e6:10.1f} {r.seconds / t_ref:6.2f}" for r in builds]
    report["csr_build"] = [{"variant": r.variant, "seconds": r.seconds, "ratio": r.seconds / t_ref} for r in builds]
    targets.append(("CSR build at least as fast as scipy", f"ratio {t_mine / t_ref:.2f}", t_mine <= t_ref))

  # 2. homogeneous sampling, products-sized
  if "homo" in parts:
    graph = Graph(path)
    lean = NeighborSampler(graph, FANOUTS, BATCH_SIZE, seed=0, gather_features=False)
    full = NeighborSampler(graph, FANOUTS, BATCH_SIZE, seed=0)
    bf16 = NeighborSampler(graph, FANOUTS, BATCH_SIZE, seed=0, feature_dtype="bfloat16")
    checks += check_batch(graph, full) + thread_independence(lean)
    count = a.batches
    variants = {
        "numpy fixed-fanout loop (baseline), 1 thread": lambda st: time_numpy_loop("numpy", lean, count, st),
        "kernel, no gather, 1 thread": lambda st: time_sampler("k1", lean, count, 1, st),
        "kernel, no gather, 2 threads": lambda st: time_sampler("k2", lean, count, 2, st),
        "kernel + host gather f32, 2 threads": lambda st: time_sampler("g2", full, count, 2, st),
        "kernel + host gather bf16, 2 threads": lambda st: time_sampler("b2", bf16, count, 2, st),
    }
    if a.dgl_python:
      variants["DGL sample_blocks (side env), 1 process"] = dgl_variant(a.dgl_python, path, count, False)
      variants["DGL sample_blocks + index_select"] = dgl_variant(a.dgl_python, path, count, True)
    print(f"homogeneous: {path}, fanouts {list(FANOUTS)}, batch {BATCH_SIZE}, {count} batches x {a.rounds} rounds",
          flush=True)
    res = alternate(variants, a.rounds, count)
    med = {v: median_rate(r) for v, r in res.items()}
    base = med["numpy fixed-fanout loop (baseline), 1 thread"]
    lines.append("")
    lines.append(f"homogeneous sampling (ogbn-products-sized: {graph.num_nodes} nodes, {graph.num_edges} edges, "
                 f"{a.feat_dim} features), median of {a.rounds} alternated rounds")
    lines.append(f"{'variant':<44} {'M edges/s':>10} {'vs numpy':>9}  rounds")
    lines += [f"{v:<44} {m / 1e6:10.2f} {m / base:9.2f}  " + " ".join(f"{r.edges_per_s / 1e6:.1f}" for r in res[v])
              for v, m in med.items()]
    report["homogeneous"] = {v: {"median_edges_per_s": m, "ratio_to_numpy": m / base,
                                 "rounds": [r.edges_per_s for r in res[v]]} for v, m in med.items()}
    k1, k2 = med["kernel, no gather, 1 thread"], med["kernel, no gather, 2 threads"]
    g2, b2 = med["kernel + host gather f32, 2 threads"], med["kernel + host gather bf16, 2 threads"]
    targets += [("homogeneous, no gather, 1 thread >= 30 M edges/s", f"{k1 / 1e6:.1f} M/s", k1 >= 30e6),
                ("homogeneous, no gather, 2 threads >= 50 M edges/s", f"{k2 / 1e6:.1f} M/s", k2 >= 50e6),
                ("homogeneous, host gather (f32), 2 threads >= 12 M edges/s", f"{g2 / 1e6:.1f} M/s", g2 >= 12e6),
                ("homogeneous, host gather (bf16), 2 threads >= 12 M edges/s", f"{b2 / 1e6:.1f} M/s", b2 >= 12e6),
                ("no gather, 1 thread >= 0.8x the numpy loop", f"{k1 / base:.2f}x", k1 >= 0.8 * base)]
    if a.profile:
      prof = cProfile.Profile()
      prof.enable()
      for k in range(a.profile):
        full.batch(k % len(full))
      prof.disable()
      text = io.StringIO()
      pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
      lines += ["", f"cProfile of {a.profile} batches with the host gather:", text.getvalue().strip()]
    del graph, lean, full, bf16
    gc.collect()

  # 3. heterogeneous sampling, MAG-sized
  if "hetero" in parts:
    mag = load(ensure_mag(work, a.mag_scale, a.seed))
    lean = HeteroNeighborSampler(mag, FANOUTS, BATCH_SIZE, seed=0, gather_features=False)
    full = HeteroNeighborSampler(mag, FANOUTS, BATCH_SIZE, seed=0)
    checks += check_hetero_batch(mag, lean) + thread_independence(lean, batches=2)
    count = a.hetero_batches
    variants = {
        "hetero kernel, no gather, 1 thread": lambda st: time_sampler("h1", lean, count, 1, st),
        "hetero kernel, no gather, 2 threads": lambda st: time_sampler("h2", lean, count, 2, st),
        "hetero kernel + host gather f32, 2 threads": lambda st: time_sampler("hg2", full, count, 2, st),
    }
    print(f"heterogeneous: MAG-shaped x{a.mag_scale:g}, {count} batches x {a.rounds} rounds", flush=True)
    res = alternate(variants, a.rounds, count)
    med = {v: median_rate(r) for v, r in res.items()}
    nodes = mag.meta["num_nodes"]
    edges = sum(len(mag.relation(r)[1]) for r in lean.relations)
    lines.append("")
    lines.append(f"heterogeneous sampling (MAG-shaped x{a.mag_scale:g}: {nodes}, {edges} edges with reverse "
                 f"relations; fanouts {list(FANOUTS)} per relation, batch {BATCH_SIZE} paper seeds), median of "
                 f"{a.rounds} alternated rounds")
    lines.append(f"{'variant':<44} {'M edges/s':>10}  rounds")
    lines += [f"{v:<44} {m / 1e6:10.2f}  " + " ".join(f"{r.edges_per_s / 1e6:.1f}" for r in res[v])
              for v, m in med.items()]
    report["heterogeneous"] = {v: {"median_edges_per_s": m, "rounds": [r.edges_per_s for r in res[v]]}
                               for v, m in med.items()}
    h1 = med["hetero kernel, no gather, 1 thread"]
    targets.append(("heterogeneous (MAG), no gather, 1 thread >= 25 M edges/s (the seed's headline: 12.4 M/s)",
                    f"{h1 / 1e6:.1f} M/s", h1 >= 25e6))
    del mag, lean, full
    gc.collect()

  # 4. .graphbin download from the GCS emulator
  if "download" in parts:
    import bench_graph_download

    runs = [("no cap per connection", bench_graph_download.run(
        a.download_mb << 20, a.download_streams, a.rounds, os.path.join(work, "download"), 16 << 20, None))]
    if a.download_cap_mb_s:
      runs.append((f"each connection capped at {a.download_cap_mb_s:g} MB/s",
                   bench_graph_download.run(a.download_mb << 20, a.download_streams, a.rounds,
                                            os.path.join(work, "download"), 16 << 20, a.download_cap_mb_s)))
    report["download"] = {name: got for name, got in runs}
    lines.append("")
    lines.append(f"download of a {a.download_mb} MB .graphbin from the benchmark bucket (30 ms first byte; 16 MiB "
                 f"ranges), median of {a.rounds} rounds; old = one stream, then SHA-256 and section CRCs in passes "
                 "of their own")
    for name, got in runs:
      lines.append(f"  {name}: " + ", ".join(f"{k} {got['median_s'][k]:.2f} s ({got['median_mb_s'][k]:.0f} MB/s)"
                                             for k in got["median_s"])
                   + f"; {a.download_streams} streams vs 1 stream {got['speedup_vs_one_stream']:.2f}x, "
                     f"vs old {got['speedup_vs_old']:.2f}x")
      targets.append((f"download, {name}: {a.download_streams} streams faster than one",
                      f"{got['speedup_vs_one_stream']:.2f}x", got["speedup_vs_one_stream"] > 1))

  # 5. the whole ogb_graphs conversion against pandas + scipy + GraphBinWriter (scripts/bench_convert_graph.py)
  if "convert" in parts:
    import bench_convert_graph

    got = bench_convert_graph.main([f"--work={work}", f"--scale={a.convert_scale}", f"--rounds={a.rounds}",
                                    "--workers=0,2", "--steps"])
    report["convert"] = got
    lines.append("")
    lines.append(f"ogb_graphs conversion of a papers100M-shaped CSV folder x{a.convert_scale:g}, median of "
                 f"{a.rounds} alternated rounds (ratio to pandas + scipy + GraphBinWriter in one process)")
    lines += [f"  {v:<44} {r['median_s']:7.1f} s {r['ratio']:6.2f}x  " + " ".join(f"{x:.1f}" for x in r["seconds"])
              for v, r in got["variants"].items()]
    ratio = got["variants"]["ogb_graphs, DirectRunner in process"]["ratio"]
    targets.append(("whole ogb_graphs conversion <= 2x the single-process path", f"{ratio:.2f}x", ratio <= 2))

  print()
  print("\n".join(lines))
  print()
  for text, ok in checks:
    print(f"{'ok  ' if ok else 'FAIL'}  {text}")
  print()
  for text, got, ok in targets:
    print(f"{'PASS' if ok else 'MISS'}  {text} ({got})")
  print(f"info  peak RSS {peak_rss_gb():.1f} GB (mapped .graphbin pages included)")
  if a.json:
    report["checks"] = [{"check": t, "pass": ok} for t, ok in checks]
    report["targets"] = [{"check": t, "value": got, "pass": ok} for t, got, ok in targets]
    with open(a.json, "w") as f:
      json.dump(report, f, indent=2)
  return 0 if all(ok for _, ok in checks) else 1  # a wrong result is an error, a slow one is not


if __name__ == "__main__":
  sys.exit(main())
