"""CT label sources (DICOM SEG, RTSTRUCT, NIfTI) → label volumes aligned voxel for voxel. Pure, no Beam.

`sniff(data, path)` says what a file is, `read_label_header(data, path, salt,
config)` reads what matching needs (salted keys of the series, patient, Frame
of Reference and instances it references; the class ids it brings; no
pixels, no names) and `rasterize(plan, header, data, config)` paints the label
in the volume's own voxel order: [D, H, W] = (slice k sorted along the normal,
row j, column i) of the `VolumePlan`, class ids (`layout="classes"`, uint8, or
uint16 when a class id is over 255), or [D, H, W, C] uint8 0/1 channels
(`layout="channels"`, C = the largest class id, channel c - 1 is class c).
Background is 0. Every misalignment is a `LabelRejected` with a one-line reason
that names tags, segment or ROI numbers and distances, never a header value.

Tolerance: one rule, `tolerance_mm` (default `DEFAULT_TOLERANCE_MM`, 0.05 mm):
a label agrees with the volume when each of its voxel centres lies within that
distance of the volume's (checked where it is largest, at the corners of a
frame or of the label map). DS rounding and float32 NIfTI affines pass; a tenth
of a voxel of any CT grid coarser than 0.5 mm does not, let alone half a voxel.

Common to SEG and RTSTRUCT: the volume must be sorted by position (a volume
sorted by InstanceNumber has no geometry to check a label against); the
object's PatientID, FrameOfReferenceUID and referenced series (hashed as
`headers.py` hashes them) must be the volume's; every instance it references
(ReferencedSeriesSequence / ContourImageSequence, per frame or per contour)
must be a slice of the volume (or a dropped identical duplicate of one). An
object that names no series has series_uid_key "" (matched by its instances);
one that names several is a reject.
Segment labels and ROI names become class ids through `label_map` (exact,
case-sensitive); a name not in it is a reject naming the segment or ROI
number, never a silent drop. A name mapped to 0 (`IGNORED`) is left out on
purpose: its SEG frames are placed and checked but not painted, its RTSTRUCT
contours are neither checked nor painted (a BODY or couch ROI that reaches
past the reconstructed field of view).

DICOM SEG (BINARY or FRACTIONAL; Segmentation Storage): each frame is put on
the slice its per-frame source image reference names (SOP key, plus
ReferencedFrameNumber for a multi-frame source such as Enhanced CT); a frame
without a source reference goes by its PlanePositionSequence onto the slice at
that position along the normal; a frame with neither is a reject. Each frame's
plane position, orientation and pixel spacing (per-frame, else shared
functional groups) are then checked against its slice by the tolerance rule,
which catches a half-voxel shift. Frames may be omitted (empty frames, as the
standard allows and highdicom does): their slices are background. A FRACTIONAL
voxel is in its segment where value / MaximumFractionalValue >=
`fraction_threshold`. Pixels are decoded by highdicom, one frame at a time;
where frames go is decided here, from the functional groups. Rejects: frames
for a slice the volume lacks, more frames for one segment than the volume has
slices, two frames for one (segment, slice), frame size, position, orientation
or spacing off the slice, and in the classes layout two segments of different
classes on one voxel ("use --label_layout=channels").

RTSTRUCT: each ROI's CLOSED_PLANAR contours (ContourData, LPS mm) are mapped
onto the slice they lie on: every point's distance along the normal must be
within the tolerance of one slice's position, else "contour off the slice
grid" (or "contour outside the volume" beyond the first or last slice); a point
outside the slice's extent (columns -0.5 .. W - 0.5, rows likewise, plus the
tolerance) is "contour outside the volume". In-plane, points become continuous
(column, row) indices by that slice's own position, row and column cosines and
pixel spacing, rounded to a millionth of a voxel (so that a vertex meant to be
on a centre is on it). Fill rule: a voxel is in the ROI when its centre is
inside the polygon by the even-odd rule; the contours of one ROI on one slice combine by
XOR (holes by nesting, PS3.3 C.8.8.6). Ties, a centre exactly on an edge: a row
j crosses an edge when min(y0, y1) <= j < max(y0, y1) and a centre i is past a
crossing at x when x <= i, so centres on a left or upper edge are inside and
on a right or lower edge outside (a square with corners on voxel centres
covers as many voxels as its area). The scanline fill is vectorised (a
million-point contour takes about a second). Bounded work: at most
`max_contour_points` points per file (checked before any is parsed) and
`MAX_SCANLINE_CROSSINGS` edge-row crossings per file. An ROI without
contours is allowed (no voxels) but must be in the label map; other contour
types (POINT, OPEN_PLANAR, ...) are a reject.

NIfTI (.nii, .nii.gz; nibabel): integer values are class ids (floats only
when integral); with a label map every value must be one of its ids, else a
reject naming the value. The affine (RAS; sform, else qform) must describe the
volume's grid (LPS: x and y negated) up to a permutation and flips of the
array's axes, which are undone: the array must then have the volume's shape and
its voxel centres must agree within the tolerance, else "label map affine
disagrees with the series geometry" (or the shape reject). With `resample`, a
label map that does not describe the grid is resampled instead: nearest
neighbour by world coordinates (index floor(x + 0.5)), voxels outside it 0.
NIfTI names no series: `nifti_series` maps its path to a series_uid_key (from
the mapping file), else it is matched beside a series by `directory`.

Everything is a pure function of the bytes. Memory: the file, the label
volume (at most `MAX_LABEL_BYTES`) and one decoded frame or slice; pydicom,
highdicom and nibabel are kept quiet while they read (`quiet_pydicom`, and
their loggers on this thread).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
import contextlib
import dataclasses
import io
import logging
import math
import posixpath
import threading
import zlib

import highdicom
import highdicom.frame
import nibabel
import numpy as np
import pydicom
import pydicom.encaps
from pydicom.errors import InvalidDicomError
from pydicom.multival import MultiValue
from pydicom.pixels import get_decoder
from pydicom.uid import UID

from pipelines.ct_volumes.assembly import MAX_VOLUME_VOXELS, VolumePlan
from pipelines.ct_volumes.headers import (
    EXPLICIT_BIG_ENDIAN, MAX_FILE_BYTES, MAX_HEADER_BYTES, SUPPORTED_TRANSFER_SYNTAXES, SliceHeader, SliceRejected,
    floats_tag, int_tag, named_errors, quiet_pydicom, read_dataset, read_file_meta, salted_hash, tag_name, tag_value)

LABEL_SOURCES = ("seg", "rtstruct", "nifti")
SEG_STORAGE = "1.2.840.10008.5.1.4.1.1.66.4"
LABEL_MAP_SEG_STORAGE = "1.2.840.10008.5.1.4.1.1.66.7"  # sniffed as "seg", rejected by name
RTSTRUCT_STORAGE = "1.2.840.10008.5.1.4.1.1.481.3"
LAYOUTS = ("classes", "channels")
MAX_CLASS_ID = 65535
IGNORED = 0  # a label map's id for a name that is left out on purpose (a BODY or couch ROI)
DEFAULT_TOLERANCE_MM = 0.05
# Contour points of one RTSTRUCT file; a whole-body structure set of 50 ROIs on 500 slices
# at 200 points per contour holds 5 million.
MAX_CONTOUR_POINTS = 5_000_000
# Rows crossed by all the edges of one RTSTRUCT's contours (the scanline fill's work): that
# structure set crosses about 50 x 500 x 2 x 512 = 25 million.
MAX_SCANLINE_CROSSINGS = 1 << 28
_CROSSINGS_PER_CHUNK = 1 << 22
# A label volume (D x H x W, x C channels, x the dtype's bytes) fits one record beside its volume.
MAX_LABEL_BYTES = 1 << 30
# A .nii.gz may inflate to at most this: a float64 label map of MAX_VOLUME_VOXELS voxels and its header.
MAX_NIFTI_BYTES = MAX_VOLUME_VOXELS * 8 + (1 << 16)
_LPS_FROM_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])
_NAMES = {"seg": "SEG", "rtstruct": "RTSTRUCT", "nifti": "NIfTI"}


class LabelRejected(Exception):
  """The label cannot be paired with the volume; str(e) is the reason: one line, never a header value."""


@dataclasses.dataclass(frozen=True)
class LabelConfig:
  """What label sources to read and how to express them.

  Attributes:
    sources: the label sources to read, a subset of LABEL_SOURCES.
    label_map: segment label / ROI name -> class id (1..MAX_CLASS_ID, or IGNORED to leave a name
      out); None only when the
      sources are NIfTI alone (the values are then the class ids).
    layout: "classes" ([D, H, W] class ids) or "channels" ([D, H, W, C] uint8 0/1, C = the
      largest class id; needs a label map).
    nifti_series: NIfTI path (as InputFile.path prints it) -> series_uid_key.
    resample: NIfTI only: resample (nearest neighbour) a label map whose affine does not describe
      the volume's grid, instead of rejecting it.
    tolerance_mm: the largest distance between a label's voxel centres and the volume's.
    fraction_threshold: a FRACTIONAL SEG voxel is in its segment where fraction >= this.
    max_contour_points: the most contour points an RTSTRUCT file may hold.
    max_voxels: the most voxels a NIfTI label map may hold (checked from its header, before its
      data is inflated).
  """

  sources: tuple[str, ...]
  label_map: Mapping[str, int] | None
  layout: str = "classes"
  nifti_series: Mapping[str, str] = dataclasses.field(default_factory=dict)
  resample: bool = False
  tolerance_mm: float = DEFAULT_TOLERANCE_MM
  fraction_threshold: float = 0.5
  max_contour_points: int = MAX_CONTOUR_POINTS
  max_voxels: int = MAX_VOLUME_VOXELS  # the largest NIfTI label map, in voxels (--max_volume_voxels)

  def __post_init__(self):
    sources = tuple(self.sources)
    if not sources or len(set(sources)) != len(sources) or any(s not in LABEL_SOURCES for s in sources):
      raise ValueError(f"sources={sources!r}: a non-empty subset of {LABEL_SOURCES} expected")
    object.__setattr__(self, "sources", sources)
    if self.label_map is None:
      if sources != ("nifti",):
        raise ValueError(f"label_map=None with sources={sources!r}: SEG and RTSTRUCT need a label map")
    else:
      label_map = dict(self.label_map)
      for name, class_id in label_map.items():
        if not isinstance(name, str) or not name:
          raise ValueError("label_map: every name must be a non-empty string")
        if isinstance(class_id, bool) or not isinstance(class_id, int) or not 0 <= class_id <= MAX_CLASS_ID:
          raise ValueError(f"label_map: class id {class_id!r} is not an integer in 0..{MAX_CLASS_ID}")
      if not any(label_map.values()):
        raise ValueError("label_map names no class (every id is 0, or it is empty)")
      object.__setattr__(self, "label_map", label_map)
    if self.layout not in LAYOUTS:
      raise ValueError(f"layout={self.layout!r}, expected one of {LAYOUTS}")
    if self.layout == "channels" and self.label_map is None:
      raise ValueError("layout='channels' needs a label_map (its largest class id is the number of channels)")
    object.__setattr__(self, "nifti_series", {str(k): str(v) for k, v in dict(self.nifti_series).items()})
    if not (isinstance(self.tolerance_mm, (int, float)) and math.isfinite(self.tolerance_mm)
            and self.tolerance_mm > 0):
      raise ValueError(f"tolerance_mm={self.tolerance_mm!r}: a positive number of millimetres expected")
    if not (isinstance(self.fraction_threshold, (int, float)) and 0 < self.fraction_threshold <= 1):
      raise ValueError(f"fraction_threshold={self.fraction_threshold!r}: a number in (0, 1] expected")
    if isinstance(self.max_contour_points, bool) or not isinstance(self.max_contour_points, int) or (
        self.max_contour_points < 1):
      raise ValueError(f"max_contour_points={self.max_contour_points!r}: a positive integer expected")

  def __hash__(self) -> int:  # the mappings are dicts (picklable): hash their items
    return hash((self.sources, tuple(sorted((self.label_map or {}).items())), self.layout,
                 tuple(sorted(self.nifti_series.items())), self.resample, self.tolerance_mm,
                 self.fraction_threshold, self.max_contour_points, self.max_voxels))

  @property
  def class_ids(self) -> frozenset[int]:
    """The class ids of the label map (empty without one)."""
    return frozenset(self.label_map.values()) - {IGNORED} if self.label_map else frozenset()


def label_dtype(config: LabelConfig) -> str:
  """The label's dtype: uint8 for channels or class ids up to 255, else uint16 (so without a label map).

  Args:
    config: the label settings.

  Returns:
    "uint8" or "uint16".
  """
  if config.layout == "channels" or (config.label_map and max(config.label_map.values()) <= 255):
    return "uint8"
  return "uint16"


def num_channels(config: LabelConfig) -> int | None:
  """C of the channels layout (the largest class id); None for the classes layout.

  Args:
    config: the label settings.

  Returns:
    The number of channels, or None.
  """
  return max(config.label_map.values()) if config.layout == "channels" else None


@dataclasses.dataclass(frozen=True)
class SegFrame:
  """One SEG frame's placement facts, from its functional groups (per-frame, else shared)."""

  segment: int  # ReferencedSegmentNumber
  sources: tuple[tuple[str, int | None], ...]  # (salted SOP key, ReferencedFrameNumber or None)
  position: tuple[float, float, float] | None  # PlanePositionSequence ImagePositionPatient
  orientation: tuple[float, ...]  # row cosines, column cosines
  pixel_spacing: tuple[float, float]  # (between rows, between columns)


