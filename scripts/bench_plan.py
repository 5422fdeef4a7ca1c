"""Benchmarks the shard plan at scale: the launcher's plan at ImageNet size, and the workers'
bounded-memory plan on 100 M synthetic records, with peak memory measured.

    python scripts/bench_plan.py [--records=100000000] [--record_bytes=110000] [--workers=100]
        [--launcher_files=1281167] [--beam_units=200000] [--parts=launcher,workers,beam] [--json=out.json]

Parts (each in its own subprocess, so that each peak RSS is its own):
 1. launcher: `shards.plan_in_memory` on `--launcher_files` ImageNet-like units (1000 class
    folders, names like `n01440764/n01440764_10026.JPEG`, InputFile units, 110 KB each):
    the time, the peak RSS, and the compressed plan the job carries (`ShardTask.units_blob`).
 2. workers: the distributed plan's algorithm on `--records` synthetic sort keys (16 random
    bytes each: sort keys are uniform 16-byte hashes), streamed in chunks of 1 M as the workers'
    bundles would be, with the module's own functions: pass 1 the 64 Ki-bucket histogram
    (`layout_from_histogram`), pass 2 each boundary's exact key (`boundary_keys`, bucket range
    by bucket range), pass 3 the shard of every key (`shard_of`'s rule, vectorised) to check
    that shard sizes differ by at most one. Reports the peak RSS of the process, and what one
    worker holds at each step: the histogram, the largest boundary bucket, the largest shard's
    plan. Sort-key hashing is timed separately (1 M keys with `shards.sort_key`) for the
    extrapolation.
 3. beam: `PlanOnWorkers` on the in-process DirectRunner over `--beam_units` units, checked
    equal to `plan_in_memory`, timed.

Prints a table; exits 0 unless a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from pipelines.core import shards  # noqa: E402
from pipelines.core.shards import sort_key  # noqa: E402
from pipelines.core.sink import DEFAULT_TARGET_SHARD_BYTES  # noqa: E402

CHUNK = 1_000_000


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def imagenet_units(n: int):
  from pipelines.core.inputs import InputFile  # pylint: disable=import-outside-toplevel
  per_class = -(-n // 1000)
  for i in range(n):
    cls = f"n{1440764 + i // per_class:08d}"
    rel = f"{cls}/{cls}_{10026 + i % per_class}.JPEG"
    yield shards.PlanUnit("train", rel, (("train", cls), InputFile(f"gs://bucket/imagenet/train/{rel}")), 110_000)


def part_launcher(a) -> dict:
  rss0 = peak_rss_mb()
  t0 = time.perf_counter()
  units = list(imagenet_units(a.launcher_files))
  t1 = time.perf_counter()
  tasks = shards.plan_in_memory(units, 0, 0, DEFAULT_TARGET_SHARD_BYTES, 2 * a.workers)
  t2 = time.perf_counter()
  blob = sum(len(t.units_blob) for t in tasks)
  sizes = [t.num_units for t in tasks]
  assert max(sizes) - min(sizes) <= 1 and sum(sizes) == a.launcher_files
  return {"files": a.launcher_files, "shards": len(tasks), "listing_to_units_s": t1 - t0, "plan_s": t2 - t1,
          "plan_blob_mb": blob / 1e6, "peak_rss_mb": peak_rss_mb(), "rss_before_mb": rss0}


def _chunks(n: int, seed: int):
  rng = np.random.default_rng(seed)
  done = 0
  while done < n:
    k = min(CHUNK, n - done)
    yield np.frombuffer(rng.bytes(16 * k), dtype="S16")
    done += k


def _buckets(keys: np.ndarray) -> np.ndarray:
  b = keys.view(np.uint8).reshape(-1, 16)
  return (b[:, 0].astype(np.int64) << 8) | b[:, 1]


def part_workers(a) -> dict:
  n, seed = a.records, 1
  # Sort-key hashing, timed on 1 M keys (the workers hash every unit once).
  t = time.perf_counter()
  for i in range(CHUNK):
    sort_key(0, "train", f"n01440764/n01440764_{i}.JPEG")
  hash_us = (time.perf_counter() - t) / CHUNK * 1e6

  t0 = time.perf_counter()
  counts = np.zeros(shards.NUM_BUCKETS, np.int64)
  for keys in _chunks(n, seed):  # pass 1: the histogram (one worker's combine holds 512 KiB)
    counts += np.bincount(_buckets(keys), minlength=shards.NUM_BUCKETS)
  layout = shards.layout_from_histogram(counts, n * a.record_bytes, 0, DEFAULT_TARGET_SHARD_BYTES, 2 * a.workers)
  t1 = time.perf_counter()

  # Pass 2: the exact boundary keys, a range of buckets at a time (on the workers, one
  # bucket per group: the largest group is what one worker holds).
  boundary_buckets = np.array(sorted(layout.located), np.int64)
  found: list[tuple[int, bytes]] = []
  ranges = 16
  step = shards.NUM_BUCKETS // ranges
  for r in range(ranges):
    lo, hi = r * step, (r + 1) * step
    wanted = boundary_buckets[(boundary_buckets >= lo) & (boundary_buckets < hi)]
    if not len(wanted):
      continue
    table = np.zeros(shards.NUM_BUCKETS, bool)
    table[wanted] = True
    held = np.sort(np.concatenate([keys[table[_buckets(keys)]] for keys in _chunks(n, seed)]))
    held_b = _buckets(held)  # sorted keys: each bucket's keys are contiguous, in order
    starts = np.searchsorted(held_b, wanted, side="left")
    ends = np.searchsorted(held_b, wanted, side="right")
    for bucket, s0, s1 in zip(wanted, starts, ends):
      found += shards.boundary_keys(list(held[s0:s1]), layout.located[int(bucket)])
    del held, held_b
  boundaries = np.array([k for _, k in sorted(found)], dtype="S16")
  t2 = time.perf_counter()

  per_shard = np.zeros(layout.num_shards, np.int64)
  for keys in _chunks(n, seed):  # pass 3: every key's shard (bisect_right on the boundaries)
    per_shard += np.bincount(np.searchsorted(boundaries, keys, side="right"), minlength=layout.num_shards)
  t3 = time.perf_counter()
  assert per_shard.sum() == n and per_shard.max() - per_shard.min() <= 1, (per_shard.min(), per_shard.max())
  return {
      "records": n, "shards": layout.num_shards, "boundary_buckets": len(layout.located),
      "largest_bucket_keys": int(counts.max()), "mean_bucket_keys": float(counts.mean()),
      "shard_units_min": int(per_shard.min()), "shard_units_max": int(per_shard.max()),
      "histogram_kib": counts.nbytes / 1024, "pass1_s": t1 - t0, "pass2_s": t2 - t1, "pass3_s": t3 - t2,
      "sort_key_us": hash_us, "peak_rss_mb": peak_rss_mb(),
  }


def part_beam(a) -> dict:
  import apache_beam as beam  # pylint: disable=import-outside-toplevel
  units = [shards.PlanUnit("train", f"c{i % 1000}/f{i}.jpg", i, 100_000) for i in range(a.beam_units)]
  from apache_beam.testing.util import assert_that, equal_to  # pylint: disable=import-outside-toplevel
  want = [(t.index, t.num_shards, t.units()) for t in shards.plan_in_memory(units, 0, 0, 1 << 27, 8)]
  t0 = time.perf_counter()
  with beam.Pipeline(argv=["--direct_num_workers=1", "--direct_running_mode=in_memory"]) as p:
    tasks, _ = p | beam.Create(units) | shards.PlanOnWorkers(0, 0, 1 << 27, 8)
    assert_that(tasks | beam.Map(lambda t: (t.index, t.num_shards, t.units())), equal_to(want))
  seconds = time.perf_counter() - t0
  return {"units": a.beam_units, "shards": len(want), "seconds": seconds, "units_per_s": a.beam_units / seconds,
          "peak_rss_mb": peak_rss_mb()}


PARTS = {"launcher": part_launcher, "workers": part_workers, "beam": part_beam}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--records", type=int, default=100_000_000)
  ap.add_argument("--record_bytes", type=int, default=110_000, help="estimated output bytes per record")
  ap.add_argument("--workers", type=int, default=100, help="workers the plan balances over (>= 2 shards each)")
  ap.add_argument("--launcher_files", type=int, default=1_281_167)
  ap.add_argument("--beam_units", type=int, default=200_000)
  ap.add_argument("--parts", default="launcher,workers,beam")
  ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run one part in this process
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  if a.one:
    print(json.dumps(PARTS[a.one](a)))
    return 0
  results = {}
  for part in a.parts.split(","):
    if part not in PARTS:
      ap.error(f"--parts: unknown part {part!r} (known: {', '.join(PARTS)})")
    args = [sys.executable, os.path.abspath(__file__), f"--one={part}"] + [
        f"--{k}={v}" for k, v in vars(a).items() if k not in ("one", "parts", "json")]
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode:
      print(proc.stderr, file=sys.stderr)
      return 1
    results[part] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{part}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                  for k, v in results[part].items()), flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
