"""Every DICOM transfer syntax, end to end: a series of real CT slices re-encoded in the
syntax, converted by `pipelines.ct_volumes`, equals pydicom's own decode voxel for voxel
(stored value x slope + intercept, padding -> CT_PADDING_HU), or every file of it is a
reject naming the syntax. Lossy syntaxes are compared with pydicom's decode of the
lossy file itself.

The slices are real CT: 128 x 128 tiles of pydicom-data's `693_UNCR.dcm` (14-bit
signed, PixelPaddingValue -2000 outside the field of view) and pydicom's
`CT_small.dcm`, in one series. How each file is built (pydicom's encoders, GDCM where
pydicom has none) is in SYNTAXES.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import zlib

import gdcm
import numpy as np
import pydicom
from pydicom.data import get_testdata_file
from pydicom.uid import UID
import pytest

from formats.transforms import CT_PADDING_HU
from formats import arrayrecord
from formats.storage import files
from formats.manifest import Manifest
from pipelines import ct_volumes
from pipelines.ct_volumes.assembly import plan_volumes, read_volume
from pipelines.ct_volumes import headers as ct_headers
from pipelines.ct_volumes.headers import SliceRejected, read_slices, salted_hash
from tests.pipelines.test_ct_hostile import _silently  # noqa: E402  (one quiet pydicom for the tests)

SALT = "syntax-salt"
STUDY = "1.2.826.0.1.3680043.9.7.1"
TILES = ((0, 0), (192, 160), (300, 120))  # 693_UNCR tiles: the first is mostly padding


@dataclasses.dataclass(frozen=True)
class Syntax:
  uid: str
  build: str  # how the test makes the file
  pixels: str = "ct16"  # ct16: 14-bit signed CT; ct12: 12-bit unsigned CT; ct8: 8-bit
  supported: bool = True  # False: every file must be a reject naming the syntax


# The full list: every transfer syntax pydicom registers that a CT image could carry.
SYNTAXES = {
    "implicit_le": Syntax("1.2.840.10008.1.2", "pydicom"),
    "explicit_le": Syntax("1.2.840.10008.1.2.1", "pydicom"),
    "explicit_be": Syntax("1.2.840.10008.1.2.2", "gdcm"),
    "explicit_be_8bit": Syntax("1.2.840.10008.1.2.2", "gdcm", "ct8"),
    "deflated_le": Syntax("1.2.840.10008.1.2.1.99", "pydicom"),
    "rle": Syntax("1.2.840.10008.1.2.5", "pydicom"),
    "jpeg_baseline": Syntax("1.2.840.10008.1.2.4.50", "gdcm", "ct8"),
    "jpeg_extended_8bit": Syntax("1.2.840.10008.1.2.4.51", "gdcm", "ct8"),
    # 12-bit JPEG (the only JPEG lossy a CT image can carry): GDCM encodes it, but no
    # installed pydicom plugin decodes 12-bit samples (pylibjpeg-libjpeg would; GPLv3).
    "jpeg_extended_12bit": Syntax("1.2.840.10008.1.2.4.51", "gdcm", "ct12", supported=False),
    "jpeg_lossless_p14": Syntax("1.2.840.10008.1.2.4.57", "gdcm"),
    "jpeg_lossless_sv1": Syntax("1.2.840.10008.1.2.4.70", "gdcm"),
    "jpeg_ls_lossless": Syntax("1.2.840.10008.1.2.4.80", "pydicom"),
    "jpeg_ls_near_lossless": Syntax("1.2.840.10008.1.2.4.81", "pydicom"),
    "j2k_lossless": Syntax("1.2.840.10008.1.2.4.90", "pydicom"),
    "j2k_lossy": Syntax("1.2.840.10008.1.2.4.91", "pydicom"),
    # JPEG 2000 Part 2 (multi-component): GDCM encodes it, pydicom has no decoder.
    "j2k_mc_lossless": Syntax("1.2.840.10008.1.2.4.92", "gdcm", supported=False),
    # HTJ2K: pylibjpeg-openjpeg decodes it, but nothing installed here encodes it, so the
    # toolkit cannot prove its decode exact and rejects it. The files carry a Part 1
    # codestream under the HTJ2K UID (the reject comes from the syntax, before any pixel).
    "htj2k_lossless": Syntax("1.2.840.10008.1.2.4.201", "relabel_j2k", supported=False),
    "htj2k_rpcl_lossless": Syntax("1.2.840.10008.1.2.4.202", "relabel_j2k", supported=False),
    "htj2k": Syntax("1.2.840.10008.1.2.4.203", "relabel_j2k", supported=False),
    # Retired or not pixel codecs a CT can use: labelled files (no encoder exists here).
    "jpeg_extended_p3_5": Syntax("1.2.840.10008.1.2.4.52", "relabel_j2k", supported=False),
    "jpip_referenced": Syntax("1.2.840.10008.1.2.4.94", "relabel_j2k", supported=False),
    "mpeg2_main": Syntax("1.2.840.10008.1.2.4.100", "relabel_j2k", supported=False),
}
LOSSY = {"jpeg_ls_near_lossless", "j2k_lossy"}
SUPPORTED = sorted(k for k, s in SYNTAXES.items() if s.supported)
UNSUPPORTED = sorted(k for k, s in SYNTAXES.items() if not s.supported)




def _real_slices() -> list[np.ndarray]:
  """Three 128 x 128 real CT slices: two tiles of 693_UNCR, then CT_small."""
  big = pydicom.dcmread(get_testdata_file("693_UNCR.dcm")).pixel_array
  small = pydicom.dcmread(get_testdata_file("CT_small.dcm")).pixel_array
  tiles = [big[r:r + 128, c:c + 128] for r, c in TILES[:2]]
  return [np.ascontiguousarray(t) for t in (*tiles, small)]


def _pixels(kind: str, stored: np.ndarray) -> tuple[np.ndarray, dict]:
  """The stored values and pixel-module tags of a slice in one of the three layouts."""
  if kind == "ct16":  # as 693_UNCR: 14-bit signed, padding -2000, HU = stored - 1024
    return stored.astype(np.int16), dict(BitsAllocated=16, BitsStored=14, HighBit=13, PixelRepresentation=1,
                                         PixelPaddingValue=-2000, RescaleIntercept=-1024)
  hu = np.where(stored == -2000, -3000, stored.astype(np.int32) - 1024)
  if kind == "ct12":  # 12-bit unsigned (JPEG extended), padding 0, HU = stored - 1024
    out = np.where(hu == -3000, 0, np.clip(hu + 1024, 1, 4095))
    return out.astype(np.uint16), dict(BitsAllocated=16, BitsStored=12, HighBit=11, PixelRepresentation=0,
                                       PixelPaddingValue=0, RescaleIntercept=-1024)
  # ct8: 8-bit (JPEG baseline), 16 HU per step, padding 0, HU = 16 * stored - 1040
  out = np.where(hu == -3000, 0, np.clip((hu + 1040) // 16, 1, 255))
  return out.astype(np.uint8), dict(BitsAllocated=8, BitsStored=8, HighBit=7, PixelRepresentation=0,
                                     PixelPaddingValue=0, RescaleIntercept=-1040, RescaleSlope=16)


def _dataset(series: str, i: int, stored: np.ndarray, tags: dict) -> pydicom.Dataset:
  ds = pydicom.dcmread(get_testdata_file("693_UNCR.dcm"))
  ds.PatientID = "syntax-patient"
  ds.StudyInstanceUID = STUDY
  ds.SeriesInstanceUID = series
  ds.FrameOfReferenceUID = f"{STUDY}.9"
  ds.SOPInstanceUID = f"{series}.{i + 1}"
  ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
  ds.InstanceNumber = i + 1
  ds.ImagePositionPatient = [-100.0, -120.0, 2.5 * i]
  ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
  ds.PixelSpacing = [0.7, 0.7]
  ds.Rows, ds.Columns = stored.shape
  ds.RescaleSlope = 1
  for keyword, value in tags.items():
    if keyword == "PixelPaddingValue":
      ds.add_new(0x00280120, "SS" if tags["PixelRepresentation"] else "US", value)
    else:
      setattr(ds, keyword, value)
  for keyword in ("SmallestImagePixelValue", "LargestImagePixelValue", "WindowCenter", "WindowWidth"):
    if keyword in ds:
      del ds[keyword]
  ds.PixelData = stored.tobytes()
  ds["PixelData"].VR = "OB" if stored.dtype.itemsize == 1 else "OW"
  ds.file_meta.TransferSyntaxUID = pydicom.uid.ExplicitVRLittleEndian
  return ds


def _gdcm(src: str, dst: str, uid: str) -> None:
  """Re-encodes `src` with GDCM (pydicom has no encoder for JPEG baseline/extended/lossless)."""
  reader = gdcm.ImageReader()
  reader.SetFileName(src)
  assert reader.Read(), src
  change = gdcm.ImageChangeTransferSyntax()
  change.SetTransferSyntax(gdcm.TransferSyntax(gdcm.TransferSyntax.GetTSType(uid)))
  if uid in ("1.2.840.10008.1.2.4.50", "1.2.840.10008.1.2.4.51"):
    codec = gdcm.JPEGCodec()
    codec.SetLossless(False)
    codec.SetQuality(90)
    change.SetUserCodec(codec)
  change.SetInput(reader.GetImage())
  assert change.Change(), uid
  writer = gdcm.ImageWriter()
  writer.SetFile(reader.GetFile())
  writer.SetImage(change.GetOutput())
  writer.SetFileName(dst)
  assert writer.Write(), dst


def _encode(ds: pydicom.Dataset, syntax: Syntax, path: str) -> None:
  uid = UID(syntax.uid)
  if syntax.build == "gdcm":
    plain = path + ".plain"
    ds.save_as(plain, enforce_file_format=True)
    _gdcm(plain, path, syntax.uid)
    os.remove(plain)
  elif syntax.build == "relabel_j2k":
    ds.compress(pydicom.uid.JPEG2000Lossless, encoding_plugin="pylibjpeg")
    ds.file_meta.TransferSyntaxUID = uid
    ds.save_as(path, enforce_file_format=True)
  elif uid in (pydicom.uid.ImplicitVRLittleEndian, pydicom.uid.ExplicitVRLittleEndian,
               pydicom.uid.DeflatedExplicitVRLittleEndian):
    ds.file_meta.TransferSyntaxUID = uid  # pydicom deflates the data set when writing
    ds.save_as(path, enforce_file_format=True)
  elif uid == pydicom.uid.JPEGLSNearLossless:
    ds.compress(uid, jls_error=3)
    ds.save_as(path, enforce_file_format=True)
  elif uid == pydicom.uid.JPEG2000:
    ds.compress(uid, j2k_cr=[20])
    ds.save_as(path, enforce_file_format=True)
  else:
    ds.compress(uid)
    ds.save_as(path, enforce_file_format=True)
  written = pydicom.dcmread(path, stop_before_pixels=True)
  assert written.file_meta.TransferSyntaxUID == uid


def _series_uid(key: str) -> str:
  return f"{STUDY}.{sorted(SYNTAXES).index(key) + 10}"


def build_series(root: str, key: str) -> list[str]:
  """The three real slices, re-encoded in syntax `key`, as root/<key>/s<i>.dcm."""
  syntax = SYNTAXES[key]
  folder = os.path.join(root, key)
  os.makedirs(folder, exist_ok=True)
  paths = []
  with _silently():
    for i, raw in enumerate(_real_slices()):
      stored, tags = _pixels(syntax.pixels, raw)
      path = os.path.join(folder, f"s{i}.dcm")
      _encode(_dataset(_series_uid(key), i, stored, tags), syntax, path)
      paths.append(path)
  return paths


def expected_volume(paths: list[str]) -> np.ndarray:
  """pydicom's own decode of each file, in HU: stored x slope + intercept, padding -> CT_PADDING_HU."""
  out = []
  with _silently():
    for path in sorted(paths, key=lambda p: float(pydicom.dcmread(p).ImagePositionPatient[2])):
      ds = pydicom.dcmread(path)
      stored = ds.pixel_array.astype(np.int64)
      hu = stored * int(ds.RescaleSlope) + int(ds.RescaleIntercept)
      hu[stored == int(ds.PixelPaddingValue)] = CT_PADDING_HU
      out.append(hu)
  return np.stack(out)


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """Every syntax's series in one input tree, converted in one run."""
  root = str(tmp_path_factory.mktemp("syntaxes") / "in")
  built = {key: build_series(root, key) for key in SYNTAXES}
  out = str(tmp_path_factory.mktemp("syntaxes_out") / "out")
  ct_volumes.run([f"--input={root}", f"--output={out}", f"--id_salt={SALT}", "--splits=train=1.0"])
  m = Manifest.loads(files.read_bytes(files.join(out, "manifest.json")))
  volumes = {}
  for split in m.splits.values():
    for shard in split.shards:
      for r in arrayrecord.read_file(files.join(out, shard.path)):
        record = m.features.decode(r)
        volumes[record["series_id"]] = record["volume"]
  rejects = collections.defaultdict(list)
  for line in files.read_bytes(files.join(out, m.rejected.path)).splitlines():
    e = json.loads(line)
    rejects[e["input"]].append(e["reason"])
  return built, volumes, rejects


