"""Benchmarks how the toolkit reaches gs:// against etils.epath, fsspec/gcsfs and google-cloud-storage's transfer_manager.

    python scripts/bench_storage.py [--rounds=3] [--work=bench_work/storage] [--latency_ms=30] [--mbps=100]
        [--threads=16] [--ops=list,small,ranged,download,create,cas] [--scale=1.0]
        [--side_python=/path/to/venv/bin/python] [--json=results.json]

One benchmark bucket (scripts/bench_bucket.py: its own process, sendfile,
`--latency_ms` first-byte latency and a `--mbps` cap per connection, like GCS
from a VM in its region) serves, under gs://bench/storage/:
  list/    5,000 objects of 1 KiB in 50 folders (an image folder's classes);
  small/   2,000 objects of 100 KB;
  big.bin  one 256 MiB object.
Each library runs in a worker process of its own (this script with
--worker), so each one's client CPU (process CPU time: user + system, all
threads, and the children of transfer_manager's process pool) is measured
apart from the others' and from the server's. The operations, each timed
once per variant per round, the variants in a rotated order every round, one
warm-up round first at a tenth of the items (imports, connections,
credentials; downloads are not repeated there) that is not counted:
  list      every object under list/ (recursive), names sorted;
  small     2,000 whole-object reads, `--threads` at once (the library's own
            batch call where it has one, with the same concurrency);
  ranged    1,000 reads of 150 KB at random offsets of big.bin, the same way;
  download  big.bin to a local file, verified against its SHA-256 (a second
            pass over the file where the library cannot hash while streaming);
  create    100 writes of 1 KiB that must not replace an existing object
            (ifGenerationMatch=0), then a check that a second create is refused;
  cas       100 replacements that must find the generation they name
            (ifGenerationMatch=N), then a check that a stale one is refused.
A variant that cannot express an operation is listed as such, not run.

Variants: the toolkit's current path (formats.storage: files, gcs_media,
gcs_download; the reference of every ratio), google-cloud-storage's Blob and
transfer_manager, fsspec/gcsfs, and etils.epath on its fsspec backend.
epath's default backend for gs:// when TensorFlow is installed (this venv)
is tf.io.gfile, whose GCS endpoint cannot be redirected to a local server, so
the epath worker sets EPATH_USE_TF=false. gcsfs and epath run in
`--side_python`, a venv where gcsfs is installed (gcsfs is not in
constraints.txt); without one they are skipped. gcsfs's experimental
zonal-bucket layer (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT, on by default) first
asks the Storage Control gRPC service for the bucket's type, which a local
server cannot answer (a 60 s timeout): the workers turn it off. The bench
bucket's multipart parser wants CRLF line ends, gcsfs sends LF (GCS accepts
both), so the gcsfs worker rewrites the line ends of its multipart uploads.

Every variant's bytes are compared with the reference's (SHA-256 per item).
Prints per operation and variant the medians of wall time and client CPU per
item, their ratios to the reference, requests and KB the server sent per item.
`run(...)` returns the figures as a dict (tests/test_bench_storage.py runs it small).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import concurrent.futures
import dataclasses
import gc
import hashlib
import importlib.util
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

MiB = 1 << 20
BUCKET = "bench"
PREFIX = "storage"
OPS = ("list", "small", "ranged", "download", "create", "cas")
_RESULT = "@@bench_storage "  # a worker's answer lines start with this (libraries may print too)
_COMMAND_TIMEOUT_S = 600.0
_HASH_BLOCK = 8 * MiB
CHECKED = 5  # names a create or cas is checked on afterwards (a second create, a stale generation)


@dataclasses.dataclass(frozen=True)
class Sizes:
  """How much data each operation moves.

  Attributes:
    list_objects: objects under list/ (spread over list_folders folders).
    list_folders: folders under list/.
    list_bytes: bytes per listed object.
    small_objects: objects under small/, each read once per timing.
    small_bytes: bytes per small object.
    ranged_reads: ranged reads of big.bin per timing.
    ranged_bytes: bytes per ranged read.
    big_bytes: the size of big.bin.
    writes: conditional writes per timing (create, cas).
    write_bytes: bytes per write.
    chunk_bytes: the chunk of a parallel download.
    streams: the parallel streams of a download.
  """

  list_objects: int = 5000
  list_folders: int = 50
  list_bytes: int = 1024
  small_objects: int = 2000
  small_bytes: int = 100_000
  ranged_reads: int = 1000
  ranged_bytes: int = 150_000
  big_bytes: int = 256 * MiB
  writes: int = 100
  write_bytes: int = 1024
  chunk_bytes: int = 32 * MiB
  streams: int = 8

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if not isinstance(getattr(self, f.name), int) or getattr(self, f.name) < 1:
        raise ValueError(f"{f.name} must be an integer >= 1, got {getattr(self, f.name)!r}")
    if self.ranged_bytes > self.big_bytes:
      raise ValueError(f"ranged_bytes {self.ranged_bytes} exceeds big_bytes {self.big_bytes}")
    if self.list_folders > self.list_objects:
      raise ValueError(f"list_folders {self.list_folders} exceeds list_objects {self.list_objects}")

  def scaled(self, factor: float) -> Sizes:
    """These sizes with every count (not the byte sizes) multiplied by `factor` (at least 1 each)."""
    counts = ("list_objects", "small_objects", "ranged_reads", "writes")
    return dataclasses.replace(self, **{k: max(1, round(getattr(self, k) * factor)) for k in counts},
                               list_folders=max(1, min(self.list_folders, round(self.list_objects * factor))))


@dataclasses.dataclass(frozen=True)
class Variant:
  """One way of doing one operation.

  Attributes:
    op: the operation (one of OPS).
    name: what the table calls it.
    worker: the worker process that runs it ("toolkit", "gcsfs", "epath").
    fraction: the share of the operation's items it does per timing (a slow variant does fewer; figures are per item).
    reference: whether the others' ratios are taken against it.
  """

  op: str
  name: str
  worker: str
  fraction: float = 1.0
  reference: bool = False


VARIANTS = (
    Variant("list", "toolkit files.walk (google-cloud-storage list_blobs)", "toolkit", reference=True),
    Variant("list", "gcsfs find", "gcsfs"),
    Variant("list", "epath walk (fsspec)", "epath"),
    Variant("small", "toolkit files.read_bytes (Blob.download_as_bytes)", "toolkit", reference=True),
    Variant("small", "toolkit gcs_media.read_into (size known)", "toolkit"),
    Variant("small", "gcsfs cat (batch)", "gcsfs"),
    Variant("small", "epath read_bytes (fsspec)", "epath", fraction=0.25),
    Variant("ranged", "toolkit gcs_download.read_range_into (gcs_media)", "toolkit", reference=True),
    Variant("ranged", "google-cloud-storage Blob.download_as_bytes(start, end)", "toolkit"),
    Variant("ranged", "gcsfs cat_ranges (batch)", "gcsfs"),
    Variant("ranged", "epath open+seek+read (fsspec)", "epath", fraction=0.2),
    Variant("download", "toolkit gcs_download.download (durable=False)", "toolkit", reference=True),
    Variant("download", "toolkit gcs_download.download (durable=True)", "toolkit"),
    Variant("download", "transfer_manager chunks, threads + SHA-256 pass", "toolkit"),
    Variant("download", "transfer_manager chunks, processes + SHA-256 pass", "toolkit"),
    Variant("download", "gcsfs get_file + SHA-256 pass", "gcsfs"),
    Variant("download", "epath copy + SHA-256 pass", "epath"),
    Variant("create", "toolkit Blob.upload_from_string(if_generation_match=0)", "toolkit", reference=True),
    Variant("create", "gcsfs pipe_file(mode='create')", "gcsfs"),
    Variant("cas", "toolkit Blob.upload_from_string(if_generation_match=N)", "toolkit", reference=True),
)

# What a library cannot express at all (listed in the report instead of timed).
CANNOT = {
    ("create", "epath"): "open() takes only 'r', 'w', 'a' (mode 'x' is refused); no precondition argument",
    ("cas", "gcsfs"): "only ifGenerationMatch=0 (mode='create'); no write conditioned on a named generation",
    ("cas", "epath"): "no precondition of any kind",
    ("cas", "transfer_manager"): "bulk transfers only; a conditional write is the Blob call itself",
    ("list", "transfer_manager"): "no listing",
    ("ranged", "transfer_manager"): "whole objects only (download_chunks_concurrently refuses start/end)",
}


# --------------------------------------------------------------------------- the data


def stage(root: str, sizes: Sizes, seed: int = 0) -> dict:
  """Writes the objects into the bench bucket's folder (kept when a previous run wrote the same sizes).

  Args:
    root: the bench bucket server's folder of buckets.
    sizes: how much to write.
    seed: the random bytes' seed.

  Returns:
    {"list": prefix, "list_names": [...], "small": [paths], "big": path, "big_sha256": hex, "create": prefix}.
  """
  base = os.path.join(root, BUCKET, PREFIX)
  marker = os.path.join(root, f".{PREFIX}-staged.json")
  want = {"sizes": dataclasses.asdict(sizes), "seed": seed}
  gs = f"gs://{BUCKET}/{PREFIX}"
  list_names = [f"c{i % sizes.list_folders:03d}/i{i:05d}.bin" for i in range(sizes.list_objects)]
  small = [f"{gs}/small/s{i:05d}.bin" for i in range(sizes.small_objects)]
  staged = None
  if os.path.exists(marker):
    with open(marker) as f:
      staged = json.load(f)
  if staged is None or staged.get("want") != want:
    shutil.rmtree(base, ignore_errors=True)
    rng = random.Random(seed)
    for name in list_names:
      _write(os.path.join(base, "list", name), rng.randbytes(sizes.list_bytes))
    for i in range(sizes.small_objects):
      _write(os.path.join(base, "small", f"s{i:05d}.bin"), rng.randbytes(sizes.small_bytes))
    digest = hashlib.sha256()
    os.makedirs(base, exist_ok=True)
    with open(os.path.join(base, "big.bin"), "wb") as f:
      left = sizes.big_bytes
      while left:
        block = rng.randbytes(min(left, _HASH_BLOCK))
        digest.update(block)
        f.write(block)
        left -= len(block)
    staged = {"want": want, "big_sha256": digest.hexdigest()}
    with open(marker, "w") as f:
      json.dump(staged, f)
  shutil.rmtree(os.path.join(base, "create"), ignore_errors=True)
  return {"list": f"{gs}/list", "list_names": sorted(list_names), "small": small, "big": f"{gs}/big.bin",
          "big_sha256": staged["big_sha256"], "create": f"{gs}/create"}


def _write(path: str, data: bytes) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb") as f:
    f.write(data)


def _relative(names: Sequence[str], prefix: str) -> list[str]:
  """Object names below a gs:// prefix, sorted, whichever form a library gives them in (with or without gs://)."""
  bare = prefix[len("gs://"):].rstrip("/") + "/"
  out = []
  for n in names:
    n = n[len("gs://"):] if n.startswith("gs://") else n
    if not n.startswith(bare):
      raise ValueError(f"{n!r} is not below {prefix}")
    out.append(n[len(bare):])
  return sorted(out)


