"""DICOM headers → per-slice geometry and intensity facts, with nothing identifying.

`read_slices(fileobj, path, salt)` parses a file's header only (pixel data is not
read) and returns one `SliceHeader` per image frame (one for classic CT, one per
frame for Enhanced CT), or raises `Rejected` with the reason the file cannot be
part of a volume. Identifiers leave this module only as salted hashes, and only
a whitelist of geometry and intensity tags is kept: no names, dates, IDs,
institutions or private tags reach anything downstream.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from typing import BinaryIO

import numpy as np
import pydicom
from pydicom.errors import InvalidDicomError

CT_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.2"
ENHANCED_CT_STORAGE = "1.2.840.10008.5.1.4.1.1.2.1"
LEGACY_ENHANCED_CT_STORAGE = "1.2.840.10008.5.1.4.1.1.2.2"
CT_SOP_CLASSES = {CT_IMAGE_STORAGE, ENHANCED_CT_STORAGE, LEGACY_ENHANCED_CT_STORAGE}
_KNOWN_NON_CT = {
    "1.2.840.10008.5.1.4.1.1.7": "secondary capture",
    "1.2.840.10008.5.1.4.1.1.88.67": "dose report (structured report)",
    "1.2.840.10008.5.1.4.1.1.88.22": "structured report",
    "1.2.840.10008.5.1.4.1.1.88.33": "structured report",
    "1.2.840.10008.5.1.4.1.1.481.3": "RT structure set",
    "1.2.840.10008.5.1.4.1.1.66": "raw data",
    "1.2.840.10008.5.1.4.1.1.11.1": "presentation state",
}
_PIXEL_DATA_TAGS = (b"\xe0\x7f\x10\x00", b"\x7f\xe0\x00\x10", b"\xe0\x7f\x08\x00", b"\xe0\x7f\x09\x00")
ORIENTATION_DECIMALS = 4
SPACING_DECIMALS = 4


class Rejected(Exception):
  """The file (or frame) cannot be part of a volume; str(e) is the reason."""


@dataclasses.dataclass(frozen=True)
class SliceHeader:
  """One image plane: where it is, how to turn its stored values into HU, where its pixels are."""

  path: str
  frame: int | None  # index in a multi-frame file; None for single-frame files
  series_key: str  # salted hash of the grouping tags: same key, same candidate volume
  series_id: str  # salted hash of Study + Series Instance UID (stored in the record)
  patient_id: str  # salted hash of PatientID
  acquisition: str  # "acq=N" / "temporal=N" / "" : separates contrast phases
  position: tuple[float, float, float] | None  # ImagePositionPatient (LPS mm); None if absent
  orientation: tuple[float, ...]  # ImageOrientationPatient: row cosines, column cosines
  pixel_spacing: tuple[float, float]  # (between rows, between columns) mm
  rows: int
  columns: int
  slope: float
  intercept: float
  padding: tuple[int, int] | None  # (PixelPaddingValue, PixelPaddingRangeLimit or same)
  bits_stored: int
  pixel_representation: int
  instance_number: int | None
  spacing_between_slices: float | None
  bits_allocated: int = 16
  # Byte offset of native (uncompressed little-endian) single-frame pixel data in the
  # file, so the pixels can be read directly; None: decode with pydicom.
  pixel_offset: int | None = None


def salted_hash(salt: str, *parts: str) -> str:
  h = hashlib.blake2b(digest_size=16, key=salt.encode("utf-8")[:64])
  h.update("\x1f".join(parts).encode("utf-8"))
  return h.hexdigest()


def _floats(value, n: int, tag: str) -> tuple[float, ...]:
  try:
    out = tuple(float(v) for v in value)
  except (TypeError, ValueError):
    raise Rejected(f"invalid {tag}") from None
  if len(out) != n or not all(np.isfinite(out)):
    raise Rejected(f"invalid {tag}: expected {n} finite numbers")
  return out


def _require(ds, keyword: str):
  value = ds.get(keyword)
  if value is None or value == "":
    raise Rejected(f"missing mandatory tag {keyword}")
  return value


_NATIVE_LE = {"1.2.840.10008.1.2": False, "1.2.840.10008.1.2.1": True}  # syntax -> explicit VR


def _pixel_data(fileobj: BinaryIO, transfer_syntax: str, expected_bytes: int) -> tuple[bool, int | None]:
  """(has pixel data, offset of native pixel bytes or None), reading just past the element header.

  After dcmread(stop_before_pixels=True) the stream sits at the pixel data tag, if any.
  """
  try:
    start = fileobj.tell()
    tag = fileobj.read(4)
    if tag not in _PIXEL_DATA_TAGS:
      return False, None
    if transfer_syntax not in _NATIVE_LE or tag != _PIXEL_DATA_TAGS[0]:
      return True, None
    if _NATIVE_LE[transfer_syntax]:
      vr_and_length = fileobj.read(8)  # VR, 2 reserved bytes, 4-byte length
      length, header = struct.unpack_from("<I", vr_and_length, 4)[0], 12
    else:
      length, header = struct.unpack("<I", fileobj.read(4))[0], 8
    if length != expected_bytes:  # undefined length, odd padding, multi-frame: let pydicom decide
      return True, None
    return True, start + header
  except (OSError, ValueError, struct.error):
    return True, None


def _is_localizer(image_type) -> bool:
  values = [str(v).upper() for v in (image_type or [])]
  return any("LOCALIZER" in v or "PROJECTION IMAGE" in v for v in values)


def _padding(ds, pixel_representation: int, bits_allocated: int) -> tuple[int, int] | None:
  value = ds.get("PixelPaddingValue")
  if value is None:
    return None
  limit = ds.get("PixelPaddingRangeLimit", value)

  def signed(v: int) -> int:  # 'US or SS' may have been read as US
    v = int(v)
    if pixel_representation == 1 and v >= 1 << (bits_allocated - 1):
      v -= 1 << bits_allocated
    return v

  a, b = signed(value), signed(limit)
  return (min(a, b), max(a, b))


def read_slices(fileobj: BinaryIO, path: str, salt: str) -> list[SliceHeader]:
  """Header facts of one DICOM file (pixel data not read). Raises Rejected."""
  try:
    ds = pydicom.dcmread(fileobj, stop_before_pixels=True)
  except InvalidDicomError:
    raise Rejected("not DICOM (no DICM preamble)") from None
  except Exception as e:  # pydicom raises many types on a damaged header
    raise Rejected(f"unreadable or truncated DICOM header: {type(e).__name__}") from None
  sop_class = str(ds.get("SOPClassUID", ""))
  if sop_class in _KNOWN_NON_CT:
    raise Rejected(f"non-image object ({_KNOWN_NON_CT[sop_class]})")
  modality = str(ds.get("Modality", ""))
  if sop_class not in CT_SOP_CLASSES:
    raise Rejected(f"not a CT image (modality {modality or '?'}, SOP class {sop_class or '?'})")
  rows, columns = int(_require(ds, "Rows")), int(_require(ds, "Columns"))
  bits_allocated = int(_require(ds, "BitsAllocated"))
  transfer_syntax = str(getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", "") or "")
  has_pixels, pixel_offset = _pixel_data(
      fileobj, transfer_syntax, rows * columns * bits_allocated // 8 if bits_allocated in (8, 16, 32) else -1)
  if not has_pixels:
    raise Rejected("no pixel data")
  if _is_localizer(ds.get("ImageType")):
    raise Rejected("localizer (scout) image")
  if int(ds.get("SamplesPerPixel", 1)) != 1:
    raise Rejected("not a grayscale image (SamplesPerPixel != 1)")
  study = str(_require(ds, "StudyInstanceUID"))
  series = str(_require(ds, "SeriesInstanceUID"))
  frame_of_ref = str(ds.get("FrameOfReferenceUID", ""))
  bits_stored = int(ds.get("BitsStored", bits_allocated))
  pixel_representation = int(_require(ds, "PixelRepresentation"))
  patient = salted_hash(salt, "patient", str(ds.get("PatientID", "")))
  series_id = salted_hash(salt, "series", study, series)
  padding = _padding(ds, pixel_representation, bits_allocated)
  number_of_frames = int(ds.get("NumberOfFrames", 1) or 1)
  is_enhanced = "PerFrameFunctionalGroupsSequence" in ds

  common = dict(rows=rows, columns=columns, bits_stored=bits_stored, bits_allocated=bits_allocated,
                pixel_representation=pixel_representation, padding=padding, patient_id=patient,
                series_id=series_id)

  def key(orientation, pixel_spacing) -> str:
    return salted_hash(
        salt, "group", study, series, frame_of_ref,
        ",".join(f"{v:.{ORIENTATION_DECIMALS}f}" for v in orientation),
        f"{rows}x{columns}", ",".join(f"{v:.{SPACING_DECIMALS}f}" for v in pixel_spacing))

  if not is_enhanced:
    if number_of_frames != 1:
      raise Rejected(f"multi-frame image without functional groups ({number_of_frames} frames)")
    orientation = _floats(_require(ds, "ImageOrientationPatient"), 6, "ImageOrientationPatient")
    pixel_spacing = _floats(_require(ds, "PixelSpacing"), 2, "PixelSpacing")
    position = ds.get("ImagePositionPatient")
    position = _floats(position, 3, "ImagePositionPatient") if position else None
    slope = float(_require(ds, "RescaleSlope"))
    intercept = float(_require(ds, "RescaleIntercept"))
    acq = ds.get("AcquisitionNumber")
    temporal = ds.get("TemporalPositionIndex")
    acquisition = f"temporal={temporal}" if temporal not in (None, "") else (
        f"acq={acq}" if acq not in (None, "") else "")
    sbs = ds.get("SpacingBetweenSlices")
    instance = ds.get("InstanceNumber")
    return [SliceHeader(
        path=path, frame=None, series_key=key(orientation, pixel_spacing), acquisition=acquisition,
        position=position, orientation=orientation, pixel_spacing=pixel_spacing, slope=slope,
        intercept=intercept, instance_number=int(instance) if instance not in (None, "") else None,
        spacing_between_slices=float(sbs) if sbs not in (None, "") else None, pixel_offset=pixel_offset,
        **common)]

  # Enhanced / legacy-converted enhanced CT: geometry and rescale per frame.
  shared = ds.get("SharedFunctionalGroupsSequence")
  shared = shared[0] if shared else None
  per_frame = ds.PerFrameFunctionalGroupsSequence
  if len(per_frame) != number_of_frames:
    raise Rejected(f"{len(per_frame)} per-frame functional groups for {number_of_frames} frames")

  def group(item, name):
    for source in (item, shared):
      if source is not None and name in source and len(source[name].value):
        return source[name].value[0]
    return None

  out = []
  for i, item in enumerate(per_frame):
    frame_type = group(item, "CTImageFrameTypeSequence")
    if frame_type is not None and _is_localizer(frame_type.get("FrameType")):
      raise Rejected("localizer (scout) image")
    plane_pos = group(item, "PlanePositionSequence")
    plane_ori = group(item, "PlaneOrientationSequence")
    measures = group(item, "PixelMeasuresSequence")
    if plane_ori is None or measures is None:
      raise Rejected(f"missing mandatory tag PlaneOrientationSequence/PixelMeasuresSequence (frame {i})")
    orientation = _floats(_require(plane_ori, "ImageOrientationPatient"), 6, "ImageOrientationPatient")
    pixel_spacing = _floats(_require(measures, "PixelSpacing"), 2, "PixelSpacing")
    position = None
    if plane_pos is not None and plane_pos.get("ImagePositionPatient"):
      position = _floats(plane_pos.ImagePositionPatient, 3, "ImagePositionPatient")
    transform = group(item, "PixelValueTransformationSequence")
    if transform is None:
      slope, intercept = float(_require(ds, "RescaleSlope")), float(_require(ds, "RescaleIntercept"))
    else:
      slope, intercept = float(_require(transform, "RescaleSlope")), float(_require(transform, "RescaleIntercept"))
    content = group(item, "FrameContentSequence")
    temporal = content.get("TemporalPositionIndex") if content is not None else None
    stack = content.get("StackID") if content is not None else None
    acquisition = "/".join(x for x in (
        f"stack={stack}" if stack not in (None, "") else "",
        f"temporal={temporal}" if temporal not in (None, "") else "") if x)
    out.append(SliceHeader(
        path=path, frame=i, series_key=key(orientation, pixel_spacing), acquisition=acquisition,
        position=position, orientation=orientation, pixel_spacing=pixel_spacing, slope=slope,
        intercept=intercept, instance_number=i + 1, spacing_between_slices=None, **common))
  return out
