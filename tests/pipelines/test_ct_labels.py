"""`pipelines.ct_volumes.labels`: DICOM SEG, RTSTRUCT and NIfTI label sources painted in the volume's voxel
order, compared voxel for voxel with independent readings (highdicom's own pixel API for SEG, dcmrtstruct2nii
and scikit-image for RTSTRUCT, SimpleITK's resampling for NIfTI), and every misalignment turned down with a
reason that holds no header value. Series come from scripts/make_sample_ct.py, labels from
scripts/make_sample_ct_labels.py. No Beam."""

from __future__ import annotations

import dataclasses
import gzip
import io
import logging
import os
import pickle
import warnings

from dcmrtstruct2nii import dcmrtstruct2nii
from dcmrtstruct2nii.adapters.convert.filenameconverter import FilenameConverter
import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import pytest
import SimpleITK as sitk
from skimage.draw import polygon2mask

from pipelines.ct_volumes import labels
from pipelines.ct_volumes.assembly import VolumePlan, plan_volumes
from pipelines.ct_volumes.headers import read_slices
from scripts import make_sample_ct as ct, make_sample_ct_labels as cl

SALT = "label-salt"
PATIENT = "LAB-0001"
# Segment labels and ROI names hold names, as real ones do: no reason may quote them.
LIVER, SPLEEN, EMPTY = "Hepar of Doe^Jane", "Lien of Roe^Richard", "Vacuum of Poe^Edgar"
LABEL_MAP = {LIVER: 1, SPLEEN: 2, EMPTY: 3}


# ---------------------------------------------------------------- helpers


def _plan(truth: ct.SeriesTruth, files: list[str] | None = None) -> VolumePlan:
  slices = []
  for path in files or truth.files:
    with open(path, "rb") as f:
      slices += read_slices(f, path, SALT)
  plans, rejected = plan_volumes(slices)
  assert not rejected and len(plans) == 1, rejected
  return plans[0]


def _config(**kw) -> labels.LabelConfig:
  kw.setdefault("label_map", LABEL_MAP)
  return labels.LabelConfig(sources=kw.pop("sources", labels.LABEL_SOURCES), **kw)


def _read(path: str) -> bytes:
  with open(path, "rb") as f:
    return f.read()


def _label(plan: VolumePlan, data: bytes, path: str, config: labels.LabelConfig | None = None) -> np.ndarray:
  config = config or _config()
  header = labels.read_label_header(data, path, SALT, config)
  return labels.rasterize(plan, header, data, config)


def _secrets(*truths: ct.SeriesTruth, extra: tuple[str, ...] = ()) -> list[str]:
  """Every identifying value planted in the series and its labels."""
  out = [LIVER, SPLEEN, EMPTY, "Hepar", "Lien", "Doe", "Roe", *extra]
  for t in truths:
    out += [v for v in (t.phi or {}).values()] + [t.series_uid, t.study_uid, t.frame_uid, t.patient_id]
    out += [s.sop_uid for s in cl.volume_slots(t)]
  return [s for s in out if s]


def _rejected(fn, match: str, secrets: list[str]) -> str:
  """fn() raises LabelRejected matching `match`, one line, none of `secrets` in it."""
  with pytest.raises(labels.LabelRejected, match=match) as e:
    fn()
  reason = str(e.value)
  assert "\n" not in reason
  leaked = [s for s in secrets if s in reason]
  assert not leaked, (reason, leaked)
  return reason


def _masks(shape) -> tuple[np.ndarray, np.ndarray]:
  """Two disjoint organs, off-centre along every axis (a flip or a shift shows), empty end slices."""
  d, h, w = shape
  a = cl.ellipsoid(shape, (d * 0.4, h * 0.42, w * 0.37), (d * 0.3, h * 0.3, w * 0.25))
  b = cl.ellipsoid(shape, (d * 0.55, h * 0.62, w * 0.74), (d * 0.3, h * 0.22, w * 0.16)) & ~a
  assert a.any() and b.any() and not (a | b)[0].any() and not (a | b)[-1].any()
  return a, b


def _edited(data: bytes, edit) -> bytes:
  ds = pydicom.dcmread(io.BytesIO(data))
  edit(ds)
  return cl.seg_bytes(ds)


def _frames(ds) -> list[tuple[int, str]]:
  """(segment, referenced SOP UID) per SEG frame."""
  return [(int(f.SegmentIdentificationSequence[0].ReferencedSegmentNumber),
           str(f.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID))
          for f in ds.PerFrameFunctionalGroupsSequence]


def _highdicom(seg_path: str, truth: ct.SeriesTruth, **kw) -> np.ndarray:
  """highdicom's own reading: [D, H, W, segments], slice k the source slot k of the truth."""
  seg = hd.seg.segread(seg_path)
  slots = cl.volume_slots(truth)
  if slots[0].frame is None:
    return seg.get_pixels_by_source_instance([s.sop_uid for s in slots], assert_missing_frames_are_empty=True, **kw)
  return seg.get_pixels_by_source_frame(slots[0].sop_uid, [s.frame + 1 for s in slots],
                                        assert_missing_frames_are_empty=True, **kw)


# ---------------------------------------------------------------- series


@pytest.fixture(scope="module")
def axial(tmp_path_factory) -> ct.SeriesTruth:
  return ct.write_series(str(tmp_path_factory.mktemp("axial")), patient_id=PATIENT, seed=11, rows=32, cols=40,
                         num_slices=10, pixel_spacing=(0.7, 0.8), slice_spacing=1.5, origin=(-20.5, -30.25, 40.0))


@pytest.fixture(scope="module")
def descending(tmp_path_factory, axial) -> ct.SeriesTruth:
  """Same patient and study as `axial`, another series, files in reversed (descending) order."""
  return ct.write_series(str(tmp_path_factory.mktemp("descending")), patient_id=PATIENT, phi=axial.phi,
                         study_uid=axial.study_uid, seed=12, rows=24, cols=32, num_slices=9, descending=True)


@pytest.fixture(scope="module")
def oblique(tmp_path_factory) -> ct.SeriesTruth:
  return ct.write_series(str(tmp_path_factory.mktemp("oblique")), patient_id="LAB-0002", patient_name="Roe^Richard",
                         seed=13, rows=32, cols=32, num_slices=8, orientation=ct.OBLIQUE,
                         pixel_spacing=(0.75, 0.65), origin=(-31.5, 12.25, 80.0), instance_numbers="shuffled")


