"""Benchmarks the loaders (grain, torch_xla) against a torch DataLoader over the image folder.

    python scripts/bench_loaders.py [--work=bench_work] [--num_images=2000]
        [--batch_size=64] [--num_threads=16] [--num_workers=2] [--xla=raw,jpeg]
        [--repeats=1] [--json=results.json]

On the cached folder of ~500x375 JPEGs that scripts/bench_image_folder.py
generates, converts (once, cached under --work) ArrayRecord shards at 224x224,
JPEG-encoded and raw, then times one shuffled pass of uint8 [64, 224, 224, 3]
batches from: (a) loaders.grain over both shard kinds, (b) loaders.xla on the
XLA CPU device (a subprocess: torch_xla never shares a process with
TensorFlow), (c) the baseline users have now, a torch DataLoader over the
folder (PIL, 2 workers), and (d) the bare record reads of the raw shards (the
I/O ceiling). Page caches are warmed first. Prints a table and the targets;
exits 0 whether they are met or not (this is a report), non-zero only on errors.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
from PIL import Image as PILImage
import torch
import torch.utils.data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

import bench_image_folder  # noqa: E402
from formats import load_manifest  # noqa: E402
from loaders import ShardedRecords, grain as grain_loader  # noqa: E402
from pipelines import image_folder  # noqa: E402

SPLIT = "train"
JPEG_TARGET = 5.0  # (a) JPEG shards: at least this times the DataLoader's images/s
RAW_TARGET = 20.0  # (a) raw shards: at least this times the DataLoader's images/s
CEILING_TARGET = 0.70  # (a) raw shards: at least this fraction of the bare reads' images/s
XLA_TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Result:
  variant: str
  seconds: float  # best of the repeats
  images: int

  @property
  def images_per_s(self) -> float:
    return self.images / self.seconds


def ensure_shards(work: str, root: str, encoding: str, size: tuple[int, int]) -> str:
  """The cached ArrayRecord output of `image_folder` for `root` (converted on first use)."""
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


class FolderDataset(torch.utils.data.Dataset):
  """The usual torchvision-free baseline: PIL open, RGB, resize the shorter side, center crop."""

  def __init__(self, root: str, size: tuple[int, int]):
    self.items = list_images(root)
    self.size = size

  def __len__(self) -> int:
    return len(self.items)

  def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
    path, label = self.items[i]
    h, w = self.size
    with PILImage.open(path) as im:
      im = im.convert("RGB")
    scale = max(h / im.height, w / im.width)
    rw, rh = max(w, round(im.width * scale)), max(h, round(im.height * scale))
    im = im.resize((rw, rh), PILImage.Resampling.BILINEAR)
    left, top = (rw - w) // 2, (rh - h) // 2
    im = im.crop((left, top, left + w, top + h))
    return torch.from_numpy(np.array(im, dtype=np.uint8)), label  # a writable copy, as torchvision makes


def check_batch(variant: str, image, batch_size: int, size: tuple[int, int]) -> None:
  shape, dtype = tuple(image.shape), str(image.dtype).replace("torch.", "")
  if shape != (batch_size, *size, 3) or dtype != "uint8":
    raise RuntimeError(f"{variant}: batch of {dtype} {shape}, expected uint8 {(batch_size, *size, 3)}")


def time_dataloader(root: str, a: argparse.Namespace, size: tuple[int, int]) -> int:
  """(c): one shuffled pass of torch's DataLoader over the folder; returns the images yielded."""
  loader = torch.utils.data.DataLoader(FolderDataset(root, size), batch_size=a.batch_size, shuffle=True,
                                       num_workers=a.num_workers, drop_last=True)
  n = 0
  for image, _ in loader:
    check_batch("DataLoader", image, a.batch_size, size)
    n += image.shape[0]
  return n


def time_grain(path: str, a: argparse.Namespace, size: tuple[int, int]) -> int:
  """(a): one shuffled pass of loaders.grain; returns the images yielded."""
  ds = grain_loader.dataset(path, SPLIT, batch_size=a.batch_size, image_size=size, num_threads=a.num_threads,
                            num_epochs=1, shuffle=True, seed=0)
  n = 0
  for batch in ds:
    check_batch("grain", batch["image"], a.batch_size, size)
    n += batch["image"].shape[0]
  return n


