"""Writes label sources (DICOM SEG, RTSTRUCT, NIfTI) for the synthetic CT series of make_sample_ct.

    from scripts import make_sample_ct as ct, make_sample_ct_labels as cl
    truth = ct.write_series(out, patient_id="P1", seed=0, rows=32, cols=32, num_slices=10)
    mask = cl.ellipsoid(truth.hu.shape, centre=(4, 12, 15), radii=(3, 6, 8))
    seg = cl.write_seg(truth, out + "/seg.dcm", [mask], ["liver"], seed=1)

Masks are given in the truth's voxel order ([k, j, i] = slice sorted along the
normal, row, column: `SeriesTruth.hu`'s). SEG files are written by highdicom
from the series' own files (so its source references and plane positions are
highdicom's); RTSTRUCT files by pydicom from contours in continuous (column,
row) indices of a slice, mapped to patient LPS mm by the truth's geometry;
NIfTI files by nibabel from the truth's geometry (LPS → RAS), optionally with
the array's axes permuted and flipped the way dcm2niix and ITK write them.
Identifying values (the series' `phi`, plus structure names and creator names)
are planted in the SEG and RTSTRUCT headers for PHI tests.

    python scripts/make_sample_ct_labels.py OUT_DIR [--seed=0]

writes one series with a SEG, an RTSTRUCT and a NIfTI label map of the same two organs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import dataclasses
import io
import os
import sys

import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import pydicom.data
from pydicom.charset import default_encoding
from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sequence import Sequence as DicomSequence
from pydicom.sr.codedict import codes
from pydicom.uid import PYDICOM_IMPLEMENTATION_UID, ExplicitVRLittleEndian, ImplicitVRLittleEndian, generate_uid

if __package__:  # imported as scripts.make_sample_ct_labels
  from scripts import make_sample_ct as ct
else:  # run as a script
  import make_sample_ct as ct

RTSTRUCT_STORAGE = "1.2.840.10008.5.1.4.1.1.481.3"
_STUDY_COMPONENT = "1.2.840.10008.3.1.2.3.1"  # the RT Referenced Study's ReferencedSOPClassUID (retired class)
_CONTOUR_DATA = 0x30060050
_LPS_FROM_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])


def _uid(rng: np.random.Generator) -> str:
  return str(generate_uid(entropy_srcs=[f"synthlabel-{int(rng.integers(1 << 62))}"]))


# ---------------------------------------------------------------- geometry


@dataclasses.dataclass(frozen=True)
class Slot:
  """Where slice k of a truth's volume is stored: its file, its SOP UID, its frame (None: single-frame)."""

  path: str
  sop_uid: str
  frame: int | None
  position: np.ndarray


def volume_slots(truth: ct.SeriesTruth) -> list[Slot]:
  """One `Slot` per slice of the truth's volume, in volume order (sorted along the normal).

  Args:
    truth: a VOLUME truth of make_sample_ct (classic series, or one Enhanced CT file).

  Returns:
    The slots, slot k holding hu[k].
  """
  normal = truth.direction[2]
  slots = []
  for path in truth.files:
    ds = pydicom.dcmread(path, stop_before_pixels=True)
    if "PerFrameFunctionalGroupsSequence" in ds:
      for i, item in enumerate(ds.PerFrameFunctionalGroupsSequence):
        position = np.array(item.PlanePositionSequence[0].ImagePositionPatient, dtype=float)
        slots.append(Slot(path, str(ds.SOPInstanceUID), i, position))
    else:
      slots.append(Slot(path, str(ds.SOPInstanceUID), None, np.array(ds.ImagePositionPatient, dtype=float)))
  slots.sort(key=lambda s: float(normal @ s.position))
  return slots


