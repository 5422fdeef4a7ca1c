"""The peers' side of scripts/bench_peers.py: MosaicML Streaming, LitData and WebDataset, in their own venv.

Contract (bench_peers.py runs this with the side environment's python, never the toolkit's):

    PYTHON scripts/_peers_child.py REQUEST_JSON

    REQUEST_JSON is one JSON object; "mode" says what to do:
      {"mode": "versions"}
          -> {"versions": {python, torch, numpy, pillow, mosaicml-streaming, litdata, webdataset,
              google-cloud-storage}}
      {"mode": "convert", "peer": P, "kind": K, "items": FILE, "out": DIR, "workers": W,
       "image_size": [H, W], "jpeg_quality": Q, "num_shards": S}
          -> {"seconds", "images", "bytes", "files"}: P's writer turns the listed source images (FILE:
             a JSON list of [path, label]) into a dataset of K ("raw": uint8 HxWx3 arrays, "jpeg":
             JPEG bytes) in DIR with W processes; "seconds" is the wall time from the writer's start
             (its pool or workers included) to its index written. S: WebDataset's shard count.
      {"mode": "read", "peer": P, "kind": K, "source": DIR_OR_URL, "variant": V, "workers": W,
       "batch_size": B, "image_size": [H, W], "epochs": E, "seed": S, "cache": DIR, "shards": [...]}
          -> {"seconds", "images", "batches", "cpu_s", "settings"}: E shuffled epochs of P's loader
             over the dataset at DIR_OR_URL (a local folder or gs:// for MosaicML and LitData; for
             WebDataset "shards" lists the shard URLs, local paths or `pipe:curl ...`), every image
             decoded to uint8 HxWx3, batched by B; every batch's shape and dtype is checked. V:
             "bare" (the dataset iterated in this process, batches stacked here; MosaicML only) or
             "loader" (the peer's DataLoader with W worker processes, 0: in this process). "cpu_s":
             this process's user+system CPU seconds over the timed epochs, its worker processes'
             included (they are joined before it is read).
    The result is the last line of stdout. Exit 0 with a result, 1 on any error (a loader that
    yields fewer than EPOCHS x (images - workers x batch) images is an error, not a rate).

The source images are prepared for every peer by `prepare` below: the toolkit's recipe (Pillow,
JPEG draft decode at twice the target, RGB, aspect-preserving bilinear resize and center crop,
JPEG quality 95), so that the writers differ in their framework only, not in the image work.
Imports: numpy, Pillow, the one peer named, torch (never the toolkit's packages).
"""

from __future__ import annotations

import gc
import io
import json
import math
import multiprocessing
import os
import platform
import resource
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
from PIL import Image, ImageOps

PEERS = ("mosaic", "litdata", "webdataset")
KINDS = ("raw", "jpeg")
SHUFFLE_BUFFER = 1000  # WebDataset's sample shuffle buffer (its docs' usual value)
TORCH_THREADS = 1  # torch's intra-op threads in the loader's main process (see _before_timing)


# --------------------------------------------------------------------------- the same image work for every writer


def prepare(path: str, kind: str, size: tuple[int, int], quality: int) -> np.ndarray | bytes:
  """One source file as the toolkit's pipeline stores it: HxWx3 uint8 pixels, or their JPEG bytes."""
  h, w = size
  with Image.open(path) as im:
    if im.format == "JPEG":
      im.draft("RGB", (2 * w, 2 * h))
    im = ImageOps.exif_transpose(im).convert("RGB")
  if im.size != (w, h):
    im = ImageOps.fit(im, (w, h), method=Image.Resampling.BILINEAR, centering=(0.5, 0.5))
  if kind == "raw":
    return np.asarray(im, dtype=np.uint8)
  out = io.BytesIO()
  im.save(out, format="JPEG", quality=quality)
  return out.getvalue()


def _slices(n: int, parts: int) -> list[tuple[int, int]]:
  return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


def _tree(out: str) -> tuple[int, int]:
  """(bytes, files) under `out`."""
  total = files = 0
  for d, _, fs in os.walk(out):
    for f in fs:
      total += os.path.getsize(os.path.join(d, f))
      files += 1
  return total, files


# --------------------------------------------------------------------------- writers


def _mds_columns(kind: str, size: tuple[int, int]) -> dict[str, str]:
  # JPEG as "bytes": MDS's "jpeg" encoding re-encodes an in-memory image at Pillow's default quality (75)
  # and keeps the bytes only of an image opened from a file; reading decodes them with Pillow, as "jpeg" does.
  image = "bytes" if kind == "jpeg" else f"ndarray:uint8:{size[0]},{size[1]},3"
  return {"image": image, "label": "int"}


