"""DICOM CT series → Hounsfield-unit 3D volumes in shards: `python -m pipelines.ct_volumes` (docs/ct_volumes.md)."""

from pipelines.core import launch
from pipelines.ct_volumes.pipeline import (
    CtVolumes, CtVolumesConfig, CtVolumesOptions, parse_splits, split_of, volume_features)

CONVERTER = CtVolumes()
run = launch.entry_point(CONVERTER)

__all__ = ["CONVERTER", "CtVolumes", "CtVolumesConfig", "CtVolumesOptions", "parse_splits", "run", "split_of",
           "volume_features"]
