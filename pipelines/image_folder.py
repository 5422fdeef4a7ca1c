"""Image folders (ImageNet style) → ArrayRecord or TFRecord shards.

    python -m pipelines.image_folder --input=DIR_OR_GS --output=DIR_OR_GS \
        [--format=array_record|tfrecord] [--num_shards=N] [--image_size=H,W] \
        [--encoding=jpeg|raw] [--name=NAME] [--seed=0] [any Beam option]

Input is `<input>/<class>/<files>` (one split, `train`) or
`<input>/<split>/<class>/<files>`; files below a class folder are taken
recursively. Class names, sorted, give the label ids. Each record holds
`image` (JPEG bytes, or raw uint8 HxWx3 with --encoding=raw), `label` and
`file_name` (the path relative to the input root). Files that are not
decodable images go to `<output>/errors/rejected.jsonl` with the reason and are
counted in the manifest; the pipeline goes on.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
import logging
import os
import re
import time

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions

from formats import files as fs
from formats import naming
from formats.features import ClassLabel, Features, Image, Tensor, Text
from pipelines import _cli, _imaging, _inputs
from pipelines._sink import InputSummary, OutputSpec, Record, Reject, WriteOutput

PIPELINE = "pipelines.image_folder"
DEFAULT_SPLIT = "train"
MAX_IMAGE_SIDE = 16384  # --image_size sides: a 16384x16384 RGB record is already 805 MB
_log = logging.getLogger(PIPELINE)


class ImageFolderOptions(PipelineOptions):
  """Flags of `pipelines.image_folder` beyond the shared ones (`_cli.ConverterOptions`)."""

  @classmethod
  def _add_argparse_args(cls, parser):
    parser.add_argument("--image_size", default=None, help="H,W: resize (keep aspect) and center-crop to this size.")
    parser.add_argument("--encoding", default="jpeg", help="jpeg (default) or raw (uint8 HxWx3; needs --image_size).")
    parser.add_argument("--jpeg_quality", default="95", help="JPEG quality when images are re-encoded.")
    parser.add_argument("--layout", default="auto",
                        help="auto, classes (<class>/<files>) or splits (<split>/<class>/<files>).")
    parser.add_argument("--max_image_pixels", default=str(_imaging.MAX_PIXELS),
                        help=f"Reject images with more pixels (width x height) than this, from their header, "
                             f"before decoding (default {_imaging.MAX_PIXELS}).")


def split_and_class(rel: str, split_layout: bool) -> tuple[str, str]:
  """(split, class name) of a file from its path relative to the input root."""
  parts = rel.split("/")
  return (parts[0], parts[1]) if split_layout else (DEFAULT_SPLIT, parts[0])


def _scan(folder: str, root: str, taken: list[str]) -> tuple[list[str], list[str], list[tuple[str, str]]]:
  """(folder names, file names, (name, reason) of other entries) directly in `folder`.

  Locally a sub-folder is judged by where it leads: back to `root` or above it
  is a link loop; into a folder already `taken` (real paths of the layout's
  folders so far, extended here) or one that holds it lists files twice (under
  another label): both are odd entries, as are names whose escaped form collides.
  """
  if fs.is_gcs(folder):
    dirs, files = fs.list_dir(folder)
    return dirs, files, []
  dirs, files, others = _inputs.scan_dir(folder)
  clashes = _inputs.colliding([*dirs, *files])
  others += [(n, _inputs.COLLIDING_NAME) for n in sorted(clashes)]
  files = [f for f in files if f not in clashes]
  real_root, kept = os.path.realpath(root), []
  for d in dirs:
    if d in clashes:
      continue
    real = os.path.realpath(os.path.join(folder, d))
    if real == real_root or real_root.startswith(real.rstrip(os.sep) + os.sep):
      others.append((d, "symbolic link loop"))
    elif any(real == t or real.startswith(t + os.sep) or t.startswith(real + os.sep) for t in taken):
      others.append((d, _inputs.OTHER_PART_OF_INPUT))
    else:
      taken.append(real)
      kept.append(d)
  return kept, files, sorted(others)


class _Layout:
  """What the launcher found under the input: splits, classes, stray files, odd entries.

  Names are kept as the OS gives them (surrogate escapes for non-UTF-8 bytes);
  class names, labels and file names are their printable forms (`_inputs.printable`).
  """

  def __init__(self, root: str, layout: str):
    self.root = root
    dirs, root_files, root_others = _scan(root, root, [])
    below = {}
    for d in dirs:  # each split's class folders: no two of the whole input may overlap
      below[d] = _scan(fs.join(root, d), root, [os.path.realpath(fs.join(root, e)) for e in dirs if e != d])
    if layout == "auto":
      layout = "splits" if dirs and all(below[d][0] for d in dirs) else "classes"
    self.layout = layout
    self.class_dirs: dict[str, list[str]] = {}  # split -> class folder names
    self.stray_files = [fs.join(root, f) for f in root_files]
    self.odd_entries = [(fs.join(root, f), reason) for f, reason in root_others]
    if layout == "classes":
      self.class_dirs[DEFAULT_SPLIT] = dirs
    else:
      for split in dirs:
        classes, files, others = below[split]
        self.class_dirs[split] = classes
        self.stray_files += [fs.join(root, split, f) for f in files]
        self.odd_entries += [(fs.join(root, split, f), reason) for f, reason in others]
    self.class_names = sorted({_inputs.printable(c) for cs in self.class_dirs.values() for c in cs})

  def folder(self, split: str, cls: str) -> str:
    return fs.join(self.root, cls) if self.layout == "classes" else fs.join(self.root, split, cls)

  def num_undecodable(self) -> int:
    """Launcher rejects and class folders whose names are not valid UTF-8."""
    names = [*self.stray_files, *(f for f, _ in self.odd_entries), *(c for cs in self.class_dirs.values() for c in cs)]
    return sum(1 for n in names if _inputs.printable(n) != n)

  def launcher_rejects(self) -> list[Reject]:
    """Files outside class folders and entries that are no file or folder."""
    return ([Reject(_inputs.printable(f), "not inside a class folder") for f in self.stray_files]
            + [Reject(_inputs.printable(f), reason) for f, reason in self.odd_entries])


class _ConvertImageFn(beam.DoFn):
  """((split, class name), InputFile) → Record, or a Reject naming the file and the reason."""

  REJECTS = "rejects"
  MULTI_FRAME = "multi_frame"  # paths of files whose first frame was kept, others dropped

  def __init__(self, root: str, class_names: Sequence[str], features: Features,
               image_options: _imaging.ImageOptions, read_policy: _inputs.ReadPolicy):
    self._root = _inputs.printable(root).rstrip("/") + "/"
    self._labels = {c: i for i, c in enumerate(class_names)}
    self._features = features
    self._image_options = image_options
    self._read_policy = read_policy

  def setup(self):
    self._read = Metrics.counter(PIPELINE, "images_read")
    self._bytes_read = Metrics.counter(PIPELINE, "bytes_read")
    self._rejected = Metrics.counter(PIPELINE, "images_rejected")
    self._converted = Metrics.counter(PIPELINE, "images_converted")
    self._multi_frame = Metrics.counter(PIPELINE, "images_multi_frame")
    self._n = 0
    self._t0 = self._last_log = time.monotonic()

  def _progress(self):
    self._n += 1
    now = time.monotonic()
    if now - self._last_log >= 10:
      self._last_log = now
      _log.info("converted %d images on this worker (%.0f/s)", self._n, self._n / (now - self._t0))

  def process(self, element):
    (split, class_name), f = element
    rel = f.path[len(self._root):]
    label = self._labels[class_name]
    self._read.inc()
    try:
      data = self._read_policy.read(f.location)
    except _inputs.Unreadable as e:  # the file's own fault; a transient error fails the job
      self._rejected.inc()
      yield beam.pvalue.TaggedOutput(self.REJECTS, Reject(f.path, str(e), split))
      return
    self._bytes_read.inc(len(data))
    try:
      image = _imaging.convert_image(data, self._image_options)
    except _imaging.BadImage as e:
      self._rejected.inc()
      yield beam.pvalue.TaggedOutput(self.REJECTS, Reject(f.path, str(e), split))
      return
    self._converted.inc()
    if image.multi_frame:
      self._multi_frame.inc()
      yield beam.pvalue.TaggedOutput(self.MULTI_FRAME, f.path)
    self._progress()
    payload = self._features.encode({"image": image.data, "label": label, "file_name": rel})
    yield Record(split, rel, payload)


def image_features(class_names: Sequence[str], options: _imaging.ImageOptions) -> Features:
  """The records' schema: `image` (JPEG, or raw uint8 HxWx3), `label`, `file_name`."""
  if options.encoding == "raw":
    image = Tensor(shape=(*options.size, 3), dtype="uint8")
  else:
    image = Image(shape=(*options.size, 3) if options.size else (None, None, 3), encoding="jpeg")
  return Features({"image": image, "label": ClassLabel(class_names), "file_name": Text()})


