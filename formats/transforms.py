"""The record transforms that writers and every reader share, defined once. No framework (numpy only).

The CT values here are part of the on-disk contract (the "volume" kind of
formats.kinds defines them): the converter writes
`CT_PADDING_HU` where a slice has no data (PixelPaddingValue), and every loader
pads patches that reach outside a volume with the same value.

The rest is the specification of the fixed-shape transforms the loaders apply
(loaders._transforms with numpy/Pillow for grain and torch_xla,
loaders.tfdata with TensorFlow ops); tests/loaders/test_parity.py proves the
implementations bit-equal:

- **CT patches.** A patch of `patch_size` (D, H, W) starts at
  `center_patch_start` (`max(shape - patch, 0) // 2`) or at
  `random_patch_start`, drawn from `element_rng(seed, position, slot)`: the
  generator of the batch at `position` (counted over all epochs) and the
  example's `slot` in it, so a seed fixes every patch. Voxels past the volume's
  far end are `CT_PADDING_HU`. Then float32 values are clipped to the HU window
  and, with normalisation, mapped to [0, 1] as `(x - low) / (high - low)` with
  the float32 constants of `hu_window_constants`.
- **CT labels.** A volume record with a `label` feature (`label_layout`:
  "classes", [D, H, W] uint8 or uint16 class ids, 0 background; or
  "channels", [D, H, W, C] uint8 0/1, channel c - 1 is class c) is cut at the
  SAME start as its volume, padded at the far end with `LABEL_PADDING`
  (background) and given the dtype `label_patch_dtype` says (uint8 class ids
  as stored, int32 for uint16 ones, uint8 channels), shape patch_size (+ (C,)). `patch="random"` with a
  `pos_fraction` p draws its start with `sampled_patch_start`: the uniform
  start first (the draws of `random_patch_start`, so p=0 is exactly the plain
  draw), then with probability p a foreground voxel (label != 0, any channel)
  uniformly, as the centre, `centred_patch_start` (MONAI's
  RandCropByPosNegLabeld with pos / (pos + neg) = p); a label without
  foreground keeps the uniform start.
- **Images stored at their own size** become uint8 [H, W, 3] as Pillow does it:
  a JPEG is decoded with libjpeg's accurate integer DCT (TensorFlow's
  `dct_method="INTEGER_ACCURATE"`), at the reduced scale `jpeg_draft_scale`
  picks (Pillow's `draft`); then, unless it already has the size, the centre
  region of the target aspect ratio (`fit_box`, crop first) is resized with
  Pillow's BILINEAR filter (`bilinear_taps`: its support, rounding and 22-bit
  fixed-point arithmetic), horizontally then vertically, each pass rounded to
  uint8.
"""

from __future__ import annotations

from collections.abc import Callable
import math

import numpy as np

from formats.features import Tensor
from formats.kinds import CT_PADDING_HU  # noqa: F401  (the "volume" kind's padding, re-exported here)

# The HU range a loader keeps by default (clipped): the padding value up to the 12-bit maximum.
DEFAULT_HU_WINDOW = (-1024.0, 3071.0)
# Where a CT patch is placed.
PATCH_MODES = ("random", "center")
# How a CT label is laid out (by its rank, `label_layout`) and the stored dtypes each layout allows.
LABEL_LAYOUTS = {"classes": ("uint8", "uint16"), "channels": ("uint8",)}


def label_patch_dtype(layout: str, stored: str) -> str:
  """The dtype of a label patch, the same in every loader: uint8 class ids and channels as stored (a patch
  costs a quarter of the float32 volume patch's bytes), uint16 class ids as int32 (torch and XLA have no
  full uint16).

  Args:
    layout: "classes" or "channels" (`label_layout`).
    stored: the label's stored dtype (uint8 or uint16).

  Returns:
    "uint8" or "int32".
  """
  return "uint8" if layout == "channels" or stored == "uint8" else "int32"

# What a label patch holds past the volume's far end: background.
LABEL_PADDING = 0
# libjpeg's DCT that Pillow uses (JDCT_ISLOW), by TensorFlow's name for it.
JPEG_DCT_METHOD = "INTEGER_ACCURATE"
# The reduced scales libjpeg decodes at (1/s), the largest first.
JPEG_DRAFT_SCALES = (8, 4, 2, 1)
# Fixed-point bits of Pillow's 8-bit resampling coefficients (32 - 8 - 2).
RESAMPLE_PRECISION_BITS = 22


