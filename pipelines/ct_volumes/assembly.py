"""CT series → geometry plan → Hounsfield volume. Pure functions, no Beam.

`plan_volumes` turns the headers of one candidate series into volume plans
(sorted slices and geometry) or per-file rejections; it never touches pixels.
`read_volume` then decodes the planned slices into one [depth, rows, columns]
HU array. The rules (see docs/ct_volumes.md):

- stacks: a series whose positions repeat is split by acquisition / temporal
  position (contrast phases) when that separates the repeats;
- geometries: the slices of one series are grouped by geometry (frame of reference,
  orientation, size, spacing: `SliceHeader.series_key`); when two groups make volumes,
  each volume's stack label starts with `geometry=<k>` (k in key order), so no two
  volumes of a series share a record key;
- order: by position along the slice normal, normal = row × column cosines,
  position = normal · ImagePositionPatient; InstanceNumber only when no slice
  has a position (and SpacingBetweenSlices gives the spacing), flagged: the
  InstanceNumbers must then be consecutive, and the origin and slice direction
  are NaN (nothing says which way the stack runs);
- z spacing from the sorted positions, never SliceThickness; gaps that differ
  from the mean by more than `tolerance` reject the series (missing slice or
  irregular spacing), so does a stack that is not along its normal (gantry tilt)
  and one whose slice positions leave the line through the first and last of them
  by more than MAX_SHIFT_PIXELS of a pixel (a slice shifted in plane);
- duplicates (same position): identical HU (stored values, rescale and padding
  together) → dropped; different → rejected;
- HU = stored × slope + intercept per slice, stored values masked to BitsStored,
  PixelPaddingValue (range) on stored values → CT_PADDING_HU (-1024); big-endian
  stored values are byte-swapped to native order first;
- bounded work: a volume of more than `max_volume_voxels` is rejected when
  planned, and `read_volume` checks that every file holds the pixel data its
  header promises before it allocates anything;
- reasons never quote a header value, nor does an exception from pydicom (its
  type name only), and pydicom is kept quiet while it decodes (`quiet_pydicom`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
import dataclasses
import math
from typing import BinaryIO

import numpy as np

from formats.transforms import CT_PADDING_HU
from pipelines.ct_volumes.headers import (
    MAX_HEADER_BYTES, ORIENTATION_DECIMALS, SIZE_TAGS, SPACING_DECIMALS, SliceRejected, SliceHeader, quiet_pydicom,
    read_dataset, tag_name)

DUPLICATE_MM = 0.01  # positions closer than this along the normal are the same position
MAX_TILT_DEGREES = 0.1
MAX_SHIFT_PIXELS = 0.25  # a slice this far (in pixels) off the stack's line is shifted in plane
DEFAULT_TOLERANCE = 0.01
# Largest volume, in voxels: 512 Mi voxels are 1 GiB as int16 and 2 GiB as float32, which
# still fits one record (a protobuf message is at most 2 GiB); a 512 x 512 x 2000 CT
# (500 Mi voxels) passes. read_volume needs this plus one decoded file of memory.
MAX_VOLUME_VOXELS = 512 << 20
_SHORT = f"{tag_name('PixelData')} holds fewer bytes than {SIZE_TAGS} require"


class SeriesRejected(Exception):
  """The whole stack is rejected; str(e) is the reason, `culprit` the file at fault if one is."""

  def __init__(self, reason: str, culprit: str | None = None, culprit_reason: str | None = None):
    super().__init__(reason)
    self.culprit = culprit
    self.culprit_reason = culprit_reason


@dataclasses.dataclass(frozen=True)
class VolumePlan:
  """One volume of a series: its slices in volume order and its geometry, before any pixel is read."""

  series_id: str
  patient_id: str
  stack: str  # "" or the acquisition/temporal label that separated it
  slices: tuple[SliceHeader, ...]  # in volume order
  duplicates: tuple[tuple[int, SliceHeader], ...]  # (index in slices it duplicates, the copy)
  spacing: tuple[float, float, float]  # (z, y, x) mm
  origin: tuple[float, float, float]  # LPS mm of voxel [0, 0, 0]
  direction: tuple[float, ...]  # 3x3 row-major; columns: row cosines, column cosines, slice direction
  sorted_by: str  # "position" or "instance_number"
  # The label sources matched to this volume (`labels.LabelHeader`s), when the run converts labels.
  labels: tuple = ()

  @property
  def key(self) -> str:
    """The volume's record key: the series id, with its stack label when the series was split."""
    return f"{self.series_id}/{self.stack}" if self.stack else self.series_id

  @property
  def files(self) -> list[str]:
    """The paths the volume reads (duplicates included), sorted, each once."""
    return sorted({s.path for s in self.slices} | {d.path for _, d in self.duplicates})

  @property
  def integral_rescale(self) -> bool:
    """True when every slice's slope and intercept are whole numbers (HU fit int16 exactly)."""
    return all(float(s.slope).is_integer() and float(s.intercept).is_integer() for s in self.slices)


