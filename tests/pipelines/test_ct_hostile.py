"""Hostile DICOM input: no header value reaches a reason, an output byte or a log line,
and a header claiming huge images costs nothing before it is rejected."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
import tracemalloc
import warnings

import pydicom
from pydicom.data import get_testdata_file
from pydicom.dataelem import RawDataElement
from pydicom.datadict import dictionary_VR, tag_for_keyword
from pydicom.tag import Tag
import pytest

from pipelines.ct_volumes.assembly import SeriesRejected, plan_volumes, read_volume
from pipelines.ct_volumes.headers import SliceRejected, read_slices
from tests.conftest import REPO

MARKER = "ZZPHI^SECRET^42"
SALT = "salt"
MR_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.4"
RLE_LOSSLESS = "1.2.840.10008.1.2.5"


def _tag_text(keyword: str) -> str:
  tag = Tag(tag_for_keyword(keyword))
  return f"{keyword} ({tag.group:04X},{tag.element:04X})"


def _plant(ds: pydicom.Dataset, keyword: str, text: str) -> None:
  """Puts `text` into the element as raw bytes, as a hostile writer would (no validation)."""
  tag = Tag(tag_for_keyword(keyword))
  value = text.encode() + (b" " if len(text) % 2 else b"")
  ds[tag] = RawDataElement(tag, dictionary_VR(tag), len(value), value, 0, False, True)


@contextlib.contextmanager
def _silently():
  """Writing hostile files makes pydicom warn and log too: not what the tests listen to."""
  logger = logging.getLogger("pydicom")
  disabled, logger.disabled = logger.disabled, True
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      yield
  finally:
    logger.disabled = disabled


def _ct(path: str, *, series: str = "1.2.826.0.1.3680043.9.9.1", z: float = 0.0, instance: int = 1,
        plant: dict[str, str] | None = None, **values) -> str:
  """CT_small.dcm (128x128 CT, explicit VR little endian) as one slice of `series` at `z`."""
  with _silently():
    return _write_ct(path, series, z, instance, plant, values)


def _write_ct(path: str, series: str, z: float, instance: int, plant: dict[str, str] | None, values: dict) -> str:
  ds = pydicom.dcmread(get_testdata_file("CT_small.dcm"))
  ds.StudyInstanceUID = "1.2.826.0.1.3680043.9.9"
  ds.SeriesInstanceUID = series
  ds.SOPInstanceUID = f"{series}.{instance}"
  ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
  ds.InstanceNumber = instance
  ds.ImagePositionPatient = [-158.135803, -179.035797, z]
  for keyword, value in values.items():
    if keyword == "TransferSyntaxUID":
      ds.file_meta.TransferSyntaxUID = value
    else:
      setattr(ds, keyword, value)
  for keyword, text in (plant or {}).items():
    _plant(ds, keyword, text)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  ds.save_as(path, enforce_file_format=False, implicit_vr=False, little_endian=True)
  return path


def _series(folder: str, n: int = 3, **kw) -> list[str]:
  series = kw.pop("series", "1.2.826.0.1.3680043.9.9.1")
  return [_ct(os.path.join(folder, f"s{i}"), series=series, z=5.0 * i, instance=i + 1, **kw) for i in range(n)]


def _headers(path: str, **kw) -> list:
  with open(path, "rb") as f:
    return read_slices(f, path, SALT, **kw)


@pytest.fixture
def said(caplog):
  """Everything this test's code says through logging and warnings, as one string."""
  caplog.set_level(logging.DEBUG)
  with warnings.catch_warnings(record=True) as recorded:
    warnings.simplefilter("always")

    def text() -> str:
      return "\n".join([caplog.text, *(r.getMessage() for r in caplog.records),
                        *(str(w.message) for w in recorded)])

    yield text