def center_patch_start(shape, patch_size) -> np.ndarray:
  """Start (int64 per axis) of the centred patch: max(shape - patch, 0) // 2 (the patch then pads at the far end).

  Args:
    shape: the volume's shape (D, H, W).
    patch_size: the patch's shape.

  Returns:
    The start per axis.
  """
  return np.maximum(np.asarray(shape, np.int64) - np.asarray(patch_size, np.int64), 0) // 2


def element_rng(seed: int, position: int, slot: int) -> np.random.Generator:
  """The generator of one example: batch `position` (over all epochs) and `slot` in that batch.

  Args:
    seed: the loader's seed.
    position: the batch's position, counted over all epochs.
    slot: the example's place in the batch.

  Returns:
    A generator determined by the three.
  """
  return np.random.default_rng([seed, position, slot])


def random_patch_start(shape, patch_size, rng: np.random.Generator) -> np.ndarray:
  """A uniformly drawn start (int64 per axis, first axis drawn first) in [0, max(shape - patch, 0)].

  Args:
    shape, patch_size: as `center_patch_start` takes them.
    rng: the example's generator (`element_rng`).

  Returns:
    The start per axis.
  """
  room = np.maximum(np.asarray(shape, np.int64) - np.asarray(patch_size, np.int64), 0)
  return np.array([rng.integers(0, r + 1) for r in room], np.int64)


def label_layout(name: str, spec) -> str:
  """The layout of a CT label feature: "classes" ([D, H, W]) or "channels" ([D, H, W, C], C static).

  Args:
    name: the feature's name (for the message).
    spec: its formats.features.Tensor.

  Returns:
    "classes" or "channels".

  Raises:
    ValueError: not a Tensor of rank 3 or 4, a dtype the layout does not allow, or channels of unknown count.
  """
  layout = {3: "classes", 4: "channels"}.get(len(spec.shape)) if isinstance(spec, Tensor) else None
  if layout is None:
    raise ValueError(f"feature {name!r} of a volume record must be a Tensor [D, H, W] of class ids or "
                     f"[D, H, W, C] of channels, got {spec!r}")
  if spec.dtype not in LABEL_LAYOUTS[layout]:
    raise ValueError(f"feature {name!r}: a {layout} label is {' or '.join(LABEL_LAYOUTS[layout])}, got {spec.dtype}")
  if layout == "channels" and spec.shape[3] is None:
    raise ValueError(f"feature {name!r}: a channels label needs its channel count in the schema "
                     f"(shape {spec.shape}) for static shapes")
  return layout