def voxel_to_lps(truth: ct.SeriesTruth, ijk: np.ndarray) -> np.ndarray:
  """Continuous (column i, row j, slice k) indices → patient LPS mm, by the truth's geometry.

  Args:
    truth: the series' truth.
    ijk: (..., 3) indices.

  Returns:
    (..., 3) LPS positions.
  """
  sz, sy, sx = truth.spacing
  d = truth.direction
  ijk = np.asarray(ijk, dtype=np.float64)
  return (np.asarray(truth.origin) + ijk[..., :1] * sx * d[0] + ijk[..., 1:2] * sy * d[1]
          + ijk[..., 2:3] * sz * d[2])


def series_affine(truth: ct.SeriesTruth) -> np.ndarray:
  """4x4 RAS affine of the truth's voxel grid, index order (i, j, k): what nibabel writes for hu.T."""
  sz, sy, sx = truth.spacing
  lps = np.eye(4)
  lps[:3, 0] = truth.direction[0] * sx
  lps[:3, 1] = truth.direction[1] * sy
  lps[:3, 2] = truth.direction[2] * sz
  lps[:3, 3] = truth.origin
  return _LPS_FROM_RAS @ lps


def ellipsoid(shape: Sequence[int], centre: Sequence[float], radii: Sequence[float]) -> np.ndarray:
  """A bool [k, j, i] mask: voxels with sum(((index - centre) / radii)^2) < 1."""
  k, j, i = np.meshgrid(*[np.arange(n, dtype=float) for n in shape], indexing="ij")
  return ((k - centre[0]) / radii[0]) ** 2 + ((j - centre[1]) / radii[1]) ** 2 + (
      (i - centre[2]) / radii[2]) ** 2 < 1


# ---------------------------------------------------------------- SEG


def _segment(number: int, label: str, fractional: bool) -> hd.seg.SegmentDescription:
  return hd.seg.SegmentDescription(
      segment_number=number, segment_label=label, segmented_property_category=codes.SCT.Tissue,
      segmented_property_type=codes.SCT.Organ, tracking_uid=hd.UID(), tracking_id=f"track {label}",
      algorithm_type=hd.seg.SegmentAlgorithmTypeValues.SEMIAUTOMATIC if fractional else
      hd.seg.SegmentAlgorithmTypeValues.MANUAL,
      algorithm_identification=hd.AlgorithmIdentificationSequence(
          name="synthseg", version="1", family=codes.DCM.ArtificialIntelligence) if fractional else None)


def seg_dataset(truth: ct.SeriesTruth, masks: Sequence[np.ndarray], labels: Sequence[str], *, seed: int,
                fractional: bool = False, omit_empty_frames: bool = True,
                transfer_syntax: str = ExplicitVRLittleEndian, source_order: str = "volume") -> hd.seg.Segmentation:
  """A highdicom Segmentation of the truth's series: one segment per mask.

  Args:
    truth: the series (classic or Enhanced CT).
    masks: per segment, [k, j, i] in the truth's voxel order: bool, or fractions in [0, 1].
    labels: the SegmentLabel of each segment.
    seed: derives the UIDs.
    fractional: FRACTIONAL (PROBABILITY, max 255) instead of BINARY.
    omit_empty_frames: highdicom's default, leave out frames with no voxel of their segment.
    transfer_syntax: of the SEG's pixel data.
    source_order: the order of the single-frame source images handed to highdicom: "volume"
      (sorted along the normal) or "files" (truth.files, e.g. InstanceNumber order).

  Returns:
    The Segmentation (a pydicom Dataset). PHI: the series' patient and study tags (highdicom
    copies them), plus a content creator, a series description and a content description.
  """
  rng = np.random.default_rng(seed)
  slots = volume_slots(truth)
  stack = np.stack([np.asarray(m, dtype=np.float32 if fractional else bool) for m in masks], axis=-1)
  if stack.shape[:3] != truth.hu.shape:
    raise ValueError(f"masks of shape {stack.shape[:3]}, the volume is {truth.hu.shape}")
  if slots[0].frame is None:
    order = list(range(len(slots)))
    if source_order == "files":
      where = {s.path: k for k, s in enumerate(slots)}
      order = [where[p] for p in truth.files]
    sources = [pydicom.dcmread(slots[k].path, stop_before_pixels=True) for k in order]
    pixels = stack[order]
  else:
    sources = [pydicom.dcmread(slots[0].path, stop_before_pixels=True)]
    pixels = np.zeros_like(stack)
    for k, s in enumerate(slots):
      pixels[s.frame] = stack[k]  # the source's frame order
  phi = truth.phi or {}
  kind = hd.seg.SegmentationTypeValues.FRACTIONAL if fractional else hd.seg.SegmentationTypeValues.BINARY
  seg = hd.seg.Segmentation(
      source_images=sources, pixel_array=pixels, segmentation_type=kind,
      segment_descriptions=[_segment(n + 1, label, fractional) for n, label in enumerate(labels)],
      series_instance_uid=_uid(rng), series_number=300, sop_instance_uid=_uid(rng), instance_number=1,
      manufacturer="SYNTHLABEL", manufacturer_model_name="synth", software_versions="1",
      device_serial_number="SN-" + phi.get("OtherPatientID", "0"),
      content_description=f"masks for {phi.get('PatientID', '')}"[:64],
      content_creator_name=phi.get("ReferringPhysicianName", "Roe^Anne"), omit_empty_frames=omit_empty_frames,
      transfer_syntax_uid=transfer_syntax, series_description=f"SEG {phi.get('PatientName', '')}"[:64])
  return seg