def _mds_part(args: tuple) -> int:
  """Writes items[lo:hi] with one MDSWriter into `out` (a pool task, or the whole job with 1 worker)."""
  from streaming import MDSWriter

  items, out, kind, size, quality = args
  with MDSWriter(out=out, columns=_mds_columns(kind, size)) as writer:
    for path, label in items:
      data = prepare(path, kind, size, quality)
      writer.write({"image": data, "label": label})
  return len(items)


def write_mosaic(items: list, out: str, kind: str, size: tuple[int, int], quality: int, workers: int, _) -> None:
  """MDSWriter; with several workers, Mosaic's recipe for parallel conversion: one MDSWriter per process
  into its own sub-folder, then `streaming.base.util.merge_index` writes the top-level index."""
  if workers == 1:
    _mds_part((items, out, kind, size, quality))
    return
  from streaming.base.util import merge_index

  tasks = [(items[lo:hi], os.path.join(out, f"part_{i:02d}"), kind, size, quality)
           for i, (lo, hi) in enumerate(_slices(len(items), workers))]
  with multiprocessing.Pool(workers) as pool:
    pool.map(_mds_part, tasks)
  merge_index(out, keep_local=True)


class _LitFn:
  """LitData's `optimize` function: one input (path, label) -> one sample (picklable for its workers)."""

  def __init__(self, kind: str, size: tuple[int, int], quality: int):
    self.kind, self.size, self.quality = kind, size, quality

  def __call__(self, item: list) -> dict:
    from litdata.types import Jpeg

    path, label = item
    data = prepare(path, self.kind, self.size, self.quality)
    image = Jpeg(bytes=data, max_quality=None) if self.kind == "jpeg" else data  # JPEG bytes kept as they are
    return {"image": image, "label": label}


def write_litdata(items: list, out: str, kind: str, size: tuple[int, int], quality: int, workers: int, _) -> None:
  """litdata.optimize with `workers` worker processes and its documented 64 MB chunks."""
  import litdata

  litdata.optimize(fn=_LitFn(kind, size, quality), inputs=[list(i) for i in items], output_dir=out,
                   num_workers=workers, chunk_bytes="64MB", verbose=False, mode="overwrite")


def _wds_part(args: tuple) -> int:
  """Writes items[lo:hi] with one ShardWriter into `out`, shards named by `part`."""
  import webdataset as wds

  items, out, part, kind, size, quality, maxcount = args
  pattern = os.path.join(out, f"part{part:02d}-%06d.tar")
  with wds.ShardWriter(pattern, maxcount=maxcount, maxsize=1 << 30, verbose=0) as sink:
    for i, (path, label) in enumerate(items):
      data = prepare(path, kind, size, quality)
      sample = {"__key__": f"p{part:02d}_{i:07d}", "cls": label}
      sample["jpg" if kind == "jpeg" else "npy"] = data
      sink.write(sample)
  return len(items)


def write_webdataset(items: list, out: str, kind: str, size: tuple[int, int], quality: int, workers: int,
                     num_shards: int) -> None:
  """wds.ShardWriter (tar shards of `num_shards` about equal parts); with several workers, one ShardWriter
  per process over its slice (WebDataset's own writers are single-process)."""
  maxcount = max(1, math.ceil(len(items) / num_shards))
  tasks = [(items[lo:hi], out, i, kind, size, quality, maxcount)
           for i, (lo, hi) in enumerate(_slices(len(items), workers))]
  if workers == 1:
    _wds_part(tasks[0])
    return
  with multiprocessing.Pool(workers) as pool:
    pool.map(_wds_part, tasks)


WRITERS: dict[str, Callable] = {"mosaic": write_mosaic, "litdata": write_litdata, "webdataset": write_webdataset}


def convert(req: dict) -> dict:
  with open(req["items"]) as f:
    items = [tuple(i) for i in json.load(f)]
  out, size = req["out"], tuple(req["image_size"])
  shutil.rmtree(out, ignore_errors=True)
  os.makedirs(out)
  write = WRITERS[req["peer"]]
  t0 = time.perf_counter()
  write(items, out, req["kind"], size, req["jpeg_quality"], req["workers"], req.get("num_shards", 8))
  seconds = time.perf_counter() - t0
  num_bytes, files = _tree(out)
  return {"seconds": seconds, "images": len(items), "bytes": num_bytes, "files": files}


# --------------------------------------------------------------------------- readers


