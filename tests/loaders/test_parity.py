"""One transform specification, three loaders: grain, torch_xla (host batches) and tf.data agree bit for bit.

The same TFRecord outputs (images: raw, fixed-size JPEG, JPEG resized to a
static shape, real photos included; CT volumes: centre and random patches,
HU windows, normalisation, padding; CT volumes with masks, both label layouts,
label-aware random patches; generic "tensors" records) are read by
`loaders.grain`, `loaders.xla` (in its own process, without TensorFlow;
batches copied back from the XLA CPU device into an .npz) and
`loaders.tfdata`, in the same deterministic order, and every batch must hold
the same keys, dtypes and values.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from loaders import ShardedRecords, grain as grain_loader, tfdata
from pipelines import ct_volumes, image_folder
from scripts import make_sample_ct as ct, make_sample_images
from tests.conftest import REPO
from tests.loaders import make_outputs

pytestmark = pytest.mark.slow


def _real_photos() -> list[str]:
  """JPEG photographs that ship with installed packages (scikit-learn's china.jpg and flower.jpg)."""
  try:
    import sklearn
  except ImportError:
    return []
  return sorted(glob.glob(os.path.join(os.path.dirname(sklearn.__file__), "datasets", "images", "*.jpg")))


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, str]:
  base = tmp_path_factory.mktemp("parity")
  folder = str(base / "photos")
  make_sample_images.make_folder(folder, ["a", "b"], 5, None, (64, 48), 0, seed=3)
  for i, photo in enumerate(_real_photos()):
    shutil.copy(photo, os.path.join(folder, "ab"[i % 2], "real_" + os.path.basename(photo)))
  out = {}
  for key, flags in {
      "jpeg": [],  # every image at its own size (real photos kept byte for byte)
      "jpeg_fixed": ["--image_size=40,40"],
      "raw": ["--encoding=raw", "--image_size=32,32"],
  }.items():
    image_folder.run([f"--input={folder}", f"--output={base / key}", "--format=tfrecord", "--num_shards=2", *flags])
    out[key] = str(base / key)
  dicom = str(base / "dicom")
  ct.make_mixed_tree(dicom, seed=5)
  for key, dtype in (("ct", "auto"), ("ct16", "int16")):  # the tree has a slope of 0.5: auto is float32
    ct_volumes.run([f"--input={dicom}", f"--output={base / key}", "--id_salt=s", "--splits=train=1.0",
                    "--format=tfrecord", f"--volume_dtype={dtype}"])
    out[key] = str(base / key)
  out["tensors"] = make_outputs.write_tensors(str(base / "tensors"), "tfrecord")
  for key, layout, classes in (("seg", "classes", 3), ("seg_channels", "channels", 3), ("seg16", "classes", 300)):
    features, payloads = make_outputs.labelled_volumes(np.random.default_rng(5), 10, layout, classes,
                                                       depth=(4, 12), side=(10, 30))
    out[key] = make_outputs.write(str(base / key), features, {"train": payloads}, kind="volume",
                                  file_format="tfrecord", num_shards=2)
  for dtype in ("int32", "uint16", "float64"):  # volumes of another producer: formats.kinds takes any dtype
    features, payloads = make_outputs.volumes(np.random.default_rng(6), 6, depth=(4, 9), side=(10, 20), dtype=dtype)
    out[f"ct_{dtype}"] = make_outputs.write(str(base / f"ct_{dtype}"), features, {"train": payloads}, kind="volume",
                                            file_format="tfrecord", num_shards=2)
  return out


