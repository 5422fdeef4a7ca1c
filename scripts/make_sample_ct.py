"""Writes synthetic DICOM CT series with known ground truth, for tests and benchmarks.

    python scripts/make_sample_ct.py OUT_DIR [--seed=0] [--big_slices=N] [--manifest=PATH]

Without `--big_slices` it writes `make_mixed_tree(OUT_DIR, seed)`: several
patients, studies and series (axial ascending/descending, oblique, every
transfer syntax that encodes here, localizer, padding, per-slice rescale,
contrast phases, Enhanced CT) plus broken series and non-DICOM junk, all
scattered under random nested folders with meaningless file names. With
`--big_slices=N` it writes one uncompressed 512x512xN series for benchmarks.

Every writer returns `SeriesTruth` records (one per expected outcome). Headers
come from pydicom's `CT_small.dcm` (and `eCT_Supplemental.dcm` for Enhanced
CT) with UIDs, geometry, rescale and identity tags replaced. The same seed
gives byte-identical files.

Transfer syntaxes: "explicit", "implicit", "rle" (pydicom's own RLE encoder),
"jpegls" (JPEG-LS lossless, pyjpegls), "jpeg2000" (JPEG 2000 lossless,
pylibjpeg-openjpeg), "jpeg_lossless" (JPEG Lossless SV1, Process 14: pydicom
has no encoder, so the explicit file is transcoded with python-gdcm).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import pydicom
import pydicom.data
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sequence import Sequence as DicomSequence
from pydicom.uid import (
  PYDICOM_IMPLEMENTATION_UID,
  UID,
  CTImageStorage,
  EnhancedCTImageStorage,
  ExplicitVRLittleEndian,
  ImplicitVRLittleEndian,
  JPEG2000Lossless,
  JPEGLosslessSV1,
  JPEGLSLossless,
  RLELossless,
  SecondaryCaptureImageStorage,
  generate_uid,
)

VOLUME = "volume"
# Rejection keywords used in `SeriesTruth.expected`.
LOCALIZER = "localizer"
MISSING_SLICE = "missing slice"
IRREGULAR_SPACING = "irregular spacing"
GANTRY_TILT = "gantry tilt"
CONFLICTING_DUPLICATE = "conflicting duplicate"
NO_PIXEL_DATA = "no pixel data"
SECONDARY_CAPTURE = "secondary capture"
NOT_DICOM = "not dicom"
TRUNCATED = "truncated"
MISSING_TAG = "missing tag"

AXIAL = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)
# Oblique cosines that are exact decimals (3-4-5 and 7-24-25 triangles):
# row (0.8, 0.6, 0), col (-0.576, 0.768, 0.28), normal (0.168, -0.224, 0.96).
OBLIQUE = (0.8, 0.6, 0.0, -0.576, 0.768, 0.28)
CORONAL = (1.0, 0.0, 0.0, 0.0, 0.0, -1.0)

TRANSFER_SYNTAXES = {
  "explicit": ExplicitVRLittleEndian,
  "implicit": ImplicitVRLittleEndian,
  "rle": RLELossless,
  "jpegls": JPEGLSLossless,
  "jpeg2000": JPEG2000Lossless,
  "jpeg_lossless": JPEGLosslessSV1,
}
_COMPRESSED_BY_PYDICOM = ("rle", "jpegls", "jpeg2000")
XRAY_DOSE_SR_STORAGE = UID("1.2.840.10008.5.1.4.1.1.88.67")

# A phantom maps normalized volume coordinates to HU. u runs over columns
# (x), v over rows (y), w over slices in sorted order (z); each spans
# [-1, 1] across the volume. Arrays broadcast: u (1, cols), v (rows, 1), w scalar.
Phantom = Callable[[np.ndarray, np.ndarray, float], np.ndarray]


@dataclasses.dataclass
class SeriesTruth:
  """What a correct converter should produce from `files`.

  Conventions (all coordinates DICOM patient LPS, millimetres):
  - `hu[k, j, i]`: slice k, row j, column i; slices sorted by increasing
    position along the slice normal. Padding (PixelPaddingValue, on stored
    values) is -1024. int16 when every slope/intercept is integral, else
    float32 (computed in float64 as stored * slope + intercept, then cast).
  - `spacing = (sz, sy, sx)`: sz from positions, sy = PixelSpacing[0]
    (between rows), sx = PixelSpacing[1] (between columns).
  - `origin`: ImagePositionPatient (x, y, z) of `hu[0]`, i.e. centre of the
    first voxel of the lowest slice along the normal.
  - `direction`: 3x3, one unit vector per ROW: direction[0] = row cosines
    (IOP[0:3], the way column index i grows), direction[1] = column cosines
    (IOP[3:6], the way row index j grows), direction[2] = normal =
    cross(direction[0], direction[1]) (the way k grows). Voxel centre:
    origin + i*sx*direction[0] + j*sy*direction[1] + k*sz*direction[2].
    SimpleITK/ITK store the transpose: reshape(GetDirection(), (3, 3)) ==
    direction.T, and GetSpacing() == spacing[::-1].
  - `expected`: VOLUME, or a rejection keyword (LOCALIZER, MISSING_SLICE, ...):
    no volume may be made from these files. hu/spacing/origin/direction are
    None then.
  - `phi`: identifying values planted in the files (name, IDs, dates, a
    private tag) that a de-identified output must not contain.
  """

  name: str
  patient_id: str
  series_uid: str
  study_uid: str
  hu: np.ndarray | None
  spacing: tuple[float, float, float] | None
  origin: tuple[float, float, float] | None
  direction: np.ndarray | None
  files: list[str]
  expected: str = VOLUME
  acquisition_number: int | None = None
  frame_uid: str = ""
  transfer_syntax: str = ""
  pixel_padding_value: int | None = None
  phi: dict[str, str] = dataclasses.field(default_factory=dict)
  note: str = ""

  def rejected(self, reason: str, note: str = "") -> SeriesTruth:
    """A copy that expects `reason` instead of a volume."""
    return dataclasses.replace(
      self, expected=reason, hu=None, spacing=None, origin=None, direction=None, note=note or self.note)


# ---------------------------------------------------------------- basics


def _rng(rng: np.random.Generator | None, seed: int | None) -> np.random.Generator:
  if rng is not None:
    return rng
  if seed is None:
    raise ValueError("pass rng= or seed=: refusing to generate data without a seed")
  return np.random.default_rng(seed)


def _uid(rng: np.random.Generator) -> str:
  """A UID under pydicom's root, derived from the generator (deterministic)."""
  return str(generate_uid(entropy_srcs=[f"synthct-{int(rng.integers(1 << 62))}"]))


def _ds_str(v: float) -> str:
  """Formats a float for a DS value (at most 16 characters, no exponent)."""
  v = 0.0 if abs(v) < 1e-9 else float(v)
  for digits in range(6, -1, -1):
    s = f"{v:.{digits}f}".rstrip("0").rstrip(".")
    if len(s) <= 16:
      return s if s not in ("-0", "") else "0"
  raise ValueError(f"cannot format {v!r} as DS")


def _ds_list(values: Sequence[float]) -> tuple[list[str], np.ndarray]:
  """DS strings and the floats a reader will parse back from them."""
  strs = [_ds_str(v) for v in values]
  return strs, np.array([float(s) for s in strs])


