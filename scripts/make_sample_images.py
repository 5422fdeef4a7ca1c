"""Generates a small ImageNet-style image folder for demos, tests and benchmarks.

    python scripts/make_sample_images.py OUT_DIR [--per_class=N] [--classes=a,b,c]
        [--splits=train,validation] [--size=500x375] [--corrupt=N] [--seed=0]

Images are synthetic (gradients and shapes, deterministic for a seed) in
several modes and formats (RGB/grayscale/CMYK JPEG, RGBA/palette PNG, EXIF
rotated JPEG), plus `--corrupt` broken files per split: a truncated JPEG, a
text file named .jpg, an empty file.
"""

from __future__ import annotations

import argparse
import io
import os

import numpy as np
from PIL import Image


def synthetic_image(rng: np.random.Generator, w: int, h: int) -> Image.Image:
  y, x = np.mgrid[0:h, 0:w].astype(np.float32)
  c = rng.uniform(0.2, 1.0, size=3)
  phase = rng.uniform(0, 6.28, size=3)
  freq = rng.uniform(0.005, 0.05, size=3)
  arr = np.stack([127 + 120 * np.sin(freq[i] * (x * c[i] + y) + phase[i]) for i in range(3)], -1)
  arr += rng.normal(0, 8, size=arr.shape)
  cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(10, min(w, h) / 3)
  arr[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 255, size=3)
  return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")


def write_variant(im: Image.Image, path_base: str, variant: int) -> str:
  """Writes `im` in one of several formats/modes; returns the path."""
  if variant == 1:
    path = path_base + ".png"
    im.convert("RGBA").save(path)
  elif variant == 2:
    path = path_base + ".jpg"
    im.convert("L").save(path, quality=90)
  elif variant == 3:
    path = path_base + ".jpg"
    im.convert("CMYK").save(path, quality=90)
  elif variant == 4:
    path = path_base + ".png"
    im.convert("P").save(path)
  elif variant == 5:
    path = path_base + ".jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90° clockwise when displayed
    im.save(path, quality=90, exif=exif)
  else:
    path = path_base + ".jpg"
    im.save(path, quality=90)
  return path


def make_folder(out: str, classes: list[str], per_class: int, splits: list[str] | None,
                size: tuple[int, int], corrupt: int, seed: int, mixed: bool = True) -> int:
  """Writes the folder; returns the number of good images."""
  rng = np.random.default_rng(seed)
  n = 0
  for split in splits or [None]:
    base = os.path.join(out, split) if split else out
    for ci, cls in enumerate(classes):
      d = os.path.join(base, cls)
      os.makedirs(d, exist_ok=True)
      for i in range(per_class):
        w = int(size[0] * rng.uniform(0.8, 1.2))
        h = int(size[1] * rng.uniform(0.8, 1.2))
        variant = (i % 8) if mixed else 0
        write_variant(synthetic_image(rng, w, h), os.path.join(d, f"{cls}_{i:05d}"), variant)
        n += 1
    for k in range(corrupt):
      d = os.path.join(base, classes[k % len(classes)])
      kind = k % 3
      if kind == 0:
        buf = io.BytesIO()
        synthetic_image(rng, 64, 48).save(buf, format="JPEG")
        data = buf.getvalue()[: len(buf.getvalue()) // 2]
        name = f"truncated_{k}.jpg"
      elif kind == 1:
        data, name = b"this is not an image\n", f"notes_{k}.jpg"
      else:
        data, name = b"", f"empty_{k}.png"
      with open(os.path.join(d, name), "wb") as f:
        f.write(data)
  return n


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("out")
  ap.add_argument("--per_class", type=int, default=20)
  ap.add_argument("--classes", default="daisy,rose,tulip")
  ap.add_argument("--splits", default="", help="comma-separated split folders; empty: class folders only")
  ap.add_argument("--size", default="500x375")
  ap.add_argument("--corrupt", type=int, default=3)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--plain", action="store_true", help="RGB JPEG only (benchmarks)")
  a = ap.parse_args(argv)
  w, h = (int(v) for v in a.size.lower().split("x"))
  n = make_folder(a.out, a.classes.split(","), a.per_class, [s for s in a.splits.split(",") if s] or None,
                  (w, h), a.corrupt, a.seed, mixed=not a.plain)
  print(f"wrote {n} images (+{a.corrupt} corrupt files per split) to {a.out}")


if __name__ == "__main__":
  main()
