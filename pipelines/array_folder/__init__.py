"""Folders of NumPy `.npy` arrays → ArrayRecord or TFRecord shards: `python -m pipelines.array_folder` (docs/array_folder.md)."""

from pipelines.core import launch
from pipelines.array_folder.pipeline import ArrayFolder, ArrayFolderConfig, ArrayFolderOptions, load_array

CONVERTER = ArrayFolder()
run = launch.entry_point(CONVERTER)

__all__ = ["ArrayFolder", "ArrayFolderConfig", "ArrayFolderOptions", "CONVERTER", "load_array", "run"]
