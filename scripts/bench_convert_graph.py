"""The `ogb_graphs` conversion against the best single-process path, and its steps' peak memory.

    python scripts/bench_convert_graph.py [--work=bench_work] [--scale=0.01] [--rounds=3] [--workers=0,2]
        [--layout=csv|npz] [--steps] [--json=out.json]

Used by scripts/bench_graphs.py (`--parts=convert`); runnable alone. On an ogbn-papers100M-shaped
folder in OGB's raw CSV layout (scripts/make_sample_ogb.py `write_papers_csv`: papers100M's counts
times --scale, 128 float features; written once under --work):

- **plain**: one process, pandas reading the same CSVs (edges, features, labels, years, splits),
  scipy's COO → CSR with neighbours in file order (the edge's position as the column, as
  `csr_from_coo` does), the arrays written with `GraphBinWriter`: the best single-process path.
- **ogb_graphs**: `pipelines.ogb_graphs.run` on the DirectRunner in this process, and with
  `--direct_running_mode=multi_processing --direct_num_workers=W` for each W in --workers (W > 0).

With --layout=npz the input is papers100M's own binary layout instead (`raw/data.npz`, stored as
np.savez writes it, so read in parallel ranges) and plain is np.load + scipy + GraphBinWriter.

Variants alternate within each of --rounds rounds (the order rotated); each ratio is the variant's
median over the median of plain. With --steps, each step of the conversion (reading the edge
file, one sort partition, the node features) is also run alone in a fresh process and its peak
RSS reported (VmHWM of that process), with a bare process's for reference. With --gcs, one more
run writes to gs:// on a local GCS emulator
in a child process: its time, peak RSS and the peak size of its TMPDIR (pieces stream to GCS).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import json
import multiprocessing
import os
import resource
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

import numpy as np  # noqa: E402


def ensure_papers(work: str, scale: float, seed: int = 0) -> str:
  """The cached papers100M-shaped raw CSV folder (written on first use)."""
  import make_sample_ogb

  base = os.path.join(work, f"papers_csv_{scale:g}_seed{seed}")
  folder = os.path.join(base, "ogbn_papers100M")
  if os.path.exists(base + ".done"):
    return folder
  shutil.rmtree(base, ignore_errors=True)
  t0 = time.perf_counter()
  make_sample_ogb.write_papers_csv(folder, seed, scale)
  with open(base + ".done", "w") as f:
    f.write(f"{time.perf_counter() - t0:.1f}s\n")
  return folder


def ensure_papers_npz(work: str, scale: float, seed: int = 0) -> str:
  """The cached papers100M-shaped binary folder (data.npz), stored uncompressed (np.savez) as the
  converter reads it in parallel ranges; OGB's node-label.npz and CSV splits beside it."""
  import make_sample_ogb

  base = os.path.join(work, f"papers_npz_{scale:g}_seed{seed}")
  folder = os.path.join(base, "ogbn_papers100M")
  if os.path.exists(base + ".done"):
    return folder
  shutil.rmtree(base, ignore_errors=True)
  make_sample_ogb.write_binary_node(folder, seed, max(10, round(make_sample_ogb.PAPERS_NUM_NODES * scale)),
                                    max(10, round(make_sample_ogb.PAPERS_NUM_EDGES * scale)),
                                    make_sample_ogb.PAPERS_FEAT_DIM)
  data = os.path.join(folder, "raw", "data.npz")
  with np.load(data) as z:
    arrays = {k: z[k] for k in z.files}
  np.savez(data, **arrays)
  open(base + ".done", "w").close()
  return folder


def _write_plain(folder: str, out: str, m, feat, label, year) -> None:
  """The plain paths' common end: the time splits read with pandas, then one GraphBinWriter file."""
  import pandas as pd

  from formats.graphbin import GraphBinWriter

  splits = {s: pd.read_csv(os.path.join(folder, "split", "time", f"{s}.csv.gz"), header=None).to_numpy()[:, 0]
            for s in ("test", "train", "valid")}
  os.makedirs(out, exist_ok=True)
  with GraphBinWriter(os.path.join(out, "plain.graphbin")) as w:
    w.add_meta({"name": "plain"})
    w.add("indptr", m.indptr.astype(np.int64))
    w.add("indices", m.data)
    w.add("node/feat", feat)
    w.add("node/label", label)
    w.add("node/year", year)
    for s, ids in splits.items():
      w.add(f"split/time/{s}", ids)


