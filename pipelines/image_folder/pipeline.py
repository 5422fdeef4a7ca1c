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

import dataclasses
import logging
import time

from apache_beam.options.pipeline_options import PipelineOptions

from formats.features import ClassLabel, Features, Image, Tensor, Text
from pipelines.core import flags, inputs
from pipelines.core.converter import Converter, Found, OutputPlan, Sources, UnitConverter, appended_feature, counters
from pipelines.core.errors import UsageError, usage_errors
from pipelines.core.flags import CommonConfig
from pipelines.core.records import Event, Record, Reject
from pipelines.core.shards import ListedFile, PlanUnit
from pipelines.image_folder import imaging
from pipelines.image_folder.layout import InputLayout

NAME = "image_folder"
PIPELINE = f"pipelines.{NAME}"
_log = logging.getLogger(PIPELINE)


class ImageFolderOptions(PipelineOptions):
  """Flags of `pipelines.image_folder` beyond the shared ones (`core.flags.ConverterOptions`)."""

  @classmethod
  def _add_argparse_args(cls, parser):
    parser.add_argument("--image_size", type=flags.positive_ints("H,W", 2), default=None,
                        help="Resize (keep aspect) and center-crop to this size; default: each image's own size.")
    parser.add_argument("--encoding", default="jpeg", choices=("jpeg", "raw"),
                        help="jpeg, or raw (uint8 HxWx3; needs --image_size).")
    parser.add_argument("--jpeg_quality", type=flags.integer(1, 100), default=95,
                        help="JPEG quality when images are re-encoded.")
    parser.add_argument("--layout", default="auto", choices=("auto", "classes", "splits"),
                        help="auto, classes (<class>/<files>) or splits (<split>/<class>/<files>).")
    parser.add_argument("--max_image_pixels", type=flags.integer(1), default=imaging.MAX_PIXELS,
                        help="Reject images with more pixels (width x height) than this, from their header, "
                             "before decoding.")


@dataclasses.dataclass(frozen=True)
class ImageFolderConfig:
  """The image converter's own flags, checked."""

  image: imaging.ImageOptions
  layout: str = "auto"  # auto, classes or splits

  def __post_init__(self):
    if self.layout not in ("auto", "classes", "splits"):
      raise ValueError(f"--layout must be auto, classes or splits, got {self.layout!r}")


class _ImageUnits(UnitConverter):
  """((split, class name), InputFile) → a Record, or a Reject naming the file and the reason."""

  def __init__(self, root: str, class_names, features: Features, image_options: imaging.ImageOptions,
               read_policy: inputs.ReadPolicy):
    self._root = inputs.printable(root).rstrip("/") + "/"
    self._labels = {c: i for i, c in enumerate(class_names)}
    self._features = features
    self._image_options = image_options
    self._read_policy = read_policy

  def setup(self):
    self._count = counters(PIPELINE, "images_read", "bytes_read", "images_rejected", "images_converted",
                           "images_multi_frame")
    self._n = 0
    self._t0 = self._last_log = time.monotonic()

  def _progress(self):
    self._n += 1
    now = time.monotonic()
    if now - self._last_log >= 10:
      self._last_log = now
      _log.info("converted %d images on this worker (%.0f/s)", self._n, self._n / (now - self._t0))

  def input_paths(self, unit):
    return [unit[1].location]

  def convert(self, unit):
    (split, class_name), f = unit
    rel = f.path[len(self._root):]
    self._count.images_read.inc()
    try:
      data = self._read_policy.read(f.location)  # the file's own fault is a reject; a transient error fails the job
      self._count.bytes_read.inc(len(data))
      image = imaging.convert_image(data, self._image_options)
    except (inputs.Unreadable, imaging.BadImage) as e:
      self._count.images_rejected.inc()
      yield Reject(f.path, str(e), split)
      return
    self._count.images_converted.inc()
    if image.multi_frame:
      self._count.images_multi_frame.inc()
    self._progress()
    payload = self._features.encode({"image": image.data, "label": self._labels[class_name], "file_name": rel})
    if image.multi_frame:
      yield Event("multi_frame")
    yield Record(split, rel, payload)


def image_features(class_names: list[str] | tuple[str, ...], options: imaging.ImageOptions) -> Features:
  """The records' schema: `image` (JPEG, or raw uint8 HxWx3), `label`, `file_name`.

  Args:
    class_names: the label names, sorted (label i is class_names[i]).
    options: the image size and encoding.

  Returns:
    The `Features`.
  """
  if options.encoding == "raw":
    image = Tensor(shape=(*options.size, 3), dtype="uint8")
  else:
    image = Image(shape=(*options.size, 3) if options.size else (None, None, 3), encoding="jpeg")
  return Features({"image": image, "label": ClassLabel(class_names), "file_name": Text()})


