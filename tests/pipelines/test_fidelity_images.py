"""Images with more than 8 bits per sample: one documented rule, whatever the container.

docs/image_folder.md: integer samples (modes I;16*, I) are on the 16-bit scale,
pixel = round(value × 255 / 65535); float samples (F) are on the 8-bit scale;
never scaled by the image's own maximum.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pipelines.image_folder.imaging import ImageOptions, convert

H, W = 12, 16


def _twelve_bit() -> np.ndarray:
  """12-bit samples (0..4095), as a CT or microscope camera writes them into a 16-bit container."""
  return (np.arange(H * W).reshape(H, W) * 4095 // (H * W - 1)).astype(np.uint16)


def _png16(a: np.ndarray) -> bytes:
  buf = io.BytesIO()
  Image.fromarray(a).save(buf, "PNG")
  return buf.getvalue()


def _pgm16(a: np.ndarray) -> bytes:
  return b"P5\n%d %d\n65535\n" % (a.shape[1], a.shape[0]) + a.astype(">u2").tobytes()


def _tiff16(a: np.ndarray) -> bytes:
  buf = io.BytesIO()
  Image.fromarray(a).save(buf, "TIFF")
  return buf.getvalue()


def _pixels(data: bytes) -> np.ndarray:
  """The stored RGB pixels (raw encoding, the image's own size: no resampling)."""
  return np.frombuffer(convert(data, ImageOptions(size=(H, W), encoding="raw")), np.uint8).reshape(H, W, 3)


def _rule(values: np.ndarray) -> np.ndarray:
  gray = np.clip(np.rint(values.astype(np.float64) * 255 / 65535), 0, 255).astype(np.uint8)
  return np.repeat(gray[..., None], 3, axis=2)


def test_same_12_bit_data_as_png_pgm_and_tiff_gives_identical_pixels():
  a = _twelve_bit()
  assert Image.open(io.BytesIO(_png16(a))).mode == "I;16"
  assert Image.open(io.BytesIO(_pgm16(a))).mode == "I"
  assert Image.open(io.BytesIO(_tiff16(a))).mode == "I;16"
  png, pgm, tiff = _pixels(_png16(a)), _pixels(_pgm16(a)), _pixels(_tiff16(a))
  np.testing.assert_array_equal(pgm, png)
  np.testing.assert_array_equal(tiff, png)
  np.testing.assert_array_equal(png, _rule(a))


@pytest.mark.parametrize("encode", [_png16, _pgm16, _tiff16], ids=["png", "pgm", "tiff"])
def test_a_pixel_value_means_the_same_in_every_file(encode):
  """Two images sharing a pixel value store the same 8-bit value for it, whatever else they hold."""
  dark = np.full((H, W), 1000, np.uint16)
  bright = dark.copy()
  bright[0, 0] = 4095
  np.testing.assert_array_equal(_pixels(encode(dark))[1:, 1:], _pixels(encode(bright))[1:, 1:])
  assert _pixels(encode(dark))[5, 5, 0] == round(1000 * 255 / 65535)


def test_mode_i_is_on_the_16_bit_scale_and_saturates():
  values = np.array([[-5, 0, 257, 65535, 70000, 1 << 30] * 2] * 2, np.int32)
  buf = io.BytesIO()
  Image.fromarray(values, "I").save(buf, "TIFF")
  assert Image.open(io.BytesIO(buf.getvalue())).mode == "I"
  out = np.frombuffer(convert(buf.getvalue(), ImageOptions(size=values.shape, encoding="raw")), np.uint8)
  np.testing.assert_array_equal(out.reshape(*values.shape, 3)[0, :6, 0], [0, 0, 1, 255, 255, 255])
