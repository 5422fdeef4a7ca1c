"""ArrayRecord files as the toolkit writes them: one record per group.

`group_size:1` makes every record its own chunk, the unit of random access,
so grain's and TFDS's `ArrayRecordDataSource` can read any index without
decoding neighbours (the library logs an error for larger groups).
Records are stored uncompressed: the payloads are mostly JPEG or raw pixels,
which do not compress, and the reader on the TPU host should not pay for it.
ArrayRecord files are local paths only (google/array_record#120): callers
write locally and upload.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

from array_record.python import array_record_module

from formats._closing import Closing
from formats.errors import CorruptRecordError

WRITER_OPTIONS = "group_size:1,uncompressed"
# Reads of single records by index: nothing read ahead (the next record wanted is anywhere) and no
# thread pool of array_record's own (callers read from their own threads, each with its own reader:
# formats.outputs.output.SplitRecords), so a read is one pread, its chunk's hash check and one copy.
RANDOM_ACCESS_READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"


def write_file(path: str, records: Iterable[bytes]) -> int:
  """Writes `records` to a new local ArrayRecord file.

  Args:
    path: the local file to create.
    records: the payloads, in order.

  Returns:
    How many records were written.

  Raises:
    OSError: (array_record's error) the file could not be written completely.
  """
  writer = array_record_module.ArrayRecordWriter(path, WRITER_OPTIONS)
  n = 0
  try:
    for record in records:
      writer.write(record)
      n += 1
  finally:
    writer.close()  # raises on an I/O error: never leave a silently short file
  return n


def open_reader(path: str, random_access: bool = True):
  """An `ArrayRecordReader` over a local file.

  Args:
    path: a local file.
    random_access: read ahead nothing (for reads of single records).

  Returns:
    array_record's reader; the caller closes it.
  """
  options = RANDOM_ACCESS_READER_OPTIONS if random_access else ""
  return open_checked(path, options, path)


def open_checked(path: str, options: str, what: str):
  """array_record's reader over `path`, refused when it opens failed.

  A damaged file (a cut tail, a footer whose hash does not match) does not
  make the C++ constructor raise: the reader opens with ok() False and 0
  records, and raises its reason only on close() (measured with array_record
  0.8.6), so the file would look empty. Here it is a CorruptRecordError.

  Args:
    path: a local file.
    options: the reader's options string.
    what: how the message names the file.

  Raises:
    OSError: the file cannot be opened (FileNotFoundError when it is not there): not damage.
    CorruptRecordError: the reader refuses the file; the message gives its reason.
  """
  os.stat(path)  # the C++ reader reports a missing file as a RuntimeError, like damage
  try:
    reader = array_record_module.ArrayRecordReader(path, options)
  except Exception as e:  # the C++ reader's own error
    raise CorruptRecordError(f"{what}: the ArrayRecord reader refuses the file: {type(e).__name__}: {e}") from None
  if reader.ok():
    return reader
  try:
    reader.close()
    reason = "failed without a reason"
  except Exception as e:  # the C++ reader's own error
    reason = f"{type(e).__name__}: {e}"
  raise CorruptRecordError(f"{what}: the ArrayRecord reader refuses the file: {reason}")


def read_file(path: str, batch: int = 1024) -> Iterator[bytes]:
  """Yields every record of a local ArrayRecord file, in order.

  Args:
    path: a local file.
    batch: records read per call into the C++ reader.

  Yields:
    Each record's payload.
  """
  reader = open_reader(path, random_access=False)
  try:
    n = reader.num_records()
    for start in range(0, n, batch):
      yield from reader.read(start, min(n, start + batch))
  finally:
    reader.close()


def num_records(path: str) -> int:
  """The number of records of a local ArrayRecord file.

  Args:
    path: a local file.

  Returns:
    Its record count, from the file's footer.
  """
  reader = open_reader(path)
  try:
    return reader.num_records()
  finally:
    reader.close()


class RandomAccessReader(Closing):
  """Random access to the records of a local ArrayRecord file (array_record's reader, GIL released).

  Threads that read one file at the same time each open their own reader
  (formats.outputs.output.SplitRecords does), so that none waits on another's read.
  Closed when garbage-collected.

  Args:
    path: a local file.
  """

  def __init__(self, path: str):
    self.path = path
    self._reader = None
    self._reader = open_reader(path)
    self._n = self._reader.num_records()

  def __len__(self) -> int:
    return self._n

  def read(self, i: int) -> bytes:
    """See adapters.RandomAccessFile.read.

    Raises:
      CorruptRecordError: the C++ reader failed; the message names the file,
        the record and the reader's error.
    """
    if not 0 <= i < self._n:
      raise IndexError(f"{self.path}: record {i} outside [0, {self._n})")
    if self._reader is None:
      raise ValueError(f"{self.path}: read from a closed reader")
    try:
      return self._reader.read([i])[0]
    except Exception as e:  # the C++ reader's own error: name the file and record
      raise CorruptRecordError(f"{self.path}: record {i}: {type(e).__name__}: {e}") from None

  def close(self) -> None:
    """Closes the file; closing twice is fine."""
    if self._reader is not None:
      self._reader.close()
      self._reader = None
