"""TFRecord shards → a `tf.data.Dataset` of fixed-shape dict batches.

    ds = loaders.tfdata.dataset("gs://bucket/imagenet", "train", batch_size=256, image_size=(224, 224))

Records are parsed from the manifest's schema, split disjointly with
`Dataset.shard` at record level (after trimming to a multiple of the shard
count, so every shard gets the same number of batches), shuffled with `seed`
and reshuffled each epoch, decoded/resized to static shapes and batched with
drop_remainder. gs:// shards are fetched once into a local cache and checked
against the manifest's SHA-256 (no TensorFlow GCS plugin or FUSE mount needed).
"""

from __future__ import annotations

import tensorflow as tf

from formats.features import ClassLabel, Image, Tensor, Text
from loaders._shards import load_manifest, local_shard
from loaders._transforms import ExampleOptions, record_kind


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


def _resize_center_crop(img, size):
  """Aspect-preserving resize so the image covers `size`, then the center crop (as the pipeline does)."""
  h, w = tf.cast(tf.shape(img)[0], tf.float32), tf.cast(tf.shape(img)[1], tf.float32)
  scale = tf.maximum(size[0] / h, size[1] / w)
  new = tf.cast(tf.math.ceil(tf.stack([h * scale, w * scale])), tf.int32)
  img = tf.image.resize(img, new, method="bilinear")
  return tf.cast(tf.clip_by_value(tf.image.resize_with_crop_or_pad(img, size[0], size[1]), 0, 255), tf.uint8)


def dataset(path: str, split: str = "train", *, batch_size: int, shuffle: bool = True, seed: int = 0,
            shard_index: int = 0, shard_count: int = 1, num_epochs: int = 1, cache_dir: str | None = None,
            shuffle_buffer: int = 10_000, **example_options) -> tf.data.Dataset:
  """A tf.data.Dataset of batches (dicts of tensors) from TFRecord shards; images and CT volumes."""
  manifest = load_manifest(path)
  if manifest.file_format != "tfrecord":
    raise ValueError(f"{path} holds {manifest.file_format} shards; tf.data reads tfrecord (use loaders.grain)")
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index {shard_index} is outside [0, {shard_count})")
  features = manifest.features
  kind = record_kind(features)
  o = ExampleOptions(**example_options)
  shards = manifest.splits[split].shards
  paths = [local_shard(path, s, cache_dir, verify=True) for s in shards]
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
