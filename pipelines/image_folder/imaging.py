"""Image decoding and normalisation for the image pipeline: bytes in, bytes out. No Beam.

`convert` decodes anything Pillow reads, applies the EXIF orientation, turns
grayscale/palette/CMYK/alpha/16-bit images into 8-bit RGB, optionally resizes
(aspect-preserving, then center crop) to a fixed size, and encodes JPEG or raw
uint8 HxWx3 pixels. Baseline RGB JPEGs that need no change are kept byte for byte.
Multi-frame files (animated GIF/PNG/WebP, multi-page TIFF) keep their first frame;
`convert_image` says how many frames the file had, so the caller can report it.
"""

from __future__ import annotations

import dataclasses
import io
from typing import NamedTuple
import warnings

import numpy as np
from PIL import Image, ImageOps, TiffImagePlugin

_EXIF_ORIENTATION = 0x0112
_TRANSPOSING = range(2, 9)  # the orientations ImageOps.exif_transpose turns; 1 and unknown values need nothing
_SWAPS_AXES = range(5, 9)  # transpose, rotate 90 and 270, transverse: the displayed image is the stored one on its side
# Decompression bombs: images above this many pixels are refused from their header,
# before any decoding (`ImageOptions.max_pixels`, the `--max_image_pixels` flag).
MAX_IMAGE_SIDE = 16384  # --image_size sides: a 16384x16384 RGB record is already 805 MB
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
    # The messages name the command-line flags: the converter's flag checks are these, in this order.
    if self.size is not None:
      shown = f"'{self.size[0]},{self.size[1]}'" if len(self.size) == 2 else repr(self.size)
      if len(self.size) != 2 or min(self.size) <= 0:
        raise ValueError(f"--image_size must be H,W with positive integers, got {shown}")
      if max(self.size) > MAX_IMAGE_SIDE:
        raise ValueError(f"--image_size sides must be <= {MAX_IMAGE_SIDE}, got {shown}")
    if self.max_pixels < 1:
      raise ValueError(f"--max_image_pixels must be >= 1, got {self.max_pixels}")
    if self.encoding not in ("jpeg", "raw"):
      raise ValueError(f"--encoding must be jpeg or raw, got {self.encoding!r}")
    if self.encoding == "raw" and self.size is None:
      raise ValueError("--encoding=raw needs --image_size=H,W (raw pixels must have a fixed shape)")
    if not 1 <= self.jpeg_quality <= 100:
      raise ValueError(f"--jpeg_quality must be in [1, 100], got {self.jpeg_quality}")


class Converted(NamedTuple):
  """What `convert_image` made: the stored bytes, and the frames the file held (1 kept)."""

  data: bytes
  num_frames: int = 1

  @property
  def multi_frame(self) -> bool:
    """True when the file held more than one frame (only the first was kept)."""
    return self.num_frames > 1


# Samples wider than 8 bits, one rule (docs/image_folder.md): integer modes are on the
# 16-bit scale, pixel = round(value * 255 / 65535), clipped to [0, 255] (Pillow decodes
# 16-bit PNG/TIFF as I;16* and 16-bit PGM as I, rescaling a PGM maxval to 65535); F is
# on the 8-bit scale (Pillow's own F -> L rule), NaN -> 0. Never the image's own maximum:
# a pixel value then means the same in every file.
_SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")
_SIXTEEN_BIT_MAX = 65535


def wide_to_gray(arr: np.ndarray, mode: str) -> np.ndarray:
  """uint8 gray from the samples of an I;16*, I or F image, by the rule above.

  Args:
    arr: the image's samples (`np.asarray(im)`).
    mode: the image's Pillow mode.

  Returns:
    The gray values, same shape, dtype uint8.

  Raises:
    ValueError: `mode` has 8-bit samples.
  """
  if mode in _SIXTEEN_BIT_MODES:
    scaled = np.clip(arr.astype(np.int64), 0, _SIXTEEN_BIT_MAX).astype(np.float32) / 257.0  # 257 = 65535 / 255
  elif mode == "F":
    scaled = np.nan_to_num(arr.astype(np.float64), nan=0.0)
  else:
    raise ValueError(f"mode {mode!r} has 8-bit samples")
  return np.clip(np.rint(scaled), 0, 255).astype(np.uint8)


def to_rgb(im: Image.Image) -> Image.Image:
  """8-bit RGB from any mode Pillow decodes (alpha dropped, as torchvision's loader does).

  Args:
    im: a decoded image.

  Returns:
    `im` itself when already RGB, else an RGB copy.
  """
  if im.mode == "RGB":
    return im
  if im.mode in (*_SIXTEEN_BIT_MODES, "F"):
    return Image.fromarray(wide_to_gray(np.asarray(im), im.mode), "L").convert("RGB")
  if im.mode == "P" and "transparency" in im.info:
    im = im.convert("RGBA")
  return im.convert("RGB")


