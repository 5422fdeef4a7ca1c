"""TFRecord shards → a `tf.data.Dataset` of fixed-shape dict batches.

    ds = loaders.tfdata.dataset("gs://bucket/imagenet", "train", batch_size=256, image_size=(224, 224))

Records are parsed from the manifest's schema, split disjointly with
`Dataset.shard` at record level (after trimming to a multiple of the shard
count, so every shard gets the same number of batches), shuffled with `seed`
and reshuffled each epoch, decoded/resized to static shapes and batched with
drop_remainder. gs:// shards are fetched once into a local cache and checked
against the manifest's SHA-256 (no TensorFlow GCS plugin or FUSE mount needed).

Before tf.data sees a shard, its bytes are proven at the `verify` level (see
formats.outputs.integrity) and its framing is walked once to count its records against
the manifest: tf.data's own errors name a byte offset but not the file, ours
name the shard and the record.

The manifest is read once: the dataset reads the generation it named, every
epoch, and holds a lease on it while the dataset lives (loaders._pinning).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from formats.errors import CorruptRecordError
from formats.features import ClassLabel, Features, Image, Tensor, Text
from formats.outputs.integrity import Verify, verify_level
from formats.outputs.output import Output
from loaders._pinning import pin_output
from formats.transforms import (CT_PADDING_HU, JPEG_DCT_METHOD, JPEG_DRAFT_SCALES, LABEL_PADDING,
                                RESAMPLE_PRECISION_BITS, hu_window_constants, jpeg_draft_scale, label_patch_dtype,
                                resize_plan, seeded_patch_start)
from loaders._transforms import ExampleOptions, batched_features, volume_label

__all__ = ["dataset"]


# The dtypes tf.io.decode_raw reads.
_RAW_DTYPES = (tf.float16, tf.float32, tf.float64, tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8, tf.uint16,
               tf.complex64, tf.complex128, tf.bool)


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


def _sizes_function(func, inputs: list, dtypes: list, shapes: list) -> list[tf.Tensor]:
  """Calls a pure numpy function of sizes from formats.transforms (the one definition), static shapes set."""
  out = tf.numpy_function(tf.autograph.experimental.do_not_convert(func), inputs, dtypes, stateful=False)
  out = out if isinstance(out, (list, tuple)) else [out]
  for t, shape in zip(out, shapes):
    t.set_shape(shape)
  return list(out)


def _decode_jpeg(data: tf.Tensor, size: tuple[int, int]) -> tf.Tensor:
  """uint8 [h, w, 3] decoded as Pillow does for a target `size`: accurate integer DCT, at jpeg_draft_scale."""
  shape = tf.image.extract_jpeg_shape(data)

  def draft_branch(height, width):
    return np.int32(JPEG_DRAFT_SCALES.index(jpeg_draft_scale(int(height), int(width), size)))

  branch, = _sizes_function(draft_branch, [shape[0], shape[1]], [tf.int32], [[]])
  return tf.switch_case(branch, [
      lambda r=r: tf.io.decode_jpeg(data, channels=3, ratio=r, dct_method=JPEG_DCT_METHOD)
      for r in JPEG_DRAFT_SCALES])


def _resample(pixels: tf.Tensor, first: tf.Tensor, weights: tf.Tensor, axis: int) -> tf.Tensor:
  """One pass of formats.transforms.bilinear_taps along `axis` (0 or 1) of int32 pixels: Pillow's fixed point."""
  idx = tf.minimum(first[:, None] + tf.range(tf.shape(weights)[1]), tf.shape(pixels)[axis] - 1)
  taken = tf.gather(pixels, idx, axis=axis)  # the axis becomes [out, k]
  w = weights[:, :, None, None] if axis == 0 else weights[None, :, :, None]
  acc = tf.reduce_sum(taken * w, axis=axis + 1) + (1 << (RESAMPLE_PRECISION_BITS - 1))
  return tf.clip_by_value(tf.bitwise.right_shift(acc, RESAMPLE_PRECISION_BITS), 0, 255)