def _hwc(image: Any) -> np.ndarray | Any:
  """One decoded image as HxWx3 uint8 (numpy, or a torch view for LitData's CHW tensors)."""
  if isinstance(image, bytes):  # MDS's JPEG bytes
    image = Image.open(io.BytesIO(image))
  if isinstance(image, Image.Image):
    return np.asarray(image.convert("RGB"))  # decodes (Pillow opens lazily)
  if hasattr(image, "permute") and image.ndim == 3 and image.shape[0] == 3:
    return image.permute(1, 2, 0)  # torchvision's decode_jpeg: CHW
  return image


def _check(peer: str, batch: Any, batch_size: int, size: tuple[int, int]) -> None:
  shape, dtype = tuple(batch.shape), str(batch.dtype).replace("torch.", "")
  if shape != (batch_size, *size, 3) or dtype != "uint8":
    raise RuntimeError(f"{peer}: batch of {dtype} {shape}, expected uint8 {(batch_size, *size, 3)}")


def _stacked(samples: Iterable[dict], batch_size: int) -> Iterator[np.ndarray]:
  """Batches of `batch_size` images stacked in this process (the remainder dropped)."""
  buf = []
  for s in samples:
    buf.append(_hwc(s["image"]))
    if len(buf) == batch_size:
      yield np.stack(buf)
      buf = []


def _torch_loader_kwargs(workers: int) -> dict:
  # Persistent workers: later epochs reuse them, as a multi-epoch training run would set.
  return {"num_workers": workers, "persistent_workers": workers > 0, **({"prefetch_factor": 2} if workers else {})}


def read_mosaic(req: dict, size: tuple[int, int]) -> tuple[Callable[[], Iterable], dict]:
  import torch.utils.data
  from streaming import StreamingDataset

  class Images(StreamingDataset):
    """Mosaic's pattern for transforms: decode in `__getitem__` (so in the DataLoader's workers)."""

    def __getitem__(self, i: int) -> dict:
      s = super().__getitem__(i)
      return {"image": _hwc(s["image"]), "label": s["label"]}

  remote = req["source"] if req["source"].startswith("gs://") else None
  local = req["cache"] if remote else req["source"]
  ds = Images(remote=remote, local=local, shuffle=True, shuffle_seed=req["seed"], batch_size=req["batch_size"])
  settings = {"shuffle": "on (py1e, Mosaic's default algorithm and block size)", "batch_size": req["batch_size"],
              "predownload": "default (8 x batch_size)", "cache_limit": "none", "local": local, "remote": remote,
              "decode": "Pillow, in __getitem__ (a bytes column)" if req["kind"] == "jpeg" else "ndarray column"}
  if req["variant"] == "bare":
    settings["loader"] = "none: the StreamingDataset iterated in this process, batches stacked with numpy"
    return (lambda: _stacked(ds, req["batch_size"])), settings
  loader = torch.utils.data.DataLoader(ds, batch_size=req["batch_size"], drop_last=True,
                                       **_torch_loader_kwargs(req["workers"]))
  settings["loader"] = f"torch DataLoader, {req['workers']} workers, persistent, drop_last"
  return (lambda: (b["image"] for b in loader)), settings


def read_litdata(req: dict, size: tuple[int, int]) -> tuple[Callable[[], Iterable], dict]:
  import litdata

  def transform(s: dict) -> dict:
    return {"image": _hwc(s["image"]), "label": s["label"]}

  storage = {}
  ds = litdata.StreamingDataset(req["source"], cache_dir=req["cache"], shuffle=True, seed=req["seed"],
                                drop_last=True, transform=transform, storage_options=storage)
  loader = litdata.StreamingDataLoader(ds, batch_size=req["batch_size"], **_torch_loader_kwargs(req["workers"]))
  settings = {"shuffle": "on (LitData's chunk + item shuffle)", "batch_size": req["batch_size"],
              "loader": f"StreamingDataLoader, {req['workers']} workers, persistent", "cache_dir": req["cache"],
              "max_cache_size": "default",
              "decode": ("LitData's own (torchvision decode_jpeg, CHW -> HWC view)" if req["kind"] == "jpeg"
                         else "LitData's numpy serializer"),
              "async_chunk_prefetch": os.environ.get("LITDATA_ASYNC_CHUNK_PREFETCH", "default")}
  return (lambda: (b["image"] for b in loader)), settings


