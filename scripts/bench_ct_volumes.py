"""Benchmarks CT volume assembly against SimpleITK's ImageSeriesReader, and the pipeline.

    python scripts/bench_ct_volumes.py [--work=bench_work] [--series=4]
        [--slices_per_series=500] [--rounds=3] [--json=results.json]

Generates (once, cached under --work) `--series` uncompressed 512x512 axial
series (`make_sample_ct.write_big_series`, one subfolder each, seeds 0, 1, ...)
and keeps their HU truth beside them. After one untimed pass that reads every
file's bytes (page cache warm), it times on the same files, in order:
SimpleITK's `ImageSeriesReader` down to a numpy array, the toolkit's bare
assembly (`read_slices` → `plan_volumes` → `read_volume`), and `ct_volumes.run`
on the in-process DirectRunner (which also encodes and writes shards). Then it
checks, series by series, that the assembly equals SimpleITK (padding mapped
to -1024, which SimpleITK ignores) and the truth, and that the manifest has
one record per series. Prints a table and the target; exits 0 whether it is
met or not (this is a report), non-zero on errors and failed checks.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import dataclasses
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

import numpy as np  # noqa: E402
import SimpleITK as sitk  # noqa: E402

from formats import load_manifest  # noqa: E402
from pipelines import ct_volumes  # noqa: E402
from formats.kinds import CT_PADDING_HU as PADDING_HU  # noqa: E402
from pipelines.ct_volumes.assembly import VolumePlan, plan_volumes, read_volume  # noqa: E402
from pipelines.ct_volumes.headers import read_slices  # noqa: E402
import make_sample_ct  # noqa: E402

SALT = "bench"
VOLUME_DTYPE = "int16"  # write_big_series: slope 1, intercept -1024


@dataclasses.dataclass(frozen=True)
class Result:
  variant: str
  seconds: float  # median over the rounds
  slices: int
  ratio: float = 1.0  # median over the rounds of (this variant's time / SimpleITK's in that round)

  @property
  def slices_per_s(self) -> float:
    return self.slices / self.seconds


@dataclasses.dataclass(frozen=True)
class CtInput:
  """The cached input: one subfolder per series, and each series' HU truth as .npy."""

  root: str
  series: tuple[str, ...]  # series folders, sorted
  truth: tuple[str, ...]  # .npy per series, same order
  slices: int


def ensure_series(work: str, num_series: int, slices_per_series: int) -> CtInput:
  """The cached input tree (generated on first use)."""
  root = os.path.join(work, f"ct_{num_series}x{slices_per_series}")
  truth_dir = root + "_truth"  # outside the input tree: the pipeline reads every file under it
  done = root + ".done"  # beside the folder: a file inside would be a stray input
  names = [f"series_{k:02d}" for k in range(num_series)]
  if not os.path.exists(done):
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(truth_dir, ignore_errors=True)
    os.makedirs(truth_dir)
    t0 = time.perf_counter()
    for k, name in enumerate(names):
      truth = make_sample_ct.write_big_series(os.path.join(root, name), slices_per_series, seed=k)
      np.save(os.path.join(truth_dir, name + ".npy"), truth.hu)
      del truth
      gc.collect()
    with open(done, "w") as f:
      f.write(f"{num_series * slices_per_series}\n")
    print(f"generated {num_series} x {slices_per_series} slices in {root} "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)
  with open(done) as f:
    n = int(f.read())
  return CtInput(root, tuple(os.path.join(root, s) for s in names),
                 tuple(os.path.join(truth_dir, s + ".npy") for s in names), n)


def _files(folder: str) -> list[str]:
  return [os.path.join(folder, f) for f in sorted(os.listdir(folder))]


def warm_page_cache(data: CtInput) -> int:
  """Reads every input file's bytes once (untimed); returns the bytes read."""
  total = 0
  for folder in data.series:
    for path in _files(folder):
      with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
          total += len(chunk)
  return total


def read_sitk(folder: str) -> np.ndarray:
  """The baseline: GDCM's file sorting, ImageSeriesReader, then a numpy array."""
  reader = sitk.ImageSeriesReader()
  reader.SetFileNames(sitk.ImageSeriesReader.GetGDCMSeriesFileNames(folder))
  return sitk.GetArrayFromImage(reader.Execute())


def plan_series(folder: str) -> VolumePlan:
  """Headers of every file in `folder` → the one volume plan they make."""
  slices = []
  for path in _files(folder):
    with open(path, "rb") as f:
      slices += read_slices(f, path, SALT)
  plans, rejected = plan_volumes(slices)
  if len(plans) != 1 or rejected:
    raise RuntimeError(f"{folder}: {len(plans)} plans, {len(rejected)} files rejected ({rejected[:3]})")
  return plans[0]


def read_assembly(folder: str) -> np.ndarray:
  """The toolkit's bare assembly of one series folder."""
  volume, _ = read_volume(plan_series(folder), lambda p: open(p, "rb"), VOLUME_DTYPE)
  return volume


def run_per_series(data: CtInput, read: Callable[[str], np.ndarray]) -> int:
  """`read` on each series, freeing each volume before the next; returns the slices read."""
  n = 0
  for folder in data.series:
    volume = read(folder)
    n += volume.shape[0]
    del volume
    gc.collect()
  return n


def run_pipeline(data: CtInput, output: str) -> int:
  """`ct_volumes.run` on the in-process DirectRunner; returns the records in the manifest."""
  ct_volumes.run([
      f"--input={data.root}", f"--output={output}", f"--id_salt={SALT}", "--overwrite=true",
      "--runner=DirectRunner", "--splits=train=1.0",
  ])
  gc.collect()
  return load_manifest(output).num_records


