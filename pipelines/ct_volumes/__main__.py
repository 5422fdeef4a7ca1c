"""`python -m pipelines.ct_volumes --input=... --output=...`: see pipelines/ct_volumes/pipeline.py."""

from pipelines.core import launch
from pipelines.ct_volumes import CONVERTER

launch.main(CONVERTER)
