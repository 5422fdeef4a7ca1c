"""The record file formats, one adapter each: the table every writer and reader goes through.

TFDS's `file_adapters.ADAPTER_FOR_FORMAT` is the model: a file format is an
entry here, and the names of the shards, the writer's `write_file`, the
sequential reader that checks a whole file and the random-access reader
follow from it. Adding a format means adding an adapter (and its codec
module); `naming.FILE_FORMATS` is derived from this table.

    adapter = adapters.get(manifest.file_format)
    adapter.write_file(local_path, payloads)
    with adapter.open_random(local_path) as f:
      record = f.read(3)
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Mapping
import types
from typing import ClassVar, Protocol, runtime_checkable

from formats import arrayrecord, tfrecord

__all__ = ["ADAPTERS", "ArrayRecordAdapter", "FileAdapter", "RandomAccessFile", "TFRecordAdapter", "get"]


@runtime_checkable
class RandomAccessFile(Protocol):
  """Records of one local file by index (what `FileAdapter.open_random` returns)."""

  path: str

  def __len__(self) -> int: ...

  def read(self, i: int) -> bytes:
    """Record `i`'s payload.

    Args:
      i: the record's index in the file, 0 <= i < len(self).

    Returns:
      The payload.

    Raises:
      IndexError: `i` is outside the file.
      CorruptRecordError: the record is damaged.
    """
    ...

  def close(self) -> None:
    """Closes the file; closing twice is fine."""
    ...

  def __enter__(self) -> RandomAccessFile: ...

  def __exit__(self, *exc) -> None: ...


class FileAdapter(abc.ABC):
  """One record file format: its name and how its files are written and read.

  Every path is a local file (ArrayRecord cannot read gs://: callers write
  locally and upload, and read a local copy).
  """

  name: ClassVar[str]  # as in manifest.json's "format" and in the shard names
  # Whether threads may share one `open_random` reader of a file (else each thread opens its own).
  shared_reads: ClassVar[bool] = False

  @property
  def suffix(self) -> str:
    """The part of a shard name that names the format (`cats-train.<suffix>-00000-of-00004`)."""
    return self.name

  @abc.abstractmethod
  def write_file(self, path: str, payloads: Iterable[bytes]) -> int:
    """Writes a new local file holding `payloads`, in order.

    Args:
      path: the local file to create (replaced if it exists).
      payloads: the records' bytes.

    Returns:
      How many records were written.
    """

  @abc.abstractmethod
  def read_file(self, path: str) -> Iterator[bytes]:
    """Yields every record of a local file in order, each checked as the format allows.

    Args:
      path: a local file.

    Yields:
      Each record's payload.

    Raises:
      CorruptRecordError: (TFRecord) framing or a checksum is wrong.
      Exception: (ArrayRecord) the C++ reader's error for a damaged file.
    """

  @abc.abstractmethod
  def open_random(self, path: str) -> RandomAccessFile:
    """Opens a local file for reading records by index.

    Args:
      path: a local file.

    Returns:
      A reader with `len()`, `read(i) -> bytes` and `close()` (also a context manager).

    Raises:
      CorruptRecordError: (TFRecord) the framing is damaged.
    """

  def num_records(self, path: str) -> int:
    """The number of records of a local file.

    Args:
      path: a local file.

    Returns:
      Its record count.
    """
    with self.open_random(path) as f:
      return len(f)

  def locate_damage(self, path: str) -> str | None:
    """The first damaged record of a local file, when the format can tell.

    Args:
      path: a local file.

    Returns:
      "record <i> ...: <reason>", or None when nothing is found (or the format
      has no per-record checksums).
    """
    del path
    return None

  def __repr__(self) -> str:
    return f"{type(self).__name__}()"


class ArrayRecordAdapter(FileAdapter):
  """ArrayRecord (formats.arrayrecord): one record per chunk, uncompressed, random access."""

  name = "array_record"

  def write_file(self, path: str, payloads: Iterable[bytes]) -> int:
    """See FileAdapter.write_file."""
    return arrayrecord.write_file(path, payloads)

  def read_file(self, path: str) -> Iterator[bytes]:
    """See FileAdapter.read_file."""
    return arrayrecord.read_file(path)

  def open_random(self, path: str) -> arrayrecord.RandomAccessReader:
    """See FileAdapter.open_random."""
    return arrayrecord.RandomAccessReader(path)


class TFRecordAdapter(FileAdapter):
  """TFRecord (formats.tfrecord): CRC-framed records, read by index through an offset index."""

  name = "tfrecord"
  shared_reads = True  # os.pread on one descriptor; the index is built once per file

  def write_file(self, path: str, payloads: Iterable[bytes]) -> int:
    """See FileAdapter.write_file."""
    with open(path, "wb") as f:
      return tfrecord.write_records(f, payloads)

  def read_file(self, path: str) -> Iterator[bytes]:
    """See FileAdapter.read_file."""
    return tfrecord.read_file(path)

  def open_random(self, path: str) -> tfrecord.IndexedReader:
    """See FileAdapter.open_random."""
    return tfrecord.IndexedReader(path)

  def num_records(self, path: str) -> int:
    """See FileAdapter.num_records."""
    return len(tfrecord.index(path)[0])

  def locate_damage(self, path: str) -> str | None:
    """See FileAdapter.locate_damage."""
    return tfrecord.locate_damage(path)


# Every record file format by name, the default (random access) first.
ADAPTERS: Mapping[str, FileAdapter] = types.MappingProxyType(
    {a.name: a for a in (ArrayRecordAdapter(), TFRecordAdapter())})


def get(file_format: str) -> FileAdapter:
  """The adapter of a record file format.

  Args:
    file_format: a name in `ADAPTERS` ("array_record", "tfrecord").

  Returns:
    Its `FileAdapter`.

  Raises:
    ValueError: `file_format` is not a record file format.
  """
  try:
    return ADAPTERS[file_format]
  except KeyError:
    raise ValueError(f"file format must be one of {tuple(ADAPTERS)}, got {file_format!r}") from None
