"""Every error type of `formats`, in one module.

Each is a subclass of the built-in its callers already catch (`ValueError` for
bytes that are wrong, `FileNotFoundError` for a folder that is not an output,
`RuntimeError` for a lost commit), so `except ValueError` keeps working. The
modules that raise them re-export them under their old names
(`formats.tfrecord.TFRecordCorruptError` is `formats.errors.TFRecordCorruptError`).
"""

from __future__ import annotations

__all__ = [
    "CommitConflict",
    "CorruptRecordError",
    "ExampleDecodeError",
    "GraphBinError",
    "NotAnOutputError",
    "TFRecordCorruptError",
]


class CorruptRecordError(ValueError):
  """A record or shard whose bytes are wrong; the message names the shard and record."""


class TFRecordCorruptError(CorruptRecordError):
  """A TFRecord file whose framing or checksums are wrong; the message names the record and byte."""


class ExampleDecodeError(ValueError):
  """The bytes are not a well-formed tf.train.Example."""


class GraphBinError(ValueError):
  """A .graphbin file whose bytes are wrong; the message names the file, section and offset."""


class NotAnOutputError(FileNotFoundError):
  """A folder without `manifest.json`: not an output, or one whose run has not committed.

  The message is "<folder>/manifest.json not found: <folder> is not a complete output".
  """


class CommitConflict(RuntimeError):
  """Another run replaced the output after this run started; this run's output was not committed."""