@dataclasses.dataclass(frozen=True)
class LabelHeader:
  """Header facts of one label file: no pixels, nothing identifying (salted hashes, numbers)."""

  path: str
  source: str  # seg | rtstruct | nifti
  series_uid_key: str  # the referenced series; NIfTI: from LabelConfig.nifti_series, else ""
  patient_id: str  # salted_hash(salt, "patient", PatientID), as SliceHeader.patient_id; "" for NIfTI
  frame_of_reference_key: str  # as SliceHeader.frame_of_reference_key; "" for NIfTI
  referenced_sop_keys: frozenset[str]  # SOP keys of the instances the label references
  classes: tuple[int, ...]  # the class ids it contributes, sorted
  directory: str  # posix dirname of path
  segments: tuple[tuple[int, int], ...] = ()  # (SegmentNumber or ROINumber, class id)
  rows: int = 0  # SEG frames
  columns: int = 0
  number_of_frames: int = 0
  segmentation_type: str = ""  # BINARY | FRACTIONAL
  max_fractional_value: int = 0
  frames: tuple[SegFrame, ...] = ()  # SEG, in frame order
  contour_points: int = 0  # RTSTRUCT
  # RTSTRUCT, per contour with points in file order: its ContourImageSequence (SOP key, frame number).
  contour_references: tuple[tuple[tuple[str, int | None], ...], ...] = ()
  shape: tuple[int, ...] = ()  # NIfTI array shape
  affine: tuple[float, ...] = ()  # NIfTI affine (RAS), 16 values row-major

  @property
  def name(self) -> str:
    """How a reason names the source: SEG, RTSTRUCT or NIfTI."""
    return _NAMES[self.source]


# --------------------------------------------------------------------------- quiet


class _Quiet(threading.local):
  depth = 0


_QUIET = _Quiet()
_QUIET_LOGGERS = ("highdicom", "nibabel")


class _DropOnQuietThread(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return _QUIET.depth == 0


_DROP = _DropOnQuietThread()
_loggers_seen = -1


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
  """`quiet_pydicom()`, and highdicom's and nibabel's log records dropped on this thread (they quote values).

  The filter sits on every logger of those packages (a logger's filters do not apply to its
  children's records), including ones created since the last call.
  """
  global _loggers_seen
  loggers = logging.root.manager.loggerDict
  if len(loggers) != _loggers_seen:
    _loggers_seen = len(loggers)
    for name, logger in [*loggers.items(), *((n, logging.getLogger(n)) for n in _QUIET_LOGGERS)]:
      if isinstance(logger, logging.Logger) and name.split(".")[0] in _QUIET_LOGGERS and (
          _DROP not in logger.filters):
        logger.addFilter(_DROP)
  _QUIET.depth += 1
  try:
    with quiet_pydicom():
      yield
  finally:
    _QUIET.depth -= 1


# --------------------------------------------------------------------------- sniff


def _is_nifti(data: bytes, gzipped: bool) -> bool:
  head = data[:548]
  if gzipped:
    try:
      head = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data, 548)
    except zlib.error:
      return False
  if len(head) >= 348 and head[344:348] in (b"n+1\x00", b"ni1\x00"):
    return head[344:348] == b"n+1\x00" and head[:4] in (b"\x5c\x01\x00\x00", b"\x00\x00\x01\x5c")
  return len(head) >= 540 and head[4:8] == b"n+2\x00" and head[:4] in (b"\x1c\x02\x00\x00", b"\x00\x00\x02\x1c")


