"""The on-disk layouts of the toolkit: shard names, records, manifest, metadata.

The bottom layer: plain Python, numpy and array_record's module; no Beam,
TensorFlow or torch, so that every writer and reader can build on it.

    import formats

    out = formats.open_output("gs://bucket/flowers")   # manifest, kind, shards, local copies
    records = out.open_records("train")
    example = out.features.decode(records.read(0))

The package's top level holds the codecs and layouts: `errors` (every error
type), `protowire` (the protobuf wire format, walked in place), `example`
and `features` (records as tf.train.Example), `kinds` (record kinds),
`tfrecord`, `arrayrecord`, `arrayrecord_index` (an ArrayRecord file's
records by ranged reads) and `adapters` (the file formats), `naming` (shard
names), `manifest`, `tfds_metadata`, `graphbin` and `transforms` (the
loaders' shared specification). `storage/` holds local and gs:// bytes:
`files`, `gcs_media`, `gcs_download` and `retry`. `outputs/` holds an output
folder's life: `commit` (how a run publishes an output and how long replaced
generations stay), `leases` (readers' holds on a generation), `output`
(opening an output), `integrity` (checks of local copies) and `inspect` (the
command line).
"""

from formats.errors import (CommitConflict, CorruptRecordError, ExampleDecodeError, GraphBinError,
                            NotAnOutputError, TFRecordCorruptError)
from formats.example import decode_example, encode_example
from formats.features import ClassLabel, Features, Image, Tensor, Text
from formats.kinds import KINDS, RecordKind
from formats.manifest import MANIFEST_FILENAME, FileInfo, Manifest, Rejected, ShardInfo, SplitInfo
from formats.naming import FILE_FORMATS, ShardName
from formats.outputs.leases import LeaseError
from formats.outputs.output import Output, SplitRecords, is_output, load_manifest, open_output

__all__ = [
    "FILE_FORMATS",
    "KINDS",
    "LeaseError",
    "MANIFEST_FILENAME",
    "ClassLabel",
    "CommitConflict",
    "CorruptRecordError",
    "ExampleDecodeError",
    "Features",
    "FileInfo",
    "GraphBinError",
    "Image",
    "Manifest",
    "NotAnOutputError",
    "Output",
    "RecordKind",
    "Rejected",
    "ShardInfo",
    "ShardName",
    "SplitInfo",
    "SplitRecords",
    "TFRecordCorruptError",
    "Tensor",
    "Text",
    "decode_example",
    "encode_example",
    "is_output",
    "load_manifest",
    "open_output",
]
