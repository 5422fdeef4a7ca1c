"""`python -m pipelines.audio_folder --input=... --output=...`: see pipelines/audio_folder/pipeline.py."""

from pipelines.audio_folder import CONVERTER
from pipelines.core import launch

launch.main(CONVERTER)