def multi_frame_warning(count: int) -> str:
  """The manifest warning for `count` files stored as their first frame only."""
  return f"{count} multi-frame image{'s' if count != 1 else ''}: first frame kept"


class _InputCounts(beam.CombineFn):
  """Events of the listing and the conversion → (files per (split, class), listing rejects,
  undecodable names, multi-frame files): one combine for all the input accounting."""

  def create_accumulator(self):
    return collections.Counter(), 0, 0, 0

  def add_input(self, acc, event):
    per_folder, rejects, undecodable, multi_frame = acc
    kind, key, is_undecodable = event
    if kind == "file":
      per_folder[key] += 1
    elif kind == "reject":
      rejects += 1
    else:
      multi_frame += 1
    return per_folder, rejects, undecodable + int(is_undecodable), multi_frame

  def merge_accumulators(self, accs):
    per_folder, totals = collections.Counter(), [0, 0, 0]
    for counts, *rest in accs:
      per_folder.update(counts)
      totals = [t + r for t, r in zip(totals, rest)]
    return (per_folder, *totals)

  def extract_output(self, acc):
    return dict(acc[0]), acc[1], acc[2], acc[3]


def _summarize_inputs(_, counts, folders, num_launcher_rejects, num_launcher_undecodable) -> InputSummary:
  """Entries found (files + listing rejects + launcher rejects), a warning per empty
  class folder, one for names that are not valid UTF-8 and one for multi-frame files."""
  per_folder, num_listing_rejects, num_undecodable, num_multi_frame = counts
  warnings = [f"empty class folder: {folder}" for split, cls, folder in folders if not per_folder.get((split, cls))]
  if num_undecodable + num_launcher_undecodable:
    warnings.append(_inputs.undecodable_warning(num_undecodable + num_launcher_undecodable))
  if num_multi_frame:
    warnings.append(multi_frame_warning(num_multi_frame))
  return InputSummary(sum(per_folder.values()) + num_listing_rejects + num_launcher_rejects, tuple(warnings))


