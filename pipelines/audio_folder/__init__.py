"""Folders of WAV clips → ArrayRecord or TFRecord shards of fixed-length audio: `python -m pipelines.audio_folder`
(docs/audio_folder.md)."""

from pipelines.audio_folder.pipeline import AudioFolder, AudioFolderConfig, AudioFolderOptions, read_clip
from pipelines.core import launch

CONVERTER = AudioFolder()
run = launch.entry_point(CONVERTER)

__all__ = ["AudioFolder", "AudioFolderConfig", "AudioFolderOptions", "CONVERTER", "read_clip", "run"]