def _sop_class_of(data: bytes) -> str | None:
  """MediaStorageSOPClassUID of the file meta, else the data set's SOPClassUID; None when unreadable."""
  if len(data) < 132 or data[128:132] != b"DICM":
    return None
  try:
    with _quiet():
      meta = read_file_meta(io.BytesIO(data[132:]))
      value = meta.get("MediaStorageSOPClassUID")
      if value:
        return str(value)
      ds = pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True, specific_tags=["SOPClassUID"])
      return str(ds.get("SOPClassUID") or "") or None
  except Exception:  # noqa: BLE001 (not a label source, whatever the file holds)
    return None


def sniff(data: bytes, path: str) -> str | None:
  """What label source a file is, cheaply: "seg", "rtstruct", "nifti", or None.

  DICOM by its SOP class (file meta, else data set; pixels never read), NIfTI by its
  name (.nii, .nii.gz) and its magic (n+1 or n+2 in a header of the right size).

  Args:
    data: the file's bytes.
    path: its path.

  Returns:
    The label source, or None for anything else (a CT slice, junk).
  """
  name = path.lower()
  if name.endswith((".nii", ".nii.gz")):
    return "nifti" if _is_nifti(data, name.endswith(".gz")) else None
  return {SEG_STORAGE: "seg", LABEL_MAP_SEG_STORAGE: "seg", RTSTRUCT_STORAGE: "rtstruct"}.get(
      _sop_class_of(data) or "")


# --------------------------------------------------------------------------- DICOM helpers


def _invalid(keyword: str, why: str = "") -> LabelRejected:
  return LabelRejected(f"invalid {tag_name(keyword)}" + (f": {why}" if why else ""))


def _element(ds, keyword: str):
  """The value, or None when absent or empty; a conversion error names the tag only."""
  return tag_value(ds, keyword, _invalid)


def _require(ds, keyword: str, what: str = ""):
  value = _element(ds, keyword)
  if value is None:
    raise LabelRejected(f"missing mandatory tag {tag_name(keyword)}" + (f" ({what})" if what else ""))
  return value


def _int(ds, keyword: str, *, required: bool = False, low: int | None = None, high: int | None = None,
         default: int | None = None) -> int | None:
  value = _require(ds, keyword) if required else _element(ds, keyword)
  return int_tag(value, keyword, _invalid, default, low, high)


def _uid(ds, keyword: str) -> str:
  value = _element(ds, keyword)
  return "" if value is None else str(value)


def _items(ds, keyword: str) -> list:
  value = _element(ds, keyword)
  return list(value) if value is not None else []


def _read_dicom(data: bytes, what: str, *, stop_before_pixels: bool) -> pydicom.Dataset:
  try:
    ds, _ = read_dataset(io.BytesIO(data), MAX_FILE_BYTES + MAX_HEADER_BYTES, stop_before_pixels=stop_before_pixels)
  except InvalidDicomError:
    raise LabelRejected(f"not DICOM (no DICM preamble): not a {what}") from None
  except SliceRejected as e:  # a deflate bomb or broken stream: the reason holds no value
    raise LabelRejected(str(e)) from None
  except Exception as e:  # noqa: BLE001 (pydicom raises many types on a damaged header)
    raise LabelRejected(f"unreadable or truncated {what} header: {type(e).__name__}") from None
  return ds


def _identity(ds, salt: str) -> dict:
  return dict(patient_id=salted_hash(salt, "patient", str(_element(ds, "PatientID") or "")))


def _sop_key(salt: str, uid: str) -> str:
  return salted_hash(salt, "sop", uid)


def _frame_numbers(item) -> list[int | None]:
  value = _element(item, "ReferencedFrameNumber")
  if value is None:
    return [None]
  values = value if isinstance(value, (list, tuple, MultiValue)) else [value]
  try:
    out = [int(v) for v in values]
  except (TypeError, ValueError):
    raise LabelRejected(f"invalid {tag_name('ReferencedFrameNumber')}") from None
  if not out or any(v < 1 for v in out):
    raise LabelRejected(f"invalid {tag_name('ReferencedFrameNumber')}")
  return out


def _some_class(classes: set[int], what: str) -> tuple[int, ...]:
  """The classes a SEG or RTSTRUCT brings; one that brings none (every name mapped to 0) labels nothing."""
  classes = classes - {IGNORED}
  if not classes:
    raise LabelRejected(f"every {what} is mapped to 0 in --label_map: the file labels nothing")
  return tuple(sorted(classes))


def _label_class(config: LabelConfig, name, what: str, number: int) -> int:
  """The class id of a segment label / ROI name; the reason names the number only."""
  keyword = "SegmentLabel" if what == "segment" else "ROIName"
  if name is None:
    raise LabelRejected(f"{what} {number} has no {tag_name(keyword)}")
  class_id = config.label_map.get(str(name))
  if class_id is None:
    raise LabelRejected(f"{what} {number} ({tag_name(keyword)}) is not in --label_map")
  return class_id


# --------------------------------------------------------------------------- headers


def read_label_header(data: bytes, path: str, salt: str, config: LabelConfig) -> LabelHeader:
  """Header facts of one label file (SEG, RTSTRUCT or NIfTI), checked as far as they go without a volume.

  Args:
    data: the file's bytes.
    path: its path (recorded; NIfTI: looked up in config.nifti_series).
    salt: the secret key of the identifier hashes (`salted_hash`, as `read_slices` uses it).
    config: the label settings.

  Returns:
    The `LabelHeader`.

  Raises:
    LabelRejected: not a label source of config.sources, unreadable or malformed, a SEG that is
      not BINARY or FRACTIONAL, a segment or ROI name not in the label map, an unsupported
      contour type, too many contour points, NIfTI values that are not class ids, ...
  """
  source = sniff(data, path)
  if source is None:
    raise LabelRejected("not a label source (DICOM SEG, RTSTRUCT or NIfTI)")
  if source not in config.sources:
    raise LabelRejected(f"label source {source} not among the label sources read")
  reader = {"seg": _seg_header, "rtstruct": _rtstruct_header, "nifti": _nifti_header}[source]
  with _quiet():
    return named_errors(LabelRejected, f"invalid {_NAMES[source]} header", reader, data, path, salt, config)


def _group(item, shared, keyword: str):
  """Item 0 of a functional group: per-frame, else shared; None when neither has it."""
  for source in (item, shared):
    if source is not None and keyword in source and len(source[keyword].value):
      return source[keyword].value[0]
  return None


def _seg_syntax(ds) -> None:
  meta = getattr(ds, "file_meta", None)
  syntax = UID(str(meta.get("TransferSyntaxUID") or "")) if meta is not None else UID("")
  if not syntax:
    return
  if syntax not in SUPPORTED_TRANSFER_SYNTAXES or syntax == EXPLICIT_BIG_ENDIAN:
    raise LabelRejected(f"unsupported transfer syntax of a SEG ({tag_name('TransferSyntaxUID')})")
  if syntax.is_encapsulated and not get_decoder(syntax).is_available:
    raise LabelRejected(f"unsupported transfer syntax of a SEG ({tag_name('TransferSyntaxUID')}): no decoder")


