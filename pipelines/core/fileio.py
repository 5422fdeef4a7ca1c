"""Building a file locally and publishing it to the output (local or gs://) in one atomic step.

Whole small files (manifests, reject lists) are written with
`formats.storage.files.write_bytes`; this module adds what only the writers need:
building a shard locally (array_record cannot write to gs://,
google/array_record#120) and publishing it, so that a reader sees no file or
the complete file, never a partial one, and a retried or killed bundle cannot
leave a shard that looks whole. On GCS an object appears only when its upload
completes; locally the file is built beside its destination and renamed.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import os
import shutil
import tempfile

from apache_beam.io.filesystems import FileSystems

from formats.storage import files as fs

_COPY_CHUNK = 16 << 20


@contextlib.contextmanager
def staged(dest: str) -> Iterator[str]:
  """A local path for the block to build `dest` at, published to `dest` when the block ends (renamed onto a
  local `dest`, one upload to a gs:// one); when the block raises, nothing is published. The local file is
  removed either way.

      with fileio.staged(dest) as local:
        adapters.get("array_record").write_file(local, payloads)

  Raises:
    OSError: the rename, copy or upload failed.
  """
  if not fs.is_gcs(dest):
    with fs.replacing(dest) as local:
      yield local
    return
  tmpdir = tempfile.mkdtemp(prefix="toolkit-shards-")  # removed here: runners need not call teardown
  try:
    local = os.path.join(tmpdir, os.path.basename(dest))
    yield local
    with open(local, "rb") as src, FileSystems.create(dest, mime_type="application/octet-stream") as out:
      shutil.copyfileobj(src, out, _COPY_CHUNK)
  finally:
    shutil.rmtree(tmpdir, ignore_errors=True)