def _hex(rng: np.random.Generator, lo: int, hi: int) -> str:
  return "".join("0123456789abcdef"[d] for d in rng.integers(0, 16, size=int(rng.integers(lo, hi))))


def _random_name(rng: np.random.Generator, folder: str, style: str = "random", number: int = 0) -> str:
  """A unique file name in `folder`: meaningless hex (30% with .dcm), or IM<number>."""
  if style == "instance" and not os.path.exists(os.path.join(folder, f"IM{number:06d}")):
    return f"IM{number:06d}"
  while True:
    name = _hex(rng, 8, 25) + (".dcm" if rng.random() < 0.3 else "")
    if not os.path.exists(os.path.join(folder, name)):
      return name


@functools.cache
def _template(name: str) -> Dataset:
  return pydicom.dcmread(pydicom.data.get_testdata_file(name))


def _ct_header() -> Dataset:
  """CT_small.dcm without pixel data or trailing padding."""
  ds = copy.deepcopy(_template("CT_small.dcm"))
  for tag in (0x7FE00010, 0xFFFCFFFC, 0x00180088, 0x00204000):
    if tag in ds:
      del ds[tag]
  return ds


_FIRST = ["Jane", "Richard", "Edgar", "Maria", "Olu", "Ken"]
_LAST = ["Doe", "Roe", "Poe", "Moe", "Zoe"]


def make_phi(rng: np.random.Generator, patient_id: str, patient_name: str) -> dict[str, str]:
  """Realistic fake identifying values for one patient/study."""
  year = int(rng.integers(1935, 2005))
  return {
    "PatientName": patient_name,
    "PatientID": patient_id,
    "PatientBirthDate": f"{year:04d}{int(rng.integers(1, 13)):02d}{int(rng.integers(1, 29)):02d}",
    "OtherPatientID": f"HOSP{int(rng.integers(10**7, 10**8))}",
    "AccessionNumber": f"ACC{int(rng.integers(10**6, 10**7))}",
    "InstitutionName": "Saint Elsewhere General Hospital",
    "ReferringPhysicianName": f"{_LAST[int(rng.integers(len(_LAST)))]}^{_FIRST[int(rng.integers(len(_FIRST)))]}^^Dr",
    "PatientAddress": f"{int(rng.integers(1, 999))} Fake Street^^Springfield",
    "StudyDate": f"20{int(rng.integers(15, 25)):02d}{int(rng.integers(1, 13)):02d}{int(rng.integers(1, 29)):02d}",
    "Private": f"PHI {patient_name} {patient_id}",
  }


def _apply_phi(ds: Dataset, phi: dict[str, str]) -> None:
  ds.PatientName = phi["PatientName"]
  ds.PatientID = phi["PatientID"]
  ds.PatientBirthDate = phi["PatientBirthDate"]
  ds.AccessionNumber = phi["AccessionNumber"]
  ds.InstitutionName = phi["InstitutionName"]
  ds.ReferringPhysicianName = phi["ReferringPhysicianName"]
  ds.PatientAddress = phi["PatientAddress"]
  for kw in ("PerformingPhysicianName", "NameOfPhysiciansReadingStudy", "OperatorsName"):
    if kw in ds:  # eCT_Supplemental has real-looking names here
      setattr(ds, kw, phi["ReferringPhysicianName"])
  other = Dataset()
  other.PatientID = phi["OtherPatientID"]
  other.TypeOfPatientID = "TEXT"
  ds.OtherPatientIDsSequence = DicomSequence([other])
  for kw in ("StudyDate", "SeriesDate", "AcquisitionDate", "ContentDate", "InstanceCreationDate"):
    setattr(ds, kw, phi["StudyDate"])
  ds.private_block(0x0033, "SYNTHCT PHI", create=True).add_new(0x10, "LO", phi["Private"])


def _new_meta(ds: Dataset, transfer_syntax: str) -> None:
  meta = FileMetaDataset()
  meta.MediaStorageSOPClassUID = ds.SOPClassUID
  meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
  meta.TransferSyntaxUID = TRANSFER_SYNTAXES[transfer_syntax]
  meta.ImplementationClassUID = PYDICOM_IMPLEMENTATION_UID
  meta.ImplementationVersionName = "SYNTHCT_1"
  ds.file_meta = meta


def _gdcm_jpeg_lossless(src: str, dst: str) -> None:
  """Transcodes an uncompressed DICOM file to JPEG Lossless SV1 with GDCM."""
  import gdcm  # optional: only this syntax needs it

  reader = gdcm.ImageReader()
  reader.SetFileName(src)
  if not reader.Read():
    raise ValueError(f"gdcm cannot read {src}")
  change = gdcm.ImageChangeTransferSyntax()
  change.SetTransferSyntax(gdcm.TransferSyntax(gdcm.TransferSyntax.JPEGLosslessProcess14_1))
  change.SetInput(reader.GetImage())
  if not change.Change():
    raise ValueError(f"gdcm cannot encode {src} as JPEG Lossless")
  writer = gdcm.ImageWriter()
  writer.SetFileName(dst)
  writer.SetFile(reader.GetFile())
  writer.SetImage(change.GetOutput())
  if not writer.Write():
    raise ValueError(f"gdcm cannot write {dst}")


def _save(ds: Dataset, path: str, transfer_syntax: str, stored: np.ndarray | None = None) -> None:
  """Saves `ds` (uncompressed PixelData) in `transfer_syntax`, atomically."""
  if transfer_syntax not in TRANSFER_SYNTAXES:
    raise ValueError(f"transfer_syntax={transfer_syntax!r}, expected one of {sorted(TRANSFER_SYNTAXES)}")
  tmp = path + ".partial"
  if transfer_syntax in _COMPRESSED_BY_PYDICOM and stored is not None:
    ds.compress(TRANSFER_SYNTAXES[transfer_syntax], stored, generate_instance_uid=False)
    ds.save_as(tmp, enforce_file_format=True)
  elif transfer_syntax == "jpeg_lossless" and stored is not None:
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.save_as(tmp + ".raw", enforce_file_format=True)
    _gdcm_jpeg_lossless(tmp + ".raw", tmp)
    os.remove(tmp + ".raw")
  else:
    if transfer_syntax not in ("explicit", "implicit"):
      transfer_syntax = "explicit"  # no pixel data to compress
    ds.file_meta.TransferSyntaxUID = TRANSFER_SYNTAXES[transfer_syntax]
    ds.save_as(tmp, enforce_file_format=True)
  os.replace(tmp, path)


# ---------------------------------------------------------------- phantom


