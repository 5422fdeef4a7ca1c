"""DICOM headers → per-slice geometry and intensity facts, with nothing identifying.

`read_slices(fileobj, path, salt)` parses a file's header only (pixel data is not
read) and returns one `SliceHeader` per image frame (one for classic CT, one per
frame for Enhanced CT), or raises `SliceRejected` with the reason the file cannot be
part of a volume. Identifiers leave this module only as salted hashes, and only
a whitelist of geometry and intensity tags is kept: no names, dates, IDs,
institutions or private tags reach anything downstream.

No header value leaves either: a reason names the tag ("invalid RescaleSlope
(0028,1053)"), never what it holds, an exception from pydicom becomes its type
name, and `quiet_pydicom()` keeps pydicom's warnings and log records (which
quote values) from being shown. Work per file is bounded before anything is
allocated: Rows x Columns x NumberOfFrames x BitsAllocated / 8 may not exceed
`max_file_bytes`, and `pixel_bytes` records how much native pixel data the file
really holds, so that a reader can refuse a header that promises more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import dataclasses
import hashlib
import io
import logging
import re
import struct
import threading
from typing import Any, BinaryIO
import warnings
import zlib

import numpy as np
import pydicom
from pydicom.datadict import tag_for_keyword
from pydicom.errors import InvalidDicomError
from pydicom.filebase import DicomBytesIO
from pydicom.pixels import get_decoder
from pydicom.uid import UID, UID_dictionary

CT_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.2"
ENHANCED_CT_STORAGE = "1.2.840.10008.5.1.4.1.1.2.1"
LEGACY_ENHANCED_CT_STORAGE = "1.2.840.10008.5.1.4.1.1.2.2"
CT_SOP_CLASSES = {CT_IMAGE_STORAGE, ENHANCED_CT_STORAGE, LEGACY_ENHANCED_CT_STORAGE}
_KNOWN_NON_CT_IMAGES = {"1.2.840.10008.5.1.4.1.1.7": "secondary capture"}
_KNOWN_NON_IMAGES = {
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
# Largest decoded pixel data of one file, Rows x Columns x NumberOfFrames x BitsAllocated / 8:
# 1 GiB holds a 512 x 512 x 2000 16-bit Enhanced CT in one file (a classic slice is 512 KiB).
MAX_FILE_BYTES = 1 << 30
_NATIVE = {  # uncompressed transfer syntaxes: byte order, explicit VR
    "1.2.840.10008.1.2": ("<", False), "1.2.840.10008.1.2.1": ("<", True), "1.2.840.10008.1.2.2": (">", True)}
EXPLICIT_BIG_ENDIAN = "1.2.840.10008.1.2.2"
DEFLATED = "1.2.840.10008.1.2.1.99"  # the data set after the file meta is one deflate stream
JPEG_EXTENDED = "1.2.840.10008.1.2.4.51"
# Encapsulated syntaxes, decoded by pydicom's plugins: RLE, JPEG baseline/extended, JPEG
# lossless (process 14, SV1), JPEG-LS lossless and near-lossless, JPEG 2000 lossless and
# lossy. Each is proven exact by tests/pipelines/test_ct_syntaxes.py; any other syntax
# (HTJ2K, JPEG 2000 Part 2, retired JPEG processes, video, JPIP) is a reject naming it.
_ENCAPSULATED = frozenset({
    "1.2.840.10008.1.2.5", "1.2.840.10008.1.2.4.50", JPEG_EXTENDED, "1.2.840.10008.1.2.4.57",
    "1.2.840.10008.1.2.4.70", "1.2.840.10008.1.2.4.80", "1.2.840.10008.1.2.4.81", "1.2.840.10008.1.2.4.90",
    "1.2.840.10008.1.2.4.91"})
SUPPORTED_TRANSFER_SYNTAXES = frozenset(_NATIVE) | {DEFLATED} | _ENCAPSULATED
# A deflated data set may inflate to at most the file's pixel data cap plus this much header.
MAX_HEADER_BYTES = 64 << 20
_GRAYSCALE = ("MONOCHROME1", "MONOCHROME2")


class SliceRejected(Exception):
  """The file (or frame) cannot be part of a volume; str(e) is the reason (never a header value)."""


def tag_name(keyword: str) -> str:
  """'RescaleSlope' -> 'RescaleSlope (0028,1053)': how a reason names a tag.

  Args:
    keyword: a DICOM keyword.

  Returns:
    The keyword with its (group,element) tag; the keyword alone when pydicom does not know it.
  """
  tag = tag_for_keyword(keyword)
  return f"{keyword} ({tag >> 16:04X},{tag & 0xFFFF:04X})" if tag is not None else keyword


SIZE_TAGS = " x ".join(tag_name(k) for k in ("Rows", "Columns", "NumberOfFrames", "BitsAllocated")) + " / 8"


# --------------------------------------------------------------------------- silence

class _Quiet(threading.local):
  depth = 0


_QUIET = _Quiet()
_QUIET_LOGGERS = ("pydicom", "pylibjpeg", "openjpeg", "libjpeg", "jpeg_ls", "rle", "gdcm")


class _OnQuietThread:
  """A warnings-filter pattern that matches on a thread inside `quiet_pydicom()`."""

  def match(self, _text: str) -> bool:
    return _QUIET.depth > 0


class _DropOnQuietThread(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return _QUIET.depth == 0


_IGNORE_ON_QUIET_THREAD = ("ignore", None, Warning, _OnQuietThread(), 0)
_DROP_ON_QUIET_THREAD = _DropOnQuietThread()
_loggers_seen = -1


def _install_filters() -> None:
  """Puts the thread-gated filters in place; cheap when they already are.

  The warnings filter goes first in `warnings.filters` (again after anyone
  replaced the list, e.g. `catch_warnings`); the logging filter sits on every
  logger of pydicom and its decoders, including ones created since the last call.
  """
  global _loggers_seen
  filters = warnings.filters
  if not filters or filters[0] is not _IGNORE_ON_QUIET_THREAD:
    with contextlib.suppress(ValueError):
      filters.remove(_IGNORE_ON_QUIET_THREAD)
    filters.insert(0, _IGNORE_ON_QUIET_THREAD)
  loggers = logging.root.manager.loggerDict
  if len(loggers) != _loggers_seen:
    _loggers_seen = len(loggers)
    for name, logger in list(loggers.items()):
      if isinstance(logger, logging.Logger) and name.split(".")[0] in _QUIET_LOGGERS:
        logger.addFilter(_DROP_ON_QUIET_THREAD)
    logging.getLogger("pydicom").addFilter(_DROP_ON_QUIET_THREAD)


@contextlib.contextmanager
def quiet_pydicom() -> Iterator[None]:
  """Within the block, on this thread only, warnings and pydicom's log records are dropped.

  pydicom quotes header values in both ("Invalid value for VR IS: '<value>'",
  "Unknown encoding '<value>'"). Other threads are unaffected, so this is safe
  in a multi-threaded worker, unlike `warnings.catch_warnings()` (one that ends
  on another thread while a block runs can restore a filter list without ours,
  until the next block puts it back).
  """
  _install_filters()
  _QUIET.depth += 1
  try:
    yield
  finally:
    _QUIET.depth -= 1


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
  # Byte offset of native (uncompressed) single-frame pixel data in the file, so the
  # pixels can be read directly; None: decode with pydicom.
  pixel_offset: int | None = None
  byte_order: str = "<"  # of the native pixel data: ">" for Explicit VR Big Endian
  file_frames: int = 1  # NumberOfFrames of the file this frame is in
  # Bytes of native pixel data the file really holds (a truncated file, or a header
  # promising more than is there, holds fewer than it needs); None: encapsulated.
  pixel_bytes: int | None = None
  # Salted hashes of the identifiers label objects reference (pipelines.ct_volumes.labels):
  # SOPInstanceUID (the file's, for every frame of an Enhanced CT), SeriesInstanceUID and
  # FrameOfReferenceUID ("" hashed when absent).
  sop_key: str = ""
  series_uid_key: str = ""
  frame_of_reference_key: str = ""

  @property
  def file_pixel_bytes(self) -> int:
    """Decoded size of the whole file's pixel data, from the header."""
    return self.rows * self.columns * self.file_frames * self.bits_allocated // 8