def _sha(data) -> str:
  return hashlib.sha256(data).hexdigest()


def _sha256_file(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(_HASH_BLOCK):
      digest.update(block)
  return digest.hexdigest()


def _threads(fn: Callable, items: Sequence, threads: int) -> list:
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    return list(pool.map(fn, items))


# --------------------------------------------------------------------------- the libraries (inside a worker)


class _Library:
  """A library's way of doing each operation: `op(variant_name, command) -> result` (what measure() times)."""

  def close(self) -> None:
    pass


class _Toolkit(_Library):
  """formats.storage (files, gcs_media, gcs_download), google-cloud-storage's Blob and transfer_manager."""

  def __init__(self):
    from formats.storage import files, gcs_download, gcs_media

    self.files, self.gcs_media, self.gcs_download = files, gcs_media, gcs_download
    self.versions = {"google-cloud-storage": _version("google-cloud-storage")}

  def list(self, variant: str, c: dict):
    return self.files.walk(c["prefix"])

  def small(self, variant: str, c: dict):
    if variant.startswith("toolkit gcs_media"):
      def read(path):
        buffer = bytearray(c["size"])
        self.gcs_media.read_into(path, 0, buffer)
        return buffer
      return _threads(read, c["paths"], c["threads"])
    return _threads(self.files.read_bytes, c["paths"], c["threads"])

  def ranged(self, variant: str, c: dict):
    path, ranges = c["path"], c["ranges"]
    if variant.startswith("google-cloud-storage"):
      def read(r):
        return self.files.gcs_blob(path).download_as_bytes(start=r[0], end=r[0] + r[1] - 1)
      return _threads(read, ranges, c["threads"])
    obj = self.gcs_download.RemoteObject(path, c["size"])  # the first read pins the generation, as loaders do

    def read(r):
      buffer = bytearray(r[1])
      self.gcs_download.read_range_into(obj, r[0], buffer)
      return buffer
    return _threads(read, ranges, c["threads"])

  def download(self, variant: str, c: dict):
    dest = os.path.join(c["dest_dir"], "big.bin")
    if variant.startswith("toolkit"):
      options = self.gcs_download.DownloadOptions(streams=c["streams"], chunk_bytes=c["chunk_bytes"], progress=False,
                                                  durable="durable=True" in variant)
      self.gcs_download.download(self.gcs_download.remote_object(c["path"]), dest, c["sha256"], options=options)
      return c["sha256"]  # download() raised unless the file's SHA-256 is this
    from google.cloud.storage import transfer_manager

    worker_type = transfer_manager.PROCESS if "processes" in variant else transfer_manager.THREAD
    transfer_manager.download_chunks_concurrently(self.files.gcs_blob(c["path"]), dest, chunk_size=c["chunk_bytes"],
                                                  worker_type=worker_type, max_workers=c["streams"],
                                                  crc32c_checksum=True)
    return _sha256_file(dest)

  def create(self, variant: str, c: dict):
    data = c["data"].encode("latin-1")
    for path in c["paths"]:
      self.files.gcs_blob(path).upload_from_string(data, content_type="application/octet-stream",
                                                   if_generation_match=0)
    return None

  def create_refused(self, path: str, data: bytes) -> bool:
    try:
      self.files.gcs_blob(path).upload_from_string(data, if_generation_match=0)
    except self.files.gcs_precondition_failed():
      return True
    return False

  def cas_setup(self, paths: Sequence[str], data: bytes) -> list[int]:
    generations = []
    for path in paths:
      blob = self.files.gcs_blob(path)
      blob.upload_from_string(data)
      generations.append(int(blob.generation))
    return generations

  def cas(self, variant: str, c: dict):
    data = c["data"].encode("latin-1")
    out = []
    for path, generation in zip(c["paths"], c["generations"]):
      blob = self.files.gcs_blob(path)
      blob.upload_from_string(data, content_type="application/octet-stream", if_generation_match=generation)
      out.append(int(blob.generation))
    return out

  def cas_refused(self, path: str, stale: int, data: bytes) -> bool:
    try:
      self.files.gcs_blob(path).upload_from_string(data, if_generation_match=stale)
    except self.files.gcs_precondition_failed():
      return True
    return False


class _Gcsfs(_Library):
  """fsspec/gcsfs: its batch calls (cat, cat_ranges) run their requests concurrently on its event loop."""

  def __init__(self):
    import gcsfs

    _crlf_multipart(gcsfs.GCSFileSystem)
    self.fs = gcsfs.GCSFileSystem(token="anon", use_listings_cache=False)
    self.versions = {"gcsfs": _version("gcsfs"), "fsspec": _version("fsspec"), "aiohttp": _version("aiohttp")}

  def list(self, variant: str, c: dict):
    return self.fs.find(c["prefix"])

  def small(self, variant: str, c: dict):
    got = self.fs.cat(c["paths"], batch_size=c["threads"], on_error="raise")
    by_name = {("gs://" + k if not k.startswith("gs://") else k): v for k, v in got.items()}
    return [by_name[p] for p in c["paths"]]

  def ranged(self, variant: str, c: dict):
    ranges = c["ranges"]
    out = self.fs.cat_ranges([c["path"]] * len(ranges), [a for a, _ in ranges], [a + n for a, n in ranges],
                             batch_size=c["threads"], on_error="raise")
    return out

  def download(self, variant: str, c: dict):
    dest = os.path.join(c["dest_dir"], "big.bin")
    self.fs.get_file(c["path"], dest, concurrency=c["streams"])
    return _sha256_file(dest)

  def create(self, variant: str, c: dict):
    data = c["data"].encode("latin-1")
    for path in c["paths"]:
      self.fs.pipe_file(path, data, mode="create")
    return None

  def create_refused(self, path: str, data: bytes) -> bool:
    try:
      self.fs.pipe_file(path, data, mode="create")
    except FileExistsError:
      return True
    return False


class _Epath(_Library):
  """etils.epath on its fsspec backend (gcsfs underneath; listings cached, as epath leaves them)."""

  def __init__(self):
    os.environ["EPATH_USE_TF"] = "false"  # else tf.io.gfile, which only talks to storage.googleapis.com
    from etils import epath
    from etils.epath import backend

    self.epath = epath
    self.backend = backend.fsspec_backend
    self.versions = {"etils": _version("etils"), "gcsfs": _version("gcsfs"), "fsspec": _version("fsspec")}

  def fresh(self) -> None:
    """Forgets cached listings, so that a timing starts as a new process would."""
    self.backend.fs("gs://x").invalidate_cache()

  def list(self, variant: str, c: dict):
    out = []
    for folder, _, names in self.epath.Path(c["prefix"]).walk():
      out += [f"{os.fspath(folder).rstrip('/')}/{n}" for n in names]
    return out

  def small(self, variant: str, c: dict):
    return _threads(lambda p: self.epath.Path(p).read_bytes(), c["paths"], c["threads"])

  def ranged(self, variant: str, c: dict):
    path = self.epath.Path(c["path"])

    def read(r):
      with path.open("rb") as f:
        f.seek(r[0])
        return f.read(r[1])
    return _threads(read, c["ranges"], c["threads"])

  def download(self, variant: str, c: dict):
    dest = os.path.join(c["dest_dir"], "big.bin")
    self.epath.Path(c["path"]).copy(dest)
    return _sha256_file(dest)


def _crlf_multipart(cls) -> None:
  """Makes gcsfs's multipart uploads end their header lines with CRLF (the bench bucket wants it; GCS takes both).

  Only the few header bytes before the media part change: the request count and the bytes uploaded stay.
  """
  if getattr(cls, "_bench_crlf", False):
    return
  call = cls._call

  async def _call(self, method, path, *args, **kwargs):
    if kwargs.get("uploadType") == "multipart" and isinstance(kwargs.get("data"), (bytes, bytearray)):
      data = bytes(kwargs["data"])
      media = data.index(b"\n\n", data.index(b"\n--==0==\n")) + 2
      kwargs["data"] = data[:media].replace(b"\n", b"\r\n") + data[media:-len(b"\n--==0==--")] + b"\r\n--==0==--"
    return await call(self, method, path, *args, **kwargs)

  cls._call = _call
  cls._bench_crlf = True


def _version(dist: str) -> str | None:
  from importlib import metadata

  try:
    return metadata.version(dist)
  except metadata.PackageNotFoundError:
    return None


LIBRARIES = {"toolkit": _Toolkit, "gcsfs": _Gcsfs, "epath": _Epath}


def _cpu_seconds() -> float:
  """This process's CPU seconds (all threads) plus those of its children that have ended (a process pool's)."""
  total = 0.0
  for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
    r = resource.getrusage(who)
    total += r.ru_utime + r.ru_stime
  return total


def measure(library: _Library, command: dict) -> dict:
  """Runs one command in this process: times it, then checks what it returned (outside the timing).

  Args:
    library: the worker's library.
    command: {"op", "variant", ...the operation's arguments}.

  Returns:
    {"wall", "cpu", "items": per-item SHA-256, the names listed, or the generations a cas wrote}.
  """
  op, variant = command["op"], command["variant"]
  if command.get("dest_dir"):
    shutil.rmtree(command["dest_dir"], ignore_errors=True)
    os.makedirs(command["dest_dir"])
  if hasattr(library, "fresh"):
    library.fresh()
  gc.collect()
  cpu0, t0 = _cpu_seconds(), time.perf_counter()
  result = getattr(library, op)(variant, command)
  wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
  if op == "list":
    items = _relative(result, command["prefix"])
  elif op in ("small", "ranged"):
    items = [_sha(x) for x in result]
  elif op == "download":
    items = [result]
    shutil.rmtree(command["dest_dir"], ignore_errors=True)
  else:
    items = result or []  # cas: the new generations
  return {"wall": wall, "cpu": cpu, "items": items}


def check(library: _Library, command: dict) -> dict:
  """After a timed create or cas (apart, so that its requests are not counted): what the server refuses now.

  Args:
    library: the worker's library.
    command: the timed command, plus "written" (the generations a cas wrote).

  Returns:
    {"tried", "refused"}: a second create of the first names, or a write naming their replaced generation.
  """
  data = command["data"].encode("latin-1")
  paths = command["paths"][:CHECKED]
  if command["op"] == "create":
    refused = sum(library.create_refused(p, data) for p in paths)
  else:
    refused = sum(library.cas_refused(p, g, data) for p, g in zip(paths, command["generations"]))
  return {"tried": len(paths), "refused": refused}


def worker_main(name: str) -> int:
  """A worker: reads one JSON command per line from stdin, answers one `_RESULT` line each on stdout."""
  library = LIBRARIES[name]()
  print(_RESULT + json.dumps({"ready": name, "versions": library.versions}), flush=True)
  for line in sys.stdin:
    command = json.loads(line)
    try:
      if command["op"] == "cas_setup":
        answer = {"generations": library.cas_setup(command["paths"], command["data"].encode("latin-1"))}
      elif command["op"] == "check":
        answer = check(library, command["timed"])
      else:
        answer = measure(library, command)
    except Exception as e:  # reported to the driver, which stops the run with it
      answer = {"error": f"{type(e).__name__}: {e}"}
    print(_RESULT + json.dumps(answer), flush=True)
  library.close()
  return 0


# --------------------------------------------------------------------------- the driver


class Worker:
  """A worker process (this script with --worker) and its command pipe."""

  def __init__(self, name: str, python: str, env: dict, log_path: str):
    self.name = name
    self._log = open(log_path, "ab")
    self.proc = subprocess.Popen([python, os.path.abspath(__file__), f"--worker={name}"], cwd=REPO, env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
    self.versions = self._answer(120.0)["versions"]

  def ask(self, command: dict, timeout: float = _COMMAND_TIMEOUT_S) -> dict:
    """Sends a command and returns the worker's answer; RuntimeError if it failed or took too long."""
    self.proc.stdin.write(json.dumps(command) + "\n")
    self.proc.stdin.flush()
    answer = self._answer(timeout)
    if "error" in answer:
      raise RuntimeError(f"{self.name} worker, {command.get('op')} / {command.get('variant')}: {answer['error']}")
    return answer

  def _answer(self, timeout: float) -> dict:
    box: list = []

    def read():
      for line in self.proc.stdout:
        if line.startswith(_RESULT):
          box.append(json.loads(line[len(_RESULT):]))
          return
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not box:
      self.close()
      raise RuntimeError(f"the {self.name} worker gave no answer within {timeout:.0f} s (see its log)")
    return box[0]

  def close(self) -> None:
    if self.proc.poll() is None:
      try:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
      except (OSError, subprocess.TimeoutExpired):
        self.proc.kill()
        self.proc.wait(timeout=10)
    self._log.close()


def _available(worker: str, side_python: str | None) -> str | None:
  """The interpreter that runs a worker, or None when its library is not installed."""
  if worker == "toolkit":
    return sys.executable
  if side_python:
    return side_python
  return sys.executable if importlib.util.find_spec("gcsfs") is not None else None


def _commands(variant: Variant, data: dict, sizes: Sizes, threads: int, work: str, round_name: str,
              fraction: float) -> dict:
  """The command a variant's worker runs for one timing (`fraction` of the items: the warm-up does fewer)."""
  share = variant.fraction * fraction
  base = {"op": variant.op, "variant": variant.name, "threads": threads}
  if variant.op == "list":
    return {**base, "prefix": data["list"]}
  if variant.op == "small":
    return {**base, "paths": data["small"][:max(1, round(len(data["small"]) * share))], "size": sizes.small_bytes}
  if variant.op == "ranged":
    return {**base, "path": data["big"], "size": sizes.big_bytes,
            "ranges": data["ranges"][:max(1, round(len(data["ranges"]) * share))]}
  if variant.op == "download":
    return {**base, "path": data["big"], "sha256": data["big_sha256"], "streams": sizes.streams,
            "chunk_bytes": sizes.chunk_bytes, "dest_dir": os.path.join(work, "download", variant.worker)}
  n = max(1, round(sizes.writes * share))
  slug = "".join(ch if ch.isalnum() else "-" for ch in variant.name)[:40]
  paths = [f"{data['create']}/{variant.op}/{slug}/{round_name}/o{i:04d}" for i in range(n)]
  return {**base, "paths": paths, "data": random.Random(n).randbytes(sizes.write_bytes).decode("latin-1")}


def run(work: str = os.path.join(REPO, "bench_work", "storage"), sizes: Sizes = Sizes(), rounds: int = 3,
        ops: Sequence[str] = OPS, threads: int = 16, latency_ms: float = 30.0, mbps: float = 100.0,
        side_python: str | None = None, log: Callable[[str], None] = print) -> dict:
  """Stages the data, serves it from a bench bucket, and times every available variant `rounds` times.

  Args:
    work: the folder for the bucket's files, the downloads and the workers' logs.
    sizes: how much data each operation moves.
    rounds: timings per variant (after one warm-up round at a tenth of the items).
    ops: the operations to time (a subset of OPS).
    threads: reads in flight at once for small and ranged reads.
    latency_ms: the bench bucket's first-byte latency.
    mbps: its cap per connection in MB/s (0: none).
    side_python: an interpreter with gcsfs installed (the gcsfs and epath workers), or None.
    log: where progress lines go.

  Returns:
    {"settings", "versions", "results": {op: {variant: {...medians, ratios, per round...}}}, "cannot": {...}}.
  """
  if __package__:  # imported as scripts.bench_storage (tests/test_bench_storage.py)
    from scripts import bench_bucket  # pylint: disable=import-outside-toplevel
  else:  # run as a script: scripts/ is sys.path[0]
    import bench_bucket  # pylint: disable=import-outside-toplevel

  unknown = set(ops) - set(OPS)
  if unknown or rounds < 1:
    raise ValueError(f"ops must be among {OPS} and rounds >= 1, got {sorted(unknown)} and {rounds}")
  os.makedirs(work, exist_ok=True)
  root = os.path.join(work, "bucket")
  t0 = time.monotonic()
  data = stage(root, sizes)
  data["root"] = root
  rng = random.Random(1)
  data["ranges"] = [(rng.randrange(0, sizes.big_bytes - sizes.ranged_bytes + 1), sizes.ranged_bytes)
                    for _ in range(sizes.ranged_reads)]
  log(f"staged in {time.monotonic() - t0:.1f} s")
  variants = [v for v in VARIANTS if v.op in ops]
  skipped = {}
  workers: dict[str, Worker] = {}
  results: dict[str, dict[str, dict]] = {op: {} for op in ops}
  with bench_bucket.BenchBucket(root, latency_ms=latency_ms, mbps=mbps) as bucket:
    bucket.warm(f"gs://{BUCKET}/{PREFIX}")
    env = {**os.environ, "STORAGE_EMULATOR_HOST": bucket.host, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
           "EPATH_USE_TF": "false", "FSSPEC_GCS_TOKEN": "anon", "FSSPEC_GS_TOKEN": "anon"}
    try:
      for name in sorted({v.worker for v in variants}):
        python = _available(name, side_python)
        if python is None:
          skipped[name] = "gcsfs is not installed here (pass --side_python)"
          continue
        workers[name] = Worker(name, python, env, os.path.join(work, f"worker-{name}.log"))
      variants = [v for v in variants if v.worker in workers]
      for r in range(rounds + 1):  # round 0 warms up and is not counted
        round_name, fraction = ("warm", 0.1) if r == 0 else (f"r{r}", 1.0)
        for op in ops:
          mine = [v for v in variants if v.op == op]
          mine = mine[r % len(mine):] + mine[:r % len(mine)] if mine else []
          for v in mine:
            if r == 0 and v.op == "download":
              continue  # 256 MiB each: the other operations have warmed the workers' connections
            command = _commands(v, data, sizes, threads, work, round_name, fraction)
            if op == "cas":
              command["generations"] = workers[v.worker].ask({"op": "cas_setup", "paths": command["paths"],
                                                              "data": command["data"]})["generations"]
            before, server0 = bucket.stats(), bucket.server_cpu_seconds()
            answer = workers[v.worker].ask(command)
            after, server1 = bucket.stats(), bucket.server_cpu_seconds()
            checks = workers[v.worker].ask({"op": "check", "timed": command}) if op in ("create", "cas") else {}
            if op == "cas":
              checks["new_generations"] = sum(a != b for a, b in zip(answer["items"], command["generations"]))
              answer["items"] = []
            if r == 0:
              continue
            entry = results[op].setdefault(v.name, {"worker": v.worker, "rounds": []})
            entry["rounds"].append({
                "wall": answer["wall"], "cpu": answer["cpu"], "server_cpu": server1 - server0,
                "requests": after["requests"] - before["requests"],
                "bytes_sent": after["bytes_sent"] - before["bytes_sent"], "items": answer["items"],
                "checks": checks, "n": _count(command)})
          log(f"round {round_name}: {op} done ({time.monotonic() - t0:.0f} s)")
    finally:
      for w in workers.values():
        w.close()
      shutil.rmtree(os.path.join(work, "download"), ignore_errors=True)
  return {
      "settings": {"sizes": dataclasses.asdict(sizes), "rounds": rounds, "threads": threads, "latency_ms": latency_ms,
                   "mbps": mbps, "cpus": os.cpu_count(), "seconds": time.monotonic() - t0},
      "versions": {name: w.versions for name, w in workers.items()},
      "results": {op: _summarise(op, entries, data, sizes) for op, entries in results.items()},
      "skipped": skipped,
      "cannot": {f"{op} / {lib}": why for (op, lib), why in CANNOT.items() if op in ops},
  }


def _count(command: dict) -> int:
  for key in ("paths", "ranges"):
    if key in command:
      return len(command[key])
  return 1


def _summarise(op: str, entries: dict[str, dict], data: dict, sizes: Sizes) -> dict:
  """Per variant: medians per item, ratios to the reference, and whether its bytes equal the reference's."""
  out = {}
  ref_name = next((v.name for v in VARIANTS if v.op == op and v.reference), None)
  expected = _expected(op, data)
  for name, e in entries.items():
    rounds = e["rounds"]
    n = rounds[0]["n"] if op != "list" else sizes.list_objects
    per = lambda key: statistics.median(x[key] for x in rounds) / n  # noqa: E731
    same = all(_same(op, x["items"], expected) for x in rounds)
    checks = rounds[-1]["checks"]
    if op in ("create", "cas"):  # every refusal seen, and every replacement made a new generation
      same = same and all(x["checks"]["refused"] == x["checks"]["tried"] > 0 for x in rounds)
    if op == "cas":
      same = same and all(x["checks"]["new_generations"] == x["n"] for x in rounds)
    out[name] = {"worker": e["worker"], "items": n, "wall_per_item_s": per("wall"), "cpu_per_item_s": per("cpu"),
                 "server_cpu_per_item_s": per("server_cpu"), "requests_per_item": per("requests"),
                 "bytes_sent_per_item": per("bytes_sent"), "wall_s": [x["wall"] for x in rounds],
                 "cpu_s": [x["cpu"] for x in rounds], "same_as_reference": same, "checks": checks}
    if op == "download":
      out[name]["cpu_s_per_gb"] = statistics.median(x["cpu"] for x in rounds) / (sizes.big_bytes / 1e9)
  ref = out.get(ref_name)
  for name, o in out.items():
    o["reference"] = name == ref_name
    o["wall_ratio"] = o["wall_per_item_s"] / ref["wall_per_item_s"] if ref else None
    o["cpu_ratio"] = o["cpu_per_item_s"] / ref["cpu_per_item_s"] if ref else None
  return out


def _expected(op: str, data: dict):
  """What every variant must return: the listed names, the bytes' digests, the big object's SHA-256."""
  if op == "list":
    return data["list_names"]
  if op == "small":
    return [_digest_of_object(p, data) for p in data["small"]]
  if op == "ranged":
    return data.setdefault("_ranged_digests", [_digest_of_range(a, n, data) for a, n in data["ranges"]])
  if op == "download":
    return [data["big_sha256"]]
  return []


def _local(path: str, data: dict) -> str:
  return os.path.join(data["root"], path[len("gs://"):])


def _digest_of_object(path: str, data: dict) -> str:
  with open(_local(path, data), "rb") as f:
    return _sha(f.read())


def _digest_of_range(start: int, n: int, data: dict) -> str:
  with open(_local(data["big"], data), "rb") as f:
    f.seek(start)
    return _sha(f.read(n))


def _same(op: str, items: list, expected: list) -> bool:
  if op == "list":
    return items == expected
  return items == expected[:len(items)]


def print_report(report: dict) -> None:
  """The table: per operation and variant, per item, the medians and the ratios to the reference."""
  s = report["settings"]
  print(f"bench bucket: {s['latency_ms']:g} ms first byte, {s['mbps']:g} MB/s per connection (0: none); "
        f"{s['threads']} reads in flight; medians of {s['rounds']} rounds; {s['cpus']} cpus; "
        f"{s['seconds']:.0f} s in all")
  for name, versions in report["versions"].items():
    print(f"  {name} worker: {', '.join(f'{k} {v}' for k, v in versions.items())}")
  for op, variants in report["results"].items():
    print(f"\n{op}:")
    print(f"  {'variant':<58} {'ms/item':>9} {'x ref':>6} {'CPU ms':>8} {'x ref':>6} {'req':>5} {'KB sent':>9} same")
    for name, v in variants.items():
      print(f"  {name[:58]:<58} {v['wall_per_item_s'] * 1e3:9.3f} {_ratio(v['wall_ratio']):>6} "
            f"{v['cpu_per_item_s'] * 1e3:8.3f} {_ratio(v['cpu_ratio']):>6} {v['requests_per_item']:5.2f} "
            f"{v['bytes_sent_per_item'] / 1e3:9.1f} {'yes' if v['same_as_reference'] else 'NO'}")
      if "cpu_s_per_gb" in v:
        print(f"  {'':<58} {'':>9} {'':>6} {v['cpu_s_per_gb']:8.2f} CPU-s/GB")
  for what, why in report["cannot"].items():
    print(f"  cannot: {what}: {why}")
  for name, why in report["skipped"].items():
    print(f"  skipped: {name}: {why}")


def _ratio(x: float | None) -> str:
  return "-" if x is None else f"{x:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--worker", choices=sorted(LIBRARIES), help=argparse.SUPPRESS)
  p.add_argument("--work", default=os.path.join(REPO, "bench_work", "storage"))
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--ops", default=",".join(OPS), help=f"a comma-separated subset of {','.join(OPS)}")
  p.add_argument("--threads", type=int, default=16, help="reads in flight at once (small and ranged reads)")
  p.add_argument("--scale", type=float, default=1.0, help="multiplies every item count (not the byte sizes)")
  p.add_argument("--latency_ms", type=float, default=30.0, help="the bench bucket's first-byte latency")
  p.add_argument("--mbps", type=float, default=100.0, help="its cap per connection, MB/s (0: none)")
  p.add_argument("--side_python", default=None, help="an interpreter with gcsfs installed (gcsfs and epath)")
  p.add_argument("--json", default=None, help="also write the figures here")
  a = p.parse_args(argv)
  if a.worker:
    return worker_main(a.worker)
  ops = [o for o in a.ops.split(",") if o]
  if a.threads < 1 or a.scale <= 0:
    p.error("--threads must be >= 1 and --scale > 0")
  report = run(a.work, Sizes().scaled(a.scale), a.rounds, ops, a.threads, a.latency_ms, a.mbps, a.side_python)
  print_report(report)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(report, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
