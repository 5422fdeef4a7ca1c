"""`pipelines.ct_volumes.headers.read_slices` on single files: what a SliceHeader holds for classic
and Enhanced CT, and the reasons a file is turned down (those tests/pipelines/test_ct_hostile.py and
test_ct_syntaxes.py do not already name). Files come from scripts/make_sample_ct.py. No Beam."""

from __future__ import annotations

import os
import re

import numpy as np
import pydicom
import pytest

from scripts import make_sample_ct as ct
from pipelines.ct_volumes.headers import SliceHeader, SliceRejected, read_slices, salted_hash
from tests.pipelines.test_ct_hostile import _silently

SALT = "header-salt"
PATIENT = "PAT-0042"
NUM = 4


def _read(path: str, salt: str = SALT, **kw) -> list[SliceHeader]:
  with open(path, "rb") as f:
    return read_slices(f, path, salt, **kw)


@pytest.fixture(scope="module")
def classic(tmp_path_factory) -> ct.SeriesTruth:
  return ct.write_series(str(tmp_path_factory.mktemp("classic")), patient_id=PATIENT, seed=1, rows=16, cols=20,
                         num_slices=NUM, pixel_spacing=(0.5, 0.75), slice_spacing=2.5, slope=0.5,
                         intercept=-1000.0, acquisition_number=3, pixel_padding_value=-2000)


@pytest.fixture(scope="module")
def enhanced(tmp_path_factory) -> ct.SeriesTruth:
  return ct.write_enhanced_series(str(tmp_path_factory.mktemp("enhanced")), patient_id=PATIENT, seed=2, rows=16,
                                  cols=12, num_frames=NUM, pixel_spacing=(0.6, 0.8), slice_spacing=1.5, slope=2.0,
                                  intercept=-1024.0, frame_order="shuffled")


def test_a_stack_id_of_free_text_never_reaches_the_key_in_clear(enhanced, tmp_path):
  """StackID is a short string: a number stays as it is ("stack=1"), text (here a name) is a salted hash,
  the same for every frame that shares it."""
  (path,) = enhanced.files
  ds = pydicom.dcmread(path)
  for i, item in enumerate(ds.PerFrameFunctionalGroupsSequence):
    item.FrameContentSequence[0].StackID = "SMITH^JOHN" if i % 2 else "2"
  edited = str(tmp_path / "edited.dcm")
  ds.save_as(edited)
  labels = [s.acquisition for s in _read(edited)]
  text = {a for i, a in enumerate(labels) if i % 2}
  assert {a for i, a in enumerate(labels) if not i % 2} == {"stack=2"} and len(text) == 1
  (label,) = text
  assert re.fullmatch(r"stack=h[0-9a-f]{12}", label) and "SMITH" not in label
  assert {s.acquisition for s in _read(edited, salt="another salt")} - {"stack=2"} != text  # keyed by the salt


def _expected_positions(t: ct.SeriesTruth, spacing: float) -> list[np.ndarray]:
  return [np.asarray(t.origin) + k * spacing * t.direction[2] for k in range(NUM)]


def test_a_classic_slice(classic):
  slices = [s for f in classic.files for s in _read(f)]
  assert len(slices) == NUM
  s = slices[0]
  assert s.path == classic.files[0] and s.frame is None and s.file_frames == 1
  assert (s.rows, s.columns, s.bits_allocated, s.bits_stored, s.pixel_representation) == (16, 20, 16, 16, 1)
  assert s.orientation == pytest.approx(ct.AXIAL) and s.pixel_spacing == pytest.approx((0.5, 0.75))
  assert (s.slope, s.intercept) == (0.5, -1000.0)
  assert s.padding == (-2000, -2000)
  assert s.acquisition == "acq=3" and s.spacing_between_slices is None
  assert s.instance_number == 1  # files are listed in InstanceNumber order
  # native little-endian pixels: read straight from the file at this offset, all of them there
  assert s.byte_order == "<" and s.pixel_bytes == 16 * 20 * 2 == s.file_pixel_bytes
  with open(s.path, "rb") as f:
    f.seek(s.pixel_offset)
    assert f.read(s.pixel_bytes) == pydicom.dcmread(s.path).PixelData
  got = sorted((np.asarray(x.position) for x in slices), key=lambda p: p @ classic.direction[2])
  np.testing.assert_allclose(got, _expected_positions(classic, 2.5), atol=1e-4)


