"""TFDS metadata for an output, so `tfds.builder_from_directory(output)` loads it.

The files are the ones `tfds.folder_dataset.write_metadata` produces
(`dataset_info.json`, `features.json`, `<feature>.labels.txt`), generated here
from a `Manifest` without importing TensorFlow.
"""

from __future__ import annotations

import json
import posixpath

from formats import naming
from formats.features import ClassLabel
from formats.manifest import Manifest

DATASET_INFO_FILENAME = "dataset_info.json"
FEATURES_FILENAME = "features.json"
VERSION = "1.0.0"


def _dataset_info(manifest: Manifest, description: str) -> dict:
  folders = {posixpath.dirname(s.path) for split in manifest.splits.values() for s in split.shards}
  if len(folders) > 1:
    raise ValueError(f"shards of one output lie in several folders: {sorted(folders)}")
  folder = folders.pop() if folders else ""
  template = naming.tfds_template(folder)
  splits = [
      {
          "filepathTemplate": template,
          "name": name,
          "numBytes": str(split.num_bytes),
          "shardLengths": [str(n) for n in split.shard_lengths],
      }
      for name, split in sorted(manifest.splits.items())
      if split.num_records  # TFDS cannot open a split without records; pipelines list none
  ]
  return {
      "description": description,
      "fileFormat": manifest.file_format,
      "name": manifest.name,
      "splits": splits,
      "version": VERSION,
  }


def metadata_files(manifest: Manifest, description: str = "") -> dict[str, bytes]:
  """{relative path: content} of every TFDS metadata file for `manifest`.

  Args:
    manifest: the committed manifest of a record output.
    description: the data set description for dataset_info.json.

  Returns:
    The files' paths relative to the output root, and their bytes.

  Raises:
    ValueError: the shards lie in more than one folder.
  """
  files = {
      DATASET_INFO_FILENAME: json.dumps(_dataset_info(manifest, description), indent=2).encode(),
      FEATURES_FILENAME: json.dumps(manifest.features.to_tfds(), indent=4).encode(),
  }
  for key, feature in manifest.features.items():
    if isinstance(feature, ClassLabel):
      files[f"{key}.labels.txt"] = "".join(n + "\n" for n in feature.names).encode("utf-8")
  return files