def multi_frame_warning(count: int) -> str:
  """The manifest warning for `count` files stored as their first frame only.

  Args:
    count: how many multi-frame files were converted.

  Returns:
    The warning, one line.
  """
  return f"{count} multi-frame image{'s' if count != 1 else ''}: first frame kept"


class ImageFolder(Converter, name=NAME, kind="image", options=ImageFolderOptions,
                  input_kind="a folder of class folders"):
  """Image folders (ImageNet style) → shards of (image, label, file_name) records."""

  def configure(self, o: ImageFolderOptions, common: CommonConfig) -> ImageFolderConfig:
    """See Converter.configure: the flags must go together (no raw encoding without a size), and no side of
    --image_size may be larger than `imaging.MAX_IMAGE_SIDE`."""
    with usage_errors():
      return ImageFolderConfig(
          image=imaging.ImageOptions(size=o.image_size.values if o.image_size else None, encoding=o.encoding,
                                     jpeg_quality=o.jpeg_quality, max_pixels=o.max_image_pixels),
          layout=o.layout)

  def plan(self, common: CommonConfig, config: ImageFolderConfig) -> OutputPlan:
    """See Converter.plan. Its `state` is the `InputLayout` (splits and class folders).

    Args:
      common: its `input` is listed (two levels at most).
      config: the layout and the image options.

    Raises:
      UsageError: no class folders, or a split folder's name is not a valid split name.
    """
    layout = InputLayout(common.input, config.layout)
    if not layout.class_names:
      raise UsageError(f"--input {common.input!r} holds no class folders")
    label = appended_feature(common, "label", ClassLabel, "image output (no class label feature)")
    if label is not None:  # label ids never change: new classes come last
      layout.class_names = [*label.names, *sorted(set(layout.class_names) - set(label.names))]
    splits = tuple(inputs.split_folder(s) for s in sorted(layout.class_dirs))
    opts = config.image
    return OutputPlan(
        features=image_features(layout.class_names, opts), splits=splits,
        description=f"Images from {inputs.printable(common.input)}, converted by {PIPELINE}.",
        source={
            "pipeline": PIPELINE, "input": inputs.printable(common.input), "layout": layout.layout,
            "image_size": list(opts.size) if opts.size else None, "encoding": opts.encoding,
            "jpeg_quality": opts.jpeg_quality, "seed": common.seed, "num_shards": common.num_shards,
        },
        launcher_rejects=tuple(layout.launcher_rejects()),
        state=layout,
    )

  def sources(self, common: CommonConfig, config: ImageFolderConfig, plan: OutputPlan) -> Sources:
    """See Converter.sources: every class folder, keyed (split, class name)."""
    layout: InputLayout = plan.state
    return Sources(folders=[((s, inputs.printable(c)), layout.folder(s, c)) for s in plan.splits
                            for c in layout.class_dirs[s]], root=layout.root)

  def plan_unit(self, config: ImageFolderConfig, listed: ListedFile) -> PlanUnit:
    """See Converter.plan_unit: the file is the unit, estimated at its converted size (`_estimated_bytes`)."""
    return PlanUnit(listed.split, listed.rel, (listed.key, listed.file), _estimated_bytes(listed.size, config.image))

  def unit_converter(self, common: CommonConfig, config: ImageFolderConfig, plan: OutputPlan) -> UnitConverter:
    """See Converter.unit_converter: one image file → its record, or a reject."""
    layout: InputLayout = plan.state
    return _ImageUnits(layout.root, layout.class_names, plan.features, config.image, common.read_policy)

  def warnings(self, config: ImageFolderConfig, plan: OutputPlan, found: Found) -> list[str]:
    """See Converter.warnings: empty class folders, names that are not UTF-8 (the launcher's too), and
    multi-frame files (first frame kept)."""
    layout: InputLayout = plan.state
    out = [f"empty class folder: {inputs.printable(layout.folder(s, c))}" for s in plan.splits
           for c in layout.class_dirs[s] if not found.per_key.get((s, inputs.printable(c)))]
    undecodable = found.undecodable + layout.num_undecodable()
    if undecodable:
      out.append(inputs.undecodable_warning(undecodable))
    if found.events.get("multi_frame"):
      out.append(multi_frame_warning(found.events["multi_frame"]))
    return out


def _estimated_bytes(size: int, options: imaging.ImageOptions) -> int:
  """A record's output bytes, estimated from its file's size (for the automatic shard count).

  Raw pixels are exact; a JPEG resized to HxW is taken as about a fifth of its raw pixels
  (quality 95 on photographs), and never more than the file; otherwise the file's size.
  """
  if options.size is None:
    return size
  raw = options.size[0] * options.size[1] * 3
  return raw + 64 if options.encoding == "raw" else min(size, raw // 5)