def _resize_center_crop(img: tf.Tensor, size: tuple[int, int]) -> tf.Tensor:
  """The centre region of the target aspect ratio (fit_box, crop first) resized to `size` with Pillow's BILINEAR.

  The taps come from formats.transforms.resize_plan; only the rows the
  output uses are resampled horizontally, then the vertical pass, each
  rounded to uint8, so the pixels equal Pillow's ImageOps.fit.
  """
  img = tf.convert_to_tensor(img)
  shape = tf.shape(img)

  def plan(height, width):
    return resize_plan(int(height), int(width), size)

  row_first, row_w, col_first, col_w = _sizes_function(
      plan, [shape[0], shape[1]], [tf.int32] * 4, [[size[0]], [size[0], None], [size[1]], [size[1], None]])
  r0 = row_first[0]
  r1 = tf.minimum(row_first[-1] + tf.shape(row_w)[1], shape[0])
  rows = tf.cast(img[r0:r1], tf.int32)
  across = _resample(rows, col_first, col_w, axis=1)
  return tf.cast(_resample(across, row_first - r0, row_w, axis=0), tf.uint8)


def _checked_shards(output: Output, split: str, cache_dir: str | None, verify: Verify) -> list[str]:
  """Local paths of a split's shards, proven at `verify` and with the record counts the manifest gives.

  The count comes from walking each shard's framing (headers only), so a bad
  length or a truncated file is reported here, naming the shard and record.
  """
  shards = output.shards(split)
  paths = output.local_copies(shards, cache_dir, verify)
  if verify_level(verify) != "none":
    for local, s in zip(paths, shards):
      n = output.adapter.num_records(local)
      if n != s.num_records:
        raise CorruptRecordError(f"{local}: {n} records, the manifest says {s.num_records}")
  return paths


_Convert = Callable[[tf.Tensor, tf.Tensor, tf.Tensor], dict]  # (n, record index, serialized record) -> example


def _check_arguments(verify: Verify, batch_size: int, num_epochs: int) -> None:
  """Rejects a bad verify level, batch size or epoch count, before anything is opened."""
  verify_level(verify)
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  if num_epochs < 1:
    raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")


def _check_tfrecord(output: Output) -> None:
  """Rejects an output whose shards are not TFRecord."""
  if output.manifest.file_format != "tfrecord":
    raise ValueError(f"{output.path} holds {output.manifest.file_format} shards; tf.data reads tfrecord "
                     f"(use loaders.grain)")


def _check_shard(shard_index: int, shard_count: int) -> None:
  """Rejects a shard index outside [0, shard_count)."""
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index {shard_index} is outside [0, {shard_count})")


def _converter(kind: str, features: Features, o: ExampleOptions, seed: int, batch_size: int) -> _Convert:
  """The parse-and-decode function for records of `kind`, giving static shapes; ValueError for a kind not read here."""
  spec = _parse_spec(features)
  if kind == "image":
    return _image_converter(features, spec, o)
  if kind == "volume":
    return _volume_converter(features, spec, o, seed, batch_size)
  if kind == "tensors":
    return _tensors_converter(features, spec)
  raise ValueError(f"loaders.tfdata reads image, volume and tensors records, not {kind!r} "
                   f"(use loaders.grain for graph records)")


def _image_converter(features: Features, spec: dict, o: ExampleOptions) -> _Convert:
  """Images decoded (raw, or JPEG as Pillow does) and centre-cropped/resized to `image_size` or the stored size."""
  image = features["image"]
  size = o.image_size or (None if None in image.shape[:2] else tuple(image.shape[:2]))
  if size is None:
    raise ValueError("these images have no fixed size: pass image_size=(H, W) for static shapes")

  def convert(n, index, serialized):
    ex = tf.io.parse_single_example(serialized, spec)
    if isinstance(image, Tensor):
      img = tf.reshape(tf.io.decode_raw(ex["image"], tf.uint8), image.shape)
    elif tuple(image.shape[:2]) == tuple(size):  # stored at the target size: draft scale 1, no resize
      img = tf.io.decode_jpeg(ex["image"], channels=3, dct_method=JPEG_DCT_METHOD)
    else:
      img = _decode_jpeg(ex["image"], size)
      same = tf.reduce_all(tf.shape(img)[:2] == tf.constant(size))
      img = tf.cond(same, lambda: img, lambda: _resize_center_crop(img, size))
    img.set_shape((*size, 3))
    out = {"image": img, "record_index": index}
    if "label" in ex:
      out["label"] = ex["label"]
    return out
  return convert