def _normal(orientation: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  row, col = np.asarray(orientation[:3], float), np.asarray(orientation[3:], float)
  if abs(np.linalg.norm(row) - 1) > 1e-3 or abs(np.linalg.norm(col) - 1) > 1e-3 or abs(row @ col) > 1e-3:
    raise SeriesRejected("invalid ImageOrientationPatient (cosines not orthonormal)")
  normal = np.cross(row, col)
  return row, col, normal / np.linalg.norm(normal)


def _stacks(slices: Sequence[SliceHeader]) -> dict[str, list[SliceHeader]]:
  """Splits by acquisition label when that removes repeated positions (contrast phases)."""
  def repeats(group):
    positions = [tuple(np.round(s.position, 2)) for s in group if s.position is not None]
    return len(positions) - len(set(positions))

  total = repeats(slices)
  if total == 0:
    return {"": list(slices)}
  by_label: dict[str, list[SliceHeader]] = collections.defaultdict(list)
  for s in slices:
    by_label[s.acquisition].append(s)
  if len(by_label) > 1 and sum(repeats(g) for g in by_label.values()) < total:
    return dict(by_label)
  return {"": list(slices)}


def _plan_stack(slices: list[SliceHeader], stack: str, tolerance: float) -> VolumePlan:
  first = slices[0]
  if len({s.patient_id for s in slices}) > 1:
    raise SeriesRejected("one series holds several patients")
  row, col, normal = _normal(first.orientation)
  if all(s.position is None for s in slices):
    return _plan_by_instance_number(slices, stack, row, col, normal)
  d = np.array([normal @ np.asarray(s.position) for s in slices])
  order = sorted(range(len(slices)), key=lambda i: (d[i], slices[i].instance_number or 0, slices[i].path,
                                                    slices[i].frame or 0))
  kept: list[int] = []
  duplicates: list[tuple[int, SliceHeader]] = []
  for i in order:
    if kept and abs(d[i] - d[kept[-1]]) < DUPLICATE_MM:
      duplicates.append((len(kept) - 1, slices[i]))
    else:
      kept.append(i)
  if len(kept) < 2:
    raise SeriesRejected(f"single slice: {len(slices)} file(s) at one position, not a volume")
  z = d[kept]
  gaps = np.diff(z)
  mean = (z[-1] - z[0]) / (len(kept) - 1)
  median = float(np.median(gaps))
  if np.max(np.abs(gaps - mean)) > tolerance * mean:
    ratios = gaps / median
    whole = np.round(ratios)
    if np.all(np.abs(ratios - whole) <= tolerance * whole) and whole.max() >= 2:
      missing = int((whole - 1).sum())
      at = int(np.argmax(whole))
      raise SeriesRejected(
          f"missing slice(s): {missing} missing, e.g. a gap of {gaps[at]:.3f} mm after position "
          f"{z[at]:.3f} mm where the spacing is {median:.3f} mm")
    raise SeriesRejected(
        f"irregular slice spacing: gaps from {gaps.min():.3f} to {gaps.max():.3f} mm (tolerance {tolerance:.0%})")
  p0, p1 = np.asarray(slices[kept[0]].position), np.asarray(slices[kept[-1]].position)
  v = p1 - p0
  along = float(v @ normal)
  perp = float(np.linalg.norm(v - along * normal))
  tilt = math.degrees(math.atan2(perp, abs(along)))
  if tilt > MAX_TILT_DEGREES:
    raise SeriesRejected(f"gantry tilt: the stack runs {tilt:.2f} degrees off the slice normal")
  sy, sx = first.pixel_spacing
  w = np.array([slices[i].position for i in kept], float) - p0
  u = v / np.linalg.norm(v)
  off = np.linalg.norm(w - np.outer(w @ u, u), axis=1)
  if off.max() > MAX_SHIFT_PIXELS * min(sy, sx):
    at = int(np.argmax(off))
    raise SeriesRejected(
        f"in-plane shift: the slice at position {z[at]:.3f} mm lies {off[at]:.3f} mm off the line through the "
        f"first and last slice positions")
  direction = np.stack([row, col, normal], axis=1)
  return VolumePlan(
      series_id=first.series_id, patient_id=first.patient_id, stack=stack,
      slices=tuple(slices[i] for i in kept), duplicates=tuple(duplicates),
      spacing=(float(mean), float(sy), float(sx)), origin=tuple(float(x) for x in p0),
      direction=tuple(float(x) for x in direction.ravel()), sorted_by="position")


def _plan_by_instance_number(slices, stack, row, col, normal) -> VolumePlan:
  numbers = [s.instance_number for s in slices]
  if None in numbers or len(set(numbers)) != len(numbers):
    raise SeriesRejected("missing mandatory tag ImagePositionPatient (and no unique InstanceNumbers)")
  spacing = {s.spacing_between_slices for s in slices}
  if len(spacing) != 1 or None in spacing or not spacing.pop():
    raise SeriesRejected("missing mandatory tag ImagePositionPatient (and no SpacingBetweenSlices)")
  ordered = sorted(slices, key=lambda s: s.instance_number)
  missing = ordered[-1].instance_number - ordered[0].instance_number + 1 - len(ordered)
  if missing:
    raise SeriesRejected(f"missing slice(s): {missing} missing, the {tag_name('InstanceNumber')}s of a series "
                         f"without {tag_name('ImagePositionPatient')} are not consecutive")
  if len(ordered) < 2:
    raise SeriesRejected("single slice: 1 file without a position, not a volume")
  dz = abs(ordered[0].spacing_between_slices)
  sy, sx = ordered[0].pixel_spacing
  # Which way the stack runs along the normal is unknown without positions: NaN, not a guess.
  direction = np.stack([row, col, np.full(3, math.nan)], axis=1)
  return VolumePlan(
      series_id=ordered[0].series_id, patient_id=ordered[0].patient_id, stack=stack,
      slices=tuple(ordered), duplicates=(), spacing=(dz, sy, sx), origin=(math.nan,) * 3,
      direction=tuple(float(x) for x in direction.ravel()), sorted_by="instance_number")


def frames_per_file(slices: Sequence[SliceHeader]) -> dict[str, int]:
  """{path: how many of `slices` come from it} (1 per classic file, frames for Enhanced CT).

  Args:
    slices: slice headers, from one or more files.

  Returns:
    The count of slices per file path.
  """
  return dict(collections.Counter(s.path for s in slices))


def _check_volume_size(plan: VolumePlan, max_volume_voxels: int) -> None:
  first = plan.slices[0]
  if len(plan.slices) * first.rows * first.columns > max_volume_voxels:
    raise SeriesRejected(
        f"volume over the size limit: {tag_name('Rows')} x {tag_name('Columns')} x the number of slices "
        f"exceeds {max_volume_voxels} voxels")


def stack_count(slices: Sequence[SliceHeader]) -> int:
  """How many volumes (stacks) `plan_volumes` makes or rejects from one candidate series: what a label
  that names no instance must know to be given to the only one.

  Args:
    slices: the slice headers of one candidate series.

  Returns:
    The number of stacks.
  """
  count = 0
  for members in _geometries(slices).values():
    with_pos = [s for s in members if s.position is not None]
    count += len(_stacks(with_pos if with_pos and len(with_pos) < len(members) else members))
  return count


def _geometries(slices: Sequence[SliceHeader]) -> dict[str, list[SliceHeader]]:
  """{series_key: its slices}, in key order: the groups of one series that differ in geometry.

  Keys of geometries that differ by no more than the precision the key rounds to are one group (the first
  key's): header jitter across a rounding boundary (an orientation cosine 0.99995 beside 0.99994) must not
  split one stack into two partial volumes, each evenly spaced and so never rejected.
  """
  groups: dict[str, list[SliceHeader]] = collections.defaultdict(list)
  for s in slices:
    groups[s.series_key].append(s)
  keys = sorted(groups)
  into = {k: k for k in keys}  # each key -> the first key of its group (union-find over close geometries)

  def root(k: str) -> str:
    while into[k] != k:
      k = into[k]
    return k

  for i, a in enumerate(keys):
    for b in keys[i + 1:]:
      if _same_geometry(groups[a][0], groups[b][0]):
        into[root(b)] = root(a)
  merged: dict[str, list[SliceHeader]] = collections.defaultdict(list)
  for k in keys:
    merged[root(k)] += groups[k]
  return dict(sorted(merged.items()))


SPLIT_STACK = ("two of its geometries interleave or touch along one slice normal (orientation or pixel spacing "
               "that differ within one stack)")
PARALLEL_DEGREES = 1.0  # geometries whose slice normals differ by less are parallel (see _split_stack)


def _split_stack(groups: Sequence[Sequence[SliceHeader]]) -> set[int]:
  """The indices of geometry groups that are one stack cut in two: same frame of reference, slice normals within
  PARALLEL_DEGREES, and slices that interleave or lie within one slice gap of each other along the normal. Each
  part is evenly spaced (an interleaved cut doubles its gap), so no later check would reject it.
  """
  facts = []
  for members in groups:
    with_pos = [s for s in members if s.position is not None]
    try:
      normal = _normal(members[0].orientation)[2]
    except SeriesRejected:
      normal = None  # _plan_stack rejects it
    if normal is None or not with_pos:
      facts.append(None)
      continue
    facts.append((members[0].frame_of_reference_key, normal, with_pos))
  split = set()
  cos_parallel = math.cos(math.radians(PARALLEL_DEGREES))
  for i, a in enumerate(facts):
    for j in range(i + 1, len(facts)):
      b = facts[j]
      if a is None or b is None or a[0] != b[0] or abs(float(a[1] @ b[1])) < cos_parallel:
        continue
      da = np.sort([a[1] @ np.asarray(x.position) for x in a[2]])
      db = np.sort([a[1] @ np.asarray(x.position) for x in b[2]])
      gaps = np.concatenate([np.diff(da), np.diff(db)])
      gap = float(np.median(gaps[gaps > DUPLICATE_MM])) if (gaps > DUPLICATE_MM).any() else 0.0
      if max(da[0], db[0]) - min(da[-1], db[-1]) <= 1.5 * gap:
        split |= {i, j}
  return split


def _same_geometry(a: SliceHeader, b: SliceHeader) -> bool:
  """Whether two slices' geometries differ by no more than the precision of their series keys."""
  return (a.frame_of_reference_key == b.frame_of_reference_key and (a.rows, a.columns) == (b.rows, b.columns)
          and max(abs(x - y) for x, y in zip(a.orientation, b.orientation)) <= 10.0 ** -ORIENTATION_DECIMALS
          and max(abs(x - y) for x, y in zip(a.pixel_spacing, b.pixel_spacing)) <= 10.0 ** -SPACING_DECIMALS)


def plan_volumes(slices: Sequence[SliceHeader], tolerance: float = DEFAULT_TOLERANCE,
                 max_volume_voxels: int = MAX_VOLUME_VOXELS
                 ) -> tuple[list[VolumePlan], list[tuple[str, str, int]]]:
  """Volume plans of one series, and (path, reason, frames) for what is left out.

  Args:
    slices: the slice headers of one series (one `series_id`), of one or more geometries.
    tolerance: the largest deviation of a slice gap from the mean gap, as a fraction of it.
    max_volume_voxels: a volume with more voxels is left out (see MAX_VOLUME_VOXELS).

  Returns:
    (volume plans, (path, reason, frames) of every file left out); a series that
    cannot be a volume is all in the second list, never raised. Plans of different
    geometries have the stack label `geometry=<k>[/<stack>]`.
  """
  plans, rejected = [], []
  by_geometry = []
  groups = list(_geometries(slices).values())
  split = _split_stack(groups)
  for k, members in enumerate(groups, 1):
    if k - 1 in split:
      rejected += [(path, f"series rejected, {SPLIT_STACK}", n) for path, n in sorted(frames_per_file(members).items())]
      by_geometry.append((k, []))
      continue
    group_plans, group_rejected = _plan_geometry(members, tolerance, max_volume_voxels)
    by_geometry.append((k, group_plans))
    rejected += group_rejected
  several = sum(bool(group_plans) for _, group_plans in by_geometry) > 1
  for k, group_plans in by_geometry:
    plans += [dataclasses.replace(p, stack="/".join(x for x in (f"geometry={k}", p.stack) if x)) if several else p
              for p in group_plans]
  return plans, rejected


def _plan_geometry(slices: Sequence[SliceHeader], tolerance: float, max_volume_voxels: int
                   ) -> tuple[list[VolumePlan], list[tuple[str, str, int]]]:
  """`plan_volumes` of the slices of one geometry (one series_key)."""
  plans, rejected = [], []
  with_pos = [s for s in slices if s.position is not None]
  if with_pos and len(with_pos) < len(slices):
    missing = [s for s in slices if s.position is None]
    rejected += [(path, "missing mandatory tag ImagePositionPatient", n)
                 for path, n in sorted(frames_per_file(missing).items())]
    slices = with_pos
  for stack, members in sorted(_stacks(slices).items()):
    try:
      plan = _plan_stack(members, stack, tolerance)
      _check_volume_size(plan, max_volume_voxels)
      plans.append(plan)
    except SeriesRejected as e:
      rejected += [(path, f"series rejected, {e}", n) for path, n in sorted(frames_per_file(members).items())]
  return plans, rejected


# --------------------------------------------------------------------------- pixels


def stored_values(arr: np.ndarray, bits_stored: int, pixel_representation: int) -> np.ndarray:
  """Stored pixel values limited to BitsStored (sign-extended when signed), same width as
  `arr`, in native byte order (pydicom gives big-endian arrays for Explicit VR Big Endian).

  Args:
    arr: the decoded pixel array of one slice.
    bits_stored: BitsStored of the slice.
    pixel_representation: 0 for unsigned, 1 for two's complement.

  Returns:
    The stored values, signed or unsigned as `pixel_representation` says.
  """
  if not arr.dtype.isnative:
    arr = arr.astype(arr.dtype.newbyteorder("="))  # same values, native bytes
  size = arr.dtype.itemsize
  signed = np.dtype(f"=i{size}") if size > 1 else np.dtype(np.int8)
  unsigned = np.dtype(f"=u{size}") if size > 1 else np.dtype(np.uint8)
  bits = 8 * size
  if pixel_representation == 1:
    a = arr.view(signed) if arr.dtype.kind in "iu" and arr.dtype.itemsize == size else arr.astype(signed)
    if bits_stored < bits:
      shift = bits - bits_stored
      a = (a << shift) >> shift  # arithmetic shift: drops the bits above BitsStored, keeps the sign
    return a
  a = arr.view(unsigned) if arr.dtype.kind in "iu" else arr.astype(unsigned)
  if bits_stored < bits:
    a = a & unsigned.type((1 << bits_stored) - 1)
  return a


def slice_hu(stored: np.ndarray, s: SliceHeader, out: np.ndarray) -> np.ndarray:
  """Writes one slice in HU into `out`: slope/intercept, then padding (found on the
  stored values) set to -1024 (CT_PADDING_HU). Integral rescales into int16 stay in integer arithmetic.

  Args:
    stored: the slice's stored values (`stored_values`).
    s: the slice's header (slope, intercept, padding).
    out: the volume's slice to fill; int16 values are rounded and clipped.

  Returns:
    `out`.
  """
  slope, intercept = s.slope, s.intercept
  if out.dtype == np.int16 and float(slope).is_integer() and float(intercept).is_integer():
    hu = stored.astype(np.int32)
    if slope != 1:
      hu *= int(slope)
    hu += int(intercept)
    if hu.size and (hu.min() < -32768 or hu.max() > 32767):
      np.clip(hu, -32768, 32767, out=hu)
    out[...] = hu
  else:
    hu = stored.astype(np.float64)
    hu *= slope
    hu += intercept
    if out.dtype == np.int16:
      np.rint(hu, out=hu)
      np.clip(hu, -32768, 32767, out=hu)
    out[...] = hu
  if s.padding is not None:
    lo, hi = s.padding
    mask = stored == lo if lo == hi else (stored >= lo) & (stored <= hi)
    np.putmask(out, mask, CT_PADDING_HU)
  return out


def _undecodable(s: SliceHeader, why: str) -> SeriesRejected:
  """The series fails because of one file's pixels; `why` must hold no header value."""
  return SeriesRejected(f"undecodable pixel data in a slice: {s.path}", culprit=s.path,
                        culprit_reason=f"truncated or undecodable pixel data: {why}")


class _Decoded:
  """Decoded stored values per (path, frame), one file open at a time.

  Native single-frame files are read straight from the pixel data offset found while
  reading the header (big endian ones byte-swapped by `stored_values`); everything else,
  deflated files included, goes through pydicom.
  """

  def __init__(self, open_file: Callable[[str], BinaryIO]):
    self._open = open_file
    self._path: str | None = None
    self._array: np.ndarray | None = None

  def _read_native(self, s: SliceHeader) -> np.ndarray:
    size = s.bits_allocated // 8
    dtype = np.dtype(f"{s.byte_order}{'i' if s.pixel_representation == 1 else 'u'}{size}") if size > 1 else np.dtype(
        np.int8 if s.pixel_representation == 1 else np.uint8)
    nbytes = s.rows * s.columns * size
    with self._open(s.path) as f:
      f.seek(s.pixel_offset)
      data = f.read(nbytes)
    if len(data) != nbytes:  # the file shrank since its header was read
      raise _undecodable(s, _SHORT)
    return np.frombuffer(data, dtype=dtype).reshape(s.rows, s.columns)

  def _decode(self, s: SliceHeader) -> np.ndarray:
    with self._open(s.path) as f:
      ds, _ = read_dataset(f, s.file_pixel_bytes + MAX_HEADER_BYTES)
    # The file must still describe the image its header did, or decoding could
    # allocate what the header checks refused (a file replaced between the steps).
    # A tag now absent is left to the decoder, which cannot size an image without it.
    planned = {"Rows": s.rows, "Columns": s.columns, "BitsAllocated": s.bits_allocated,
               "NumberOfFrames": s.file_frames}
    for keyword, expected in planned.items():
      value = getattr(ds, keyword, None)
      if keyword == "NumberOfFrames" and value is not None:
        value = value or 1  # read_slices takes 0 or empty as one frame
      if value is not None and value != expected:
        raise _undecodable(s, f"{tag_name(keyword)} changed since the header was read")
    return ds.pixel_array

  def get(self, s: SliceHeader) -> np.ndarray:
    if s.path != self._path:
      self._path, self._array = s.path, None
      why = None
      try:
        with quiet_pydicom():
          if s.pixel_offset is not None and s.frame is None:
            self._array = self._read_native(s)
          else:
            self._array = self._decode(s)
      except SeriesRejected:
        raise
      except SliceRejected as e:  # a deflated file over its bound: the reason holds no header value
        why = str(e)
      except Exception as e:  # noqa: BLE001 (a codec without a plugin, corrupt data)
        why = type(e).__name__  # pydicom's message may quote values: raised outside, without a context
      if why is not None:
        raise _undecodable(s, why)
    arr = self._array if s.frame is None or self._array.ndim == 2 else self._array[s.frame]  # 2-D: one frame
    if arr.shape != (s.rows, s.columns):
      raise SeriesRejected(f"pixel data shape differs from the header ({tag_name('Rows')}, "
                           f"{tag_name('Columns')}): {s.path}")
    return stored_values(arr, s.bits_stored, s.pixel_representation)


def read_volume(plan: VolumePlan, open_file: Callable[[str], BinaryIO], dtype: str,
                max_volume_voxels: int = MAX_VOLUME_VOXELS) -> tuple[np.ndarray, list[tuple[str, str]]]:
  """The HU volume [depth, rows, columns] and (path, reason) of dropped identical duplicates.

  Memory: the output volume plus one decoded file, both checked against the
  headers (and `max_volume_voxels`) before anything is allocated.

  Args:
    plan: the volume, from `plan_volumes`.
    open_file: opens a path for binary reading.
    dtype: the volume's dtype (int16, or float32 for a non-integral rescale).
    max_volume_voxels: the largest volume allocated.

  Returns:
    (volume, (path, reason) of each identical duplicate dropped).

  Raises:
    SeriesRejected: the volume is too large, a slice's pixels are short, undecodable
      or not the header's shape, or duplicate slices differ.
  """
  _check_volume_size(plan, max_volume_voxels)
  for s in sorted([*plan.slices, *(d for _, d in plan.duplicates)], key=lambda s: (s.path, s.frame or 0)):
    if s.pixel_bytes is not None and s.pixel_bytes < s.file_pixel_bytes:
      raise _undecodable(s, _SHORT)
  first = plan.slices[0]
  out = np.empty((len(plan.slices), first.rows, first.columns), dtype=dtype)
  dups = collections.defaultdict(list)
  for index, copy in plan.duplicates:
    dups[index].append(copy)
  decoded = _Decoded(open_file)
  # Visit slices grouped by file so a multi-frame file is decoded once.
  order = sorted(range(len(plan.slices)), key=lambda i: (plan.slices[i].path, plan.slices[i].frame or 0))
  for i in order:
    slice_hu(decoded.get(plan.slices[i]), plan.slices[i], out[i])
  dropped = []
  for i, copies in sorted(dups.items()):
    for copy in copies:  # a copy is the same slice when its HU are: stored values, rescale and padding
      if not np.array_equal(slice_hu(decoded.get(copy), copy, np.empty_like(out[i])), out[i]):
        z = float(np.asarray(copy.position) @ np.asarray(plan.direction).reshape(3, 3)[:, 2])
        raise SeriesRejected(f"conflicting duplicate slices: different pixels at position {z:.3f} mm")
      dropped.append((copy.path, "identical duplicate of another slice (dropped)"))
  return out, dropped
