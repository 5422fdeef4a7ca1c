"""Benchmarks resumed and appending conversions of `pipelines.image_folder` against a clean run.

    python scripts/bench_resume.py [--work=bench_work/resume] [--num_images=6000] [--num_shards=16]
        [--rounds=3] [--json=results.json]

Generates (once, cached under --work) a class folder of plain RGB JPEGs around
500x375 resized to 224x224, plus 10 % more images held back for the append. Each
round runs, as a user would (`python -m pipelines.image_folder`, one process,
the in-process DirectRunner; wall time including the interpreter's start-up, and
the run's own time from its summary line):

- **clean**: the whole folder into a fresh output (`--reuse_shards=false`);
- **resume**: a run killed (SIGKILL, the fault harness) once half of its shards
  are published, then the rerun, timed: it reuses the published half
  (pipelines/core/reuse.py) and converts the rest;
- **append**: the clean output with the held-back 10 % added to the folder,
  `--mode=append`, timed: it converts the new images into new shards and copies
  the existing ones.

The variants rotate their order every round (this machine is shared and swings
±30 %); the medians of the per-round ratios to the clean run are reported against
issue 21's targets (resume ≤ 0.6, append ≤ 0.25). Exits 0 whether they are met
or not (this is a report), non-zero only on errors.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import make_sample_images  # noqa: E402

FAULT_POINT_ENV = "TPU_SHARDS_FAULT_POINT"  # formats.outputs.commit.FAULT_POINT_ENV
RESUME_TARGET = 0.6  # issue 21: a rerun after a kill at 50 % takes at most this times a clean run
APPEND_TARGET = 0.25  # issue 21: appending 10 % new inputs takes at most this times a clean run
NUM_CLASSES = 10


def _inputs(work: str, num_images: int) -> tuple[str, str]:
  """(the class folder, the held-back 10 % in the same layout), generated once."""
  folder, extra = os.path.join(work, "images"), os.path.join(work, "extra")
  if not os.path.isdir(folder):
    classes = [f"class{i:02d}" for i in range(NUM_CLASSES)]
    make_sample_images.make_folder(folder, classes, num_images // NUM_CLASSES, None, (500, 375), corrupt=0,
                                   seed=0, mixed=False)
    make_sample_images.make_folder(extra, classes, max(1, num_images // NUM_CLASSES // 10), None, (500, 375),
                                   corrupt=0, seed=1, mixed=False)
  return folder, extra


RUN_SECONDS = re.compile(r" records in .* in ([0-9.]+)s")  # the summary line: the run's own time, after start-up


def _run(folder: str, out: str, *flags: str, fault: str = "") -> tuple[float, float]:
  """(wall seconds, the run's own seconds from its summary line) of one `python -m pipelines.image_folder`
  run, which must succeed (or be killed, when `fault`: then the run's own time is 0)."""
  env = {**os.environ, "PYTHONPATH": REPO}
  env.pop(FAULT_POINT_ENV, None)
  if fault:
    env[FAULT_POINT_ENV] = fault
  t0 = time.monotonic()
  proc = subprocess.run([sys.executable, "-m", "pipelines.image_folder", f"--input={folder}", f"--output={out}",
                         "--image_size=224,224", "--name=images", *flags],
                        cwd=REPO, env=env, capture_output=True, text=True)
  seconds = time.monotonic() - t0
  if proc.returncode != (-9 if fault else 0):
    raise RuntimeError(f"run failed ({proc.returncode}): {proc.stderr[-2000:]}")
  found = RUN_SECONDS.search(proc.stdout)
  return seconds, float(found[1]) if found else 0.0


def _with_extra(folder: str, extra: str, dest: str) -> str:
  """A copy of `folder` (hard links) with the held-back images added."""
  shutil.rmtree(dest, ignore_errors=True)
  shutil.copytree(folder, dest, copy_function=os.link)
  for cls in os.listdir(extra):
    for name in os.listdir(os.path.join(extra, cls)):
      os.link(os.path.join(extra, cls, name), os.path.join(dest, cls, f"extra-{name}"))
  return dest


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--work", default=os.path.join(REPO, "bench_work", "resume"))
  ap.add_argument("--num_images", type=int, default=6000)
  ap.add_argument("--num_shards", type=int, default=16)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--json", default="")
  a = ap.parse_args(argv)
  os.makedirs(a.work, exist_ok=True)
  folder, extra = _inputs(a.work, a.num_images)
  grown = _with_extra(folder, extra, os.path.join(a.work, "grown"))
  shards = (f"--num_shards={a.num_shards}",)
  half = f"shards:published:{a.num_shards // 2}"
  times: dict[str, list[float]] = {"clean": [], "resume": [], "append": []}
  own: dict[str, list[float]] = {"clean": [], "resume": [], "append": []}

  def record(variant, measured):
    times[variant].append(measured[0])
    own[variant].append(measured[1])

  base = os.path.join(a.work, "base")  # the clean output the appends start from
  shutil.rmtree(base, ignore_errors=True)
  _run(folder, base, *shards, "--reuse_shards=false")

  def clean(r):
    out = os.path.join(a.work, f"clean-{r}")
    shutil.rmtree(out, ignore_errors=True)
    record("clean", _run(folder, out, *shards, "--reuse_shards=false"))

  def resume(r):
    out = os.path.join(a.work, f"resume-{r}")
    shutil.rmtree(out, ignore_errors=True)
    _run(folder, out, *shards, fault=half)
    record("resume", _run(folder, out, *shards))

  def append(r):
    out = os.path.join(a.work, f"append-{r}")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(base, out)
    record("append", _run(grown, out, "--mode=append"))

  variants = [clean, resume, append]
  for r in range(a.rounds):
    for v in variants[r % 3:] + variants[:r % 3]:
      v(r)
    print(f"round {r + 1}: " + ", ".join(f"{k} {t[-1]:.1f}s" for k, t in times.items()), flush=True)
  ratios = {k: [t / c for t, c in zip(times[k], times["clean"])] for k in ("resume", "append")}
  own_ratios = {k: [t / c for t, c in zip(own[k], own["clean"])] for k in ("resume", "append")}
  result = {"num_images": a.num_images, "extra_images": sum(len(os.listdir(os.path.join(extra, c)))
                                                            for c in os.listdir(extra)),
            "num_shards": a.num_shards, "rounds": a.rounds,
            "seconds": {k: statistics.median(v) for k, v in times.items()},
            "ratios": {k: statistics.median(v) for k, v in ratios.items()},
            "per_round": {k: [round(x, 3) for x in v] for k, v in ratios.items()},
            "run_seconds": {k: statistics.median(v) for k, v in own.items()},
            "run_ratios": {k: statistics.median(v) for k, v in own_ratios.items()},
            "run_per_round": {k: [round(x, 3) for x in v] for k, v in own_ratios.items()}}
  print(f"clean {result['seconds']['clean']:.1f}s; resume after a kill at 50 %: "
        f"{result['ratios']['resume']:.2f}x (per round {result['per_round']['resume']}; target <= {RESUME_TARGET}); "
        f"append of {result['extra_images']} images: {result['ratios']['append']:.2f}x "
        f"(per round {result['per_round']['append']}; target <= {APPEND_TARGET})")
  print(f"the runs' own time (after the interpreter's start and imports, ~1.6 s here): clean "
        f"{result['run_seconds']['clean']:.1f}s; resume {result['run_ratios']['resume']:.2f}x (per round "
        f"{result['run_per_round']['resume']}); append {result['run_ratios']['append']:.2f}x (per round "
        f"{result['run_per_round']['append']})")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(result, f, indent=1)
  for r in range(a.rounds):
    for k in ("clean", "resume", "append"):
      shutil.rmtree(os.path.join(a.work, f"{k}-{r}"), ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
