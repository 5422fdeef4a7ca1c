"""Benchmarks the loaders (grain, torch_xla, JAX) against today's record path, a read ceiling and a torch DataLoader.

    python scripts/bench_loaders.py [--work=bench_work] [--num_images=2000]
        [--batch_size=64] [--num_threads=16] [--num_workers=2] [--raw_epochs=5]
        [--xla=raw,jpeg] [--jax=raw,jpeg] [--per_example=raw,jpeg] [--stream=jpeg,raw] [--rounds=3]
        [--only=h,i] [--json=results.json] [--pinning_only]

On the cached folder of ~500x375 JPEGs that scripts/bench_image_folder.py
generates, converts (once, cached under --work) ArrayRecord shards at 224x224,
JPEG-encoded and raw, then times shuffled passes of uint8 [64, 224, 224, 3]
batches from:

  (a) loaders.grain over both shard kinds: the record path (loaders._batch:
      features found in place, each example written once into the batch), and
      today's loader, the decode-transform-copy path (loaders.grain._ReadBatch
      FAST=False), with the same dataset arguments;
  (b) loaders.xla on the XLA CPU device (a subprocess: torch_xla never shares
      a process with TensorFlow);
  (c) the baseline users have now, a torch DataLoader over the folder (PIL,
      --num_workers workers), in a fresh subprocess each time (its workers
      fork: never from a process with grain's threads);
  (d) the bare record reads of the raw shards (ShardedRecords.raw, one thread);
  (e) the read ceiling of the raw shards: as many threads as grain's (two on a
      2-CPU machine), each reading through its own readers and copying each
      record's pixel bytes once into a preallocated batch, nothing decoded.

  (f) streaming: scripts/bench_stream.py on --stream kinds (two epochs from
      the benchmark bucket, scripts/bench_bucket.py: 30 ms to the first byte,
      100 MB/s per connection, through a cache of 40 % of the split vs the
      same window order from local disk, and ranged reads of one host's
      records in runs), with the targets (>= 0.8x local for JPEG, >= 0.6x for
      raw, >= 0.5x for one host's records) and the client's CPU-seconds per
      GB fetched and verified (target <= 0.3).
  (g) the cost of pinning and leases: (a)'s record path with lease=False
      (the manifest read once either way; with the default lease=True a
      lease object is written, the manifest read again to prove it came in
      time, and a heartbeat thread runs). --pinning_only times just (a) and
      (g), for both shard kinds, without (b) to (f), (h) or (i): each round
      runs lease on and off in the order on, off, off, on per kind (the run
      after its twin finds warmer caches) and takes the mean of each
      variant's two runs.
  (h) loaders.jax over --jax kinds, in a subprocess with 8 CPU devices
      (XLA_FLAGS=--xla_force_host_platform_device_count=8; jax never shares
      a process with this one): the same passes as (a)'s record path, each
      global batch split over a mesh of the 8 and waited on until its arrays
      are on the devices (block_until_ready), against loaders.grain's numpy
      batches (the record path) timed in the same process, in the order
      grain, jax, jax, grain (the mean of each pair is the round's figure);
      target >= 0.9x, as the median of the per-round ratios. Also printed:
      the process's CPU time per image of each (medians of the rounds),
      steadier than the rates where other jobs share the CPUs.
  (i) the per-example path over --per_example kinds: loaders.grain.records,
      then grain's own .repeat and .batch, read with (a)'s threads and
      prefetch, against (a)'s fused path (loaders.grain.dataset) timed beside
      it in the order fused, per-example, per-example, fused (the mean of each
      pair is the round's figure); its cost is reported as the median of the
      per-round ratios (no target: what composing per example costs).

--only=h,i runs just the sections named by their letters ((f) included).
Every variant runs once per round, in an order rotated each round, for
--rounds rounds; each reports its median images/s. Raw passes are repeated
--raw_epochs times so that each timing lasts long enough. Page caches are
warmed first. Prints a table (medians and every round) and PASS/MISS for the
targets with their ratios; exits 0 whether they are met or not (this is a
report), non-zero only on errors.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
from PIL import Image as PILImage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

import bench_image_folder  # noqa: E402
import bench_stream  # noqa: E402
from formats import load_manifest  # noqa: E402
from formats.example import FeatureFinder  # noqa: E402
from loaders import ShardedRecords, grain as grain_loader  # noqa: E402

SPLIT = "train"
SPEEDUP_TARGET = 2.0  # (a) raw shards: the record path at least this times today's loader
CEILING_TARGET = 0.70  # (a) raw shards: at least this fraction of the read ceiling (e)
JPEG_TARGET = 5.0  # (a) JPEG shards: at least this times the DataLoader's images/s
LEASE_TARGET = 0.97  # (g): with pinning and a lease, at least this fraction of the images/s without a lease
RAW_TARGET = 20.0  # (a) raw shards: at least this times the DataLoader's images/s
JAX_TARGET = 0.9  # (h): loaders.jax at least this fraction of loaders.grain's images/s in the same process
JAX_DEVICES = 8  # (h): CPU devices of the JAX child's mesh
PREFETCH = 64  # (i): batches read ahead by the per-example path (loaders.grain.dataset's prefetch_buffer_size)
CHILD_TIMEOUT_S = 900

NEW_RAW, OLD_RAW = "(a) grain, raw shards", "(a) grain, raw shards, today's loader"
NEW_JPEG, OLD_JPEG = "(a) grain, JPEG shards", "(a) grain, JPEG shards, today's loader"
DATALOADER, BARE = "(c) torch DataLoader, folder", "(d) bare reads, raw shards, 1 thread"
CEILING = "(e) read ceiling, raw shards, grain's threads"
NO_LEASE_RAW, NO_LEASE_JPEG = "(g) grain, raw shards, lease=False", "(g) grain, JPEG shards, lease=False"
JAX_VARIANTS = {kind: (f"(h) jax, {JAX_DEVICES} CPU devices, {name} shards",
                       f"(h) grain in jax's process, {name} shards")
                for kind, name in (("raw", "raw"), ("jpeg", "JPEG"))}  # kind: (variant, its baseline)
PER_EXAMPLE_VARIANTS = {kind: (f"(i) grain per example, records().batch, {name}",
                               f"(i) grain fused, beside the per-example, {name}")
                        for kind, name in (("raw", "raw"), ("jpeg", "JPEG"))}  # kind: (variant, its baseline)
SECTIONS = "abcdefghi"


def ensure_shards(work: str, root: str, encoding: str, size: tuple[int, int]) -> str:
  """The cached ArrayRecord output of `image_folder` for `root` (converted on first use)."""
  from pipelines import image_folder  # Beam, at the edge: only when shards are missing (not in every child)

  out = os.path.join(work, "loaders", f"{os.path.basename(root)}_{encoding}_{size[0]}x{size[1]}")
  done = out + ".done"
  if not os.path.exists(done):
    t0 = time.perf_counter()
    image_folder.run([
        f"--input={root}", f"--output={out}", "--format=array_record", f"--encoding={encoding}",
        f"--image_size={size[0]},{size[1]}", "--overwrite=true", "--runner=DirectRunner",
        "--direct_num_workers=1", "--direct_running_mode=in_memory",
    ])
    n = load_manifest(out).num_records
    with open(done, "w") as f:
      f.write(f"{n}\n")
    print(f"converted {n} images to {encoding} shards in {out} ({time.perf_counter() - t0:.1f}s)", flush=True)
  return out


def list_images(root: str) -> list[tuple[str, int]]:
  """(path, label) of every file under `root`'s class folders, sorted."""
  classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
  out = []
  for label, cls in enumerate(classes):
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, cls)):
      dirnames.sort()
      out += [(os.path.join(dirpath, f), label) for f in sorted(filenames)]
  return out


