"""DICOM CT series → Hounsfield-unit 3D volumes in shards: `python -m pipelines.ct_volumes`.

`run(argv)` is the programmatic entry point (the same flags); `CONVERTER` is
the converter object the registry, Airflow and the tests use. docs/ct_volumes.md.
"""

from collections.abc import Sequence

from apache_beam.runners.runner import PipelineResult

from pipelines.core import launch
from pipelines.ct_volumes.pipeline import CtVolumes, CtVolumesConfig, CtVolumesOptions, parse_splits, split_of, volume_features

CONVERTER = CtVolumes()


def run(argv: Sequence[str] | None = None) -> PipelineResult:
  """Runs the conversion with command-line flags and waits for it.

  Raises:
    UsageError: a bad flag (nothing was written).
  """
  return launch.run(CONVERTER, argv)


__all__ = ["CONVERTER", "CtVolumes", "CtVolumesConfig", "CtVolumesOptions", "parse_splits", "run", "split_of",
           "volume_features"]