def plain_npz(folder: str, out: str) -> float:
  """np.load + scipy + GraphBinWriter, one process (the binary layout's plain path); returns seconds."""
  import scipy.sparse

  t0 = time.perf_counter()
  raw = os.path.join(folder, "raw")
  with np.load(os.path.join(raw, "data.npz")) as z:
    ei, n = z["edge_index"], int(z["num_nodes_list"].sum())
    e = ei.shape[1]
    m = scipy.sparse.coo_array((ei[1].astype(np.int32), (ei[0].astype(np.int32), np.arange(e, dtype=np.int32))),
                               shape=(n, e)).tocsr()
    del ei
    feat, year = z["node_feat"], z["node_year"]
  with np.load(os.path.join(raw, "node-label.npz")) as z:
    label = z["node_label"]
  _write_plain(folder, out, m, feat, label, year)
  return time.perf_counter() - t0


def plain(folder: str, out: str) -> float:
  """pandas + scipy + GraphBinWriter, one process; returns seconds."""
  import pandas as pd
  import scipy.sparse

  t0 = time.perf_counter()
  raw = os.path.join(folder, "raw")
  n = int(pd.read_csv(os.path.join(raw, "num-node-list.csv.gz"), header=None).iloc[0, 0])
  edges = pd.read_csv(os.path.join(raw, "edge.csv.gz"), header=None, dtype=np.int64).to_numpy()
  e = len(edges)
  m = scipy.sparse.coo_array((edges[:, 1].astype(np.int32), (edges[:, 0].astype(np.int32),
                              np.arange(e, dtype=np.int32))), shape=(n, e)).tocsr()
  del edges
  feat = pd.read_csv(os.path.join(raw, "node-feat.csv.gz"), header=None, dtype=np.float32).to_numpy()
  label = pd.read_csv(os.path.join(raw, "node-label.csv.gz"), header=None).to_numpy()
  year = pd.read_csv(os.path.join(raw, "node_year.csv.gz"), header=None).to_numpy()
  _write_plain(folder, out, m, feat, label, year)
  return time.perf_counter() - t0


def convert(folder: str, out: str, workers: int) -> float:
  """pipelines.ogb_graphs on the DirectRunner (in process, or `workers` processes); returns seconds."""
  from pipelines import ogb_graphs

  shutil.rmtree(out, ignore_errors=True)
  flags = [f"--input={folder}", f"--output={out}"]
  if workers:
    flags += ["--direct_running_mode=multi_processing", f"--direct_num_workers={workers}"]
  t0 = time.perf_counter()
  ogb_graphs.run(flags)
  return time.perf_counter() - t0