def _far_end_pad(part: tf.Tensor, patch: tf.Tensor, fill) -> tf.Tensor:
  """`part` padded with `fill` at the far end of its first three axes up to `patch` (later axes kept whole)."""
  pad = patch - tf.shape(part, out_type=tf.int64)[:3]
  rows = tf.concat([tf.stack([tf.zeros_like(pad), pad], axis=1), tf.zeros([part.shape.rank - 3, 2], tf.int64)], 0)
  return tf.pad(part, rows, constant_values=fill)


def _label_parser(features: Features, layout: str) -> Callable[[dict, tf.Tensor], tf.Tensor]:
  """(parsed example, the volume's shape) → the record's label tensor, checked to share the volume's [D, H, W]."""
  dtype = tf.as_dtype(features["label"].dtype)

  def parse(ex, shape):
    label = tf.reshape(tf.io.decode_raw(ex["label/value"], dtype), ex["label/shape"])
    same = tf.debugging.assert_equal(
        tf.shape(label, out_type=tf.int64)[:3], shape,
        message=f"feature label ({layout}) must have the [D, H, W] of its volume")
    with tf.control_dependencies([same]):
      return tf.identity(label)
  return parse


def _volume_converter(features: Features, spec: dict, o: ExampleOptions, seed: int, batch_size: int) -> _Convert:
  """CT volumes cut to a `patch_size` patch (centre, or seeded by batch position and slot), padded, windowed;
  their `label`, when they have one, cut at the same start (formats.transforms)."""
  if o.patch_size is None:
    raise ValueError("CT volumes differ in size: pass patch_size=(D, H, W) for static shapes")
  vdtype = tf.int16 if features["volume"].dtype == "int16" else tf.float32
  lo, hi, span = hu_window_constants(o.hu_window)
  patch = tf.constant(o.patch_size, tf.int64)
  layout = volume_label(features, o)
  if layout:
    parse_label = _label_parser(features, layout)
    label_dtype = tf.as_dtype(label_patch_dtype(layout, features["label"].dtype))
    channels = tuple(features["label"].shape[3:])  # (C,) for channels, () for class ids

  def draw(shape, n, *label):
    position, slot = divmod(int(n), batch_size)
    return seeded_patch_start(shape, o.patch_size, seed, position, slot, o.pos_fraction,
                              label[0] if label else None)

  def convert(n, index, serialized):
    ex = tf.io.parse_single_example(serialized, spec)
    vol = tf.reshape(tf.io.decode_raw(ex["volume/value"], vdtype), ex["volume/shape"])
    shape = tf.shape(vol, out_type=tf.int64)
    label = parse_label(ex, shape) if layout else None
    if o.patch == "random":
      inputs = [shape, n] if o.pos_fraction is None else [shape, n, label]
      start, = _sizes_function(draw, inputs, [tf.int64], [[3]])
    else:
      start = tf.maximum(shape - patch, 0) // 2  # formats.transforms.center_patch_start
    size = tf.minimum(patch, shape - start)
    part = tf.cast(tf.slice(vol, start, size), tf.float32)
    vol = _far_end_pad(part, patch, float(CT_PADDING_HU))  # the far end, as in grain
    vol = tf.clip_by_value(vol, lo, hi)
    if o.normalize:
      vol = (vol - lo) / span
    vol.set_shape(o.patch_size)
    out = {"volume": vol, "spacing": ex["spacing"], "patch_start": start, "record_index": index}
    if layout:
      rest = tf.constant(channels, tf.int64)
      part = tf.slice(label, tf.concat([start, tf.zeros_like(rest)], 0), tf.concat([size, rest], 0))
      out["label"] = _far_end_pad(tf.cast(part, label_dtype), patch, LABEL_PADDING)
      out["label"].set_shape((*o.patch_size, *channels))
    return out
  return convert


def _tensors_converter(features: Features, spec: dict) -> _Convert:
  """Tensors and class labels as stored; ValueError for a bytes dtype tf.io.decode_raw cannot read."""
  batched = batched_features(features)
  for name, f in batched.items():
    if isinstance(f, Tensor) and f.encoding == "bytes" and tf.as_dtype(f.dtype) not in _RAW_DTYPES:
      raise ValueError(f"feature {name!r}: tf.io.decode_raw cannot read dtype {f.dtype} (use loaders.grain)")

  def convert(n, index, serialized):
    ex = tf.io.parse_single_example(serialized, spec)
    out = {}
    for name, f in batched.items():
      if isinstance(f, ClassLabel):
        out[name] = ex[name]
      elif f.encoding == "bytes":  # little-endian bytes at the static shape (formats.features.Tensor)
        out[name] = tf.reshape(tf.io.decode_raw(ex[name], tf.as_dtype(f.dtype), little_endian=True), f.shape)
      else:
        out[name] = tf.cast(ex[name], f.dtype)
    out["record_index"] = index
    return out
  return convert