# name: (output, loader options). Every case is read unshuffled and shuffled-free random draws are seeded.
CASES = {
    "raw": ("raw", dict(batch_size=4)),
    "jpeg_fixed": ("jpeg_fixed", dict(batch_size=4)),
    "jpeg_small": ("jpeg", dict(batch_size=4, image_size=(24, 24))),  # real photos decoded at 1/8 scale
    "jpeg_aspect": ("jpeg", dict(batch_size=4, image_size=(56, 40))),
    "jpeg_mid": ("jpeg", dict(batch_size=4, image_size=(150, 200))),  # photos at 1/2 scale, others upscaled
    "ct_center": ("ct", dict(batch_size=2, patch_size=(8, 40, 40), patch="center")),
    "ct_random": ("ct", dict(batch_size=2, patch_size=(8, 40, 40), patch="random", seed=3, num_epochs=2)),
    "ct_window": ("ct", dict(batch_size=2, patch_size=(6, 24, 56), patch="center", hu_window=(-200.0, 300.0),
                             normalize=False)),
    "ct_padded": ("ct", dict(batch_size=2, patch_size=(24, 72, 72), patch="random", seed=9, hu_window=(-500.0, 500.0))),
    "ct16_center": ("ct16", dict(batch_size=2, patch_size=(8, 40, 40), patch="center")),  # int16 volumes
    **{f"ct_{dtype}_center": (f"ct_{dtype}", dict(batch_size=2, patch_size=(4, 12, 12), patch="center"))
       for dtype in ("int32", "uint16", "float64")},  # tf.data used to read any of these bytes as float32
    "tensors": ("tensors", dict(batch_size=4)),  # record kind "tensors": Tensors and ClassLabels as stored
    "ct16_random_raw_hu": ("ct16", dict(batch_size=2, patch_size=(24, 72, 72), patch="random", seed=4,
                                        hu_window=(-1024.0, 3071.0), normalize=False)),
    # CT volumes with masks: the label patch beside the volume's, at its start
    "seg_center": ("seg", dict(batch_size=2, patch_size=(6, 16, 16), patch="center")),
    "seg_random": ("seg", dict(batch_size=2, patch_size=(6, 16, 16), patch="random", seed=3, num_epochs=2)),
    "seg_positive": ("seg", dict(batch_size=2, patch_size=(6, 16, 16), patch="random", seed=3, num_epochs=2,
                                 pos_fraction=0.7)),
    "seg_channels_center": ("seg_channels", dict(batch_size=2, patch_size=(8, 24, 24), patch="center")),
    "seg_channels_positive": ("seg_channels", dict(batch_size=2, patch_size=(6, 16, 16), patch="random", seed=8,
                                                   num_epochs=2, pos_fraction=0.5, hu_window=(-500.0, 500.0))),
    "seg_channels_padded": ("seg_channels", dict(batch_size=2, patch_size=(12, 40, 40), patch="random", seed=8,
                                                 pos_fraction=0.5)),  # larger than every volume: padded
    "seg16_positive": ("seg16", dict(batch_size=2, patch_size=(6, 16, 16), patch="random", seed=1, pos_fraction=1.0,
                                     normalize=False)),
}


def _grain(outputs, case) -> list[dict]:
  key, opts = CASES[case]
  return list(grain_loader.dataset(outputs[key], shuffle=False, num_threads=2, **opts))


def _tfdata(outputs, case) -> list[dict]:
  key, opts = CASES[case]
  return list(tfdata.dataset(outputs[key], shuffle=False, **opts).as_numpy_iterator())