@pytest.mark.slow
@pytest.mark.parametrize("key", SUPPORTED)
def test_a_supported_syntax_converts_to_pydicoms_decode_exactly(converted, key):
  built, volumes, rejects = converted
  paths = built[key]
  assert not [rejects[p] for p in paths if p in rejects], key
  volume = volumes.get(salted_hash(SALT, "series", STUDY, _series_uid(key)))
  assert volume is not None, key
  expected = expected_volume(paths)
  assert volume.shape == expected.shape == (3, 128, 128)
  diff = np.abs(volume.astype(np.int64) - expected)
  assert diff.max() == 0, (key, int(diff.max()), int((diff > 0).sum()))
  if key not in LOSSY:  # lossy coding moves the padding value itself
    assert (expected == CT_PADDING_HU).sum() > 10000  # the padding rule was exercised


@pytest.mark.slow
@pytest.mark.parametrize("key", UNSUPPORTED)
def test_an_unsupported_syntax_is_a_reject_naming_it(converted, key):
  built, volumes, rejects = converted
  assert salted_hash(SALT, "series", STUDY, _series_uid(key)) not in volumes
  name = UID(SYNTAXES[key].uid).name
  for path in built[key]:
    (reason,) = rejects.get(path, [""])
    assert reason.startswith(f"unsupported transfer syntax: {name}"), (key, reason)
  if key == "jpeg_extended_12bit":
    assert reason.endswith("with BitsStored (0028,0101) over 8 (no 12-bit JPEG decoder installed)")


