"""Benchmarks the ct_volumes pipeline against a plain loop, its own assembly function and SimpleITK.

    python scripts/bench_ct_volumes.py [--work=bench_work] [--series=4]
        [--slices_per_series=500] [--rounds=3] [--json=results.json]
        [--profile=PATH] [--memory] [--labels=seg] [--source=dicomweb]

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

`--labels=seg` measures the label path instead (issue 26): each series gets a
DICOM SEG of two organs (highdicom, cached beside the series in their own
folder), and each round times, alternated, the pipeline on the CT alone and
on CT + SEG (`--label_sources=seg`), then 300 epochs of random (D, H, W) =
(32, 128, 128) patches through `loaders.grain` from each output: the volume
alone, volume + label, and volume + label with `pos_fraction=0.5`. Targets:
conversion with SEG masks <= 1.3x the time without, loading volume + label
patches >= 0.8x the throughput of volume patches (medians of the per-round
ratios). Checks: every record's label equals the masks it was made from.

`--source=dicomweb` measures the DICOMweb input instead (issue 23): the series are
stored in a local Orthanc (`scripts/orthanc.py`), and each round times, alternated,
the pipeline from the folder, from the store, and one WADO-RS retrieval of every
series (the store and the transfer). Target: the store's throughput >= 0.7x the
folder's. Checks: both outputs are byte-identical.
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
import orthanc  # noqa: E402

SALT = "bench"
VOLUME_DTYPE = "int16"  # write_big_series: slope 1, intercept -1024


SITK, ASSEMBLY, LOOP, PIPELINE = (
    "SimpleITK ImageSeriesReader", "assembly (read_slices/plan/read_volume)", "plain loop (pydicom, encode, write)",
    "pipeline, DirectRunner in-process")
# (numerator, denominator) of the per-round ratios reported; the first is the target's.
RATIOS = ((PIPELINE, LOOP), (PIPELINE, ASSEMBLY), (ASSEMBLY, SITK), (LOOP, ASSEMBLY))
TARGET = 2.0  # issue 14: the DirectRunner pipeline <= 2x the plain loop
# issue 26: conversion with SEG masks <= 1.3x the time without; volume + label patches >= 0.8x the throughput
LABEL_CONVERT_TARGET, LABEL_LOAD_TARGET = 1.3, 0.8
LABEL_MAP = {"liver": 1, "spleen": 2}
PATCH = (32, 128, 128)
EPOCHS = 300  # of the loading rounds: enough patches that opening the output is not what is timed


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


def ensure_labels(data: CtInput) -> tuple[str, tuple[str, ...]]:
  """A SEG of two organs per series (cached): (a root holding the CT and the SEGs, the masks' .npy paths)."""
  import make_sample_ct_labels as labels  # noqa: PLC0415 (highdicom is only needed here)
  root = data.root + "_with_seg"
  seg_dir, masks_dir = os.path.join(root, "seg"), data.root + "_masks"
  done = root + ".done"
  masks = tuple(os.path.join(masks_dir, os.path.basename(s) + ".npy") for s in data.series)
  if not os.path.exists(done):
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(seg_dir)
    os.makedirs(masks_dir, exist_ok=True)
    os.symlink(data.root, os.path.join(root, "ct"))
    t0 = time.perf_counter()
    for k, (folder, truth_path) in enumerate(zip(data.series, data.truth)):
      truth = _bench_truth(folder, np.load(truth_path))
      d, h, w = truth.hu.shape
      liver = labels.ellipsoid(truth.hu.shape, (d / 2, h * 0.45, w * 0.4), (d / 3, h / 5, w / 4))
      spleen = labels.ellipsoid(truth.hu.shape, (d / 2, h * 0.55, w * 0.75), (d / 6, h / 12, w / 14))
      labels.write_seg(truth, os.path.join(seg_dir, f"{k:02d}.dcm"), [liver, spleen], list(LABEL_MAP), seed=k)
      np.save(masks[k], (liver * 1 + spleen * 2).astype(np.uint8))
      del truth, liver, spleen
      gc.collect()
    with open(done, "w") as f:
      f.write("ok\n")
    print(f"wrote {len(data.series)} SEGs in {time.perf_counter() - t0:.1f}s", flush=True)
  return root, masks


def _bench_truth(folder: str, hu: np.ndarray) -> make_sample_ct.SeriesTruth:
  """The SeriesTruth a SEG generator needs, for a cached series (its files, sorted along the normal, and HU)."""
  plan = plan_series(folder)
  return make_sample_ct.SeriesTruth(
      name=os.path.basename(folder), patient_id="BENCH0001", series_uid="", study_uid="", hu=hu,
      spacing=plan.spacing, origin=plan.origin, direction=np.asarray(plan.direction).reshape(3, 3).T,
      files=[s.path for s in plan.slices])


def _load_epoch(output: str, with_label: bool, pos_fraction: float | None) -> int:
  """EPOCHS epochs of random patches through loaders.grain; the patches read."""
  from loaders import grain as grain_loaders  # noqa: PLC0415
  n = 0
  options = {"pos_fraction": pos_fraction} if pos_fraction is not None else {}
  for batch in grain_loaders.dataset(output, "train", batch_size=2, patch_size=PATCH, num_epochs=EPOCHS,
                                     **options):
    if with_label and "label" not in batch:
      raise RuntimeError(f"{output}: no label in the batch")
    n += batch["volume"].shape[0]
  return n


def labels_benchmark(a, data: CtInput, work: str) -> int:
  """`--labels=seg`: conversion and loading with SEG masks against without (see the module docstring)."""
  root, masks = ensure_labels(data)
  label_map = os.path.join(work, "label_map.json")
  with open(label_map, "w") as f:
    json.dump(LABEL_MAP, f)
  plain_out, labelled_out = os.path.join(work, "out", "ct_plain"), os.path.join(work, "out", "ct_seg")

  def convert(src: str, out: str, *flags: str) -> Callable[[], None]:
    def fn() -> None:
      shutil.rmtree(out, ignore_errors=True)
      ct_volumes.run([f"--input={src}", f"--output={out}", f"--id_salt={SALT}", "--overwrite=true",
                      "--runner=DirectRunner", "--splits=train=1.0", *flags])
      if load_manifest(out).num_records != len(data.series):
        raise RuntimeError(f"{out}: not one record per series")
    return fn

  without, with_seg = "convert CT", "convert CT + SEG"
  convert_results = alternated([(without, convert(data.root, plain_out)),
                                (with_seg, convert(root, labelled_out, "--label_sources=seg",
                                                   f"--label_map={label_map}"))], a.rounds, data.slices)
  patches = {}

  def load(name: str, out: str, with_label: bool, pos_fraction: float | None = None) -> Callable[[], None]:
    def fn() -> None:
      patches[name] = _load_epoch(out, with_label, pos_fraction)
    return fn

  volume, labelled, positive = "load volume patches", "load volume + label patches", "... with pos_fraction=0.5"
  for out in (plain_out, labelled_out):  # untimed: each shard's SHA-256 (once per process) and the page cache
    _load_epoch(out, out == labelled_out, None)
  load_results = alternated([(volume, load(volume, plain_out, False)), (labelled, load(labelled, labelled_out, True)),
                             (positive, load(positive, labelled_out, True, 0.5))], a.rounds, 1)
  m = load_manifest(labelled_out)
  got = [m.features.decode(r)["label"] for split in m.splits.values() for shard in split.shards
         for r in arrayrecord.read_file(fs.join(labelled_out, shard.path))]
  wanted = [np.load(p) for p in masks]
  checks = [("every record's label is the masks of a SEG, and every SEG's masks are a record's label",
             len(got) == len(wanted) and all(any(np.array_equal(w, g) for g in got) for w in wanted)
             and all(any(np.array_equal(w, g) for w in wanted) for g in got))]

  def per_round(results, num, den, invert=False):
    by = {r.variant: r.times for r in results}
    ratios_ = [(y / x if invert else x / y) for x, y in zip(by[num], by[den])]
    return statistics.median(ratios_), ratios_

  convert_ratio, convert_rounds = per_round(convert_results, with_seg, without)
  load_ratio, load_rounds = per_round(load_results, labelled, volume, invert=True)  # throughput: time inverted
  pos_ratio, pos_rounds = per_round(load_results, positive, volume, invert=True)
  print()
  for r in (*convert_results, *load_results):
    print(f"{r.variant:<32} median {r.seconds:7.2f}s   per round " + " ".join(f"{t:.2f}" for t in r.times))
  print(f"\npatches per epoch: {patches}")
  for text, ok in checks:
    print(f"{'ok  ' if ok else 'FAIL'}  {text}")
  print()
  print(f"{'PASS' if convert_ratio <= LABEL_CONVERT_TARGET else 'MISS'}  conversion with SEG <= "
        f"{LABEL_CONVERT_TARGET}x the time without: median {convert_ratio:.2f} "
        f"(rounds {' '.join(f'{x:.2f}' for x in convert_rounds)})")
  print(f"{'PASS' if load_ratio >= LABEL_LOAD_TARGET else 'MISS'}  volume + label patches >= "
        f"{LABEL_LOAD_TARGET}x the throughput of volume patches: median {load_ratio:.2f} "
        f"(rounds {' '.join(f'{x:.2f}' for x in load_rounds)})")
  print(f"info  with pos_fraction=0.5: {pos_ratio:.2f}x (rounds {' '.join(f'{x:.2f}' for x in pos_rounds)})")
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"series": a.series, "slices_per_series": a.slices_per_series, "rounds": a.rounds,
                 "results": [{"variant": r.variant, "seconds": r.seconds, "times": list(r.times)}
                             for r in (*convert_results, *load_results)],
                 "convert_ratio": convert_ratio, "load_ratio": load_ratio, "pos_fraction_ratio": pos_ratio,
                 "checks": [{"check": t, "pass": ok} for t, ok in checks]}, f, indent=2)
  return 0 if all(ok for _, ok in checks) else 1


