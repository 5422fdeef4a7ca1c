"""TFRecord shards → a `tf.data.Dataset` of fixed-shape dict batches.

    ds = loaders.tfdata.dataset("gs://bucket/imagenet", "train", batch_size=256, image_size=(224, 224))
    ds = loaders.tfdata.dataset(path, "train", order="global", global_batch_size=1024, shard_index=host,
                                shard_count=hosts, window_shards=8)   # grain's batches, streamed from gs://

Two ways to choose the records of a batch:

* order="host" (the default) without `window_shards`: tf.data's own
  pipeline. Records are split disjointly with `Dataset.shard` at record level
  (after trimming to a multiple of the shard count, so every shard gets the
  same number of batches), shuffled with `seed` in a buffer and reshuffled
  each epoch, decoded/resized to static shapes and batched with
  drop_remainder. gs:// shards are fetched once into a local cache and
  checked against the manifest's SHA-256 (no TensorFlow GCS plugin or FUSE
  mount needed).
* order="global", or `window_shards`: the records of batch position k are
  those loaders.grain puts in it, chosen by the same framework-free order
  (loaders._stream.WindowOrder for windows of shards; otherwise one seeded
  permutation of the whole split per epoch) and read by the same readers
  (loaders.ShardedRecords at random, loaders._stream.ShardStream for
  windows: a gs:// split streamed through a bounded cache, each shard's
  SHA-256 checked as it arrives). tf.data maps `Dataset.range(positions)`
  through one `tf.numpy_function` that hands it batch k's serialized records,
  then parses and decodes them as above: the batches equal grain's bit for
  bit, and a run resumes at global step k on any number of hosts with the
  same global batch (`dataset` says how).

Before tf.data sees a shard, its bytes are proven at the `verify` level (see
formats.outputs.integrity) and its framing is walked once to count its records against
the manifest: tf.data's own errors name a byte offset but not the file, ours
name the shard and the record.

The manifest is read once: the dataset reads the generation it named, every
epoch, and holds a lease on it while the dataset lives (loaders._pinning).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from formats.errors import CorruptRecordError
from formats.features import ClassLabel, Features, Image, Tensor, Text
from formats.outputs.integrity import Verify, verify_level
from formats.outputs.output import Output
from loaders._order import RecordOrder, check_some_batch, per_host_batch_size
from loaders._pinning import DataIdentity, StateGuard, pin_output
from loaders._shards import ShardedRecords, check_fits
from loaders._stream import ShardStream, WindowOrder
from formats.transforms import (CT_PADDING_HU, JPEG_DCT_METHOD, JPEG_DRAFT_SCALES, LABEL_PADDING,
                                RESAMPLE_PRECISION_BITS, hu_window_constants, jpeg_draft_scale, label_patch_dtype,
                                resize_plan, seeded_patch_start)
from loaders._transforms import (ExampleOptions, batched_features, check_options_read, check_raw_image_size,
                                 volume_label)
from loaders.options import TFDATA_DEFAULTS, Fetching, Ordering, Sharding, settings

__all__ = ["SHUFFLE_BUFFER", "data_state", "dataset"]

SHUFFLE_BUFFER = 10_000  # records in tf.data's shuffle buffer (its own host pipeline)


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


# (n, record index, serialized record) -> example; n = batch position × batch_size + slot in this host's batch
_Convert = Callable[[tf.Tensor, tf.Tensor, tf.Tensor], dict]


def _check_tfrecord(output: Output) -> None:
  """Rejects an output whose shards are not TFRecord."""
  if output.manifest.file_format != "tfrecord":
    raise ValueError(f"{output.path} holds {output.manifest.file_format} shards; tf.data reads tfrecord "
                     f"(use loaders.grain)")


def _converter(kind: str, features: Features, o: ExampleOptions, seed: int, batch_size: int,
               first_slot: int = 0) -> _Convert:
  """The parse-and-decode function for records of `kind`, giving static shapes; ValueError for a kind not read here.

  Random draws are keyed by (seed, batch position, first_slot + slot): `first_slot` is this host's first slot
  in the global batch with order="global", else 0.
  """
  if kind in ("image", "volume", "tensors"):
    check_options_read(kind, o)
  spec = _parse_spec(features)
  if kind == "image":
    return _image_converter(features, spec, o)
  if kind == "volume":
    return _volume_converter(features, spec, o, seed, batch_size, first_slot)
  if kind == "tensors":
    return _tensors_converter(features, spec)
  raise ValueError(f"loaders.tfdata reads image, volume and tensors records, not {kind!r} "
                   f"(use loaders.grain for graph records)")


def _within(value: tf.Tensor, lo: int, hi: int, what: str, index: tf.Tensor) -> tf.Tensor:
  """`value`, checked to lie in [lo, hi]: a record whose values lie (its checksums may still match) fails the
  read with an InvalidArgumentError naming `what` and the record's record_index, where grain raises
  CorruptRecordError; never a value passed on, or wrapped by a cast."""
  fits = tf.reduce_all((value >= tf.constant(lo, value.dtype)) & (value <= tf.constant(hi, value.dtype)))
  with tf.control_dependencies([tf.debugging.Assert(fits, [what, "record_index", index])]):
    return tf.identity(value)


def _class_id(ex: dict, name: str, feature: ClassLabel, index: tf.Tensor) -> tf.Tensor:
  return _within(ex[name], 0, feature.num_classes - 1,
                 f"feature {name!r}: a class id outside [0, {feature.num_classes})", index)


def _image_converter(features: Features, spec: dict, o: ExampleOptions) -> _Convert:
  """Images decoded (raw, or JPEG as Pillow does) and centre-cropped/resized to `image_size` or the stored size."""
  image = features["image"]
  if isinstance(image, Image) and image.encoding != "jpeg":  # the toolkit writes JPEG; another writer may not
    raise ValueError(f"loaders.tfdata decodes JPEG images; this output's are {image.encoding.upper()} "
                     "(loaders.grain reads them)")
  check_raw_image_size(image, o)
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
      out["label"] = _class_id(ex, "label", features["label"], index)
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


def _volume_converter(features: Features, spec: dict, o: ExampleOptions, seed: int, batch_size: int,
                      first_slot: int) -> _Convert:
  """CT volumes cut to a `patch_size` patch (centre, or seeded by batch position and slot), padded, windowed;
  their `label`, when they have one, cut at the same start (formats.transforms)."""
  if o.patch_size is None:
    raise ValueError("CT volumes differ in size: pass patch_size=(D, H, W) for static shapes")
  vdtype = tf.as_dtype(features["volume"].dtype)  # the stored dtype, whatever wrote it (formats.kinds takes any)
  lo, hi, span = hu_window_constants(o.hu_window)
  patch = tf.constant(o.patch_size, tf.int64)
  layout = volume_label(features, o)
  if layout:
    parse_label = _label_parser(features, layout)
    label_dtype = tf.as_dtype(label_patch_dtype(layout, features["label"].dtype))
    channels = tuple(features["label"].shape[3:])  # (C,) for channels, () for class ids

  def draw(shape, n, *label):
    position, slot = divmod(int(n), batch_size)
    return seeded_patch_start(shape, o.patch_size, seed, position, first_slot + slot, o.pos_fraction,
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
        out[name] = _class_id(ex, name, f, index)
      elif f.encoding == "bytes":  # little-endian bytes at the static shape (formats.features.Tensor)
        out[name] = tf.reshape(tf.io.decode_raw(ex[name], tf.as_dtype(f.dtype), little_endian=True), f.shape)
      elif np.dtype(f.dtype).kind in "iu" and np.dtype(f.dtype).itemsize < 8:  # stored as int64 (uint64: wrapped)
        bounds = np.iinfo(f.dtype)
        value = _within(ex[name], int(bounds.min), int(bounds.max), f"Tensor {name!r}: a value outside "
                        f"{f.dtype}'s range", index)
        out[name] = tf.cast(value, f.dtype)
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


class _RecordBatches:
  """Batch position → (n, record indices, serialized records) of this host's batch, for tf.numpy_function.

  The records are read by `source.raw` (a ShardedRecords, or a ShardStream whose `batch` block makes the
  position's shards local and pins them); n = position × batch_size + slot keys the random draws.

  `data` (a string tf.Variable, `data_state`) holds the stamp of the data and order settings a
  tf.train.Checkpoint restored; before each batch it is checked against what this dataset reads, so a
  checkpoint saved on other data (a rerun's new generation) or with other settings raises
  StateMismatchError instead of resuming on records its position does not name.
  """

  def __init__(self, source: ShardedRecords | ShardStream, order: RecordOrder | WindowOrder, batch_size: int,
               guard: StateGuard):
    self.source, self.order, self.batch_size, self._guard = source, order, batch_size, guard
    self._stamp = json.dumps(guard.stamp({}), sort_keys=True)
    with tf.init_scope(), tf.device("/cpu:0"):  # eager and on the host, whatever scope builds the dataset
      self.data = tf.Variable(self._stamp, trainable=False, dtype=tf.string, name="tpu_shards_data")
    self._checked = self._stamp

  def _check_data(self) -> None:
    """StateMismatchError when a checkpoint restored `data` from other data or order settings."""
    stamp = self.data.numpy().decode()
    if stamp != self._checked:
      self._guard.check(json.loads(stamp))
      self._checked = stamp

  def __call__(self, position) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    self._check_data()
    position = int(position)
    if isinstance(self.source, ShardStream):
      with self.source.batch(position) as indices:
        data = [self.source.raw(int(i)) for i in indices]
    else:
      indices = self.order.indices(position)
      data = [self.source.raw(int(i)) for i in indices]
    n = position * self.batch_size + np.arange(len(data), dtype=np.int64)
    return n, np.asarray(indices, np.int64), np.array(data, dtype=object).reshape(len(data))


def _position_batches(read: _RecordBatches, positions: int, convert: _Convert) -> tf.data.Dataset:
  """Batch positions 0..positions-1, each read by `read` (one numpy call per batch, in parallel), converted
  record by record and batched again: every batch holds exactly the records `read` gave for its position.

  Checkpoints are symbolic (tf.data.Options.experimental_symbolic_checkpoint): a tf.train.Checkpoint of an
  iterator saves how far the range has gone, not the batches in tf.data's buffers, so it is a few KiB and
  restores into a dataset of another host count (the position is the global step with order="global").
  """
  b = read.batch_size
  # tf.numpy_function keeps its function for the life of the process (in the outermost graph): it holds
  # `read` weakly, and the dataset strongly (`dataset`), so the readers go with the dataset.
  ref = weakref.ref(read)

  def call(position):
    reader = ref()
    if reader is None:
      raise RuntimeError("the loaders.tfdata dataset this iterator reads was collected")
    return reader(position)

  def load(position):
    out = tf.numpy_function(tf.autograph.experimental.do_not_convert(call), [position],
                            [tf.int64, tf.int64, tf.string], stateful=False)
    for t in out:
      t.set_shape([b])
    return tuple(out)

  ds = tf.data.Dataset.range(positions).map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  ds = ds.unbatch().map(convert, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  ds = ds.batch(b, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
  options = tf.data.Options()
  options.experimental_symbolic_checkpoint = True  # a checkpoint holds positions, never buffered batches
  return ds.with_options(options)


def dataset(path: str, split: str = "train", *, batch_size: int | None = None,
            global_batch_size: int | None = None, ordering: Ordering | None = None,
            sharding: Sharding | None = None, fetching: Fetching | None = None, example: ExampleOptions | None = None,
            shuffle_buffer: int | None = None, **fields) -> tf.data.Dataset:
  """A tf.data.Dataset of batches (dicts of tensors) from TFRecord shards: images, CT volumes, tensors records.

  The batches have loaders.grain's keys, dtypes and values (formats.transforms
  is the one specification), every epoch cut to whole batches (drop_remainder).

  order="host" without window_shards (the default): every epoch is this
  shard's records (strided by record index), shuffled with `seed` in a buffer
  of `shuffle_buffer` records when `shuffle`; random patches are drawn from
  element_rng(seed, batch position, slot). With shuffle=False the batches
  equal grain's bit for bit; shuffled orders differ (tf.data's shuffle buffer
  is not grain's permutation), and so do the random patches a record gets.

  order="global", or any order with window_shards: every batch is the one
  loaders.grain.dataset gives with the same arguments (`order` among them: its
  default here is "host", grain's "global"), bit for bit, shuffled
  or not (the same order, read by the same readers; random draws keyed by the
  slot in the global batch with order="global"). Batch k of the dataset is
  batch position k (over all epochs); with order="global" position k is
  global step k, the same on any number of hosts. Resume, on this host count
  or another with the same global batch: restore a tf.train.Checkpoint of an
  iterator (checkpoints are symbolic: a few KiB, and nothing before the saved
  step is read again), or take `dataset(...).skip(k)` after k steps (the same
  batches, but tf.data reads and drops the k skipped ones).

  Args:
    path: the output folder (TFRecord shards), local or gs://.
    split: the split to read.
    batch_size, global_batch_size: as in loaders.grain.dataset (the remainder of each epoch is dropped).
    ordering: as in loaders.grain.dataset, but order=None (given by name or in an Ordering) means "host"
      (loaders.options.TFDATA_DEFAULTS: tf.data's own pipeline above); pass order="global" for grain's
      batches. on_new_data is not read and drop_remainder must stay True.
    sharding: this replica's share (loaders.Sharding or grain's ShardOptions).
    fetching: as in loaders.grain.dataset; streamed shards are fetched whole (fetch="records" is
      ArrayRecord's).
    example: how records become fixed-shape examples (loaders.ExampleOptions).
    shuffle_buffer: the shuffle buffer's size (order="host" without window_shards only; None:
      SHUFFLE_BUFFER records).
    **fields: any field of those groups by its own name.

  Returns:
    A tf.data.Dataset of dicts of tensors with static shapes.

  Raises:
    ValueError: the shards are not TFRecord, the record kind is not read here, a bad setting or one
      tf.data does not read, or a global batch the host count does not divide.
    TypeError: as in loaders.options.settings.
    NotAnOutputError: `path` has no manifest.json.
    KeyError: the output has no such split.
    CorruptRecordError: a shard differs from the manifest (size, digest or record count).
  """
  s = settings("loaders.tfdata", ordering=ordering, sharding=sharding, fetching=fetching, example=example,
               read=("shuffle", "seed", "num_epochs", "order", "drop_remainder", "window_shards", "run_records",
                     "sharding", "cache_dir", "verify", "cache_limit_bytes", "fetch", "lease", "example"),
               defaults=TFDATA_DEFAULTS, **fields)
  if not s.ordering.drop_remainder:
    raise ValueError("loaders.tfdata gives whole batches only: drop_remainder must be True")
  if s.fetching.fetch == "records":
    raise ValueError("loaders.tfdata streams whole TFRecord shards: fetch='records' reads ArrayRecord only")
  o, f = s.ordering, s.fetching
  if f.fetch != "auto" and o.window_shards is None:  # as loaders.grain
    raise ValueError(f"fetch={f.fetch!r} chooses how windows are streamed: it needs window_shards")
  host_pipeline = o.order == "host" and o.window_shards is None
  if shuffle_buffer is not None and not host_pipeline:
    raise ValueError("shuffle_buffer sizes tf.data's own host pipeline: with order='global' or window_shards "
                     "the order is grain's permutation")
  if shuffle_buffer is not None and not o.shuffle:
    raise ValueError("shuffle_buffer sizes the shuffle: with shuffle=False there is none")
  if shuffle_buffer is not None and shuffle_buffer < 1:
    raise ValueError(f"shuffle_buffer must be at least 1 record, got {shuffle_buffer}")
  shard_index, shard_count = s.sharding.resolve(0, 1)
  batch_size = per_host_batch_size(batch_size, shard_count, o.order, global_batch_size)
  pin = pin_output(path, lease=f.lease, purpose=f"loaders.tfdata {split}")
  source = None
  try:
    output = pin.output
    _check_tfrecord(output)
    kind = output.kind  # here: a manifest without a kind is reported before bad options or a missing split
    if o.window_shards is None:
      check_fits(output, split, f.cache_dir, f.cache_limit_bytes)
    if host_pipeline:
      ds, read = _host_pipeline(output, split, kind, s.example, batch_size, o.shuffle, o.seed, shard_index,
                                shard_count, o.num_epochs, f.cache_dir, shuffle_buffer or SHUFFLE_BUFFER,
                                f.verify), None
    else:
      if o.window_shards is not None:
        order = WindowOrder.of([s.num_records for s in output.shards(split)], o, batch_size, shard_index,
                               shard_count)
      else:
        num_records = sum(s.num_records for s in output.shards(split))  # a missing split: reported before fetching
        order = RecordOrder(num_records, batch_size, seed=o.seed, shuffle=o.shuffle, shard_index=shard_index,
                            shard_count=shard_count, order=o.order)
      convert = _converter(kind, output.features, s.example, o.seed, batch_size, order.first_slot)  # before a fetch
      if o.window_shards is not None:
        source = ShardStream(output, split, order, order.batches_per_epoch * o.num_epochs, cache_dir=f.cache_dir,
                             cache_limit_bytes=f.cache_limit_bytes, verify=f.verify)
      else:
        source = ShardedRecords(output, split, cache_dir=f.cache_dir, verify=f.verify)
      guard = StateGuard(DataIdentity.of(output, split), order.batches_per_epoch,
                         order=o.stamp(batch_size, shard_count))
      read = _RecordBatches(source, order, batch_size, guard)
      ds = _position_batches(read, order.batches_per_epoch * o.num_epochs, convert)
  except BaseException:
    if source is not None:
      source.close()  # a stream's private folder goes now, not when the traceback is dropped
    pin.release()  # nothing will read it: its lease goes now too
    raise
  ds._tpu_shards_pin = pin  # lives as long as the dataset and every dataset made from it (they hold their input)
  ds._tpu_shards_read = read  # the readers (a stream's private folder goes with them); None for the host pipeline
  return ds


def data_state(ds: tf.data.Dataset) -> tf.Variable:
  """What a tf.train.Checkpoint saves beside the iterator so that a restore is checked against the data.

      ds = loaders.tfdata.dataset(path, "train", order="global", global_batch_size=1024, ...)
      it = iter(ds)
      ckpt = tf.train.Checkpoint(iterator=it, data=loaders.tfdata.data_state(ds))
      ckpt.restore(path)   # on other data or order settings: the next batch raises StateMismatchError

  Args:
    ds: a dataset `dataset` returned with order="global" or window_shards (the position pipeline).

  Returns:
    A string tf.Variable holding the data's identity (generation, manifest SHA-256, split) and order
    settings.

  Raises:
    ValueError: `ds` is not such a dataset (tf.data's own host pipeline checkpoints its buffers and names
      no position).
  """
  read = getattr(ds, "_tpu_shards_read", None)
  if read is None:
    raise ValueError("data_state needs the dataset loaders.tfdata.dataset returned (not one tf.data made from it) "
                     "with order='global' or window_shards: tf.data's own host pipeline names no position to check")
  return read.data


def _host_pipeline(output: Output, split: str, kind: str, options: ExampleOptions, batch_size: int, shuffle: bool,
                   seed: int, shard_index: int, shard_count: int, num_epochs: int, cache_dir: str | None,
                   shuffle_buffer: int, verify: Verify) -> tf.data.Dataset:
  """order="host" without windows: tf.data's TFRecordDataset, `shard`, a shuffle buffer, map and batch."""
  num_records = sum(s.num_records for s in output.shards(split))
  per_shard = num_records // shard_count
  check_some_batch(per_shard // batch_size, num_records, per_shard, batch_size, shard_count, global_order=False)
  convert = _converter(kind, output.manifest.features, options, seed, batch_size)  # refusals before a fetch
  paths = _checked_shards(output, split, cache_dir, verify)
  records = _shard_records(paths, per_shard, shard_index, shard_count)
  if shuffle:
    records = records.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
  return _whole_batches(records, convert, per_shard, batch_size, num_epochs)
