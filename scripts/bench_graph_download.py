"""Benchmarks fetching a gs:// .graphbin: the old single-stream path against parallel ranged reads.

    python scripts/bench_graph_download.py [--size_mb=256] [--streams=8] [--chunk_mb=32]
        [--rounds=3] [--work=bench_work] [--json=results.json] [--server=bucket|emulator]
        [--per_stream_mb_s=100] [--latency_ms=30]

Writes (once, cached under --work) a .graphbin of about --size_mb of random
float32 sections with formats.graphbin.GraphBinWriter and its manifest,
serves both as gs://, then times, --rounds times each in turn:
  old:       files.download (one stream), then its SHA-256 and every section's
             CRC in passes of their own: what loaders.graph.load did before;
  1 stream:  loaders.graph.load(..., streams=1) (checked as the bytes arrive);
  N streams: loaders.graph.load(..., streams=N).
Each timing starts from an empty cache and ends with a verified, mapped file.
Prints the medians and the ratios.

The objects are served by the benchmark bucket (scripts/bench_bucket.py, its
own process, sendfile), with `--latency_ms` first-byte latency and
`--per_stream_mb_s` per connection (default 100: GCS from a VM in its region,
where one stream is bounded by latency and TCP window long before the network
is, and parallel streams add up until the NIC is full; 0: no cap, the client's
own ceiling on loopback). Targets: N streams >= 3x one stream with the cap,
>= 1x without. --server=emulator serves from gcp-storage-emulator instead (a
Python server on the same cores: it caps the parallel speed-up far below a
real bucket's).

`run(size_bytes, streams, rounds, work_dir)` returns the figures as a dict
(for scripts/bench_graphs.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from formats.storage import files  # noqa: E402
from formats.features import Features  # noqa: E402
from formats.graphbin import GraphBin, GraphBinWriter  # noqa: E402
from formats.manifest import MANIFEST_FILENAME, FileInfo, Manifest, sha256_file  # noqa: E402
from loaders import graph as lg  # noqa: E402

MiB = 1 << 20
_SECTIONS = 4  # the data is split over a few sections, so there are several CRCs to check


def write_graph(path: str, size_bytes: int, seed: int = 0) -> FileInfo:
  """A .graphbin of about `size_bytes` of random float32 sections, and its manifest entry (kept when present)."""
  if not (os.path.exists(path) and os.path.exists(path + ".json")
          and json.loads(open(path + ".json").read())["target"] == size_bytes):
    rng = np.random.default_rng(seed)
    rows = max(1, size_bytes // (_SECTIONS * 4 * 256))  # [rows, 256] float32 per section
    with GraphBinWriter(path) as w:
      w.add_meta({"num_nodes": {"": rows}})
      for k in range(_SECTIONS):
        with w.stream(f"node/x{k}", "<f4", (rows, 256)) as s:
          for start in range(0, rows, 16384):  # 16 MiB at a time
            s.write(rng.random((min(16384, rows - start), 256), dtype=np.float32))
    with open(path + ".json", "w") as f:
      json.dump({"target": size_bytes, "sha256": sha256_file(path)}, f)
  with open(path + ".json") as f:
    digest = json.load(f)["sha256"]
  return FileInfo(os.path.basename(path), os.path.getsize(path), digest, "graphbin")


@contextlib.contextmanager
def emulator(bucket: str = "bench") -> Iterator[str]:
  """gcp-storage-emulator on loopback, in memory; STORAGE_EMULATOR_HOST names it while it runs."""
  exe = shutil.which("gcp-storage-emulator") or os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  proc = subprocess.Popen([exe, "start", "--host=127.0.0.1", f"--port={port}", f"--default-bucket={bucket}",
                           "--in-memory"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  host = f"http://127.0.0.1:{port}"
  old = os.environ.get("STORAGE_EMULATOR_HOST")
  try:
    deadline = time.monotonic() + 30
    while True:
      try:
        urllib.request.urlopen(f"{host}/storage/v1/b/{bucket}", timeout=1).read()
        break
      except Exception:
        if proc.poll() is not None or time.monotonic() > deadline:
          raise RuntimeError("gcp-storage-emulator did not start")
        time.sleep(0.2)
    os.environ["STORAGE_EMULATOR_HOST"] = host
    files._gcs_client.cache_clear()  # the client reads the variable when it is created
    yield bucket
  finally:
    proc.terminate()
    proc.wait(timeout=10)
    if old is None:
      os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
      os.environ["STORAGE_EMULATOR_HOST"] = old
    files._gcs_client.cache_clear()


def _old_path(src: str, info: FileInfo, cache: str) -> None:
  """What loaders.graph.load did before: one stream, then the SHA-256 and every section's CRC, each a pass."""
  local = files.cache_path(src, info.sha256, cache)
  files.download(src, local)
  if sha256_file(local) != info.sha256:
    raise RuntimeError(f"{src}: the download differs from the manifest")
  GraphBin(local, verify=True)


