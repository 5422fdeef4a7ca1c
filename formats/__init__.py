"""The on-disk layouts of the toolkit: shard names, records, manifest, metadata.

The bottom layer: plain Python, numpy and array_record's module; no Beam,
TensorFlow or torch, so that every writer and reader can build on it.
"""

from formats.example import ExampleDecodeError, decode_example, encode_example
from formats.features import ClassLabel, Features, Image, Tensor, Text
from formats.manifest import MANIFEST_FILENAME, Manifest, ShardInfo, SplitInfo
from formats.naming import FILE_FORMATS, ShardName

__all__ = [
    "FILE_FORMATS",
    "MANIFEST_FILENAME",
    "ClassLabel",
    "ExampleDecodeError",
    "Features",
    "Image",
    "Manifest",
    "ShardInfo",
    "ShardName",
    "SplitInfo",
    "Tensor",
    "Text",
    "decode_example",
    "encode_example",
]