def centred_patch_start(centre, shape, patch_size) -> np.ndarray:
  """Start (int64 per axis) of the patch centred on voxel `centre`: clip(centre - patch // 2, 0, max(shape - patch, 0)).

  The patch always holds `centre` (it is clipped into the volume, or starts at 0 when the volume is smaller).

  Args:
    centre: a voxel index per axis.
    shape, patch_size: as `center_patch_start` takes them.

  Returns:
    The start per axis.
  """
  patch = np.asarray(patch_size, np.int64)
  room = np.maximum(np.asarray(shape, np.int64) - patch, 0)
  return np.clip(np.asarray(centre, np.int64) - patch // 2, 0, room)


def _foreground(plane: np.ndarray) -> np.ndarray:
  """A slice whose non-zero voxels are its foreground: the class ids ([H, W]), or the OR of the channels
  ([H, W, C]; one pass per channel, 8x faster than `any(axis=-1)` over a short last axis)."""
  if plane.ndim == 2:
    return plane
  acc = plane[..., 0].copy()
  for c in range(1, plane.shape[-1]):
    np.bitwise_or(acc, plane[..., c], out=acc)
  return acc


def foreground_counts(label: np.ndarray) -> np.ndarray:
  """Foreground voxels (label != 0, any channel) per slice along the first axis, int64 [D].

  One pass over the label, a slice at a time: no array of the label's size is
  made (on one core: 0.01 s for a 512^3 uint8 label of class ids, 0.15 s for
  256 x 512 x 512 x 4 channels).

  Args:
    label: [D, H, W] class ids or [D, H, W, C] channels.

  Returns:
    The count per slice.
  """
  return np.fromiter((np.count_nonzero(_foreground(plane)) for plane in label), np.int64, len(label))


def foreground_voxel(label: np.ndarray, counts: np.ndarray, k: int) -> np.ndarray:
  """The k-th foreground voxel (int64 (z, y, x)) in C order, found through `foreground_counts`.

  Args:
    label: [D, H, W] class ids or [D, H, W, C] channels.
    counts: foreground_counts(label).
    k: in [0, counts.sum()).

  Returns:
    The voxel's index per axis.
  """
  ends = np.cumsum(counts)
  z = int(np.searchsorted(ends, k, side="right"))
  within = k - (int(ends[z]) - int(counts[z]))
  flat = int(np.flatnonzero(_foreground(label[z]))[within])
  return np.array([z, *divmod(flat, label.shape[2])], np.int64)


def sampled_patch_start(shape, patch_size, rng: np.random.Generator, pos_fraction: float | None,
                        label: np.ndarray | None, counts: Callable[[], np.ndarray] | None = None) -> np.ndarray:
  """The start of a random patch, centred on a foreground voxel with probability `pos_fraction`.

  Draws, in order: the uniform start (`random_patch_start`); with a
  pos_fraction, u = rng.random(); when u < pos_fraction and the label has
  foreground, k = rng.integers(0, foreground voxels), and the start is
  `centred_patch_start` of the k-th foreground voxel (`foreground_voxel`).
  pos_fraction=None is `random_patch_start` itself; pos_fraction=0 gives the
  same starts. The label is scanned (`foreground_counts`) only for a positive draw.

  Args:
    shape, patch_size, rng: as `random_patch_start` takes them.
    pos_fraction: the probability of a foreground centre, in [0, 1]; None: uniform only.
    label: the record's label (its first three axes are `shape`); needed with a pos_fraction.
    counts: returns `foreground_counts(label)` (a reader that keeps them per record); None: scanned here.

  Returns:
    The start per axis.
  """
  start = random_patch_start(shape, patch_size, rng)
  if pos_fraction is None or not rng.random() < pos_fraction:
    return start
  per_slice = foreground_counts(label) if counts is None else counts()
  total = int(per_slice.sum())
  if total == 0:
    return start
  return centred_patch_start(foreground_voxel(label, per_slice, int(rng.integers(0, total))), shape, patch_size)


def seeded_patch_start(shape, patch_size, seed: int, position: int, slot: int, pos_fraction: float | None = None,
                       label: np.ndarray | None = None) -> np.ndarray:
  """`sampled_patch_start` with `element_rng(seed, position, slot)`: what every loader draws.

  Args:
    shape, patch_size: as `random_patch_start` takes them.
    seed, position, slot: as `element_rng` takes them.
    pos_fraction, label: as `sampled_patch_start` takes them (None: the uniform start).

  Returns:
    The start per axis.
  """
  return sampled_patch_start(shape, patch_size, element_rng(seed, position, slot), pos_fraction, label)


def hu_window_constants(hu_window: tuple[float, float]) -> tuple[np.float32, np.float32, np.float32]:
  """(low, high, high - low) as the float32 values clipping and normalisation use.

  The span is subtracted in float64 and rounded once: normalised = (clip(x) - low) / span, float32.

  Args:
    hu_window: (low, high) in HU.

  Returns:
    (low, high, span) as float32.
  """
  lo, hi = hu_window
  return np.float32(lo), np.float32(hi), np.float32(hi - lo)


def jpeg_draft_scale(height: int, width: int, size: tuple[int, int]) -> int:
  """The reduced scale (8, 4, 2 or 1) a JPEG of height x width is decoded at for a target (H, W).

  Pillow's `draft`: the largest scale s with s <= min(width // W, height // H),
  1 for an image smaller than the target; the decoded image is
  ceil(width / s) x ceil(height / s), never below the target.

  Args:
    height, width: the JPEG's size, from its header.
    size: the target (H, W).

  Returns:
    The scale s: the image is decoded at 1/s of its size.
  """
  scale = min(width // size[1], height // size[0])
  return next((s for s in JPEG_DRAFT_SCALES if scale >= s), 1)


def fit_box(height: int, width: int, size: tuple[int, int]) -> tuple[float, float, float, float]:
  """(left, top, right, bottom) of the centred region with the aspect ratio of `size` (H, W); Pillow's ImageOps.fit.

  Args:
    height, width: the image's size.
    size: the target (H, W).

  Returns:
    The crop box in input pixels (floats).
  """
  image_ratio, output_ratio = width / height, size[1] / size[0]
  if image_ratio == output_ratio:
    crop_w, crop_h = float(width), float(height)
  elif image_ratio >= output_ratio:
    crop_w, crop_h = output_ratio * height, float(height)
  else:
    crop_w, crop_h = float(width), width / output_ratio
  left, top = (width - crop_w) * 0.5, (height - crop_h) * 0.5
  return left, top, left + crop_w, top + crop_h


def bilinear_taps(in_size: int, box0: float, box1: float, out_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Pillow's BILINEAR taps along one axis for `out_size` outputs from [box0, box1) of `in_size` inputs.

  Returns (first, weights): int32 [out] first input index and int32 [out, k]
  fixed-point weights (2**22 is 1.0; zero past each output's last input, whose
  indices are first + j clamped to in_size - 1). An output is
  clip((2**21 + sum_j pixel[first + j] * weights[j]) >> 22, 0, 255).
  The box is float32 and the filter is widened by the scale when shrinking
  (antialiasing), as in Pillow's Resample.c.

  Args:
    in_size: input pixels along the axis.
    box0: where the region starts (input pixels).
    box1: where it ends.
    out_size: output pixels along the axis.

  Returns:
    (first, weights) as described above.
  """
  b0, b1 = np.float32(box0), np.float32(box1)
  scale = float(np.float32(b1 - b0)) / out_size
  filterscale = max(scale, 1.0)
  support, ss = 1.0 * filterscale, 1.0 / filterscale
  k = int(math.ceil(support)) * 2 + 1
  first = np.zeros(out_size, np.int32)
  weights = np.zeros((out_size, k), np.int32)
  one = 1 << RESAMPLE_PRECISION_BITS
  for xx in range(out_size):
    center = float(b0) + (xx + 0.5) * scale
    xmin = max(int(center - support + 0.5), 0)
    xmax = min(int(center + support + 0.5), in_size) - xmin
    w = [max(0.0, 1.0 - abs((x + xmin - center + 0.5) * ss)) for x in range(xmax)]
    total = 0.0
    for v in w:  # summed in order, as Pillow does
      total += v
    if total != 0.0:
      w = [v / total for v in w]
    first[xx] = xmin
    weights[xx, :xmax] = [int(-0.5 + v * one) if v < 0 else int(0.5 + v * one) for v in w]
  return first, weights


def resize_plan(height: int, width: int, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(row_first, row_weights, col_first, col_weights): the taps of resizing `fit_box` of an image to `size`.

  Args:
    height, width, size: as `fit_box` takes them.

  Returns:
    The row taps and the column taps (`bilinear_taps`).
  """
  left, top, right, bottom = fit_box(height, width, size)
  rows = bilinear_taps(height, top, bottom, size[0])
  cols = bilinear_taps(width, left, right, size[1])
  return (*rows, *cols)


def apply_taps(pixels: np.ndarray, first: np.ndarray, weights: np.ndarray, axis: int) -> np.ndarray:
  """One resampling pass of `bilinear_taps` over uint8 `pixels` along `axis`, rounded to uint8 (a reference).

  Args:
    pixels: uint8 pixels.
    first: the taps' first input index per output (`bilinear_taps`).
    weights: the taps' fixed-point weights.
    axis: the axis resampled.

  Returns:
    The resampled uint8 pixels.
  """
  n = pixels.shape[axis]
  idx = np.minimum(first[:, None] + np.arange(weights.shape[1]), n - 1)
  taken = np.take(pixels.astype(np.int64), idx, axis=axis)  # axis becomes [out, k]
  w = weights.astype(np.int64).reshape((1,) * axis + weights.shape + (1,) * (pixels.ndim - axis - 1))
  acc = (taken * w).sum(axis=axis + 1) + (1 << (RESAMPLE_PRECISION_BITS - 1))
  return np.clip(acc >> RESAMPLE_PRECISION_BITS, 0, 255).astype(np.uint8)
