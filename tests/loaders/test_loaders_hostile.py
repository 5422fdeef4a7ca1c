"""Loaders on outputs that lie: damaged records, wrong counts, swapped shards, hostile image shapes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from formats import tfrecord
from formats.graphbin import META, GraphBin, GraphBinWriter
from formats.manifest import MANIFEST_FILENAME
from loaders import CorruptRecordError, ShardedRecords, tfdata
from loaders import grain as grain_loader
from loaders import graph as lg
from tests.conftest import REPO
from tests.damage import flip_byte
from tests.loaders import make_outputs


def _images(make) -> tuple:
  """(features, {split: records}): 18 train and 18 validation records of `make(rng, n)`."""
  rng = np.random.default_rng(0)
  made = {split: make(rng, 18) for split in ("train", "validation")}
  return made["train"][0], {split: payloads for split, (_, payloads) in made.items()}


def _jpegs(rng, n):
  return make_outputs.jpeg_images(rng, n, mixed=False)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, str]:
  """Small train/validation outputs: TFRecord (JPEG, 2 shards a split) and ArrayRecord (raw 16x16, one shard a
  split, train's and validation's of equal size)."""
  base = tmp_path_factory.mktemp("hostile_outputs")
  raw_features, raws = _images(lambda rng, n: make_outputs.raw_images(rng, n, size=(16, 16)))
  return {"tfrecord": make_outputs.write(str(base / "tfrecord"), *_images(_jpegs), kind="image",
                                         file_format="tfrecord", num_shards=2),
          "array_record": make_outputs.write(str(base / "array_record"), raw_features, raws, kind="image")}


def _copy(src: str, dst) -> str:
  shutil.copytree(src, str(dst))
  return str(dst)


def _manifest(out: str) -> dict:
  with open(os.path.join(out, MANIFEST_FILENAME)) as f:
    return json.load(f)


def _write_manifest(out: str, m: dict) -> None:
  with open(os.path.join(out, MANIFEST_FILENAME), "w") as f:
    json.dump(m, f)


def _shard(out: str, split: str = "train", k: int = 0) -> str:
  return os.path.join(out, _manifest(out)["splits"][split]["shards"][k]["path"])


def _record_offsets(path: str) -> list[int]:
  """Byte offset of each record's frame in a TFRecord file."""
  offsets, pos = [], 0
  for record in tfrecord.read_file(path):
    offsets.append(pos)
    pos += 16 + len(record)
  return offsets


def _ids(ds) -> list[int]:
  return [int(i) for b in ds.as_numpy_iterator() for i in b["record_index"]]


# ---- a split too small for one batch is an error, never an empty epoch ------------------------------------

@pytest.mark.parametrize("make", [
    lambda out: grain_loader.dataset(out["array_record"], global_batch_size=32, shard_index=1, shard_count=4),
    lambda out: grain_loader.dataset(out["array_record"], batch_size=32),
    lambda out: grain_loader.dataset(out["array_record"], order="host", batch_size=8, shard_count=4),
    lambda out: tfdata.dataset(out["tfrecord"], batch_size=32),  # tf.data's own host pipeline
    lambda out: tfdata.dataset(out["tfrecord"], order="global", global_batch_size=32),
    lambda out: tfdata.dataset(out["tfrecord"], window_shards=1, batch_size=4, shard_index=2, shard_count=4),
], ids=["grain-global", "grain-one-host", "grain-host-order", "tfdata-host", "tfdata-global", "tfdata-windows"])
def test_a_split_too_small_for_one_batch_is_refused_not_read_as_empty(outputs, make):
  """18 records: no global batch of 32, no batch of 8 from the 4 each of 4 hosts reads, and no record at all for
  hosts 2 and 3 when 2 shards are dealt whole to 4: each would iterate zero times without a word."""
  with pytest.raises(ValueError, match=r"make no whole (global )?batch of \d+.*so every epoch would be empty"):
    make(outputs)


@pytest.mark.parametrize("loader", ["grain", "grain-records", "tfdata"])
def test_an_image_size_raw_pixels_are_not_stored_at_is_refused_not_ignored(outputs, tmp_path, loader):
  """Raw pixels are never resized: an image_size other than the stored 16x16 would have given 16x16 batches."""
  if loader == "tfdata":
    raw = make_outputs.write(str(tmp_path / "raw"), *_images(lambda rng, n: make_outputs.raw_images(rng, n, (16, 16))),
                             kind="image", file_format="tfrecord")
    first = lambda size: next(tfdata.dataset(raw, batch_size=4, image_size=size).as_numpy_iterator())
  elif loader == "grain":
    first = lambda size: next(iter(grain_loader.dataset(outputs["array_record"], batch_size=4, image_size=size)))
  else:
    first = lambda size: grain_loader.records(outputs["array_record"], image_size=size)[0]
  with pytest.raises(ValueError, match=r"^image_size=\(24, 24\): these raw images are stored at \(16, 16\)"):
    first((24, 24))
  assert first((16, 16))["image"].shape[-3:] == (16, 16, 3)


