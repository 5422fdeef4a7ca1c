"""The toolkit's loaders and converter side by side with the peers users would pick instead, in one run.

    python scripts/bench_peers.py [--peers_python=/tmp/peersenv/bin/python] [--work=bench_work/peers]
        [--num_images=2000] [--image_size=224,224] [--batch_size=64] [--rounds=3] [--raw_epochs=3]
        [--workers=1,2,4] [--kinds=raw,jpeg] [--convert_kinds=jpeg] [--convert_workers=1,2]
        [--storage=local|bucket] [--latency_ms=30] [--mbps=100] [--json=results.json]

On the folder of ~500x375 JPEGs that scripts/bench_image_folder.py generates
(`--num_images`, 2,000 by default; `--num_images=10000` for the 10k figure),
stored at 224x224 in two kinds, raw (uint8 224x224x3 arrays) and JPEG
(quality 95), times:

  Loading (images/s, shuffled, batches of 64 uint8 [64, 224, 224, 3], every
  image decoded, every batch's shape and dtype checked; a loader that yields
  too few images fails the run instead of reporting a rate):
    - the toolkit: `loaders.grain.dataset` over its ArrayRecord shards (threads,
      no worker processes), and tf.data over its TFRecord shards
      (`loaders.tfdata.dataset`, tf.data's AUTOTUNE threads), each in its own
      process of this venv;
    - MosaicML Streaming: `StreamingDataset` iterated bare, and through a torch
      DataLoader with 0, 1, 2 and 4 worker processes;
    - LitData: `StreamingDataset` + `StreamingDataLoader`, 0, 1, 2 and 4 workers;
    - WebDataset: `WebDataset` pipeline + `WebLoader`, 0, 1, 2 and 4 workers.
  Each peer at its documented settings with its own shuffle on (the settings
  used are in the table's notes and the JSON). A peer's best worker count is
  the one of --workers with the highest median. For each kind, two cells
  compare the toolkit (loaders.grain) with the best peer: with 0 worker
  processes, and with each peer at its best count.
  Raw timings run --raw_epochs epochs (JPEG one), each from building the
  loader (index and manifest reads, the downloads from a bucket) to its last
  batch, in a fresh process (imports untimed). Client CPU seconds (getrusage
  of the loader process, its joined worker processes included) are reported
  per GB read: the stored dataset's bytes times the epochs (local), or the
  bytes the bucket served (bucket).

  Conversion (--convert_kinds, JPEG by default): the toolkit's pipeline
  (`pipelines.image_folder.run`, DirectRunner, --direct_num_workers=1
  in-process or 2 multi_threading, the documented local mode for several
  workers: Pillow releases the GIL, and no worker processes start; ArrayRecord) against each peer's writer
  (MDSWriter, litdata.optimize, wds.ShardWriter) with 1 and 2 processes, on
  the same folder, each from the runner's or pool's start to its index
  written, in a fresh process. Every writer gets the same image work (the
  toolkit's: Pillow draft decode, RGB, bilinear resize and center crop, JPEG
  quality 95; `_peers_child.prepare`). Reported: images/s and toolkit /
  fastest peer at each process count.

Every variant runs once per round, the order rotated each round, for --rounds
rounds; medians are reported with every round. Datasets are converted once
and cached under --work (git-ignored); page caches are warmed first.

--storage=bucket reads everything from gs:// through scripts/bench_bucket.py's
local GCS JSON API server (--latency_ms first-byte latency per request,
--mbps per connection), with a fresh cache per timing (one cold epoch, also
for raw): the toolkit's loaders and LitData through google-cloud-storage
(STORAGE_EMULATOR_HOST), LitData with LITDATA_ASYNC_CHUNK_PREFETCH=0 (its
async prefetch uses obstore's GCSStore, which it builds without an endpoint),
WebDataset through `pipe:curl` of each object's media URL. MosaicML cannot
read gs:// from such an endpoint (see BUCKET_LIMITS): the run says so.

The peers are never dependencies of the toolkit: they live in a side
environment, pinned in constraints-peers.txt at the repository root, and run
through scripts/_peers_child.py (a JSON request in, a JSON line out):

    python3.11 -m venv /tmp/peersenv
    /tmp/peersenv/bin/pip install -c constraints-peers.txt \\
        mosaicml-streaming litdata webdataset torch torchvision pillow numpy

(torch from PyPI: Mosaic imports torchvision, whose PyPI wheels need PyPI's
CUDA torch, used here on the CPU; the set is about 6.4 GB installed.)

Prints the tables and the issue's targets as PASS/MISS (the toolkit's loader
>= 1.5x the best peer in every cell; its conversion >= 1.0x the fastest
peer's writer at the same process count on 2,000 images, >= 1.2x on 10,000);
exits 0 when every variant ran, 1 when any failed (its error is printed).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import dataclasses
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

SPLIT = "train"
CHILD = os.path.join(REPO, "scripts", "_peers_child.py")
CHILD_TIMEOUT_S = 1800
DEFAULT_PEERS_PYTHON = "/tmp/peersenv/bin/python"
JPEG_QUALITY = 95  # the toolkit's default (pipelines.image_folder.imaging.ImageOptions)
WDS_SHARDS = 8  # WebDataset splits shards among workers: at least as many shards as the most workers tried
BUCKET = "bench"
KIND_LABEL = {"raw": "raw", "jpeg": "JPEG"}
PEER_LABEL = {"grain": "toolkit loaders.grain (ArrayRecord)", "tfdata": "tf.data loaders.tfdata (TFRecord)",
              "mosaic": "MosaicML Streaming", "litdata": "LitData", "webdataset": "WebDataset"}
WRITER_LABEL = {"toolkit": "toolkit image_folder (Beam DirectRunner)", "mosaic": "MosaicML MDSWriter",
                "litdata": "LitData optimize", "webdataset": "WebDataset ShardWriter"}
THIRD_PARTY = ("mosaic", "litdata", "webdataset")

# What a peer needs to read gs://, from its source in the side environment (printed in bucket mode).
BUCKET_LIMITS = {
    "mosaic": (
        "MosaicML Streaming 0.13 cannot read gs:// from a GCS-compatible endpoint: "
        "streaming/base/storage/download.py GCSDownloader._create_gcs_client either builds a boto3 S3 client "
        "for endpoint_url='https://storage.googleapis.com' (hard-coded; with GCS_KEY/GCS_SECRET HMAC keys) or "
        "calls google.auth.default() and passes its credentials to google.cloud.storage.Client. The Client "
        "honours STORAGE_EMULATOR_HOST for the endpoint, but only substitutes anonymous credentials when none "
        "are passed; without Application Default Credentials Mosaic raises ValueError (no authentication), and "
        "with real ones each request needs a token minted by Google's OAuth endpoint. Reading the bench "
        "bucket would take fake credentials and a fake token server: not done."),
    "litdata": (
        "LitData reads gs:// with google.cloud.storage.Client(**storage_options) (streaming/downloader.py "
        "GCPDownloader), which honours STORAGE_EMULATOR_HOST (anonymous credentials, emulator endpoint); its "
        "default async chunk prefetch for remote data goes through obstore's GCSStore instead, which LitData "
        "builds with no endpoint (GCPDownloader._get_store; obstore takes one only from a service-account "
        "file's gcs_base_url, not from STORAGE_EMULATOR_HOST), so LITDATA_ASYNC_CHUNK_PREFETCH=0 is set to keep "
        "every read on google-cloud-storage."),
    "webdataset": (
        "WebDataset reads any URL a shell command can stream: pipe:curl -s -f of the object's JSON API media "
        "URL (HOST/download/storage/v1/b/B/o/NAME?alt=media), anonymous, as a user reading GCS over HTTP would "
        "(or pipe:gsutil cat / gcloud storage cat with credentials)."),
    "grain": "loaders.grain copies the gs:// split into its cache_dir (google-cloud-storage, STORAGE_EMULATOR_HOST).",
    "tfdata": "loaders.tfdata fetches gs:// shards into its cache_dir (google-cloud-storage, STORAGE_EMULATOR_HOST).",
}


@dataclasses.dataclass(frozen=True)
class ReadVariant:
  """One loader configuration: timed once per round in a fresh process."""

  name: str
  peer: str  # grain, tfdata, mosaic, litdata, webdataset
  kind: str  # raw or jpeg
  workers: int | None  # worker processes; None: threads only (the toolkit's loaders)
  mode: str = "loader"  # "bare": Mosaic's dataset iterated without a DataLoader


@dataclasses.dataclass(frozen=True)
class WriteVariant:
  name: str
  writer: str  # toolkit, mosaic, litdata, webdataset
  kind: str
  workers: int


# --------------------------------------------------------------------------- children


def run_process(cmd: Sequence[str], env: dict | None = None) -> dict:
  """bench_loaders.run_process with this script's timeout (imported here: the parent only loads frameworks)."""
  import bench_loaders

  return bench_loaders.run_process(cmd, env, CHILD_TIMEOUT_S)


