"""Reading and writing output files on a local disk or in `gs://`, without Beam.

The pipelines move data through Beam's `FileSystems`; readers (loaders,
`formats.outputs.inspect`) must not depend on Beam, so they use this small layer:
local paths through `os`, `gs://` through google-cloud-storage, which honours
`STORAGE_EMULATOR_HOST` (then with anonymous credentials) for tests. Every
gs:// request is retried on transient errors by the process's retry policy
(`formats.storage.retry.default()`, passed as `retry=`), naming the object when
it gives up.

Every path and folder a function here takes is local or gs:// unless its
docstring says otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import functools
import os
import shutil
import stat
import tempfile
import uuid

from formats.storage import retry


def is_gcs(path: str) -> bool:
  """Whether `path` is a gs:// path."""
  return path.startswith("gs://")


def join(base: str, *parts: str) -> str:
  """`base` joined with `parts`: by '/' for gs://, by os.path.join locally.

  Args:
    base: a folder.
    *parts: relative parts.

  Returns:
    The joined path.
  """
  if is_gcs(base):
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
  return os.path.join(base, *parts)


def split_gcs(path: str) -> tuple[str, str]:
  """gs://bucket/name → (bucket, name).

  Args:
    path: a gs:// path.

  Returns:
    (bucket, object name).

  Raises:
    ValueError: the path names no bucket.
  """
  bucket, _, name = path[len("gs://"):].partition("/")
  if not bucket:
    raise ValueError(f"{path!r} names no bucket")
  return bucket, name


@functools.lru_cache(maxsize=1)
def _gcs_client():
  from google.cloud import storage  # the one heavy import, only for gs:// paths

  if os.environ.get("STORAGE_EMULATOR_HOST"):
    from google.auth.credentials import AnonymousCredentials

    return storage.Client(project="emulator", credentials=AnonymousCredentials())
  return storage.Client()  # its requests session keeps 10 connections: ranged reads go through gcs_media instead


def gcs_client():
  """The process's google-cloud-storage client (anonymous against STORAGE_EMULATOR_HOST).

  Returns:
    The client.
  """
  return _gcs_client()


def gcs_blob(path: str):
  """The google-cloud-storage Blob of a gs:// path (for conditional operations).

  Args:
    path: a gs:// path.

  Returns:
    Its Blob (nothing is fetched).
  """
  bucket, name = split_gcs(path)
  return _gcs_client().bucket(bucket).blob(name)


def _listing(folder: str, **kw):
  """The objects under the gs:// prefix `folder/` (the bucket's whole listing for gs://bucket), `kw` passed on."""
  bucket, name = split_gcs(folder)
  prefix = name.rstrip("/") + "/" if name else ""
  return prefix, _gcs_client().list_blobs(bucket, prefix=prefix, retry=retry.named(f"listing {folder}"), **kw)


def gcs_not_found() -> type[Exception]:
  """google-cloud-storage's NotFound exception class (imported only when needed).

  Returns:
    The class.
  """
  from google.api_core.exceptions import NotFound

  return NotFound


def gcs_precondition_failed() -> type[Exception]:
  """google-cloud-storage's PreconditionFailed exception class (imported only when needed).

  Returns:
    The class.
  """
  from google.api_core.exceptions import PreconditionFailed

  return PreconditionFailed


def exists(path: str) -> bool:
  """Whether the file `path` exists."""
  if is_gcs(path):
    return gcs_blob(path).exists(retry=retry.named(path))
  return os.path.exists(path)


def is_dir(path: str) -> bool:
  """Whether `path` is a local folder, or a gs:// prefix holding at least one object."""
  if is_gcs(path):
    return any(True for _ in _listing(path, max_results=1)[1])
  return os.path.isdir(path)


def read_bytes(path: str) -> bytes:
  """The whole file's content; FileNotFoundError when there is no such file."""
  if is_gcs(path):
    try:
      return gcs_blob(path).download_as_bytes(retry=retry.named(path))
    except gcs_not_found():
      raise FileNotFoundError(path) from None
  with open(path, "rb") as f:
    return f.read()