def run(size_bytes: int = 256 * MiB, streams: int = 8, rounds: int = 3, work_dir: str = "bench_work",
        chunk_bytes: int = 32 * MiB, per_stream_mb_s: float | None = 100.0, server: str = "bucket",
        latency_ms: float = 30.0) -> dict:
  """Times the three ways of fetching a graph of about `size_bytes` from a gs:// server.

  Args:
    size_bytes: the .graphbin's approximate size.
    streams: the parallel streams of the last variant.
    rounds: timings of each variant (taken in turn, each from an empty cache).
    work_dir: where the .graphbin is written and the caches go.
    chunk_bytes: bytes per ranged read.
    per_stream_mb_s: the benchmark bucket's cap per connection (None or 0: none).
    server: "bucket" (scripts/bench_bucket.py) or "emulator" (gcp-storage-emulator; no cap, no latency).
    latency_ms: the benchmark bucket's first-byte latency.

  Returns:
    {"size_bytes", "streams", "chunk_bytes", "rounds", "per_stream_mb_s", "server", "seconds": {variant: [...]},
     "median_s": {...}, "median_mb_s": {...}, "speedup_vs_old", "speedup_vs_one_stream"}.
  """
  import bench_bucket

  os.makedirs(work_dir, exist_ok=True)
  local = os.path.join(work_dir, "bench_download.graphbin")
  info = write_graph(local, size_bytes)
  manifest = Manifest(name="bench", file_format="graphbin", features=Features({}), splits={}, files=(info,))
  variants = {
      "old": lambda gs, cache: _old_path(files.join(gs, info.path), info, cache),
      "1 stream": lambda gs, cache: lg.load(gs, cache_dir=cache, streams=1, chunk_bytes=chunk_bytes, progress=False),
      f"{streams} streams": lambda gs, cache: lg.load(gs, cache_dir=cache, streams=streams, chunk_bytes=chunk_bytes,
                                                      progress=False),
  }
  seconds: dict[str, list[float]] = {k: [] for k in variants}
  with contextlib.ExitStack() as stack:
    if server == "emulator":
      gs = f"gs://{stack.enter_context(emulator())}/graph"
      files.gcs_blob(files.join(gs, info.path)).upload_from_filename(local)
      files.write_bytes(files.join(gs, MANIFEST_FILENAME), manifest.dumps())
    else:
      root = os.path.join(work_dir, "bench_bucket")
      tree = os.path.join(work_dir, "bench_download_tree")
      os.makedirs(tree, exist_ok=True)
      with open(os.path.join(tree, MANIFEST_FILENAME), "wb") as f:
        f.write(manifest.dumps())
      if os.path.lexists(os.path.join(tree, info.path)):
        os.remove(os.path.join(tree, info.path))
      os.link(local, os.path.join(tree, info.path))
      gs = bench_bucket.stage(root, "bench", tree, "graph")
      bucket = stack.enter_context(bench_bucket.BenchBucket(root, latency_ms=latency_ms, mbps=per_stream_mb_s or 0))
      stack.enter_context(bucket.active())
      bucket.warm(gs)
    for r in range(rounds):
      names = list(variants)
      names = names[r % len(names):] + names[:r % len(names)]  # rotate the order every round
      for name in names:
        cache = os.path.join(work_dir, "bench_download_cache")
        shutil.rmtree(cache, ignore_errors=True)
        t = time.perf_counter()
        variants[name](gs, cache)
        seconds[name].append(time.perf_counter() - t)
    shutil.rmtree(os.path.join(work_dir, "bench_download_cache"), ignore_errors=True)
  median = {k: statistics.median(v) for k, v in seconds.items()}
  many = f"{streams} streams"
  return {
      "size_bytes": info.num_bytes, "streams": streams, "chunk_bytes": chunk_bytes, "rounds": rounds,
      "per_stream_mb_s": per_stream_mb_s, "server": server, "latency_ms": latency_ms,
      "seconds": seconds, "median_s": median,
      "median_mb_s": {k: info.num_bytes / v / 1e6 for k, v in median.items()},
      "speedup_vs_old": median["old"] / median[many],
      "speedup_vs_one_stream": median["1 stream"] / median[many],
  }


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--size_mb", type=int, default=256)
  p.add_argument("--streams", type=int, default=8)
  p.add_argument("--chunk_mb", type=int, default=32)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--server", default="bucket", choices=("bucket", "emulator"))
  p.add_argument("--per_stream_mb_s", type=float, default=100.0,
                 help="the benchmark bucket's cap per connection; the run is repeated without it (0: only without)")
  p.add_argument("--latency_ms", type=float, default=30.0, help="the benchmark bucket's first-byte latency")
  p.add_argument("--work", default=os.path.join(REPO, "bench_work"))
  p.add_argument("--json", default=None, help="also write the figures here")
  a = p.parse_args(argv)
  caps = [None] if a.server == "emulator" else ([a.per_stream_mb_s, None] if a.per_stream_mb_s else [None])
  results = []
  for cap in caps:
    r = run(a.size_mb * MiB, a.streams, a.rounds, a.work, a.chunk_mb * MiB, cap, a.server, a.latency_ms)
    results.append(r)
    where = ("gcp-storage-emulator" if a.server == "emulator" else
             f"the benchmark bucket ({a.latency_ms:g} ms first byte, "
             + (f"{cap:g} MB/s per connection)" if cap else "no cap per connection)"))
    print(f"{r['size_bytes'] / 1e6:.0f} MB .graphbin from {where}, chunks of {a.chunk_mb} MiB, "
          f"median of {a.rounds} rounds (cpus: {os.cpu_count()})")
    for name, s in r["median_s"].items():
      print(f"  {name:>12}: {s:6.2f} s  {r['median_mb_s'][name]:7.1f} MB/s   "
            f"(rounds: {', '.join(f'{x:.2f}' for x in r['seconds'][name])})")
    target = 3.0 if cap else 1.0
    ok = r["speedup_vs_one_stream"] >= target
    print(f"  {'PASS' if ok else 'MISS'}  {a.streams} streams vs 1 stream: {r['speedup_vs_one_stream']:.2f}x "
          f"(target >= {target:g}x); vs old: {r['speedup_vs_old']:.2f}x")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(results, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