def time_bare_reads(path: str) -> int:
  """(d): every record's bytes through ShardedRecords.raw, no decoding; returns the records read."""
  source = ShardedRecords(path, SPLIT)
  num_bytes = 0
  for i in range(len(source)):
    num_bytes += len(source.raw(i))
  if num_bytes == 0:
    raise RuntimeError(f"{path}: read no bytes")
  return len(source)


def best_of(variant: str, repeats: int, fn: Callable[[], int]) -> Result:
  """Runs `fn` `repeats` times; keeps the best time (all runs must yield as many images)."""
  times, counts = [], set()
  for _ in range(repeats):
    t0 = time.perf_counter()
    counts.add(fn())
    times.append(time.perf_counter() - t0)
  if len(counts) != 1:
    raise RuntimeError(f"{variant}: the runs yielded different image counts {sorted(counts)}")
  return Result(variant, min(times), counts.pop())


def xla_child(path: str, batch_size: int, size: tuple[int, int], num_threads: int, repeats: int) -> dict:
  """(b), in its own process: one pass of loaders.xla per repeat, each batch materialised on the device."""
  import torch_xla  # the edge: only this subprocess imports torch_xla

  from loaders import xla as xla_loader

  device = torch_xla.device()

  def touch(image: torch.Tensor) -> int:
    # A device computation reading the batch: it cannot run before the whole transfer has landed.
    return int(image[:, 0, 0, 0].to(torch.int32).sum().item())

  touch(torch.zeros((batch_size, *size, 3), dtype=torch.uint8, device=device))  # compile it untimed
  times, n = [], 0
  for _ in range(repeats):
    t0 = time.perf_counter()
    n = 0
    for batch in xla_loader.device_loader(path, SPLIT, batch_size=batch_size, image_size=size,
                                          num_threads=num_threads, shuffle=True, seed=0, num_epochs=1):
      image = batch["image"]
      if image.device.type != "xla":
        raise RuntimeError(f"batch on {image.device}, not an XLA device")
      check_batch("xla", image, batch_size, size)
      touch(image)
      n += image.shape[0]
    times.append(time.perf_counter() - t0)
  return {"seconds": min(times), "images": n, "device": str(device)}