def peer_child(a: argparse.Namespace, request: dict, env: dict | None = None) -> dict:
  return run_process([a.peers_python, CHILD, json.dumps(request)], env)


def toolkit_child(request: dict, env: dict | None = None) -> dict:
  return run_process([sys.executable, os.path.abspath(__file__), f"--_toolkit_child={json.dumps(request)}"], env)


def _cpu_seconds() -> float:
  me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def toolkit_read(req: dict) -> dict:
  """In a fresh process: `epochs` shuffled epochs of loaders.grain or loaders.tfdata, built inside the timing."""
  import bench_loaders  # noqa: E402 - check_batch; imports grain and the toolkit's loaders

  size, b, epochs = tuple(req["image_size"]), req["batch_size"], req["epochs"]
  if req["loader"] == "tfdata":
    import tensorflow as tf  # noqa: F401 - imported before the timing, as a training script has

    from loaders import tfdata
  else:
    from loaders import grain as grain_loader
  cpu0, t0 = _cpu_seconds(), time.perf_counter()
  n = 0
  if req["loader"] == "tfdata":
    ds = tfdata.dataset(req["source"], SPLIT, batch_size=b, shuffle=True, seed=req["seed"], num_epochs=epochs,
                        cache_dir=req["cache"], image_size=size)
    for batch in ds.as_numpy_iterator():
      bench_loaders.check_batch("tf.data", batch["image"], b, size)
      n += batch["image"].shape[0]
  else:
    ds = grain_loader.dataset(req["source"], SPLIT, batch_size=b, image_size=size, num_threads=req["num_threads"],
                              num_epochs=epochs, shuffle=True, seed=req["seed"], cache_dir=req["cache"])
    for batch in ds:
      bench_loaders.check_batch("grain", batch["image"], b, size)
      n += batch["image"].shape[0]
    ds.close()
  seconds = time.perf_counter() - t0
  cpu = _cpu_seconds() - cpu0
  least = epochs * (req["num_images"] - b)
  if n < max(b, least):
    raise RuntimeError(f"{req['loader']}: {n} images in {epochs} epochs of {req['num_images']}, expected at "
                       f"least {max(b, least)}")
  return {"seconds": seconds, "images": n, "batches": n // b, "cpu_s": cpu}


def toolkit_convert(req: dict) -> dict:
  """In a fresh process: `image_folder.run` on the DirectRunner, timed from the call (the runner's start)."""
  from formats import load_manifest
  from pipelines import image_folder

  out, w = req["out"], req["workers"]
  shutil.rmtree(out, ignore_errors=True)
  mode = "in_memory" if w == 1 else "multi_threading"  # the documented local mode for several workers
  argv = [f"--input={req['input']}", f"--output={out}", "--format=array_record", f"--encoding={req['kind']}",
          f"--image_size={req['image_size'][0]},{req['image_size'][1]}", "--overwrite=true", "--runner=DirectRunner",
          f"--direct_num_workers={w}", f"--direct_running_mode={mode}"]
  t0 = time.perf_counter()
  image_folder.run(argv)
  seconds = time.perf_counter() - t0
  return {"seconds": seconds, "images": load_manifest(out).num_records, "bytes": tree_bytes(out)}


# --------------------------------------------------------------------------- data, converted once


def tree_files(out: str) -> list[str]:
  return sorted(os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs)


def tree_bytes(out: str) -> int:
  return sum(os.path.getsize(p) for p in tree_files(out))


def ensure_tfrecord(work: str, root: str, kind: str, size: tuple[int, int]) -> str:
  """The cached TFRecord output of `image_folder` for `root` (bench_loaders.ensure_shards makes ArrayRecord)."""
  from formats import load_manifest
  from pipelines import image_folder

  out = os.path.join(work, "loaders", f"{os.path.basename(root)}_{kind}_{size[0]}x{size[1]}_tfrecord")
  if not os.path.exists(out + ".done"):
    t0 = time.perf_counter()
    image_folder.run([
        f"--input={root}", f"--output={out}", "--format=tfrecord", f"--encoding={kind}",
        f"--image_size={size[0]},{size[1]}", "--overwrite=true", "--runner=DirectRunner",
        "--direct_num_workers=1", "--direct_running_mode=in_memory",
    ])
    with open(out + ".done", "w") as f:
      f.write(f"{load_manifest(out).num_records}\n")
    print(f"converted {kind} TFRecord shards in {out} ({time.perf_counter() - t0:.1f}s)", flush=True)
  return out


def ensure_peer_data(a: argparse.Namespace, work: str, items: str, n: int, peer: str, kind: str) -> str:
  """The cached dataset of `peer`'s writer (1 process) for the listed images."""
  out = os.path.join(work, "peers_data", f"{peer}_{kind}_{n}_{a.image_size.replace(',', 'x')}")
  if not os.path.exists(out + ".done"):
    r = peer_child(a, {"mode": "convert", "peer": peer, "kind": kind, "items": items, "out": out, "workers": 1,
                       "image_size": list(a.size), "jpeg_quality": JPEG_QUALITY, "num_shards": WDS_SHARDS})
    if r["images"] != n:
      raise RuntimeError(f"{peer}: wrote {r['images']} images, expected {n}")
    with open(out + ".done", "w") as f:
      json.dump(r, f)
    print(f"converted {n} images to {peer} {kind} in {out} ({r['seconds']:.1f}s)", flush=True)
  return out


def warm(paths: Sequence[str]) -> int:
  import bench_loaders

  return bench_loaders.warm(paths)


# --------------------------------------------------------------------------- the runs


def median(xs: Sequence[float]) -> float | None:
  return statistics.median(xs) if xs else None


def read_variants(a: argparse.Namespace) -> list[ReadVariant]:
  out = []
  for kind in a.kinds:
    k = KIND_LABEL[kind]
    if "grain" in a.peers:
      out.append(ReadVariant(f"{k}: toolkit grain", "grain", kind, None))
    if "tfdata" in a.peers:
      out.append(ReadVariant(f"{k}: tf.data", "tfdata", kind, None))
    if "mosaic" in a.peers:
      out.append(ReadVariant(f"{k}: mosaic bare", "mosaic", kind, 0, "bare"))
    for peer in ("mosaic", "litdata", "webdataset"):
      if peer in a.peers:
        out += [ReadVariant(f"{k}: {peer} w{w}", peer, kind, w) for w in [0, *a.workers]]
  return out


def write_variants(a: argparse.Namespace) -> list[WriteVariant]:
  writers = ["toolkit"] + [p for p in THIRD_PARTY if p in a.peers]
  return [WriteVariant(f"{KIND_LABEL[k]}: {w} x{n}", w, k, n) for k in a.convert_kinds for w in writers
          for n in a.convert_workers]


def alternate(names: Sequence[str], rounds: int, run: Callable[[str, int], dict], label: str) -> tuple[dict, dict]:
  """Every name once per round, the order rotated each round; (results per name, failures)."""
  results: dict[str, list[dict]] = {v: [] for v in names}
  failures: dict[str, str] = {}
  for r in range(rounds if names else 0):
    order = list(names[r % len(names):]) + list(names[:r % len(names)])
    for v in order:
      if v in failures:
        continue
      try:
        res = run(v, r)
        results[v].append(res)
        print(f"{label} round {r + 1}/{rounds}: {v}: {res['images'] / res['seconds']:.1f} images/s "
              f"({res['seconds']:.2f}s)", flush=True)
      except RuntimeError as err:
        failures[v] = str(err)
        print(f"{label} round {r + 1}/{rounds}: {v}: FAILED {err}", flush=True)
  return results, failures


# --------------------------------------------------------------------------- report


def rates(runs: list[dict]) -> list[float]:
  return [x["images"] / x["seconds"] for x in runs]


def cpu_per_gb(runs: list[dict]) -> float | None:
  vals = [x["cpu_s"] / (x["bytes_read"] / 1e9) for x in runs if x.get("bytes_read")]
  return median(vals)


def report_reads(variants: list[ReadVariant], results: dict, failures: dict,
                 a: argparse.Namespace) -> tuple[list[dict], dict[str, int]]:
  """Prints the loaders' table and the cells; returns the cells and each peer's best worker count."""
  by_name = {v.name: v for v in variants}
  print()
  print(f"Loading, {a.num_images_found} images {a.image_size}, batch {a.batch_size}, {a.storage} storage, "
        f"medians of {a.rounds} rounds (raw: {a.epochs['raw']} epochs per timing)")
  print(f"{'variant':<24} {'loader':<42} {'workers':>8} {'img/s':>9} {'CPU-s/GB':>9}   every round")
  for v in variants:
    xs = rates(results[v.name])
    w = "threads" if v.workers is None else str(v.workers)
    loader = PEER_LABEL[v.peer] + (", no DataLoader" if v.mode == "bare" else "")
    if v.name in failures:
      print(f"{v.name:<24} {loader:<42} {w:>8} {'FAILED':>9}")
      continue
    cpu = cpu_per_gb(results[v.name])
    cpu_s = f"{cpu:9.1f}" if cpu is not None else f"{'-':>9}"
    print(f"{v.name:<24} {loader:<42} {w:>8} {median(xs):9.1f} {cpu_s}   {' '.join(f'{x:.1f}' for x in xs)}")

  cells = []
  for kind in a.kinds:
    med = {v.name: median(rates(results[v.name])) for v in variants
           if v.kind == kind and v.name not in failures and results[v.name]}
    tk = next((n for n in med if by_name[n].peer == "grain"), None)
    for cell in ("0 workers", "best workers"):
      best: tuple[float, str] | None = None
      for n, m in med.items():
        v = by_name[n]
        if v.peer == "grain":
          continue
        if v.workers is not None and (v.workers == 0) != (cell == "0 workers"):
          continue
        if best is None or m > best[0]:
          best = (m, n)
      entry = {"kind": kind, "cell": cell, "toolkit": tk, "toolkit_images_per_s": med.get(tk),
               "best_peer": best[1] if best else None, "best_peer_images_per_s": best[0] if best else None}
      entry["ratio"] = (entry["toolkit_images_per_s"] / best[0]) if tk and best else None
      best3 = max(((m, n) for n, m in med.items() if by_name[n].peer in THIRD_PARTY
                   and (by_name[n].workers == 0) == (cell == "0 workers")), default=None)
      entry["best_third_party"] = best3[1] if best3 else None
      entry["ratio_vs_third_party"] = (med[tk] / best3[0]) if tk and best3 else None
      cells.append(entry)
  best_workers = {}
  for kind in a.kinds:
    for peer in THIRD_PARTY:
      cands = [(median(rates(results[v.name])), v.workers) for v in variants
               if v.kind == kind and v.peer == peer and v.mode == "loader" and v.workers
               and v.name not in failures and results[v.name]]
      if cands:
        best_workers[f"{kind}/{peer}"] = max(cands)[1]
  print()
  print("Best worker count per peer (of " + ",".join(map(str, a.workers)) + "): " +
        ", ".join(f"{k} {w}" for k, w in best_workers.items()))
  print(f"{'cell':<20} {'toolkit img/s':>13} {'best peer':<24} {'img/s':>9} {'toolkit/best':>12}"
        f" {'best 3rd-party':<24} {'toolkit/it':>10}")
  for c in cells:
    def f(x, fmt):
      return format(x, fmt) if x is not None else "-"
    print(f"{KIND_LABEL[c['kind']] + ', ' + c['cell']:<20} {f(c['toolkit_images_per_s'], '13.1f'):>13} "
          f"{c['best_peer'] or '-':<24} {f(c['best_peer_images_per_s'], '9.1f'):>9} {f(c['ratio'], '12.2f'):>12} "
          f"{c['best_third_party'] or '-':<24} {f(c['ratio_vs_third_party'], '10.2f'):>10}")
  for c in cells:
    if c["ratio"] is not None:
      ok = c["ratio"] >= READ_TARGET
      print(f"  {'PASS' if ok else 'MISS'}  {KIND_LABEL[c['kind']]}, {c['cell']}: toolkit / best peer "
            f"({c['best_peer']}) = {c['ratio']:.2f} (target >= {READ_TARGET:g})")
  for name, why in failures.items():
    print(f"FAILED {name}: {why}")
  return cells, best_workers


def report_writes(variants: list[WriteVariant], results: dict, failures: dict, a: argparse.Namespace) -> list[dict]:
  print()
  print(f"Conversion of the {a.num_images_found}-image folder to {a.image_size}, medians of {a.rounds} rounds "
        "(wall time from the runner's or pool's start to the index written, in a fresh process)")
  print(f"{'writer':<42} {'kind':<5} {'procs':>5} {'seconds':>8} {'img/s':>8}   every round (s)")
  for v in variants:
    if v.name in failures:
      print(f"{WRITER_LABEL[v.writer]:<42} {KIND_LABEL[v.kind]:<5} {v.workers:>5} {'FAILED':>8}")
      continue
    s = [x["seconds"] for x in results[v.name]]
    print(f"{WRITER_LABEL[v.writer]:<42} {KIND_LABEL[v.kind]:<5} {v.workers:>5} {median(s):8.2f} "
          f"{median(rates(results[v.name])):8.1f}   {' '.join(f'{x:.2f}' for x in s)}")
  cells = []
  for kind in a.convert_kinds:
    for w in a.convert_workers:
      med = {v.writer: median(rates(results[v.name])) for v in variants
             if v.kind == kind and v.workers == w and v.name not in failures and results[v.name]}
      peers = {p: m for p, m in med.items() if p != "toolkit"}
      fastest = max(peers, key=peers.get) if peers else None
      ratio = med["toolkit"] / peers[fastest] if "toolkit" in med and fastest else None
      cells.append({"kind": kind, "workers": w, "toolkit_images_per_s": med.get("toolkit"),
                    "fastest_peer": fastest, "fastest_peer_images_per_s": peers.get(fastest), "ratio": ratio})
      target = CONVERT_TARGET_10K if a.num_images_found >= 10_000 else CONVERT_TARGET
      verdict = "" if ratio is None else ("PASS  " if ratio >= target else "MISS  ")
      print(f"  {verdict}{KIND_LABEL[kind]}, {w} process(es): toolkit / fastest peer ({fastest}) = "
            + (f"{ratio:.2f}" if ratio is not None else "-") + f" (target >= {target:g})")
  for name, why in failures.items():
    print(f"FAILED {name}: {why}")
  return cells


READ_TARGET = 1.5  # the toolkit's loader against the best peer, every cell
CONVERT_TARGET, CONVERT_TARGET_10K = 1.0, 1.2  # its conversion against the fastest peer's writer


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--peers_python", default=DEFAULT_PEERS_PYTHON, help="the side environment's python")
  ap.add_argument("--work", default=os.path.join("bench_work", "peers"), help="cache of images and datasets")
  ap.add_argument("--num_images", type=int, default=2000)
  ap.add_argument("--image_size", default="224,224")
  ap.add_argument("--batch_size", type=int, default=64)
  ap.add_argument("--num_threads", type=int, default=16, help="loaders.grain's threads (capped at the CPUs)")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--raw_epochs", type=int, default=3, help="epochs per raw timing (local storage)")
  ap.add_argument("--workers", default="1,2,4", help="the peers' worker counts tried besides 0")
  ap.add_argument("--kinds", default="raw,jpeg", help="what the loaders read: raw and/or jpeg")
  ap.add_argument("--peers", default="grain,tfdata,mosaic,litdata,webdataset", help="the loaders and writers run")
  ap.add_argument("--convert_kinds", default="jpeg", help="kinds to time the conversion of; empty: skip it")
  ap.add_argument("--convert_workers", default="1,2", help="processes per writer in the conversion timings")
  ap.add_argument("--storage", choices=("local", "bucket"), default="local")
  ap.add_argument("--latency_ms", type=float, default=30.0, help="--storage=bucket: first-byte latency")
  ap.add_argument("--mbps", type=float, default=100.0, help="--storage=bucket: per-connection MB/s")
  ap.add_argument("--json", default=None, help="also write the results here")
  ap.add_argument("--_toolkit_child", default=None, help=argparse.SUPPRESS)
  a = ap.parse_args(argv)

  def ints(flag: str, text: str) -> list[int]:
    try:
      vals = [int(x) for x in text.split(",") if x]
    except ValueError:
      ap.error(f"--{flag} takes comma-separated integers, got {text!r}")
    if any(v < 1 for v in vals):
      ap.error(f"--{flag} values must be >= 1, got {text!r}")
    return vals

  if a._toolkit_child:
    return a
  if min(a.rounds, a.num_images, a.batch_size, a.raw_epochs, a.num_threads) < 1:
    ap.error("--rounds, --num_images, --batch_size, --raw_epochs and --num_threads must be >= 1")
  a.workers, a.convert_workers = ints("workers", a.workers), ints("convert_workers", a.convert_workers)
  a.kinds = [k for k in a.kinds.split(",") if k]
  a.convert_kinds = [k for k in a.convert_kinds.split(",") if k]
  a.peers = [p for p in a.peers.split(",") if p]
  if not a.kinds or set(a.kinds + a.convert_kinds) - set(KIND_LABEL):
    ap.error(f"--kinds and --convert_kinds take raw and/or jpeg, got {a.kinds} and {a.convert_kinds}")
  if set(a.peers) - set(PEER_LABEL):
    ap.error(f"--peers takes some of {','.join(PEER_LABEL)}, got {a.peers}")
  try:
    a.size = tuple(int(v) for v in a.image_size.split(","))
  except ValueError:
    a.size = ()
  if len(a.size) != 2 or min(a.size) < 1:
    ap.error(f"--image_size must be H,W, got {a.image_size!r}")
  if not os.path.exists(a.peers_python) and set(a.peers) & set(THIRD_PARTY):
    ap.error(f"--peers_python={a.peers_python} does not exist; make the side environment (see --help)")
  return a


def main(argv: Sequence[str] | None = None) -> int:
  a = parse_args(argv)
  if a._toolkit_child:
    req = json.loads(a._toolkit_child)
    result = toolkit_convert(req) if req["mode"] == "convert" else toolkit_read(req)
    print(json.dumps(result), flush=True)
    return 0

  import bench_image_folder  # noqa: E402 - the parent only (Beam): children import their own framework
  import bench_loaders  # noqa: E402

  bench_image_folder.quiet_beam()

  work = os.path.abspath(a.work)
  root, n = bench_image_folder.ensure_images(work, a.num_images)
  a.num_images_found = n
  items = os.path.join(work, f"items_{os.path.basename(root)}.json")
  with open(items, "w") as f:
    json.dump(bench_loaders.list_images(root), f)

  # The datasets, each converted once: the toolkit's by its pipeline, the peers' by their writers.
  data: dict[tuple[str, str], str] = {}
  for kind in a.kinds:
    if "grain" in a.peers:
      data["grain", kind] = bench_loaders.ensure_shards(work, root, kind, a.size)
    if "tfdata" in a.peers:
      data["tfdata", kind] = ensure_tfrecord(work, root, kind, a.size)
    for peer in THIRD_PARTY:
      if peer in a.peers:
        data[peer, kind] = ensure_peer_data(a, work, items, n, peer, kind)
  sizes = {key: tree_bytes(path) for key, path in data.items()}
  versions = peer_child(a, {"mode": "versions"})["versions"] if set(a.peers) & set(THIRD_PARTY) else {}
  toolkit_versions = {}
  from importlib import metadata

  for name in ("grain", "tensorflow-cpu", "apache-beam", "array-record", "numpy", "pillow",
               "google-cloud-storage"):
    try:
      toolkit_versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      toolkit_versions[name] = None
  print(f"peers (side env {a.peers_python}): {versions}")
  print(f"toolkit (main venv): {toolkit_versions}")

  bucket = None
  sources: dict[tuple[str, str], str] = {}
  wds_shards: dict[str, list[str]] = {}
  scratch = tempfile.mkdtemp(prefix="peers_", dir=work)
  child_env = dict(os.environ)
  try:
    if a.storage == "bucket":
      import bench_bucket  # noqa: E402 - only for --storage=bucket

      broot = os.path.join(work, "bucket_root")
      shutil.rmtree(broot, ignore_errors=True)
      bucket = bench_bucket.BenchBucket(broot, latency_ms=a.latency_ms, mbps=a.mbps)
      bucket.start()
      for (peer, kind), path in data.items():
        sources[peer, kind] = bench_bucket.stage(broot, BUCKET, path, os.path.basename(path))
        bucket.warm(sources[peer, kind])
      child_env["STORAGE_EMULATOR_HOST"] = bucket.host
      child_env["LITDATA_ASYNC_CHUNK_PREFETCH"] = "0"
      print(f"bench bucket {bucket.host} (latency {a.latency_ms} ms, {a.mbps} MB/s per connection); "
            f"staged {len(sources)} datasets")
      for peer in a.peers:
        print(f"  {peer}: {BUCKET_LIMITS[peer]}")
      from urllib.parse import quote

      for kind in a.kinds:
        if ("webdataset", kind) in data:
          local = data["webdataset", kind]
          prefix = sources["webdataset", kind][len(f"gs://{BUCKET}/"):]
          wds_shards[kind] = [
              f"pipe:curl -s -f {bucket.host}/download/storage/v1/b/{BUCKET}/o/"
              f"{quote(prefix + '/' + os.path.relpath(p, local), safe='')}?alt=media"
              for p in tree_files(local) if p.endswith(".tar")]
    else:
      sources = dict(data)
      for kind in a.kinds:
        if ("webdataset", kind) in data:
          wds_shards[kind] = [p for p in tree_files(data["webdataset", kind]) if p.endswith(".tar")]
      cached = warm([p for path in data.values() for p in tree_files(path)])
      print(f"page cache warmed: {cached / 1e6:.0f} MB")
    a.epochs = {"raw": 1 if bucket else a.raw_epochs, "jpeg": 1}

    reads = read_variants(a)
    by_name = {v.name: v for v in reads}

    def run_read(name: str, r: int) -> dict:
      v = by_name[name]
      cache = tempfile.mkdtemp(prefix="cache_", dir=scratch)  # a fresh cache each time: a cold epoch
      req = {"mode": "read", "kind": v.kind, "source": sources[v.peer, v.kind], "batch_size": a.batch_size,
             "image_size": list(a.size), "epochs": a.epochs[v.kind], "seed": r, "cache": cache,
             "num_images": n}
      stats0 = bucket.stats() if bucket else None
      try:
        if v.peer in ("grain", "tfdata"):
          res = toolkit_child({**req, "loader": v.peer, "num_threads": a.num_threads}, child_env)
        else:
          res = peer_child(a, {**req, "peer": v.peer, "variant": v.mode, "workers": v.workers,
                               "shards": wds_shards.get(v.kind, [])}, child_env)
      finally:
        shutil.rmtree(cache, ignore_errors=True)
      if bucket:
        res["bytes_read"] = bucket.stats()["bytes_sent"] - stats0["bytes_sent"]
      else:
        res["bytes_read"] = sizes[v.peer, v.kind] * a.epochs[v.kind]
      return res

    # A peer that cannot read the bench bucket (Mosaic: BUCKET_LIMITS) is tried once, and its error shown.
    unsupported: dict[str, str] = {}
    if bucket:
      for peer in THIRD_PARTY:
        probe = next((v for v in reads if v.peer == peer), None)
        if probe is None:
          continue
        try:
          run_read(probe.name, 0)
        except RuntimeError as err:
          unsupported[peer] = str(err)
          print(f"{peer} cannot read gs:// from the bench bucket ({probe.name}: {err})\n  why: {BUCKET_LIMITS[peer]}")
      reads = [v for v in reads if v.peer not in unsupported]
    read_names = [v.name for v in reads]
    read_results, read_failures = alternate(read_names, a.rounds, run_read, "read")
    read_cells, best_workers = report_reads(reads, read_results, read_failures, a)

    writes = write_variants(a) if a.storage == "local" else []
    wby = {v.name: v for v in writes}

    def run_write(name: str, r: int) -> dict:
      v = wby[name]
      out = os.path.join(scratch, f"convert_{v.writer}_{v.kind}_{v.workers}")
      try:
        if v.writer == "toolkit":
          res = toolkit_child({"mode": "convert", "input": root, "out": out, "kind": v.kind,
                               "image_size": list(a.size), "workers": v.workers})
        else:
          res = peer_child(a, {"mode": "convert", "peer": v.writer, "kind": v.kind, "items": items, "out": out,
                               "workers": v.workers, "image_size": list(a.size), "jpeg_quality": JPEG_QUALITY,
                               "num_shards": WDS_SHARDS})
      finally:
        shutil.rmtree(out, ignore_errors=True)
      if res["images"] != n:
        raise RuntimeError(f"{name}: wrote {res['images']} images, expected {n}")
      return res

    write_results, write_failures = alternate([v.name for v in writes], a.rounds, run_write, "convert")
    write_cells = report_writes(writes, write_results, write_failures, a) if writes else []
    if a.storage == "bucket" and a.convert_kinds:
      print("\n(conversion is timed with --storage=local only: every writer writes to local disk)")
  finally:
    if bucket is not None:
      bucket.close()
    shutil.rmtree(scratch, ignore_errors=True)

  if a.json:
    settings = {}
    for v in reads:
      s = next((x.get("settings") for x in read_results[v.name] if x.get("settings")), None)
      if v.peer == "grain":
        s = {"loader": "loaders.grain.dataset", "num_threads": bench_loaders.threads_of(a),
             "worker_processes": 0, "shuffle": "on (seeded permutation per epoch)", "prefetch_buffer_size": 64,
             "cache_dir": "fresh per timing (gs:// split copied into it)" if bucket else "none (local shards)"}
      elif v.peer == "tfdata":
        s = {"loader": "loaders.tfdata.dataset", "parallelism": "tf.data AUTOTUNE map and prefetch",
             "worker_processes": 0, "shuffle": "on (buffer 10,000, reshuffled each epoch)",
             "cache_dir": "fresh per timing (gs:// shards fetched into it)" if bucket else "none (local shards)"}
      settings[v.name] = {**(s or {}), "batch_size": a.batch_size, "epochs": a.epochs[v.kind],
                          "workers": v.workers if v.workers is not None else "threads"}
    out = {
        "num_images": n, "image_size": a.image_size, "batch_size": a.batch_size, "rounds": a.rounds,
        "storage": a.storage, "latency_ms": a.latency_ms if bucket else None, "mbps": a.mbps if bucket else None,
        "cpus": os.cpu_count(), "epochs": a.epochs, "versions": {"peers": versions, "toolkit": toolkit_versions},
        "dataset_bytes": {f"{p}/{k}": b for (p, k), b in sizes.items()},
        "reads": [{"variant": v.name, "peer": v.peer, "kind": v.kind, "workers": v.workers, "mode": v.mode,
                   "median_images_per_s": median(rates(read_results[v.name])),
                   "rounds_images_per_s": rates(read_results[v.name]),
                   "cpu_s_per_gb": cpu_per_gb(read_results[v.name]),
                   "runs": read_results[v.name], "settings": settings[v.name]} for v in reads],
        "read_cells": read_cells, "best_workers": best_workers, "read_failures": read_failures,
        "conversion": [{"variant": v.name, "writer": v.writer, "kind": v.kind, "workers": v.workers,
                        "median_seconds": median([x["seconds"] for x in write_results[v.name]]),
                        "median_images_per_s": median(rates(write_results[v.name])),
                        "runs": write_results[v.name]} for v in writes],
        "conversion_cells": write_cells, "conversion_failures": write_failures,
        "bucket_notes": {p: BUCKET_LIMITS[p] for p in a.peers} if bucket else None,
        "cannot_read_bucket": unsupported,
    }
    with open(a.json, "w") as f:
      json.dump(out, f, indent=2)
  return 1 if read_failures or write_failures else 0


if __name__ == "__main__":
  sys.exit(main())
