"""Records → fixed-shape numpy examples, for every record kind the pipelines write. No framework.

`example_transform(kind, features, options)` picks the transform by the
output's record kind (formats.kinds.kind_of of its manifest): images (decoded
to uint8 [H, W, 3], resized when the shards are not already fixed-size), CT
volumes (fixed-size patches, HU clipped and normalised, padding
formats.transforms.CT_PADDING_HU; a `label` feature cut at the same start,
optionally centred on its foreground by `pos_fraction`), graph-property records (padded to
node/edge budgets, with masks) and generic "tensors" records (every Tensor at
its static shape and dtype, every ClassLabel as int64, Text left out). Each
transform takes (record, rng): randomness (patch positions) comes from the
loader's per-element generator (formats.transforms.element_rng), so a seed
fixes it.

This is the numpy/Pillow implementation of the specification in
formats.transforms; loaders.tfdata implements the same one with TensorFlow
ops, and tests/loaders/test_parity.py proves the two bit-equal.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import io
from typing import Literal

import numpy as np
from PIL import Image as PILImage, ImageOps
import simplejpeg

from formats.errors import CorruptRecordError
from formats.features import ClassLabel, Features, Tensor
from formats.transforms import (CT_PADDING_HU, DEFAULT_HU_WINDOW, LABEL_PADDING, PATCH_MODES,
                                center_patch_start, hu_window_constants, label_layout, label_patch_dtype,
                                sampled_patch_start)


Patch = Literal["random", "center"]  # formats.transforms.PATCH_MODES


@dataclasses.dataclass(frozen=True)
class ExampleOptions:
  """How records become fixed-shape examples ("tensors" records need none of these).

  Attributes:
    image_size: (H, W) for images stored at their own size (required then).
    patch_size: (D, H, W) of CT patches (required for volumes).
    patch: "random" or "center" (placement: formats.transforms.random_patch_start /
      center_patch_start).
    hu_window: the HU range kept (clipped).
    normalize: map the HU window to [0, 1] float32.
    pos_fraction: with patch="random" on volumes with a `label`, the probability that a
      patch is centred on a foreground voxel (formats.transforms.sampled_patch_start);
      None: uniform starts only.
    max_nodes, max_edges: budgets of graph records (required for graphs).

  Raises:
    ValueError: (on construction) an unknown `patch`, a window with low >= high, or a
      pos_fraction outside [0, 1] or with patch="center".
  """

  image_size: tuple[int, int] | None = None
  patch_size: tuple[int, int, int] | None = None
  patch: Patch = "random"
  hu_window: tuple[float, float] = DEFAULT_HU_WINDOW
  normalize: bool = True
  pos_fraction: float | None = None
  max_nodes: int | None = None
  max_edges: int | None = None

  def __post_init__(self) -> None:
    if self.patch not in PATCH_MODES:
      raise ValueError(f"patch must be random or center, got {self.patch!r}")
    if self.hu_window[0] >= self.hu_window[1]:
      raise ValueError(f"hu_window must be (low, high) with low < high, got {self.hu_window}")
    if self.pos_fraction is not None:
      if isinstance(self.pos_fraction, bool) or not 0.0 <= self.pos_fraction <= 1.0:
        raise ValueError(f"pos_fraction must be a probability in [0, 1] or None, got {self.pos_fraction!r}")
      if self.patch != "random":
        raise ValueError(f"pos_fraction={self.pos_fraction} places random patches: it needs patch='random', "
                         f"got patch={self.patch!r}")


def batched_features(features: Features) -> dict[str, Tensor | ClassLabel]:
  """The features a "tensors" record puts in a batch: every Tensor and ClassLabel, in schema order.

  Text is left out (a batch holds arrays of one static shape; strings have
  none); read it with ShardedRecords[i] when needed.

  Args:
    features: the schema of the records.

  Returns:
    name → feature, for the features that are batched.

  Raises:
    ValueError: a Tensor has a None dimension: its size differs between records,
      so it cannot be batched with static shapes.
  """
  out: dict[str, Tensor | ClassLabel] = {}
  for name, f in features.items():
    if isinstance(f, Tensor) and None in f.shape:
      raise ValueError(f"feature {name!r} has shape {f.shape}: a None dimension differs between records, so "
                       f"these records cannot be batched with static shapes (write the feature with a fixed "
                       f"shape, or read records one at a time with loaders.ShardedRecords)")
    if isinstance(f, (Tensor, ClassLabel)):
      out[name] = f
  return out


def _decode_into(out: np.ndarray, data, size: tuple[int, int]) -> None:
  """Decodes an encoded image into `out` (uint8 [H, W, 3] of `size`), as _decode_image would.

  A YCbCr JPEG already of `size` (what the converters store) is decoded by
  simplejpeg straight into `out`: libjpeg-turbo with the settings Pillow uses
  (accurate DCT, fancy upsampling), so the same pixels (by test), without
  Pillow's header parsing in Python or a copy (0.16 against 0.20 ms per
  224x224 image here). Anything else, or a JPEG simplejpeg refuses (it is
  strict about recoverable errors Pillow lets pass), goes through Pillow.
  """
  try:
    h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
  except ValueError:  # not a JPEG, or a header libjpeg refuses: Pillow says what it is
    h = w = colorspace = None
  if (h, w) == tuple(size) and colorspace == "YCbCr":
    try:
      simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=out)
      return
    except ValueError:
      pass
  out[...] = _decode_image(data, size)


def _decode_image(data: bytes, size: tuple[int, int] | None) -> np.ndarray:
  """uint8 [H, W, 3]: decoded (JPEG at jpeg_draft_scale), then fit_box resized with Pillow's BILINEAR."""
  im = PILImage.open(io.BytesIO(data))
  if size is not None and im.format == "JPEG":
    im.draft("RGB", (size[1], size[0]))  # let libjpeg decode at a reduced scale (formats.transforms.jpeg_draft_scale)
  if im.mode != "RGB":
    im = im.convert("RGB")
  if size is not None and im.size != (size[1], size[0]):
    im = ImageOps.fit(im, (size[1], size[0]), method=PILImage.Resampling.BILINEAR)
  return np.asarray(im, dtype=np.uint8)