def test_an_enhanced_ct_file_gives_one_header_per_frame(enhanced):
  (path,) = enhanced.files
  slices = _read(path)
  assert [s.frame for s in slices] == list(range(NUM))
  assert [s.instance_number for s in slices] == [i + 1 for i in range(NUM)]
  assert all(s.path == path and s.file_frames == NUM and s.rows == 16 and s.columns == 12 for s in slices)
  assert all(s.bits_stored == 12 and s.pixel_representation == 0 and s.pixel_offset is None for s in slices)
  assert all(s.orientation == pytest.approx(ct.AXIAL) and s.pixel_spacing == pytest.approx((0.6, 0.8))
             for s in slices)
  assert {(s.slope, s.intercept) for s in slices} == {(2.0, -1024.0)}  # from the shared functional group
  assert {s.acquisition for s in slices} == {"stack=1"}
  # each frame has its own position (the frames are shuffled in the file)
  ds = pydicom.dcmread(path, stop_before_pixels=True)
  for s, item in zip(slices, ds.PerFrameFunctionalGroupsSequence):
    assert s.position == pytest.approx(tuple(float(v) for v in item.PlanePositionSequence[0].ImagePositionPatient))
  got = sorted((np.asarray(s.position) for s in slices), key=lambda p: p @ enhanced.direction[2])
  np.testing.assert_allclose(got, _expected_positions(enhanced, 1.5), atol=1e-4)
  assert [s.position for s in slices] != sorted(s.position for s in slices)  # shuffled: order is the file's


def test_frames_of_one_series_share_its_key_and_series_differ(classic, enhanced, tmp_path):
  keys = {s.series_key for f in classic.files for s in _read(f)}
  assert len(keys) == 1
  # a second series of the same study, frame of reference and geometry: only the series UID differs
  twin = ct.write_series(str(tmp_path), patient_id=PATIENT, seed=5, rows=16, cols=20, num_slices=2,
                         pixel_spacing=(0.5, 0.75), study_uid=classic.study_uid, frame_uid=classic.frame_uid)
  assert twin.series_uid != classic.series_uid
  twin_keys = {s.series_key for f in twin.files for s in _read(f)}
  assert len(twin_keys) == 1 and twin_keys != keys
  enhanced_keys = {s.series_key for s in _read(enhanced.files[0])}
  assert len(enhanced_keys) == 1 and enhanced_keys != keys
  ids = {s.series_id for f in classic.files for s in _read(f)}
  assert ids == {salted_hash(SALT, "series", classic.study_uid, classic.series_uid)}


def test_ids_are_salted_hashes_never_the_raw_values(classic, enhanced):
  a, b = _read(classic.files[0])[0], _read(enhanced.files[0])[0]
  raw = str(pydicom.dcmread(classic.files[0], stop_before_pixels=True).PatientID)
  assert a.patient_id == b.patient_id == salted_hash(SALT, "patient", raw)  # one patient, two files
  assert raw not in {a.patient_id, a.series_id, a.series_key}
  assert classic.series_uid not in a.series_id and classic.study_uid not in a.series_key
  other = _read(classic.files[0], salt="another-salt")[0]
  assert other.patient_id != a.patient_id and other.series_key != a.series_key and other.series_id != a.series_id


# --------------------------------------------------------------------------- reasons


def _rewrite(src: str, dst: str, change) -> str:
  """`src` read by pydicom, changed by `change(ds)`, written to `dst`."""
  with _silently():
    ds = pydicom.dcmread(src)
    change(ds)
    ds.save_as(dst, enforce_file_format=False)
  return dst


def _rejected(path: str, **kw) -> str:
  with pytest.raises(SliceRejected) as e:
    _read(path, **kw)
  return str(e.value)


def test_not_dicom(tmp_path):
  path = tmp_path / "notes.dcm"
  path.write_bytes(b"just some text, no preamble")
  assert _rejected(str(path)) == "not DICOM (no DICM preamble)"


def test_a_file_meta_cut_short(classic, tmp_path):
  data = open(classic.files[0], "rb").read()
  path = tmp_path / "cut.dcm"
  path.write_bytes(data[:142])  # the preamble, "DICM" and half of the first meta element
  assert _rejected(str(path)).startswith("unreadable or truncated DICOM header: ")