@pytest.mark.parametrize("make", [
    lambda out: grain_loader.dataset(out["array_record"], batch_size=4, patch_size=(2, 8, 8)),
    lambda out: grain_loader.records(out["array_record"], hu_window=(-100.0, 100.0), normalize=False),
    lambda out: tfdata.dataset(out["tfrecord"], batch_size=4, image_size=(8, 8), patch="center"),
], ids=["grain", "grain-records", "tfdata"])
def test_a_volume_option_on_images_is_refused_not_ignored(outputs, make):
  with pytest.raises(ValueError, match=r"^(patch_size|hu_window|patch)=.*: not read for image records \(they read "
                                       r"image_size\); leave it unset$"):
    make(outputs)


@pytest.mark.parametrize("options,error", [
    (dict(shuffle=False, shuffle_buffer=5), "with shuffle=False there is none"),
    (dict(fetch="shards"), "fetch='shards' chooses how windows are streamed: it needs window_shards"),
])
def test_tfdata_refuses_settings_it_would_not_read(outputs, options, error):
  with pytest.raises(ValueError, match=re.escape(error)):
    tfdata.dataset(outputs["tfrecord"], batch_size=4, image_size=(8, 8), **options)


# ---- tf.data: a damaged record names its shard -------------------------------------------------


def test_tfdata_damaged_record_names_the_shard_and_record(outputs, tmp_path):
  out = _copy(outputs["tfrecord"], tmp_path / "broken")
  shard = _shard(out)
  at = _record_offsets(shard)[1] + 20  # inside record 1's payload; the size is unchanged
  flip_byte(shard, at)
  with pytest.raises(CorruptRecordError) as e:
    _ids(tfdata.dataset(out, batch_size=1, image_size=(8, 8), shuffle=False))
  msg = str(e.value)
  assert shard in msg
  assert "record 1 " in msg
  assert "sha256" in msg


def test_tfdata_damaged_framing_names_the_shard_at_verify_size(outputs, tmp_path):
  out = _copy(outputs["tfrecord"], tmp_path / "broken")
  shard = _shard(out, k=1)
  at = _record_offsets(shard)[2]  # record 2's length field: its checksum no longer matches
  with open(shard, "r+b") as f:
    f.seek(at)
    f.write(b"\x07")
  with pytest.raises(CorruptRecordError, match=rf"{re.escape(shard)}: record 2: bad length checksum at byte {at}"):
    _ids(tfdata.dataset(out, batch_size=1, image_size=(8, 8), verify="size"))


# ---- tf.data: record counts against the manifest -----------------------------------------------


@pytest.mark.parametrize("off_by", [-3, 30])
def test_tfdata_checks_every_shard_count_against_the_manifest(outputs, tmp_path, off_by):
  out = _copy(outputs["tfrecord"], tmp_path / "miscounted")
  m = _manifest(out)
  split = m["splits"]["train"]
  real = split["shards"][1]["num_records"]
  split["shards"][1]["num_records"] += off_by
  split["num_records"] += off_by
  _write_manifest(out, m)
  shard = os.path.join(out, split["shards"][1]["path"])
  expected = rf"{re.escape(shard)}: {real} records, the manifest says {real + off_by}"
  with pytest.raises(CorruptRecordError, match=expected):
    _ids(tfdata.dataset(out, batch_size=1, image_size=(8, 8)))


# ---- tf.data: a thin image costs what a square one does --------------------------------------------------


_RSS_SCRIPT = r"""
import json, resource, sys
sys.path.insert(0, sys.argv[1])
from loaders import tfdata

def peak_mb():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

def run(path):
  ds = tfdata.dataset(path, batch_size=1, image_size=(224, 224), shuffle=False)
  return [b["image"].shape for b in ds.as_numpy_iterator()]

run(sys.argv[2])  # ordinary images: TensorFlow, tf.data and the map function warmed up
before = peak_mb()
shapes = run(sys.argv[3])
print(json.dumps({"before": before, "after": peak_mb(), "shapes": [list(s) for s in shapes]}))
"""