def warm(paths: Sequence[str]) -> int:
  """Reads every file once (untimed) so that timings start from a warm page cache; returns bytes."""
  total = 0
  for p in paths:
    with open(p, "rb") as f:
      while chunk := f.read(1 << 24):
        total += len(chunk)
  return total


def shard_files(out: str) -> list[str]:
  return sorted(os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs)


def check_batch(variant: str, image, batch_size: int, size: tuple[int, int]) -> None:
  shape, dtype = tuple(image.shape), str(image.dtype).replace("torch.", "")
  if shape != (batch_size, *size, 3) or dtype != "uint8":
    raise RuntimeError(f"{variant}: batch of {dtype} {shape}, expected uint8 {(batch_size, *size, 3)}")


def threads_of(a: argparse.Namespace) -> int:
  """grain's reading threads for --num_threads (loaders.grain.dataset caps them at the usable CPUs)."""
  return max(1, min(a.num_threads, len(os.sched_getaffinity(0))))


# --------------------------------------------------------------------------- the variants: each returns images


def time_grain(path: str, a: argparse.Namespace, size: tuple[int, int], seed: int, epochs: int, fast: bool,
               lease: bool = True) -> int:
  """(a), (g): shuffled passes of loaders.grain, through the record path (fast) or today's loader, with or
  without a lease (the dataset is built inside the timing: its manifest reads and lease count)."""
  old = grain_loader._ReadBatch.FAST
  grain_loader._ReadBatch.FAST = fast  # read when the dataset is built
  try:
    ds = grain_loader.dataset(path, SPLIT, batch_size=a.batch_size, image_size=size, num_threads=a.num_threads,
                              num_epochs=epochs, shuffle=True, seed=seed, lease=lease)
  finally:
    grain_loader._ReadBatch.FAST = old
  n = 0
  for batch in ds:
    check_batch("grain", batch["image"], a.batch_size, size)
    n += batch["image"].shape[0]
  ds.close()
  return n


