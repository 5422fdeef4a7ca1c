"""Benchmarks the ct_volumes pipeline against a plain loop, its own assembly function and SimpleITK.

    python scripts/bench_ct_volumes.py [--work=bench_work] [--series=4]
        [--slices_per_series=500] [--rounds=3] [--json=results.json]
        [--profile=PATH] [--memory]

Generates (once, cached under --work) `--series` uncompressed 512x512 axial
series (`make_sample_ct.write_big_series`, one subfolder each, seeds 0, 1, ...)
and keeps their HU truth beside them. After one untimed pass that reads every
file's bytes (page cache warm), each round times, on the same files, in an
order rotated by one every round (the shared machine swings; a round measures
every variant under the same load):

- SimpleITK's `ImageSeriesReader` down to a numpy array;
- the toolkit's bare assembly (`read_slices` → `plan_volumes` → `read_volume`);
- a plain single-process loop (`plain_loop`): pydicom reads every file, groups
  by series, sorts along the normal, computes HU, encodes one record per series
  with the pipeline's own `Features.encode` and writes one ArrayRecord shard;
- `ct_volumes.run` on the in-process DirectRunner (headers, plan, then one
  step per shard: read, assemble, encode, write, hash, publish; and the commit).

Reported: the median time of each variant, and the medians of the per-round
ratios pipeline / loop (the target: <= 2), pipeline / assembly and
assembly / SimpleITK. Checks: the assembly equals SimpleITK (padding mapped to
-1024, which SimpleITK ignores) and the truth, series by series; the loop's
records are the pipeline's records, byte for byte. `--profile=PATH` then runs
the pipeline once more under cProfile (stats to PATH, the top functions
printed); `--memory` measures, in a child process, the peak RSS of one
series' read + assemble + encode + write through the pipeline's shard step
and the local disk that step uses. Exits 0 whether the target is met or not
(this is a report), non-zero on errors and failed checks.
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable, Iterator, Sequence
import cProfile
import dataclasses
import gc
import hashlib
import json
import logging
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

import numpy as np  # noqa: E402
import pydicom  # noqa: E402
import SimpleITK as sitk  # noqa: E402

from formats import arrayrecord, load_manifest  # noqa: E402
from formats.storage import files as fs  # noqa: E402
from formats.kinds import CT_PADDING_HU as PADDING_HU  # noqa: E402
from pipelines import ct_volumes  # noqa: E402
from pipelines.ct_volumes.assembly import VolumePlan, plan_volumes, read_volume  # noqa: E402
from pipelines.ct_volumes.headers import read_slices, salted_hash  # noqa: E402
import make_sample_ct  # noqa: E402

SALT = "bench"
VOLUME_DTYPE = "int16"  # write_big_series: slope 1, intercept -1024


SITK, ASSEMBLY, LOOP, PIPELINE = (
    "SimpleITK ImageSeriesReader", "assembly (read_slices/plan/read_volume)", "plain loop (pydicom, encode, write)",
    "pipeline, DirectRunner in-process")
# (numerator, denominator) of the per-round ratios reported; the first is the target's.
RATIOS = ((PIPELINE, LOOP), (PIPELINE, ASSEMBLY), (ASSEMBLY, SITK), (LOOP, ASSEMBLY))
TARGET = 2.0  # issue 14: the DirectRunner pipeline <= 2x the plain loop


@dataclasses.dataclass(frozen=True)
class Result:
  variant: str
  seconds: float  # median over the rounds
  slices: int
  times: tuple[float, ...]  # per round

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


def _series_records(root: str) -> Iterator[bytes]:
  """The plain loop's records, one series at a time (the files are all read first: grouping needs them)."""
  features = ct_volumes.volume_features(VOLUME_DTYPE)
  series: dict[tuple[str, str], list[pydicom.Dataset]] = collections.defaultdict(list)
  for folder, _, names in sorted(os.walk(root)):
    for name in sorted(names):
      ds = pydicom.dcmread(os.path.join(folder, name))
      series[(str(ds.StudyInstanceUID), str(ds.SeriesInstanceUID))].append(ds)
  for (study, uid), members in sorted(series.items()):
    orientation = np.asarray(members[0].ImageOrientationPatient, float)
    row, col = orientation[:3], orientation[3:]
    normal = np.cross(row, col)
    normal /= np.linalg.norm(normal)
    members.sort(key=lambda ds: float(normal @ np.asarray(ds.ImagePositionPatient, float)))
    z = [float(normal @ np.asarray(ds.ImagePositionPatient, float)) for ds in members]
    first = members[0]
    volume = np.empty((len(members), first.Rows, first.Columns), VOLUME_DTYPE)
    for i, ds in enumerate(members):
      stored = ds.pixel_array
      hu = stored.astype(np.int32) * int(ds.RescaleSlope) + int(ds.RescaleIntercept)
      padding = getattr(ds, "PixelPaddingValue", None)
      if padding is not None:
        hu[stored == padding] = PADDING_HU
      volume[i] = hu
    members.clear()  # the pixel data of this series is no longer needed
    yield features.encode({
        "volume": volume,
        "spacing": np.asarray(((z[-1] - z[0]) / (len(z) - 1), *map(float, first.PixelSpacing)), np.float32),
        "origin": np.asarray([float(x) for x in first.ImagePositionPatient], np.float32),
        "direction": np.stack([row, col, normal], axis=1).astype(np.float32),
        "num_slices": len(z),
        "series_id": salted_hash(SALT, "series", study, uid),
        "patient_id": salted_hash(SALT, "patient", str(first.PatientID)),
        "sorted_by": "position",
    })
    del volume


