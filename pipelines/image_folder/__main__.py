"""`python -m pipelines.image_folder --input=... --output=...`: see pipelines/image_folder/pipeline.py."""

from pipelines.core import launch
from pipelines.image_folder import CONVERTER

launch.main(CONVERTER)
