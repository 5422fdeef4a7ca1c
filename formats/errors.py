"""Every error type of `formats`, in one module.

Each is a subclass of the built-in its callers already catch (`ValueError` for
bytes that are wrong, `FileNotFoundError` for a folder that is not an output,
`RuntimeError` for a lost commit), so `except ValueError` works. The modules
that raise them also export them (`formats.tfrecord.TFRecordCorruptError` is
`formats.errors.TFRecordCorruptError`).
"""

from __future__ import annotations

__all__ = [
    "CommitConflict",
    "CorruptRecordError",
    "ExampleDecodeError",
    "GraphBinError",
    "NotAnOutputError",
    "TFRecordCorruptError",
    "WireFormatError",
]


class CorruptRecordError(ValueError):
  """A record or shard whose bytes are wrong; the message names the shard and record."""


class TFRecordCorruptError(CorruptRecordError):
  """A TFRecord file whose framing or checksums are wrong; the message names the record and byte."""


class ExampleDecodeError(ValueError):
  """The bytes are not a well-formed tf.train.Example."""


class WireFormatError(ValueError):
  """Bytes that are not protobuf wire format (formats.protowire); callers re-raise it as their own error.

  Attributes:
    field: the number of the field whose value runs past its message, or
      whose wire type is unsupported; None when a varint is malformed.
    wire_type: the unsupported wire type (3, 4, 6, 7), else None.
  """

  def __init__(self, message: str, field: int | None = None, wire_type: int | None = None):
    super().__init__(message)
    self.field = field
    self.wire_type = wire_type


class GraphBinError(ValueError):
  """A .graphbin file whose bytes are wrong; the message names the file, section and offset."""


class NotAnOutputError(FileNotFoundError):
  """A folder without `manifest.json`: not an output, or one whose run has not committed.

  The message is "<folder>/manifest.json not found: <folder> is not a complete output".
  """


class CommitConflict(RuntimeError):
  """Another run replaced the output after this run started; this run's output was not committed."""