def plain_loop(data: CtInput, shard: str) -> int:
  """The plain single-process loop: read every file (pydicom), group by series, sort, HU, encode one
  record per series (`Features.encode`, the pipeline's schema), write one ArrayRecord shard; returns
  the records written."""
  n = arrayrecord.write_file(shard, _series_records(data.root))
  gc.collect()
  return n


def _record_digests(paths: Sequence[str]) -> list[str]:
  return sorted(hashlib.sha256(r).hexdigest() for path in paths for r in arrayrecord.read_file(path))


def alternated(variants: Sequence[tuple[str, Callable[[], object]]], rounds: int, slices: int) -> list[Result]:
  """Each round runs every variant once, the order rotated by one each round (the shared machine swings
  between runs: a round measures all of them under similar load, and no variant always runs first)."""
  times: dict[str, list[float]] = {name: [] for name, _ in variants}
  for r in range(rounds):
    order = [*variants[r % len(variants):], *variants[:r % len(variants)]]
    for name, fn in order:
      gc.collect()
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
    print(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {times[n][-1]:.2f}s" for n, _ in order), flush=True)
  return [Result(name, statistics.median(times[name]), slices, tuple(times[name])) for name, _ in variants]


def ratios(results: Sequence[Result]) -> list[tuple[str, str, list[float], float]]:
  """(numerator, denominator, per-round ratios, their median) for each of RATIOS both of whose variants ran."""
  by = {r.variant: r.times for r in results}
  out = []
  for a, b in RATIOS:
    if a not in by or b not in by:
      continue
    per_round = [x / y for x, y in zip(by[a], by[b])]
    out.append((a, b, per_round, statistics.median(per_round)))
  return out


def profile_pipeline(data: CtInput, output: str, path: str, top: int = 25) -> None:
  """One more pipeline run under cProfile: the stats to `path`, the top functions printed."""
  shutil.rmtree(output, ignore_errors=True)
  profiler = cProfile.Profile()
  t0 = time.perf_counter()
  profiler.runcall(run_pipeline, data, output)
  print(f"\nprofiled pipeline run: {time.perf_counter() - t0:.2f}s (stats in {path})")
  profiler.dump_stats(path)
  stats = pstats.Stats(path)
  stats.sort_stats("tottime").print_stats(top)
  stats.sort_stats("cumulative").print_stats(top)


_MEMORY_CHILD = """
import json, os, shutil, sys, tempfile
sys.path[:0] = [{repo!r}, {scripts!r}]
import bench_ct_volumes as b
from pipelines.ct_volumes import pipeline as ct
from pipelines.core import inputs, shards
from pipelines.core.sink import OutputSpec

def status(field):  # kB, of this process's memory (not ru_maxrss: Linux keeps the parent's across exec)
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

plan = b.plan_series({folder!r})
features = {{d: ct.volume_features(d) for d in ("int16", "float32")}}
out = tempfile.mkdtemp(prefix="bench-ct-memory-", dir={work!r})
spec = OutputSpec(output=out, name="bench", file_format="array_record", features=features["int16"],
                  splits=("train",), num_shards=1, seed=0, description="", source={{}}, generation="gen-bench")
fn = shards._ConvertShardFn(ct._VolumeUnits((("train", 1.0),), features, inputs.ReadPolicy()), spec,
                            ct.PIPELINE, (1, 0), 1)
fn.setup()
task = shards.make_task("train", 0, 1, [plan], 0)
with open("/proc/self/clear_refs", "w") as f:
  f.write("5")  # resets VmHWM to the current RSS
before = status("VmRSS")
results = list(fn.process(task, dtype="int16", raw_paths={{}}))
peak = status("VmHWM")
info = results[-1].info
shutil.rmtree(out)
print(json.dumps({{"voxels": len(plan.slices) * plan.slices[0].rows * plan.slices[0].columns,
                  "rss_before_kib": before, "rss_peak_kib": peak, "shard_bytes": info.num_bytes,
                  "records": info.num_records}}))
"""


def measure_memory(data: CtInput, work: str) -> dict:
  """Peak RSS of one series' read + assemble + encode + write through the pipeline's shard step
  (`ConvertShards`' DoFn on a one-series task), in a fresh process, and the shard's bytes on disk."""
  code = _MEMORY_CHILD.format(repo=REPO, scripts=os.path.join(REPO, "scripts"), folder=data.series[0], work=work)
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
  if r.returncode != 0:
    raise RuntimeError(r.stderr[-3000:])
  return json.loads(r.stdout.strip().splitlines()[-1])


def check_volumes(data: CtInput, with_sitk: bool = True) -> list[tuple[str, bool]]:
  """Per series: assembly == SimpleITK (its padding mapped to -1024) and assembly == truth."""
  checks = []
  for folder, truth_path in zip(data.series, data.truth):
    name = os.path.basename(folder)
    plan = plan_series(folder)
    volume, _ = read_volume(plan, lambda p: open(p, "rb"), VOLUME_DTYPE)
    if with_sitk:
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
  ap.add_argument("--no_sitk", action="store_true", help="leave SimpleITK out (rounds and checks)")
  ap.add_argument("--profile", default=None, help="then profile one pipeline run; cProfile stats to this path")
  ap.add_argument("--memory", action="store_true",
                  help="then measure the peak RSS and disk of one series' shard step (child process)")
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
  loop_shard = os.path.join(work, "out", "ct_loop.array_record")
  os.makedirs(os.path.dirname(loop_shard), exist_ok=True)
  records: list[int] = []
  loop_records: list[int] = []

  def pipeline() -> None:
    shutil.rmtree(output, ignore_errors=True)
    records.append(run_pipeline(data, output))

  def loop() -> None:
    if os.path.exists(loop_shard):
      os.remove(loop_shard)
    loop_records.append(plain_loop(data, loop_shard))

  variants = [(LOOP, loop), (PIPELINE, pipeline), (ASSEMBLY, counted(read_assembly))]
  if not a.no_sitk:
    variants.append((SITK, counted(read_sitk)))
  results = alternated(variants, a.rounds, n)
  m = load_manifest(output)
  pipeline_shards = [fs.join(output, s.path) for split in m.splits.values() for s in split.shards]
  checks = check_volumes(data, with_sitk=not a.no_sitk)
  checks.append((f"pipeline manifest: one record per series ({a.series})", all(r == a.series for r in records)))
  checks.append((f"plain loop: one record per series ({a.series})", all(r == a.series for r in loop_records)))
  checks.append(("plain loop's records == the pipeline's records (bytes)",
                 _record_digests([loop_shard]) == _record_digests(pipeline_shards)))

  print()
  print(f"{'variant':<42} {'median s':>8} {'slices/s':>9}   per round (s)")
  for r in results:
    print(f"{r.variant:<42} {r.seconds:8.2f} {r.slices_per_s:9.1f}   " + " ".join(f"{t:.2f}" for t in r.times))
  print()
  found = ratios(results)
  for num, den, per_round, median in found:
    print(f"ratio {num} / {den}: median {median:.2f} (rounds: {' '.join(f'{x:.2f}' for x in per_round)})")
  print()
  for text, ok in checks:
    print(f"{'ok  ' if ok else 'FAIL'}  {text}")
  target_ratio = found[0][3]
  target = (f"pipeline (DirectRunner) <= {TARGET:g}x the plain loop", target_ratio, target_ratio <= TARGET)
  print()
  print(f"{'PASS' if target[2] else 'MISS'}  {target[0]} (median ratio {target_ratio:.2f})")
  print(f"info  pipeline vs its assembly function: median ratio {found[1][3]:.2f}")

  memory = None
  if a.memory:
    memory = measure_memory(data, work)
    volume_mb = memory["voxels"] * 2 / 1e6
    before, peak = memory["rss_before_kib"] / 1024, memory["rss_peak_kib"] / 1024
    grown_mb = (peak - before) * 1024 * 1024 / 1e6
    print(f"\nmemory: one series of {memory['voxels'] // (512 * 512)} slices of 512x512 ({volume_mb:.0f} MB "
          f"int16), read + assembled + encoded + written by the shard step: peak RSS {peak:.0f} MiB "
          f"({before:.0f} MiB before the step: +{grown_mb:.0f} MB, {grown_mb / volume_mb:.2f}x the volume); "
          f"local disk: the shard, {memory['shard_bytes'] / 1e6:.0f} MB")
  if a.profile:
    profile_pipeline(data, output, a.profile)

  if a.json:
    report = {
        "series": a.series, "slices_per_series": a.slices_per_series, "slices": n, "rounds": a.rounds,
        "cpus": os.cpu_count(),
        "results": [{"variant": r.variant, "seconds": r.seconds, "slices_per_s": r.slices_per_s,
                     "times": list(r.times)} for r in results],
        "ratios": [{"ratio": f"{num} / {den}", "per_round": per_round, "median": median}
                   for num, den, per_round, median in found],
        "checks": [{"check": t, "pass": ok} for t, ok in checks],
        "target": {"check": target[0], "ratio": target[1], "pass": target[2]},
        "memory": memory,
    }
    with open(a.json, "w") as f:
      json.dump(report, f, indent=2)
  return 0 if all(ok for _, ok in checks) else 1  # a wrong volume is an error, a slow one is not


if __name__ == "__main__":
  sys.exit(main())
