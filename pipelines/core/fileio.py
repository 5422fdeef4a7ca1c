"""Publishing a finished local file to the output (local or gs://) in one atomic step.

Whole small files (manifests, reject lists) are written with
`formats.storage.files.write_bytes`; this module adds what only the writers need:
building a shard locally (array_record cannot write to gs://,
google/array_record#120) and publishing it, so that a reader sees no file or
the complete file, never a partial one, and a retried or killed bundle cannot
leave a shard that looks whole. On GCS an object appears only when its upload
completes; locally the file is built beside its destination and renamed.
"""

from __future__ import annotations

import os
import shutil
import uuid

from apache_beam.io.filesystems import FileSystems

from formats.storage import files as fs

_COPY_CHUNK = 16 << 20


def local_staging_path(dest: str, tmpdir: str) -> str:
  """Where to build `dest` locally before `publish`: beside it when local (no copy).

  Args:
    dest: the file's final path, local or gs://.
    tmpdir: the local folder for files bound for gs://.

  Returns:
    A fresh local path (a uuid in its name); a local `dest`'s folder is created.
  """
  if not fs.is_gcs(dest):
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    return f"{dest}.tmp-{uuid.uuid4().hex}"
  return os.path.join(tmpdir, f"{uuid.uuid4().hex}-{os.path.basename(dest)}")


def publish(local_path: str, dest: str) -> None:
  """Moves a finished local file to `dest` in one atomic step (one upload when remote).

  The local file is removed afterwards, also when the upload fails.

  Args:
    local_path: the finished file, from `local_staging_path`.
    dest: the final path, local or gs://.

  Raises:
    OSError: the rename, copy or upload failed.
  """
  if not fs.is_gcs(dest):
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    try:
      os.replace(local_path, dest)
    except OSError:  # another file system: copy beside the destination, then rename
      tmp = f"{dest}.tmp-{uuid.uuid4().hex}"
      shutil.copyfile(local_path, tmp)
      os.replace(tmp, dest)
      os.remove(local_path)
    return
  try:
    with open(local_path, "rb") as src, FileSystems.create(dest, mime_type="application/octet-stream") as out:
      shutil.copyfileobj(src, out, _COPY_CHUNK)
  finally:
    os.remove(local_path)