def time_records(path: str, a: argparse.Namespace, size: tuple[int, int], seed: int, epochs: int) -> int:
  """(i): shuffled passes of the per-example path, loaders.grain.records then grain's .repeat and .batch, read by
  (a)'s threads with (a)'s prefetch (the dataset built inside the timing, as in (a))."""
  import grain

  examples = grain_loader.records(path, SPLIT, image_size=size, shuffle=True, seed=seed)
  batches = examples.repeat(epochs).batch(a.batch_size, drop_remainder=True)
  n = 0
  for batch in batches.to_iter_dataset(grain.ReadOptions(num_threads=threads_of(a), prefetch_buffer_size=PREFETCH)):
    check_batch("per example", batch["image"], a.batch_size, size)
    n += batch["image"].shape[0]
  examples.close()
  return n


def time_bare_reads(source: ShardedRecords, epochs: int) -> int:
  """(d): every record's bytes through ShardedRecords.raw, one thread, no decoding."""
  num_bytes = 0
  for _ in range(epochs):
    for i in range(len(source)):
      num_bytes += len(source.raw(i))
  if num_bytes == 0:
    raise RuntimeError("bare reads: read no bytes")
  return epochs * len(source)


def time_ceiling(source: ShardedRecords, a: argparse.Namespace, size: tuple[int, int], seed: int,
                 epochs: int) -> int:
  """(e): the shuffled records read by grain's number of threads, each through its own readers (ShardedRecords
  gives every thread its own), each record's pixel bytes copied once into the thread's preallocated batch."""
  nbytes = size[0] * size[1] * 3
  first = source.raw(0)
  (_, spans), = FeatureFinder(["image"])(first)
  tail = len(first) - spans[0][1]  # the pixels end this far before the record's end (the label entry after them)
  threads = threads_of(a)
  orders = [np.random.default_rng([seed, e]).permutation(len(source)) for e in range(epochs)]
  errors: list[BaseException] = []

  def work(t: int) -> None:
    batch = np.empty((a.batch_size, nbytes), np.uint8)
    try:
      j = 0
      for order in orders:
        for i in order[t::threads]:
          data = source.raw(int(i))
          batch[j] = np.frombuffer(data, np.uint8, nbytes, len(data) - tail - nbytes)
          j = (j + 1) % a.batch_size
    except BaseException as e:  # noqa: BLE001 - reported by the caller
      errors.append(e)

  workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
  for w in workers:
    w.start()
  for w in workers:
    w.join()
  if errors:
    raise errors[0]
  return epochs * len(source)


def run_process(cmd: Sequence[str], env: dict | None = None, timeout: float = CHILD_TIMEOUT_S) -> dict:
  """Runs `cmd`; its last stdout line is a JSON report. RuntimeError with the stderr's tail otherwise."""
  try:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    raise RuntimeError(f"timed out after {timeout}s") from None
  lines = p.stdout.strip().splitlines()
  if p.returncode != 0 or not lines:
    tail = [line for line in (p.stderr or p.stdout).strip().splitlines() if line.strip()][-3:]
    raise RuntimeError(f"exit {p.returncode}: " + " | ".join(tail))
  try:
    return json.loads(lines[-1])
  except json.JSONDecodeError:
    raise RuntimeError(f"no JSON report, last line: {lines[-1][:200]!r}") from None