def read_webdataset(req: dict, size: tuple[int, int]) -> tuple[Callable[[], Iterable], dict]:
  import torch
  import webdataset as wds

  kind, b = req["kind"], req["batch_size"]
  key = "jpg" if kind == "jpeg" else "npy"
  ds = (wds.WebDataset(req["shards"], shardshuffle=len(req["shards"]), seed=req["seed"],
                       nodesplitter=wds.single_node_only, empty_check=True)
        .shuffle(SHUFFLE_BUFFER)
        .decode("rgb8")  # PIL for .jpg, to HxWx3 uint8; .npy by numpy.load
        .to_tuple(key, "cls")
        .map(lambda s: (np.ascontiguousarray(s[0]), s[1]))
        .batched(b, partial=False))
  loader = wds.WebLoader(ds, batch_size=None, **_torch_loader_kwargs(req["workers"]))
  settings = {"shuffle": f"on (shardshuffle over {len(req['shards'])} shards, sample buffer {SHUFFLE_BUFFER})",
              "batch_size": b, "loader": f"WebLoader, {req['workers']} workers, persistent, batched in the workers",
              "decode": "rgb8 (PIL)" if kind == "jpeg" else "npy (numpy.load)", "shards": len(req["shards"]),
              "cache": "none"}

  def batches() -> Iterator:
    for images, _ in loader:
      yield torch.as_tensor(images) if isinstance(images, np.ndarray) else images

  return batches, settings


READERS: dict[str, Callable] = {"mosaic": read_mosaic, "litdata": read_litdata, "webdataset": read_webdataset}


def _cpu_seconds() -> float:
  me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _before_timing(peer: str) -> None:
  """What a training script has done before it builds its loader (untimed): the imports (torch's takes
  seconds here; the readers' own imports then find them loaded)."""
  import torch
  import torch.utils.data  # noqa: F401

  # One intra-op thread, as torch gives each DataLoader worker: on this machine's 2 shared cores the
  # collate's torch.stack of 64 uint8 224x224x3 images takes 5 ms with 1 OpenMP thread and 170-270 ms with 2.
  torch.set_num_threads(TORCH_THREADS)
  if peer == "mosaic":
    import streaming  # noqa: F401
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()  # a killed earlier run's shared memory would block this one
  elif peer == "litdata":
    import litdata  # noqa: F401
    import torchvision.io  # noqa: F401 - LitData imports it lazily on its first JPEG (about 2 s here)
  else:
    import webdataset  # noqa: F401


def read(req: dict) -> dict:
  """The timed run: the loader built (its index and manifest reads, downloads from gs://) and every epoch."""
  size = tuple(req["image_size"])
  b, epochs = req["batch_size"], req["epochs"]
  _before_timing(req["peer"])
  cpu0, t0 = _cpu_seconds(), time.perf_counter()
  epoch, settings = READERS[req["peer"]](req, size)
  images = batches = 0
  for _ in range(epochs):
    for image in epoch():
      _check(req["peer"], image, b, size)
      images += image.shape[0]
      batches += 1
  seconds = time.perf_counter() - t0
  epoch = None  # drops the loaders: their worker processes are joined, so RUSAGE_CHILDREN counts them
  gc.collect()
  cpu = _cpu_seconds() - cpu0
  least = epochs * (req["num_images"] - max(1, req["workers"]) * b)
  if images < max(b, least):
    raise RuntimeError(f"{req['peer']}: {images} images in {epochs} epochs of {req['num_images']}, expected at "
                       f"least {max(b, least)}")
  settings["torch_intra_op_threads"] = TORCH_THREADS
  return {"seconds": seconds, "images": images, "batches": batches, "cpu_s": cpu, "settings": settings}


def versions() -> dict:
  from importlib import metadata

  names = ["torch", "numpy", "pillow", "mosaicml-streaming", "litdata", "webdataset", "google-cloud-storage"]
  out = {"python": platform.python_version()}
  for n in names:
    try:
      out[n] = metadata.version(n)
    except metadata.PackageNotFoundError:
      out[n] = None
  return {"versions": out}


def main(argv: list[str]) -> int:
  if len(argv) != 1:
    print(__doc__.splitlines()[0], file=sys.stderr)
    return 2
  req = json.loads(argv[0])
  mode = req.get("mode")
  if mode == "versions":
    result = versions()
  elif mode in ("convert", "read"):
    if req.get("peer") not in PEERS or req.get("kind") not in KINDS:
      raise ValueError(f"peer must be one of {PEERS} and kind one of {KINDS}, got {req.get('peer')!r}, "
                       f"{req.get('kind')!r}")
    result = convert(req) if mode == "convert" else read(req)
  else:
    raise ValueError(f"mode must be versions, convert or read, got {mode!r}")
  print(json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