def resize_center_crop(im: Image.Image, size: tuple[int, int]) -> Image.Image:
  """Scales so the image covers (H, W), keeping its aspect ratio, and crops the center.

  Args:
    im: a decoded image.
    size: (H, W), the output's size.

  Returns:
    An image of exactly (H, W) (`im` itself when already that size).
  """
  h, w = size
  if im.size == (w, h):
    return im
  return ImageOps.fit(im, (w, h), method=Image.Resampling.BILINEAR, centering=(0.5, 0.5))


_TIFF_MAGIC = (b"II*\0", b"MM\0*", b"II+\0", b"MM\0+")


def _unopenable_reason(data: bytes) -> str:
  """Why Pillow found no reader for `data`: a TIFF Pillow's TIFF reader refuses, or no known format.

  Pillow's `Image.open` turns a refusal by the reader of a recognised format into
  "cannot identify image file"; the TIFF reader's own refusal is asked for here.
  """
  if data[:4] not in _TIFF_MAGIC:
    return "not an image: format not recognised"
  try:
    ifd = TiffImagePlugin.ImageFileDirectory_v2(data[:8])
    fp = io.BytesIO(data)
    fp.seek(ifd.next)
    ifd.load(fp)
    compression = int(ifd.get(259, 1))
  except Exception:
    return "corrupt TIFF: unreadable first page directory"
  if compression not in TiffImagePlugin.COMPRESSION_INFO:
    return f"TIFF compression Pillow cannot decode: {compression}"
  try:
    TiffImagePlugin.TiffImageFile(io.BytesIO(data))
  except Exception as e:  # the reader's refusal, as Image.open hid it
    if str(e) == "unknown pixel mode":
      return ("TIFF pixel layout Pillow cannot decode: photometric interpretation, samples per pixel or "
              "bits per sample it does not support")
    return f"TIFF Pillow's reader refuses: {type(e).__name__}"
  return "not an image: format not recognised"


def convert(data: bytes, options: ImageOptions) -> bytes:
  """Decoded, oriented, RGB, sized and re-encoded image bytes.

  Args:
    data: the bytes of one image file.
    options: the size, encoding and limits (`--image_size`, `--encoding`, ...).

  Returns:
    JPEG bytes, or raw uint8 RGB pixels (H * W * 3) with `--encoding=raw`.

  Raises:
    BadImage: the file is not an image Pillow decodes, is too large, or cannot be converted.
  """
  return convert_image(data, options).data


def convert_image(data: bytes, options: ImageOptions) -> Converted:
  """As `convert`, with the number of frames the file held (the first one is kept).

  An RGB JPEG that needs no change is stored as it is, after one decode proves it whole.

  Args:
    data: the bytes of one image file.
    options: the size, encoding and limits.

  Returns:
    `Converted`: the stored bytes and the file's frame count.

  Raises:
    BadImage: the reason the file is a reject (never a value from the file).
  """
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("error", Image.DecompressionBombWarning)
      im = Image.open(io.BytesIO(data))
      fmt = im.format
      if im.width * im.height > options.max_pixels:
        raise BadImage(f"image too large: {im.width}x{im.height} pixels > {options.max_pixels}")
      num_frames = max(1, int(getattr(im, "n_frames", 1)))
      orientation = im.getexif().get(_EXIF_ORIENTATION, 1)
      if (
          fmt == "JPEG" and im.mode == "RGB" and orientation == 1
          and options.size is None and options.encoding == "jpeg"
      ):
        im.load()  # decode once to prove the file is whole
        return Converted(data, num_frames)
      if options.size is not None and fmt == "JPEG":
        # Let libjpeg decode at a reduced scale (never below 2x the target).
        h, w = options.size
        if orientation in _SWAPS_AXES:  # the size is the displayed one, the draft scales the stored pixels
          h, w = w, h
        im.draft("RGB", (2 * w, 2 * h))
      im.load()
  except BadImage:
    raise
  except Image.UnidentifiedImageError:
    raise BadImage(_unopenable_reason(data)) from None
  except MemoryError:  # the worker's trouble, not the file's
    raise
  except Exception as e:  # noqa: BLE001 - Pillow's readers raise anything on damaged bytes (a TIFF's later
    # page directory: TypeError, KeyError): the file is the problem, never a reason to stop the job
    raise BadImage(f"corrupt or truncated image: {type(e).__name__}") from None
  try:
    if im.getexif().get(_EXIF_ORIENTATION, 1) in _TRANSPOSING:  # else exif_transpose only copies the pixels
      im = ImageOps.exif_transpose(im)
    im = to_rgb(im)
    if options.size is not None:
      im = resize_center_crop(im, options.size)
    if options.encoding == "raw":
      return Converted(im.tobytes(), num_frames)  # 8-bit RGB: H * W * 3 bytes, row by row
    out = io.BytesIO()
    im.save(out, format="JPEG", quality=options.jpeg_quality)
    return Converted(out.getvalue(), num_frames)
  except (OSError, ValueError) as e:
    raise BadImage(f"cannot convert image: {type(e).__name__}") from None