def body_phantom(u: np.ndarray, v: np.ndarray, w: float, *, contrast: bool = False) -> np.ndarray:
  """A torso-like phantom in HU, asymmetric along every axis (catches flips).

  Air -1000 outside, fat -90 rim, soft tissue 40, lungs -850 (only for
  w < 0.6), spine 1000, a bone sphere 700..1200 growing with w, aorta 40 (300
  with `contrast`), a 200 HU marker in the left-front corner for w < -0.3.
  """
  hu = np.full(np.broadcast_shapes(np.shape(u), np.shape(v)), -1000.0)
  hu[(u / 0.85) ** 2 + (v / 0.65) ** 2 < 1] = -90.0
  hu[(u / 0.78) ** 2 + (v / 0.58) ** 2 < 1] = 40.0
  if w < 0.6:
    for cx in (-0.38, 0.38):
      hu[((u - cx) / 0.24) ** 2 + ((v + 0.08) / 0.3) ** 2 < 1] = -850.0
  hu[(u / 0.12) ** 2 + ((v - 0.42) / 0.1) ** 2 < 1] = 1000.0
  hu[(u + 0.12) ** 2 + (v - 0.22) ** 2 < 0.07**2] = 300.0 if contrast else 40.0
  r2 = 0.35**2 - (w - 0.3) ** 2
  if r2 > 0:
    hu[(u - 0.4) ** 2 + (v - 0.15) ** 2 < r2] = 700.0 + 250.0 * (w + 1.0)
  if w < -0.3:
    hu[(u > -0.55) & (u < -0.4) & (v > -0.45) & (v < -0.3)] = 200.0
  return hu


def contrast_phantom(u: np.ndarray, v: np.ndarray, w: float) -> np.ndarray:
  """`body_phantom` in an arterial phase (aorta 300 HU)."""
  return body_phantom(u, v, w, contrast=True)


def _stored_range(bits_stored: int, pixel_representation: int) -> tuple[int, int]:
  if pixel_representation:
    return -(1 << (bits_stored - 1)), (1 << (bits_stored - 1)) - 1
  return 0, (1 << bits_stored) - 1


def _make_slice(
  rng: np.random.Generator, phantom: Phantom, rows: int, cols: int, w: float, slope: float,
  intercept: float, lo: int, hi: int, pad: int | None, noise_hu: float,
) -> tuple[np.ndarray, np.ndarray]:
  """(stored int array, HU float64 truth) for one slice."""
  u = ((np.arange(cols) - (cols - 1) / 2) / (cols / 2))[None, :]
  v = ((np.arange(rows) - (rows - 1) / 2) / (rows / 2))[:, None]
  hu = phantom(u, v, w) + rng.normal(0.0, noise_hu, size=(rows, cols))
  stored = np.clip(np.rint((hu - intercept) / slope), lo, hi)
  if pad is not None:
    fov = (u**2 + v**2) <= 1.0
    stored[fov & (stored == pad)] += 1 if pad < hi else -1
    stored[~fov] = pad
  truth = stored * slope + intercept
  if pad is not None:
    truth[stored == pad] = -1024.0
  return stored.astype(np.int64), truth


def _truth_dtype(truth: np.ndarray, rescales: Sequence[tuple[float, float]]) -> np.ndarray:
  integral = all(float(s).is_integer() and float(b).is_integer() for s, b in rescales)
  if integral and truth.min() >= -32768 and truth.max() <= 32767:
    return truth.astype(np.int16)
  return truth.astype(np.float32)


# ---------------------------------------------------------------- series writer


def _geometry(
  orientation: Sequence[float], pixel_spacing: Sequence[float],
) -> tuple[list[str], np.ndarray, list[str], np.ndarray]:
  """(IOP strings, direction rows, PixelSpacing strings, parsed spacing)."""
  iop_s, iop = _ds_list(orientation)
  row, col = iop[:3], iop[3:]
  if abs(row @ row - 1) > 1e-6 or abs(col @ col - 1) > 1e-6 or abs(row @ col) > 1e-6:
    raise ValueError(f"orientation={tuple(orientation)} is not two orthonormal vectors")
  ps_s, ps = _ds_list(pixel_spacing)
  return iop_s, np.stack([row, col, np.cross(row, col)]), ps_s, ps


def write_series(
  out_dir: str,
  *,
  patient_id: str,
  rng: np.random.Generator | None = None,
  seed: int | None = None,
  patient_name: str = "Doe^Jane",
  phi: dict[str, str] | None = None,
  study_uid: str | None = None,
  series_uid: str | None = None,
  frame_uid: str | None = None,
  rows: int = 64,
  cols: int = 64,
  num_slices: int = 20,
  pixel_spacing: tuple[float, float] = (0.7, 0.7),
  slice_spacing: float = 1.25,
  slice_thickness: float = 2.0,
  origin: tuple[float, float, float] = (-100.0, -120.0, -50.0),
  orientation: Sequence[float] = AXIAL,
  descending: bool = False,
  instance_numbers: str = "consistent",
  first_instance_number: int = 1,
  slope: float = 1.0,
  intercept: float = -1024.0,
  slopes_per_slice: Sequence[float] | None = None,
  pixel_padding_value: int | None = None,
  bits_stored: int = 16,
  pixel_representation: int = 1,
  transfer_syntax: str = "explicit",
  file_names: str = "random",
  subdir: str | None = None,
  acquisition_number: int | None = None,
  series_number: int = 1,
  series_description: str = "AXIAL 1.25",
  phantom: Phantom = body_phantom,
  noise_hu: float = 8.0,
  name: str = "",
) -> SeriesTruth:
  """Writes one single-frame CT series and returns its truth.

  `origin` is the ImagePositionPatient of the lowest slice along the normal
  (so truth.origin == origin); slice k sits at origin + k*slice_spacing*normal.
  `descending` makes InstanceNumber 1 the highest slice; `instance_numbers`
  "reversed" flips that again and "shuffled" permutes them. `slopes_per_slice`
  is indexed in sorted (truth) order and overrides `slope`. A
  `pixel_padding_value` (stored value) fills pixels outside the circular
  reconstruction FOV. `acquisition_number=None` leaves the tag out.
  """
  rng = _rng(rng, seed)
  if instance_numbers not in ("consistent", "reversed", "shuffled"):
    raise ValueError(f"instance_numbers={instance_numbers!r}")
  if bits_stored not in (12, 16) or pixel_representation not in (0, 1):
    raise ValueError(f"bits_stored={bits_stored}, pixel_representation={pixel_representation}")
  if slopes_per_slice is not None and len(slopes_per_slice) != num_slices:
    raise ValueError(f"slopes_per_slice has {len(slopes_per_slice)} values for {num_slices} slices")
  lo, hi = _stored_range(bits_stored, pixel_representation)
  if pixel_padding_value is not None and not lo <= pixel_padding_value <= hi:
    raise ValueError(f"pixel_padding_value={pixel_padding_value} outside stored range [{lo}, {hi}]")
  folder = os.path.join(out_dir, subdir) if subdir else out_dir
  os.makedirs(folder, exist_ok=True)

  study_uid = study_uid or _uid(rng)
  series_uid = series_uid or _uid(rng)
  frame_uid = frame_uid or _uid(rng)
  phi = phi or make_phi(rng, patient_id, patient_name)
  iop_s, direction, ps_s, ps = _geometry(orientation, pixel_spacing)
  normal = direction[2]
  slopes = [float(s) for s in slopes_per_slice] if slopes_per_slice is not None else [float(slope)] * num_slices

  # InstanceNumber for sorted slice k.
  order = np.arange(num_slices)[::-1] if descending else np.arange(num_slices)
  if instance_numbers == "reversed":
    order = order[::-1]
  elif instance_numbers == "shuffled":
    order = rng.permutation(order)
  instance_of = np.empty(num_slices, dtype=int)
  instance_of[order] = np.arange(num_slices) + first_instance_number

  base = _ct_header()
  _apply_phi(base, phi)
  base.SpecificCharacterSet = "ISO_IR 100"
  base.ImageType = ["ORIGINAL", "PRIMARY", "AXIAL"]
  base.SOPClassUID = CTImageStorage
  base.StudyInstanceUID, base.SeriesInstanceUID, base.FrameOfReferenceUID = study_uid, series_uid, frame_uid
  base.StudyID = "S" + phi["AccessionNumber"][-5:]
  base.StudyDescription = "CT CHEST ABDOMEN"
  base.SeriesDescription = series_description
  base.SeriesNumber = series_number
  if acquisition_number is None:
    del base.AcquisitionNumber
  else:
    base.AcquisitionNumber = acquisition_number
  base.ImageOrientationPatient = iop_s
  base.PixelSpacing = ps_s
  base.SliceThickness = _ds_str(slice_thickness)
  base.Rows, base.Columns = rows, cols
  base.BitsAllocated, base.BitsStored, base.HighBit = 16, bits_stored, bits_stored - 1
  base.PixelRepresentation = pixel_representation
  base.SamplesPerPixel, base.PhotometricInterpretation = 1, "MONOCHROME2"
  del base.PixelPaddingValue
  if pixel_padding_value is not None:
    base.add_new(0x00280120, "SS" if pixel_representation else "US", pixel_padding_value)
  base.RescaleType = "HU"
  base.WindowCenter, base.WindowWidth = "40", "400"

  files: list[str] = []
  truth_slices: list[np.ndarray] = []
  rescales: list[tuple[float, float]] = []
  origin_ds = None
  for k in range(num_slices):
    w = (k - (num_slices - 1) / 2) / (num_slices / 2)
    s_str, (s,) = _ds_list([slopes[k]])
    b_str, (b,) = _ds_list([intercept])
    stored, truth = _make_slice(rng, phantom, rows, cols, w, s, b, lo, hi, pixel_padding_value, noise_hu)
    truth_slices.append(truth)
    rescales.append((s, b))
    ipp_s, ipp = _ds_list(np.asarray(origin, dtype=float) + k * slice_spacing * normal)
    origin_ds = ipp if k == 0 else origin_ds
    ds = base  # every per-slice tag is set below; copying the header costs more than writing it
    ds.SOPInstanceUID = _uid(rng)
    ds.InstanceNumber = int(instance_of[k])
    ds.ImagePositionPatient = ipp_s
    ds.SliceLocation = _ds_str(float(normal @ ipp))
    ds.RescaleSlope, ds.RescaleIntercept = s_str[0], b_str[0]
    arr = stored.astype(np.int16 if pixel_representation else np.uint16)
    ds.PixelData = arr.astype(arr.dtype.newbyteorder("<")).tobytes()
    ds["PixelData"].VR = "OW"
    _new_meta(ds, transfer_syntax)
    files.append(os.path.join(folder, _random_name(rng, folder, file_names, int(instance_of[k]))))
    _save(ds, files[-1], transfer_syntax, arr)

  # Files listed in InstanceNumber order, like a PACS export.
  files = [files[k] for k in np.argsort(instance_of, kind="stable")]
  hu = _truth_dtype(np.stack(truth_slices), rescales)
  return SeriesTruth(
    name=name or f"{patient_id}_{series_number}", patient_id=patient_id, series_uid=series_uid,
    study_uid=study_uid, hu=hu, spacing=(float(slice_spacing), float(ps[0]), float(ps[1])),
    origin=tuple(float(x) for x in origin_ds), direction=direction, files=files,
    acquisition_number=acquisition_number, frame_uid=frame_uid,
    transfer_syntax=str(TRANSFER_SYNTAXES[transfer_syntax]), pixel_padding_value=pixel_padding_value, phi=phi)