def _parse(argv: Sequence[str] | None) -> tuple[PipelineOptions, dict]:
  """Validates every flag before anything is read or written; raises UsageError."""
  options = _cli.parse_options(argv, [ImageFolderOptions])
  c, o = options.view_as(_cli.ConverterOptions), options.view_as(ImageFolderOptions)
  root, output, overwrite = _cli.check_input_output(c.input, c.output, c.overwrite, "a folder of class folders")
  _cli.check_file_format(c.file_format)
  if o.layout not in ("auto", "classes", "splits"):
    raise _cli.UsageError(f"--layout must be auto, classes or splits, got {o.layout!r}")
  size = None
  if o.image_size:
    m = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*", o.image_size)
    if not m or min(int(m[1]), int(m[2])) <= 0:
      raise _cli.UsageError(f"--image_size must be H,W with positive integers, got {o.image_size!r}")
    size = (int(m[1]), int(m[2]))
    if max(size) > MAX_IMAGE_SIDE:
      raise _cli.UsageError(f"--image_size sides must be <= {MAX_IMAGE_SIDE}, got {o.image_size!r}")
  max_pixels = _cli.int_flag("max_image_pixels", o.max_image_pixels, 1)
  if o.encoding not in ("jpeg", "raw"):
    raise _cli.UsageError(f"--encoding must be jpeg or raw, got {o.encoding!r}")
  if o.encoding == "raw" and size is None:
    raise _cli.UsageError("--encoding=raw needs --image_size=H,W (raw pixels must have a fixed shape)")
  quality = _cli.int_flag("jpeg_quality", o.jpeg_quality, 1)
  if quality > 100:
    raise _cli.UsageError(f"--jpeg_quality must be in [1, 100], got {quality}")
  name = _cli.dataset_name(c.name, root)
  args = dict(
      root=root, output=output, name=name, file_format=c.file_format,
      num_shards=_cli.int_flag("num_shards", c.num_shards, 0), seed=_cli.int_flag("seed", c.seed, 0),
      image_options=_imaging.ImageOptions(size=size, encoding=o.encoding, jpeg_quality=quality,
                                          max_pixels=max_pixels),
      layout=o.layout, overwrite=overwrite,
      read_policy=_cli.read_policy(options),
  )
  return options, args


