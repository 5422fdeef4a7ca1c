"""Image normalisation: pure functions, no Beam."""

import io

import numpy as np
import pytest
from PIL import Image

from pipelines.image_folder.imaging import BadImage, ImageOptions, convert, convert_image


def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
  buf = io.BytesIO()
  im.save(buf, format=fmt, **kw)
  return buf.getvalue()


def _decode(data: bytes) -> np.ndarray:
  return np.asarray(Image.open(io.BytesIO(data)))


def _gradient(w=40, h=30) -> Image.Image:
  y, x = np.mgrid[0:h, 0:w]
  return Image.fromarray(np.stack([x * 6, y * 8, (x + y) * 3], -1).astype(np.uint8), "RGB")


def test_plain_rgb_jpeg_is_kept_byte_for_byte():
  data = _encode(_gradient(), "JPEG", quality=90)
  assert convert(data, ImageOptions()) == data


@pytest.mark.parametrize("mode,fmt", [("L", "JPEG"), ("CMYK", "JPEG"), ("RGBA", "PNG"), ("P", "PNG"),
                                      ("LA", "PNG"), ("I;16", "PNG"), ("RGB", "WEBP"), ("RGB", "BMP")])
def test_every_mode_becomes_rgb(mode, fmt):
  im = _gradient().convert(mode) if mode != "I;16" else Image.fromarray(
      (np.arange(1200).reshape(30, 40) * 50).astype(np.uint16))
  out = _decode(convert(_encode(im, fmt), ImageOptions()))
  assert out.shape == (30, 40, 3)
  assert out.dtype == np.uint8


def test_exif_orientation_is_applied():
  exif = Image.Exif()
  exif[0x0112] = 6  # rotate 90° clockwise for display
  data = _encode(_gradient(40, 30), "JPEG", exif=exif)
  assert _decode(convert(data, ImageOptions())).shape == (40, 30, 3)


@pytest.mark.parametrize("orientation,turn", [(6, Image.Transpose.ROTATE_90), (8, Image.Transpose.ROTATE_270),
                                              (5, Image.Transpose.TRANSPOSE)])
def test_a_turned_jpeg_is_decoded_at_its_displayed_size(orientation, turn):
  """libjpeg's reduced decode was asked for the displayed size in the stored orientation: a tall stored image
  shown wide, cut to a tall target, was decoded at 1/4 and upscaled 2x (a blurred image, no error)."""
  rng = np.random.default_rng(0)
  shown = Image.fromarray(rng.integers(0, 256, (400, 1600, 3), np.uint8))  # 1600 wide, 400 tall as displayed
  exif = Image.Exif()
  exif[0x0112] = orientation
  stored = _encode(shown.transpose(turn), "JPEG", quality=95, exif=exif)
  options = ImageOptions(size=(200, 50), encoding="raw")
  reference = Image.open(io.BytesIO(stored))
  reference = reference.transpose({6: Image.Transpose.ROTATE_270, 8: Image.Transpose.ROTATE_90,
                                   5: Image.Transpose.TRANSPOSE}[orientation])  # displayed, decoded in full
  expected = np.frombuffer(convert(_encode(reference, "PNG"), options), np.uint8).astype(int)
  got = np.frombuffer(convert(stored, options), np.uint8).astype(int)
  assert np.abs(got - expected).mean() < 4  # decoded in full, as the reference: 0 (at 1/4, upscaled: about 12)


def test_resize_keeps_aspect_and_center_crops():
  im = Image.new("RGB", (300, 100), "red")
  im.paste(Image.new("RGB", (100, 100), "blue"), (100, 0))  # blue center third
  out = np.frombuffer(convert(_encode(im, "PNG"), ImageOptions(size=(50, 50), encoding="raw")), np.uint8)
  out = out.reshape(50, 50, 3)
  assert out[:, 5:45, 2].min() > 200
  assert out[:, 5:45, 0].max() < 60  # only the blue middle survives


def test_raw_encoding_has_fixed_shape():
  out = convert(_encode(_gradient(123, 77), "JPEG"), ImageOptions(size=(32, 48), encoding="raw"))
  assert len(out) == 32 * 48 * 3


def test_jpeg_resize_gives_fixed_size():
  out = convert(_encode(_gradient(400, 300), "JPEG"), ImageOptions(size=(64, 80)))
  assert _decode(out).shape == (64, 80, 3)