def salted_hash(salt: str, *parts: str) -> str:
  """A keyed BLAKE2b hash of `parts`: how identifiers leave this module (never in clear).

  Args:
    salt: the secret key (--id_salt); only its first 64 UTF-8 bytes are used.
    *parts: the strings to hash, joined with a unit separator.

  Returns:
    32 hex digits; the same salt and parts always give the same hash.
  """
  h = hashlib.blake2b(digest_size=16, key=salt.encode("utf-8")[:64])
  h.update("\x1f".join(parts).encode("utf-8"))
  return h.hexdigest()


def _invalid(keyword: str, why: str = "") -> SliceRejected:
  return SliceRejected(f"invalid {tag_name(keyword)}" + (f": {why}" if why else ""))


def tag_value(ds, keyword: str, invalid: Callable[[str], Exception]):
  """A tag's value, or None when absent or empty. pydicom converts values on access and may raise with
  the value in the message: only `invalid(keyword)`, which names the tag, gets out.

  Args:
    ds: a pydicom Dataset.
    keyword: the tag's keyword.
    invalid: makes the exception raised for a value that does not convert.

  Returns:
    The value, or None.
  """
  try:
    value = ds.get(keyword)
    return None if value is None or value == "" else value
  except Exception:  # noqa: BLE001 (any conversion error; its message may hold the value)
    pass
  raise invalid(keyword)