@pytest.mark.slow  # a subprocess (its own peak memory)
def test_tfdata_thin_images_never_materialise_the_full_resize(tmp_path):
  """A 2000x1 image resized to cover 224x224 would be 448000x224 (1.2 GB float) before the crop."""
  rng = np.random.default_rng(1)
  features = make_outputs.image_features()
  thin = [features.encode({"image": make_outputs.encode_image(rng, size), "label": 0, "file_name": f"{i}.jpg"})
          for i, size in enumerate(((2000, 1), (1, 2000)))]  # (height, width): tall, wide
  make_outputs.write(str(tmp_path / "thin_out"), features, {"train": thin}, kind="image", file_format="tfrecord")
  make_outputs.write(str(tmp_path / "normal_out"), *_images(_jpegs), kind="image", file_format="tfrecord")
  env = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "3"}
  r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, REPO, str(tmp_path / "normal_out"),
                      str(tmp_path / "thin_out")], capture_output=True, text=True, env=env, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert got["shapes"] == [[1, 224, 224, 3]] * 2
  assert got["after"] - got["before"] < 400, got  # the full resize alone would add over 1 GB


# ---- verify= levels: a swapped shard of equal size ---------------------------------------------


def _point_train_at_validation(out: str) -> tuple[str, str, str]:
  """The manifest's train shard path now names the validation shard (same size, other records)."""
  m = _manifest(out)
  train, valid = m["splits"]["train"]["shards"][0], m["splits"]["validation"]["shards"][0]
  assert train["num_bytes"] == valid["num_bytes"]
  assert train["num_records"] == valid["num_records"]
  train["path"] = valid["path"]
  _write_manifest(out, m)
  return os.path.join(out, valid["path"]), train["sha256"], valid["sha256"]


def test_swapped_shard_of_equal_size_is_refused_by_default(outputs, tmp_path):
  out = _copy(outputs["array_record"], tmp_path / "swapped")
  shard, expected, actual = _point_train_at_validation(out)
  for load in (lambda **kw: ShardedRecords(out, **kw),
               lambda **kw: grain_loader.dataset(out, batch_size=2, **kw),
               lambda **kw: grain_loader.data_source(out, **kw)):
    for verify in ({}, {"verify": True}, {"verify": "sha256"}):
      with pytest.raises(CorruptRecordError) as e:
        load(**verify)
      msg = str(e.value)
      assert shard in msg, msg
      assert expected[:12] in msg, msg
      assert actual[:12] in msg, msg
    for verify in ("size", "none", False):  # the cheaper levels trust the manifest's paths, as documented
      assert len(ShardedRecords(out, verify=verify)) == 18


def test_tfdata_swapped_shard_of_equal_size_is_refused(outputs, tmp_path):
  out = _copy(outputs["tfrecord"], tmp_path / "swapped")
  m = _manifest(out)
  shards = m["splits"]["train"]["shards"]
  src = os.path.join(out, shards[0]["path"])
  other = os.path.join(os.path.dirname(src), "other.tfrecord")
  with open(other, "wb") as f:  # the same records in another order: same size, same count, other data
    tfrecord.write_records(f, reversed(list(tfrecord.read_file(src))))
  assert os.path.getsize(other) == os.path.getsize(src)
  shards[0]["path"] = os.path.relpath(other, out)
  _write_manifest(out, m)
  expected = rf"{re.escape(other)}: sha256 [0-9a-f]{{12}}\S* differs from the manifest's {shards[0]['sha256'][:12]}"
  with pytest.raises(CorruptRecordError, match=expected):
    tfdata.dataset(out, batch_size=1, image_size=(8, 8))
  assert len(_ids(tfdata.dataset(out, batch_size=1, image_size=(8, 8), verify="size"))) == m["splits"]["train"][
      "num_records"]


def test_verify_level_is_checked(outputs):
  for bad in ("md5", "SHA256", 1, None):
    with pytest.raises(ValueError, match=rf"verify must be .*got {bad!r}"):
      ShardedRecords(outputs["array_record"], verify=bad)
    with pytest.raises(ValueError, match=rf"verify must be .*got {bad!r}"):
      tfdata.dataset(outputs["tfrecord"], batch_size=1, image_size=(8, 8), verify=bad)


# ---- verify= on the graph loader -----------------------------------------------------------------