@pytest.mark.parametrize("data,reason", [
    (b"", "not an image"),
    (b"hello world", "not an image"),
    (None, "corrupt or truncated"),
])
def test_bad_inputs_raise_bad_image_with_reason(data, reason):
  if data is None:
    full = _encode(_gradient(200, 200), "JPEG")
    data = full[: len(full) // 2]
  with pytest.raises(BadImage, match=reason):
    convert(data, ImageOptions(size=(16, 16)))


def test_options_are_validated():
  with pytest.raises(ValueError, match="raw needs"):
    ImageOptions(encoding="raw")
  with pytest.raises(ValueError, match="encoding"):
    ImageOptions(encoding="png")
  with pytest.raises(ValueError, match="positive"):
    ImageOptions(size=(0, 4))


def _png_header_only(width: int, height: int) -> bytes:
  """A PNG signature and IHDR claiming width x height, then a truncated IDAT: Pillow
  reads the size from it without decoding anything."""
  import struct
  import zlib

  def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

  ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grayscale
  return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))


def test_image_over_the_pixel_cap_is_rejected_with_a_true_reason():
  data = _png_header_only(13000, 13000)
  with pytest.raises(BadImage, match=r"^image too large: 13000x13000 pixels > 100000000$"):
    convert(data, ImageOptions(max_pixels=100_000_000))
  with pytest.raises(BadImage, match=r"^image too large: 14000x13000 pixels > 178956970$"):
    convert(_png_header_only(14000, 13000), ImageOptions())  # the default cap


@pytest.mark.slow  # a benchmark-size input: a 90 M pixel image
def test_image_under_the_cap_but_over_pillows_limit_is_converted():
  """9500x9500 = 90 M pixels: above Pillow's own warning threshold (89 M, which once
  made such images "corrupt or truncated"), under the toolkit's cap. Grayscale keeps it light."""
  buf = io.BytesIO()
  Image.new("L", (9500, 9500), 128).save(buf, "PNG")
  out = convert(buf.getvalue(), ImageOptions(size=(4, 4), encoding="raw"))
  assert len(out) == 4 * 4 * 3
  assert set(out) == {128}


# --------------------------------------------------------------------------- multi-frame files, true reasons


def _pages(n: int, fmt: str, **kw) -> bytes:
  frames = [Image.fromarray(np.full((8, 10), 40 * i + 20, np.uint8)).convert("RGB") for i in range(n)]
  buf = io.BytesIO()
  frames[0].save(buf, format=fmt, save_all=True, append_images=frames[1:], **kw)
  return buf.getvalue()


def _patch_first_ifd(data: bytes, tag: int, value: int) -> bytes:
  """A little-endian TIFF with one SHORT tag of its first page set to `value`."""
  import struct

  b = bytearray(data)
  offset = struct.unpack_from("<I", b, 4)[0]
  for i in range(struct.unpack_from("<H", b, offset)[0]):
    entry = offset + 2 + 12 * i
    if struct.unpack_from("<H", b, entry)[0] == tag:
      struct.pack_into("<H", b, entry + 8, value)
      return bytes(b)
  raise AssertionError(f"no tag {tag}")


@pytest.mark.parametrize("fmt,kw", [("GIF", {"duration": 50, "loop": 0}), ("TIFF", {})])
def test_multi_frame_files_keep_the_first_frame_and_say_so(fmt, kw):
  data = _pages(3, fmt, **kw)
  result = convert_image(data, ImageOptions(size=(8, 10), encoding="raw"))
  assert result.num_frames == 3
  assert result.multi_frame
  assert set(result.data[:3]) == {20}  # the first frame's gray
  single = convert_image(_pages(1, fmt), ImageOptions(size=(8, 10), encoding="raw"))
  assert single.num_frames == 1
  assert not single.multi_frame


def test_a_damaged_later_page_is_a_reject_not_a_crash():
  """Counting the frames of a TIFF reads every page directory: a second page without a width raised TypeError
  ("Missing dimensions"), which stopped the whole job instead of rejecting the file."""
  import struct

  b = bytearray(_pages(2, "TIFF"))
  first = struct.unpack_from("<I", b, 4)[0]
  second = struct.unpack_from("<I", b, first + 2 + 12 * struct.unpack_from("<H", b, first)[0])[0]  # next IFD
  for i in range(struct.unpack_from("<H", b, second)[0]):
    if struct.unpack_from("<H", b, second + 2 + 12 * i)[0] == 256:  # ImageWidth -> a private tag
      struct.pack_into("<H", b, second + 2 + 12 * i, 65000)
  with pytest.raises(BadImage, match="^corrupt or truncated image: TypeError$"):
    convert_image(bytes(b), ImageOptions())


@pytest.mark.parametrize("tag,value,reason", [
    (259, 34712, "TIFF compression Pillow cannot decode: 34712"),  # JPEG 2000 in TIFF
    (262, 9, "TIFF pixel layout Pillow cannot decode"),  # photometric CIELab variant Pillow lacks
])
def test_a_valid_tiff_pillow_cannot_open_is_not_called_unrecognised(tag, value, reason):
  data = _patch_first_ifd(_pages(2, "TIFF"), tag, value)
  with pytest.raises(BadImage) as e:
    convert(data, ImageOptions())
  assert str(e.value).startswith(reason)
  assert "not recognised" not in str(e.value)