def run_child(args: Sequence[str], env: dict | None = None) -> dict:
  """Runs this script with `args` in a fresh process; its last stdout line is a JSON report."""
  return run_process([sys.executable, os.path.abspath(__file__), *args], env)


def dataloader_child(root: str, a: argparse.Namespace, size: tuple[int, int], seed: int) -> dict:
  """(c), in its own process: one shuffled pass of torch's DataLoader over the folder (timed after imports)."""
  import torch
  import torch.utils.data

  class FolderDataset(torch.utils.data.Dataset):
    """The usual torchvision-free baseline: PIL open, RGB, resize the shorter side, center crop."""

    def __init__(self, items: list[tuple[str, int]]):
      self.items = items

    def __len__(self) -> int:
      return len(self.items)

    def __getitem__(self, i: int):
      path, label = self.items[i]
      h, w = size
      with PILImage.open(path) as im:
        im = im.convert("RGB")
      scale = max(h / im.height, w / im.width)
      rw, rh = max(w, round(im.width * scale)), max(h, round(im.height * scale))
      im = im.resize((rw, rh), PILImage.Resampling.BILINEAR)
      left, top = (rw - w) // 2, (rh - h) // 2
      im = im.crop((left, top, left + w, top + h))
      return torch.from_numpy(np.array(im, dtype=np.uint8)), label  # a writable copy, as torchvision makes

  torch.manual_seed(seed)
  loader = torch.utils.data.DataLoader(FolderDataset(list_images(root)), batch_size=a.batch_size, shuffle=True,
                                       num_workers=a.num_workers, drop_last=True)
  t0 = time.perf_counter()
  n = 0
  for image, _ in loader:
    check_batch("DataLoader", image, a.batch_size, size)
    n += image.shape[0]
  return {"seconds": time.perf_counter() - t0, "images": n}


def xla_child(path: str, a: argparse.Namespace, size: tuple[int, int], seed: int) -> dict:
  """(b), in its own process: one pass of loaders.xla, each batch materialised on the device."""
  import torch
  import torch_xla  # the edge: only this subprocess imports torch_xla

  from loaders import xla as xla_loader

  device = torch_xla.device()

  def touch(image: torch.Tensor) -> int:
    # A device computation reading the batch: it cannot run before the whole transfer has landed.
    return int(image[:, 0, 0, 0].to(torch.int32).sum().item())

  touch(torch.zeros((a.batch_size, *size, 3), dtype=torch.uint8, device=device))  # compile it untimed
  t0 = time.perf_counter()
  n = 0
  for batch in xla_loader.device_loader(path, SPLIT, batch_size=a.batch_size, image_size=size,
                                        num_threads=a.num_threads, shuffle=True, seed=seed, num_epochs=1):
    image = batch["image"]
    if image.device.type != "xla":
      raise RuntimeError(f"batch on {image.device}, not an XLA device")
    check_batch("xla", image, a.batch_size, size)
    touch(image)
    n += image.shape[0]
  return {"seconds": time.perf_counter() - t0, "images": n, "device": str(device)}


def jax_child(path: str, a: argparse.Namespace, size: tuple[int, int], seed: int, epochs: int) -> dict:
  """(h), in its own process: (a)'s record path through loaders.jax on a mesh of every device, each global
  batch waited on until its arrays are on the devices, and through loaders.grain (numpy), timed grain, jax,
  jax, grain; the images/s of each, the mean of its two passes (datasets built inside the timings, as in (a))."""
  import jax  # the edge: only this subprocess imports jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from loaders import jax as jax_loader

  mesh = Mesh(np.array(jax.devices()), ("data",))
  # untimed: the shards' checksums (once per process, as in (a)'s process) and a first transfer
  grain_loader.data_source(path, SPLIT).close()
  jax.device_put(np.zeros((a.batch_size, *size, 3), np.uint8), NamedSharding(mesh, PartitionSpec("data")))

  def time_jax() -> int:
    it = jax_loader.dataset(path, SPLIT, mesh=mesh, batch_size=a.batch_size, image_size=size,
                            num_threads=a.num_threads, num_epochs=epochs, shuffle=True, seed=seed)
    n = 0
    for batch in it:
      image = batch["image"].block_until_ready()
      check_batch("jax", image, a.batch_size, size)
      n += image.shape[0]
    it.close()
    return n

  grain_pass = lambda: timed_cpu(lambda: time_grain(path, a, size, seed, epochs, fast=True))
  numpy_batches = [grain_pass()]
  device_arrays = [timed_cpu(time_jax), timed_cpu(time_jax)]
  numpy_batches.append(grain_pass())
  return {"jax_images_per_s": statistics.mean(x for x, _ in device_arrays),
          "grain_images_per_s": statistics.mean(x for x, _ in numpy_batches),
          "jax_cpu_us_per_image": statistics.mean(c for _, c in device_arrays),
          "grain_cpu_us_per_image": statistics.mean(c for _, c in numpy_batches),
          "devices": len(jax.devices())}


