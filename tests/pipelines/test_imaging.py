"""Image normalisation: pure functions, no Beam."""

import io

import numpy as np
import pytest
from PIL import Image

from pipelines._imaging import BadImage, ImageOptions, convert


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
  assert out.shape == (30, 40, 3) and out.dtype == np.uint8


def test_exif_orientation_is_applied():
  exif = Image.Exif()
  exif[0x0112] = 6  # rotate 90° clockwise for display
  data = _encode(_gradient(40, 30), "JPEG", exif=exif)
  assert _decode(convert(data, ImageOptions())).shape == (40, 30, 3)


def test_resize_keeps_aspect_and_center_crops():
  im = Image.new("RGB", (300, 100), "red")
  im.paste(Image.new("RGB", (100, 100), "blue"), (100, 0))  # blue center third
  out = np.frombuffer(convert(_encode(im, "PNG"), ImageOptions(size=(50, 50), encoding="raw")), np.uint8)
  out = out.reshape(50, 50, 3)
  assert out[:, 5:45, 2].min() > 200 and out[:, 5:45, 0].max() < 60  # only the blue middle survives


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