def _homogeneous(w: GraphBinWriter, num_nodes: int = 200, num_edges: int = 800) -> None:
  """A random graph with node features and labels, as ogb_graphs writes a node-property data set."""
  rng = np.random.default_rng(1)
  indptr, indices = make_outputs.csr(rng.integers(0, num_nodes, num_edges), rng.integers(0, num_nodes, num_edges),
                                     num_nodes)
  w.add_meta({"num_nodes": {"": num_nodes}})
  w.add("indptr", indptr)
  w.add("indices", indices)
  w.add("node/feat", rng.normal(size=(num_nodes, 8)).astype(np.float32))
  w.add("node/label", rng.integers(0, 5, (num_nodes, 1)))
  w.add("split/random/train", np.arange(0, num_nodes, 2, dtype=np.int64))


def test_graph_load_refuses_a_swapped_graphbin_of_equal_size(tmp_path):
  out = make_outputs.write_graph(str(tmp_path / "graph"), _homogeneous)
  info = _manifest(out)["files"][0]
  path = os.path.join(out, info["path"])
  original = GraphBin(path)
  other = str(tmp_path / "other.graphbin")
  with GraphBinWriter(other) as w:  # every section intact and checksummed, node features in another order
    w.add_meta(original.meta)
    for name in original.sections:
      if name != META:
        arr = np.asarray(original[name])
        w.add(name, arr[::-1].copy() if name == "node/feat" else arr)
  assert os.path.getsize(other) == info["num_bytes"]
  os.replace(other, path)
  expected = rf"{re.escape(path)}: sha256 [0-9a-f]{{12}}\S* differs from the manifest's {info['sha256'][:12]}"
  with pytest.raises(CorruptRecordError, match=expected):
    lg.load(out)
  assert lg.load(out, verify="size").num_nodes == 200


# ---- torch_xla: the same levels, without TensorFlow ----------------------------------------------


_XLA_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from loaders import xla
from loaders import CorruptRecordError
from tests.damage import flip_byte
try:
  xla.device_loader(sys.argv[2], batch_size=2, shard_index=0, shard_count=1, num_threads=1)
  refused = ""
except CorruptRecordError as e:
  refused = str(e)
n = sum(1 for _ in xla.device_loader(sys.argv[2], batch_size=2, shard_index=0, shard_count=1, num_threads=1,
                                     verify="size"))
print(json.dumps({"refused": refused, "batches": n, "tf": "tensorflow" in sys.modules}))
"""


@pytest.mark.slow  # a subprocess (torch_xla)
def test_xla_loader_refuses_a_swapped_shard(outputs, tmp_path):
  out = _copy(outputs["array_record"], tmp_path / "swapped")
  shard, expected, actual = _point_train_at_validation(out)
  env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
  r = subprocess.run([sys.executable, "-c", _XLA_SCRIPT, REPO, out], capture_output=True, text=True, env=env,
                     timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert shard in got["refused"]
  assert expected[:12] in got["refused"]
  assert actual[:12] in got["refused"]
  assert got["batches"] == 9
  assert not got["tf"]


@pytest.mark.slow
@pytest.mark.gcs
def test_a_cached_gcs_shard_damaged_after_its_download_is_fetched_again(outputs, gcs_emulator, tmp_path):
  """The shard cache outlives processes; its `.verified` marker used to vouch for the copy forever."""
  import hashlib

  from tests.conftest import upload_tree

  key = sorted(outputs)[0]
  gs = f"gs://{gcs_emulator}/hostile_cache/{tmp_path.name}"
  upload_tree(outputs[key], gs)
  cache = str(tmp_path / "cache")
  first = ShardedRecords(gs, "train", cache_dir=cache)
  expected = [first.raw(i) for i in range(len(first))]
  shard = first.manifest.splits["train"].shards[0]
  (copy,) = [os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs
             if f == os.path.basename(shard.path)]
  data = bytearray(open(copy, "rb").read())
  data[len(data) // 2] ^= 0xFF  # bit rot in the cache, same size
  open(copy, "wb").write(bytes(data))
  for verify in ("size", "none"):  # the cheaper levels trust a cached copy of the right size, as documented
    ShardedRecords(gs, "train", cache_dir=cache, verify=verify)
    assert hashlib.sha256(open(copy, "rb").read()).hexdigest() != shard.sha256
  again = ShardedRecords(gs, "train", cache_dir=cache)
  assert [again.raw(i) for i in range(len(again))] == expected
  assert hashlib.sha256(open(copy, "rb").read()).hexdigest() == shard.sha256  # fetched again