def save(ds: Dataset, path: str) -> str:
  """Saves a data set (SEG, RTSTRUCT) atomically; returns path."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = path + ".partial"
  ds.save_as(tmp, enforce_file_format=True)
  os.replace(tmp, path)
  return path


def write_seg(truth: ct.SeriesTruth, path: str, masks: Sequence[np.ndarray], labels: Sequence[str], *, seed: int,
              **kwargs) -> str:
  """`seg_dataset(...)` saved to path; returns path."""
  return save(seg_dataset(truth, masks, labels, seed=seed, **kwargs), path)


def seg_bytes(ds: Dataset) -> bytes:
  """A data set as the bytes of a DICOM file."""
  buffer = io.BytesIO()
  ds.save_as(buffer, enforce_file_format=True)
  return buffer.getvalue()


def liver_testdata() -> str:
  """Path of pydicom-data's liver.dcm: a real BINARY SEG (DCMTK, 3 frames of 512 x 512, one segment)."""
  return pydicom.data.get_testdata_file("liver.dcm")


def write_series_for_seg(seg_path: str, out_dir: str, *, seed: int) -> ct.SeriesTruth:
  """A CT series the SEG at seg_path was made from: its patient, study, series, Frame of Reference, SOP
  instance UIDs, plane positions, orientation and pixel spacing (one slice per referenced instance).

  Args:
    seg_path: a SEG whose frames all lie on one regular stack (e.g. `liver_testdata()`).
    out_dir: where the series goes.
    seed: for the phantom.

  Returns:
    The series' truth, its files' SOP UIDs those the SEG's frames reference.
  """
  seg = pydicom.dcmread(seg_path)
  shared = seg.SharedFunctionalGroupsSequence[0]
  orientation = [float(v) for v in shared.PlaneOrientationSequence[0].ImageOrientationPatient]
  spacing = [float(v) for v in shared.PixelMeasuresSequence[0].PixelSpacing]
  normal = np.cross(orientation[:3], orientation[3:])
  by_position = {}
  for item in seg.PerFrameFunctionalGroupsSequence:
    position = tuple(float(v) for v in item.PlanePositionSequence[0].ImagePositionPatient)
    by_position[position] = str(item.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID)
  positions = sorted(by_position, key=lambda p: float(normal @ np.asarray(p)))
  steps = np.diff([float(normal @ np.asarray(p)) for p in positions])
  ref = seg.ReferencedSeriesSequence[0]
  truth = ct.write_series(
      out_dir, seed=seed, patient_id=str(seg.PatientID), patient_name=str(seg.get("PatientName", "")),
      study_uid=str(seg.StudyInstanceUID), series_uid=str(ref.SeriesInstanceUID),
      frame_uid=str(seg.FrameOfReferenceUID), rows=int(seg.Rows), cols=int(seg.Columns), num_slices=len(positions),
      pixel_spacing=tuple(spacing), slice_spacing=float(steps.mean()), origin=positions[0],
      orientation=tuple(orientation), noise_hu=0.0)
  for slot, position in zip(volume_slots(truth), positions):
    ds = pydicom.dcmread(slot.path)
    ds.SOPInstanceUID = by_position[position]
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
    save(ds, slot.path)
  return truth