def int_tag(value, keyword: str, invalid: Callable[[str], Exception], default: int | None = None,
            low: int | None = None, high: int | None = None) -> int | None:
  """An integer tag's value (IS, US, UL, ...) checked to be a whole number within [low, high].

  Args:
    value: the tag's value (`tag_value`), None when absent.
    keyword: the tag, for `invalid`.
    invalid: makes the exception raised for a value that is not such a number.
    default: what an absent tag gives.
    low, high: the bounds (None: unbounded).

  Returns:
    The integer, or `default`.
  """
  if value is None:
    return default
  try:
    out = int(value)
    ok = not (isinstance(value, float) and out != value) and (low is None or out >= low) and (
        high is None or out <= high)
  except (TypeError, ValueError, OverflowError):
    ok = False
  if not ok:
    raise invalid(keyword)
  return out


def _element(ds, keyword: str):
  return tag_value(ds, keyword, _invalid)


def _require(ds, keyword: str):
  value = _element(ds, keyword)
  if value is None:
    raise SliceRejected(f"missing mandatory tag {keyword}")
  return value


def _int(ds, keyword: str, default: int | None = None, *, required: bool = False, low: int | None = None,
         high: int | None = None) -> int | None:
  """An integer tag (IS, US, UL, ...) within [low, high], or `default` when absent."""
  value = _require(ds, keyword) if required else _element(ds, keyword)
  return int_tag(value, keyword, _invalid, default, low, high)


def _float(ds, keyword: str, *, required: bool = False) -> float | None:
  """A finite number (DS, FD, ...), or None when absent."""
  value = _require(ds, keyword) if required else _element(ds, keyword)
  if value is None:
    return None
  try:
    out = float(value)
  except (TypeError, ValueError, OverflowError):
    out = float("nan")
  if not np.isfinite(out):
    raise _invalid(keyword)
  return out


def floats_tag(value, n: int, keyword: str, invalid: Callable[..., Exception] | None = None) -> tuple[float, ...]:
  """A multi-valued DS tag as `n` finite floats; else `invalid(keyword[, why])` (this module's
  SliceRejected by default; labels pass their own)."""
  invalid = invalid or _invalid
  try:
    out = tuple(float(v) for v in value)
  except (TypeError, ValueError, OverflowError):
    raise invalid(keyword) from None
  if len(out) != n or not all(np.isfinite(out)):
    raise invalid(keyword, f"expected {n} finite numbers")
  return out


