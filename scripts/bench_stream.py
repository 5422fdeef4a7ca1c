"""Benchmarks streaming a gs:// split through a bounded cache against reading the same shards from local disk.

    python scripts/bench_stream.py [--work=bench_work] [--num_images=2000] [--kinds=jpeg,raw]
        [--num_shards=16] [--window_shards=2] [--cache_fraction=0.4] [--rounds=3] [--json=out.json]
        [--server=bucket|emulator] [--latency_ms=30] [--mbps=100]

The 224x224 ArrayRecord shards of scripts/bench_loaders.py's image folder are
converted again into `--num_shards` shards (cached under --work) and served
as gs:// by the benchmark bucket (scripts/bench_bucket.py: its own process,
sendfile, `--latency_ms` first-byte latency and a `--mbps` cap per connection,
like GCS from a VM in the same region) or, with --server=emulator, by
gcp-storage-emulator. In one run, alternating over `--rounds` rounds, one
epoch of loaders.grain batches (batch 64) is timed five ways: (L) the local
shards in the window order (`window_shards`), (S) the gs:// copy in the same
order, streamed through a cache limited to `--cache_fraction` of the split,
(R) the local shards at random, and host 0 of 2 in the global window order
from (Lg) the local shards and (Sg) gs:// by ranged reads of its own records
(fetch="records", runs of 8 records). Each (S) round starts from an empty
cache; a thread polls the cache folder's disk use every few milliseconds.

Prints the medians, (S)/(L) against the targets (>= 0.8 JPEG, >= 0.6 raw),
(Sg)/(Lg) against 0.5, the peak disk use against the limit, and the client's
CPU-seconds per GB: the loader process's CPU time of a gs:// variant minus that
of its local twin (the same batches decoded the same way), divided by the
bytes the server sent: what fetching and verifying cost the client, the figure
that carries over to a real bucket and host. The server's own CPU is reported
apart (it shares these 2 cores with the loader; a real bucket serves from
elsewhere).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

import bench_bucket  # noqa: E402
import bench_graph_download  # noqa: E402
import bench_image_folder  # noqa: E402
from formats import load_manifest  # noqa: E402
from formats.storage import files  # noqa: E402
from loaders import grain as grain_loader  # noqa: E402
from pipelines import image_folder  # noqa: E402

STREAM_TARGET = {"jpeg": 0.8, "raw": 0.6}  # (S) at least this fraction of (L)'s images/s
RECORDS_TARGET = 0.5  # (Sg) at least this fraction of (Lg)'s
CPU_TARGET = 0.3  # client CPU-seconds per GB fetched and verified, at most
BATCH = 64


def ensure_shards(work: str, root: str, encoding: str, num_shards: int) -> str:
  """The cached `num_shards`-shard ArrayRecord output of `root` at 224x224."""
  out = os.path.join(work, "loaders", f"{os.path.basename(root)}_{encoding}_224x224_{num_shards}shards")
  if not os.path.exists(out + ".done"):
    image_folder.run([f"--input={root}", f"--output={out}", "--format=array_record", f"--encoding={encoding}",
                      "--image_size=224,224", f"--num_shards={num_shards}", "--overwrite=true",
                      "--runner=DirectRunner", "--direct_num_workers=1", "--direct_running_mode=in_memory"])
    open(out + ".done", "w").close()
  return out


class DiskWatch:
  """Polls a folder's disk use (allocated blocks) in a thread and keeps the peak."""

  def __init__(self, folder: str):
    self.folder, self.peak = folder, 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self) -> None:
    while not self._stop.is_set():
      used = 0
      for d, _, names in os.walk(self.folder):
        for name in names:
          try:
            used += os.stat(os.path.join(d, name)).st_blocks * 512
          except FileNotFoundError:
            pass
      self.peak = max(self.peak, used)
      time.sleep(0.005)

  def __enter__(self) -> DiskWatch:
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()


def emulator_cpu_s() -> float:
  """CPU seconds used so far by the gcp-storage-emulator processes of this machine (from /proc)."""
  total = 0.0
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if b"gcp-storage-emulator" not in f.read():
          continue
      with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
      continue
  return total


