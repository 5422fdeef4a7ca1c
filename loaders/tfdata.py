"""TFRecord shards → a `tf.data.Dataset` of fixed-shape dict batches.

    ds = loaders.tfdata.dataset("gs://bucket/imagenet", "train", batch_size=256, image_size=(224, 224))

Records are parsed from the manifest's schema, split disjointly with
`Dataset.shard` at record level (after trimming to a multiple of the shard
count, so every shard gets the same number of batches), shuffled with `seed`
and reshuffled each epoch, decoded/resized to static shapes and batched with
drop_remainder. gs:// shards are fetched once into a local cache and checked
against the manifest's SHA-256 (no TensorFlow GCS plugin or FUSE mount needed).

Before tf.data sees a shard, its bytes are proven at the `verify` level (see
loaders._verify) and its framing is walked once to count its records against
the manifest: tf.data's own errors name a byte offset but not the file, ours
name the shard and the record.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from formats.features import ClassLabel, Image, Tensor, Text
from formats.manifest import ShardInfo
from loaders._shards import load_manifest, local_shard, tfrecord_index
from loaders._transforms import ExampleOptions, record_kind
from loaders._verify import CorruptRecordError, Verify, verify_level


def _parse_spec(features) -> dict:
  spec = {}
  for name, f in features.items():
    if isinstance(f, (Image, Text)) or (isinstance(f, Tensor) and f.encoding == "bytes" and not f.dynamic):
      spec[name] = tf.io.FixedLenFeature([], tf.string)
    elif isinstance(f, Tensor) and f.dynamic:
      spec[f"{name}/shape"] = tf.io.FixedLenFeature([len(f.shape)], tf.int64)
      spec[f"{name}/value"] = tf.io.FixedLenFeature([], tf.string)
    elif isinstance(f, ClassLabel):
      spec[name] = tf.io.FixedLenFeature([], tf.int64)
    elif isinstance(f, Tensor):
      dtype = tf.float32 if f.dtype.startswith("float") else tf.int64
      spec[name] = tf.io.FixedLenFeature(list(f.shape), dtype)
  return spec


def _kept_samples(n_in: tf.Tensor, n_out: tf.Tensor, keep: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
  """Bilinear taps along one axis for the `keep` center outputs of resizing n_in → n_out.

  The arithmetic of tf.image.resize's kernel (half-pixel centers, float32):
  position (i + 0.5) * n_in / n_out - 0.5, neighbours clamped to the image.
  Returns (lower, upper, weight of upper) for those outputs only.
  """
  scale = tf.cast(n_in, tf.float32) / tf.cast(n_out, tf.float32)
  start = tf.maximum((n_out - keep) // 2, 0)  # resize_with_crop_or_pad's offset
  pos = (tf.cast(tf.range(start, start + keep), tf.float32) + 0.5) * scale - 0.5
  floor = tf.math.floor(pos)
  lower = tf.maximum(tf.cast(floor, tf.int32), 0)
  upper = tf.minimum(tf.cast(tf.math.ceil(pos), tf.int32), n_in - 1)
  return lower, upper, pos - floor


def _resize_center_crop(img: tf.Tensor, size: tuple[int, int]) -> tf.Tensor:
  """Aspect-preserving bilinear resize so the image covers `size`, then the center crop (as the pipeline does).

  Computed crop first: only the pixels the crop keeps are interpolated, with
  tf.image.resize's arithmetic, so the result is the same as resizing the
  whole image and cropping, without that image (a 2000x1 image would become
  448000x224 floats on the way to 224x224).
  """
  shape = tf.shape(img)
  h, w = tf.cast(shape[0], tf.float32), tf.cast(shape[1], tf.float32)
  scale = tf.maximum(size[0] / h, size[1] / w)
  new_h, new_w = tf.cast(tf.math.ceil(h * scale), tf.int32), tf.cast(tf.math.ceil(w * scale), tf.int32)
  y0, y1, wy = _kept_samples(shape[0], new_h, size[0])
  x0, x1, wx = _kept_samples(shape[1], new_w, size[1])
  r0, c0 = y0[0], x0[0]
  region = img[r0:y1[-1] + 1, c0:x1[-1] + 1]  # the part of the image the crop keeps
  rows_above, rows_below = tf.gather(region, y0 - r0), tf.gather(region, y1 - r0)

  def left_right(rows):
    return (tf.cast(tf.gather(rows, x0 - c0, axis=1), tf.float32),
            tf.cast(tf.gather(rows, x1 - c0, axis=1), tf.float32))

  (tl, tr), (bl, br) = left_right(rows_above), left_right(rows_below)
  wx, wy = wx[None, :, None], wy[:, None, None]
  top = tl + (tr - tl) * wx  # the kernel's order of operations, so the floats are the same
  bottom = bl + (br - bl) * wx
  return tf.cast(tf.clip_by_value(top + (bottom - top) * wy, 0, 255), tf.uint8)


def _checked_shards(path: str, shards: Sequence[ShardInfo], cache_dir: str | None, verify: Verify) -> list[str]:
  """Local paths of the shards, proven at `verify` and with the record counts the manifest gives.

  The count comes from walking each shard's framing (headers only), so a bad
  length or a truncated file is reported here, naming the shard and record.
  """
  paths = [local_shard(path, s, cache_dir, verify, "tfrecord") for s in shards]
  if verify_level(verify) != "none":
    for local, s in zip(paths, shards):
      n = len(tfrecord_index(local)[0])
      if n != s.num_records:
        raise CorruptRecordError(f"{local}: {n} records, the manifest says {s.num_records}")
  return paths


def dataset(path: str, split: str = "train", *, batch_size: int, shuffle: bool = True, seed: int = 0,
            shard_index: int = 0, shard_count: int = 1, num_epochs: int = 1, cache_dir: str | None = None,
            shuffle_buffer: int = 10_000, verify: Verify = "sha256", **example_options) -> tf.data.Dataset:
  """A tf.data.Dataset of batches (dicts of tensors) from TFRecord shards; images and CT volumes.

  verify: "sha256" (default), "size" or "none"; see docs/loaders.md.
  """
  verify_level(verify)
  manifest = load_manifest(path)
  if manifest.file_format != "tfrecord":
    raise ValueError(f"{path} holds {manifest.file_format} shards; tf.data reads tfrecord (use loaders.grain)")
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index {shard_index} is outside [0, {shard_count})")
  features = manifest.features
  kind = record_kind(features)
  o = ExampleOptions(**example_options)
  shards = manifest.splits[split].shards
  paths = _checked_shards(path, shards, cache_dir, verify)
  total = sum(s.num_records for s in shards)
  spec = _parse_spec(features)
  ds = tf.data.TFRecordDataset(paths).take(total - total % shard_count)
  ds = ds.enumerate().shard(shard_count, shard_index)

  if kind == "image":
    image = features["image"]
    size = o.image_size or (None if None in image.shape[:2] else tuple(image.shape[:2]))
    if size is None:
      raise ValueError("these images have no fixed size: pass image_size=(H, W) for static shapes")

    def convert(index, serialized):
      ex = dict(tf.io.parse_single_example(serialized, spec), record_index=index)
      if isinstance(image, Tensor):
        img = tf.reshape(tf.io.decode_raw(ex["image"], tf.uint8), image.shape)
      else:
        img = tf.io.decode_jpeg(ex["image"], channels=3)
        if None in image.shape[:2] or tuple(image.shape[:2]) != tuple(size):
          img = _resize_center_crop(img, size)
      img.set_shape((*size, 3))
      out = {"image": img, "record_index": ex["record_index"]}
      if "label" in ex:
        out["label"] = ex["label"]
      return out
  elif kind == "volume":
    if o.patch_size is None:
      raise ValueError("CT volumes differ in size: pass patch_size=(D, H, W) for static shapes")
    vdtype = tf.int16 if features["volume"].dtype == "int16" else tf.float32
    lo, hi = o.hu_window

    def convert(index, serialized):
      ex = tf.io.parse_single_example(serialized, spec)
      vol = tf.reshape(tf.io.decode_raw(ex["volume/value"], vdtype), ex["volume/shape"])
      vol = tf.cast(vol, tf.float32)
      pad = tf.maximum(tf.constant(o.patch_size, tf.int64) - tf.shape(vol, out_type=tf.int64), 0)
      vol = tf.pad(vol, tf.stack([tf.zeros_like(pad), pad], axis=1), constant_values=-1024.0)
      vol = tf.image.random_crop(vol, o.patch_size, seed=seed) if o.patch == "random" else vol[
          tuple(slice(0, p) for p in o.patch_size)]
      vol = tf.clip_by_value(vol, lo, hi)
      if o.normalize:
        vol = (vol - lo) / (hi - lo)
      vol.set_shape(o.patch_size)
      return {"volume": vol, "spacing": ex["spacing"], "record_index": index}
  else:
    raise ValueError("loaders.tfdata reads image and CT records; use loaders.grain for graph records")

  if shuffle:
    ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
  ds = ds.repeat(num_epochs).map(convert, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