# What each planted file's reason must name; `values` make the file otherwise valid.
PLANTED = {
    "RescaleSlope": ({}, _tag_text("RescaleSlope")),
    "RescaleIntercept": ({}, _tag_text("RescaleIntercept")),
    "SpacingBetweenSlices": ({}, _tag_text("SpacingBetweenSlices")),
    "InstanceNumber": ({}, _tag_text("InstanceNumber")),
    "NumberOfFrames": ({}, _tag_text("NumberOfFrames")),
    "AcquisitionNumber": ({}, _tag_text("AcquisitionNumber")),
    "PhotometricInterpretation": ({}, _tag_text("PhotometricInterpretation")),
    "Modality": ({"SOPClassUID": MR_IMAGE_STORAGE}, "not a CT image (SOP class MR Image Storage)"),
    "SOPClassUID": ({}, _tag_text("SOPClassUID")),
    "TransferSyntaxUID": ({}, _tag_text("TransferSyntaxUID")),
}


def _planted_file(folder: str, keyword: str) -> str:
  values, _ = PLANTED[keyword]
  path = os.path.join(folder, keyword.lower())
  series = f"1.2.826.0.1.3680043.9.9.{100 + sorted(PLANTED).index(keyword)}"
  if keyword == "TransferSyntaxUID":
    return _ct(path, series=series, TransferSyntaxUID=MARKER, **values)
  return _ct(path, series=series, plant={keyword: MARKER}, **values)


@pytest.mark.parametrize("keyword", sorted(PLANTED))
def test_a_bad_header_value_is_rejected_by_tag_name_never_quoted(tmp_path, said, keyword):
  path = _planted_file(str(tmp_path), keyword)
  with pytest.raises(SliceRejected) as e:
    _headers(path)
  reason = str(e.value)
  assert PLANTED[keyword][1] in reason
  assert MARKER not in reason
  assert "ZZPHI" not in said()


def test_a_well_formed_unknown_sop_class_is_not_named(tmp_path, said):
  path = _ct(str(tmp_path / "f"), SOPClassUID="1.2.826.0.1.3680043.9.9.77", plant={"Modality": MARKER})
  with pytest.raises(SliceRejected, match=r"^not a CT image \(SOP class unknown\)$"):
    _headers(path)
  assert "ZZPHI" not in said()



def test_a_secondary_capture_is_called_an_image_that_is_not_ct(tmp_path, said):
  """A secondary capture is an image (not a "non-image object"); a dose report is not one."""
  sc = _ct(str(tmp_path / "sc"), SOPClassUID="1.2.840.10008.5.1.4.1.1.7", plant={"Modality": MARKER})
  with pytest.raises(SliceRejected, match=r"^not a CT image \(secondary capture\)$"):
    _headers(sc)
  sr = _ct(str(tmp_path / "sr"), SOPClassUID="1.2.840.10008.5.1.4.1.1.88.67", plant={"Modality": MARKER})
  with pytest.raises(SliceRejected, match=r"^non-image object \(dose report \(structured report\)\)$"):
    _headers(sr)
  assert "ZZPHI" not in said()

def test_values_in_tags_the_toolkit_does_not_use_are_never_printed(tmp_path, said):
  """An invalid PatientAge (AS), an unknown character set, names: pydicom warns and logs
  them with their values; none of it may reach a log or the warnings."""
  plant = {"PatientAge": MARKER, "SpecificCharacterSet": MARKER, "PatientName": MARKER,
           "PatientID": MARKER, "StudyDescription": MARKER, "InstitutionName": MARKER}
  paths = _series(str(tmp_path), plant=plant)
  slices = [s for p in paths for s in _headers(p)]
  (plan,), rejected = plan_volumes(slices)
  assert not rejected
  volume, _ = read_volume(plan, lambda p: open(p, "rb"), "int16")
  assert volume.shape == (3, 128, 128)
  assert "ZZPHI" not in said()
  assert not any("ZZPHI" in str(v) for s in slices for v in dataclasses.astuple(s))