# --------------------------------------------------------------------------- pure functions


def _read(paths: list[str], **replace) -> np.ndarray:
  slices = []
  for p in paths:
    with open(p, "rb") as f:
      slices += read_slices(f, p, SALT)
  slices = [dataclasses.replace(s, **replace) for s in slices]
  (plan,), rejected = plan_volumes(slices)
  assert not rejected
  volume, _ = read_volume(plan, lambda p: open(p, "rb"), "int16")
  return volume


def test_big_endian_is_exact_through_the_native_path_and_through_pydicom(tmp_path):
  paths = build_series(str(tmp_path), "explicit_be")
  expected = expected_volume(paths)
  with open(paths[0], "rb") as f:
    (header,) = read_slices(f, paths[0], SALT)
  assert header.pixel_offset is not None  # read straight from the file, then byte-swapped
  np.testing.assert_array_equal(_read(paths), expected)
  np.testing.assert_array_equal(_read(paths, pixel_offset=None), expected)


def test_deflated_is_decoded_and_its_length_checked(tmp_path):
  paths = build_series(str(tmp_path), "deflated_le")
  with open(paths[0], "rb") as f:
    (header,) = read_slices(f, paths[0], SALT)
  assert header.pixel_offset is None and header.pixel_bytes == 128 * 128 * 2
  np.testing.assert_array_equal(_read(paths), expected_volume(paths))