def peak_rss() -> int:
  """This process's peak RSS in bytes: VmHWM (ru_maxrss survives exec on Linux: a spawned child would
  report its parent's peak)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(fn_name: str, args: tuple, q) -> None:
  t0 = time.perf_counter()
  out = globals()[fn_name](*args)
  q.put((out, peak_rss(), time.perf_counter() - t0))


def in_child(fn_name: str, *args):
  """Runs `fn_name(*args)` in a fresh (spawned) process: (result, its peak RSS in bytes, seconds)."""
  ctx = multiprocessing.get_context("spawn")
  q = ctx.Queue()
  p = ctx.Process(target=_child, args=(fn_name, args, q))
  p.start()
  got = q.get()
  p.join()
  if p.exitcode:
    raise RuntimeError(f"{fn_name} failed ({p.exitcode})")
  return got


def _step_bare() -> None:
  from pipelines.ogb_graphs import assemble  # noqa: F401  the imports every worker has


def _plan(folder: str):
  from pipelines.ogb_graphs import plan_graph
  return plan_graph(folder, "ogbn-papers100M", "auto", 1 << 24)


def _step_read_edges(folder: str) -> int:
  """ReadEdges over the whole edge file, dropping the chunks (a reader's own memory)."""
  from pipelines.ogb_graphs.assemble import _ReadEdgesFn

  fn = _ReadEdgesFn(_plan(folder))
  fn.setup()
  return sum(len(c[1]) for src in fn._plan.edge_files for _, c in fn.process(src))


def _step_sort_partition(folder: str, parts_dir: str) -> list:
  """The largest partition's chunks (as the group gives them) sorted into its pieces."""
  from pipelines.ogb_graphs.assemble import _BuildPartFn, _ReadEdgesFn

  plan = _plan(folder)
  fn = _ReadEdgesFn(plan)
  fn.setup()
  by_part: dict = {}
  for src in plan.edge_files:
    for key, c in fn.process(src):
      by_part.setdefault(key, []).append(c)
  counts = {k: sum(len(c[1]) for c in v) for k, v in by_part.items()}
  biggest = max(counts, key=counts.get)
  keep = by_part.pop(biggest)
  by_part.clear()
  build = _BuildPartFn(plan, parts_dir)
  build.setup()
  return [biggest, counts[biggest], len(counts), list(build.process((biggest, keep), counts))]


def _step_node_feat(folder: str, parts_dir: str) -> list:
  from pipelines.ogb_graphs.assemble import _NodeArrayFn, node_units

  plan = _plan(folder)
  fn = _NodeArrayFn(plan, "float32", parts_dir)
  fn.setup()
  return [p for u in node_units(plan) if u.section == "node/feat" for p in fn.process(u)]




def gcs_run(folder: str, work: str) -> dict:
  """The conversion with its output on a local GCS emulator (gcp-storage-emulator, in memory), in a
  child process with its own TMPDIR: wall time, the child's peak RSS (VmHWM) and TMPDIR's peak size
  (polled every 0.5 s): pieces stream to GCS, so nothing should land on local disk."""
  import socket
  import subprocess
  import urllib.request

  exe = shutil.which("gcp-storage-emulator") or os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  emu = subprocess.Popen([exe, "start", "--host=127.0.0.1", f"--port={port}", "--default-bucket=bench", "--in-memory"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    host = f"http://127.0.0.1:{port}"
    for _ in range(150):
      try:
        urllib.request.urlopen(f"{host}/storage/v1/b/bench", timeout=1).read()
        break
      except Exception:
        time.sleep(0.2)
    tmp = os.path.join(work, "gcs_tmpdir")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    env = {**os.environ, "STORAGE_EMULATOR_HOST": host, "TMPDIR": tmp, "PYTHONPATH": REPO}
    code = ("import json, sys, time; t = time.perf_counter(); from pipelines import ogb_graphs; "
            "ogb_graphs.run(sys.argv[1:]); "
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]; "
            "print('RESULT', json.dumps({'seconds': time.perf_counter() - t, 'peak_rss_gb': int(hwm) * 1024 / 1e9}))")
    child = subprocess.Popen([sys.executable, "-c", code, f"--input={folder}", "--output=gs://bench/out"], env=env,
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak = 0
    while child.poll() is None:
      peak = max(peak, sum(os.path.getsize(os.path.join(d, f)) for d, _, fs_ in os.walk(tmp) for f in fs_))
      time.sleep(0.5)
    out = child.stdout.read()
    if child.returncode:
      raise RuntimeError(f"gs:// conversion failed ({child.returncode})")
    got = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT ")).split(" ", 1)[1])
    got["tmpdir_peak_bytes"] = peak
    return got
  finally:
    emu.terminate()
    emu.wait(timeout=30)


def run_steps(folder: str, work: str) -> dict:
  parts_dir = os.path.join(work, "steps_parts")
  shutil.rmtree(parts_dir, ignore_errors=True)
  report = {}
  _, rss, s = in_child("_step_bare")
  report["bare process (imports)"] = {"peak_rss_gb": rss / 1e9, "seconds": s}
  n, rss, s = in_child("_step_read_edges", folder)
  report["ReadEdges: the whole edge file, one reader"] = {"peak_rss_gb": rss / 1e9, "seconds": s, "edges": n}
  (key, edges, num_parts, pieces), rss, s = in_child("_step_sort_partition", folder, parts_dir)
  report[f"read + SortPartitions of the largest of {num_parts} partitions ({edges} edges)"] = {
      "peak_rss_gb": rss / 1e9, "seconds": s, "piece_bytes": sum(p.nbytes for p in pieces)}
  pieces, rss, s = in_child("_step_node_feat", folder, parts_dir)
  report["ReadNodeArrays: node-feat.csv.gz, one unit"] = {
      "peak_rss_gb": rss / 1e9, "seconds": s, "piece_bytes": sum(p.nbytes for p in pieces)}
  shutil.rmtree(parts_dir, ignore_errors=True)
  return report


def main(argv: Sequence[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--work", default="bench_work")
  ap.add_argument("--scale", type=float, default=0.01, help="papers100M's counts times this")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--workers", default="0", help="DirectRunner variants: 0 = in process, W = W worker processes")
  ap.add_argument("--layout", default="csv", choices=("csv", "npz"),
                  help="csv: OGB's raw CSV layout; npz: papers100M's data.npz (stored), plain = np.load + scipy")
  ap.add_argument("--steps", action="store_true", help="also each step alone in a fresh process: peak RSS")
  ap.add_argument("--gcs", action="store_true", help="also once with the output on a local GCS emulator")
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  import logging
  logging.basicConfig(level=logging.WARNING)
  for noisy in ("apache_beam", "absl"):
    logging.getLogger(noisy).setLevel(logging.ERROR)
  work = os.path.abspath(a.work)
  os.makedirs(work, exist_ok=True)
  folder = ensure_papers(work, a.scale) if a.layout == "csv" else ensure_papers_npz(work, a.scale)
  raw = os.path.join(folder, "raw")
  sizes = {f: os.path.getsize(os.path.join(raw, f)) for f in sorted(os.listdir(raw))}
  print(f"input: {folder} ({sum(sizes.values()) / 1e6:.0f} MB {a.layout})", flush=True)
  if a.layout == "csv":
    variants = {"plain (pandas + scipy + GraphBinWriter)": lambda: plain(folder, os.path.join(work, "conv_plain"))}
  else:
    variants = {"plain (np.load + scipy + GraphBinWriter)": lambda: plain_npz(folder, os.path.join(work, "conv_plain"))}
  for w in (int(x) for x in a.workers.split(",")):
    name = "ogb_graphs, DirectRunner in process" if w == 0 else f"ogb_graphs, DirectRunner {w} processes"
    variants[name] = (lambda w=w: convert(folder, os.path.join(work, f"conv_{w}"), w))
  names = list(variants)
  times: dict[str, list[float]] = {v: [] for v in names}
  for r in range(a.rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for v in order:
      times[v].append(variants[v]())
      print(f"  round {r + 1}: {v:<42} {times[v][-1]:7.1f} s", flush=True)
  base = float(np.median(times[names[0]]))
  report = {"input_bytes": sizes, "rounds": a.rounds,
            "variants": {v: {"seconds": t, "median_s": float(np.median(t)), "ratio": float(np.median(t)) / base}
                         for v, t in times.items()}}
  out = os.path.join(work, "conv_0")
  if os.path.isdir(out):
    from formats.outputs.output import load_manifest
    m = load_manifest(out)
    report["graphbin_bytes"] = m.files[0].num_bytes
  lines = [f"{'conversion (median of %d alternated rounds)' % a.rounds:<44} {'median s':>9} {'ratio':>6}  rounds"]
  lines += [f"{v:<44} {r['median_s']:9.1f} {r['ratio']:6.2f}  " + " ".join(f"{x:.1f}" for x in r["seconds"])
            for v, r in report["variants"].items()]
  if a.steps and a.layout == "csv":
    report["steps"] = run_steps(folder, work)
    lines.append("")
    lines.append("steps alone, each in a fresh process (peak RSS = VmHWM)")
    lines += [f"  {k:<70} {v['peak_rss_gb']:6.2f} GB {v['seconds']:7.1f} s" for k, v in report["steps"].items()]
  if a.gcs:
    report["gcs"] = got = gcs_run(folder, work)
    lines.append("")
    lines.append(f"output on gs:// (GCS emulator, in memory), one run in a child process: {got['seconds']:.1f} s, "
                 f"peak RSS {got['peak_rss_gb']:.2f} GB, TMPDIR peak {got['tmpdir_peak_bytes']} bytes")
  print("\n".join(lines), flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(report, f, indent=2)
  return report


if __name__ == "__main__":
  main()
