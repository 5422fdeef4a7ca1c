"""Folders of NumPy `.npy` arrays → ArrayRecord or TFRecord shards: `python -m pipelines.array_folder`.

`run(argv)` is the programmatic entry point (the same flags); `CONVERTER` is
the converter object the registry, Airflow and the tests use. docs/array_folder.md.
"""

from collections.abc import Sequence

from apache_beam.runners.runner import PipelineResult

from pipelines.array_folder.pipeline import ArrayFolder, ArrayFolderConfig, ArrayFolderOptions, load_array
from pipelines.core import launch

CONVERTER = ArrayFolder()


def run(argv: Sequence[str] | None = None) -> PipelineResult:
  """Runs the conversion with command-line flags and waits for it.

  Raises:
    UsageError: a bad flag (nothing was written).
  """
  return launch.run(CONVERTER, argv)


__all__ = ["ArrayFolder", "ArrayFolderConfig", "ArrayFolderOptions", "CONVERTER", "load_array", "run"]
