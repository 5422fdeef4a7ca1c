"""loaders.tfdata's own pieces: the TensorFlow resize equals Pillow's fit, pixel for pixel; the global order's
resume (tf.train.Checkpoint on another host count, `skip`), its errors, and its readers' lifetime."""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image as PILImage, ImageOps

from formats.errors import CorruptRecordError
from formats.features import ClassLabel, Features, Image, Tensor, Text
from formats.outputs.output import open_output
from loaders import grain as grain_loader, tfdata
from tests.loaders import make_outputs


def _pillow_fit(img: np.ndarray, size: tuple[int, int]) -> np.ndarray:
  """The reference (formats.transforms, grain's loader): Pillow's ImageOps.fit with BILINEAR on the whole image."""
  im = PILImage.fromarray(img)
  if im.size == (size[1], size[0]):
    return img
  return np.asarray(ImageOps.fit(im, (size[1], size[0]), method=PILImage.Resampling.BILINEAR))


def test_crop_first_gives_the_same_pixels_as_pillows_fit():
  rng = np.random.default_rng(0)
  shapes = [(48, 64), (64, 48), (375, 500), (500, 375), (333, 333), (224, 224), (7, 300), (300, 7), (257, 511),
            (225, 224), (1, 50)]
  sizes = [(224, 224), (20, 20), (32, 48), (48, 32), (299, 299), (1, 1)]
  for h, w in shapes:
    y, x = np.mgrid[:h, :w]
    smooth = np.stack([(3 * x) % 256, (5 * y) % 256, (x + y) % 256], -1).astype(np.uint8)
    for img in (rng.integers(0, 256, (h, w, 3), dtype=np.uint8), smooth):
      for size in sizes:
        np.testing.assert_array_equal(tfdata._resize_center_crop(img, size).numpy(), _pillow_fit(img, size),
                                      err_msg=f"{(h, w)} -> {size}")


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> str:
  """48 raw 6x5 images in 6 TFRecord shards."""
  features, payloads = make_outputs.raw_images(np.random.default_rng(1), 48, size=(6, 5))
  return make_outputs.write(str(tmp_path_factory.mktemp("tfdata") / "raw"), features, {"train": payloads},
                            kind="image", file_format="tfrecord", num_shards=6)


def _global(path: str, host: int, hosts: int, **kw) -> tf.data.Dataset:
  return tfdata.dataset(path, order="global", global_batch_size=8, shard_index=host, shard_count=hosts, seed=5,
                        num_epochs=3, **kw)


def _ids(batches) -> list[list[int]]:
  return [np.asarray(b["record_index"]).tolist() for b in batches]


@pytest.mark.parametrize("window_shards", [None, 2])
def test_a_checkpoint_saved_on_2_hosts_resumes_on_4_with_the_same_global_steps(raw, tmp_path, window_shards):
  """tf.train.Checkpoint of host 0's iterator after 5 global steps on 2 hosts, restored by each of 4 hosts: the
  rest of the run's global steps are those of one uninterrupted host (the checkpoint holds the global step)."""
  single = _ids(_global(raw, 0, 1, window_shards=window_shards).as_numpy_iterator())
  assert len(single) == 3 * 48 // 8
  its = [iter(_global(raw, h, 2, window_shards=window_shards)) for h in range(2)]
  steps = [sum(_ids(next(it) for it in its), []) for _ in range(5)]
  saved = tf.train.Checkpoint(iterator=its[0]).save(str(tmp_path / "ckpt"))
  its = [iter(_global(raw, h, 4, window_shards=window_shards)) for h in range(4)]
  for it in its:
    tf.train.Checkpoint(iterator=it).restore(saved).assert_consumed()
  steps += [sum(_ids(next(it) for it in its), []) for _ in range(len(single) - 5)]
  assert steps == single
  for it in its:
    with pytest.raises(StopIteration):
      next(it)


def test_skip_resumes_at_a_global_step(raw):
  full = _ids(_global(raw, 0, 1).as_numpy_iterator())
  assert _ids(_global(raw, 0, 1).skip(7).as_numpy_iterator()) == full[7:]
  assert sorted(sum(full[:6], [])) == list(range(48))  # every record once an epoch