def _spacing(pixel_spacing: tuple[float, ...]) -> tuple[float, ...]:
  """PixelSpacing, which must be positive (a zero or negative one would give a volume no geometry)."""
  if min(pixel_spacing) <= 0:
    raise _invalid("PixelSpacing", "expected positive numbers")
  return pixel_spacing


def _slope(slope: float) -> float:
  """RescaleSlope, which must not be 0 (every voxel would be the intercept)."""
  if slope == 0:
    raise _invalid("RescaleSlope", "0 maps every stored value to one HU")
  return slope


def _uid(ds, keyword: str) -> UID | None:
  value = _element(ds, keyword)
  if value is None:
    return None
  uid = UID(str(value)) if isinstance(value, str) else UID("-")
  if not uid.is_valid:
    raise _invalid(keyword)
  return uid


def _sop_class(ds) -> UID:
  """The SOP class of a CT image, or SliceRejected naming what the object is (a registered
  UID's name; never the Modality or an unregistered UID, which are free text)."""
  sop_class = _uid(ds, "SOPClassUID")
  if sop_class is None:
    raise SliceRejected(f"missing mandatory tag {tag_name('SOPClassUID')}")
  if sop_class in _KNOWN_NON_IMAGES:
    raise SliceRejected(f"non-image object ({_KNOWN_NON_IMAGES[sop_class]})")
  if sop_class in _KNOWN_NON_CT_IMAGES:
    raise SliceRejected(f"not a CT image ({_KNOWN_NON_CT_IMAGES[sop_class]})")
  if sop_class not in CT_SOP_CLASSES:
    name = UID_dictionary[sop_class][0] if sop_class in UID_dictionary else "unknown"
    raise SliceRejected(f"not a CT image (SOP class {name})")
  return sop_class


def _syntax_name(syntax: str) -> str:
  """The registered name of a transfer syntax (a UID outside the dictionary is a header value)."""
  return UID_dictionary[syntax][0] if syntax in UID_dictionary else "unregistered"


def _transfer_syntax(ds) -> str:
  """The file's transfer syntax if the toolkit decodes it exactly ("" when the file does
  not say), else SliceRejected naming it: "unsupported transfer syntax: JPEG 2000 Part 2 ..."."""
  meta = getattr(ds, "file_meta", None)
  if meta is None:
    return ""
  syntax = _uid(meta, "TransferSyntaxUID")
  if syntax is None:
    return ""
  if not syntax.is_transfer_syntax:
    raise SliceRejected(f"unsupported {tag_name('TransferSyntaxUID')}")
  if syntax not in SUPPORTED_TRANSFER_SYNTAXES:
    raise SliceRejected(f"unsupported transfer syntax: {_syntax_name(syntax)}")
  if syntax in _ENCAPSULATED and not get_decoder(syntax).is_available:
    raise SliceRejected(f"unsupported transfer syntax: {_syntax_name(syntax)} (no decoder installed)")
  return str(syntax)


def _check_syntax_depth(transfer_syntax: str, bits_allocated: int, bits_stored: int) -> None:
  """Rejects, naming the syntax, the sample depths a syntax's installed decoders cannot do."""
  name = _syntax_name(transfer_syntax)
  if transfer_syntax == JPEG_EXTENDED and bits_stored > 8 and "pylibjpeg" not in get_decoder(
      transfer_syntax).available_plugins:  # pydicom's gdcm and pillow plugins refuse 12-bit JPEG
    raise SliceRejected(f"unsupported transfer syntax: {name} with {tag_name('BitsStored')} over 8 "
                   "(no 12-bit JPEG decoder installed)")
  if transfer_syntax == EXPLICIT_BIG_ENDIAN and bits_allocated > 16:
    # OW words are swapped 16 bits at a time: 32-bit samples have no one byte order
    raise SliceRejected(f"unsupported transfer syntax: {name} with {tag_name('BitsAllocated')} over 16")


def _at_pixel_data(tag, _vr, _length) -> bool:
  return tag in (0x7FE00010, 0x7FE00008, 0x7FE00009)


def _past_file_meta(tag, _vr, _length) -> bool:
  return tag >> 16 != 0x0002