def check_raw_image_size(spec, o: ExampleOptions) -> None:
  """Refuses an image_size that raw pixels (a Tensor image, never resized) are not stored at.

  Raises:
    ValueError: `o.image_size` differs from the stored [H, W] of raw images.
  """
  if isinstance(spec, Tensor) and o.image_size is not None and tuple(o.image_size) != tuple(spec.shape[:2]):
    raise ValueError(f"image_size={tuple(o.image_size)}: these raw images are stored at {tuple(spec.shape[:2])} and "
                     f"raw pixels are not resized; leave image_size unset or pass the stored size")


def _image_transform(features: Features, o: ExampleOptions) -> Callable:
  spec = features["image"]
  label = "label" if isinstance(features.get("label"), ClassLabel) else None
  size = None  # raw pixels: already uint8 [H, W, 3], possibly a view into the record
  check_raw_image_size(spec, o)
  if not isinstance(spec, Tensor):
    fixed = None if None in spec.shape[:2] else tuple(spec.shape[:2])
    size = o.image_size or fixed
    if size is None:
      raise ValueError("these images have no fixed size: pass image_size=(H, W) for static shapes")

  def image(rec, rng=None):
    out = {"image": rec["image"] if size is None else _decode_image(rec["image"], size)}
    if label:
      out["label"] = np.int64(rec[label])
    return out
  return image


def volume_label(features: Features, o: ExampleOptions) -> str | None:
  """The layout of the volumes' `label` feature (formats.transforms.label_layout), or None when they have none.

  Raises:
    ValueError: a label that is not a CT label, or a pos_fraction without one.
  """
  if "label" in features:
    return label_layout("label", features["label"])
  if o.pos_fraction is not None:
    raise ValueError(f"pos_fraction={o.pos_fraction} centres patches on a label's foreground, and these volume "
                     f"records have no 'label' feature")
  return None


def _cut(array, start: np.ndarray, patch_size: tuple[int, ...], fill, dtype, out: np.ndarray | None = None):
  """The patch of `array` at `start` (its leading axes; the rest kept whole), `fill` past the far end.

  `array` is a numpy array or a formats.record_slices.StoredArray, whose
  `read_into` reads only the box, straight into place. Written into `out`
  when given (of the patch's shape and `dtype`), else into a new array.
  """
  key = tuple(slice(int(s), int(s) + p) for s, p in zip(start, patch_size))
  if out is None:
    out = np.empty((*patch_size, *array.shape[len(patch_size):]), dtype)
  read_into = getattr(array, "read_into", None)
  if read_into is None:
    part = array[key]
    shape = part.shape
    out[tuple(slice(0, n) for n in shape)] = part
  else:
    shape = array.box_shape(key)
    read_into(key, out[tuple(slice(0, n) for n in shape)])
  for axis, n in enumerate(shape[:len(patch_size)]):  # past the far end: axis by axis, each voxel once
    if n < patch_size[axis]:
      out[(*(slice(0, m) for m in shape[:axis]), slice(n, None))] = fill
  return out