def test_the_global_order_refuses_bad_arguments(raw):
  with pytest.raises(ValueError, match="order must be one of"):
    tfdata.dataset(raw, batch_size=4, order="random")
  with pytest.raises(ValueError, match="global_batch_size 8 is not divisible by shard_count 3"):
    tfdata.dataset(raw, order="global", global_batch_size=8, shard_count=3)
  with pytest.raises(ValueError, match="global_batch_size needs order='global'"):
    tfdata.dataset(raw, global_batch_size=8)
  with pytest.raises(ValueError, match="window_shards must be >= 1"):
    tfdata.dataset(raw, batch_size=4, order="global", window_shards=0)
  with pytest.raises(ValueError, match="cache_limit_bytes must be >= 1"):
    tfdata.dataset(raw, batch_size=4, order="global", window_shards=1, cache_limit_bytes=0)


def test_a_damaged_record_read_in_the_global_order_names_its_shard(tmp_path):
  features, payloads = make_outputs.raw_images(np.random.default_rng(2), 8, size=(6, 5))
  out = make_outputs.write(str(tmp_path / "raw"), features, {"train": payloads}, kind="image",
                           file_format="tfrecord", num_shards=2)
  output = open_output(out)
  shard = output.shard_path(output.shards("train")[0])
  with open(shard, "r+b") as f:  # a payload byte of the first record: its data checksum fails
    f.seek(40)
    b = f.read(1)
    f.seek(40)
    f.write(bytes([b[0] ^ 0xFF]))
  ds = tfdata.dataset(out, batch_size=4, order="global", shuffle=False, verify="none")
  with pytest.raises(tf.errors.OpError, match=f"{os.path.basename(shard)}: record 0: bad data checksum"):
    list(ds)


def _lying(tmp_path, kind: str) -> str:
  """An output whose records hold values its manifest rules out, with every checksum and count matching: class
  ids past the 3 classes (records encoded for 10), or a uint8 tensor stored as the int64 300."""
  if kind == "image":
    _, payloads = make_outputs.raw_images(np.random.default_rng(3), 8, size=(6, 5), classes=tuple("abcdefghij"))
    features = make_outputs.image_features((6, 5), raw=True)
  else:
    stored = Features({"small": Tensor((2,), "int64", encoding="none"), "label": ClassLabel(make_outputs.CLASSES)})
    payloads = [stored.encode({"small": np.array([1, 300 if i == 5 else i]), "label": i % 3}) for i in range(8)]
    features = Features({"small": Tensor((2,), "uint8", encoding="none"), "label": ClassLabel(make_outputs.CLASSES)})
  return make_outputs.write(str(tmp_path / kind), features, {"train": payloads}, kind=kind,
                            file_format="tfrecord", num_shards=2)


@pytest.mark.parametrize("order", ["host", "global"])
@pytest.mark.parametrize("kind,lie", [("image", r"label.*: a class id outside \[0, 3\)\] \[record_index\] \[3\]"),
                                      ("tensors", r"small.*: a value outside uint8.*s range\] \[record_index\] \[5\]")])
def test_values_a_record_lies_about_fail_the_read_as_in_grain(tmp_path, order, kind, lie):
  """docs/loaders.md ("Corruption"): a class id past num_classes or an integer that does not fit its dtype is
  refused, never passed on or wrapped (300 as a uint8 is 44), in both pipelines, naming the record."""
  out = _lying(tmp_path, kind)
  with pytest.raises(CorruptRecordError):
    list(grain_loader.dataset(out, batch_size=4, shuffle=False, num_epochs=1))
  ds = tfdata.dataset(out, batch_size=4, order=order, shuffle=False)
  with pytest.raises(tf.errors.InvalidArgumentError, match=lie):
    list(ds)


def test_png_images_are_refused_up_front_not_decoded_as_jpeg(tmp_path):
  """An output another writer made with PNG images (the toolkit writes JPEG): grain reads it; tf.data, which
  decodes JPEG, says so before it reads, instead of failing on the first batch without naming a shard."""
  features = Features({"image": Image(shape=(8, 8, 3), encoding="png"), "label": ClassLabel(make_outputs.CLASSES),
                       "file_name": Text()})
  rng = np.random.default_rng(4)
  payloads = [features.encode({"image": make_outputs.encode_image(rng, (8, 8), fmt="PNG"), "label": i % 3,
                               "file_name": f"{i}.png"}) for i in range(8)]
  out = make_outputs.write(str(tmp_path / "png"), features, {"train": payloads}, kind="image",
                           file_format="tfrecord", num_shards=2)
  assert [b["image"].shape for b in grain_loader.dataset(out, batch_size=4, num_epochs=1)] == [(4, 8, 8, 3)] * 2
  for order in ("host", "global"):
    with pytest.raises(ValueError, match="loaders.tfdata decodes JPEG images; this output's are PNG"):
      tfdata.dataset(out, batch_size=4, order=order)