def write_big_series(out_dir: str, num_slices: int, rows: int = 512, cols: int = 512, seed: int = 0) -> SeriesTruth:
  """One uncompressed axial series for benchmarks (GE-like: signed, padding -2000)."""
  return write_series(
    out_dir, seed=seed, patient_id="BENCH0001", patient_name="Bench^Mark", rows=rows, cols=cols,
    num_slices=num_slices, pixel_spacing=(0.75, 0.75), slice_spacing=0.625, slice_thickness=1.25,
    origin=(-192.0, -192.0, -300.0), pixel_padding_value=-2000, name="big", noise_hu=10.0)


# ---------------------------------------------------------------- pathologies


def _read(path: str) -> Dataset:
  return pydicom.dcmread(path)


def _resave(ds: Dataset, path: str) -> None:
  tmp = path + ".partial"
  ds.save_as(tmp, enforce_file_format=True)
  os.replace(tmp, path)


def _positions(truth: SeriesTruth) -> list[tuple[float, str]]:
  """(position along the normal, path) for each file, sorted by position."""
  normal = truth.direction[2]
  out = []
  for p in truth.files:
    ds = pydicom.dcmread(p, stop_before_pixels=True)
    out.append((float(normal @ np.array(ds.ImagePositionPatient, dtype=float)), p))
  return sorted(out)


def _uncompressed_copy(path: str) -> Dataset:
  ds = _read(path)
  if ds.file_meta.TransferSyntaxUID.is_compressed:
    ds.decompress()
  return ds