def _assert_same_batches(got: list[dict], want: list[dict], what: str) -> None:
  assert len(got) == len(want), f"{what}: {len(got)} batches, grain has {len(want)}"
  assert want, f"{what}: {len(got)} batches, grain has {len(want)}"
  for n, (g, w) in enumerate(zip(got, want)):
    assert sorted(g) == sorted(w), f"{what} batch {n}: keys {sorted(g)} != grain's {sorted(w)}"
    for k in w:
      g_k, w_k = np.asarray(g[k]), np.asarray(w[k])
      assert g_k.dtype == w_k.dtype, f"{what} batch {n} {k}: {g_k.dtype}{g_k.shape} != grain's {w_k.dtype}{w_k.shape}"
      assert g_k.shape == w_k.shape, f"{what} batch {n} {k}: {g_k.dtype}{g_k.shape} != grain's {w_k.dtype}{w_k.shape}"
      if not np.array_equal(g_k, w_k):
        diff = np.abs(g_k.astype(np.float64) - w_k.astype(np.float64))
        raise AssertionError(f"{what} batch {n} {k}: {int((diff > 0).sum())} values differ, max {diff.max()}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_tfdata_equals_grain(outputs, case):
  _assert_same_batches(_tfdata(outputs, case), _grain(outputs, case), f"tf.data {case}")


def test_the_label_cases_carry_labels_with_foreground(outputs):
  """The seg cases compare label patches (not only volumes): every batch has one, and some hold foreground."""
  for case in (c for c in CASES if c.startswith("seg")):
    batches = _grain(outputs, case)
    assert all("label" in b for b in batches), case
    assert any(b["label"].any() for b in batches), case


def test_real_photos_are_in_the_jpeg_cases(outputs):
  """The JPEG cases include real photographs stored as their original bytes (when the packages ship some)."""
  photos = _real_photos()
  assert photos, "scikit-learn (pinned in constraints.txt, needed by ogb) ships china.jpg and flower.jpg"
  stored = {bytes(r["image"]) for r in ShardedRecords(outputs["jpeg"])}
  assert all(open(p, "rb").read() in stored for p in photos)


def test_random_patch_starts_follow_the_seed_in_both(outputs):
  """Same seed → same patch_start in grain and tf.data; another seed moves the patches."""
  a = np.concatenate([b["patch_start"] for b in _tfdata(outputs, "ct_random")])
  assert np.array_equal(a, np.concatenate([b["patch_start"] for b in _grain(outputs, "ct_random")]))
  key, opts = CASES["ct_random"]
  other = list(grain_loader.dataset(outputs[key], shuffle=False, **dict(opts, seed=4)))
  assert not np.array_equal(a, np.concatenate([b["patch_start"] for b in other]))


def test_center_patch_is_the_centre(outputs):
  """The centre rule (formats.transforms): start = max(shape - patch, 0) // 2, in every loader."""
  records = ShardedRecords(outputs["ct"])
  for b in _tfdata(outputs, "ct_center"):
    for start, idx in zip(b["patch_start"], b["record_index"]):
      shape = np.asarray(records[int(idx)]["volume"].shape)
      assert start.tolist() == (np.maximum(shape - (8, 40, 40), 0) // 2).tolist()


# name: (output, loader options) read with order="global", shuffled, by 1 host and by each of 2 hosts.
GLOBAL_CASES = {
    "raw": ("raw", dict(global_batch_size=4, num_epochs=2)),
    "jpeg_small": ("jpeg", dict(global_batch_size=4, image_size=(24, 24))),
    "ct_random": ("ct", dict(global_batch_size=2, patch_size=(8, 40, 40), patch="random", num_epochs=2)),
    "seg_positive": ("seg", dict(global_batch_size=2, patch_size=(6, 16, 16), patch="random", num_epochs=2,
                                 pos_fraction=0.7)),
    "tensors": ("tensors", dict(global_batch_size=4)),
}


def _both(path: str, **opts) -> tuple[list[dict], list[dict]]:
  """(tf.data's batches, grain's batches) of the same arguments."""
  return (list(tfdata.dataset(path, **opts).as_numpy_iterator()),
          list(grain_loader.dataset(path, num_threads=2, **opts)))


@pytest.mark.parametrize("hosts", [1, 2])
@pytest.mark.parametrize("case", sorted(GLOBAL_CASES))
def test_tfdata_global_order_equals_grain_shuffled(outputs, case, hosts):
  """order="global", shuffled: every host's batches are grain's, bit for bit (the same permutation of the
  split, and every random patch keyed by the slot in the global batch)."""
  key, opts = GLOBAL_CASES[case]
  for h in range(hosts):
    got, want = _both(outputs[key], order="global", seed=7, shard_index=h, shard_count=hosts, **opts)
    _assert_same_batches(got, want, f"tf.data {case} host {h} of {hosts}")
  if hosts == 1:  # shuffled for real: not the record order
    assert not np.array_equal(np.concatenate([b["record_index"] for b in got]),
                              np.arange(len(got) * len(got[0]["record_index"])))


@pytest.mark.parametrize("order", ["global", "host"])
@pytest.mark.parametrize("case", ["raw", "seg_positive"])
def test_tfdata_windows_of_shards_equal_grain(outputs, case, order):
  """window_shards on a local output: the same windows, runs and slots as grain, on each of 2 hosts."""
  key, opts = GLOBAL_CASES[case]
  opts = {**{k: v for k, v in opts.items() if k != "global_batch_size"}, "batch_size": opts["global_batch_size"] // 2}
  for h in range(2):
    got, want = _both(outputs[key], order=order, seed=3, shard_index=h, shard_count=2, window_shards=1, **opts)
    _assert_same_batches(got, want, f"tf.data {case} windows, order={order}, host {h}")


@pytest.mark.parametrize("window_shards", [1, None])
def test_tfdata_streamed_from_gcs_equals_grain_reading_the_local_copy(outputs, gcs_emulator, tmp_path,
                                                                       window_shards):
  """gs:// through the emulator: windows of shards streamed through a bounded cache (or, without windows, the
  split copied once), the batches grain gives for the local output; the stream's private folder goes with the
  dataset."""
  import gc

  from formats import load_manifest
  from tests.conftest import upload_tree
  from tests.loaders.test_stream import _DiskWatch

  for key, opts in (("raw", dict(GLOBAL_CASES["raw"][1])), ("seg", dict(GLOBAL_CASES["seg_positive"][1]))):
    gs = f"gs://{gcs_emulator}/parity/{key}-{window_shards}"
    upload_tree(outputs[key], gs)
    shards = load_manifest(outputs[key]).splits["train"].shards
    limit = 4096 + 3 * (max(s.num_bytes for s in shards) + 4 * 4096)  # 3 of the 2 shards: the smallest it takes
    cache = tmp_path / f"cache-{key}"
    opts.update(order="global", seed=11, shard_count=2, window_shards=window_shards, cache_dir=str(cache))
    if window_shards:
      opts["cache_limit_bytes"] = limit
    for h in range(2):
      ds = tfdata.dataset(gs, shard_index=h, **opts)
      with _DiskWatch(str(cache)) as watch:  # the disk itself, not only the stream's own count
        got = list(ds.as_numpy_iterator())
      want = list(grain_loader.dataset(outputs[key], num_threads=2, shard_index=h, **{
          k: v for k, v in opts.items() if k not in ("cache_dir", "cache_limit_bytes")}))
      _assert_same_batches(got, want, f"tf.data {key} from gs://, window_shards={window_shards}, host {h}")
      if window_shards:
        stream = ds._tpu_shards_read.source
        assert stream.bytes_fetched >= sum(s.num_bytes for s in shards) and 0 < stream.peak_bytes <= limit
        assert watch.samples > 10 and 0 < watch.peak_apparent <= limit and watch.peak_blocks <= limit
        del ds, stream
        gc.collect()
        assert not [f for _, _, fs in os.walk(cache / "stream") for f in fs], "the stream outlived its dataset"


_XLA_DUMP = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from loaders import xla
assert "tensorflow" not in sys.modules
cases = json.loads(sys.argv[2])
for name, (path, opts) in cases.items():
  if "hu_window" in opts:
    opts["hu_window"] = tuple(opts["hu_window"])
  for k in ("image_size", "patch_size"):
    if k in opts:
      opts[k] = tuple(opts[k])
  arrays = {}
  for n, batch in enumerate(xla.device_loader(path, shuffle=False, shard_index=0, shard_count=1, num_threads=2,
                                              **opts)):
    for k, v in batch.items():
      arrays[f"{n}/{k}"] = v.cpu().numpy()
  np.savez(f"{sys.argv[3]}/{name}.npz", **arrays)
print(json.dumps({"tf": "tensorflow" in sys.modules}))
"""


def test_xla_host_batches_equal_grain_and_tfdata(outputs, tmp_path):
  cases = {name: (outputs[key], opts) for name, (key, opts) in CASES.items()}
  env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
  r = subprocess.run([sys.executable, "-c", _XLA_DUMP, REPO, json.dumps(cases), str(tmp_path)], capture_output=True,
                     text=True, env=env, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert json.loads(r.stdout.strip().splitlines()[-1]) == {"tf": False}
  for name in CASES:
    with np.load(tmp_path / f"{name}.npz") as z:
      batches: dict[int, dict] = {}
      for key in z.files:
        n, k = key.split("/", 1)
        batches.setdefault(int(n), {})[k] = z[key]
    xla_batches = [batches[n] for n in sorted(batches)]
    grain_batches = _grain(outputs, name)
    _assert_same_batches(xla_batches, grain_batches, f"torch_xla {name}")
    _assert_same_batches(_tfdata(outputs, name), grain_batches, f"tf.data {name}")


def test_the_specification_is_pillows_arithmetic():
  """formats.transforms' numpy reference (draft scale, fit box, BILINEAR taps) gives Pillow's pixels exactly."""
  import io

  from PIL import Image, ImageOps

  from formats import transforms as T

  rng = np.random.default_rng(0)
  for _ in range(60):
    h, w = (int(v) for v in rng.integers(1, 160, 2))
    size = tuple(int(v) for v in rng.integers(1, 120, 2))
    pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    want = np.asarray(ImageOps.fit(Image.fromarray(pixels), (size[1], size[0]), method=Image.Resampling.BILINEAR))
    row_first, row_w, col_first, col_w = T.resize_plan(h, w, size)
    got = T.apply_taps(T.apply_taps(pixels, col_first, col_w, axis=1), row_first, row_w, axis=0)
    np.testing.assert_array_equal(got, want, err_msg=f"{(h, w)} -> {size}")
    data = io.BytesIO()
    Image.fromarray(pixels).save(data, format="JPEG")
    im = Image.open(data)
    im.draft("RGB", (size[1], size[0]))
    s = T.jpeg_draft_scale(h, w, size)
    assert im.size == (-(-w // s), -(-h // s)), f"{(h, w)} -> {size}: scale {s}"