def read_small(path: str, limit: int) -> tuple[bytes | None, float]:
  """(content, modification time) of a regular file of at most `limit` bytes; (None, mtime) for anything
  else (larger, a link, a FIFO, a device): what a reader of untrusted small files (markers, leases,
  records) needs, so that no such file can make it block or read gigabytes.

  Args:
    path: the file.
    limit: the largest content read.

  Returns:
    (the bytes or None, the modification time as a POSIX timestamp).

  Raises:
    FileNotFoundError: there is no such file.
  """
  if is_gcs(path):
    blob, policy = gcs_blob(path), retry.named(path)
    try:
      blob.reload(retry=policy)
      if (blob.size or 0) > limit:
        return None, blob.updated.timestamp()
      return blob.download_as_bytes(if_generation_match=blob.generation, retry=policy), blob.updated.timestamp()
    except gcs_not_found():
      raise FileNotFoundError(path) from None
  try:  # no link followed, no FIFO waited on: the file is judged by what was opened
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
  except OSError as e:
    if isinstance(e, FileNotFoundError):
      raise
    return None, os.stat(path, follow_symlinks=False).st_mtime  # a link (ELOOP), or unreadable
  with os.fdopen(fd, "rb") as f:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
      return None, st.st_mtime
    data = f.read(limit + 1)
    return (data if len(data) <= limit else None), st.st_mtime


def write_bytes(path: str, data: bytes) -> None:
  """Writes a whole file atomically: a reader sees the old file or the new one.

  Args:
    path: the file (local folders are created).
    data: the whole content.
  """
  if is_gcs(path):  # a GCS object appears only when complete; a retry uploads the same bytes again
    gcs_blob(path).upload_from_string(data, retry=retry.named(path))
    return
  with replacing(path) as tmp, open(tmp, "wb") as f:
    f.write(data)