class _Server:
  """The gs:// side of a run: the benchmark bucket (default) or the emulator, with its CPU and bytes sent."""

  def __init__(self, kind: str, work: str, latency_ms: float, mbps: float):
    self.kind, self.root = kind, os.path.join(work, "bench_bucket")
    self.latency_ms, self.mbps = latency_ms, mbps
    self._stack = contextlib.ExitStack()

  def __enter__(self) -> _Server:
    if self.kind == "emulator":
      self.bucket = self._stack.enter_context(bench_graph_download.emulator())
      self._server = None
    else:
      self.bucket = "bench"
      os.makedirs(os.path.join(self.root, self.bucket), exist_ok=True)
      self._server = self._stack.enter_context(
          bench_bucket.BenchBucket(self.root, latency_ms=self.latency_ms, mbps=self.mbps))
      self._stack.enter_context(self._server.active())
    return self

  def __exit__(self, *exc) -> None:
    self._stack.close()

  def upload(self, local: str, prefix: str) -> str:
    if self._server is None:
      gs = f"gs://{self.bucket}/{prefix}"
      for d, _, names in os.walk(local):
        for name in names:
          rel = os.path.relpath(os.path.join(d, name), local)
          files.gcs_blob(files.join(gs, rel)).upload_from_filename(os.path.join(d, name))
      return gs
    gs = bench_bucket.stage(self.root, self.bucket, local, prefix)
    self._server.warm(gs)
    return gs

  def cpu_s(self) -> float:
    return emulator_cpu_s() if self._server is None else self._server.server_cpu_seconds()

  def settle(self) -> None:
    """Waits until the server sends nothing for 0.2 s (a finished loader's fetchers have stopped), at most 5 s."""
    gc.collect()
    if self._server is None:
      return
    last, deadline = self.bytes_sent(), time.monotonic() + 5.0
    while time.monotonic() < deadline:
      time.sleep(0.2)
      now = self.bytes_sent()
      if now == last:
        return
      last = now

  def bytes_sent(self) -> int:
    return 0 if self._server is None else int(self._server.stats()["bytes_sent"])


EPOCHS = 2  # per timing (--epochs): the first epoch's start (leases, tails, first fetches) is paid once


def one_epoch(path: str, num_threads: int, **kw) -> int:
  """Images in EPOCHS epochs of loaders.grain batches."""
  n = 0
  for batch in grain_loader.dataset(path, batch_size=BATCH, seed=0, num_epochs=EPOCHS, num_threads=num_threads,
                                    image_size=(224, 224), **kw):
    if batch["image"].shape != (BATCH, 224, 224, 3):
      raise RuntimeError(f"batch of shape {batch['image'].shape}")
    n += batch["image"].shape[0]
  return n


def run(work: str = "bench_work", num_images: int = 2000, kinds: Sequence[str] = ("jpeg", "raw"),
        num_shards: int = 16, window_shards: int = 2, cache_fraction: float = 0.4, rounds: int = 3,
        num_threads: int = 16, server: str = "bucket", latency_ms: float = 30.0, mbps: float = 100.0) -> dict:
  """Times (L), (S), (R), (Lg) and (Sg) for each shard kind; returns the per-round seconds, medians and ratios."""
  work = os.path.abspath(work)
  root, _ = bench_image_folder.ensure_images(work, num_images)
  report: dict = {"num_images": num_images, "num_shards": num_shards, "window_shards": window_shards,
                  "cache_fraction": cache_fraction, "rounds": rounds, "server": server, "latency_ms": latency_ms,
                  "mbps": mbps, "kinds": {}}
  with _Server(server, work, latency_ms, mbps) as srv:
    for kind in kinds:
      local = ensure_shards(work, root, kind, num_shards)
      report["kinds"][kind] = _run_kind(local, srv.upload(local, f"stream/{kind}"), srv,
                                        os.path.join(work, "bench_stream_cache"), window_shards, cache_fraction,
                                        rounds, num_threads)
  return report


S, L, R, LG, SG = ("(S) gs:// streamed, bounded cache", "(L) local, window order", "(R) local, random access",
                   "(Lg) local, global order, host 0 of 2", "(Sg) gs:// records, global, host 0 of 2")
