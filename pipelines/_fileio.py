"""File operations of the pipelines, through Beam's FileSystems (local, gs://, ...).

Every write is atomic: a reader sees no file or the complete file, never a
partial one, so a retried or killed bundle cannot leave a shard that looks
whole. On GCS an object appears only when its upload completes; locally we
write a temporary sibling and `os.replace` it.
"""

from __future__ import annotations

import os
import shutil
import uuid

from apache_beam.io.filesystems import FileSystems


_COPY_CHUNK = 16 << 20


def _use_anonymous_gcs_for_emulator() -> None:
  """With STORAGE_EMULATOR_HOST set (tests, local development), talk to the
  emulator anonymously. Beam otherwise looks for Google credentials first and
  retries with back-off for about 25 s per process before giving up."""
  if not os.environ.get("STORAGE_EMULATOR_HOST"):
    return
  from apache_beam.internal.gcp import auth

  with auth._Credentials._credentials_lock:
    auth._Credentials._credentials = None
    auth._Credentials._credentials_init = True


# Runs wherever the pipelines' code is loaded: the launcher and every worker
# process that unpickles one of our DoFns.
_use_anonymous_gcs_for_emulator()


def is_local(path: str) -> bool:
  return FileSystems.get_scheme(path) in (None, "file")


def join(base: str, *parts: str) -> str:
  return FileSystems.join(base, *parts)


def local_staging_path(dest: str, tmpdir: str) -> str:
  """Where to build `dest` locally before `publish`: beside it when local (no copy)."""
  if is_local(dest):
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    return f"{dest}.tmp-{uuid.uuid4().hex}"
  return os.path.join(tmpdir, f"{uuid.uuid4().hex}-{os.path.basename(dest)}")


def publish(local_path: str, dest: str) -> None:
  """Moves a finished local file to `dest` in one atomic step (one upload when remote)."""
  if is_local(dest):
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


def write_bytes(path: str, data: bytes) -> None:
  if is_local(path):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  else:
    with FileSystems.create(path, mime_type="application/octet-stream") as f:
      f.write(data)