def test_pixel_decoding_errors_never_quote_values(tmp_path, said):
  """pydicom's own exception while decoding says `Unknown (0028,0004) ... value '<value>'`."""
  paths = _series(str(tmp_path), RescaleIntercept=-1024)
  slices = [s for p in paths for s in _headers(p)]
  # the file changes after its header was read (or pydicom dislikes what we accepted)
  _ct(paths[1], z=5.0, instance=2, plant={"PhotometricInterpretation": MARKER})
  slices = [dataclasses.replace(s, pixel_offset=None) for s in slices]  # decode with pydicom
  (plan,), _ = plan_volumes(slices)
  with pytest.raises(SeriesRejected) as e:
    read_volume(plan, lambda p: open(p, "rb"), "int16")
  assert e.value.culprit == paths[1]
  assert "ZZPHI" not in str(e.value)
  assert "ZZPHI" not in e.value.culprit_reason
  assert e.value.culprit_reason.startswith("truncated or undecodable pixel data")
  assert "ZZPHI" not in said()


def test_huge_dimensions_are_rejected_from_the_header(tmp_path):
  """Three 14 KB files claiming 65535 x 65535 (8 GiB each): rejected by the per-file cap,
  the reason names the tags and the limit; a compressed one is held to the same cap."""
  for i in range(3):
    path = _ct(str(tmp_path / f"big{i}"), z=float(i), instance=i + 1, Rows=65535, Columns=65535,
               PixelData=bytes(14000))
    assert os.path.getsize(path) < 30000
    with pytest.raises(SliceRejected, match=r"^pixel data over the size limit: .*Rows \(0028,0010\)"
                       r".*Columns \(0028,0011\).*1073741824 bytes"):
      _headers(path)
  rle = _ct(str(tmp_path / "rle"), Rows=65535, Columns=65535, TransferSyntaxUID=RLE_LOSSLESS,
            PixelData=pydicom.encaps.encapsulate([bytes(64)]))
  with pytest.raises(SliceRejected, match="^pixel data over the size limit"):
    _headers(rle)


def test_the_caps_are_parameters(tmp_path):
  """A 128x128 16-bit file is 32 KiB decoded: a 16 KiB cap rejects it; the volume cap
  rejects a series of such files at planning and again (defensively) before decoding."""
  paths = _series(str(tmp_path))
  with pytest.raises(SliceRejected, match="over the size limit.*16384 bytes"):
    _headers(paths[0], max_file_bytes=16384)
  slices = [s for p in paths for s in _headers(p, max_file_bytes=32768)]
  plans, rejected = plan_volumes(slices, max_volume_voxels=3 * 128 * 128 - 1)
  assert not plans
  assert len(rejected) == 3
  assert all(r.startswith("series rejected, volume over the size limit") and "Rows (0028,0010)" in r
             for _, r, _ in rejected)
  (plan,), _ = plan_volumes(slices)
  with pytest.raises(SeriesRejected, match="volume over the size limit"):
    read_volume(plan, lambda p: open(p, "rb"), "int16", max_volume_voxels=1000)


def test_short_pixel_data_is_found_before_anything_is_allocated(tmp_path):
  """Two 14 KB files claiming 16000 x 16000 (under both caps: 512 MB each, 512 M voxels in
  all): the volume is rejected for its truncated slice without allocating the volume."""
  paths = [_ct(str(tmp_path / f"f{i}"), z=float(i), instance=i + 1, Rows=16000, Columns=16000,
               PixelData=bytes(14000)) for i in range(2)]
  slices = [s for p in paths for s in _headers(p)]
  (plan,), rejected = plan_volumes(slices)
  assert not rejected
  tracemalloc.start()
  try:
    with pytest.raises(SeriesRejected) as e:
      read_volume(plan, lambda p: open(p, "rb"), "float32")
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert peak < 16 << 20
  assert e.value.culprit in paths
  assert e.value.culprit_reason.startswith("truncated or undecodable pixel data: PixelData (7FE0,0010)")


# --------------------------------------------------------------------------- end to end


def _run_pipeline(src: str, out: str, *flags: str) -> dict:
  from pipelines import ct_volumes

  ct_volumes.run([f"--input={src}", f"--output={out}", f"--id_salt={SALT}", "--splits=train=1.0", *flags])
  with open(os.path.join(out, "manifest.json")) as f:
    return json.load(f)


def _rejects(out: str, manifest: dict) -> dict[str, str]:
  with open(os.path.join(out, manifest["rejected"]["path"]), "rb") as f:
    return {(e := json.loads(line))["input"]: e["reason"] for line in f.read().splitlines()}


