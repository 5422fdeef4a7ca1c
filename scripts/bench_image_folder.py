"""Benchmarks `pipelines.image_folder` on the DirectRunner against a plain Python loop.

    python scripts/bench_image_folder.py [--work=bench_work] [--num_images=2000]
        [--image_size=224,224] [--encodings=raw,jpeg] [--format=array_record|tfrecord]
        [--num_shards=0] [--rounds=3] [--json=results.json]

Generates (once, cached under --work) a folder of plain RGB JPEGs around
500x375, then times on it, for each encoding: a single-process loop doing the
same work (list, read, `imaging.convert`, encode the Example, write the
shards), and `image_folder.run` with one worker (the DirectRunner's default,
in-process mode), two worker threads (`--direct_running_mode=multi_threading`)
and two worker processes (`multi_processing`). Each run is timed from the call
into a fresh output folder: the runner's start and teardown, the listing, the
plan, the conversion, the commit and the TFDS metadata are included; the
imports are not (done once, before). The variants are alternated over
`--rounds` rounds, the order rotated each round (this machine is shared and
swings between runs: each round measures all variants under the same load),
and the median per variant and of the per-round ratios to the loop is
reported. Prints a table and the targets; exits 0 whether they are met or not
(this is a report), non-zero only on errors.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import dataclasses
import json
import logging
import math
import os
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

from formats import adapters, naming  # noqa: E402
from formats import load_manifest  # noqa: E402
from pipelines import image_folder  # noqa: E402
from pipelines.core import flags  # noqa: E402
from pipelines.image_folder import imaging  # noqa: E402
from pipelines.core.sink import DEFAULT_TARGET_SHARD_BYTES  # noqa: E402
import make_sample_images  # noqa: E402

NUM_CLASSES = 10
IN_PROCESS_TARGET = 1.1  # in-process DirectRunner, one worker: at most this times the loop's time (issue 14)
TWO_WORKER_TARGET = 0.8  # 2 workers (threads): at most this times the loop's time (issue 14)
# (name, flags) of the pipeline's variants; the loop runs first in every table.
PIPELINE_VARIANTS = (
    ("1 worker (in-process)", ["--direct_num_workers=1"]),
    ("2 workers (threads)", ["--direct_num_workers=2", "--direct_running_mode=multi_threading"]),
    ("2 workers (processes)", ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]),
)


@dataclasses.dataclass(frozen=True)
class Result:
  variant: str
  seconds: float  # median over the rounds
  images: int
  ratio: float = 1.0  # median over the rounds of (this variant's time / the loop's time in that round)

  @property
  def images_per_s(self) -> float:
    return self.images / self.seconds


def quiet_beam() -> None:
  """Beam's and the clients' logs at WARNING, and the repository on PYTHONPATH for multi-process workers."""
  logging.basicConfig(level=logging.WARNING)
  for noisy in ("apache_beam", "google", "urllib3", "absl"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  # Relays the worker processes' own start-up warnings (unparsed pipeline flags and the like).
  logging.getLogger("apache_beam.runners.portability.local_job_service").setLevel(logging.ERROR)
  # Multi-process workers are fresh interpreters: let them import `pipelines` and `formats`.
  os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))


def ensure_images(work: str, num_images: int, seed: int = 0) -> tuple[str, int]:
  """The cached input folder (generated on first use) and its image count."""
  per_class = math.ceil(num_images / NUM_CLASSES)
  folder = os.path.join(work, f"images_{NUM_CLASSES}x{per_class}")
  done = folder + ".done"  # beside the folder: a file inside would be a stray input
  if not os.path.exists(done):
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    classes = [f"class_{i:02d}" for i in range(NUM_CLASSES)]
    n = make_sample_images.make_folder(folder, classes, per_class, None, (500, 375), corrupt=0,
                                       seed=seed, mixed=False)
    with open(done, "w") as f:
      f.write(f"{n}\n")
    print(f"generated {n} images in {folder} ({time.perf_counter() - t0:.1f}s)", flush=True)
  with open(done) as f:
    return folder, int(f.read())


def _list_images(root: str) -> list[tuple[str, str]]:
  """(class name, path relative to root) of every file, sorted."""
  out = []
  for cls in sorted(os.listdir(root)):
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, cls)):
      dirnames.sort()
      out += [(cls, os.path.relpath(os.path.join(dirpath, f), root)) for f in sorted(filenames)]
  return out


def run_loop(root: str, output: str, options: imaging.ImageOptions, file_format: str,
             num_shards: int, name: str) -> int:
  """The baseline: the pipeline's work in one plain loop; returns the records written."""
  files = _list_images(root)
  class_names = sorted({c for c, _ in files})
  labels = {c: i for i, c in enumerate(class_names)}
  features = image_folder.image_features(class_names, options)
  payloads = []
  for cls, rel in files:
    with open(os.path.join(root, rel), "rb") as f:
      data = f.read()
    image = imaging.convert(data, options)
    payloads.append(features.encode({"image": image, "label": labels[cls], "file_name": rel}))
  num_bytes = sum(len(p) for p in payloads)
  shards = min(num_shards or max(1, math.ceil(num_bytes / DEFAULT_TARGET_SHARD_BYTES)), len(payloads))
  n = len(payloads)
  for i in range(shards):
    chunk = payloads[i * n // shards:(i + 1) * n // shards]
    path = os.path.join(output, naming.ShardName(name, "train", file_format, i, shards).filename)
    adapters.get(file_format).write_file(path, chunk)
  return n


def run_pipeline(root: str, output: str, a: argparse.Namespace, extra: Sequence[str], encoding: str) -> int:
  """`image_folder.run` on the DirectRunner; returns the records in the manifest."""
  argv = [
      f"--input={root}", f"--output={output}", f"--image_size={a.image_size}",
      f"--encoding={encoding}", f"--format={a.format}", f"--num_shards={a.num_shards}",
      "--overwrite=true", "--runner=DirectRunner", *extra,
  ]
  image_folder.run(argv)
  return load_manifest(output).num_records


def timed(variant: str, output: str, expected: int, fn: Callable[[str], int]) -> float:
  """Seconds of one `fn(output)` into a fresh folder (which must then hold `expected` records)."""
  shutil.rmtree(output, ignore_errors=True)
  os.makedirs(output)
  t0 = time.perf_counter()
  n = fn(output)
  seconds = time.perf_counter() - t0
  if n != expected:
    raise RuntimeError(f"{variant}: wrote {n} records, expected {expected}")
  return seconds


def alternated(variants: Sequence[tuple[str, str, Callable[[str], int]]], rounds: int, expected: int) -> list[Result]:
  """Each round runs every variant once, the order rotated by one each round (no variant always
  runs first, on a cold cache, or last); medians of the times and of the ratios to the first
  variant's time in the same round."""
  times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
  for r in range(rounds):
    for name, output, fn in variants[r % len(variants):] + variants[:r % len(variants)]:
      times[name].append(timed(name, output, expected, fn))
    print(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()), flush=True)
  base = times[variants[0][0]]
  return [Result(name, statistics.median(times[name]), expected,
                 statistics.median(t / b for t, b in zip(times[name], base))) for name, _, _ in variants]


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--work", default="bench_work", help="cache of the input and outputs (git-ignored)")
  ap.add_argument("--num_images", type=int, default=2000)
  ap.add_argument("--image_size", default="224,224")
  ap.add_argument("--encodings", default="raw,jpeg", help="comma-separated: raw, jpeg")
  ap.add_argument("--format", default="array_record")
  ap.add_argument("--num_shards", type=int, default=0, help="0: ~128 MB shards, as the pipeline picks")
  ap.add_argument("--rounds", type=int, default=3, help="rounds; every round runs each variant once")
  ap.add_argument("--json", default=None, help="also write the results here")
  a = ap.parse_args(argv)
  encodings = a.encodings.split(",")
  if a.rounds < 1 or a.num_images < 1 or not set(encodings) <= {"raw", "jpeg"}:
    ap.error("--rounds and --num_images must be >= 1, --encodings raw and/or jpeg")

  quiet_beam()

  work = os.path.abspath(a.work)
  root, n = ensure_images(work, a.num_images)
  h, w = (int(v) for v in a.image_size.split(","))
  out = os.path.join(work, "out")
  name = flags.dataset_name(None, root)
  print(f"{n} images, image_size={a.image_size} encodings={a.encodings} format={a.format} "
        f"num_shards={a.num_shards} rounds={a.rounds} cpus={os.cpu_count()}", flush=True)

  tables, checks = {}, []
  for encoding in encodings:
    options = imaging.ImageOptions(size=(h, w), encoding=encoding)
    variants = [("loop (1 process)", os.path.join(out, "loop"),
                 lambda o, options=options: run_loop(root, o, options, a.format, a.num_shards, name))]
    variants += [(v, os.path.join(out, f"pipeline_{i}"),
                  lambda o, extra=extra, encoding=encoding: run_pipeline(root, o, a, extra, encoding))
                 for i, (v, extra) in enumerate(PIPELINE_VARIANTS)]
    print(f"\n{encoding}:", flush=True)
    results = tables[encoding] = alternated(variants, a.rounds, n)
    print(f"{'variant':<28} {'median s':>8} {'images/s':>9} {'median ratio':>12}")
    for r in results:
      print(f"{r.variant:<28} {r.seconds:8.2f} {r.images_per_s:9.1f} {r.ratio:12.2f}")
    checks += [
        (f"{encoding}: in-process DirectRunner within {IN_PROCESS_TARGET}x of the loop's time",
         results[1].ratio, results[1].ratio <= IN_PROCESS_TARGET),
        (f"{encoding}: 2 worker threads within {TWO_WORKER_TARGET}x of the loop's time", results[2].ratio,
         results[2].ratio <= TWO_WORKER_TARGET),
    ]
  print()
  for text, ratio, ok in checks:
    print(f"{'PASS' if ok else 'MISS'}  {text} (ratio {ratio:.2f})")

  if a.json:
    report = {
        "num_images": n, "image_size": a.image_size, "format": a.format,
        "num_shards": a.num_shards, "rounds": a.rounds, "cpus": os.cpu_count(),
        "results": {e: [{"variant": r.variant, "seconds": r.seconds, "images_per_s": r.images_per_s,
                         "ratio": r.ratio} for r in rs] for e, rs in tables.items()},
        "checks": [{"check": t, "ratio": x, "pass": ok} for t, x, ok in checks],
    }
    with open(a.json, "w") as f:
      json.dump(report, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