def child_args(a: argparse.Namespace, seed: int) -> list[str]:
  return [f"--batch_size={a.batch_size}", f"--image_size={a.image_size}", f"--num_threads={a.num_threads}",
          f"--num_workers={a.num_workers}", f"--_seed={seed}"]


def timed(fn: Callable[[], int]) -> float:
  """images/s of one call of `fn` (which returns the images it yielded)."""
  t0 = time.perf_counter()
  n = fn()
  return n / (time.perf_counter() - t0)


def timed_cpu(fn: Callable[[], int]) -> tuple[float, float]:
  """(images/s, µs of this process's CPU per image) of one call of `fn` (which returns the images it yielded):
  the CPU figure is steadier than the rate on a machine other jobs share."""
  t0, c0 = time.perf_counter(), time.process_time()
  n = fn()
  return n / (time.perf_counter() - t0), (time.process_time() - c0) / n * 1e6


def from_child(result: dict) -> float:
  return result["images"] / result["seconds"]


# --------------------------------------------------------------------------- report


def paired_ratio(per_round: dict[str, list[float]], num: str, den: str) -> tuple[float, list[float]] | None:
  """The median of the per-round ratios num / den of two variants timed side by side, and those ratios."""
  if not per_round.get(num) or len(per_round[num]) != len(per_round.get(den, [])):
    return None
  ratios = [x / y for x, y in zip(per_round[num], per_round[den])]
  return statistics.median(ratios), ratios