def _shard_records(paths: list[str], per_shard: int, shard_index: int, shard_count: int) -> tf.data.Dataset:
  """This shard's (record index, serialized record) pairs, `per_shard` of them on every shard.

  The records are strided by record index, after trimming the split to a multiple of shard_count.
  """
  return tf.data.TFRecordDataset(paths).take(per_shard * shard_count).enumerate().shard(shard_count, shard_index)


def _whole_batches(records: tf.data.Dataset, convert: _Convert, per_shard: int, batch_size: int,
                   num_epochs: int) -> tf.data.Dataset:
  """`num_epochs` epochs of whole batches of converted records (grain's drop_remainder per epoch), prefetched.

  `convert` gets n, the example's position over all epochs, which seeds its random draws.
  """
  ds = records.take(per_shard // batch_size * batch_size).repeat(num_epochs).enumerate()
  ds = ds.map(lambda n, item: convert(n, *item), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def dataset(path: str, split: str = "train", *, batch_size: int, shuffle: bool = True, seed: int = 0,
            shard_index: int = 0, shard_count: int = 1, num_epochs: int = 1, cache_dir: str | None = None,
            shuffle_buffer: int = 10_000, verify: Verify = "sha256", lease: bool = True,
            **example_options) -> tf.data.Dataset:
  """A tf.data.Dataset of batches (dicts of tensors) from TFRecord shards: images, CT volumes, tensors records.

  The batches have loaders.grain's keys, dtypes and values (formats.transforms
  is the one specification): every epoch is this shard's records (strided by
  record index), shuffled with `seed` when `shuffle`, cut to whole batches
  (drop_remainder), and random patches are drawn from
  element_rng(seed, batch position, slot). With shuffle=False the batches
  equal grain's bit for bit; shuffled orders differ (tf.data's shuffle buffer
  is not grain's permutation), and so do the random patches a record gets.

  Args:
    path: the output folder (TFRecord shards), local or gs://.
    split: the split to read.
    batch_size: examples per batch (the remainder of each epoch is dropped).
    shuffle: shuffle each epoch with a buffer of `shuffle_buffer` records.
    seed: fixes the shuffle and every random draw.
    shard_index, shard_count: this replica's disjoint, equal share of the records.
    num_epochs: epochs in a row.
    cache_dir: where gs:// shards are cached.
    shuffle_buffer: the shuffle buffer's size.
    verify: "sha256" (default), "size" or "none"; see docs/loaders.md.
    lease: hold a lease on the generation read while the dataset (or one made from it by tf.data
      transformations) lives; see loaders.grain.dataset.
    **example_options: the fields of loaders.ExampleOptions.

  Returns:
    A tf.data.Dataset of dicts of tensors with static shapes.

  Raises:
    ValueError: the shards are not TFRecord, the record kind is not read here,
      or a bad batch size, shard, epoch count, verify level or example option.
    NotAnOutputError: `path` has no manifest.json.
    KeyError: the output has no such split.
    CorruptRecordError: a shard differs from the manifest (size, digest or record count).
  """
  _check_arguments(verify, batch_size, num_epochs)
  pin = pin_output(path, lease=lease, purpose=f"loaders.tfdata {split}")
  output = pin.output
  _check_tfrecord(output)
  _check_shard(shard_index, shard_count)  # after opening: a missing or non-TFRecord output is reported first
  kind = output.kind  # here: a manifest without a kind is reported before bad options or a missing split
  options = ExampleOptions(**example_options)
  paths = _checked_shards(output, split, cache_dir, verify)
  per_shard = sum(s.num_records for s in output.shards(split)) // shard_count
  convert = _converter(kind, output.manifest.features, options, seed, batch_size)
  records = _shard_records(paths, per_shard, shard_index, shard_count)
  if shuffle:
    records = records.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
  ds = _whole_batches(records, convert, per_shard, batch_size, num_epochs)
  ds._tpu_shards_pin = pin  # lives as long as the dataset and every dataset made from it (they hold their input)
  return ds