def read_file_meta(fileobj: BinaryIO) -> pydicom.dataset.FileMetaDataset:
  """The File Meta Information group (0002,xxxx) at the stream's position (after the preamble).

  PS3.10 7.1 encodes it in Explicit VR Little Endian whatever the data set's
  syntax (pydicom's `read_dataset` also reads a non-conformant implicit VR
  one). The stream is left at the first element after the group.
  """
  return pydicom.dataset.FileMetaDataset(pydicom.filereader.read_dataset(
      fileobj, is_implicit_VR=False, is_little_endian=True, stop_when=_past_file_meta))


def _inflate(data: bytes, limit: int) -> bytes:
  inflater = zlib.decompressobj(-zlib.MAX_WBITS)
  try:
    out = inflater.decompress(data, limit + 1)
  except zlib.error:
    raise SliceRejected("unreadable deflated data set (not a deflate stream)") from None
  if len(out) > limit:
    raise SliceRejected(f"deflated data set over the size limit: it inflates to more than {limit} bytes")
  return out


def read_dataset(fileobj: BinaryIO, max_inflated: int, *, stop_before_pixels: bool = False
                 ) -> tuple[pydicom.Dataset, BinaryIO]:
  """pydicom.dcmread, and the stream the data set was read from (after stop_before_pixels
  it sits at the pixel data tag). A deflated data set is inflated here, into memory, and
  at most `max_inflated` bytes of it (pydicom would inflate a deflate bomb whole); the
  stream is then the inflated data set, whose offsets are not the file's.

  Args:
    fileobj: the open DICOM file, positioned at its start.
    max_inflated: the most bytes a deflated data set may inflate to.
    stop_before_pixels: stop reading at the pixel data tag.

  Returns:
    (data set, the stream it was read from).

  Raises:
    SliceRejected: a deflated data set is not a deflate stream or inflates past `max_inflated`.
    Exception: whatever pydicom raises for a file it cannot parse (its message may quote values).
  """
  start = fileobj.tell()
  preamble = pydicom.filereader.read_preamble(fileobj, False)
  meta = read_file_meta(fileobj)
  if meta.get("TransferSyntaxUID") != DEFLATED:
    fileobj.seek(start)
    return pydicom.dcmread(fileobj, stop_before_pixels=stop_before_pixels), fileobj
  stream = DicomBytesIO(_inflate(fileobj.read(), max_inflated))
  dataset = pydicom.filereader.read_dataset(stream, is_implicit_VR=False, is_little_endian=True,
                                            stop_when=_at_pixel_data if stop_before_pixels else None)
  ds = pydicom.dataset.FileDataset(getattr(fileobj, "name", ""), dataset, preamble, meta,
                                   is_implicit_VR=False, is_little_endian=True)
  return ds, stream


def _file_size(fileobj: BinaryIO) -> int | None:
  try:
    here = fileobj.tell()
    fileobj.seek(0, io.SEEK_END)
    end = fileobj.tell()
    fileobj.seek(here)
    return end
  except (OSError, ValueError, AttributeError):
    return None


def _pixel_data(fileobj: BinaryIO, transfer_syntax: str, expected_bytes: int, bits_allocated: int = 16
                ) -> tuple[bool, int | None, int | None]:
  """(has pixel data, offset of native pixel bytes in the file or None, bytes of native
  pixel data present or None), reading just past the element header.

  After read_dataset(stop_before_pixels=True) the stream sits at the pixel data tag, if
  any; for a deflated file that stream is the inflated data set (no offset in the file).
  """
  try:
    start = fileobj.tell()
    tag = fileobj.read(4)
    if tag not in _PIXEL_DATA_TAGS:
      return False, None, None
    encoding = _NATIVE["1.2.840.10008.1.2.1"] if transfer_syntax == DEFLATED else _NATIVE.get(transfer_syntax)
    if encoding is None or tag not in _PIXEL_DATA_TAGS[:2]:
      return True, None, None
    order, explicit = encoding
    vr = b""
    if explicit:
      vr_and_length = fileobj.read(8)  # VR, 2 reserved bytes, 4-byte length
      vr = vr_and_length[:2]
      length, header = struct.unpack_from(order + "I", vr_and_length, 4)[0], 12
    else:
      length, header = struct.unpack(order + "I", fileobj.read(4))[0], 8
  except (OSError, ValueError, struct.error):
    return True, None, None
  present = 0 if length == 0xFFFFFFFF else length  # native pixel data has a defined length
  size = _file_size(fileobj)
  if size is not None:
    present = min(present, max(size - start - header, 0))
  # undefined length, odd padding, multi-frame, deflated: let pydicom decode. So too 8-bit
  # samples in a big-endian OW element: their bytes are swapped in 16-bit words on disk.
  swapped_bytes = order == ">" and vr == b"OW" and bits_allocated == 8
  offset = (start + header if length == expected_bytes and transfer_syntax != DEFLATED and not swapped_bytes
            else None)
  return True, offset, present


