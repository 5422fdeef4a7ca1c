"""loaders.tfdata's own pieces: the TensorFlow resize equals Pillow's fit, pixel for pixel."""

from __future__ import annotations

import numpy as np
from PIL import Image as PILImage, ImageOps

from loaders import tfdata


def _pillow_fit(img: np.ndarray, size: tuple[int, int]) -> np.ndarray:
  """The reference (formats.transforms, grain's loader): Pillow's ImageOps.fit with BILINEAR on the whole image."""
  im = PILImage.fromarray(img)
  if im.size == (size[1], size[0]):
    return img
  return np.asarray(ImageOps.fit(im, (size[1], size[0]), method=PILImage.Resampling.BILINEAR))


def test_crop_first_gives_the_same_pixels_as_pillows_fit():
  rng = np.random.default_rng(0)
  shapes = [(48, 64), (64, 48), (375, 500), (500, 375), (333, 333), (224, 224), (7, 300), (300, 7), (257, 511),
            (225, 224), (1, 50)]
  sizes = [(224, 224), (20, 20), (32, 48), (48, 32), (299, 299), (1, 1)]
  for h, w in shapes:
    y, x = np.mgrid[:h, :w]
    smooth = np.stack([(3 * x) % 256, (5 * y) % 256, (x + y) % 256], -1).astype(np.uint8)
    for img in (rng.integers(0, 256, (h, w, 3), dtype=np.uint8), smooth):
      for size in sizes:
        np.testing.assert_array_equal(tfdata._resize_center_crop(img, size).numpy(), _pillow_fit(img, size),
                                      err_msg=f"{(h, w)} -> {size}")