@pytest.fixture(scope="module")
def enhanced(tmp_path_factory) -> ct.SeriesTruth:
  return ct.write_enhanced_series(str(tmp_path_factory.mktemp("enhanced")), patient_id="LAB-0003",
                                  patient_name="Poe^Edgar", seed=14, rows=24, cols=28, num_frames=8,
                                  frame_order="shuffled", pixel_spacing=(0.6, 0.8))


@pytest.fixture(scope="module")
def axial_seg(axial, tmp_path_factory) -> tuple[str, bytes]:
  a, b = _masks(axial.hu.shape)
  path = cl.write_seg(axial, str(tmp_path_factory.mktemp("seg") / "seg.dcm"), [a, b], [LIVER, SPLEEN], seed=21)
  return path, _read(path)


# ---------------------------------------------------------------- config, sniff


def test_config_validation_and_dtypes():
  with pytest.raises(ValueError, match="sources"):
    labels.LabelConfig(sources=("seg", "png"), label_map=LABEL_MAP)
  with pytest.raises(ValueError, match="need a label map"):
    labels.LabelConfig(sources=("seg", "nifti"), label_map=None)
  with pytest.raises(ValueError, match="names no class"):
    labels.LabelConfig(sources=("seg",), label_map={"a": 0})
  with pytest.raises(ValueError, match="class id -1"):
    labels.LabelConfig(sources=("seg",), label_map={"a": 1, "b": -1})
  with pytest.raises(ValueError, match="class id 70000"):
    labels.LabelConfig(sources=("seg",), label_map={"a": 70000})
  with pytest.raises(ValueError, match="channels"):
    labels.LabelConfig(sources=("nifti",), label_map=None, layout="channels")
  with pytest.raises(ValueError, match="tolerance_mm"):
    labels.LabelConfig(sources=("seg",), label_map=LABEL_MAP, tolerance_mm=0)
  config = _config(nifti_series={"a.nii": "k"})
  assert pickle.loads(pickle.dumps(config)) == config and hash(config) == hash(_config(nifti_series={"a.nii": "k"}))
  nifti_only = labels.LabelConfig(sources=("nifti",), label_map=None)
  assert labels.label_dtype(nifti_only) == "uint16" and labels.num_channels(nifti_only) is None
  assert labels.label_dtype(_config()) == "uint8" and labels.num_channels(_config()) is None
  assert labels.label_dtype(_config(label_map={"a": 1, "b": 256})) == "uint16"
  channels = _config(label_map={"a": 1, "b": 300}, layout="channels")
  assert labels.label_dtype(channels) == "uint8" and labels.num_channels(channels) == 300


def test_sniff(axial, axial_seg, tmp_path):
  _, seg = axial_seg
  rt = cl.write_rtstruct(axial, str(tmp_path / "rt.dcm"), [cl.Roi(LIVER, [(3, cl.polygon_circle((9.3, 8.1), 4.2, 9))])],
                         seed=1)
  nii = cl.write_nifti(axial, str(tmp_path / "l.nii.gz"), _masks(axial.hu.shape)[0].astype(np.uint8))
  assert labels.sniff(seg, "x/seg.dcm") == "seg"
  assert labels.sniff(_read(rt), "rt") == "rtstruct"
  assert labels.sniff(_read(axial.files[0]), axial.files[0]) is None  # a CT slice
  assert labels.sniff(_read(nii), "labelsTr/case_001.nii.gz") == "nifti"
  assert labels.sniff(gzip.decompress(_read(nii)), "case.nii") == "nifti"
  assert labels.sniff(_read(nii), "case.dcm") is None  # NIfTI by name and magic
  assert labels.sniff(b"\0" * 400, "junk.nii") is None
  assert labels.sniff(gzip.compress(b"\0" * 400), "junk.nii.gz") is None
  assert labels.sniff(b"\0" * 128 + b"DICM" + b"\x01" * 50, "stub") is None
  with pytest.raises(labels.LabelRejected, match="not a label source"):
    labels.read_label_header(_read(axial.files[0]), axial.files[0], SALT, _config())
  with pytest.raises(labels.LabelRejected, match="not among the label sources"):
    labels.read_label_header(seg, "seg.dcm", SALT, _config(sources=("rtstruct",)))


# ---------------------------------------------------------------- SEG


@pytest.mark.parametrize("series", ["axial", "descending", "oblique", "enhanced"])
def test_seg_matches_highdicom(series, request, tmp_path):
  truth = request.getfixturevalue(series)
  a, b = _masks(truth.hu.shape)
  path = cl.write_seg(truth, str(tmp_path / "seg.dcm"), [a, b], [LIVER, SPLEEN], seed=21, source_order="files")
  data = _read(path)
  header = labels.read_label_header(data, path, SALT, _config())
  assert header.classes == (1, 2) and header.segments == ((1, 1), (2, 2))
  assert header.number_of_frames < 2 * truth.hu.shape[0]  # empty frames omitted: those slices are background
  got = labels.rasterize(_plan(truth), header, data, _config())
  reference = _highdicom(path, truth)
  assert got.dtype == np.uint8 and got.shape == truth.hu.shape
  np.testing.assert_array_equal(got, reference[..., 0] * 1 + reference[..., 1] * 2)
  np.testing.assert_array_equal(got, a * 1 + b * 2)


@pytest.mark.parametrize("syntax,fractional", [
    (pydicom.uid.JPEG2000Lossless, False), (pydicom.uid.RLELossless, True), (pydicom.uid.JPEGLSLossless, True)])
def test_seg_compressed(syntax, fractional, axial, tmp_path):
  a, b = _masks(axial.hu.shape)
  path = cl.write_seg(axial, str(tmp_path / "seg.dcm"), [a, b], [LIVER, SPLEEN], seed=26, transfer_syntax=syntax,
                      fractional=fractional)
  assert pydicom.dcmread(path).file_meta.TransferSyntaxUID == syntax
  reference = _highdicom(path, axial)
  got = _label(_plan(axial), _read(path), path)
  np.testing.assert_array_equal(got, (reference[..., 0] >= 0.5) * 1 + (reference[..., 1] >= 0.5) * 2)
  np.testing.assert_array_equal(got, a * 1 + b * 2)