def _is_localizer(image_type) -> bool:
  values = [str(v).upper() for v in (image_type or [])]
  return any("LOCALIZER" in v or "PROJECTION IMAGE" in v for v in values)


def _padding(ds, pixel_representation: int, bits_allocated: int) -> tuple[int, int] | None:
  value = _int(ds, "PixelPaddingValue")
  if value is None:
    return None
  limit = _int(ds, "PixelPaddingRangeLimit", value)

  def signed(v: int) -> int:  # 'US or SS' may have been read as US
    if pixel_representation == 1 and v >= 1 << (bits_allocated - 1):
      v -= 1 << bits_allocated
    return v

  a, b = signed(value), signed(limit)
  return (min(a, b), max(a, b))


def read_slices(fileobj: BinaryIO, path: str, salt: str, max_file_bytes: int = MAX_FILE_BYTES
                ) -> list[SliceHeader]:
  """Header facts of one DICOM file (pixel data not read); nothing pydicom says about the file is shown.

  Args:
    fileobj: the open file, positioned at its start.
    path: the file's path, recorded in each slice.
    salt: the secret key of the identifier hashes (`salted_hash`).
    max_file_bytes: bounds the decoded pixel data of the file (see MAX_FILE_BYTES).

  Returns:
    One `SliceHeader` per slice: one for a classic file, one per frame of an Enhanced CT file.

  Raises:
    SliceRejected: the file cannot be part of a volume; the reason never holds a header value.
  """
  with quiet_pydicom():
    return named_errors(SliceRejected, "invalid DICOM header", _read_slices, fileobj, path, salt, max_file_bytes)


def named_errors(error: type[Exception], what: str, fn: Callable, *args):
  """fn(*args), with any exception but `error` raised as `error(f"{what}: <its type name>")`: pydicom's
  (and its plugins') messages may quote header values, so only the type leaves, without a context.

  Args:
    error: the exception type that carries a reason (raised as is).
    what: the reason's start.
    fn: the function called.
    *args: its arguments.

  Returns:
    What `fn` returns.
  """
  try:
    return fn(*args)
  except error:
    raise
  except Exception as e:  # noqa: BLE001 (a damaged sequence, an odd value: its message may quote it)
    reason = f"{what}: {type(e).__name__}"
  raise error(reason)


@dataclasses.dataclass(frozen=True)
class _FileFacts:
  """What every frame of one file shares, and how frames of it are keyed into series."""

  ds: Any
  path: str
  salt: str
  study: str
  series: str
  frame_of_ref: str
  number_of_frames: int
  pixel_offset: int
  common: dict  # SliceHeader fields every frame of the file has

  def series_key(self, orientation, pixel_spacing) -> str:
    """Frames of one series share study, series, frame of reference, orientation, size and spacing."""
    c = self.common
    return salted_hash(
        self.salt, "group", self.study, self.series, self.frame_of_ref,
        ",".join(f"{v:.{ORIENTATION_DECIMALS}f}" for v in orientation),
        f"{c['rows']}x{c['columns']}", ",".join(f"{v:.{SPACING_DECIMALS}f}" for v in pixel_spacing))


def _read_slices(fileobj: BinaryIO, path: str, salt: str, max_file_bytes: int) -> list[SliceHeader]:
  facts = _file_facts(fileobj, path, salt, max_file_bytes)
  if "PerFrameFunctionalGroupsSequence" in facts.ds:
    return _enhanced_slices(facts)
  return [_classic_slice(facts)]