def test_the_readers_go_with_the_dataset(raw):
  """tf.numpy_function keeps its function for the process's life: the readers (and a stream's private folder)
  must not stay with it once the dataset and its iterators are gone."""
  ds = _global(raw, 0, 1, window_shards=2)
  source = weakref.ref(ds._tpu_shards_read.source)
  it = iter(ds.map(lambda b: b))
  del ds
  gc.collect()
  assert source() is not None and next(it)["image"].shape == (8, 6, 5, 3)  # the iterator holds the dataset
  del it
  gc.collect()
  assert source() is None


def test_a_checkpoint_restored_on_other_data_or_settings_is_refused(tmp_path):
  """data_state saved beside the iterator: restored on a rerun's new generation, or with another seed, the next
  batch raises StateMismatchError (naming both generations); on the same data and settings it resumes."""
  features, payloads = make_outputs.raw_images(np.random.default_rng(3), 16, size=(6, 5))
  out = make_outputs.write(str(tmp_path / "raw"), features, {"train": payloads}, kind="image",
                           file_format="tfrecord", num_shards=2)

  def make(**kw):
    ds = tfdata.dataset(out, order="global", batch_size=4, seed=kw.pop("seed", 1), num_epochs=2, **kw)
    it = iter(ds)
    return ds, it, tf.train.Checkpoint(iterator=it, data=tfdata.data_state(ds))

  ds, it, ckpt = make()
  first = _ids([next(it) for _ in range(3)])
  saved = ckpt.save(str(tmp_path / "ckpt"))
  rest = _ids(it)
  ds, it, ckpt = make()
  ckpt.restore(saved).assert_consumed()
  assert _ids(it) == rest and len(first) + len(rest) == 8
  ds, it, ckpt = make(seed=2)
  ckpt.restore(saved)
  with pytest.raises(tf.errors.OpError, match=r"other order settings: seed=1 \(now 2\)"):
    next(it)
  old = open_output(out).generation
  make_outputs.write(out, features, {"train": payloads[::-1]}, kind="image", file_format="tfrecord", num_shards=2)
  ds, it, ckpt = make()
  ckpt.restore(saved)
  with pytest.raises(tf.errors.OpError, match=f"the state was saved on {old}.*but this loader reads "
                                              f"{open_output(out).generation}"):
    next(it)
  with pytest.raises(ValueError, match="data_state needs"):
    tfdata.data_state(tfdata.dataset(out, batch_size=4))


def test_settings_tfdata_does_not_use_are_refused(raw):
  with pytest.raises(ValueError, match="shuffle_buffer sizes tf.data's own host pipeline"):
    tfdata.dataset(raw, batch_size=4, order="global", shuffle_buffer=7)
  with pytest.raises(ValueError, match="fetch='records' reads ArrayRecord only"):
    tfdata.dataset(raw, batch_size=4, order="global", window_shards=1, fetch="records")
  with pytest.raises(ValueError, match="whole batches only"):
    tfdata.dataset(raw, batch_size=4, drop_remainder=False)
  with pytest.raises(ValueError, match="loaders.tfdata does not read num_threads"):
    tfdata.dataset(raw, batch_size=4, num_threads=2)
  with pytest.raises(ValueError, match="shuffle_buffer must be at least 1 record, got 0"):  # not the default's 10 000
    tfdata.dataset(raw, batch_size=4, shuffle_buffer=0)


def test_a_gcs_split_too_big_for_random_access_is_refused_before_it_is_copied(raw, gcs_emulator, tmp_path):
  from tests.conftest import upload_tree

  gs = f"gs://{gcs_emulator}/tfdata/raw"
  upload_tree(raw, gs)
  for order in ("host", "global"):
    with pytest.raises(ValueError, match="random access needs all of it on local disk; pass window_shards=N"):
      tfdata.dataset(gs, batch_size=4, order=order, cache_limit_bytes=100, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="make no whole (global )?batch"):  # refused before the split is copied
      tfdata.dataset(gs, batch_size=1000, order=order, cache_dir=str(tmp_path / "c"))
  assert not [p for p in (tmp_path / "c").rglob("*") if p.is_file()]  # nothing was fetched