def dicomweb_benchmark(a, data: CtInput, work: str) -> int:
  """`--source=dicomweb`: the same series through a local Orthanc (DICOMweb) against from the folder."""
  from pipelines.ct_volumes import dicomweb  # noqa: E402 (only this mode)
  from pipelines.core import inputs  # noqa: E402
  shutil.rmtree(os.path.join(work, "orthanc"), ignore_errors=True)  # a fresh store every run
  with orthanc.Orthanc(os.path.join(work, "orthanc")) as o:
    t0 = time.perf_counter()
    paths = [p for folder in data.series for p in _files(folder)]
    if len(o.upload(paths)) != len(paths):
      raise RuntimeError("Orthanc did not store every file")
    print(f"{len(paths)} files stored in Orthanc in {time.perf_counter() - t0:.1f}s", flush=True)
    outs = {"folder": os.path.join(work, "out", "ct_folder"), "dicomweb": os.path.join(work, "out", "ct_dicomweb")}

    def convert(src: str, out: str) -> Callable[[], None]:
      def fn() -> None:
        shutil.rmtree(out, ignore_errors=True)
        ct_volumes.run([f"--input={src}", f"--output={out}", f"--id_salt={SALT}", "--overwrite=true", "--name=ct",
                        "--runner=DirectRunner", "--splits=train=1.0"])
      return fn

    store = dicomweb.Store(dicomweb.store_config(o.dicomweb, "none", "", "", 1000), inputs.ReadPolicy())
    listed = [s for st in store.studies() for s in store.series_of(st)]

    def retrieve_only() -> None:  # the store and the transfer: every series' WADO-RS answer, split
      for s in listed:
        if len(store.retrieve(s)) != s.num_instances:
          raise RuntimeError("a retrieval does not hold its listed instances")

    results = alternated([("folder", convert(data.root, outs["folder"])),
                          ("dicomweb", convert(o.dicomweb, outs["dicomweb"])),
                          ("retrieve", retrieve_only)], a.rounds, data.slices)
    body = store.session.get(f"{o.dicomweb}/studies/{listed[0].study}/series/{listed[0].series}",
                             headers={"Accept": dicomweb.SERIES_ACCEPT})
    t0 = time.perf_counter()
    dicomweb.split_multipart(body.content, body.headers["Content-Type"])
    split_s = (time.perf_counter() - t0) * len(listed)
  by = {r.variant: r for r in results}
  per_round = [f / d for f, d in zip(by["folder"].times, by["dicomweb"].times)]
  same = {k: sorted(s.sha256 for sp in load_manifest(v).splits.values() for s in sp.shards) for k, v in outs.items()}
  print(f"\nthroughput from the store / from the folder: median {statistics.median(per_round):.2f}x "
        f"(rounds {' '.join(f'{x:.2f}' for x in per_round)}; target >= 0.7x)")
  print(f"  folder {by['folder'].slices_per_s:.0f} slices/s, dicomweb {by['dicomweb'].slices_per_s:.0f} slices/s")
  print(f"  where the store run's time goes: the store and the transfer {by['retrieve'].seconds:.2f}s per pass over "
        f"every series (the run makes two: headers, then pixels), of which the multipart split {split_s:.3f}s; "
        f"the rest as from the folder")
  print(f"  outputs byte-identical: {same['folder'] == same['dicomweb']}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"ratio_median": statistics.median(per_round), "per_round": per_round,
                 "results": [dataclasses.asdict(r) for r in results], "split_s": split_s}, f, indent=1)
  return 0 if same["folder"] == same["dicomweb"] else 1


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
  ap.add_argument("--source", default="folder", choices=("folder", "dicomweb"),
                  help="dicomweb: the pipeline from a local Orthanc against from the folder, instead")
  ap.add_argument("--labels", default=None, choices=("seg",),
                  help="measure conversion and loading with SEG label masks against without, instead")
  a = ap.parse_args(argv)
  if a.rounds < 1 or a.series < 1 or a.slices_per_series < 2:
    ap.error("--rounds and --series must be >= 1, --slices_per_series >= 2")

  logging.basicConfig(level=logging.WARNING)
  for noisy in ("apache_beam", "google", "urllib3", "absl"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  sitk.ProcessObject.SetGlobalWarningDisplay(False)

  work = os.path.abspath(a.work)
  data = ensure_series(work, a.series, a.slices_per_series)
  if a.labels:
    return labels_benchmark(a, data, work)
  if a.source == "dicomweb":
    return dicomweb_benchmark(a, data, work)
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