def _file_facts(fileobj: BinaryIO, path: str, salt: str, max_file_bytes: int) -> _FileFacts:
  """The header checks every CT file passes (classic or Enhanced), and what its frames share."""
  try:
    ds, stream = read_dataset(fileobj, max_file_bytes + MAX_HEADER_BYTES, stop_before_pixels=True)
  except InvalidDicomError:
    raise SliceRejected("not DICOM (no DICM preamble)") from None
  except SliceRejected:
    raise
  except Exception as e:  # pydicom raises many types on a damaged header
    raise SliceRejected(f"unreadable or truncated DICOM header: {type(e).__name__}") from None
  _sop_class(ds)
  transfer_syntax = _transfer_syntax(ds)
  rows = _int(ds, "Rows", required=True, low=1)
  columns = _int(ds, "Columns", required=True, low=1)
  bits_allocated = _int(ds, "BitsAllocated", required=True)
  if bits_allocated not in (8, 16, 32):
    raise SliceRejected(f"unsupported {tag_name('BitsAllocated')}: 8, 16 or 32 expected")
  number_of_frames = _int(ds, "NumberOfFrames", 1, low=0) or 1
  file_bytes = rows * columns * number_of_frames * bits_allocated // 8
  if file_bytes > max_file_bytes:
    raise SliceRejected(f"pixel data over the size limit: {SIZE_TAGS} exceeds {max_file_bytes} bytes per file")
  has_pixels, pixel_offset, pixel_bytes = _pixel_data(stream, transfer_syntax, rows * columns * bits_allocated // 8,
                                                      bits_allocated)
  if not has_pixels:
    raise SliceRejected("no pixel data")
  if _is_localizer(_element(ds, "ImageType")):
    raise SliceRejected("localizer (scout) image")
  if _int(ds, "SamplesPerPixel", 1) != 1:
    raise SliceRejected("not a grayscale image (SamplesPerPixel != 1)")
  if str(_require(ds, "PhotometricInterpretation")).strip() not in _GRAYSCALE:
    raise SliceRejected(f"not a grayscale image ({tag_name('PhotometricInterpretation')})")
  study = str(_require(ds, "StudyInstanceUID"))
  series = str(_require(ds, "SeriesInstanceUID"))
  frame_of_ref = str(_element(ds, "FrameOfReferenceUID") or "")
  bits_stored = _int(ds, "BitsStored", bits_allocated, low=1, high=bits_allocated)
  _check_syntax_depth(transfer_syntax, bits_allocated, bits_stored)
  pixel_representation = _int(ds, "PixelRepresentation", required=True, low=0, high=1)
  common = dict(rows=rows, columns=columns, bits_stored=bits_stored, bits_allocated=bits_allocated,
                pixel_representation=pixel_representation,
                padding=_padding(ds, pixel_representation, bits_allocated),
                patient_id=salted_hash(salt, "patient", str(_element(ds, "PatientID") or "")),
                series_id=salted_hash(salt, "series", study, series), file_frames=number_of_frames,
                pixel_bytes=pixel_bytes, byte_order=">" if transfer_syntax == EXPLICIT_BIG_ENDIAN else "<",
                sop_key=salted_hash(salt, "sop", str(_element(ds, "SOPInstanceUID") or "")),
                series_uid_key=salted_hash(salt, "series-uid", series),
                frame_of_reference_key=salted_hash(salt, "frame-of-reference", frame_of_ref))
  return _FileFacts(ds, path, salt, study, series, frame_of_ref, number_of_frames, pixel_offset, common)