def alternated(variants: Sequence[tuple[str, Callable[[], object]]], rounds: int, slices: int) -> list[Result]:
  """Each round runs every variant once, in order (the shared machine swings between runs: a
  round measures all of them under the same load); medians of the times and of the ratios to
  the first variant's time in the same round."""
  times: dict[str, list[float]] = {name: [] for name, _ in variants}
  for r in range(rounds):
    for name, fn in variants:
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
    print(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()), flush=True)
  base = times[variants[0][0]]
  return [Result(name, statistics.median(times[name]), slices,
                 statistics.median(t / b for t, b in zip(times[name], base))) for name, _ in variants]


def check_volumes(data: CtInput) -> list[tuple[str, bool]]:
  """Per series: assembly == SimpleITK (its padding mapped to -1024) and assembly == truth."""
  checks = []
  for folder, truth_path in zip(data.series, data.truth):
    name = os.path.basename(folder)
    plan = plan_series(folder)
    volume, _ = read_volume(plan, lambda p: open(p, "rb"), VOLUME_DTYPE)
    ref = read_sitk(folder).astype(np.float64)
    s = plan.slices[0]
    if s.padding is not None:  # SimpleITK rescales padding like any stored value
      lo, hi = sorted((s.padding[0] * s.slope + s.intercept, s.padding[1] * s.slope + s.intercept))
      ref[(ref >= lo) & (ref <= hi)] = PADDING_HU
    checks.append((f"{name}: assembly == SimpleITK (padding -> {PADDING_HU})",
                   np.array_equal(volume, ref.astype(volume.dtype))))
    del ref
    truth = np.load(truth_path, mmap_mode="r")
    checks.append((f"{name}: assembly == truth", np.array_equal(volume, np.asarray(truth).astype(volume.dtype))))
    del truth, volume
    gc.collect()
  return checks


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--work", default="bench_work", help="cache of the input and outputs (git-ignored)")
  ap.add_argument("--series", type=int, default=4)
  ap.add_argument("--slices_per_series", type=int, default=500)
  ap.add_argument("--rounds", type=int, default=3, help="rounds; every round runs each variant once")
  ap.add_argument("--json", default=None, help="also write the results here")
  a = ap.parse_args(argv)
  if a.rounds < 1 or a.series < 1 or a.slices_per_series < 2:
    ap.error("--rounds and --series must be >= 1, --slices_per_series >= 2")

  logging.basicConfig(level=logging.WARNING)
  for noisy in ("apache_beam", "google", "urllib3", "absl"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  sitk.ProcessObject.SetGlobalWarningDisplay(False)

  work = os.path.abspath(a.work)
  data = ensure_series(work, a.series, a.slices_per_series)
  n = data.slices
  t0 = time.perf_counter()
  size = warm_page_cache(data)
  print(f"{a.series} series x {a.slices_per_series} slices of 512x512 ({size / 1e9:.2f} GB, page cache "
        f"warmed in {time.perf_counter() - t0:.1f}s), rounds={a.rounds} cpus={os.cpu_count()}", flush=True)

  def counted(read: Callable[[str], np.ndarray]) -> Callable[[], None]:
    def fn() -> None:
      if (got := run_per_series(data, read)) != n:
        raise RuntimeError(f"read {got} slices, expected {n}")
    return fn

  output = os.path.join(work, "out", "ct_pipeline")
  records: list[int] = []

  def pipeline() -> None:
    shutil.rmtree(output, ignore_errors=True)
    records.append(run_pipeline(data, output))

  results = alternated([
      ("SimpleITK ImageSeriesReader", counted(read_sitk)),
      ("assembly (read_slices/plan/read_volume)", counted(read_assembly)),
      ("pipeline, DirectRunner in-process", pipeline),
  ], a.rounds, n)
  checks = check_volumes(data)
  checks.append((f"pipeline manifest: one record per series ({a.series})",
                 all(r == a.series for r in records)))

  print()
  print(f"{'variant':<42} {'median s':>8} {'slices/s':>9} {'median ratio':>12}")
  for r in results:
    print(f"{r.variant:<42} {r.seconds:8.2f} {r.slices_per_s:9.1f} {r.ratio:12.2f}")
  print()
  for text, ok in checks:
    print(f"{'ok  ' if ok else 'FAIL'}  {text}")
  ratio = results[1].ratio
  target = ("assembly function at least as fast as SimpleITK", ratio, ratio <= 1.0)
  print()
  print(f"{'PASS' if target[2] else 'MISS'}  {target[0]} (ratio {ratio:.2f})")
  print(f"info  pipeline (encode + write shards) vs SimpleITK: ratio {results[2].ratio:.2f}")

  if a.json:
    report = {
        "series": a.series, "slices_per_series": a.slices_per_series, "slices": n, "rounds": a.rounds,
        "cpus": os.cpu_count(),
        "results": [{"variant": r.variant, "seconds": r.seconds, "slices_per_s": r.slices_per_s,
                     "ratio": r.ratio} for r in results],
        "checks": [{"check": t, "pass": ok} for t, ok in checks],
        "target": {"check": target[0], "ratio": target[1], "pass": target[2]},
    }
    with open(a.json, "w") as f:
      json.dump(report, f, indent=2)
  return 0 if all(ok for _, ok in checks) else 1  # a wrong volume is an error, a slow one is not


if __name__ == "__main__":
  sys.exit(main())