def volume_patcher(features: Features, o: ExampleOptions) -> Callable:
  """patch(volume, label, spacing, rng, counts=None, out=None) → the CT example (volume, spacing, patch_start[,
  label]).

  The CT transform's core: `volume` and `label` are numpy arrays or objects
  indexed like them (shape, step-1 slices, planes: a
  formats.record_slices.StoredArray); `label` is None for records without
  one. `counts()`, when given, is the label's foreground_counts (kept per
  record by the reader) for sampled_patch_start. `out`, when given,
  holds an array per key of the example's shape and dtype (a batch's slot),
  written in place and returned; `patch.shapes` gives them.

  Raises:
    ValueError: (on construction) no patch_size, or the label or pos_fraction `volume_label` refuses.
  """
  if o.patch_size is None:
    raise ValueError("CT volumes differ in size: pass patch_size=(D, H, W) for static shapes")
  lo, hi, span = hu_window_constants(o.hu_window)
  layout = volume_label(features, o)
  label_dtype = label_patch_dtype(layout, features["label"].dtype) if layout else None
  patch_size = tuple(o.patch_size)

  def patch(vol, label, spacing, rng=None, counts: Callable[[], np.ndarray] | None = None,
            out: dict | None = None) -> dict:
    if label is not None and tuple(label.shape[:3]) != tuple(vol.shape):
      raise CorruptRecordError(f"feature 'label' has shape {tuple(label.shape)}, its volume {tuple(vol.shape)}: "
                               f"they must share [D, H, W]")
    if o.patch == "random":
      rng = rng or np.random.default_rng(0)
      start = sampled_patch_start(vol.shape, patch_size, rng, o.pos_fraction, label, counts)
    else:
      start = center_patch_start(vol.shape, patch_size)
    spacing = np.asarray(spacing, np.float32)
    if out is None:
      out = {"volume": None, "spacing": spacing, "patch_start": start.astype(np.int64)}
    else:
      out["spacing"][...] = spacing
      out["patch_start"][...] = start
    volume = _cut(vol, start, patch_size, CT_PADDING_HU, np.float32, out["volume"])
    np.clip(volume, lo, hi, out=volume)
    if o.normalize:  # (x - low) / span in float32, in place
      np.subtract(volume, lo, out=volume)
      np.divide(volume, span, out=volume)
    out["volume"] = volume
    if label is not None:
      out["label"] = _cut(label, start, patch_size, LABEL_PADDING, label_dtype, out.get("label"))
    return out

  def shapes() -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The example's keys in order → (shape, dtype) (a channels label's C from the schema)."""
    keys = {"volume": (patch_size, np.dtype(np.float32)), "spacing": (tuple(features["spacing"].shape),
                                                                      np.dtype(np.float32)),
            "patch_start": ((len(patch_size),), np.dtype(np.int64))}
    if layout:
      keys["label"] = ((*patch_size, *features["label"].shape[3:]), np.dtype(label_dtype))
    return keys
  patch.layout, patch.shapes = layout, shapes
  return patch


def _volume_transform(features: Features, o: ExampleOptions) -> Callable:
  patch = volume_patcher(features, o)

  def crop(rec, rng=None):
    return patch(rec["volume"], rec["label"] if patch.layout else None, rec["spacing"], rng)
  return crop


def graph_size(num_nodes, edge_index: np.ndarray, o: ExampleOptions) -> tuple[int, int]:
  """(nodes, edges) of a graph record; ValueError when it exceeds the budgets (max_nodes, max_edges)."""
  n, e = int(num_nodes), edge_index.shape[1]
  if n > o.max_nodes or e > o.max_edges:
    raise ValueError(f"a graph with {n} nodes and {e} edges exceeds max_nodes={o.max_nodes}, "
                     f"max_edges={o.max_edges}")
  return n, e


def _graph_transform(features: Features, o: ExampleOptions) -> Callable:
  if o.max_nodes is None or o.max_edges is None:
    raise ValueError("graph records differ in size: pass max_nodes and max_edges for static shapes")

  def pad(rec, rng=None):
    ei = rec["edge_index"]
    n, e = graph_size(rec["num_nodes"], ei, o)
    out = {"num_nodes": np.int64(n), "label": np.asarray(rec["label"])}
    edge_index = np.zeros((2, o.max_edges), np.int64)
    edge_index[:, :e] = ei
    out["edge_index"], out["edge_mask"] = edge_index, np.arange(o.max_edges) < e
    out["node_mask"] = np.arange(o.max_nodes) < n
    for key, budget in (("node_feat", o.max_nodes), ("edge_feat", o.max_edges)):
      if key in rec:
        v = rec[key]
        padded = np.zeros((budget, *v.shape[1:]), v.dtype)
        padded[:len(v)] = v
        out[key] = padded
    return out
  return pad


def _tensors_transform(features: Features, o: ExampleOptions) -> Callable:
  batched = batched_features(features)
  labels = [name for name, f in batched.items() if isinstance(f, ClassLabel)]

  def select(rec, rng=None):
    out = {name: rec[name] for name in batched}  # Tensors: already their static shape and dtype
    for name in labels:
      out[name] = np.int64(rec[name])
    return out
  return select


_TRANSFORMS = {"image": _image_transform, "volume": _volume_transform, "graph": _graph_transform,
               "tensors": _tensors_transform}
# the ExampleOptions fields each record kind reads
_READS = {"image": ("image_size",), "volume": ("patch_size", "patch", "hu_window", "normalize", "pos_fraction"),
          "graph": ("max_nodes", "max_edges"), "tensors": ()}


def check_options_read(kind: str, options: ExampleOptions) -> None:
  """Refuses an example option set away from its default that records of `kind` never read.

  Raises:
    ValueError: such an option (patch_size for images, image_size for volumes, ...).
  """
  unread = [f"{f.name}={getattr(options, f.name)!r}" for f in dataclasses.fields(options)
            if f.name not in _READS.get(kind, ()) and getattr(options, f.name) != f.default]
  if unread:
    read = ", ".join(_READS[kind]) or "none"
    raise ValueError(f"{', '.join(unread)}: not read for {kind} records (they read {read}); leave it unset")


def example_transform(kind: str, features: Features, options: ExampleOptions) -> Callable:
  """The function that turns one record of `kind` into a dict of fixed-shape numpy arrays.

  Args:
    kind: the output's record kind (formats.kinds.kind_of(manifest)).
    features: the records' schema.
    options: sizes and windows the kind needs (image_size, patch_size, max_nodes, ...).

  Returns:
    transform(record, rng=None) → dict of arrays (`record_index` kept when the
    record has it); its `needs_rng` attribute says whether it draws from `rng`,
    its `kind` and `options` what it was made for (loaders._batch.BatchFiller
    applies the same transform in place).

  Raises:
    ValueError: no transform reads records of `kind`, or the schema needs an
      option that is missing (image_size for images of their own size,
      patch_size for volumes, max_nodes/max_edges for graphs), or a "tensors"
      feature has no static shape.
  """
  if kind not in _TRANSFORMS:
    raise ValueError(f"no loader transform for records of kind {kind!r} (the loaders read "
                     f"{sorted(_TRANSFORMS)}; a 'graphbin' output is read with loaders.graph.load)")
  check_options_read(kind, options)
  inner = _TRANSFORMS[kind](features, options)

  def transform(rec, rng=None):
    out = inner(rec, rng)
    if "record_index" in rec:
      out["record_index"] = np.int64(rec["record_index"])
    return out
  transform.needs_rng = kind == "volume" and options.patch == "random"  # only random patches draw
  transform.kind, transform.options = kind, options
  return transform


def fill_batch(examples, batch_size: int, with_mask: bool) -> dict:
  """Copies examples once into [batch_size, ...] arrays.

  Args:
    examples: an iterable of at most `batch_size` dicts with the same keys, shapes and dtypes.
    batch_size: the batch's first dimension.
    with_mask: add `mask`, True for the real examples.

  Returns:
    key → array [batch_size, ...]; missing trailing examples are zero padding.
  """
  out: dict[str, np.ndarray] = {}
  n = 0
  for i, ex in enumerate(examples):
    if not out:
      out = {k: np.zeros((batch_size, *np.shape(v)), np.asarray(v).dtype) for k, v in ex.items()}
    for k, v in ex.items():
      out[k][i] = v
    n = i + 1
  if with_mask:
    out["mask"] = np.arange(batch_size) < n
  return out