# ---------------------------------------------------------------- RTSTRUCT


@dataclasses.dataclass
class Roi:
  """One structure: its name and closed planar contours, each (slice k, (N, 2) continuous (i, j) indices)."""

  name: str
  contours: list[tuple[int, np.ndarray]] = dataclasses.field(default_factory=list)
  contour_type: str = "CLOSED_PLANAR"


def polygon_circle(centre: Sequence[float], radius: float, points: int, phase: float = 0.1) -> np.ndarray:
  """(points, 2) vertices (i, j) of a regular polygon approximating a circle, counter-clockwise."""
  t = phase + np.arange(points) * (2 * np.pi / points)
  return np.stack([centre[0] + radius * np.cos(t), centre[1] + radius * np.sin(t)], axis=1)


def _ds_raw(values: np.ndarray) -> bytes:
  """A DS value (backslash separated, at most 16 characters each) as raw bytes, padded to even length."""
  out = "\\".join(f"{v:.6f}" for v in np.asarray(values, dtype=np.float64).ravel()).encode("ascii")
  return out + b" " if len(out) % 2 else out


def contour_lps(truth: ct.SeriesTruth, k: int, ij: np.ndarray) -> np.ndarray:
  """(N, 3) LPS mm of continuous (i, j) indices on slice k."""
  ij = np.asarray(ij, dtype=np.float64)
  return voxel_to_lps(truth, np.column_stack([ij, np.full(len(ij), float(k))]))


