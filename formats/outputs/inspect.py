"""Look at an output: summary, verification against the manifest, a picture grid.

    python -m formats.outputs.inspect OUTPUT [--verify] [--repair] [--grid FILE.png] [--split=train] [--num=16]

It prints the output's summary, then its generation folders (current,
TFDS view, running, dead, replaced with its retention, abandoned) and the
reader leases on them (held, expired, and objects under `_leases/` that are
not leases). `--repair` syncs the TFDS view and runs the clean-up a run
would, which honours retention and leases (docs/manifest.md). `--verify` re-reads every shard (a local copy for gs://), checks its SHA-256,
size and record count against the manifest and decodes every record; it exits
1 naming each bad shard. `--grid` renders sample records and their labels.

This module is the command line only: opening, reading and verifying an
output are formats.outputs.output's (`open_output`, `Output.verify`). A
function's `output` is the output folder, local or gs://, and `manifest` its
manifest.
"""

from __future__ import annotations

import argparse
import io
import json
import sys

import numpy as np

from formats import kinds
from formats.outputs import commit, leases
from formats.storage import files
from formats.features import ClassLabel, Tensor
from formats.manifest import Manifest
from formats.outputs.output import Output, load_manifest, verify

# The feature a grid draws, by record kind.
_DRAWN_FEATURE = {"image": "image", "volume": "volume"}


def summary(manifest: Manifest) -> str:
  """The text `python -m formats.outputs.inspect` prints for an output.

  Returns:
    Its name, features, splits, rejects, files and warnings, one per line.
  """
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


def _clean(text: str) -> str:
  """A name from the output (lease files are anyone's) made safe to print on a terminal."""
  return "".join(c if c.isprintable() else "?" for c in text)


def _duration(seconds: float) -> str:
  for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
    if seconds >= size:
      return f"{seconds / size:.1f} {unit}"
  return f"{seconds:.0f} s"


def generations_report(output: str, now: float | None = None) -> str:
  """The text `python -m formats.outputs.inspect` prints about an output's generations and reader leases.

  Uses clean-up's defaults (`commit.DEFAULT_KEEP_REPLACED_SECONDS`, `commit.LEASE_SECONDS`,
  `leases.LEASE_TTL_SECONDS`): what a run's clean-up, or `--repair`, would keep and remove.

  Args:
    now: the time ages are measured at (default: now).

  Returns:
    One line per generation, then the leases; "" when there is neither.
  """
  gens = commit.list_generations(output, now=now)
  found = leases.list_leases(output, now=now)
  invalid = leases.list_invalid(output)
  lines = []
  if gens:
    lines.append(f"generations ({len(gens)}; ended ones kept {_duration(commit.DEFAULT_KEEP_REPLACED_SECONDS)}):")
    width = max(len(g.state) for g in gens)
    for g in gens:
      flag = " [removable]" if g.removable else ""
      lines.append(f"  {_clean(g.name)}  {g.state:<{width}}  {g.reason}{flag}")
  held = [i for i in found if not i.expired]
  expired = [i for i in found if i.expired]
  if found or invalid:
    lines.append(f"reader leases: {len(held)} held, {len(expired)} expired (TTL {_duration(leases.LEASE_TTL_SECONDS)}), "
                 f"{len(invalid)} ignored")
  for i in held:
    purpose = f" ({i.purpose})" if i.purpose else ""
    lines.append(f"  held {i.id}: {i.generation} by {i.host} pid {i.pid}{purpose}, refreshed {_duration(i.age_seconds)} ago")
  for i in expired:
    lines.append(f"  expired {i.id}: {i.generation} by {i.host} pid {i.pid}, last refreshed {_duration(i.age_seconds)} "
                 "ago (holds nothing; the next clean-up removes it)")
  for name, why in invalid:
    lines.append(f"  ignored {leases.LEASES_FOLDER}/{_clean(name)[:120]}: {why} (holds nothing, never removed)")
  return "\n".join(lines)


def _to_pixels(feature, value) -> np.ndarray:
  """uint8 pixels to draw: an image, or the middle slice of a CT volume (the volume kind's display window)."""
  from PIL import Image as PILImage

  if isinstance(feature, Tensor):
    arr = np.asarray(value)
    if arr.ndim == 3 and arr.shape[-1] != 3:  # a volume [depth, rows, columns] in HU
      low, high = kinds.KINDS["volume"].constants["display_window_hu"]
      mid = arr[arr.shape[0] // 2].astype(np.float32)
      return (np.clip((mid - low) / (high - low), 0, 1) * 255).astype(np.uint8)
    return arr
  return np.asarray(PILImage.open(io.BytesIO(value)).convert("RGB"))


def render_grid(output: str, manifest: Manifest, png_path: str, split: str | None = None,
                num: int = 16, cell: int = 128) -> int:
  """Writes a PNG grid of the first `num` records of `split`, labelled.

  Args:
    png_path: the PNG to write.
    split: the split drawn (default: the first, by name, that has records).
    num: how many records at most.
    cell: the side of each picture in pixels.

  Returns:
    How many records were drawn.

  Raises:
    ValueError: no such split, or the records are of a kind that has no picture.
  """
  from PIL import Image as PILImage, ImageDraw

  out = Output(output, manifest)
  split = split or next((k for k, v in sorted(manifest.splits.items()) if v.num_records), sorted(manifest.splits)[0])
  if split not in manifest.splits:
    raise ValueError(f"split {split!r} not in {sorted(manifest.splits)}")
  image_key = _DRAWN_FEATURE.get(out.kind)
  if image_key is None:
    raise ValueError("no image feature to draw")
  label_key = next((k for k, f in manifest.features.items() if isinstance(f, ClassLabel)), None)
  samples = []
  for shard in out.shards(split):
    with files.LocalCopy(out.shard_path(shard)) as local:
      for record in out.adapter.read_file(local):
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


def main(argv: list[str] | None = None) -> int:
  """`python -m formats.outputs.inspect`: prints an output's summary; verifies, repairs or draws it on request.

  Args:
    argv: the arguments (default sys.argv[1:]).

  Returns:
    The exit status: 0, 1 when --verify found a bad file, 2 when the folder is
    not a readable output.
  """
  ap = argparse.ArgumentParser(prog="python -m formats.outputs.inspect", description=__doc__.splitlines()[0])
  ap.add_argument("output", help="an output folder (local or gs://)")
  ap.add_argument("--verify", action="store_true", help="re-read every shard and check it against the manifest")
  ap.add_argument("--grid", metavar="FILE.png", help="render sample records to a PNG")
  ap.add_argument("--split", default=None)
  ap.add_argument("--num", type=int, default=16)
  ap.add_argument("--repair", action="store_true",
                  help="bring the TFDS metadata in line with the manifest and remove dead runs' generations "
                       "(what the next run would do first; see docs/manifest.md)")
  a = ap.parse_args(argv)
  try:
    if a.repair:
      commit.repair(a.output)  # refuses (ValueError) a manifest that is not valid: nothing is removed
    manifest = load_manifest(a.output)
  except (FileNotFoundError, ValueError, KeyError) as e:
    report = _generations_or_none(a.output)
    if report:
      print(report)
    print(f"inspect: error: {e}", file=sys.stderr)
    return 2
  print(summary(manifest))
  report = _generations_or_none(a.output)
  if report:
    print(report)
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


def _generations_or_none(output: str) -> str:
  try:
    return generations_report(output)
  except (FileNotFoundError, NotADirectoryError, ValueError):  # not a folder, or an unreadable manifest
    return ""


if __name__ == "__main__":
  sys.exit(main())