def test_a_deflate_bomb_is_rejected_without_inflating_it(tmp_path):
  """A deflated file (about 80 KB) inflating to 80 MiB, over the file cap (1 MiB) plus the
  header allowance (MAX_HEADER_BYTES, 64 MiB): rejected from a bounded inflate, never inflated whole."""
  (path,) = build_series(str(tmp_path), "deflated_le")[:1]
  with open(path, "rb") as f:
    pydicom.filereader.read_preamble(f, False)
    ct_headers.read_file_meta(f)
    meta_end = f.tell()
    data = f.seek(0) or f.read()
  body = zlib.decompress(data[meta_end:], -zlib.MAX_WBITS)
  comp = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
  chunks = ((1 << 20) + ct_headers.MAX_HEADER_BYTES) // (1 << 24) + 1  # of 16 MiB: past the limit
  bomb = comp.compress(body) + b"".join(comp.compress(bytes(1 << 24)) for _ in range(chunks)) + comp.flush()
  bombed = tmp_path / "bomb.dcm"
  bombed.write_bytes(data[:meta_end] + bomb)
  with open(bombed, "rb") as f, pytest.raises(SliceRejected, match="^deflated data set over the size limit"):
    read_slices(f, str(bombed), SALT, max_file_bytes=1 << 20)


