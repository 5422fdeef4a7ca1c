"""Image folders (ImageNet style) → ArrayRecord or TFRecord shards: `python -m pipelines.image_folder` (docs/image_folder.md)."""

from pipelines.core import launch
from pipelines.image_folder.imaging import BadImage, ImageOptions, convert_image
from pipelines.image_folder.pipeline import ImageFolder, ImageFolderConfig, ImageFolderOptions, image_features

CONVERTER = ImageFolder()
run = launch.entry_point(CONVERTER)

__all__ = ["BadImage", "CONVERTER", "ImageFolder", "ImageFolderConfig", "ImageFolderOptions", "ImageOptions",
           "convert_image", "image_features", "run"]