def test_seg_binary_frames_not_byte_aligned(tmp_path):
  """13 x 11 = 143 pixels a frame: native BINARY frames start mid-byte, one bit later each frame."""
  truth = ct.write_series(str(tmp_path / "odd"), patient_id=PATIENT, seed=15, rows=13, cols=11, num_slices=9)
  a = cl.ellipsoid(truth.hu.shape, (4, 6, 5), (4, 5, 4))
  b = cl.ellipsoid(truth.hu.shape, (5, 3, 8), (3, 2, 2)) & ~a
  path = cl.write_seg(truth, str(tmp_path / "seg.dcm"), [a, b], [LIVER, SPLEEN], seed=27, omit_empty_frames=False)
  reference = _highdicom(path, truth)
  got = _label(_plan(truth), _read(path), path)
  np.testing.assert_array_equal(got, reference[..., 0] * 1 + reference[..., 1] * 2)
  np.testing.assert_array_equal(got, a * 1 + b * 2)


def test_header_pickles(axial, axial_seg):
  path, data = axial_seg
  header = labels.read_label_header(data, path, SALT, _config())
  assert pickle.loads(pickle.dumps(header)) == header
  assert header.patient_id == _plan(axial).patient_id and header.directory == os.path.dirname(path)
  assert header.series_uid_key == _plan(axial).slices[0].series_uid_key


def test_seg_fractional(axial, tmp_path):
  d, h, w = axial.hu.shape
  k, j, i = np.meshgrid(np.arange(d), np.arange(h), np.arange(w), indexing="ij")
  fraction = np.clip(1.2 - np.sqrt(((k - 4.3) / 3) ** 2 + ((j - 14.2) / 9) ** 2 + ((i - 17.6) / 11) ** 2), 0, 1)
  other = np.clip(1.0 - np.sqrt(((k - 5.1) / 3) ** 2 + ((j - 25.3) / 4) ** 2 + ((i - 33.2) / 4) ** 2), 0, 1)
  path = cl.write_seg(axial, str(tmp_path / "frac.dcm"), [fraction, other], [LIVER, SPLEEN], seed=22,
                      fractional=True)
  data = _read(path)
  reference = _highdicom(path, axial, rescale_fractional=True)
  for threshold in (0.5, 0.85):
    got = _label(_plan(axial), data, path, _config(fraction_threshold=threshold))
    expected = (reference[..., 0] >= threshold) * 1 + (reference[..., 1] >= threshold) * 2
    assert expected.any() and (expected == 2).any()
    np.testing.assert_array_equal(got, expected)


def test_seg_overlap_classes_rejected_channels_kept(axial, tmp_path):
  a, _ = _masks(axial.hu.shape)
  c = cl.ellipsoid(axial.hu.shape, (4.6, 16.3, 20.1), (3, 6, 6))
  assert (a & c).any()
  path = cl.write_seg(axial, str(tmp_path / "overlap.dcm"), [a, c], [LIVER, SPLEEN], seed=23)
  data = _read(path)
  label_map = {LIVER: 1, SPLEEN: 3}
  _rejected(lambda: _label(_plan(axial), data, path, _config(label_map=label_map)),
            r"segments of different classes overlap: use --label_layout=channels", _secrets(axial))
  got = _label(_plan(axial), data, path, _config(label_map=label_map, layout="channels"))
  reference = _highdicom(path, axial)
  assert got.shape == (*axial.hu.shape, 3) and got.dtype == np.uint8
  np.testing.assert_array_equal(got[..., 0], reference[..., 0])
  np.testing.assert_array_equal(got[..., 2], reference[..., 1])
  assert not got[..., 1].any()
  same_class = _label(_plan(axial), data, path, _config(label_map={LIVER: 7, SPLEEN: 7}))
  np.testing.assert_array_equal(same_class, (a | c) * 7)  # one class from two segments: their union


def test_seg_class_ids_over_255_are_uint16(axial, axial_seg):
  path, data = axial_seg
  got = _label(_plan(axial), data, path, _config(label_map={LIVER: 300, SPLEEN: 2}))
  a, b = _masks(axial.hu.shape)
  assert got.dtype == np.uint16
  np.testing.assert_array_equal(got, a * 300 + b * 2)


def test_liver_dcm_real_seg(tmp_path):
  seg_path = cl.liver_testdata()
  truth = cl.write_series_for_seg(seg_path, str(tmp_path / "ct"), seed=3)
  config = _config(sources=("seg",), label_map={"Liver": 1})
  got = _label(_plan(truth), _read(seg_path), seg_path, config)
  seg = hd.seg.segread(seg_path)
  reference = seg.get_pixels_by_source_instance([s.sop_uid for s in cl.volume_slots(truth)],
                                                ignore_spatial_locations=True)[..., 0]
  assert got.shape == (3, 512, 512) and got.sum() == 36233 + 35645 + 35220
  np.testing.assert_array_equal(got, reference)


def test_seg_frames_placed_by_plane_position_alone(axial, axial_seg):
  path, data = axial_seg

  def drop_sources(ds):
    for item in ds.PerFrameFunctionalGroupsSequence:
      del item.DerivationImageSequence

  got = _label(_plan(axial), _edited(data, drop_sources), path)
  a, b = _masks(axial.hu.shape)
  np.testing.assert_array_equal(got, a * 1 + b * 2)


def test_seg_within_tolerance_accepted(axial, axial_seg):
  path, data = axial_seg

  def jitter(ds):
    for item in ds.PerFrameFunctionalGroupsSequence:
      p = [float(v) for v in item.PlanePositionSequence[0].ImagePositionPatient]
      item.PlanePositionSequence[0].ImagePositionPatient = [p[0] + 0.02, p[1] - 0.02, p[2] + 0.01]

  a, b = _masks(axial.hu.shape)
  np.testing.assert_array_equal(_label(_plan(axial), _edited(data, jitter), path), a * 1 + b * 2)


def _seg_reject(axial, data: bytes, match: str, plan: VolumePlan | None = None, config=None, extra=()) -> str:
  plan = plan or _plan(axial)
  return _rejected(lambda: _label(plan, data, "seg.dcm", config), match, _secrets(axial, extra=extra))


def test_seg_half_voxel_shift_rejected(axial, axial_seg):
  _, data = axial_seg

  def shift(ds):  # half a column (0.8 mm) along the rows
    for item in ds.PerFrameFunctionalGroupsSequence:
      p = [float(v) for v in item.PlanePositionSequence[0].ImagePositionPatient]
      item.PlanePositionSequence[0].ImagePositionPatient = [p[0] + 0.4, p[1], p[2]]

  _seg_reject(axial, _edited(data, shift), r"plane position .* lies 0\.400 mm from its slice's")