@pytest.mark.slow
def test_pipeline_leaks_no_planted_value_anywhere(tmp_path, said, capfd):
  src = str(tmp_path / "in")
  good = _series(os.path.join(src, "good"), plant={
      "PatientName": MARKER, "PatientID": MARKER, "PatientAge": MARKER, "StudyDescription": MARKER,
      "SpecificCharacterSet": MARKER})
  planted = {_planted_file(os.path.join(src, "bad"), k): k for k in PLANTED}
  out = str(tmp_path / "out")
  manifest = _run_pipeline(src, out)
  assert manifest["splits"]["train"]["num_records"] == 1
  rejects = _rejects(out, manifest)
  assert set(rejects) == set(planted)
  assert manifest["rejected"]["count"] == len(planted)
  for path, keyword in planted.items():
    assert PLANTED[keyword][1] in rejects[path], (keyword, rejects[path])
  assert not set(good) & set(rejects)
  for folder, _, names in os.walk(out):
    for name in names:
      with open(os.path.join(folder, name), "rb") as f:
        assert b"ZZPHI" not in f.read(), name
  captured = capfd.readouterr()
  assert "ZZPHI" not in captured.out + captured.err
  assert "ZZPHI" not in said()


@pytest.mark.slow
def test_huge_dimension_files_do_not_stop_the_job(tmp_path):
  """The three 14 KB 65535 x 65535 files next to a good series, in a process limited to
  4 GiB of address space: they are rejects, the good series is converted."""
  src = str(tmp_path / "in")
  _series(os.path.join(src, "good"))
  big = {_ct(os.path.join(src, "big", f"b{i}"), series="1.2.826.0.1.3680043.9.9.2", z=float(i),
             instance=i + 1, Rows=65535, Columns=65535, PixelData=bytes(14000)) for i in range(3)}
  out = str(tmp_path / "out")
  script = textwrap.dedent(f"""
      import resource
      resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
      from pipelines import ct_volumes
      ct_volumes.run([{f"--input={src}"!r}, {f"--output={out}"!r}, "--id_salt=s", "--splits=train=1.0"])
  """)
  r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                     env={**os.environ, "PYTHONPATH": REPO}, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  with open(os.path.join(out, "manifest.json")) as f:
    manifest = json.load(f)
  assert manifest["splits"]["train"]["num_records"] == 1
  rejects = _rejects(out, manifest)
  assert set(rejects) == big
  assert all(r.startswith("pixel data over the size limit") and "Rows (0028,0010)" in r for r in rejects.values())


@pytest.mark.slow
def test_the_caps_are_flags_of_the_pipeline(tmp_path):
  from pipelines.core import UsageError

  src = str(tmp_path / "in")
  os.makedirs(src)
  files = _series(src, 3)
  rows, cols = _headers(files[0])[0].rows, _headers(files[0])[0].columns
  m = _run_pipeline(src, str(tmp_path / "vox"), f"--max_volume_voxels={3 * rows * cols - 1}")
  # a split without records is left out of manifest.json (as of _sink 4f55b7f)
  assert m["splits"].get("train", {"num_records": 0})["num_records"] == 0
  assert m["rejected"]["count"] == 3
  assert all("volume over the size limit" in r for r in _rejects(str(tmp_path / "vox"), m).values())
  m = _run_pipeline(src, str(tmp_path / "file"), f"--max_file_bytes={rows * cols * 2 - 1}")
  assert m["rejected"]["count"] == 3
  assert all(r.startswith("pixel data over the size limit") for r in _rejects(str(tmp_path / "file"), m).values())
  m = _run_pipeline(src, str(tmp_path / "ok"), f"--max_volume_voxels={3 * rows * cols}",
                    f"--max_file_bytes={rows * cols * 2}")
  assert m["splits"]["train"]["num_records"] == 1
  assert m["rejected"]["count"] == 0
  for bad in ("--max_file_bytes=0", "--max_volume_voxels=-1", "--max_file_bytes=lots"):
    with pytest.raises(UsageError, match=bad.split("=")[0]):
      _run_pipeline(src, str(tmp_path / "bad"), bad)
  assert not os.path.exists(tmp_path / "bad")