def rtstruct_dataset(truth: ct.SeriesTruth, rois: Sequence[Roi], *, seed: int, reference_images: bool = True,
                     lps: dict[tuple[int, int], np.ndarray] | None = None) -> Dataset:
  """An RT Structure Set of the truth's series (valid enough for dcmrtstruct2nii and this toolkit).

  Args:
    truth: the series.
    rois: the structures, numbered 1.. in order.
    seed: derives the UIDs.
    reference_images: give each contour a ContourImageSequence naming its slice.
    lps: (roi index, contour index) -> (N, 3) LPS points that replace the computed ones
      (contours off the grid, outside the volume, ...).

  Returns:
    The data set; ContourData are raw DS elements (written as they are, Implicit VR: a
    contour over 64 KiB does not fit an explicit VR DS length).
  """
  rng = np.random.default_rng(seed)
  slots = volume_slots(truth)
  first = pydicom.dcmread(slots[0].path, stop_before_pixels=True)
  phi = truth.phi or {}
  ds = Dataset()
  ds.SpecificCharacterSet = "ISO_IR 100"
  ds.SOPClassUID = RTSTRUCT_STORAGE
  ds.SOPInstanceUID = _uid(rng)
  ds.Modality = "RTSTRUCT"
  for keyword in ("PatientName", "PatientID", "PatientBirthDate", "PatientSex", "StudyInstanceUID", "StudyDate",
                  "StudyTime", "StudyID", "AccessionNumber", "ReferringPhysicianName", "InstitutionName"):
    setattr(ds, keyword, first.get(keyword, ""))
  ds.SeriesInstanceUID = _uid(rng)
  ds.SeriesNumber = 400
  ds.SeriesDescription = f"RTSTRUCT {phi.get('PatientName', '')}"[:64]
  ds.OperatorsName = phi.get("ReferringPhysicianName", "Roe^Anne")
  ds.Manufacturer = "SYNTHLABEL"
  ds.StructureSetLabel = "SYNTH"
  ds.StructureSetName = f"plan {phi.get('PatientID', '')}"[:64]
  ds.StructureSetDate, ds.StructureSetTime = phi.get("StudyDate", "20200101"), "101500"
  ds.InstanceNumber = 1
  ds.ApprovalStatus = "UNAPPROVED"

  def image_ref(slot: Slot) -> Dataset:
    item = Dataset()
    item.ReferencedSOPClassUID = first.SOPClassUID
    item.ReferencedSOPInstanceUID = slot.sop_uid
    if slot.frame is not None:
      item.ReferencedFrameNumber = slot.frame + 1
    return item

  series = Dataset()
  series.SeriesInstanceUID = truth.series_uid
  series.ContourImageSequence = DicomSequence([image_ref(s) for s in slots])
  study = Dataset()
  study.ReferencedSOPClassUID = _STUDY_COMPONENT
  study.ReferencedSOPInstanceUID = truth.study_uid
  study.RTReferencedSeriesSequence = DicomSequence([series])
  frame = Dataset()
  frame.FrameOfReferenceUID = truth.frame_uid
  frame.RTReferencedStudySequence = DicomSequence([study])
  ds.ReferencedFrameOfReferenceSequence = DicomSequence([frame])

  structures, contours, observations = [], [], []
  for n, roi in enumerate(rois, start=1):
    item = Dataset()
    item.ROINumber = n
    item.ReferencedFrameOfReferenceUID = truth.frame_uid
    item.ROIName = roi.name
    item.ROIDescription = f"{roi.name} of {phi.get('PatientName', '')}"[:64]
    item.ROIGenerationAlgorithm = "MANUAL"
    structures.append(item)
    roi_contour = Dataset()
    roi_contour.ReferencedROINumber = n
    roi_contour.ROIDisplayColor = [255, (40 * n) % 256, 0]
    sequence = []
    for c, (k, ij) in enumerate(roi.contours):
      points = lps[(n - 1, c)] if lps and (n - 1, c) in lps else contour_lps(truth, k, ij)
      contour = Dataset()
      if reference_images:
        contour.ContourImageSequence = DicomSequence([image_ref(slots[k])])
      contour.ContourGeometricType = roi.contour_type
      contour.NumberOfContourPoints = len(points)
      contour.ContourNumber = c + 1
      raw = _ds_raw(points)
      contour[_CONTOUR_DATA] = RawDataElement(pydicom.tag.Tag(_CONTOUR_DATA), "DS", len(raw), raw, 0, True, True)
      contour.set_original_encoding(True, True, default_encoding)  # raw ContourData written as it is
      sequence.append(contour)
    if sequence:
      roi_contour.ContourSequence = DicomSequence(sequence)
    contours.append(roi_contour)
    observation = Dataset()
    observation.ObservationNumber = n
    observation.ReferencedROINumber = n
    observation.RTROIInterpretedType = "ORGAN"
    observation.ROIInterpreter = phi.get("ReferringPhysicianName", "Roe^Anne")
    observations.append(observation)
  ds.StructureSetROISequence = DicomSequence(structures)
  ds.ROIContourSequence = DicomSequence(contours)
  ds.RTROIObservationsSequence = DicomSequence(observations)
  meta = FileMetaDataset()
  meta.MediaStorageSOPClassUID = ds.SOPClassUID
  meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
  meta.TransferSyntaxUID = ImplicitVRLittleEndian
  meta.ImplementationClassUID = PYDICOM_IMPLEMENTATION_UID
  ds.file_meta = meta
  ds.set_original_encoding(True, True, "ISO_IR 100")
  return ds