def _seg_header(data: bytes, path: str, salt: str, config: LabelConfig) -> LabelHeader:
  ds = _read_dicom(data, "SEG", stop_before_pixels=True)
  sop_class = _uid(ds, "SOPClassUID")
  if sop_class == LABEL_MAP_SEG_STORAGE:
    raise LabelRejected("Label Map Segmentation Storage is not supported: BINARY or FRACTIONAL SEG expected")
  if sop_class != SEG_STORAGE:
    raise LabelRejected(f"not a SEG ({tag_name('SOPClassUID')})")
  _seg_syntax(ds)
  seg_type = str(_require(ds, "SegmentationType")).strip().upper()
  if seg_type not in ("BINARY", "FRACTIONAL"):
    raise LabelRejected(f"unsupported {tag_name('SegmentationType')}: BINARY or FRACTIONAL expected")
  rows = _int(ds, "Rows", required=True, low=1)
  columns = _int(ds, "Columns", required=True, low=1)
  frames_n = _int(ds, "NumberOfFrames", required=True, low=1)
  bits = _int(ds, "BitsAllocated", required=True)
  if bits != (1 if seg_type == "BINARY" else 8) or _int(ds, "SamplesPerPixel", default=1) != 1:
    raise LabelRejected(f"invalid {tag_name('BitsAllocated')} or {tag_name('SamplesPerPixel')} for the "
                        f"{tag_name('SegmentationType')}")
  if rows * columns * frames_n * bits // 8 > MAX_FILE_BYTES:
    raise LabelRejected(f"SEG pixel data over the size limit: {tag_name('Rows')} x {tag_name('Columns')} x "
                        f"{tag_name('NumberOfFrames')} exceeds {MAX_FILE_BYTES} bytes")
  max_fraction = 0
  if seg_type == "FRACTIONAL":
    max_fraction = _int(ds, "MaximumFractionalValue", required=True, low=1, high=255)

  segments: dict[int, int] = {}
  for item in _items(ds, "SegmentSequence"):
    number = _int(item, "SegmentNumber", required=True, low=1, high=65535)
    if number in segments:
      raise LabelRejected(f"segment {number} described twice ({tag_name('SegmentSequence')})")
    segments[number] = _label_class(config, _element(item, "SegmentLabel"), "segment", number)
  if not segments:
    raise LabelRejected(f"missing mandatory tag {tag_name('SegmentSequence')}")

  series = {_uid(s, "SeriesInstanceUID") for s in _items(ds, "ReferencedSeriesSequence")}
  if len(series) > 1:
    raise LabelRejected(f"the SEG references several series ({tag_name('ReferencedSeriesSequence')})")
  referenced = {_sop_key(salt, _uid(i, "ReferencedSOPInstanceUID"))
                for s in _items(ds, "ReferencedSeriesSequence") for i in _items(s, "ReferencedInstanceSequence")}

  shared = _items(ds, "SharedFunctionalGroupsSequence")
  shared = shared[0] if shared else None
  per_frame = _items(ds, "PerFrameFunctionalGroupsSequence")
  if len(per_frame) != frames_n:
    raise LabelRejected(f"invalid {tag_name('PerFrameFunctionalGroupsSequence')}: not one item per frame")
  frames = []
  for item in per_frame:
    frame = _seg_frame(item, shared, salt, segments)
    referenced.update(sop for sop, _ in frame.sources)
    frames.append(frame)
  return LabelHeader(
      path=path, source="seg", series_uid_key=salted_hash(salt, "series-uid", series.pop()) if series else "",
      frame_of_reference_key=salted_hash(salt, "frame-of-reference", _uid(ds, "FrameOfReferenceUID")),
      referenced_sop_keys=frozenset(referenced), classes=_some_class(set(segments.values()), "segment"),
      directory=posixpath.dirname(path), segments=tuple(sorted(segments.items())), rows=rows, columns=columns,
      number_of_frames=frames_n, segmentation_type=seg_type, max_fractional_value=max_fraction,
      frames=tuple(frames), **_identity(ds, salt))


def _seg_frame(item, shared, salt: str, segments: Mapping[int, int]) -> SegFrame:
  ident = _group(item, shared, "SegmentIdentificationSequence")
  if ident is None:
    raise LabelRejected(f"a SEG frame without {tag_name('SegmentIdentificationSequence')}")
  segment = _int(ident, "ReferencedSegmentNumber", required=True, low=1, high=65535)
  if segment not in segments:
    raise LabelRejected(f"a SEG frame refers to segment {segment}, which {tag_name('SegmentSequence')} "
                        "does not describe")
  sources = []
  derivations = _items(item, "DerivationImageSequence") or (_items(shared, "DerivationImageSequence") if shared else [])
  for derivation in derivations:
    for src in _items(derivation, "SourceImageSequence"):
      sop = _sop_key(salt, str(_require(src, "ReferencedSOPInstanceUID", "SourceImageSequence")))
      sources += [(sop, n) for n in _frame_numbers(src)]
  plane_pos = _group(item, shared, "PlanePositionSequence")
  position = None
  if plane_pos is not None and _element(plane_pos, "ImagePositionPatient") is not None:
    position = floats_tag(plane_pos.ImagePositionPatient, 3, "ImagePositionPatient", _invalid)
  if not sources and position is None:
    raise LabelRejected(f"a SEG frame has neither a source image reference ({tag_name('SourceImageSequence')}) "
                        f"nor a plane position ({tag_name('PlanePositionSequence')})")
  plane_ori = _group(item, shared, "PlaneOrientationSequence")
  measures = _group(item, shared, "PixelMeasuresSequence")
  if plane_ori is None or measures is None:
    raise LabelRejected(f"missing mandatory tag {tag_name('PlaneOrientationSequence')} or "
                        f"{tag_name('PixelMeasuresSequence')} (SEG frame)")
  orientation = floats_tag(_require(plane_ori, "ImageOrientationPatient"), 6, "ImageOrientationPatient", _invalid)
  spacing = floats_tag(_require(measures, "PixelSpacing"), 2, "PixelSpacing", _invalid)
  return SegFrame(segment=segment, sources=tuple(sources), position=position, orientation=orientation,
                  pixel_spacing=spacing)


@dataclasses.dataclass(frozen=True)
class _Contour:
  roi: int
  element: object  # ContourData, raw (bytes) or converted
  points: int
  references: tuple[tuple[str, int | None], ...]  # ContourImageSequence (SOP key, frame number)


@dataclasses.dataclass(frozen=True)
class _Structure:
  rois: dict[int, int]  # ROINumber -> class id
  contours: list[_Contour]
  series: set[str]
  frame_of_reference: str
  referenced: set[str]


def _contour_values_count(element) -> int:
  value = element.value
  if value is None:
    return 0
  if isinstance(value, (bytes, bytearray)):
    value = bytes(value).strip(b" \x00")
    return value.count(b"\\") + 1 if value else 0
  return len(value) if isinstance(value, (list, tuple, MultiValue)) else 1


def _contour_points(element) -> np.ndarray:
  """ContourData as (N, 3) float64; a raw DS value is parsed by numpy (a million points in about a second)."""
  value = element.value
  try:
    if isinstance(value, (bytes, bytearray)):
      parts = bytes(value).strip(b" \x00").split(b"\\")
      values = np.array(parts, dtype=np.float64)
    else:
      values = np.asarray([float(v) for v in (value if isinstance(value, (list, tuple, MultiValue)) else [value])],
                          dtype=np.float64)
  except (TypeError, ValueError, OverflowError):
    raise LabelRejected(f"invalid {tag_name('ContourData')}") from None
  if values.size % 3 or not np.all(np.isfinite(values)):
    raise LabelRejected(f"invalid {tag_name('ContourData')}: not finite (x, y, z) triplets")
  return values.reshape(-1, 3)


