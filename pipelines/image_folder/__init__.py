"""Image folders (ImageNet style) → ArrayRecord or TFRecord shards: `python -m pipelines.image_folder`.

`run(argv)` is the programmatic entry point (the same flags); `CONVERTER` is
the converter object the registry, Airflow and the tests use. docs/image_folder.md.
"""

from collections.abc import Sequence

from apache_beam.runners.runner import PipelineResult

from pipelines.core import launch
from pipelines.image_folder.imaging import BadImage, ImageOptions, convert_image
from pipelines.image_folder.pipeline import ImageFolder, ImageFolderConfig, ImageFolderOptions, image_features

CONVERTER = ImageFolder()


def run(argv: Sequence[str] | None = None) -> PipelineResult:
  """Runs the conversion with command-line flags and waits for it.

  Raises:
    UsageError: a bad flag (nothing was written).
  """
  return launch.run(CONVERTER, argv)


__all__ = ["BadImage", "CONVERTER", "ImageFolder", "ImageFolderConfig", "ImageFolderOptions", "ImageOptions",
           "convert_image", "image_features", "run"]
