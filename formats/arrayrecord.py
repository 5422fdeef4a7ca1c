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

from collections.abc import Iterable, Iterator

from array_record.python import array_record_module

WRITER_OPTIONS = "group_size:1,uncompressed"
RANDOM_ACCESS_READER_OPTIONS = "readahead_buffer_size:0"


def write_file(path: str, records: Iterable[bytes]) -> int:
  """Writes `records` to a new local ArrayRecord file; returns how many."""
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
  """An `ArrayRecordReader` over a local file."""
  options = RANDOM_ACCESS_READER_OPTIONS if random_access else ""
  return array_record_module.ArrayRecordReader(path, options)


def read_file(path: str, batch: int = 1024) -> Iterator[bytes]:
  """Yields every record of a local ArrayRecord file, in order."""
  reader = open_reader(path, random_access=False)
  try:
    n = reader.num_records()
    for start in range(0, n, batch):
      yield from reader.read(start, min(n, start + batch))
  finally:
    reader.close()


def num_records(path: str) -> int:
  reader = open_reader(path)
  try:
    return reader.num_records()
  finally:
    reader.close()