def _structure(ds, salt: str, config: LabelConfig) -> _Structure:
  """What an RTSTRUCT holds, its contours' points still unparsed; checks types, names and counts."""
  if _uid(ds, "SOPClassUID") != RTSTRUCT_STORAGE:
    raise LabelRejected(f"not an RTSTRUCT ({tag_name('SOPClassUID')})")
  frames_of_reference, series, referenced = set(), set(), set()
  for ref in _items(ds, "ReferencedFrameOfReferenceSequence"):
    frames_of_reference.add(_uid(ref, "FrameOfReferenceUID"))
    for study in _items(ref, "RTReferencedStudySequence"):
      for s in _items(study, "RTReferencedSeriesSequence"):
        series.add(_uid(s, "SeriesInstanceUID"))
        for image in _items(s, "ContourImageSequence"):
          referenced.add(_sop_key(salt, _uid(image, "ReferencedSOPInstanceUID")))
  if len(series) > 1:
    raise LabelRejected(f"the RTSTRUCT references several series ({tag_name('RTReferencedSeriesSequence')})")
  rois: dict[int, int] = {}
  for item in _items(ds, "StructureSetROISequence"):
    number = _int(item, "ROINumber", required=True)
    if number in rois:
      raise LabelRejected(f"ROI {number} described twice ({tag_name('StructureSetROISequence')})")
    rois[number] = _label_class(config, _element(item, "ROIName"), "ROI", number)
    frames_of_reference.add(_uid(item, "ReferencedFrameOfReferenceUID"))
  frames_of_reference.discard("")
  if len(frames_of_reference) > 1:
    raise LabelRejected(f"the RTSTRUCT's ROIs lie in several Frames of Reference "
                        f"({tag_name('ReferencedFrameOfReferenceUID')})")
  contours, total = [], 0
  for item in _items(ds, "ROIContourSequence"):
    roi = _int(item, "ReferencedROINumber", required=True)
    if roi not in rois:
      raise LabelRejected(f"contours for ROI {roi}, which {tag_name('StructureSetROISequence')} does not describe")
    if rois[roi] == IGNORED:  # left out by the label map: its contours are neither checked nor painted
      continue
    for contour in _items(item, "ContourSequence"):
      kind = str(_element(contour, "ContourGeometricType") or "").strip().upper()
      if kind != "CLOSED_PLANAR":
        raise LabelRejected(f"unsupported contour type in ROI {roi} ({tag_name('ContourGeometricType')}): "
                            "CLOSED_PLANAR expected")
      element = contour.get_item(0x30060050)  # ContourData, raw: parsed only in rasterize
      values = _contour_values_count(element) if element is not None else 0
      declared = _int(contour, "NumberOfContourPoints", low=0)
      if values % 3 or (declared is not None and declared * 3 != values):
        raise LabelRejected(f"{tag_name('ContourData')} does not hold {tag_name('NumberOfContourPoints')} "
                            f"(x, y, z) points (ROI {roi})")
      total += values // 3
      if total > config.max_contour_points:
        raise LabelRejected(f"too many contour points: the RTSTRUCT holds more than {config.max_contour_points}")
      refs = []
      for image in _items(contour, "ContourImageSequence"):
        sop = _sop_key(salt, str(_require(image, "ReferencedSOPInstanceUID", "ContourImageSequence")))
        refs += [(sop, n) for n in _frame_numbers(image)]
      referenced.update(sop for sop, _ in refs)
      if values:
        contours.append(_Contour(roi=roi, element=element, points=values // 3, references=tuple(refs)))
  return _Structure(rois=rois, contours=contours, series=series,
                    frame_of_reference=frames_of_reference.pop() if frames_of_reference else "",
                    referenced=referenced)


def _rtstruct_header(data: bytes, path: str, salt: str, config: LabelConfig) -> LabelHeader:
  ds = _read_dicom(data, "RTSTRUCT", stop_before_pixels=True)
  st = _structure(ds, salt, config)
  return LabelHeader(
      path=path, source="rtstruct",
      series_uid_key=salted_hash(salt, "series-uid", next(iter(st.series))) if st.series else "",
      frame_of_reference_key=salted_hash(salt, "frame-of-reference", st.frame_of_reference),
      referenced_sop_keys=frozenset(st.referenced), classes=_some_class(set(st.rois.values()), "ROI"),
      directory=posixpath.dirname(path), segments=tuple(sorted(st.rois.items())),
      contour_points=sum(c.points for c in st.contours),
      contour_references=tuple(c.references for c in st.contours), **_identity(ds, salt))


# --------------------------------------------------------------------------- NIfTI


_NIFTI_HEADER_BYTES = 544  # a NIfTI-2 header (540) and its extension flag; NIfTI-1 needs 352


def _nifti_bytes(data: bytes, path: str, max_voxels: int) -> bytes:
  """The NIfTI's bytes, a .gz inflated only as far as its header says the image reaches: the voxel count
  is checked from the header before the data is inflated (a small .gz can inflate to gigabytes)."""
  inflater = zlib.decompressobj(16 + zlib.MAX_WBITS) if path.lower().endswith(".gz") else None
  try:
    head = inflater.decompress(data, _NIFTI_HEADER_BYTES) if inflater else data[:_NIFTI_HEADER_BYTES]
  except zlib.error:
    raise LabelRejected("unreadable NIfTI (not a gzip stream)") from None
  header_class = nibabel.Nifti2Header if head[4:8] == b"n+2\x00" else nibabel.Nifti1Header
  try:
    header = header_class.from_fileobj(io.BytesIO(head), check=False)
    voxels = math.prod(int(n) for n in header.get_data_shape())
    needed = int(header.get_data_offset()) + voxels * header.get_data_dtype().itemsize
  except Exception as e:  # noqa: BLE001 (nibabel raises many types on a damaged header)
    raise LabelRejected(f"unreadable NIfTI header: {type(e).__name__}") from None
  if voxels > max_voxels:
    raise LabelRejected(f"NIfTI over the size limit: more than {max_voxels} voxels")
  if needed > MAX_NIFTI_BYTES:
    raise LabelRejected(f"NIfTI over the size limit: its image takes more than {MAX_NIFTI_BYTES} bytes")
  if inflater is None or needed <= len(head):
    return data if inflater is None else head
  try:
    return head + inflater.decompress(inflater.unconsumed_tail, needed - len(head))
  except zlib.error:
    raise LabelRejected("unreadable NIfTI (a damaged gzip stream)") from None


def _nifti_image(data: bytes, path: str, max_voxels: int = MAX_VOLUME_VOXELS):
  raw = _nifti_bytes(data, path, max_voxels)
  image_class = nibabel.Nifti2Image if raw[4:8] == b"n+2\x00" else nibabel.Nifti1Image
  try:
    image = image_class.from_bytes(raw)
  except Exception as e:  # noqa: BLE001 (nibabel raises many types on a damaged header)
    raise LabelRejected(f"unreadable NIfTI header: {type(e).__name__}") from None
  shape = tuple(int(n) for n in image.shape)
  if len(shape) == 4 and shape[3] == 1:
    shape = shape[:3]
  if len(shape) != 3 or min(shape) < 1:
    raise LabelRejected("not a 3D NIfTI label map (dim)")
  if math.prod(shape) > max_voxels:
    raise LabelRejected(f"NIfTI over the size limit: more than {max_voxels} voxels")
  header = image.header
  if int(header["sform_code"]) == 0 and int(header["qform_code"]) == 0:
    raise LabelRejected("NIfTI without an orientation (sform_code and qform_code are 0)")
  affine = np.asarray(image.affine, dtype=np.float64)
  if affine.shape != (4, 4) or not np.all(np.isfinite(affine)) or abs(np.linalg.det(affine[:3, :3])) < 1e-12:
    raise LabelRejected("invalid NIfTI affine (sform/qform)")
  return image, shape, affine


def _nifti_values(image, shape: tuple[int, ...], config: LabelConfig) -> np.ndarray:
  """The label map's values as class ids (uint16), checked: integral, 0..MAX_CLASS_ID, in the label map."""
  try:
    values = np.asanyarray(image.dataobj)
  except Exception as e:  # noqa: BLE001 (truncated data, an odd dtype)
    raise LabelRejected(f"unreadable NIfTI data: {type(e).__name__}") from None
  values = values.reshape(shape)
  if values.dtype.kind == "f":
    if not np.all(np.isfinite(values)) or np.any(values != np.round(values)):
      raise LabelRejected("NIfTI label values are not integers")
  elif values.dtype.kind not in "iub":
    raise LabelRejected("NIfTI label values are not integers")
  if values.size and (values.min() < 0 or values.max() > MAX_CLASS_ID):
    raise LabelRejected(f"NIfTI label values outside 0..{MAX_CLASS_ID}")
  values = values.astype(np.uint16)
  if config.label_map is not None:
    present = np.flatnonzero(np.bincount(values.ravel(), minlength=1))  # one pass, no sorted copy
    unknown = [int(v) for v in present if v and int(v) not in config.class_ids]
    if unknown:
      more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
      raise LabelRejected(f"NIfTI label value {unknown[0]}{more} is not a class id of --label_map")
  return values


def _nifti_header(data: bytes, path: str, salt: str, config: LabelConfig) -> LabelHeader:
  image, shape, affine = _nifti_image(data, path, config.max_voxels)
  values = _nifti_values(image, shape, config)
  classes = tuple(int(v) for v in np.flatnonzero(np.bincount(values.ravel(), minlength=1)) if v)
  return LabelHeader(
      path=path, source="nifti", series_uid_key=config.nifti_series.get(path, ""), patient_id="",
      frame_of_reference_key="", referenced_sop_keys=frozenset(), classes=classes,
      directory=posixpath.dirname(path), shape=shape, affine=tuple(float(x) for x in affine.ravel()))


# --------------------------------------------------------------------------- rasterize


def rasterize(plan: VolumePlan, header: LabelHeader, data: bytes, config: LabelConfig) -> np.ndarray:
  """The label of one volume, in the volume's voxel order.

  Args:
    plan: the volume (`assembly.plan_volumes`), its slices carrying their SOP keys.
    header: the label's header (`read_label_header` of the same bytes).
    data: the label file's bytes.
    config: the label settings (as given to `read_label_header`).

  Returns:
    [D, H, W] class ids of dtype label_dtype(config), or [D, H, W, C] uint8 0/1 in the
    channels layout.

  Raises:
    LabelRejected: the label does not belong to this volume or does not align with it
      (each misalignment a named reason, see the module docstring).
  """
  with _quiet():
    return named_errors(LabelRejected, f"unreadable {header.name}", _rasterize, plan, header, data, config)


def _rasterize(plan: VolumePlan, header: LabelHeader, data: bytes, config: LabelConfig) -> np.ndarray:
  _check_volume(plan, header)
  if header.source == "nifti":
    return _rasterize_nifti(plan, header, data, config)
  _check_references(plan, header)
  if header.source == "seg":
    return _rasterize_seg(plan, header, data, config)
  return _rasterize_rtstruct(plan, header, data, config)


def _check_volume(plan: VolumePlan, header: LabelHeader) -> None:
  if plan.sorted_by != "position" or any(s.position is None for s in plan.slices):
    raise LabelRejected(f"the volume has no slice positions (sorted by {tag_name('InstanceNumber')}): "
                        f"a {header.name} cannot be checked against its geometry")


def _check_references(plan: VolumePlan, header: LabelHeader) -> None:
  """Patient, series, Frame of Reference and referenced instances of a SEG or RTSTRUCT."""
  first = plan.slices[0]
  name = header.name
  if header.patient_id != plan.patient_id:
    raise LabelRejected(f"the {name} belongs to another patient than the series ({tag_name('PatientID')})")
  if header.series_uid_key and header.series_uid_key != first.series_uid_key:
    raise LabelRejected(f"the {name} references another series ({tag_name('SeriesInstanceUID')})")
  if header.frame_of_reference_key != first.frame_of_reference_key:
    raise LabelRejected(f"Frame of Reference mismatch: the {name}'s {tag_name('FrameOfReferenceUID')} "
                        "is not the series'")
  known = {s.sop_key for s in plan.slices} | {d.sop_key for _, d in plan.duplicates}
  missing = header.referenced_sop_keys - known
  if missing:
    raise LabelRejected(f"the {name} references {len(missing)} instance(s) not in this series "
                        f"({tag_name('ReferencedSOPInstanceUID')})")


def _slice_index(plan: VolumePlan) -> tuple[dict[tuple[str, int | None], int], set[str]]:
  """{(SOP key, frame number or None): slice index} (duplicates to the slice they copy), and the
  SOP keys of multi-frame files."""
  index: dict[tuple[str, int | None], int] = {}
  multi: set[str] = set()

  def add(s: SliceHeader, k: int) -> None:
    if s.frame is None:
      index[(s.sop_key, None)] = k
    else:
      index[(s.sop_key, s.frame + 1)] = k
      multi.add(s.sop_key)

  for k, s in enumerate(plan.slices):
    add(s, k)
  for k, s in plan.duplicates:
    add(s, k)
  return index, multi


def _lookup(index, multi, sop: str, frame: int | None, what: str) -> int:
  k = index.get((sop, frame))
  if k is None and frame == 1 and sop not in multi:
    k = index.get((sop, None))  # a single-frame source referenced as its frame 1
  if k is None:
    if frame is None and sop in multi:
      raise LabelRejected(f"a {what} references a multi-frame image without {tag_name('ReferencedFrameNumber')}")
    raise LabelRejected(f"a {what} references an instance or frame not in this volume "
                        f"({tag_name('ReferencedSOPInstanceUID')})")
  return k


class _Grid:
  """The volume's geometry as arrays: slice positions, their distance along the normal, cosines, spacing."""

  def __init__(self, plan: VolumePlan):
    first = plan.slices[0]
    self.shape = (len(plan.slices), first.rows, first.columns)
    direction = np.asarray(plan.direction, dtype=np.float64).reshape(3, 3)
    self.row, self.col, self.normal = direction[:, 0], direction[:, 1], direction[:, 2]
    self.positions = np.asarray([s.position for s in plan.slices], dtype=np.float64)
    self.d = self.positions @ self.normal
    self.spacing = tuple(float(x) for x in plan.spacing)  # (z, y, x)
    self.origin = np.asarray(plan.origin, dtype=np.float64)

  def nearest_slice(self, d: float) -> tuple[int, float]:
    """(index of the slice nearest to position d along the normal, its distance)."""
    k = int(np.clip(np.searchsorted(self.d, d), 1, len(self.d) - 1))
    k = k - 1 if abs(self.d[k - 1] - d) <= abs(self.d[k] - d) else k
    return k, float(abs(self.d[k] - d))

  def affine(self) -> np.ndarray:
    """4x4 LPS: (i, j, k, 1) -> the voxel centre, on the plan's regular grid."""
    out = np.eye(4)
    out[:3, 0] = self.row * self.spacing[2]
    out[:3, 1] = self.col * self.spacing[1]
    out[:3, 2] = self.normal * self.spacing[0]
    out[:3, 3] = self.origin
    return out


class _Canvas:
  """The label volume being painted: class ids (overlap of different classes rejected) or channels."""

  def __init__(self, shape: tuple[int, int, int], config: LabelConfig, parts: str):
    self.channels = num_channels(config)
    dtype = np.dtype(label_dtype(config))
    full = (*shape, self.channels) if self.channels else shape
    if math.prod(full) * dtype.itemsize > MAX_LABEL_BYTES:
      raise LabelRejected(f"label volume over the size limit: voxels x channels exceeds {MAX_LABEL_BYTES} bytes")
    self.out = np.zeros(full, dtype=dtype)
    self.parts = parts

  def paint(self, k: int, mask: np.ndarray, class_id: int) -> None:
    if class_id == IGNORED or not mask.any():
      return
    if self.channels:
      self.out[k, :, :, class_id - 1][mask] = 1
      return
    plane = self.out[k]
    there = plane[mask]
    if np.any((there != 0) & (there != class_id)):
      raise LabelRejected(f"{self.parts} of different classes overlap: use --label_layout=channels")
    plane[mask] = class_id


def _in_plane_error(orientation, spacing, slice_: SliceHeader) -> float:
  """The largest distance between a frame's voxel centres and the slice's when both start at one point
  (orientation and pixel spacing only), found at the frame's corners."""
  r0, c0 = np.asarray(orientation[:3]), np.asarray(orientation[3:])
  r1, c1 = np.asarray(slice_.orientation[:3]), np.asarray(slice_.orientation[3:])
  dr = r0 * spacing[1] - r1 * slice_.pixel_spacing[1]
  dc = c0 * spacing[0] - c1 * slice_.pixel_spacing[0]
  w, h = slice_.columns - 1, slice_.rows - 1
  return float(max(np.linalg.norm(i * dr + j * dc) for i in (0, w) for j in (0, h)))


def _place_seg_frames(plan: VolumePlan, header: LabelHeader, grid: _Grid, tol: float) -> list[int]:
  """The slice of every SEG frame, every frame checked against its slice's geometry."""
  first = plan.slices[0]
  if (header.rows, header.columns) != (first.rows, first.columns):
    raise LabelRejected(f"SEG frame size ({tag_name('Rows')} x {tag_name('Columns')}) differs from the series'")
  counts: dict[int, int] = {}
  for f in header.frames:
    counts[f.segment] = counts.get(f.segment, 0) + 1
  for segment, n in sorted(counts.items()):
    if n > len(plan.slices):
      raise LabelRejected(f"more frames for segment {segment} ({n}) than the volume has slices ({len(plan.slices)})")
  index, multi = _slice_index(plan)
  placed: dict[tuple[int, int], int] = {}
  in_plane: dict[tuple, float] = {}
  out = []
  for number, f in enumerate(header.frames, start=1):
    if f.sources:
      ks = {_lookup(index, multi, sop, frame, "SEG frame") for sop, frame in f.sources}
      if len(ks) > 1:
        raise LabelRejected("a SEG frame references several slices of the volume")
      k = ks.pop()
    else:
      k, dz = grid.nearest_slice(float(np.asarray(f.position) @ grid.normal))
      if dz > tol:
        raise LabelRejected(f"a SEG frame lies on no slice of the volume ({tag_name('PlanePositionSequence')}: "
                            f"{dz:.3f} mm from the nearest, tolerance {tol} mm)")
    s = plan.slices[k]
    if f.position is not None:
      off = float(np.linalg.norm(np.asarray(f.position) - grid.positions[k]))
      if off > tol:
        raise LabelRejected(f"a SEG frame's plane position ({tag_name('ImagePositionPatient')}) lies {off:.3f} mm "
                            f"from its slice's (tolerance {tol} mm)")
    key = (f.orientation, f.pixel_spacing, s.orientation, s.pixel_spacing)
    if key not in in_plane:
      in_plane[key] = _in_plane_error(f.orientation, f.pixel_spacing, s)
    if in_plane[key] > tol:
      raise LabelRejected(f"a SEG frame's orientation or pixel spacing ({tag_name('ImageOrientationPatient')}, "
                          f"{tag_name('PixelSpacing')}) differs from its slice's: voxels up to "
                          f"{in_plane[key]:.3f} mm apart (tolerance {tol} mm)")
    if (f.segment, k) in placed:
      raise LabelRejected(f"two SEG frames ({placed[(f.segment, k)]} and {number}) for segment {f.segment} "
                          f"on one slice")
    placed[(f.segment, k)] = number
    out.append(k)
  return out


def _seg_frames(ds, header: LabelHeader) -> Iterator[np.ndarray]:
  """The SEG's stored frames in frame order, one at a time: native BINARY frames unpacked from their bit
  range (frames are not byte-aligned when Rows x Columns is not a multiple of 8), native FRACTIONAL frames
  as uint8 views, encapsulated ones decoded by highdicom's `decode_frame`. (Building a highdicom
  `Segmentation` would index every frame's functional groups again, which `read_label_header` did:
  0.27 s of a 160-frame SEG.)"""
  rows, columns, n = header.rows, header.columns, header.number_of_frames
  pixels = rows * columns
  syntax = UID(str(ds.file_meta.get("TransferSyntaxUID") or "1.2.840.10008.1.2"))
  binary = header.segmentation_type == "BINARY"
  if syntax.is_encapsulated:
    bits = 1 if binary else 8
    count = 0
    for value in pydicom.encaps.generate_frames(ds.PixelData, number_of_frames=n):
      yield highdicom.frame.decode_frame(value, syntax, rows, columns, 1, bits, bits, "MONOCHROME2", 0, None,
                                         index=count)
      count += 1
    if count < n:  # never a silently shorter label
      raise LabelRejected(f"SEG pixel data holds {count} frames, {tag_name('NumberOfFrames')} says {n}")
    return
  data = np.frombuffer(ds.PixelData, np.uint8)
  for i in range(n):
    if binary:
      first, last = i * pixels, (i + 1) * pixels
      chunk = np.unpackbits(data[first // 8:(last + 7) // 8], bitorder="little")
      yield chunk[first % 8:first % 8 + pixels].reshape(rows, columns)
    else:
      yield data[i * pixels:(i + 1) * pixels].reshape(rows, columns)


def _rasterize_seg(plan: VolumePlan, header: LabelHeader, data: bytes, config: LabelConfig) -> np.ndarray:
  grid = _Grid(plan)
  slices = _place_seg_frames(plan, header, grid, config.tolerance_mm)
  canvas = _Canvas(grid.shape, config, "segments")
  ds = _read_dicom(data, "SEG", stop_before_pixels=False)
  for keyword, expected in (("Rows", header.rows), ("Columns", header.columns),
                            ("NumberOfFrames", header.number_of_frames)):
    if _int(ds, keyword) != expected:
      raise LabelRejected(f"{tag_name(keyword)} of the SEG changed since its header was read")
  if "PixelData" not in ds:
    raise LabelRejected("SEG without pixel data")
  bits = 1 if header.segmentation_type == "BINARY" else 8
  if not ds.file_meta.TransferSyntaxUID.is_encapsulated and (
      len(ds.PixelData) * 8 < header.rows * header.columns * header.number_of_frames * bits):
    raise LabelRejected(f"{tag_name('PixelData')} holds fewer bytes than {tag_name('Rows')} x "
                        f"{tag_name('Columns')} x {tag_name('NumberOfFrames')} require")
  class_of = dict(header.segments)
  for (frame, k), stored in zip(zip(header.frames, slices), _seg_frames(ds, header)):
    if stored.shape != (header.rows, header.columns):
      raise LabelRejected(f"SEG pixel data shape differs from {tag_name('Rows')} x {tag_name('Columns')}")
    if header.segmentation_type == "BINARY":
      mask = stored != 0
    else:
      mask = stored.astype(np.float64) / header.max_fractional_value >= config.fraction_threshold
    canvas.paint(k, mask, class_of[frame.segment])
  return canvas.out


def _fill(polygons: Sequence[tuple[np.ndarray, np.ndarray]], rows: int, columns: int) -> np.ndarray:
  """Even-odd fill of the union of polygons' edges (their XOR) at voxel centres; see the module docstring.

  Args:
    polygons: (x, y) vertex arrays in continuous (column, row) indices, each closed implicitly.
    rows, columns: the slice's size.

  Returns:
    [rows, columns] bool.
  """
  x0 = np.concatenate([x for x, _ in polygons])
  y0 = np.concatenate([y for _, y in polygons])
  x1 = np.concatenate([np.roll(x, -1) for x, _ in polygons])
  y1 = np.concatenate([np.roll(y, -1) for _, y in polygons])
  lo, hi = np.minimum(y0, y1), np.maximum(y0, y1)
  start = np.clip(np.ceil(lo), 0, rows).astype(np.int64)  # rows j with lo <= j < hi
  stop = np.clip(np.ceil(hi), 0, rows).astype(np.int64)
  n = np.maximum(stop - start, 0)
  counts = np.zeros(rows * (columns + 1), dtype=np.int64)
  edges = np.flatnonzero(n)
  # Edges in chunks of about _CROSSINGS_PER_CHUNK crossings: bounded memory for any contour.
  ends = np.cumsum(n[edges])
  begin = 0
  while begin < len(edges):
    end = int(np.searchsorted(ends, (ends[begin - 1] if begin else 0) + _CROSSINGS_PER_CHUNK, side="right"))
    end = max(end, begin + 1)
    e = edges[begin:end]
    ne = n[e]
    which = np.repeat(e, ne)
    j = start[which] + (np.arange(int(ne.sum())) - np.repeat(np.cumsum(ne) - ne, ne))
    t = (j - y0[which]) / (y1[which] - y0[which])
    xc = x0[which] + t * (x1[which] - x0[which])
    i = np.clip(np.ceil(xc), 0, columns).astype(np.int64)  # centres i >= xc are past the crossing
    counts += np.bincount(j * (columns + 1) + i, minlength=counts.size)
    begin = end
  parity = np.cumsum(counts.reshape(rows, columns + 1)[:, :columns], axis=1) & 1
  return parity.astype(bool)


def _crossings(polygons: Sequence[tuple[np.ndarray, np.ndarray]], rows: int) -> int:
  total = 0
  for _, y in polygons:
    y1 = np.roll(y, -1)
    start = np.clip(np.ceil(np.minimum(y, y1)), 0, rows)
    stop = np.clip(np.ceil(np.maximum(y, y1)), 0, rows)
    total += int(np.maximum(stop - start, 0).sum())
  return total


def _rasterize_rtstruct(plan: VolumePlan, header: LabelHeader, data: bytes, config: LabelConfig) -> np.ndarray:
  grid = _Grid(plan)
  _, rows, columns = grid.shape
  sz = grid.spacing[0]
  tol = config.tolerance_mm
  ds = _read_dicom(data, "RTSTRUCT", stop_before_pixels=True)
  st = _structure(ds, "", config)  # unsalted: the contours' references are the header's, salted
  if sum(c.points for c in st.contours) != header.contour_points or (
      len(st.contours) != len(header.contour_references)):
    raise LabelRejected("the RTSTRUCT changed since its header was read")
  index, multi = _slice_index(plan)
  per_roi: dict[int, dict[int, list[tuple[np.ndarray, np.ndarray]]]] = {}
  low, high = grid.d[0] - sz / 2 - tol, grid.d[-1] + sz / 2 + tol
  for contour, refs in zip(st.contours, header.contour_references):
    pts = _contour_points(contour.element)
    d = pts @ grid.normal
    if d.min() < low or d.max() > high:
      raise LabelRejected(f"contour outside the volume (ROI {contour.roi}: beyond the first or last slice)")
    k, _ = grid.nearest_slice(float(np.median(d)))
    off = float(np.max(np.abs(d - grid.d[k])))
    if off > tol:
      raise LabelRejected(f"contour off the slice grid (ROI {contour.roi}: a point lies {off:.3f} mm off the "
                          f"nearest slice along the normal, tolerance {tol} mm)")
    for sop, frame in refs:
      if _lookup(index, multi, sop, frame, "contour") != k:
        raise LabelRejected(f"a contour of ROI {contour.roi} references a slice other than the one it lies on "
                            f"({tag_name('ContourImageSequence')})")
    rel = pts - grid.positions[k]
    s = plan.slices[k]
    srow, scol = np.asarray(s.orientation[:3]), np.asarray(s.orientation[3:])
    # Indices to a millionth of a voxel: a vertex meant to be on a centre is on it (ties as documented).
    x = np.round(rel @ srow / s.pixel_spacing[1], 6)
    y = np.round(rel @ scol / s.pixel_spacing[0], 6)
    ex, ey = tol / s.pixel_spacing[1], tol / s.pixel_spacing[0]
    if x.min() < -0.5 - ex or x.max() > columns - 0.5 + ex or y.min() < -0.5 - ey or y.max() > rows - 0.5 + ey:
      raise LabelRejected(f"contour outside the volume (ROI {contour.roi}: beyond the slice's rows or columns)")
    per_roi.setdefault(contour.roi, {}).setdefault(k, []).append((x, y))
  total = sum(_crossings(polys, rows) for slices in per_roi.values() for polys in slices.values())
  if total > MAX_SCANLINE_CROSSINGS:
    raise LabelRejected(f"contours too complex: their edges cross more than {MAX_SCANLINE_CROSSINGS} rows")
  canvas = _Canvas(grid.shape, config, "ROIs")
  for roi in sorted(per_roi):
    for k, polygons in sorted(per_roi[roi].items()):
      canvas.paint(k, _fill(polygons, rows, columns), st.rois[roi])
  return canvas.out


def _nifti_axes(grid: _Grid, shape: tuple[int, ...], affine: np.ndarray, tol: float
                ) -> tuple[tuple[int, int, int], tuple[bool, bool, bool]]:
  """For volume axes (k, j, i): the NIfTI array axis each is, and whether it runs backwards.

  Raises:
    LabelRejected: the affine is not the volume's grid up to a permutation and flips of the
      array's axes, the shape differs once they are undone, or a voxel centre is off by more than tol.
  """
  lps = _LPS_FROM_RAS @ affine
  volume = grid.affine()
  linear = np.linalg.solve(volume[:3, :3], lps[:3, :3])  # volume index (i, j, k) per NIfTI index
  steps = np.linalg.norm(linear, axis=0)  # volume voxels per NIfTI voxel, along each NIfTI axis
  perm = np.round(linear / steps)
  if not (np.all(np.abs(perm).sum(axis=0) == 1) and np.all(np.abs(perm).sum(axis=1) == 1)):
    raise LabelRejected("label map affine disagrees with the series geometry (its axes are not the volume's "
                        "axes in any order)")
  sizes = (grid.shape[2], grid.shape[1], grid.shape[0])  # along i, j, k
  axis = [int(np.argmax(np.abs(perm[m]))) for m in range(3)]
  sign = [float(perm[m, axis[m]]) for m in range(3)]
  voxel_mm = (grid.spacing[2], grid.spacing[1], grid.spacing[0])
  stretch = max(abs(steps[axis[m]] - 1) * voxel_mm[m] * max(sizes[m] - 1, 1) for m in range(3))
  if stretch > tol:
    raise LabelRejected(f"label map affine disagrees with the series geometry (its voxel spacing differs from "
                        f"the volume's: {stretch:.3f} mm over the volume, tolerance {tol} mm)")
  if any(shape[axis[m]] != sizes[m] for m in range(3)):
    raise LabelRejected("label map shape differs from the volume (after undoing its axis order)")
  expected = np.eye(4)
  expected[:3, :3] = perm
  expected[:3, 3] = [0.0 if sign[m] > 0 else sizes[m] - 1.0 for m in range(3)]
  expected = volume @ expected
  corners = np.array([[a, b, c, 1.0] for a in (0, shape[0] - 1) for b in (0, shape[1] - 1)
                      for c in (0, shape[2] - 1)]).T
  error = float(np.max(np.linalg.norm((lps @ corners - expected @ corners)[:3], axis=0)))
  if error > tol:
    raise LabelRejected(f"label map affine disagrees with the series geometry: voxels up to {error:.3f} mm "
                        f"apart (tolerance {tol} mm)")
  return (axis[2], axis[1], axis[0]), (sign[2] < 0, sign[1] < 0, sign[0] < 0)


def _nifti_resampled(grid: _Grid, values: np.ndarray, affine: np.ndarray) -> np.ndarray:
  """Nearest neighbour (index floor(x + 0.5)) of the label map at every voxel centre; outside it 0."""
  depth, rows, columns = grid.shape
  to_index = np.linalg.inv(affine) @ _LPS_FROM_RAS @ grid.affine()  # (i, j, k, 1) -> NIfTI index
  jj, ii = np.meshgrid(np.arange(rows, dtype=np.float64), np.arange(columns, dtype=np.float64), indexing="ij")
  out = np.zeros(grid.shape, dtype=values.dtype)
  limits = np.asarray(values.shape)[:, None]
  for k in range(depth):
    points = np.stack([ii.ravel(), jj.ravel(), np.full(ii.size, float(k)), np.ones(ii.size)])
    index = np.floor((to_index @ points)[:3] + 0.5)
    inside = np.all((index >= 0) & (index < limits), axis=0)
    a = index[:, inside].astype(np.int64)
    plane = np.zeros(ii.size, dtype=values.dtype)
    plane[inside] = values[a[0], a[1], a[2]]
    out[k] = plane.reshape(rows, columns)
  return out


def _check_resampled(grid: _Grid, values: np.ndarray, affine: np.ndarray, labels: np.ndarray) -> None:
  """A resampled label map must keep its foreground: nearest neighbour keeps its volume in mm^3 to within
  the rounding at its edges, so keeping less than half says the map lies largely outside the volume."""
  before = np.count_nonzero(values) * abs(np.linalg.det(affine[:3, :3]))
  after = np.count_nonzero(labels) * math.prod(grid.spacing)
  if before and after < 0.5 * before:
    raise LabelRejected(f"resampled NIfTI label map keeps {after / before:.0%} of its foreground: it lies "
                        "largely outside the volume")


def _rasterize_nifti(plan: VolumePlan, header: LabelHeader, data: bytes, config: LabelConfig) -> np.ndarray:
  grid = _Grid(plan)
  image, shape, affine = _nifti_image(data, header.path, config.max_voxels)
  if shape != tuple(header.shape) or not np.array_equal(affine.ravel(), np.asarray(header.affine)):
    raise LabelRejected("the NIfTI changed since its header was read")
  canvas = _Canvas(grid.shape, config, "classes")  # sized and bounded before the values are read
  values = _nifti_values(image, shape, config)
  try:
    axes, flips = _nifti_axes(grid, shape, affine, config.tolerance_mm)
  except LabelRejected:
    if not config.resample:
      raise
    labels = _nifti_resampled(grid, values, affine)
    _check_resampled(grid, values, affine, labels)
  else:
    labels = np.transpose(values, axes)
    labels = labels[tuple(slice(None, None, -1) if f else slice(None) for f in flips)]
  if canvas.channels:
    for class_id in np.unique(labels):
      if class_id:
        canvas.out[..., int(class_id) - 1] = labels == class_id
  else:
    canvas.out[...] = labels
  return canvas.out
