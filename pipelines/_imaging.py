"""Image decoding and normalisation for the image pipeline: bytes in, bytes out. No Beam.

`convert` decodes anything Pillow reads, applies the EXIF orientation, turns
grayscale/palette/CMYK/alpha/16-bit images into 8-bit RGB, optionally resizes
(aspect-preserving, then center crop) to a fixed size, and encodes JPEG or raw
uint8 HxWx3 pixels. Baseline RGB JPEGs that need no change are kept byte for byte.
"""

from __future__ import annotations

import dataclasses
import io
import warnings

import numpy as np
from PIL import Image, ImageOps

_EXIF_ORIENTATION = 0x0112
# Decompression bombs: images above this many pixels are refused from their header,
# before any decoding (`ImageOptions.max_pixels`, the `--max_image_pixels` flag).
MAX_PIXELS = 178_956_970  # twice Pillow's warning threshold: about 540 MB of RGB pixels
# The toolkit checks its own cap right after the header is read; Pillow's check
# (a warning above 89 M pixels, an error above 179 M) would otherwise fire first and
# turn an image under the cap into a reject with a false reason.
Image.MAX_IMAGE_PIXELS = None


class BadImage(ValueError):
  """The bytes are not a decodable image; the message is the reason recorded in errors/."""


@dataclasses.dataclass(frozen=True)
class ImageOptions:
  """How images are stored. `size` is (height, width) or None to keep each image's size."""

  size: tuple[int, int] | None = None
  encoding: str = "jpeg"  # "jpeg" or "raw"
  jpeg_quality: int = 95
  max_pixels: int = MAX_PIXELS  # width x height above which an image is rejected unread

  def __post_init__(self):
    if self.encoding not in ("jpeg", "raw"):
      raise ValueError(f"encoding must be jpeg or raw, got {self.encoding!r}")
    if self.encoding == "raw" and self.size is None:
      raise ValueError("encoding=raw needs a fixed image size (--image_size=H,W)")
    if self.size is not None and (len(self.size) != 2 or min(self.size) <= 0):
      raise ValueError(f"image size must be two positive integers H,W, got {self.size}")
    if not 1 <= self.jpeg_quality <= 100:
      raise ValueError(f"jpeg_quality must be in [1, 100], got {self.jpeg_quality}")
    if self.max_pixels < 1:
      raise ValueError(f"max_pixels must be >= 1, got {self.max_pixels}")


def to_rgb(im: Image.Image) -> Image.Image:
  """8-bit RGB from any mode Pillow decodes (alpha dropped, as torchvision's loader does)."""
  if im.mode == "RGB":
    return im
  if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
    arr = np.asarray(im)
    if im.mode.startswith("I;16"):
      arr = arr.astype(np.float32) / 257.0
    elif im.mode == "I":
      arr = arr.astype(np.float64) * (255.0 / max(1, int(arr.max()))) if arr.max() > 255 else arr
    arr = np.clip(np.rint(arr), 0, 255).astype(np.uint8)
    return Image.fromarray(arr, "L").convert("RGB")
  if im.mode == "P" and "transparency" in im.info:
    im = im.convert("RGBA")
  return im.convert("RGB")


def resize_center_crop(im: Image.Image, size: tuple[int, int]) -> Image.Image:
  """Scales so the image covers (H, W), keeping its aspect ratio, and crops the center."""
  h, w = size
  if im.size == (w, h):
    return im
  return ImageOps.fit(im, (w, h), method=Image.Resampling.BILINEAR, centering=(0.5, 0.5))


def convert(data: bytes, options: ImageOptions) -> bytes:
  """Decoded, oriented, RGB, sized and re-encoded image bytes. Raises BadImage."""
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("error", Image.DecompressionBombWarning)
      im = Image.open(io.BytesIO(data))
      fmt = im.format
      if im.width * im.height > options.max_pixels:
        raise BadImage(f"image too large: {im.width}x{im.height} pixels > {options.max_pixels}")
      orientation = im.getexif().get(_EXIF_ORIENTATION, 1)
      if (
          fmt == "JPEG" and im.mode == "RGB" and orientation == 1
          and options.size is None and options.encoding == "jpeg"
      ):
        im.load()  # decode once to prove the file is whole
        return data
      if options.size is not None and fmt == "JPEG":
        # Let libjpeg decode at a reduced scale (never below 2x the target).
        h, w = options.size
        im.draft("RGB", (2 * w, 2 * h))
      im.load()
  except BadImage:
    raise
  except Image.UnidentifiedImageError:
    raise BadImage("not an image: format not recognised") from None
  except (OSError, SyntaxError, ValueError, EOFError, Warning) as e:
    raise BadImage(f"corrupt or truncated image: {type(e).__name__}") from None
  try:
    im = ImageOps.exif_transpose(im)
    im = to_rgb(im)
    if options.size is not None:
      im = resize_center_crop(im, options.size)
    if options.encoding == "raw":
      return np.asarray(im, dtype=np.uint8).tobytes()
    out = io.BytesIO()
    im.save(out, format="JPEG", quality=options.jpeg_quality)
    return out.getvalue()
  except (OSError, ValueError) as e:
    raise BadImage(f"cannot convert image: {type(e).__name__}") from None