def add_localizer(truth: SeriesTruth, rng: np.random.Generator) -> list[SeriesTruth]:
  """Adds a coronal scout with the same series UID, rows and columns.

  Returns [truth with the same volume, a LOCALIZER truth for the scout file].
  """
  first = _positions(truth)[0][1]
  ds = _uncompressed_copy(first)
  ds.ImageType = ["ORIGINAL", "PRIMARY", "LOCALIZER"]
  ds.ImageOrientationPatient = [_ds_str(x) for x in CORONAL]
  ds.ImagePositionPatient = [_ds_str(x) for x in (truth.origin[0], truth.origin[1] + 20.0, truth.origin[2] + 200.0)]
  ds.SOPInstanceUID = _uid(rng)
  ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
  ds.InstanceNumber = len(truth.files) + 1
  ds.SliceThickness = "1"
  ds.PixelSpacing = ["1.5", "1.5"]
  arr = ds.pixel_array
  gradient = np.linspace(0, 400, ds.Rows)[:, None].astype(arr.dtype)
  ds.PixelData = (arr // 2 + gradient).astype(arr.dtype).tobytes()
  ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
  folder = os.path.dirname(first)
  path = os.path.join(folder, _random_name(rng, folder))
  _resave(ds, path)
  scout = dataclasses.replace(truth, name=truth.name + "_scout", files=[path]).rejected(
    LOCALIZER, "coronal scout inside the axial series; the axial volume is still expected")
  return [truth, scout]


def drop_middle_slice(truth: SeriesTruth) -> SeriesTruth:
  """Deletes the middle slice's file: a gap of 2x the spacing."""
  positions = _positions(truth)
  _, path = positions[len(positions) // 2]
  os.remove(path)
  files = [f for f in truth.files if f != path]
  return dataclasses.replace(truth, files=files).rejected(MISSING_SLICE, "middle slice deleted (one 2x gap)")


def make_irregular_spacing(truth: SeriesTruth, factor: float = 1.5) -> SeriesTruth:
  """Moves every slice above the middle so that one gap is `factor` x spacing."""
  positions = _positions(truth)
  shift = (factor - 1.0) * truth.spacing[0] * truth.direction[2]
  for _, path in positions[len(positions) // 2:]:
    ds = _read(path)
    ipp = np.array(ds.ImagePositionPatient, dtype=float) + shift
    ds.ImagePositionPatient = [_ds_str(x) for x in ipp]
    ds.SliceLocation = _ds_str(float(truth.direction[2] @ ipp))
    _resave(ds, path)
  return truth.rejected(IRREGULAR_SPACING, f"one gap is {factor}x the others")


def apply_gantry_tilt(truth: SeriesTruth, degrees: float = 15.0) -> SeriesTruth:
  """Shears positions: y += tan(tilt) * (z - z0), orientation unchanged."""
  t = math.tan(math.radians(degrees))
  z0 = truth.origin[2]
  for path in truth.files:
    ds = _read(path)
    ipp = np.array(ds.ImagePositionPatient, dtype=float)
    ipp[1] += t * (ipp[2] - z0)
    ds.ImagePositionPatient = [_ds_str(x) for x in ipp]
    ds.GantryDetectorTilt = _ds_str(degrees)
    _resave(ds, path)
  return truth.rejected(GANTRY_TILT, f"{degrees} degree tilt; positions are not along the normal")


def add_identical_duplicate(truth: SeriesTruth, rng: np.random.Generator) -> SeriesTruth:
  """Copies one file byte for byte under another name: still a valid volume."""
  src = truth.files[len(truth.files) // 3]
  folder = os.path.dirname(src)
  dst = os.path.join(folder, _random_name(rng, folder))
  shutil.copyfile(src, dst)
  return dataclasses.replace(truth, files=truth.files + [dst], note="one byte-identical duplicate file (to drop)")


def add_conflicting_duplicate(truth: SeriesTruth, rng: np.random.Generator) -> SeriesTruth:
  """A second instance at the middle slice's position with different pixels."""
  _, src = _positions(truth)[len(truth.files) // 2]
  ds = _uncompressed_copy(src)
  arr = ds.pixel_array.copy()
  r, c = arr.shape
  arr[r // 4: r // 2, c // 4: c // 2] = arr[r // 4: r // 2, c // 4: c // 2] + 100
  ds.PixelData = arr.tobytes()
  ds.SOPInstanceUID = _uid(rng)
  ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
  ds.InstanceNumber = len(truth.files) + 1
  ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
  folder = os.path.dirname(src)
  dst = os.path.join(folder, _random_name(rng, folder))
  _resave(ds, dst)
  return dataclasses.replace(truth, files=truth.files + [dst]).rejected(
    CONFLICTING_DUPLICATE, "two instances at one position with different pixels")


def truncate_slice(truth: SeriesTruth) -> SeriesTruth:
  """Cuts the middle slice's file half way through its pixel data.

  Dropping that file would leave a missing slice, so no volume either way.
  """
  _, path = _positions(truth)[len(truth.files) // 2]
  with open(path, "rb") as f:
    data = f.read()
  ds = pydicom.dcmread(path)
  pixel_bytes = len(ds.PixelData)
  with open(path, "wb") as f:
    f.write(data[: len(data) - pixel_bytes // 2])
  return truth.rejected(TRUNCATED, "middle slice cut in the middle of PixelData")


def remove_tag(truth: SeriesTruth, keyword: str = "ImagePositionPatient") -> SeriesTruth:
  """Deletes a mandatory tag from the middle slice (no volume either way)."""
  _, path = _positions(truth)[len(truth.files) // 2]
  ds = _read(path)
  delattr(ds, keyword)
  _resave(ds, path)
  return truth.rejected(MISSING_TAG, f"middle slice lacks {keyword}")


def write_contrast_phases(
  out_dir: str, *, rng: np.random.Generator, patient_id: str, study_uid: str | None = None, num_slices: int = 12,
  name: str = "", **kwargs,
) -> list[SeriesTruth]:
  """Two acquisitions (plain, arterial) in one series: positions repeat.

  Same Study/Series/FrameOfReference UIDs, AcquisitionNumber 1 and 2,
  InstanceNumbers continuing. Returns two VOLUME truths.
  """
  study_uid = study_uid or _uid(rng)
  series_uid, frame_uid = _uid(rng), _uid(rng)
  name = name or f"{patient_id}_phases"
  common = dict(rng=rng, patient_id=patient_id, study_uid=study_uid, series_uid=series_uid, frame_uid=frame_uid,
                num_slices=num_slices, **kwargs)
  plain = write_series(out_dir, acquisition_number=1, phantom=body_phantom, name=name + "_a1", **common)
  common["phi"] = plain.phi
  arterial = write_series(out_dir, acquisition_number=2, phantom=contrast_phantom, name=name + "_a2",
                          first_instance_number=num_slices + 1, **common)
  return [plain, arterial]


def _study_header(rng: np.random.Generator, phi: dict[str, str], study_uid: str, sop_class: str) -> Dataset:
  ds = Dataset()
  ds.SpecificCharacterSet = "ISO_IR 100"
  ds.SOPClassUID = sop_class
  ds.SOPInstanceUID = _uid(rng)
  ds.StudyInstanceUID = study_uid
  ds.SeriesInstanceUID = _uid(rng)
  ds.StudyTime = ds.SeriesTime = ds.ContentTime = "101500"
  ds.Manufacturer = "GE MEDICAL SYSTEMS"
  ds.SeriesNumber, ds.InstanceNumber = 999, 1
  ds.PatientSex = "O"
  _apply_phi(ds, phi)
  return ds


def write_dose_report(out_dir: str, *, rng: np.random.Generator, phi: dict[str, str], study_uid: str) -> SeriesTruth:
  """An X-Ray Radiation Dose SR (no PixelData) in the study."""
  os.makedirs(out_dir, exist_ok=True)
  ds = _study_header(rng, phi, study_uid, XRAY_DOSE_SR_STORAGE)
  ds.Modality = "SR"
  ds.ValueType = "CONTAINER"
  ds.ContinuityOfContent = "SEPARATE"
  ds.CompletionFlag, ds.VerificationFlag = "COMPLETE", "UNVERIFIED"
  title = Dataset()
  title.CodeValue, title.CodingSchemeDesignator, title.CodeMeaning = "113701", "DCM", "X-Ray Radiation Dose Report"
  ds.ConceptNameCodeSequence = DicomSequence([title])
  item = Dataset()
  item.RelationshipType, item.ValueType = "CONTAINS", "TEXT"
  concept = Dataset()
  concept.CodeValue, concept.CodingSchemeDesignator, concept.CodeMeaning = "113835", "DCM", "CTDIvol"
  item.ConceptNameCodeSequence = DicomSequence([concept])
  item.TextValue = "CTDIvol 8.2 mGy, DLP 412 mGy.cm"
  ds.ContentSequence = DicomSequence([item])
  _new_meta(ds, "explicit")
  path = os.path.join(out_dir, _random_name(rng, out_dir))
  _save(ds, path, "explicit")
  return SeriesTruth(name=f"{phi['PatientID']}_dose_sr", patient_id=phi["PatientID"], series_uid=ds.SeriesInstanceUID,
                     study_uid=study_uid, hu=None, spacing=None, origin=None, direction=None, files=[path],
                     expected=NO_PIXEL_DATA, phi=phi, note="dose SR, no PixelData")


def write_secondary_capture(
  out_dir: str, *, rng: np.random.Generator, phi: dict[str, str], study_uid: str,
) -> SeriesTruth:
  """A dose screen capture: Secondary Capture, Modality CT, RGB, no geometry."""
  os.makedirs(out_dir, exist_ok=True)
  ds = _study_header(rng, phi, study_uid, SecondaryCaptureImageStorage)
  ds.Modality = "CT"
  ds.ImageType = ["DERIVED", "SECONDARY", "SCREEN SAVE"]
  ds.ConversionType = "WSD"
  ds.Rows, ds.Columns = 48, 64
  ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, "RGB", 0
  ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
  rgb = np.zeros((48, 64, 3), np.uint8)
  rgb[8:40, 8:56] = rng.integers(0, 255, size=3, dtype=np.uint8)
  ds.PixelData = rgb.tobytes()
  _new_meta(ds, "explicit")
  path = os.path.join(out_dir, _random_name(rng, out_dir))
  _save(ds, path, "explicit")
  return SeriesTruth(name=f"{phi['PatientID']}_screen", patient_id=phi["PatientID"], series_uid=ds.SeriesInstanceUID,
                     study_uid=study_uid, hu=None, spacing=None, origin=None, direction=None, files=[path],
                     expected=SECONDARY_CAPTURE, phi=phi, note="RGB screen capture, no geometry")


def write_junk(out_dir: str, *, rng: np.random.Generator) -> SeriesTruth:
  """Non-DICOM files: text, a real JPEG, an empty file, a DICM-magic stub."""
  from PIL import Image  # pillow is a core dependency

  os.makedirs(out_dir, exist_ok=True)
  paths = [os.path.join(out_dir, n) for n in ("README.txt", "scan.jpg", "empty", "DICOMDIR.bak")]
  paths.append(os.path.join(out_dir, _random_name(rng, out_dir)))
  with open(paths[0], "w") as f:
    f.write("Exported by PACS viewer. Not a DICOM file.\n")
  Image.fromarray(rng.integers(0, 255, size=(32, 32), dtype=np.uint8)).save(paths[1], quality=90)
  open(paths[2], "wb").close()
  with open(paths[3], "wb") as f:
    f.write(b"\0" * 128 + b"DICM" + rng.integers(0, 255, size=64, dtype=np.uint8).tobytes())
  with open(paths[4], "wb") as f:
    f.write(rng.integers(0, 255, size=700, dtype=np.uint8).tobytes())
  return SeriesTruth(name="junk", patient_id="", series_uid="", study_uid="", hu=None, spacing=None, origin=None,
                     direction=None, files=paths, expected=NOT_DICOM, note="text, JPEG, empty, bad DICM, random bytes")


# ---------------------------------------------------------------- Enhanced CT


def _enhanced_header() -> Dataset:
  """eCT_Supplemental.dcm minus pixel data, palette and per-frame groups."""
  ds = copy.deepcopy(_template("eCT_Supplemental.dcm"))
  for kw in ("PixelData", "RedPaletteColorLookupTableDescriptor", "GreenPaletteColorLookupTableDescriptor",
             "BluePaletteColorLookupTableDescriptor", "RedPaletteColorLookupTableData",
             "GreenPaletteColorLookupTableData", "BluePaletteColorLookupTableData", "PerFrameFunctionalGroupsSequence",
             "ReferencedRawDataSequence"):
    if kw in ds:
      delattr(ds, kw)
  ds.ImageType = ["ORIGINAL", "PRIMARY", "AXIAL", "NONE"]
  ds.PixelPresentation = "MONOCHROME"
  shared = ds.SharedFunctionalGroupsSequence[0]
  shared.CTImageFrameTypeSequence[0].FrameType = ["ORIGINAL", "PRIMARY", "AXIAL", "NONE"]
  shared.CTImageFrameTypeSequence[0].PixelPresentation = "MONOCHROME"
  del shared.RealWorldValueMappingSequence
  shared.FrameVOILUTSequence[0].WindowCenter, shared.FrameVOILUTSequence[0].WindowWidth = "40", "400"
  return ds


def write_enhanced_series(
  out_dir: str,
  *,
  patient_id: str,
  rng: np.random.Generator | None = None,
  seed: int | None = None,
  patient_name: str = "Doe^Jane",
  phi: dict[str, str] | None = None,
  study_uid: str | None = None,
  rows: int = 64,
  cols: int = 64,
  num_frames: int = 12,
  pixel_spacing: tuple[float, float] = (0.7, 0.7),
  slice_spacing: float = 1.25,
  slice_thickness: float = 2.0,
  origin: tuple[float, float, float] = (-100.0, -120.0, -50.0),
  orientation: Sequence[float] = AXIAL,
  frame_order: str = "shuffled",
  slope: float = 1.0,
  intercept: float = -1024.0,
  slopes_per_frame: Sequence[float] | None = None,
  transfer_syntax: str = "explicit",
  phantom: Phantom = body_phantom,
  subdir: str | None = None,
  name: str = "",
) -> SeriesTruth:
  """Writes one Enhanced CT file (all frames) and returns its truth.

  Orientation and pixel measures are shared functional groups; positions are
  per frame (PlanePositionSequence) in `frame_order` ("ascending",
  "descending", "shuffled"). With `slopes_per_frame` (sorted order) the
  PixelValueTransformationSequence moves into the per-frame groups.
  """
  rng = _rng(rng, seed)
  if frame_order not in ("ascending", "descending", "shuffled"):
    raise ValueError(f"frame_order={frame_order!r}")
  folder = os.path.join(out_dir, subdir) if subdir else out_dir
  os.makedirs(folder, exist_ok=True)
  study_uid = study_uid or _uid(rng)
  series_uid, frame_uid = _uid(rng), _uid(rng)
  phi = phi or make_phi(rng, patient_id, patient_name)
  iop_s, direction, ps_s, ps = _geometry(orientation, pixel_spacing)
  slopes = [float(s) for s in slopes_per_frame] if slopes_per_frame is not None else [float(slope)] * num_frames
  lo, hi = _stored_range(12, 0)

  stored, truth, rescales, ipps = [], [], [], []
  for k in range(num_frames):
    w = (k - (num_frames - 1) / 2) / (num_frames / 2)
    s_str, (s,) = _ds_list([slopes[k]])
    b_str, (b,) = _ds_list([intercept])
    st, tr = _make_slice(rng, phantom, rows, cols, w, s, b, lo, hi, None, 8.0)
    stored.append(st.astype(np.uint16))
    truth.append(tr)
    rescales.append((s, b, s_str[0], b_str[0]))
    ipps.append(_ds_list(np.asarray(origin, dtype=float) + k * slice_spacing * direction[2]))
  order = np.arange(num_frames)
  if frame_order == "descending":
    order = order[::-1]
  elif frame_order == "shuffled":
    order = rng.permutation(num_frames)

  ds = _enhanced_header()
  _apply_phi(ds, phi)
  ds.SOPClassUID = EnhancedCTImageStorage
  ds.SOPInstanceUID = _uid(rng)
  ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = study_uid, series_uid, frame_uid
  ds.DimensionOrganizationSequence[0].DimensionOrganizationUID = _uid(rng)
  for item in ds.DimensionIndexSequence:
    item.DimensionOrganizationUID = ds.DimensionOrganizationSequence[0].DimensionOrganizationUID
  ds.SeriesNumber, ds.SeriesDescription = 7, "ENHANCED AXIAL"
  ds.Rows, ds.Columns, ds.NumberOfFrames = rows, cols, num_frames
  ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
  shared = ds.SharedFunctionalGroupsSequence[0]
  shared.PlaneOrientationSequence[0].ImageOrientationPatient = iop_s
  shared.PixelMeasuresSequence[0].PixelSpacing = ps_s
  shared.PixelMeasuresSequence[0].SliceThickness = _ds_str(slice_thickness)
  per_frame_rescale = slopes_per_frame is not None
  if per_frame_rescale:
    del shared.PixelValueTransformationSequence
  else:
    pvt = shared.PixelValueTransformationSequence[0]
    pvt.RescaleSlope, pvt.RescaleIntercept, pvt.RescaleType = rescales[0][2], rescales[0][3], "HU"
  frames = []
  for k in order:
    item = Dataset()
    content = Dataset()
    content.StackID, content.InStackPositionNumber = "1", int(k) + 1
    content.FrameAcquisitionNumber = 1
    content.DimensionIndexValues = [1, int(k) + 1]
    item.FrameContentSequence = DicomSequence([content])
    pos = Dataset()
    pos.ImagePositionPatient = ipps[k][0]
    item.PlanePositionSequence = DicomSequence([pos])
    if per_frame_rescale:
      pvt = Dataset()
      pvt.RescaleSlope, pvt.RescaleIntercept, pvt.RescaleType = rescales[k][2], rescales[k][3], "HU"
      item.PixelValueTransformationSequence = DicomSequence([pvt])
    frames.append(item)
  ds.PerFrameFunctionalGroupsSequence = DicomSequence(frames)
  pixels = np.stack([stored[k] for k in order]).astype("<u2")
  ds.PixelData = pixels.tobytes()
  ds["PixelData"].VR = "OW"
  _new_meta(ds, transfer_syntax)
  path = os.path.join(folder, _random_name(rng, folder))
  _save(ds, path, transfer_syntax, pixels)
  return SeriesTruth(
    name=name or f"{patient_id}_enhanced", patient_id=patient_id, series_uid=series_uid, study_uid=study_uid,
    hu=_truth_dtype(np.stack(truth), [r[:2] for r in rescales]),
    spacing=(float(slice_spacing), float(ps[0]), float(ps[1])), origin=tuple(float(x) for x in ipps[0][1]),
    direction=direction, files=[path], acquisition_number=1, frame_uid=frame_uid,
    transfer_syntax=str(TRANSFER_SYNTAXES[transfer_syntax]), phi=phi, note=f"Enhanced CT, frames {frame_order}")


def _group_item(ds: Dataset, i: int, keyword: str) -> Dataset | None:
  """Item 0 of functional group `keyword` for frame i (per-frame, else shared)."""
  for fg_kw, index in (("PerFrameFunctionalGroupsSequence", i), ("SharedFunctionalGroupsSequence", 0)):
    groups = ds.get(fg_kw)
    if groups and keyword in groups[index]:
      return groups[index][keyword][0]
  return None


def truth_from_enhanced(path: str, name: str = "") -> SeriesTruth:
  """Truth of an Enhanced CT file computed from its functional groups alone."""
  ds = pydicom.dcmread(path)
  frames = ds.pixel_array.reshape(int(ds.NumberOfFrames), ds.Rows, ds.Columns).astype(np.float64)
  iop = np.array(_group_item(ds, 0, "PlaneOrientationSequence").ImageOrientationPatient, dtype=float)
  direction = np.stack([iop[:3], iop[3:], np.cross(iop[:3], iop[3:])])
  ps = [float(x) for x in _group_item(ds, 0, "PixelMeasuresSequence").PixelSpacing]
  entries = []
  for i in range(len(frames)):
    ipp = np.array(_group_item(ds, i, "PlanePositionSequence").ImagePositionPatient, dtype=float)
    pvt = _group_item(ds, i, "PixelValueTransformationSequence")
    s, b = (float(pvt.RescaleSlope), float(pvt.RescaleIntercept)) if pvt else (1.0, 0.0)
    entries.append((float(direction[2] @ ipp), i, ipp, s, b))
  entries.sort(key=lambda e: e[0])
  steps = np.diff([e[0] for e in entries])
  if len(steps) and np.ptp(steps) > 1e-3:
    raise ValueError(f"{path}: irregular frame spacing {steps}")
  hu = np.stack([frames[i] * s + b for _, i, _, s, b in entries])
  return SeriesTruth(
    name=name or os.path.basename(path), patient_id=str(ds.PatientID), series_uid=str(ds.SeriesInstanceUID),
    study_uid=str(ds.StudyInstanceUID), hu=_truth_dtype(hu, [(e[3], e[4]) for e in entries]),
    spacing=(float(steps.mean()) if len(steps) else float(_group_item(ds, 0, "PixelMeasuresSequence").SliceThickness),
             ps[0], ps[1]),
    origin=tuple(float(x) for x in entries[0][2]), direction=direction, files=[path],
    acquisition_number=int(ds.get("AcquisitionNumber", 1)), frame_uid=str(ds.FrameOfReferenceUID),
    transfer_syntax=str(ds.file_meta.TransferSyntaxUID), note="Enhanced CT (truth from functional groups)")


def copy_enhanced_testdata(
  out_dir: str, *, rng: np.random.Generator, phi: dict[str, str], study_uid: str,
) -> SeriesTruth:
  """pydicom-data's eCT_Supplemental.dcm (2 frames, 512x512, IOP -1,0,0,0,1,0) as our patient.

  Identity and UIDs replaced; truth from its functional groups. The frames
  are stored top-down (z -159 then -149) with normal (0, 0, -1), so frame 1
  comes first in the truth: origin (99.5, -301.5, -149), spacing 10.
  """
  os.makedirs(out_dir, exist_ok=True)
  ds = copy.deepcopy(_template("eCT_Supplemental.dcm"))
  _apply_phi(ds, phi)
  ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = study_uid, _uid(rng), _uid(rng)
  ds.SOPInstanceUID = _uid(rng)
  ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
  path = os.path.join(out_dir, _random_name(rng, out_dir))
  _resave(ds, path)
  truth = truth_from_enhanced(path, name=f"{phi['PatientID']}_eCT_Supplemental")
  truth.phi = phi
  return truth


# ---------------------------------------------------------------- mixed tree


def _scatter(truths: list[SeriesTruth], out_dir: str, staging: str, rng: np.random.Generator) -> None:
  """Moves every file into random nested folders (series mixed together)."""
  folders = []
  for _ in range(7):
    depth = int(rng.integers(1, 4))
    folders.append(os.path.join(out_dir, *[_hex(rng, 2, 9).upper() for _ in range(depth)]))
  moved: dict[str, str] = {}
  for t in truths:
    for path in t.files:
      if path in moved:
        continue
      folder = folders[int(rng.integers(len(folders)))]
      os.makedirs(folder, exist_ok=True)
      name = os.path.basename(path)
      if os.path.exists(os.path.join(folder, name)):
        name = _random_name(rng, folder)
      moved[path] = os.path.join(folder, name)
      os.replace(path, moved[path])
  for t in truths:
    t.files = [moved[p] for p in t.files]
  shutil.rmtree(staging)


def make_mixed_tree(out_dir: str, seed: int = 0) -> list[SeriesTruth]:
  """Writes the mixed test tree under `out_dir` and returns every truth.

  3 patients; valid volumes in every encodable transfer syntax, ascending,
  descending, oblique, non-square, padded, per-slice and non-integral
  rescale, contrast phases, Enhanced CT; each pathology; non-DICOM junk.
  """
  rng = np.random.default_rng(seed)
  staging = os.path.join(out_dir, f"_staging_{int(rng.integers(1 << 30)):x}")
  truths: list[SeriesTruth] = []

  def sub(folder: str) -> str:
    return os.path.join(staging, folder)

  # Patient 1: GE-like and Siemens-like axial series, a scout, SR and screen capture.
  p1 = make_phi(rng, "SYN0001", "Doe^Jane")
  s1 = _uid(rng)
  kw1 = dict(rng=rng, patient_id="SYN0001", phi=p1, study_uid=s1)
  truths.append(write_series(sub("a"), **kw1, name="p1_axial_padded", num_slices=20, pixel_padding_value=-2000,
                             series_number=2))
  truths.append(write_series(sub("b"), **kw1, name="p1_desc_implicit_u12", num_slices=16, descending=True,
                             rows=48, cols=64, pixel_spacing=(0.8, 0.7), bits_stored=12, pixel_representation=0,
                             transfer_syntax="implicit", file_names="instance", origin=(-22.4, -19.2, 10.0),
                             series_number=3))
  scout_series = write_series(sub("c"), **kw1, name="p1_with_scout", num_slices=12, instance_numbers="shuffled",
                              series_number=4, acquisition_number=1)
  truths += add_localizer(scout_series, rng)
  truths.append(write_dose_report(sub("d"), rng=rng, phi=p1, study_uid=s1))
  truths.append(write_secondary_capture(sub("d"), rng=rng, phi=p1, study_uid=s1))
  s1b = _uid(rng)
  p1b = dict(p1, AccessionNumber=f"ACC{int(rng.integers(10**6, 10**7))}")
  truths += write_contrast_phases(sub("e"), rng=rng, patient_id="SYN0001", phi=p1b, study_uid=s1b,
                                  name="p1_phases", series_number=5,
                                  origin=(-40.0, -60.0, -310.5))
  truths.append(write_series(sub("f"), rng=rng, patient_id="SYN0001", phi=p1b, study_uid=s1b, name="p1_rle",
                             num_slices=10, transfer_syntax="rle", pixel_padding_value=-2000, series_number=6))

  # Patient 2: compressed syntaxes, oblique, rescale variants, Enhanced CT.
  p2 = make_phi(rng, "SYN0002", "Roe^Richard")
  s2 = _uid(rng)
  kw2 = dict(rng=rng, patient_id="SYN0002", phi=p2, study_uid=s2)
  truths.append(write_series(sub("g"), **kw2, name="p2_oblique_j2k", num_slices=14, orientation=OBLIQUE,
                             instance_numbers="shuffled", transfer_syntax="jpeg2000", series_number=2,
                             pixel_spacing=(0.75, 0.65), origin=(-31.5, 12.25, 80.0)))
  truths.append(write_series(sub("h"), **kw2, name="p2_jpegls_slopes", num_slices=10, transfer_syntax="jpegls",
                             slopes_per_slice=[1.0 + (k % 3 == 1) for k in range(10)], series_number=3,
                             origin=(-10.0, -5.5, 120.0)))
  truths.append(write_series(sub("i"), **kw2, name="p2_jpeg_lossless_u12", num_slices=10,
                             transfer_syntax="jpeg_lossless", bits_stored=12, pixel_representation=0,
                             descending=True, series_number=4))
  truths.append(write_series(sub("j"), **kw2, name="p2_slope_half", num_slices=10, slope=0.5, intercept=-1024.0,
                             slopes_per_slice=[0.5, 0.25] * 5, series_number=5))
  truths.append(write_enhanced_series(sub("k"), **kw2, name="p2_enhanced", num_frames=12, frame_order="shuffled",
                                      slopes_per_frame=[1.0, 2.0, 1.0] * 4))
  truths.append(copy_enhanced_testdata(sub("k"), rng=rng, phi=p2, study_uid=_uid(rng)))

  # Patient 3: broken series (and one valid one with an identical duplicate).
  p3 = make_phi(rng, "SYN0003", "Poe^Edgar")
  s3 = _uid(rng)
  kw3 = dict(rng=rng, patient_id="SYN0003", phi=p3, study_uid=s3, num_slices=10)
  truths.append(add_identical_duplicate(
    write_series(sub("l"), **kw3, name="p3_duplicate", series_number=2), rng))
  truths.append(drop_middle_slice(write_series(sub("m"), **kw3, name="p3_missing", series_number=3)))
  truths.append(make_irregular_spacing(write_series(sub("n"), **kw3, name="p3_irregular", series_number=4)))
  truths.append(apply_gantry_tilt(write_series(sub("o"), **kw3, name="p3_tilt", series_number=5)))
  truths.append(add_conflicting_duplicate(write_series(sub("p"), **kw3, name="p3_conflict", series_number=6), rng))
  truths.append(truncate_slice(write_series(sub("q"), **kw3, name="p3_truncated", series_number=7)))
  truths.append(remove_tag(write_series(sub("r"), **kw3, name="p3_no_ipp", series_number=8)))
  truths.append(write_junk(sub("s"), rng=rng))

  _scatter(truths, out_dir, staging, rng)
  return truths


def _manifest(truths: list[SeriesTruth], root: str) -> list[dict]:
  out = []
  for t in truths:
    out.append({
      "name": t.name, "expected": t.expected, "patient_id": t.patient_id, "study_uid": t.study_uid,
      "series_uid": t.series_uid, "acquisition_number": t.acquisition_number, "transfer_syntax": t.transfer_syntax,
      "shape": list(t.hu.shape) if t.hu is not None else None, "dtype": str(t.hu.dtype) if t.hu is not None else None,
      "spacing": t.spacing, "origin": t.origin, "direction": t.direction.tolist() if t.direction is not None else None,
      "files": [os.path.relpath(f, root) for f in t.files], "note": t.note})
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("out_dir")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--big_slices", type=int, default=0, help="write one 512x512 series of N slices instead")
  parser.add_argument("--manifest", default="", help="also write the truths (without arrays) as JSON here")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  if args.big_slices:
    truths = [write_big_series(args.out_dir, args.big_slices, seed=args.seed)]
  else:
    truths = make_mixed_tree(args.out_dir, seed=args.seed)
  elapsed = time.perf_counter() - start
  for t in truths:
    shape = "x".join(map(str, t.hu.shape)) if t.hu is not None else "-"
    print(f"{t.name:28s} {t.expected:22s} {shape:12s} {len(t.files):3d} files")
  print(f"{sum(len(t.files) for t in truths)} files in {elapsed:.2f}s under {args.out_dir}")
  if args.manifest:
    with open(args.manifest + ".partial", "w") as f:
      json.dump(_manifest(truths, args.out_dir), f, indent=1)
    os.replace(args.manifest + ".partial", args.manifest)
  return 0


if __name__ == "__main__":
  sys.exit(main())