def write_rtstruct(truth: ct.SeriesTruth, path: str, rois: Sequence[Roi], *, seed: int, **kwargs) -> str:
  """`rtstruct_dataset(...)` saved to path; returns path."""
  return save(rtstruct_dataset(truth, rois, seed=seed, **kwargs), path)


# ---------------------------------------------------------------- NIfTI


def nifti_image(truth: ct.SeriesTruth, label: np.ndarray, *, axes: str = "ijk", flips: str = "",
                dtype=np.uint8, affine: np.ndarray | None = None, version: int = 1) -> nib.Nifti1Image:
  """A NIfTI label map of `label` ([k, j, i] in the truth's order) on the truth's grid.

  Args:
    truth: the series.
    label: class ids, [k, j, i].
    axes: the volume axis along each NIfTI array axis: "ijk" (the volume transposed, as ITK
      writes it), "kji" (the volume's own array order), ...
    flips: the volume axes ("i", "j", "k") that run backwards in the array (dcm2niix flips j).
    dtype: of the stored values.
    affine: a RAS affine to write instead of the one that describes the array.
    version: 1 or 2 (NIfTI-1 or NIfTI-2).

  Returns:
    The image (sform and qform set, code 1 = scanner).
  """
  order = {"k": 0, "j": 1, "i": 2}
  sizes = {"i": label.shape[2], "j": label.shape[1], "k": label.shape[0]}
  array = np.transpose(np.asarray(label), [order[a] for a in axes])
  array = array[tuple(slice(None, None, -1) if a in flips else slice(None) for a in axes)]
  to_volume = np.zeros((4, 4))
  to_volume[3, 3] = 1.0
  for n, a in enumerate(axes):  # NIfTI index n -> volume index a
    m = "ijk".index(a)
    to_volume[m, n] = -1.0 if a in flips else 1.0
    to_volume[m, 3] = sizes[a] - 1.0 if a in flips else 0.0
  described = series_affine(truth) @ to_volume
  image_class = nib.Nifti2Image if version == 2 else nib.Nifti1Image
  image = image_class(np.ascontiguousarray(array).astype(dtype), described if affine is None else affine)
  image.header.set_sform(described if affine is None else affine, code=1)
  image.header.set_qform(described if affine is None else affine, code=1)
  return image


def write_nifti(truth: ct.SeriesTruth, path: str, label: np.ndarray, **kwargs) -> str:
  """`nifti_image(...)` saved to path (.nii or .nii.gz); returns path."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  nib.save(nifti_image(truth, label, **kwargs), path)
  return path


# ---------------------------------------------------------------- sample


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("out_dir")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  series_dir = os.path.join(args.out_dir, "series")
  truth = ct.write_series(series_dir, patient_id="SYNLAB01", seed=args.seed, rows=48, cols=48, num_slices=12)
  shape = truth.hu.shape
  liver = ellipsoid(shape, (5, 20, 18), (4, 9, 12))
  spleen = ellipsoid(shape, (6, 26, 36), (3, 6, 5))
  write_seg(truth, os.path.join(args.out_dir, "seg.dcm"), [liver, spleen], ["liver", "spleen"], seed=args.seed)
  rois = [Roi("liver", [(k, polygon_circle((18.3, 20.2), 9.1, 40)) for k in range(2, 9)]),
          Roi("spleen", [(k, polygon_circle((36.2, 26.3), 4.7, 24)) for k in range(4, 8)])]
  write_rtstruct(truth, os.path.join(args.out_dir, "rtstruct.dcm"), rois, seed=args.seed)
  write_nifti(truth, os.path.join(args.out_dir, "labels.nii.gz"), liver * 1 + spleen * 2, flips="j")
  print(f"series of {len(truth.files)} slices, seg.dcm, rtstruct.dcm, labels.nii.gz under {args.out_dir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