def build(p: beam.Pipeline, args: dict) -> beam.PCollection:
  """Adds the conversion to pipeline `p`; returns the PCollection of the manifest."""
  layout = _Layout(args["root"], args["layout"])
  if not layout.class_names:
    raise _cli.UsageError(f"--input {args['root']!r} holds no class folders")
  opts: _imaging.ImageOptions = args["image_options"]
  features = image_features(layout.class_names, opts)
  splits = tuple(sorted(layout.class_dirs))
  for s in splits:
    try:
      naming.check_split_name(s)
    except ValueError as e:
      raise _cli.UsageError(f"split folder: {e}") from None
  spec = OutputSpec(
      output=args["output"], name=args["name"], file_format=args["file_format"], features=features,
      splits=splits, num_shards=args["num_shards"], seed=args["seed"], generation=args.get("generation", ""), expected=args.get("expected"),
      description=f"Images from {_inputs.printable(args['root'])}, converted by {PIPELINE}.",
      source={
          "pipeline": PIPELINE, "input": _inputs.printable(args["root"]), "layout": layout.layout,
          "image_size": list(opts.size) if opts.size else None, "encoding": opts.encoding,
          "jpeg_quality": opts.jpeg_quality, "seed": args["seed"], "num_shards": args["num_shards"],
      },
  )
  folders = [(s, c, layout.folder(s, c)) for s in splits for c in layout.class_dirs[s]]
  listed = (
      p
      | "ClassFolders" >> beam.Create(
          [((s, _inputs.printable(c)), _inputs.InputFile.of(f)) for s, c, f in folders])
      | "ListFiles" >> _inputs.ListFiles(args["read_policy"].retry_seconds, input_root=layout.root)
  )
  files = listed.files | "Rebalance" >> beam.Reshuffle()
  converted = files | "Convert" >> beam.ParDo(
      _ConvertImageFn(layout.root, layout.class_names, features, opts, args["read_policy"])
  ).with_outputs(_ConvertImageFn.REJECTS, _ConvertImageFn.MULTI_FRAME, main="records")
  listing_rejects = listed.rejects | "ListingRejects" >> beam.MapTuple(
      lambda key, f, reason: Reject(f.path, reason, key[0]))
  counts = (
      (listed.files | "FileEvents" >> beam.MapTuple(lambda key, f: ("file", key, f.undecodable)),
       listed.rejects | "RejectEvents" >> beam.MapTuple(lambda key, f, reason: ("reject", key, f.undecodable)),
       converted[_ConvertImageFn.MULTI_FRAME] | "MultiFrameEvents" >> beam.Map(lambda _: ("multi_frame", None, False)))
      | "InputEvents" >> beam.Flatten()
      | "CountInputs" >> beam.CombineGlobally(_InputCounts())
  )
  launcher_rejects = layout.launcher_rejects()
  summary = (
      p
      | "SummaryTrigger" >> beam.Create([None])
      | "SummarizeInputs" >> beam.Map(
          _summarize_inputs, counts=beam.pvalue.AsSingleton(counts),
          num_launcher_undecodable=layout.num_undecodable(),
          folders=[(s, _inputs.printable(c), _inputs.printable(f)) for s, c, f in folders],
          num_launcher_rejects=len(launcher_rejects))
  )
  rejects = ((converted[_ConvertImageFn.REJECTS], listing_rejects) | "AllRejects" >> beam.Flatten())
  return {"records": converted.records, "rejects": rejects} | "Write" >> WriteOutput(
      spec, summary=summary, launcher_rejects=launcher_rejects
  )


def run(argv: Sequence[str] | None = None) -> beam.runners.runner.PipelineResult:
  """Parses flags, runs the conversion and waits for it; raises UsageError on bad flags."""
  options, args = _parse(argv)
  return _cli.run_pipeline(options, args, build, PIPELINE)


if __name__ == "__main__":
  _cli.main(run, PIPELINE)