def _classic_slice(f: _FileFacts) -> SliceHeader:
  """CT Image Storage: one frame, geometry and rescale in the data set itself."""
  ds = f.ds
  if f.number_of_frames != 1:
    raise SliceRejected(f"multi-frame image without functional groups ({tag_name('NumberOfFrames')} > 1)")
  orientation = floats_tag(_require(ds, "ImageOrientationPatient"), 6, "ImageOrientationPatient")
  pixel_spacing = _spacing(floats_tag(_require(ds, "PixelSpacing"), 2, "PixelSpacing"))
  position = _element(ds, "ImagePositionPatient")
  position = floats_tag(position, 3, "ImagePositionPatient") if position else None
  slope = _slope(_float(ds, "RescaleSlope", required=True))
  intercept = _float(ds, "RescaleIntercept", required=True)
  acq = _int(ds, "AcquisitionNumber")
  temporal = _int(ds, "TemporalPositionIndex")
  acquisition = f"temporal={temporal}" if temporal is not None else (
      f"acq={acq}" if acq is not None else "")
  return SliceHeader(
      path=f.path, frame=None, series_key=f.series_key(orientation, pixel_spacing), acquisition=acquisition,
      position=position, orientation=orientation, pixel_spacing=pixel_spacing, slope=slope,
      intercept=intercept, instance_number=_int(ds, "InstanceNumber"),
      spacing_between_slices=_float(ds, "SpacingBetweenSlices"), pixel_offset=f.pixel_offset,
      **f.common)


def _stack_label(salt: str, stack_id) -> str:
  """A StackID as the record key shows it: a number as it is ("1"), free text (a short string, which may hold
  anything) as a salted hash, never in clear."""
  text = str(stack_id).strip()
  return text if re.fullmatch(r"[0-9]{1,9}", text) else "h" + salted_hash(salt, "stack", text)[:12]


def _enhanced_slices(f: _FileFacts) -> list[SliceHeader]:
  """Enhanced / legacy-converted enhanced CT: geometry and rescale per frame, from the
  per-frame functional groups, else the shared ones."""
  ds = f.ds
  shared = _element(ds, "SharedFunctionalGroupsSequence")
  shared = shared[0] if shared else None
  per_frame = _element(ds, "PerFrameFunctionalGroupsSequence") or []
  if len(per_frame) != f.number_of_frames:
    raise _invalid("PerFrameFunctionalGroupsSequence", f"not one item per frame ({tag_name('NumberOfFrames')})")

  def group(item, name):
    for source in (item, shared):
      if source is not None and name in source and len(source[name].value):
        return source[name].value[0]
    return None

  out = []
  for i, item in enumerate(per_frame):
    frame_type = group(item, "CTImageFrameTypeSequence")
    if frame_type is not None and _is_localizer(_element(frame_type, "FrameType")):
      raise SliceRejected("localizer (scout) image")
    plane_pos = group(item, "PlanePositionSequence")
    plane_ori = group(item, "PlaneOrientationSequence")
    measures = group(item, "PixelMeasuresSequence")
    if plane_ori is None or measures is None:
      raise SliceRejected(f"missing mandatory tag PlaneOrientationSequence/PixelMeasuresSequence (frame {i})")
    orientation = floats_tag(_require(plane_ori, "ImageOrientationPatient"), 6, "ImageOrientationPatient")
    pixel_spacing = _spacing(floats_tag(_require(measures, "PixelSpacing"), 2, "PixelSpacing"))
    position = None
    if plane_pos is not None and _element(plane_pos, "ImagePositionPatient"):
      position = floats_tag(plane_pos.ImagePositionPatient, 3, "ImagePositionPatient")
    transform = group(item, "PixelValueTransformationSequence")
    source = ds if transform is None else transform
    slope = _slope(_float(source, "RescaleSlope", required=True))
    intercept = _float(source, "RescaleIntercept", required=True)
    content = group(item, "FrameContentSequence")
    temporal = _int(content, "TemporalPositionIndex") if content is not None else None
    stack = _element(content, "StackID") if content is not None else None
    acquisition = "/".join(x for x in (
        f"stack={_stack_label(f.salt, stack)}" if stack is not None else "",
        f"temporal={temporal}" if temporal is not None else "") if x)
    out.append(SliceHeader(
        path=f.path, frame=i, series_key=f.series_key(orientation, pixel_spacing), acquisition=acquisition,
        position=position, orientation=orientation, pixel_spacing=pixel_spacing, slope=slope,
        intercept=intercept, instance_number=i + 1, spacing_between_slices=None, **f.common))
  return out