def test_seg_pixel_spacing_or_orientation_off_rejected(axial, axial_seg):
  _, data = axial_seg

  def spacing(ds):
    ds.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0].PixelSpacing = [0.7, 0.81]

  def orientation(ds):
    ds.SharedFunctionalGroupsSequence[0].PlaneOrientationSequence[0].ImageOrientationPatient = [1, 0, 0, 0, -1, 0]

  _seg_reject(axial, _edited(data, spacing), r"orientation or pixel spacing .* up to 0\.390 mm apart")
  _seg_reject(axial, _edited(data, orientation), r"orientation or pixel spacing")


def test_seg_instances_not_in_series_rejected(axial, axial_seg):
  _, data = axial_seg
  part = _plan(axial, [s.path for s in cl.volume_slots(axial)[:8]])  # the first 8 of 10 slices
  _seg_reject(axial, data, r"references 2 instance\(s\) not in this series", plan=part)


def test_seg_of_another_series_or_patient_rejected(axial, axial_seg, descending, oblique):
  _, data = axial_seg
  secrets = _secrets(axial, descending, oblique)
  _rejected(lambda: _label(_plan(descending), data, "seg.dcm"), r"references another series", secrets)
  _rejected(lambda: _label(_plan(oblique), data, "seg.dcm"), r"belongs to another patient", secrets)

  def other_patient(ds):
    ds.PatientID = "LAB-9999"

  _seg_reject(axial, _edited(data, other_patient), r"belongs to another patient", extra=("LAB-9999",))


def test_seg_frame_of_reference_mismatch_rejected(axial, axial_seg):
  _, data = axial_seg
  uid = str(pydicom.uid.generate_uid(entropy_srcs=["other frame"]))

  def other(ds):
    ds.FrameOfReferenceUID = uid

  _seg_reject(axial, _edited(data, other), r"Frame of Reference mismatch", extra=(uid,))


def test_seg_more_frames_than_slices_rejected(axial, tmp_path):
  a, b = _masks(axial.hu.shape)
  path = cl.write_seg(axial, str(tmp_path / "full.dcm"), [a, b], [LIVER, SPLEEN], seed=24, omit_empty_frames=False)

  def one_segment(ds):
    for item in ds.PerFrameFunctionalGroupsSequence:
      item.SegmentIdentificationSequence[0].ReferencedSegmentNumber = 1

  _seg_reject(axial, _edited(_read(path), one_segment),
              r"more frames for segment 1 \(20\) than the volume has slices \(10\)")


def test_seg_two_frames_for_one_slice_rejected(axial, axial_seg):
  _, data = axial_seg
  frames = _frames(pydicom.dcmread(io.BytesIO(data)))
  liver_slices = {sop for segment, sop in frames if segment == 1}
  twin = next(n for n, (segment, sop) in enumerate(frames) if segment == 2 and sop in liver_slices)

  def relabel(ds):
    ds.PerFrameFunctionalGroupsSequence[twin].SegmentIdentificationSequence[0].ReferencedSegmentNumber = 1

  _seg_reject(axial, _edited(data, relabel), r"two SEG frames \(\d+ and \d+\) for segment 1 on one slice")


def test_seg_frame_off_the_slices_rejected(axial, axial_seg):
  _, data = axial_seg

  def between_slices(ds):  # no source reference, and half a slice (0.75 mm) up the normal
    item = ds.PerFrameFunctionalGroupsSequence[1]
    del item.DerivationImageSequence
    p = [float(v) for v in item.PlanePositionSequence[0].ImagePositionPatient]
    item.PlanePositionSequence[0].ImagePositionPatient = [p[0], p[1], p[2] + 0.75]

  def neither(ds):
    item = ds.PerFrameFunctionalGroupsSequence[2]
    del item.DerivationImageSequence
    del item.PlanePositionSequence

  _seg_reject(axial, _edited(data, between_slices), r"lies on no slice of the volume .* 0\.750 mm")
  _seg_reject(axial, _edited(data, neither), r"neither a source image reference .* nor a plane position")


def test_seg_multiframe_source_needs_frame_number(enhanced, tmp_path):
  a, b = _masks(enhanced.hu.shape)
  path = cl.write_seg(enhanced, str(tmp_path / "seg.dcm"), [a, b], [LIVER, SPLEEN], seed=25)

  def drop_frame_numbers(ds):
    for item in ds.PerFrameFunctionalGroupsSequence:
      del item.DerivationImageSequence[0].SourceImageSequence[0].ReferencedFrameNumber

  def frame_99(ds):
    ds.PerFrameFunctionalGroupsSequence[0].DerivationImageSequence[0].SourceImageSequence[0].ReferencedFrameNumber = 99

  _rejected(lambda: _label(_plan(enhanced), _edited(_read(path), drop_frame_numbers), path),
            r"multi-frame image without ReferencedFrameNumber", _secrets(enhanced))
  _rejected(lambda: _label(_plan(enhanced), _edited(_read(path), frame_99), path),
            r"references an instance or frame not in this volume", _secrets(enhanced))