def temp_beside(path: str) -> str:
  """A fresh local path beside the local `path` (`<path>.tmp-<uuid>`; the folder is created): a file built
  there is renamed onto `path` in one atomic step."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  return f"{path}.tmp-{uuid.uuid4().hex}"


@contextlib.contextmanager
def replacing(path: str) -> Iterator[str]:
  """A `temp_beside(path)` for the block to write, renamed onto the local `path` when the block ends and
  removed when it raises: a reader sees the old file or the whole new one.

      with files.replacing(dest) as tmp:
        shutil.copyfile(source, tmp)
  """
  tmp = temp_beside(path)
  try:
    yield tmp
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def _delete(path: str) -> None:
  if is_gcs(path):
    gcs_blob(path).delete(retry=retry.named(path))  # one that a lost answer hid is missing on the retry
  else:
    os.remove(path)


def delete_many(paths: list[str], missing_ok: bool = True) -> None:
  """Deletes files; with `missing_ok`, one already gone is fine (idempotent).

  Args:
    paths: the files.
    missing_ok: a file already gone is not an error.

  Raises:
    FileNotFoundError: a file is missing and `missing_ok` is False.
  """
  for path in paths:
    try:
      _delete(path)
    except FileNotFoundError:
      if not missing_ok:
        raise
    except Exception as e:
      if not (missing_ok and is_gcs(path) and isinstance(e, gcs_not_found())):
        raise


def walk(folder: str) -> list[str]:
  """The full path of every file below `folder` (recursively; symbolic links are not followed), sorted."""
  if is_gcs(folder):
    bucket = split_gcs(folder)[0]
    return sorted(f"gs://{bucket}/{b.name}" for b in _listing(folder)[1])
  out = []
  for dirpath, _, names in os.walk(folder):
    out += [os.path.join(dirpath, n) for n in names]
  return sorted(out)


def remove_empty_dirs(folder: str) -> None:
  """Removes `folder` and the folders below it that are empty (local only: gs:// has no folders, so a gs://
  `folder` is ignored)."""
  if is_gcs(folder) or not os.path.isdir(folder):
    return
  for dirpath, _, _ in sorted(os.walk(folder), key=lambda t: -t[0].count(os.sep)):
    try:
      os.rmdir(dirpath)
    except OSError:
      pass


def list_dir(path: str) -> tuple[list[str], list[str]]:
  """(sub-folder names, file names) directly under the folder `path`, each sorted."""
  if is_gcs(path):
    prefix, it = _listing(path, delimiter="/")
    files = sorted(b.name[len(prefix):] for b in it if b.name != prefix)
    dirs = sorted(p[len(prefix):].rstrip("/") for p in it.prefixes)
    return dirs, [f for f in files if f]
  dirs, files = [], []
  with os.scandir(path) as entries:
    for e in entries:
      (dirs if e.is_dir() else files).append(e.name)
  return sorted(dirs), sorted(files)


def download(path: str, local_path: str) -> None:
  """Copies `path` to the local file `local_path` atomically.

  Args:
    path: the file.
    local_path: where the copy goes (its folder is created).
  """
  with replacing(local_path) as tmp:
    if is_gcs(path):
      gcs_blob(path).download_to_filename(tmp, retry=retry.named(path))  # a retry resumes where the answer broke
    else:
      shutil.copyfile(path, tmp)


def cache_path(path: str, sha256: str, cache_root: str) -> str:
  """Where the cached copy of `path` lives: `<cache_root>/<sha256[:16]>/<basename>`.

  Args:
    path: the file.
    sha256: its hex SHA-256 (from the manifest).
    cache_root: the cache folder.

  Returns:
    The local path (a `.verified` marker beside it says the copy is complete and checked).
  """
  return os.path.join(cache_root, sha256[:16], os.path.basename(path))


class LocalCopy:
  """Context manager giving a local path for `path`: itself if local, else a temp download."""

  def __init__(self, path: str):
    self._path = path
    self._tmpdir: str | None = None

  def __enter__(self) -> str:
    if not is_gcs(self._path):
      return self._path
    self._tmpdir = tempfile.mkdtemp(prefix="formats-")
    local = os.path.join(self._tmpdir, os.path.basename(self._path))
    download(self._path, local)
    return local

  def __exit__(self, *exc) -> None:
    if self._tmpdir:
      shutil.rmtree(self._tmpdir, ignore_errors=True)


COMPOSE_MAX_SOURCES = 32  # GCS composes at most 32 objects per request


def compose(sources: list[str], dest: str, scratch: str, max_sources: int = 32,
            policy: retry.Policy | None = None) -> None:
  """Joins gs:// objects, in order, into `dest` by object composition (no byte passes through here).

  At most `max_sources` objects per compose request: more are composed in a tree, each level
  joining runs of `max_sources` into intermediate objects `<scratch>/compose-<level>-<i>`, which
  are deleted once `dest` exists (and when a compose fails). Every request is retried on transient
  errors by `policy`: composing the same sources into the same name again gives the same object.

      compose([f"gs://b/run/_parts/p{i}" for i in range(100)], "gs://b/run/g.graphbin", "gs://b/run/_parts")

  Args:
    sources: gs:// objects of one bucket, in the order their bytes follow each other in `dest`.
    dest: the gs:// object written (replaced if it exists), in the same bucket.
    scratch: a gs:// folder of the same bucket for the intermediate objects.
    max_sources: sources per request (2..32; tests lower it to build a deeper tree).
    policy: the retry policy of each request (None: the process's, `formats.storage.retry.default()`).

  Raises:
    ValueError: no sources, a bad `max_sources`, or paths in different buckets or not on gs://.
    formats.storage.retry.RetryExhausted: a request met transient errors until the policy gave up.
    google.api_core.exceptions.GoogleAPICallError: a request was refused (a missing source: NotFound).
  """
  if not sources:
    raise ValueError(f"compose into {dest}: no sources")
  if not 2 <= max_sources <= 32:
    raise ValueError(f"max_sources must be in [2, 32] (GCS composes at most 32 per request), got {max_sources}")
  bucket = split_gcs(dest)[0]
  if any(not is_gcs(p) or split_gcs(p)[0] != bucket for p in [*sources, scratch]):
    raise ValueError(f"compose into {dest}: every source and the scratch folder must be in gs://{bucket}")
  policy = policy or retry.default()
  made: list[str] = []
  try:
    level, layer = 0, list(sources)
    while len(layer) > max_sources:
      groups = [layer[i:i + max_sources] for i in range(0, len(layer), max_sources)]
      layer = []
      for i, group in enumerate(groups):
        name = join(scratch, f"compose-{level}-{i:06d}")
        made.append(name)
        _compose_once(group, name, policy)
        layer.append(name)
      level += 1
    _compose_once(layer, dest, policy)
  finally:
    delete_many(made)


def _compose_once(sources: list[str], dest: str, policy: retry.Policy) -> None:
  blob = gcs_blob(dest)
  blob.content_type = "application/octet-stream"
  blob.compose([gcs_blob(p) for p in sources], retry=policy.named(f"composing {dest}"))


def free_bytes(path: str) -> int:
  """Bytes free on the local disk that holds `path`, or would hold it (its nearest existing ancestor).

  Args:
    path: a local path, existing or not.

  Returns:
    The free bytes there.
  """
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  return shutil.disk_usage(existing).free
