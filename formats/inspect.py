"""Look at an output: summary, verification against the manifest, a picture grid.

    python -m formats.inspect OUTPUT [--verify] [--grid FILE.png] [--split=train] [--num=16]

`--verify` re-reads every shard (a local copy for gs://), checks its SHA-256,
size and record count against the manifest and decodes every record; it exits
1 naming each bad shard. `--grid` renders sample records and their labels.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
import dataclasses
import io
import json
import os
import sys

import numpy as np

from formats import arrayrecord, commit, files, tfrecord
from formats.features import ClassLabel, Features, Tensor
from formats.graphbin import GraphBin
from formats.manifest import MANIFEST_FILENAME, FileInfo, Manifest, ShardInfo, sha256_file


def load_manifest(output: str) -> Manifest:
  path = files.join(output, MANIFEST_FILENAME)
  if not files.exists(path):
    raise FileNotFoundError(f"{path} not found: {output} is not a complete output")
  return Manifest.loads(files.read_bytes(path))


def iter_records(local_path: str, file_format: str) -> Iterator[bytes]:
  if file_format == "array_record":
    return arrayrecord.read_file(local_path)
  return tfrecord.read_file(local_path)


@dataclasses.dataclass
class ShardProblem:
  path: str
  problem: str


def verify_shard(output: str, shard: ShardInfo, file_format: str, features: Features) -> list[str]:
  """Problems found in one shard (empty when it matches the manifest)."""
  src = files.join(output, shard.path)
  if not files.exists(src):
    return ["missing"]
  problems = []
  with files.LocalCopy(src) as local:
    size = os.path.getsize(local)
    if size != shard.num_bytes:
      problems.append(f"size {size} != manifest {shard.num_bytes}")
    digest = sha256_file(local)
    if digest != shard.sha256:
      problems.append(f"sha256 {digest[:12]}... != manifest {shard.sha256[:12]}...")
    n = 0
    try:
      for n, record in enumerate(iter_records(local, file_format), start=1):
        try:
          features.decode(record)
        except ValueError as e:
          problems.append(f"record {n - 1}: {e}")
          break
    except Exception as e:  # a C++ reader error or a framing error: name it, do not crash
      problems.append(f"unreadable after record {n}: {e}")
      return problems
    if n != shard.num_records:
      problems.append(f"{n} records != manifest {shard.num_records}")
  return problems


def verify(output: str, manifest: Manifest, out=None) -> int:
  """Checks every shard; prints one line per bad shard; returns the number of bad shards."""
  out = out or sys.stdout
  bad = 0
  for split_name, split in sorted(manifest.splits.items()):
    for shard in split.shards:
      problems = verify_shard(output, shard, manifest.file_format, manifest.features)
      if problems:
        bad += 1
        print(f"BAD {shard.path}: {'; '.join(problems)}", file=out)
  for info in manifest.files:
    problems = verify_file(output, info)
    if problems:
      bad += 1
      print(f"BAD {info.path}: {'; '.join(problems)}", file=out)
  total = sum(len(s.shards) for s in manifest.splits.values()) + len(manifest.files)
  print(f"verify: {total - bad}/{total} {'files' if manifest.files else 'shards'} OK", file=out)
  return bad


def verify_file(output: str, info: FileInfo) -> list[str]:
  """Problems of a non-shard data file (a .graphbin): size, SHA-256, section checksums."""
  src = files.join(output, info.path)
  if not files.exists(src):
    return ["missing"]
  problems = []
  with files.LocalCopy(src) as local:
    if os.path.getsize(local) != info.num_bytes:
      problems.append(f"size {os.path.getsize(local)} != manifest {info.num_bytes}")
    digest = sha256_file(local)
    if digest != info.sha256:
      problems.append(f"sha256 {digest[:12]}... != manifest {info.sha256[:12]}...")
    if info.kind == "graphbin":
      try:
        GraphBin(local, verify=True)
      except ValueError as e:
        problems.append(str(e))
  return problems


def summary(manifest: Manifest) -> str:
  lines = [f"{manifest.name} ({manifest.file_format}), {manifest.num_records} records"]
  lines.append("features:")
  for k, f in manifest.features.items():
    d = f.to_json()
    extra = f" num_classes={d['num_classes']}" if "num_classes" in d else ""
    shape = f" shape={tuple(d['shape'])}" if "shape" in d else ""
    lines.append(f"  {k}: {d['kind']} {d.get('dtype', '')}{shape}{extra}".rstrip())
  lines.append("splits:")
  for name, split in sorted(manifest.splits.items()):
    lengths = split.shard_lengths
    span = f"{min(lengths)}-{max(lengths)} per shard" if lengths else "no shards"
    lines.append(
        f"  {name}: {split.num_records} records, {len(split.shards)} shards ({span}), "
        f"{split.num_bytes / 1e6:.1f} MB"
    )
  rej = manifest.rejected
  reasons = ", ".join(f"{k}: {v}" for k, v in rej.by_reason.items())
  lines.append(f"rejected: {rej.count}" + (f" ({reasons}) listed in {rej.path}" if rej.count else ""))
  for f in manifest.files:
    lines.append(f"file: {f.path} ({f.kind}, {f.num_bytes / 1e6:.1f} MB)")
  if manifest.graph:
    lines.append(f"graph: {json.dumps(manifest.graph, sort_keys=True)}")
  for w in manifest.warnings:
    lines.append(f"warning: {w}")
  return "\n".join(lines)


def _to_pixels(feature, value) -> np.ndarray:
  """uint8 pixels to draw: an image, or the middle slice of a CT volume (window -1000..1000 HU)."""
  from PIL import Image as PILImage

  if isinstance(feature, Tensor):
    arr = np.asarray(value)
    if arr.ndim == 3 and arr.shape[-1] != 3:  # a volume [depth, rows, columns] in HU
      mid = arr[arr.shape[0] // 2].astype(np.float32)
      return (np.clip((mid + 1000.0) / 2000.0, 0, 1) * 255).astype(np.uint8)
    return arr
  return np.asarray(PILImage.open(io.BytesIO(value)).convert("RGB"))


def render_grid(output: str, manifest: Manifest, png_path: str, split: str | None = None,
                num: int = 16, cell: int = 128) -> int:
  """Writes a PNG grid of the first `num` records of `split`; returns how many were drawn."""
  from PIL import Image as PILImage, ImageDraw

  split = split or next((k for k, v in sorted(manifest.splits.items()) if v.num_records), sorted(manifest.splits)[0])
  if split not in manifest.splits:
    raise ValueError(f"split {split!r} not in {sorted(manifest.splits)}")
  image_key = next((k for k in ("image", "volume") if k in manifest.features), None)
  if image_key is None:
    raise ValueError("no image feature to draw")
  label_key = next((k for k, f in manifest.features.items() if isinstance(f, ClassLabel)), None)
  samples = []
  for shard in manifest.splits[split].shards:
    with files.LocalCopy(files.join(output, shard.path)) as local:
      for record in iter_records(local, manifest.file_format):
        samples.append(manifest.features.decode(record))
        if len(samples) >= num:
          break
    if len(samples) >= num:
      break
  cols = max(1, int(np.ceil(np.sqrt(len(samples)))))
  rows = max(1, int(np.ceil(len(samples) / cols)))
  grid = PILImage.new("RGB", (cols * cell, rows * (cell + 14)), "white")
  draw = ImageDraw.Draw(grid)
  for i, s in enumerate(samples):
    img = PILImage.fromarray(_to_pixels(manifest.features[image_key], s[image_key]))
    img.thumbnail((cell, cell))
    x, y = (i % cols) * cell, (i // cols) * (cell + 14)
    grid.paste(img, (x, y))
    if label_key:
      label = s[label_key]
      draw.text((x + 2, y + cell), f"{label}: {manifest.features[label_key].names[label]}", fill="black")
    elif "num_slices" in s:
      draw.text((x + 2, y + cell), f"{int(s['num_slices'])} slices", fill="black")
  grid.save(png_path)
  return len(samples)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m formats.inspect", description=__doc__.splitlines()[0])
  ap.add_argument("output", help="an output folder (local or gs://)")
  ap.add_argument("--verify", action="store_true", help="re-read every shard and check it against the manifest")
  ap.add_argument("--grid", metavar="FILE.png", help="render sample records to a PNG")
  ap.add_argument("--split", default=None)
  ap.add_argument("--num", type=int, default=16)
  ap.add_argument("--repair", action="store_true",
                  help="bring the TFDS metadata in line with the manifest and remove dead runs' generations "
                       "(what the next run would do first; see docs/manifest.md)")
  a = ap.parse_args(argv)
  if a.repair:
    commit.repair(a.output)
  try:
    manifest = load_manifest(a.output)
  except (FileNotFoundError, ValueError, KeyError) as e:
    print(f"inspect: error: {e}", file=sys.stderr)
    return 2
  print(summary(manifest))
  status = 0
  if a.verify and commit.tfds_metadata_lags(a.output):
    # The output the manifest describes is complete (checked below); TFDS's view is the
    # previous complete one, or none while class names change (docs/manifest.md).
    print("verify: warning: the TFDS metadata does not describe the committed manifest yet (a run was "
          "stopped between its switch and its TFDS update): TFDS readers see the previous output, or none. "
          "Fix: --repair (or the next run)")
  if a.verify and verify(a.output, manifest):
    status = 1
  if a.grid:
    n = render_grid(a.output, manifest, a.grid, a.split, a.num)
    print(f"grid: {n} records -> {a.grid}")
  return status


if __name__ == "__main__":
  sys.exit(main())