def test_a_data_set_cut_short_is_missing_what_it_lost(classic, tmp_path):
  data = open(classic.files[0], "rb").read()
  path = tmp_path / "cut.dcm"
  path.write_bytes(data[:600])  # pydicom reads what is there: the image tags are gone
  assert _rejected(str(path)) == "missing mandatory tag Rows"


def test_an_undeflatable_deflated_data_set(classic, tmp_path):
  def deflated(ds):
    ds.file_meta.TransferSyntaxUID = "1.2.840.10008.1.2.1.99"

  path = _rewrite(classic.files[0], str(tmp_path / "deflated.dcm"), deflated)
  data = open(path, "rb").read()
  meta_end = data.index(b"1.2.840.10008.1.2.1.99") + len("1.2.840.10008.1.2.1.99") + 1
  with open(path, "wb") as f:  # the meta says deflated, the rest is not a deflate stream
    f.write(data[:meta_end] + b"\xff" * 64)
  assert _rejected(path) == "unreadable deflated data set (not a deflate stream)"


@pytest.mark.parametrize("change,reason", [
    (lambda ds: delattr(ds, "PixelData"), r"^no pixel data$"),
    (lambda ds: setattr(ds, "ImageType", ["ORIGINAL", "PRIMARY", "LOCALIZER"]), r"^localizer \(scout\) image$"),
    (lambda ds: setattr(ds, "SamplesPerPixel", 3), r"^not a grayscale image \(SamplesPerPixel != 1\)$"),
    (lambda ds: setattr(ds, "BitsAllocated", 12), r"^unsupported BitsAllocated \(0028,0100\): 8, 16 or 32 expected$"),
    (lambda ds: setattr(ds, "NumberOfFrames", 2),
     r"^multi-frame image without functional groups \(NumberOfFrames \(0028,0008\) > 1\)$"),
    (lambda ds: delattr(ds, "StudyInstanceUID"), r"^missing mandatory tag StudyInstanceUID$"),
    (lambda ds: delattr(ds, "RescaleSlope"), r"^missing mandatory tag RescaleSlope$"),
    (lambda ds: delattr(ds, "PixelRepresentation"), r"^missing mandatory tag PixelRepresentation$"),
    (lambda ds: setattr(ds, "ImageOrientationPatient", [1, 0, 0, 0, 1]),
     r"^invalid ImageOrientationPatient \(0020,0037\): expected 6 finite numbers$"),
    (lambda ds: setattr(ds, "PixelSpacing", [0.5, "inf"]),
     r"^invalid PixelSpacing \(0028,0030\): expected 2 finite numbers$"),
    (lambda ds: setattr(ds, "PixelSpacing", [0.5, 0]),
     r"^invalid PixelSpacing \(0028,0030\): expected positive numbers$"),
    (lambda ds: setattr(ds, "PixelSpacing", [-0.5, 0.5]),
     r"^invalid PixelSpacing \(0028,0030\): expected positive numbers$"),
    (lambda ds: setattr(ds, "RescaleSlope", 0),
     r"^invalid RescaleSlope \(0028,1053\): 0 maps every stored value to one HU$"),
    (lambda ds: setattr(ds, "BitsStored", 17), r"^invalid BitsStored \(0028,0101\)$"),
], ids=["no_pixels", "localizer", "rgb", "bits_allocated", "frames", "study", "slope", "representation", "iop",
        "spacing", "zero_spacing", "negative_spacing", "zero_slope", "bits_stored"])
def test_a_classic_slice_turned_down(classic, tmp_path, change, reason):
  path = _rewrite(classic.files[0], str(tmp_path / "bad.dcm"), change)
  with pytest.raises(SliceRejected, match=reason):
    _read(path)


def test_explicit_big_endian_over_16_bits_is_turned_down(classic, tmp_path):
  def big_endian_32(ds):
    ds.file_meta.TransferSyntaxUID = "1.2.840.10008.1.2.2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit = 32, 32, 31
    ds.PixelData = b"\0" * (ds.Rows * ds.Columns * 4)

  with _silently():
    ds = pydicom.dcmread(classic.files[0])
    big_endian_32(ds)
    path = str(tmp_path / "be32.dcm")
    pydicom.dcmwrite(path, ds, implicit_vr=False, little_endian=False, force_encoding=True)
  with pytest.raises(SliceRejected, match=r"^unsupported transfer syntax: Explicit VR Big Endian with "
                                          r"BitsAllocated \(0028,0100\) over 16$"):
    _read(path)


