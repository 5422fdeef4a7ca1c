"""Benchmarks fetching a gs:// .graphbin: the old single-stream path against parallel ranged reads.

    python scripts/bench_graph_download.py [--size_mb=256] [--streams=8] [--chunk_mb=32]
        [--rounds=3] [--work=bench_work] [--json=results.json]

Writes (once, cached under --work) a .graphbin of about --size_mb of random
float32 sections with formats.graphbin.GraphBinWriter and its manifest,
starts gcp-storage-emulator on loopback (as tests/conftest.py does, without
the fault proxy), uploads both, then times, --rounds times each in turn:
  old:       files.download (one stream), then its SHA-256 and every section's
             CRC in passes of their own: what loaders.graph.load did before;
  1 stream:  loaders.graph.load(..., streams=1) (checked as the bytes arrive);
  N streams: loaders.graph.load(..., streams=N).
Each timing starts from an empty cache and ends with a verified, mapped file.
Prints the medians and the ratios. The emulator is one Python process serving
from memory, so it caps the parallel speed-up far below a real bucket's.

With --per_stream_mb_s=R the timed reads go through a TCP proxy that caps
every connection at R MB/s: a model of a real bucket, where one stream's
throughput is bounded by latency and TCP window long before the network is
(a few tens to a few hundred MB/s per stream), and parallel streams add up
until the NIC is full. It is a simulation, reported as such.

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
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from formats import files  # noqa: E402
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


class ThrottlingProxy:
  """A TCP forwarder to `upstream` (host, port) that caps each connection's downstream bytes at `rate` B/s."""

  def __init__(self, upstream: tuple[str, int], rate: float):
    self.upstream, self.rate = upstream, rate
    self._server = socket.socket()
    self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self._server.bind(("127.0.0.1", 0))
    self._server.listen(64)
    self.host = f"http://127.0.0.1:{self._server.getsockname()[1]}"
    self._closed = False
    threading.Thread(target=self._accept, daemon=True).start()

  def _accept(self) -> None:
    while not self._closed:
      try:
        client, _ = self._server.accept()
      except OSError:
        return
      up = socket.create_connection(self.upstream)
      threading.Thread(target=self._pump, args=(client, up, None), daemon=True).start()
      threading.Thread(target=self._pump, args=(up, client, self.rate), daemon=True).start()

  @staticmethod
  def _pump(src: socket.socket, dst: socket.socket, rate: float | None) -> None:
    sent, start = 0, time.monotonic()
    try:
      while True:
        data = src.recv(64 * 1024)
        if not data:
          break
        dst.sendall(data)
        if rate:
          sent += len(data)
          ahead = sent / rate - (time.monotonic() - start)
          if ahead > 0:
            time.sleep(ahead)
    except OSError:
      pass
    finally:
      for sock in (src, dst):
        try:
          sock.shutdown(socket.SHUT_RDWR)
        except OSError:
          pass

  def close(self) -> None:
    self._closed = True
    self._server.close()


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
  local = files.cached_copy(src, info.sha256, cache)
  GraphBin(local, verify=True)


def run(size_bytes: int = 256 * MiB, streams: int = 8, rounds: int = 3, work_dir: str = "bench_work",
        chunk_bytes: int = 32 * MiB, per_stream_mb_s: float | None = None) -> dict:
  """Times the three ways of fetching a graph of about `size_bytes` from the emulator.

  Args:
    size_bytes: the .graphbin's approximate size.
    streams: the parallel streams of the last variant.
    rounds: timings of each variant (taken in turn, each from an empty cache).
    work_dir: where the .graphbin is written and the caches go.
    chunk_bytes: bytes per ranged read.
    per_stream_mb_s: cap every connection at this rate (a simulated bucket; None: the emulator as it is).

  Returns:
    {"size_bytes", "streams", "chunk_bytes", "rounds", "seconds": {variant: [...]},
     "median_s": {...}, "median_mb_s": {...}, "speedup_vs_old", "speedup_vs_one_stream"}.
  """
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
  with emulator() as bucket:
    gs = f"gs://{bucket}/graph"
    files.gcs_blob(files.join(gs, info.path)).upload_from_filename(local)
    files.write_bytes(files.join(gs, MANIFEST_FILENAME), manifest.dumps())
    proxy = None
    if per_stream_mb_s:
      port = int(os.environ["STORAGE_EMULATOR_HOST"].rsplit(":", 1)[1])
      proxy = ThrottlingProxy(("127.0.0.1", port), per_stream_mb_s * 1e6)
      os.environ["STORAGE_EMULATOR_HOST"] = proxy.host
      files._gcs_client.cache_clear()
    for _ in range(rounds):
      for name, fetch in variants.items():
        cache = os.path.join(work_dir, "bench_download_cache")
        shutil.rmtree(cache, ignore_errors=True)
        t = time.perf_counter()
        fetch(gs, cache)
        seconds[name].append(time.perf_counter() - t)
    if proxy is not None:
      proxy.close()
    shutil.rmtree(os.path.join(work_dir, "bench_download_cache"), ignore_errors=True)
  median = {k: statistics.median(v) for k, v in seconds.items()}
  many = f"{streams} streams"
  return {
      "size_bytes": info.num_bytes, "streams": streams, "chunk_bytes": chunk_bytes, "rounds": rounds,
      "per_stream_mb_s": per_stream_mb_s,
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
  p.add_argument("--per_stream_mb_s", type=float, default=None, help="cap each connection (a simulated bucket)")
  p.add_argument("--work", default=os.path.join(REPO, "bench_work"))
  p.add_argument("--json", default=None, help="also write the figures here")
  a = p.parse_args(argv)
  r = run(a.size_mb * MiB, a.streams, a.rounds, a.work, a.chunk_mb * MiB, a.per_stream_mb_s)
  cap = f", each connection capped at {a.per_stream_mb_s:g} MB/s" if a.per_stream_mb_s else ""
  print(f"{r['size_bytes'] / 1e6:.0f} MB .graphbin from gcp-storage-emulator{cap}, chunks of {a.chunk_mb} MiB, "
        f"median of {a.rounds} rounds (cpus: {os.cpu_count()})")
  for name, s in r["median_s"].items():
    print(f"  {name:>12}: {s:6.2f} s  {r['median_mb_s'][name]:7.1f} MB/s   "
          f"(rounds: {', '.join(f'{x:.2f}' for x in r['seconds'][name])})")
  print(f"  {a.streams} streams vs old: {r['speedup_vs_old']:.2f}x;  vs 1 stream: {r['speedup_vs_one_stream']:.2f}x")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(r, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