def test_seg_malformed_rejected(axial, axial_seg):
  path, data = axial_seg
  _seg_reject(axial, data, r"segment 2 \(SegmentLabel \(0062,0005\)\) is not in --label_map",
              config=_config(label_map={LIVER: 1}))

  def labelmap(ds):
    ds.SegmentationType = "LABELMAP"

  def rows(ds):
    ds.Rows = 16

  def truncate(ds):
    ds.PixelData = ds.PixelData[:len(ds.PixelData) // 2]

  def labelmap_class(ds):
    ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = labels.LABEL_MAP_SEG_STORAGE

  _seg_reject(axial, _edited(data, labelmap), r"unsupported SegmentationType")
  assert labels.sniff(_edited(data, labelmap_class), "seg.dcm") == "seg"
  _seg_reject(axial, _edited(data, labelmap_class), r"Label Map Segmentation Storage is not supported")
  _seg_reject(axial, _edited(data, rows), r"SEG frame size \(Rows .* x Columns .*\) differs")
  _seg_reject(axial, _edited(data, truncate), r"PixelData .* holds fewer bytes")
  truncated = r"unreadable or truncated SEG header|invalid SEG header|missing mandatory tag"
  _seg_reject(axial, data[:3000], truncated)
  _seg_reject(axial, data[:len(data) // 3], truncated)
  sorted_by_number = dataclasses.replace(_plan(axial), sorted_by="instance_number")
  _seg_reject(axial, data, r"no slice positions", plan=sorted_by_number)


def test_seg_rejects_leave_nothing_in_logs_or_warnings(axial, axial_seg, caplog):
  _, data = axial_seg

  def other_patient(ds):
    ds.PatientID = "LAB-9999"
    ds.SegmentSequence[0].SegmentLabel = "not mapped Doe^Jane"

  def bad_value(ds):  # an IS holding a name: pydicom warns, quoting it, when it converts the value
    ds[0x00280008] = pydicom.dataelem.RawDataElement(pydicom.tag.Tag(0x00280008), "IS", 8, b"Doe^Jane", 0,
                                                     False, True)

  caplog.set_level(logging.DEBUG)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for edited in (_edited(data, other_patient), _edited(data, bad_value), data[:3000]):
      with pytest.raises(labels.LabelRejected):
        _label(_plan(axial), edited, "seg.dcm")
    with labels._quiet():  # what the readers log while labels reads, on this thread: dropped
      logging.getLogger("highdicom.seg.sop").warning("segment Doe^Jane")
      logging.getLogger("nibabel").warning("header of Doe^Jane")
      warnings.warn("value Doe^Jane")
  said = " ".join([r.getMessage() for r in caplog.records] + [str(w.message) for w in caught])
  assert not [s for s in _secrets(axial, extra=("LAB-9999",)) if s in said], said
  logging.getLogger("highdicom.seg.sop").warning("outside: kept")
  assert caplog.records[-1].getMessage() == "outside: kept"


# ---------------------------------------------------------------- RTSTRUCT


def _rois(truth: ct.SeriesTruth) -> list[cl.Roi]:
  """A liver with a hole (nested contour) on one slice, a spleen, an empty ROI; no vertex on a voxel centre."""
  d, h, w = truth.hu.shape
  liver = cl.Roi(LIVER, [(k, cl.polygon_circle((w * 0.41 + 0.13, h * 0.45 + 0.27), min(h, w) * 0.3, 23 + k))
                         for k in range(2, d - 3)])
  liver.contours.append((4, cl.polygon_circle((w * 0.41 + 0.52, h * 0.45 - 0.19), min(h, w) * 0.12, 11)))
  spleen = cl.Roi(SPLEEN, [(k, np.array([[w * 0.7 + 0.31, h * 0.2 + 0.17], [w * 0.9 + 0.13, h * 0.3 + 0.41],
                                         [w * 0.8 + 0.07, h * 0.7 + 0.23], [w * 0.75 + 0.29, h * 0.5 + 0.11]]))
                           for k in range(3, d - 2)])
  return [liver, spleen, cl.Roi(EMPTY)]


def _polygon_reference(truth: ct.SeriesTruth, rois: list[cl.Roi]) -> np.ndarray:
  """scikit-image's polygon2mask per contour, XOR per (ROI, slice), classes by the label map."""
  out = np.zeros(truth.hu.shape, np.uint8)
  for roi in rois:
    mask = np.zeros(truth.hu.shape, bool)
    for k, ij in roi.contours:
      mask[k] ^= polygon2mask(truth.hu.shape[1:], ij[:, ::-1])
    out[mask] = LABEL_MAP[roi.name]
  return out


def _dcmrtstruct2nii(rt_path: str, truth: ct.SeriesTruth, out_dir: str, monkeypatch) -> dict[str, np.ndarray]:
  """dcmrtstruct2nii's masks (SimpleITK reads the series, skimage fills), in the truth's voxel order."""
  monkeypatch.setattr(pydicom, "read_file", pydicom.dcmread, raising=False)  # its pydicom 2 name
  dcmrtstruct2nii(rt_path, os.path.dirname(truth.files[0]), out_dir, convert_original_dicom=False,
                  mask_foreground_value=1)
  out = {}
  for name in (LIVER, SPLEEN, EMPTY):
    path = os.path.join(out_dir, FilenameConverter().convert(f"mask_{name}") + ".nii.gz")
    if not os.path.exists(path):
      continue  # an ROI without contours: no mask
    image = sitk.ReadImage(path)
    direction = np.reshape(image.GetDirection(), (3, 3))
    np.testing.assert_allclose(direction.T, truth.direction, atol=1e-6)
    np.testing.assert_allclose(image.GetOrigin(), truth.origin, atol=1e-4)
    out[name] = sitk.GetArrayFromImage(image).astype(bool)  # [k, j, i], k along the normal from the origin
  return out


@pytest.mark.parametrize("series", ["axial", "descending", "oblique"])
def test_rtstruct_matches_dcmrtstruct2nii(series, request, tmp_path, monkeypatch):
  truth = request.getfixturevalue(series)
  rois = _rois(truth)
  path = cl.write_rtstruct(truth, str(tmp_path / "rt.dcm"), rois, seed=31)
  data = _read(path)
  header = labels.read_label_header(data, path, SALT, _config())
  assert header.classes == (1, 2, 3) and header.segments == ((1, 1), (2, 2), (3, 3))
  got = labels.rasterize(_plan(truth), header, data, _config())
  reference = _dcmrtstruct2nii(path, truth, str(tmp_path / "d2n"), monkeypatch)
  assert set(reference) == {LIVER, SPLEEN}
  np.testing.assert_array_equal(got == 1, reference[LIVER])
  np.testing.assert_array_equal(got == 2, reference[SPLEEN])
  assert not (got == 3).any()  # the empty ROI: mapped, no voxels
  np.testing.assert_array_equal(got, _polygon_reference(truth, rois))
  liver_slice = got[4] == 1
  assert liver_slice.any() and not liver_slice[int(truth.hu.shape[1] * 0.45), int(truth.hu.shape[2] * 0.41 + 0.5)]


def test_rtstruct_enhanced_ct(enhanced, tmp_path):
  rois = _rois(enhanced)
  path = cl.write_rtstruct(enhanced, str(tmp_path / "rt.dcm"), rois, seed=32)
  got = _label(_plan(enhanced), _read(path), path)
  np.testing.assert_array_equal(got, _polygon_reference(enhanced, rois))
  assert (got == 1).any() and (got == 2).any()


def test_rtstruct_fill_rule_ties(axial, tmp_path):
  """Corners on voxel centres: left and upper edges in, right and lower edges out (area = voxels)."""
  square = np.array([[2.0, 3.0], [6.0, 3.0], [6.0, 8.0], [2.0, 8.0]])
  path = cl.write_rtstruct(axial, str(tmp_path / "rt.dcm"), [cl.Roi(LIVER, [(5, square)])], seed=33)
  got = _label(_plan(axial), _read(path), path)
  expected = np.zeros(axial.hu.shape, np.uint8)
  expected[5, 3:8, 2:6] = 1
  np.testing.assert_array_equal(got, expected)


@pytest.mark.slow  # a benchmark-size input: one contour of a million points
def test_rtstruct_million_point_contour(axial, tmp_path):
  d, h, w = axial.hu.shape
  centre, radius = (20.13, 15.71), 11.37
  j, i = np.mgrid[0:h, 0:w]
  distance = np.hypot(i - centre[0], j - centre[1])
  assert np.min(np.abs(distance - radius)) > 1e-3  # no centre near the boundary: no tie to decide
  points = cl.polygon_circle(centre, radius, 1_000_000)
  path = cl.write_rtstruct(axial, str(tmp_path / "big.dcm"), [cl.Roi(LIVER, [(6, points)])], seed=34)
  data = _read(path)
  header = labels.read_label_header(data, path, SALT, _config())
  assert header.contour_points == 1_000_000
  got = labels.rasterize(_plan(axial), header, data, _config())
  expected = np.zeros(axial.hu.shape, np.uint8)
  expected[6] = distance < radius
  np.testing.assert_array_equal(got, expected)
  _rejected(lambda: labels.read_label_header(data, path, SALT, _config(max_contour_points=999_999)),
            r"too many contour points: the RTSTRUCT holds more than 999999", _secrets(axial))


def _rt_reject(truth, tmp_path, rois, match, config=None, plan=None, **kw) -> str:
  path = cl.write_rtstruct(truth, str(tmp_path / "rt.dcm"), rois, seed=35, **kw)
  data = _read(path)
  return _rejected(lambda: _label(plan or _plan(truth), data, path, config), match, _secrets(truth))


def test_rtstruct_contour_off_grid_or_outside_rejected(axial, tmp_path):
  d, h, w = axial.hu.shape
  ring = cl.polygon_circle((12.3, 10.6), 5.2, 13)
  normal = axial.direction[2]
  off = cl.contour_lps(axial, 4, ring) + 0.5 * axial.spacing[0] * normal
  beyond = cl.contour_lps(axial, d - 1, ring) + 2 * axial.spacing[0] * normal
  _rt_reject(axial, tmp_path, [cl.Roi(LIVER, [(4, ring)])], r"contour off the slice grid \(ROI 1: .* 0\.750 mm",
             lps={(0, 0): off})
  _rt_reject(axial, tmp_path, [cl.Roi(LIVER, [(d - 1, ring)])], r"contour outside the volume \(ROI 1: beyond the "
             r"first or last slice", lps={(0, 0): beyond})
  wide = np.array([[3.2, 4.1], [w + 1.3, 5.2], [w - 3.1, 20.7]])
  _rt_reject(axial, tmp_path, [cl.Roi(LIVER, [(4, wide)])], r"contour outside the volume \(ROI 1: beyond the "
             r"slice's rows or columns")
  edge = np.array([[-0.5, -0.5], [w - 0.5, -0.5], [w - 0.5, h - 0.5], [-0.5, h - 0.5]])  # the extent: allowed
  path = cl.write_rtstruct(axial, str(tmp_path / "edge.dcm"), [cl.Roi(LIVER, [(4, edge)])], seed=36)
  assert (_label(_plan(axial), _read(path), path)[4] == 1).all()


def test_names_mapped_to_0_are_left_out(axial, tmp_path):
  """A BODY ROI reaching past the field of view, and a POINT marker, mapped to 0: neither checked nor painted;
  an ignored SEG segment is not painted; a map of zeros names no class."""
  d, h, w = axial.hu.shape
  body = cl.Roi("BODY", [(4, np.array([[-9.2, -8.1], [w + 7.3, -6.2], [w + 5.1, h + 9.7]]))])
  marker = cl.Roi("marker", [(5, np.array([[3.2, 4.1]]))], contour_type="POINT")
  rois = _rois(axial)
  config = _config(label_map={**LABEL_MAP, "BODY": 0, "marker": 0})
  path = cl.write_rtstruct(axial, str(tmp_path / "rt.dcm"), [*rois, body, marker], seed=37)
  header = labels.read_label_header(_read(path), path, SALT, config)
  assert header.classes == (1, 2, 3)  # the empty ROI's 3 is mapped; BODY's and the marker's 0 are not classes
  np.testing.assert_array_equal(_label(_plan(axial), _read(path), path, config), _polygon_reference(axial, rois))
  with pytest.raises(labels.LabelRejected, match="ROI 4: beyond"):  # mapped, the same contour is a reject
    _label(_plan(axial), _read(path), path, _config(label_map={**LABEL_MAP, "BODY": 4, "marker": 0}))
  a, b = _masks(axial.hu.shape)
  seg = cl.write_seg(axial, str(tmp_path / "seg.dcm"), [a, b], [LIVER, "couch"], seed=38)
  got = _label(_plan(axial), _read(seg), seg, _config(label_map={LIVER: 1, "couch": 0}))
  np.testing.assert_array_equal(got, a * 1)
  with pytest.raises(ValueError, match="names no class"):
    _config(label_map={"BODY": 0})


def test_rtstruct_contour_on_another_slice_than_it_references(axial, tmp_path):
  ring = cl.polygon_circle((12.3, 10.6), 5.2, 13)
  _rt_reject(axial, tmp_path, [cl.Roi(LIVER, [(4, ring)])], r"references a slice other than the one it lies on",
             lps={(0, 0): cl.contour_lps(axial, 3, ring)})


def test_rtstruct_malformed_rejected(axial, oblique, tmp_path):
  ring = cl.polygon_circle((12.3, 10.6), 5.2, 13)
  _rt_reject(axial, tmp_path, [cl.Roi(LIVER, [(4, ring)]), cl.Roi(SPLEEN, [(5, ring)])],
             r"ROI 2 \(ROIName \(3006,0026\)\) is not in --label_map", config=_config(label_map={LIVER: 1}))
  _rt_reject(axial, tmp_path, [cl.Roi(LIVER, [(4, ring[:1])], contour_type="POINT")],
             r"unsupported contour type in ROI 1")
  _rt_reject(axial, tmp_path, [cl.Roi(LIVER, [(4, ring)]), cl.Roi(SPLEEN, [(4, ring + 0.3)])],
             r"ROIs of different classes overlap: use --label_layout=channels")
  _rt_reject(axial, tmp_path, [cl.Roi(LIVER, [(4, ring)])], r"belongs to another patient", plan=_plan(oblique))
  part = _plan(axial, [s.path for s in cl.volume_slots(axial)[:8]])
  _rt_reject(axial, tmp_path, [cl.Roi(LIVER, [(4, ring)])], r"references 2 instance\(s\) not in this series",
             plan=part)
  few = _config(max_contour_points=12)
  _rt_reject(axial, tmp_path, [cl.Roi(LIVER, [(4, ring)])], r"too many contour points", config=few)
  sorted_by_number = dataclasses.replace(_plan(axial), sorted_by="instance_number")
  _rt_reject(axial, tmp_path, [cl.Roi(LIVER, [(4, ring)])], r"no slice positions", plan=sorted_by_number)


def test_rtstruct_frame_of_reference_mismatch_and_channels(axial, tmp_path):
  ring = cl.polygon_circle((12.3, 10.6), 5.2, 13)
  path = cl.write_rtstruct(axial, str(tmp_path / "rt.dcm"), [cl.Roi(LIVER, [(4, ring)]),
                                                             cl.Roi(SPLEEN, [(4, ring + 0.3)])], seed=37)
  ds = pydicom.dcmread(path)
  uid = str(pydicom.uid.generate_uid(entropy_srcs=["rt frame"]))
  ds.ReferencedFrameOfReferenceSequence[0].FrameOfReferenceUID = uid
  for item in ds.StructureSetROISequence:
    item.ReferencedFrameOfReferenceUID = uid
  moved = cl.seg_bytes(ds)
  _rejected(lambda: _label(_plan(axial), moved, path), r"Frame of Reference mismatch", _secrets(axial, extra=(uid,)))
  got = _label(_plan(axial), _read(path), path, _config(layout="channels"))
  assert got.shape == (*axial.hu.shape, 3)
  assert (got[..., 0] & got[..., 1]).any() and not got[..., 2].any()


# ---------------------------------------------------------------- NIfTI


def _sitk_on_series(path: str, truth: ct.SeriesTruth) -> np.ndarray:
  """SimpleITK's reading of a NIfTI resampled (nearest neighbour, 0 outside) onto the series' grid, [k, j, i]."""
  image = sitk.ReadImage(path)
  d, h, w = truth.hu.shape
  grid = sitk.Image(w, h, d, sitk.sitkUInt8)
  grid.SetOrigin(truth.origin)
  grid.SetSpacing(truth.spacing[::-1])
  grid.SetDirection(truth.direction.T.ravel().tolist())
  out = sitk.Resample(image, grid, sitk.Transform(), sitk.sitkNearestNeighbor, 0, image.GetPixelID())
  return sitk.GetArrayFromImage(out)


def _classes(truth) -> np.ndarray:
  a, b = _masks(truth.hu.shape)
  return (a * 1 + b * 2).astype(np.uint8)


@pytest.mark.parametrize("series,axes,flips,name", [
    ("axial", "ijk", "", "l.nii.gz"),  # as ITK / nibabel write the volume
    ("axial", "ijk", "j", "l.nii"),  # dcm2niix flips the rows
    ("descending", "ijk", "jk", "l.nii.gz"),
    ("oblique", "kji", "", "l.nii.gz"),  # the volume's own array order
    ("oblique", "jik", "ik", "l.nii"),
])
def test_nifti_permutations_and_flips_undone(series, axes, flips, name, request, tmp_path):
  truth = request.getfixturevalue(series)
  label = _classes(truth)
  path = cl.write_nifti(truth, str(tmp_path / name), label, axes=axes, flips=flips)
  np.testing.assert_array_equal(_sitk_on_series(path, truth), label)  # the file says what the generator meant
  got = _label(_plan(truth), _read(path), path)
  assert got.dtype == np.uint8
  np.testing.assert_array_equal(got, label)


def test_nifti_variants(axial, tmp_path):
  label = _classes(axial)
  nifti2 = cl.write_nifti(axial, str(tmp_path / "two.nii.gz"), label, version=2, flips="i")
  floats = cl.write_nifti(axial, str(tmp_path / "f.nii.gz"), label, dtype=np.float32)
  for path in (nifti2, floats):
    np.testing.assert_array_equal(_label(_plan(axial), _read(path), path), label)
  config = _config(sources=("nifti",), label_map=None)
  big = cl.write_nifti(axial, str(tmp_path / "big.nii.gz"), label.astype(np.uint16) * 300, dtype=np.uint16)
  data = _read(big)
  header = labels.read_label_header(data, "labelsTr/big.nii.gz", SALT,
                                    dataclasses.replace(config, nifti_series={"labelsTr/big.nii.gz": "k1"}))
  assert (header.series_uid_key, header.classes, header.directory, header.patient_id) == ("k1", (300, 600),
                                                                                          "labelsTr", "")
  got = labels.rasterize(_plan(axial), header, data, config)
  assert got.dtype == np.uint16
  np.testing.assert_array_equal(got, label.astype(np.uint16) * 300)
  channels = _label(_plan(axial), _read(floats), floats, _config(layout="channels"))
  assert channels.shape == (*axial.hu.shape, 3)
  np.testing.assert_array_equal(channels[..., 0], label == 1)
  np.testing.assert_array_equal(channels[..., 1], label == 2)


def _nifti_reject(truth, path, match, config=None) -> str:
  data = _read(path)
  return _rejected(lambda: _label(_plan(truth), data, path, config), match, _secrets(truth))


def test_nifti_z_flip_that_is_not_the_geometry_rejected(axial, tmp_path):
  label = _classes(axial)
  affine = cl.series_affine(axial)
  affine[:3, 2] *= -1  # the slice axis reversed without moving the origin to the last slice
  path = cl.write_nifti(axial, str(tmp_path / "z.nii.gz"), label[::-1], affine=affine)
  _nifti_reject(axial, path, r"label map affine disagrees with the series geometry: voxels up to 13\.500 mm apart")


def test_nifti_shifted_rejected_or_resampled(axial, tmp_path):
  label = _classes(axial)
  shift = np.eye(4)
  shift[:3, 3] = [0.3, -0.2, 1.3]  # voxels along i, j, k
  path = cl.write_nifti(axial, str(tmp_path / "shift.nii.gz"), label, affine=cl.series_affine(axial) @ shift)
  _nifti_reject(axial, path, r"label map affine disagrees with the series geometry")
  got = _label(_plan(axial), _read(path), path, _config(resample=True))
  reference = _sitk_on_series(path, axial)
  np.testing.assert_array_equal(got, reference)
  assert not got[0].any() and np.array_equal(got[2:], label[1:-1])  # k moved by one, i and j rounded back

  coarse = np.diag([3.0, 3.0, 1.0, 1.0])
  flip_k = np.eye(4)
  flip_k[2, 2], flip_k[2, 3] = -1.0, axial.hu.shape[0] - 1.0
  path = cl.write_nifti(axial, str(tmp_path / "coarse.nii.gz"), label[::-1, ::3, ::3],
                        affine=cl.series_affine(axial) @ flip_k @ coarse)
  _nifti_reject(axial, path, r"label map affine disagrees with the series geometry \(its voxel spacing differs")
  got = _label(_plan(axial), _read(path), path, _config(resample=True))
  np.testing.assert_array_equal(got, _sitk_on_series(path, axial))
  assert (got == 1).any() and (got == 2).any()


def test_nifti_rotated_or_cropped_rejected(axial, tmp_path):
  label = _classes(axial)
  c, s = np.cos(np.radians(30)), np.sin(np.radians(30))
  rotation = np.array([[c, -s, 0, 0], [s, c, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
  path = cl.write_nifti(axial, str(tmp_path / "rot.nii.gz"), label, affine=rotation @ cl.series_affine(axial))
  _nifti_reject(axial, path, r"its axes are not the volume's axes in any order")
  path = cl.write_nifti(axial, str(tmp_path / "crop.nii.gz"), label[:-1])
  _nifti_reject(axial, path, r"label map shape differs from the volume")
  got = _label(_plan(axial), _read(path), path, _config(resample=True))
  np.testing.assert_array_equal(got[:-1], label[:-1])
  assert not got[-1].any()


def test_nifti_values_rejected(axial, tmp_path):
  label = _classes(axial)
  seven = label.copy()
  seven[5, 10, 10] = 7
  path = cl.write_nifti(axial, str(tmp_path / "seven.nii.gz"), seven)
  _nifti_reject(axial, path, r"NIfTI label value 7 is not a class id of --label_map")
  half = cl.write_nifti(axial, str(tmp_path / "half.nii.gz"), label * 0.5, dtype=np.float32)
  _nifti_reject(axial, half, r"NIfTI label values are not integers")
  bare = str(tmp_path / "bare.nii")
  nib.save(nib.Nifti1Image(label.T.copy(), None), bare)  # no affine: sform_code and qform_code 0
  _nifti_reject(axial, bare, r"NIfTI without an orientation")
  junk = str(tmp_path / "junk.nii.gz")
  with open(junk, "wb") as f:
    f.write(gzip.compress(gzip.decompress(_read(path))[:400]))  # the header, and a few voxels
  _nifti_reject(axial, junk, r"unreadable NIfTI")


def test_nifti_resampled_off_the_volume_rejected(axial, tmp_path):
  label = _classes(axial)
  shift = np.eye(4)
  shift[:3, 3] = [0.0, 0.0, axial.hu.shape[0] * 0.7]  # 70 % of the map beyond the last slice
  path = cl.write_nifti(axial, str(tmp_path / "off.nii.gz"), label, affine=cl.series_affine(axial) @ shift)
  _nifti_reject(axial, path, r"resampled NIfTI label map keeps \d+% of its foreground", _config(resample=True))


def test_nifti_voxel_count_bounded_before_inflating(axial, tmp_path):
  """A .gz of a few KB whose header claims 8 Gi voxels: refused from the header, nothing inflated past it."""
  header = nib.Nifti1Header()
  header.set_data_shape((2048, 2048, 2048))
  header.set_data_dtype(np.uint8)
  header.set_sform(cl.series_affine(axial), code=1)
  raw = io.BytesIO()
  header.write_to(raw)
  path = str(tmp_path / "bomb.nii.gz")
  with gzip.open(path, "wb") as f:
    f.write(raw.getvalue() + b"\0" * 4 + b"\0" * (1 << 20))
  _nifti_reject(axial, path, r"NIfTI over the size limit: more than 1000 voxels", _config(max_voxels=1000))
  _nifti_reject(axial, path, r"NIfTI over the size limit")


def test_seg_of_real_vendor_slices(tmp_path):
  """Real CT: 128 x 128 tiles of pydicom-data's 693_UNCR.dcm (and CT_small) stacked into a series, its bone
  (HU > 300, a real anatomy's shape) as a SEG segment: the converted mask is highdicom's and the threshold's."""
  from tests.pipelines import test_ct_syntaxes as syntaxes
  paths = []
  for i, tile in enumerate(syntaxes._real_slices()):
    stored, tags = syntaxes._pixels("ct16", tile)
    ds = syntaxes._dataset("1.2.826.0.1.3680043.8.498.77", i, stored, tags)
    ds.PatientID = PATIENT
    paths.append(str(tmp_path / f"{i}.dcm"))
    ds.save_as(paths[-1], enforce_file_format=True)
  plan = _plan(None, paths)
  hu = np.stack([s.astype(np.int32) - 1024 for s in (syntaxes._pixels("ct16", t)[0] for t in syntaxes._real_slices())])
  truth = ct.SeriesTruth(name="vendor", patient_id=PATIENT, series_uid="", study_uid="", hu=hu, spacing=plan.spacing,
                         origin=plan.origin, direction=np.asarray(plan.direction).reshape(3, 3).T,
                         files=[s.path for s in plan.slices])
  bone = hu > 300
  assert 0 < bone.mean() < 0.5
  path = cl.write_seg(truth, str(tmp_path / "seg.dcm"), [bone], [LIVER], seed=39)
  got = _label(plan, _read(path), path)
  np.testing.assert_array_equal(got, _highdicom(path, truth)[..., 0])
  np.testing.assert_array_equal(got, bone * 1)