def report(per_round: dict[str, list[float]], failures: list[str]) -> tuple[dict[str, float], list[tuple], list[tuple]]:
  """Prints the table, the targets and the costs; returns the medians, the checks (text, ratio, ok) and the costs
  (text, ratio): ratios of medians, except (h)'s and (i)'s, the median of the per-round ratios (each pair ran
  side by side in its round)."""
  medians = {v: statistics.median(xs) for v, xs in per_round.items() if xs}
  base = medians.get(DATALOADER)
  print()
  print(f"{'variant':<42} {'median img/s':>12} {'vs (c)':>7}   every round")
  for v, xs in per_round.items():
    if not xs:
      continue
    vs = f"{medians[v] / base:6.2f}x" if base else "      -"
    print(f"{v:<42} {medians[v]:12.1f} {vs:>7}   {' '.join(f'{x:.1f}' for x in xs)}")
  for f in failures:
    print(f"FAILED {f}")
  checks = []

  def check(text: str, num: str, den: str, target: float) -> None:
    if num in medians and den in medians:
      ratio = medians[num] / medians[den]
      checks.append((text, ratio, ratio >= target))

  check(f"(a) raw: the record path >= {SPEEDUP_TARGET:g}x today's loader", NEW_RAW, OLD_RAW, SPEEDUP_TARGET)
  check(f"(a) raw: the record path >= {CEILING_TARGET:.0%} of the read ceiling (e)", NEW_RAW, CEILING,
        CEILING_TARGET)
  check(f"(a) JPEG >= {JPEG_TARGET:g}x (c)", NEW_JPEG, DATALOADER, JPEG_TARGET)
  check(f"(a) raw >= {RAW_TARGET:g}x (c)", NEW_RAW, DATALOADER, RAW_TARGET)
  check(f"(g) raw: pinned and leased >= {LEASE_TARGET:.0%} of lease=False", NEW_RAW, NO_LEASE_RAW, LEASE_TARGET)
  check(f"(g) JPEG: pinned and leased >= {LEASE_TARGET:.0%} of lease=False", NEW_JPEG, NO_LEASE_JPEG, LEASE_TARGET)
  for kind, (num, den) in JAX_VARIANTS.items():
    if (got := paired_ratio(per_round, num, den)) is not None:
      ratio, ratios = got
      checks.append((f"(h) jax {kind}: device arrays >= {JAX_TARGET:g}x grain's numpy batches (per round "
                     f"{' '.join(f'{r:.2f}' for r in ratios)})", ratio, ratio >= JAX_TARGET))
  costs = []
  for kind, (num, den) in PER_EXAMPLE_VARIANTS.items():
    if (got := paired_ratio(per_round, num, den)) is not None:
      ratio, ratios = got
      costs.append((f"(i) {kind}: per example (records().batch) / fused (dataset) images/s (per round "
                    f"{' '.join(f'{r:.2f}' for r in ratios)})", ratio))
  print()
  for text, ratio, ok in checks:
    print(f"{'PASS' if ok else 'MISS'}  {text} (ratio {ratio:.2f})")
  for text, ratio in costs:
    print(f"COST  {text} (ratio {ratio:.2f})")
  return medians, checks, costs


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--work", default="bench_work", help="cache of the images and shards (git-ignored)")
  ap.add_argument("--num_images", type=int, default=2000)
  ap.add_argument("--image_size", default="224,224")
  ap.add_argument("--batch_size", type=int, default=64)
  ap.add_argument("--num_threads", type=int, default=16, help="grain's reader threads (capped at the CPUs)")
  ap.add_argument("--num_workers", type=int, default=2, help="the DataLoader's worker processes, (c)")
  ap.add_argument("--raw_epochs", type=int, default=5, help="passes per timing of the raw-shard variants")
  ap.add_argument("--xla", default="raw,jpeg", help="shard kinds for (b), comma-separated; empty: skip (b)")
  ap.add_argument("--jax", default="raw,jpeg", help="shard kinds for (h), comma-separated; empty: skip (h)")
  ap.add_argument("--per_example", default="raw,jpeg",
                  help="shard kinds for (i), comma-separated; empty: skip (i)")
  ap.add_argument("--only", default=SECTIONS,
                  help="the sections to run, comma-separated letters, e.g. h,i (default: all)")
  ap.add_argument("--rounds", type=int, default=3, help="rounds; every variant runs once per round")
  ap.add_argument("--stream", default="jpeg,raw",
                  help="shard kinds to stream from the benchmark bucket (scripts/bench_stream.py) after the loader "
                       "variants, comma-separated; empty: skip")
  ap.add_argument("--json", default=None, help="also write the results here")
  ap.add_argument("--pinning_only", action="store_true",
                  help="time only (a)'s record path with and without a lease, (g); no (b) to (f), (h) or (i)")
  ap.add_argument("--_xla_child", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--_dataloader_child", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--_jax_child", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--_epochs", type=int, default=1, help=argparse.SUPPRESS)
  ap.add_argument("--_seed", type=int, default=0, help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.rounds < 1 or a.num_images < 1 or a.batch_size < 1 or a.num_threads < 1 or a.raw_epochs < 1:
    ap.error("--rounds, --num_images, --batch_size, --num_threads and --raw_epochs must be >= 1")
  if a.num_workers < 0:
    ap.error("--num_workers must be >= 0")
  xla_kinds = [k for k in a.xla.split(",") if k] if not a.pinning_only else []
  jax_kinds = [k for k in a.jax.split(",") if k] if not a.pinning_only else []
  per_example_kinds = [k for k in a.per_example.split(",") if k] if not a.pinning_only else []
  sections = set(a.only.replace(",", ""))
  if not sections or sections - set(SECTIONS):
    ap.error(f"--only takes letters of {SECTIONS}, comma-separated, got {a.only!r}")
  stream_kinds = [k for k in a.stream.split(",") if k] if not a.pinning_only else []
  if set(stream_kinds) - {"raw", "jpeg"}:
    ap.error(f"--stream takes raw and/or jpeg, got {a.stream!r}")
  if set(xla_kinds) - {"raw", "jpeg"}:
    ap.error(f"--xla takes raw and/or jpeg, got {a.xla!r}")
  if set(jax_kinds) - {"raw", "jpeg"}:
    ap.error(f"--jax takes raw and/or jpeg, got {a.jax!r}")
  if set(per_example_kinds) - {"raw", "jpeg"}:
    ap.error(f"--per_example takes raw and/or jpeg, got {a.per_example!r}")
  if "f" not in sections:
    stream_kinds = []
  size = tuple(int(v) for v in a.image_size.split(","))

  if a._xla_child:
    print(json.dumps(xla_child(a._xla_child, a, size, a._seed)), flush=True)
    return 0
  if a._dataloader_child:
    print(json.dumps(dataloader_child(a._dataloader_child, a, size, a._seed)), flush=True)
    return 0
  if a._jax_child:
    print(json.dumps(jax_child(a._jax_child, a, size, a._seed, a._epochs)), flush=True)
    return 0

  logging.basicConfig(level=logging.WARNING)
  for noisy in ("apache_beam", "google", "urllib3", "absl"):
    logging.getLogger(noisy).setLevel(logging.WARNING)

  work = os.path.abspath(a.work)
  root, n = bench_image_folder.ensure_images(work, a.num_images)
  shards = {kind: ensure_shards(work, root, kind, size) for kind in ("jpeg", "raw")}
  cached = warm([p for p, _ in list_images(root)] + [p for out in shards.values() for p in shard_files(out)])
  print(f"{n} images, image_size={a.image_size} batch_size={a.batch_size} num_threads={a.num_threads} "
        f"(grain uses {threads_of(a)}) num_workers={a.num_workers} raw_epochs={a.raw_epochs} rounds={a.rounds} "
        f"cpus={os.cpu_count()} (page cache warmed: {cached / 1e6:.0f} MB)", flush=True)

  raw_source = ShardedRecords(shards["raw"], SPLIT, lease=False)  # (d), (e) time reads only
  xla_env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1",
             "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
  jax_env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={JAX_DEVICES}"}
  e = a.raw_epochs
  variants: dict[str, Callable[[int], float]] = {
      DATALOADER: lambda seed: from_child(run_child([f"--_dataloader_child={root}", *child_args(a, seed)])),
      NEW_JPEG: lambda seed: timed(lambda: time_grain(shards["jpeg"], a, size, seed, 1, fast=True)),
      OLD_JPEG: lambda seed: timed(lambda: time_grain(shards["jpeg"], a, size, seed, 1, fast=False)),
      NEW_RAW: lambda seed: timed(lambda: time_grain(shards["raw"], a, size, seed, e, fast=True)),
      OLD_RAW: lambda seed: timed(lambda: time_grain(shards["raw"], a, size, seed, e, fast=False)),
      CEILING: lambda seed: timed(lambda: time_ceiling(raw_source, a, size, seed, e)),
      BARE: lambda seed: timed(lambda: time_bare_reads(raw_source, e)),
      NO_LEASE_JPEG: lambda seed: timed(lambda: time_grain(shards["jpeg"], a, size, seed, 1, fast=True, lease=False)),
      NO_LEASE_RAW: lambda seed: timed(lambda: time_grain(shards["raw"], a, size, seed, e, fast=True, lease=False)),
  }
  if a.pinning_only:
    variants = {v: variants[v] for v in (NEW_JPEG, NO_LEASE_JPEG, NEW_RAW, NO_LEASE_RAW)}
  for kind in xla_kinds:
    label = f"(b) xla CPU device, {'JPEG' if kind == 'jpeg' else kind} shards"
    variants[label] = (lambda kind: lambda seed: from_child(
        run_child([f"--_xla_child={shards[kind]}", *child_args(a, seed)], env=xla_env)))(kind)
  names = list(variants) + [JAX_VARIANTS[kind][0] for kind in jax_kinds] + [
      PER_EXAMPLE_VARIANTS[kind][0] for kind in per_example_kinds]
  names = [v for v in names if v[1] in sections]  # every label starts with "(<section>)"
  per_round: dict[str, list[float]] = {v: [] for v in names}

  jax_cpu: dict[str, list[tuple[float, float]]] = {}  # (h) kind: (jax, grain) µs of CPU per image, per round

  def time_jax(kind: str, seed: int) -> float:
    """(h): the child's jax figure; its grain figure goes to the baseline's rounds."""
    got = run_child([f"--_jax_child={shards[kind]}", f"--_epochs={e if kind == 'raw' else 1}", *child_args(a, seed)],
                    env=jax_env)
    per_round.setdefault(JAX_VARIANTS[kind][1], []).append(got["grain_images_per_s"])
    jax_cpu.setdefault(kind, []).append((got["jax_cpu_us_per_image"], got["grain_cpu_us_per_image"]))
    return got["jax_images_per_s"]

  for kind in jax_kinds:  # the same passes as (a)'s record path of its kind
    variants[JAX_VARIANTS[kind][0]] = functools.partial(time_jax, kind)

  def time_per_example(kind: str, seed: int) -> float:
    """(i): fused, per example, per example, fused; the mean per-example figure (the fused one goes to the
    baseline's rounds)."""
    epochs = e if kind == "raw" else 1
    fused = lambda: timed(lambda: time_grain(shards[kind], a, size, seed, epochs, fast=True))
    per_example = lambda: timed(lambda: time_records(shards[kind], a, size, seed, epochs))
    got = [fused(), per_example(), per_example(), fused()]
    per_round.setdefault(PER_EXAMPLE_VARIANTS[kind][1], []).append(statistics.mean(got[::3]))
    return statistics.mean(got[1:3])

  for kind in per_example_kinds:
    variants[PER_EXAMPLE_VARIANTS[kind][0]] = functools.partial(time_per_example, kind)
  failures: dict[str, str] = {}
  for r in range(a.rounds):
    order = names[r % len(names):] + names[:r % len(names)]  # rotated: no variant always runs first or last
    if a.pinning_only:  # lease on and off, A B B A per kind: a round's figure is the mean of both places
      order = [NEW_JPEG, NO_LEASE_JPEG, NO_LEASE_JPEG, NEW_JPEG, NEW_RAW, NO_LEASE_RAW, NO_LEASE_RAW, NEW_RAW]
    for v in order:
      if v in failures:
        continue
      try:
        per_round[v].append(variants[v](r))
      except RuntimeError as err:  # a child that failed (torch_xla missing, ...): reported, the rest goes on
        failures[v] = str(err)
      print(f"round {r + 1}/{a.rounds}: {v}: {per_round[v][-1]:.1f} images/s" if v not in failures
            else f"round {r + 1}/{a.rounds}: {v}: FAILED", flush=True)
    if a.pinning_only:
      for v in names:
        if len(per_round[v]) > r + 1:  # its two runs of this round: one figure
          per_round[v][r:] = [statistics.mean(per_round[v][r:])]
  medians, checks, costs = report(per_round, [f"{v}: {why}" for v, why in failures.items()])
  cpu = {kind: {"jax": statistics.median(j for j, _ in xs), "grain": statistics.median(g for _, g in xs)}
         for kind, xs in jax_cpu.items()}
  for kind, c in cpu.items():
    print(f"CPU   (h) jax {kind}: {c['jax']:.0f} us of CPU per image, grain {c['grain']:.0f} "
          f"({c['jax'] / c['grain']:.2f}x; per round {' '.join(f'{j:.0f}/{g:.0f}' for j, g in jax_cpu[kind])})")
  streaming = None
  if stream_kinds:
    streaming = bench_stream.run(a.work, a.num_images, stream_kinds, rounds=a.rounds, num_threads=a.num_threads)
    bench_stream.print_report(streaming)

  if a.json:
    out = {
        "num_images": n, "image_size": a.image_size, "batch_size": a.batch_size, "num_threads": a.num_threads,
        "grain_threads": threads_of(a), "num_workers": a.num_workers, "raw_epochs": a.raw_epochs,
        "rounds": a.rounds, "cpus": os.cpu_count(),
        "results": [{"variant": v, "median_images_per_s": medians[v], "rounds_images_per_s": per_round[v]}
                    for v in per_round if per_round[v]],
        "failures": failures,
        "checks": [{"check": t, "ratio": x, "pass": ok} for t, x, ok in checks],
        "costs": [{"cost": t, "ratio": x} for t, x in costs],
        "jax_cpu_us_per_image": cpu,
        "streaming": streaming,
    }
    with open(a.json, "w") as f:
      json.dump(out, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