def time_xla(variant: str, path: str, a: argparse.Namespace) -> Result | str:
  """(b) in a subprocess with PJRT_DEVICE=CPU; the Result, or the reason it failed."""
  env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1",
         "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
  cmd = [sys.executable, os.path.abspath(__file__), f"--_xla_child={path}", f"--batch_size={a.batch_size}",
         f"--image_size={a.image_size}", f"--num_threads={a.num_threads}", f"--repeats={a.repeats}"]
  try:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=XLA_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    return f"timed out after {XLA_TIMEOUT_S}s"
  lines = p.stdout.strip().splitlines()
  if p.returncode != 0 or not lines:
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return f"exit {p.returncode}: " + " | ".join(tail)
  report = json.loads(lines[-1])
  return Result(variant, report["seconds"], report["images"])


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--work", default="bench_work", help="cache of the images and shards (git-ignored)")
  ap.add_argument("--num_images", type=int, default=2000)
  ap.add_argument("--image_size", default="224,224")
  ap.add_argument("--batch_size", type=int, default=64)
  ap.add_argument("--num_threads", type=int, default=16, help="grain's reader threads, (a) and (b)")
  ap.add_argument("--num_workers", type=int, default=2, help="the DataLoader's worker processes, (c)")
  ap.add_argument("--xla", default="raw,jpeg", help="shard kinds for (b), comma-separated; empty: skip (b)")
  ap.add_argument("--repeats", type=int, default=1)
  ap.add_argument("--json", default=None, help="also write the results here")
  ap.add_argument("--_xla_child", default=None, help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.repeats < 1 or a.num_images < 1 or a.batch_size < 1 or a.num_threads < 1 or a.num_workers < 0:
    ap.error("--repeats, --num_images, --batch_size and --num_threads must be >= 1, --num_workers >= 0")
  xla_kinds = [k for k in a.xla.split(",") if k]
  if set(xla_kinds) - {"raw", "jpeg"}:
    ap.error(f"--xla takes raw and/or jpeg, got {a.xla!r}")
  size = tuple(int(v) for v in a.image_size.split(","))

  if a._xla_child:
    print(json.dumps(xla_child(a._xla_child, a.batch_size, size, a.num_threads, a.repeats)), flush=True)
    return 0

  logging.basicConfig(level=logging.WARNING)
  for noisy in ("apache_beam", "google", "urllib3", "absl"):
    logging.getLogger(noisy).setLevel(logging.WARNING)

  work = os.path.abspath(a.work)
  root, n = bench_image_folder.ensure_images(work, a.num_images)
  shards = {kind: ensure_shards(work, root, kind, size) for kind in ("jpeg", "raw")}
  cached = warm([p for p, _ in list_images(root)] + [p for out in shards.values() for p in shard_files(out)])
  print(f"{n} images, image_size={a.image_size} batch_size={a.batch_size} num_threads={a.num_threads} "
        f"num_workers={a.num_workers} repeats={a.repeats} cpus={os.cpu_count()} "
        f"(page cache warmed: {cached / 1e6:.0f} MB)", flush=True)

  # The DataLoader forks its workers: run it before any grain thread pool exists.
  base = best_of("(c) torch DataLoader, folder", a.repeats, lambda: time_dataloader(root, a, size))
  results = [
      best_of("(a) grain, JPEG shards", a.repeats, lambda: time_grain(shards["jpeg"], a, size)),
      best_of("(a) grain, raw shards", a.repeats, lambda: time_grain(shards["raw"], a, size)),
  ]
  failures = []
  for kind in xla_kinds:
    label = f"(b) xla CPU device, {'JPEG' if kind == 'jpeg' else kind} shards"
    r = time_xla(label, shards[kind], a)
    if isinstance(r, Result):
      results.append(r)
    else:
      failures.append(f"{label}: {r}")
  ceiling = best_of("(d) bare reads, raw shards", a.repeats, lambda: time_bare_reads(shards["raw"]))
  results += [base, ceiling]

  print()
  print(f"{'variant':<34} {'seconds':>8} {'images/s':>9} {'vs (c)':>7}")
  for r in results:
    print(f"{r.variant:<34} {r.seconds:8.2f} {r.images_per_s:9.1f} {r.images_per_s / base.images_per_s:6.2f}x")
  for f in failures:
    print(f"FAILED {f}")
  jpeg, raw = results[0], results[1]
  checks = [
      (f"(a) JPEG >= {JPEG_TARGET:g}x (c)", jpeg.images_per_s / base.images_per_s,
       jpeg.images_per_s >= JPEG_TARGET * base.images_per_s),
      (f"(a) raw >= {RAW_TARGET:g}x (c)", raw.images_per_s / base.images_per_s,
       raw.images_per_s >= RAW_TARGET * base.images_per_s),
      (f"(a) raw >= {CEILING_TARGET:.0%} of (d)", raw.images_per_s / ceiling.images_per_s,
       raw.images_per_s >= CEILING_TARGET * ceiling.images_per_s),
  ]
  print()
  for text, ratio, ok in checks:
    print(f"{'PASS' if ok else 'MISS'}  {text} (ratio {ratio:.2f})")

  if a.json:
    report = {
        "num_images": n, "image_size": a.image_size, "batch_size": a.batch_size, "num_threads": a.num_threads,
        "num_workers": a.num_workers, "repeats": a.repeats, "cpus": os.cpu_count(),
        "results": [{"variant": r.variant, "seconds": r.seconds, "images": r.images,
                     "images_per_s": r.images_per_s, "ratio": r.images_per_s / base.images_per_s}
                    for r in results],
        "failures": failures,
        "checks": [{"check": t, "ratio": x, "pass": ok} for t, x, ok in checks],
    }
    with open(a.json, "w") as f:
      json.dump(report, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
