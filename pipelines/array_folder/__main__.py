"""`python -m pipelines.array_folder --input=... --output=...`: see pipelines/array_folder/pipeline.py."""

from pipelines.core import launch
from pipelines.array_folder import CONVERTER

launch.main(CONVERTER)