_TWIN = {S: L, SG: LG}  # a gs:// variant and the local one that decodes the same batches


def _run_kind(local: str, gs: str, srv: _Server, cache: str, window_shards: int, cache_fraction: float, rounds: int,
              num_threads: int) -> dict:
  """Times one output's variants, alternated over `rounds` rounds."""
  manifest = load_manifest(local)
  split_bytes = sum(s.num_bytes for s in manifest.splits["train"].shards)
  limit = int(split_bytes * cache_fraction)
  peaks: list[int] = []
  cpu: dict[str, list[tuple[float, float, float, int]]] = {}  # variant -> (wall, loader CPU, server CPU, bytes)

  def streamed() -> int:
    shutil.rmtree(cache, ignore_errors=True)
    os.makedirs(cache)
    with DiskWatch(cache) as watch:
      n = one_epoch(gs, num_threads, window_shards=window_shards, cache_dir=cache, cache_limit_bytes=limit)
    peaks.append(watch.peak)
    return n

  variants: dict[str, Callable[[], int]] = {
      L: lambda: one_epoch(local, num_threads, window_shards=window_shards),
      S: streamed,
      R: lambda: one_epoch(local, num_threads),
      LG: lambda: one_epoch(local, num_threads, window_shards=window_shards, order="global", shard_count=2),
      SG: lambda: one_epoch(gs, num_threads, window_shards=window_shards, order="global", shard_count=2,
                            cache_dir=cache),
  }
  seconds: dict[str, list[float]] = {k: [] for k in variants}
  counts: dict[str, set[int]] = {k: set() for k in variants}
  for r in range(rounds):
    names = list(variants)
    names = names[r % len(names):] + names[:r % len(names)]  # rotate the order every round
    for name in names:
      srv.settle()
      t, c, e, b = time.perf_counter(), sum(os.times()[:2]), srv.cpu_s(), srv.bytes_sent()
      counts[name].add(variants[name]())
      seconds[name].append(time.perf_counter() - t)
      cpu.setdefault(name, []).append((seconds[name][-1], sum(os.times()[:2]) - c, srv.cpu_s() - e,
                                       srv.bytes_sent() - b))
  shutil.rmtree(cache, ignore_errors=True)
  images = {k: v.pop() for k, v in counts.items()}
  median = {k: statistics.median(v) for k, v in seconds.items()}
  ips = {k: images[k] / median[k] for k in variants}
  per_round = [images[S] / s / (images[L] / l) for s, l in zip(seconds[S], seconds[L])]
  per_round_g = [images[SG] / s / (images[LG] / l) for s, l in zip(seconds[SG], seconds[LG])]
  per_gb = {}
  for name, twin in _TWIN.items():  # per round: (this variant's CPU - its twin's) / the bytes the server sent
    extra = [(c[1] - t[1]) / max(c[3], 1) * 1e9 for c, t in zip(cpu[name], cpu[twin])]
    whole = [c[1] / max(c[3], 1) * 1e9 for c in cpu[name]]
    per_gb[name] = {"client_extra": statistics.median(extra), "client_extra_per_round": extra,
                    "client_whole": statistics.median(whole), "bytes": statistics.median(c[3] for c in cpu[name])}
  return {
      "split_bytes": split_bytes, "cache_limit_bytes": limit, "peak_disk_bytes": max(peaks),
      "seconds": seconds, "images": images, "median_images_per_s": ips,
      "cpu_seconds": {k: {"wall": statistics.median(v[0] for v in vs), "loader": statistics.median(v[1] for v in vs),
                          "server": statistics.median(v[2] for v in vs)} for k, vs in cpu.items()},
      "cpu_per_gb": per_gb,
      "stream_vs_local": ips[S] / ips[L], "stream_vs_local_per_round": per_round,
      "records_vs_local": ips[SG] / ips[LG], "records_vs_local_per_round": per_round_g,
  }