@pytest.mark.parametrize("change,reason", [
    (lambda ds: setattr(ds, "NumberOfFrames", NUM + 1),
     r"^invalid PerFrameFunctionalGroupsSequence \(5200,9230\): not one item per frame \(NumberOfFrames"),
    (lambda ds: delattr(ds.SharedFunctionalGroupsSequence[0], "PixelMeasuresSequence"),
     r"^missing mandatory tag PlaneOrientationSequence/PixelMeasuresSequence \(frame 0\)$"),
    (lambda ds: delattr(ds.SharedFunctionalGroupsSequence[0], "PixelValueTransformationSequence"),
     r"^missing mandatory tag RescaleSlope$"),
    (lambda ds: setattr(ds.PerFrameFunctionalGroupsSequence[2], "CTImageFrameTypeSequence",
                        pydicom.Sequence([pydicom.Dataset()])) or setattr(
                            ds.PerFrameFunctionalGroupsSequence[2].CTImageFrameTypeSequence[0], "FrameType",
                            ["ORIGINAL", "PRIMARY", "LOCALIZER", "NONE"]),
     r"^localizer \(scout\) image$"),
    (lambda ds: setattr(ds.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0], "PixelSpacing", [0, 0.5]),
     r"^invalid PixelSpacing \(0028,0030\): expected positive numbers$"),
    (lambda ds: setattr(ds.SharedFunctionalGroupsSequence[0].PixelValueTransformationSequence[0], "RescaleSlope",
                        0), r"^invalid RescaleSlope \(0028,1053\): 0 maps"),
], ids=["frames", "measures", "rescale", "localizer_frame", "zero_spacing", "zero_slope"])
def test_an_enhanced_file_turned_down(enhanced, tmp_path, change, reason):
  path = _rewrite(enhanced.files[0], str(tmp_path / "bad.dcm"), change)
  with pytest.raises(SliceRejected, match=reason):
    _read(path)


def test_per_frame_rescale_overrides_the_shared_one(tmp_path):
  t = ct.write_enhanced_series(str(tmp_path), patient_id=PATIENT, seed=3, rows=8, cols=8, num_frames=3,
                               slopes_per_frame=[1.0, 0.5, 2.0], frame_order="ascending")
  assert [s.slope for s in _read(t.files[0])] == [1.0, 0.5, 2.0]


def test_the_readers_stay_out_of_the_filesystem(classic):
  """read_slices reads the stream it is given; `path` is only a label."""
  with open(classic.files[0], "rb") as f:
    (s,) = read_slices(f, "gs://elsewhere/label.dcm", SALT)
  assert s.path == "gs://elsewhere/label.dcm" and os.path.exists(classic.files[0])


def test_enhanced_ct_stored_one_frame_per_file_makes_the_volume(tmp_path):
  """An Enhanced CT series written one single-frame file per slice: pydicom decodes each as a 2-D array, which
  is the frame itself (indexing it took one row, and the series was rejected for its shape)."""
  from pipelines.ct_volumes.assembly import plan_volumes, read_volume

  t = ct.write_enhanced_series(str(tmp_path / "multi"), patient_id=PATIENT, seed=4, rows=8, cols=8, num_frames=3,
                               frame_order="ascending")
  ds = pydicom.dcmread(t.files[0])
  frames = ds.pixel_array
  paths = []
  for i in range(3):
    one = pydicom.dcmread(t.files[0])
    one.NumberOfFrames = 1
    one.PerFrameFunctionalGroupsSequence = pydicom.Sequence([ds.PerFrameFunctionalGroupsSequence[i]])
    one.PixelData = np.ascontiguousarray(frames[i]).tobytes()
    one.SOPInstanceUID = pydicom.uid.generate_uid()
    paths.append(str(tmp_path / f"single{i}.dcm"))
    one.save_as(paths[i])
  slices = [s for p in paths for s in _read(p)]
  (plan,), rejected = plan_volumes(slices)
  assert not rejected
  vol, _ = read_volume(plan, lambda p: open(p, "rb"), "int16")
  np.testing.assert_array_equal(vol, t.hu)