def test_a_syntax_without_an_installed_decoder_is_a_reject_naming_it(tmp_path, monkeypatch):
  """A worker without the codec plugin: a named reject from the header, not a decode error."""
  (path,) = build_series(str(tmp_path), "j2k_lossless")[:1]

  class _NoPlugin:
    is_available = False
    available_plugins = ()

  monkeypatch.setattr(ct_headers, "get_decoder", lambda uid: _NoPlugin())
  with open(path, "rb") as f, pytest.raises(SliceRejected) as e:
    read_slices(f, path, SALT)
  assert str(e.value) == "unsupported transfer syntax: JPEG 2000 Image Compression (Lossless Only) (no decoder installed)"


def test_big_endian_8bit_samples_in_an_ow_element_are_not_read_as_bytes(tmp_path):
  """Explicit VR Big Endian allows 8-bit Pixel Data as OW, whose bytes lie swapped in 16-bit
  words on disk (GDCM writes OB): reading the bytes straight gave neighbours swapped."""
  paths = []
  with _silently():
    for p in build_series(str(tmp_path), "explicit_be_8bit"):
      ds = pydicom.dcmread(p)
      raw = np.frombuffer(ds.PixelData, np.uint8)
      ds["PixelData"].VR = "OW"
      ds.PixelData = raw.reshape(-1, 2)[:, ::-1].tobytes()
      ow = p.replace(".dcm", "_ow.dcm")
      ds.save_as(ow)
      paths.append(ow)
  expected = expected_volume(paths)
  with open(paths[0], "rb") as f:
    (header,) = read_slices(f, paths[0], SALT)
  assert header.pixel_offset is None  # decoded by pydicom, which undoes the word swap
  np.testing.assert_array_equal(_read(paths), expected)