def print_report(report: dict) -> None:
  where = ("gcp-storage-emulator" if report["server"] == "emulator" else
           f"the benchmark bucket ({report['latency_ms']:g} ms first byte, {report['mbps']:g} MB/s per connection)")
  print(f"\nstreaming from {where} ({report['num_shards']} shards, window_shards={report['window_shards']}, cache "
        f"{report['cache_fraction']:.0%} of the split, {report['rounds']} alternated rounds, medians)")
  for kind, r in report["kinds"].items():
    print(f"  {kind} shards: split {r['split_bytes'] / 1e6:.0f} MB, cache limit {r['cache_limit_bytes'] / 1e6:.0f} MB")
    for name, v in r["median_images_per_s"].items():
      rounds = ", ".join(f"{r['images'][name] / s:.0f}" for s in r["seconds"][name])
      c = r["cpu_seconds"][name]
      print(f"    {name:<40} {v:8.0f} images/s  (rounds: {rounds}; per epoch: {c['wall']:.2f} s wall, "
            f"{c['loader']:.2f} s loader CPU, {c['server']:.2f} s server CPU)")
    target = STREAM_TARGET[kind]
    ok = r["stream_vs_local"] >= target
    print(f"  {'PASS' if ok else 'MISS'}  {kind}: (S) >= {target:.0%} of (L) (ratio {r['stream_vs_local']:.2f}; "
          f"per round {', '.join(f'{x:.2f}' for x in r['stream_vs_local_per_round'])})")
    ok = r["records_vs_local"] >= RECORDS_TARGET
    print(f"  {'PASS' if ok else 'MISS'}  {kind}: (Sg) >= {RECORDS_TARGET:.0%} of (Lg) (ratio "
          f"{r['records_vs_local']:.2f}; per round {', '.join(f'{x:.2f}' for x in r['records_vs_local_per_round'])})")
    for name, g in r["cpu_per_gb"].items():
      if not g["bytes"]:
        continue
      ok = g["client_extra"] <= CPU_TARGET
      print(f"  {'PASS' if ok else 'MISS'}  {kind}: {name.split(')')[0]})'s client CPU to fetch and verify "
            f"{g['client_extra']:.2f} CPU-s/GB <= {CPU_TARGET} (per round "
            f"{', '.join(f'{x:.2f}' for x in g['client_extra_per_round'])}; the whole loader "
            f"{g['client_whole']:.2f} CPU-s/GB; {g['bytes'] / 1e6:.0f} MB sent)")
    ok = r["peak_disk_bytes"] <= r["cache_limit_bytes"]
    print(f"  {'PASS' if ok else 'MISS'}  {kind}: peak disk {r['peak_disk_bytes'] / 1e6:.1f} MB <= limit "
          f"{r['cache_limit_bytes'] / 1e6:.1f} MB")


def main(argv: Sequence[str] | None = None) -> int:
  global EPOCHS
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--work", default="bench_work")
  ap.add_argument("--num_images", type=int, default=2000)
  ap.add_argument("--kinds", default="jpeg,raw")
  ap.add_argument("--num_shards", type=int, default=16)
  ap.add_argument("--window_shards", type=int, default=2)
  ap.add_argument("--cache_fraction", type=float, default=0.4)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--num_threads", type=int, default=16)
  ap.add_argument("--json", default=None)
  ap.add_argument("--server", default="bucket", choices=("bucket", "emulator"))
  ap.add_argument("--epochs", type=int, default=2, help="epochs per timing")
  ap.add_argument("--latency_ms", type=float, default=30.0, help="the benchmark bucket's first-byte latency")
  ap.add_argument("--mbps", type=float, default=100.0, help="its cap per connection, MB/s (0: none)")
  a = ap.parse_args(argv)
  kinds = [k for k in a.kinds.split(",") if k]
  if not kinds or set(kinds) - {"jpeg", "raw"}:
    ap.error(f"--kinds takes jpeg and/or raw, got {a.kinds!r}")
  if a.rounds < 1 or a.num_shards < 2 or a.window_shards < 1 or not 0 < a.cache_fraction < 1:
    ap.error("--rounds and --window_shards must be >= 1, --num_shards >= 2, 0 < --cache_fraction < 1")
  EPOCHS = a.epochs
  report = run(a.work, a.num_images, kinds, a.num_shards, a.window_shards, a.cache_fraction, a.rounds, a.num_threads,
               a.server, a.latency_ms, a.mbps)
  print_report(report)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(report, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
