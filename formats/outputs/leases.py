"""Reader leases: a small object per reader under an output, which clean-up respects.

A reader that streams a generation for hours (a training job) holds a lease on
it, so that no run's clean-up removes that generation under it, whatever its
retention says (docs/manifest.md, "Reader leases"):

    with leases.acquire("gs://bucket/flowers", "gen-20260101T120000-0123abcd", purpose="train") as lease:
      ...  # read the generation; a daemon thread rewrites the lease every LEASE_REFRESH_SECONDS

The lease is `OUTPUT/_leases/<id>.json`; its modification time (the object's
`updated` on gs://) is the reader's heartbeat, and a lease not refreshed for
`LEASE_TTL_SECONDS` has expired: its reader died (kill -9, a lost machine).
Lease files are untrusted input (other teams may write the bucket): one that
is malformed, not the toolkit's, or names something other than a generation
holds nothing and is never removed; `list_invalid` says why each was ignored.
Every gs:// request is retried on transient errors by the process's retry policy
(`formats.storage.retry`); a lease write puts the same bytes under a name only its
reader writes, so a retried write is the same lease.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import stat
import threading
import time
import uuid
import weakref

from formats import naming
from formats.storage import files, retry

LEASES_FOLDER = "_leases"  # OUTPUT/_leases/<lease id>.json
LEASE_TTL_SECONDS = 600.0  # a lease not refreshed for this long has expired
LEASE_REFRESH_SECONDS = 60.0  # how often the heartbeat thread rewrites it
TOOLKIT = "tpu-shards"
# A lease object is a few hundred bytes; anything larger is not one of ours and is not read.
MAX_LEASE_BYTES = 4096
_SUFFIX = ".json"
_ID = re.compile(r"[0-9a-f]{32}")
_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")  # generation names; printable, no path separators
_TEXT_LIMIT = 256  # host and purpose: printable, at most this long

logger = logging.getLogger(__name__)


class LeaseError(OSError):
  """The lease could not be written (a read-only bucket or folder, no permission, an outage)."""


class LeaseUnreachable(LeaseError, retry.RetryExhausted):
  """A lease write met transient errors until the retry policy gave up (a LeaseError and a RetryExhausted)."""


@dataclasses.dataclass(frozen=True)
class LeaseInfo:
  """One valid lease as clean-up and `formats.outputs.inspect` see it."""

  id: str
  generation: str
  host: str
  pid: int
  purpose: str
  age_seconds: float  # since the lease object was last written (its mtime / `updated`)
  expired: bool  # not refreshed for the TTL: its reader is gone


# --------------------------------------------------------------------------- the lease


def _folder(output: str) -> str:
  return files.join(output, LEASES_FOLDER)


def _path(output: str, lease_id: str) -> str:
  return files.join(output, LEASES_FOLDER, lease_id + _SUFFIX)


def _write(path: str, data: bytes) -> None:
  """One atomic write of a lease object; LeaseError when it cannot be written."""
  try:
    if files.is_gcs(path):
      policy = retry.default().named(f"writing the reader lease {path}", error=LeaseUnreachable)
      files.gcs_blob(path).upload_from_string(data, content_type="application/json", retry=policy)
    else:
      files.write_bytes(path, data)
  except LeaseUnreachable:
    raise
  except OSError as e:
    raise LeaseError(e.errno, f"cannot write the reader lease {path}: {e.strerror or e}") from e
  except Exception as e:  # google.api_core's errors (403, 404 bucket, retries exhausted) are not OSErrors
    if not files.is_gcs(path):
      raise
    raise LeaseError(f"cannot write the reader lease {path}: {type(e).__name__}: {e}") from e


def _touch(path: str, data: bytes) -> bool:
  """Refreshes a lease object; returns False when it had to be re-created (it had been removed)."""
  if not files.is_gcs(path):
    try:
      os.utime(path)  # the mtime is the heartbeat: no rewrite, no temporary file
      return True
    except FileNotFoundError:
      pass
    _write(path, data)
    return False
  existed = files.gcs_blob(path).exists(retry=retry.named(path))
  _write(path, data)
  return existed


@dataclasses.dataclass
class _State:
  """What the heartbeat thread and the finalizer share (never the Lease itself, so it can be collected)."""

  path: str
  data: bytes
  lease_id: str
  pid: int  # the process that owns the lease: a forked or unpickled copy never releases it
  stop: threading.Event = dataclasses.field(default_factory=threading.Event)
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
  thread: threading.Thread | None = None
  released: bool = False


def _refresh(state: _State) -> None:
  with state.lock:
    if state.released:
      return
    if not _touch(state.path, state.data):
      logger.warning("reader lease %s had been removed (not refreshed for %.0f s?); written again: its "
                     "generation may already be gone", state.lease_id, LEASE_TTL_SECONDS)


def _beat(state: _State, refresh_seconds: float) -> None:
  while not state.stop.wait(refresh_seconds):
    try:
      _refresh(state)
    except Exception as e:  # a missed beat is retried at the next one; a lease lasts many beats
      logger.warning("refresh of reader lease %s failed (%s); retrying in %.0f s", state.lease_id,
                     type(e).__name__, refresh_seconds)


def _release(state: _State) -> None:
  """Stops the heartbeat and deletes the lease object, once, in the owning process only."""
  if os.getpid() != state.pid:
    return
  state.stop.set()
  thread = state.thread
  if thread is not None and thread is not threading.current_thread():
    thread.join()  # a beat in flight ends first: no late beat re-creates the object
  with state.lock:
    if state.released:
      return
    state.released = True
    try:
      files.delete_many([state.path], missing_ok=True)
    except Exception as e:  # pylint: disable=broad-except  # at exit the client may be gone: it expires
      logger.warning("lease %s not deleted (%s): it expires by itself after %.0f s",
                     os.path.basename(state.path), type(e).__name__, LEASE_TTL_SECONDS)


class Lease:
  """A reader's hold on one generation of an output, released by `release()` or on exit.

      lease = leases.acquire(output, generation, purpose="train")
      try: ...
      finally: lease.release()

  A pickled copy (shipped to a worker process) names the same lease but does not
  own it: its `release` and its collection do nothing, and it sends no heartbeat.
  """

  def __init__(self, output: str, generation: str, lease_id: str, state: _State, owner: bool):
    self.output = output
    self.generation = generation
    self.id = lease_id
    self._state = state
    self._finalizer = weakref.finalize(self, _release, state) if owner else None

  def refresh(self) -> None:
    """Rewrites the lease now (its age starts again); LeaseError when it cannot be written."""
    _refresh(self._state)

  def release(self) -> None:
    """Stops the heartbeat thread and deletes the lease object (idempotent)."""
    if self._finalizer is not None:
      self._finalizer()

  def __enter__(self) -> Lease:
    return self

  def __exit__(self, *exc) -> None:
    self.release()

  def __reduce__(self):
    return _detached, (self.output, self.generation, self.id)

  def __repr__(self) -> str:
    return f"Lease({self.output!r}, {self.generation!r}, id={self.id!r})"


def _detached(output: str, generation: str, lease_id: str) -> Lease:
  state = _State(_path(output, lease_id), b"", lease_id, pid=-1, released=True)
  return Lease(output, generation, lease_id, state, owner=False)


def acquire(output: str, generation: str, *, purpose: str = "", heartbeat: bool = True,
            refresh_seconds: float = LEASE_REFRESH_SECONDS) -> Lease:
  """Takes a lease on `generation` of `output` for this process; returns it.

  Writes `OUTPUT/_leases/<id>.json` and, with `heartbeat`, starts a daemon
  thread that refreshes it every `refresh_seconds`. The lease is released by
  `Lease.release()`, by leaving its `with` block, when the Lease is collected,
  or when the interpreter exits; a killed process's lease expires after
  `LEASE_TTL_SECONDS`.

  Args:
    output: the output folder, local or gs://.
    generation: the generation folder name the reader reads (`gen-...`).
    purpose: a short free text shown by `formats.outputs.inspect` (e.g. "train job 42").
    heartbeat: whether a thread refreshes the lease (False: the caller calls `refresh`).
    refresh_seconds: the heartbeat's period; well under LEASE_TTL_SECONDS.

  Returns:
    The Lease.

  Raises:
    ValueError: `generation` is not a generation folder name, or a bad `refresh_seconds`.
    LeaseError: the lease object cannot be written (read-only folder, 403 on gs://).
  """
  if not valid_generation(generation):
    raise ValueError(f"{generation!r} is not a generation folder name")
  if not 0 < refresh_seconds < LEASE_TTL_SECONDS:
    raise ValueError(f"refresh_seconds must be in (0, {LEASE_TTL_SECONDS:.0f}), got {refresh_seconds!r}")
  lease_id = uuid.uuid4().hex
  body = {"toolkit": TOOLKIT, "generation": generation, "host": socket.gethostname()[:_TEXT_LIMIT],
          "pid": os.getpid(), "purpose": _printable(purpose)[:_TEXT_LIMIT]}
  state = _State(_path(output, lease_id), json.dumps(body, sort_keys=True).encode() + b"\n", lease_id, os.getpid())
  _write(state.path, state.data)
  lease = Lease(output, generation, lease_id, state, owner=True)
  if heartbeat:
    state.thread = threading.Thread(target=_beat, args=(state, refresh_seconds), name=f"lease-{lease_id[:8]}",
                                    daemon=True)
    state.thread.start()
  return lease


def _printable(text: str) -> str:
  return "".join(c if c.isprintable() else "?" for c in str(text))


def valid_generation(name: object) -> bool:
  """Whether `name` is a plain generation folder name (no path parts), as a lease must name.

  Args:
    name: what a lease file says.

  Returns:
    True for a name like "gen-20260101T120000-0123abcd".
  """
  return (isinstance(name, str) and naming.is_generation(name) and bool(_NAME.fullmatch(name))
          and ".." not in name)


# --------------------------------------------------------------------------- reading leases


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One object under `_leases/`: its name, its content or why it was ignored, its age and version."""

  name: str
  path: str
  info: LeaseInfo | None
  problem: str  # "" for a valid lease
  token: object  # the gs:// object generation, or the local mtime (for a conditional delete)


def _objects(output: str) -> list[tuple[str, str, bytes | None, float, object, str]]:
  """(name, path, content or None, mtime, token, problem) of every object under `_leases/`, sorted."""
  folder = _folder(output)
  out = []
  if files.is_gcs(folder):
    bucket, name = files.split_gcs(folder)
    prefix = name.rstrip("/") + "/"
    for blob in files.gcs_client().list_blobs(bucket, prefix=prefix, retry=retry.named(f"listing {folder}")):
      rel = blob.name[len(prefix):]
      path = f"gs://{bucket}/{blob.name}"
      mtime = blob.updated.timestamp()
      if "/" in rel or not rel:
        out.append((rel, path, None, mtime, blob.generation, "not a lease (a folder)"))
      elif (blob.size or 0) > MAX_LEASE_BYTES:
        out.append((rel, path, None, mtime, blob.generation, f"not a lease ({blob.size} bytes)"))
      else:
        try:
          data = blob.download_as_bytes(if_generation_match=blob.generation, retry=retry.named(path))
        except files.gcs_not_found():
          continue  # released meanwhile
        except files.gcs_precondition_failed():  # refreshed meanwhile: its reader is alive
          try:
            data, mtime = files.read_small(path, MAX_LEASE_BYTES)
          except (FileNotFoundError, files.gcs_precondition_failed()):
            continue
          if data is None:  # grew past a lease's size since it was listed
            out.append((rel, path, None, mtime, blob.generation, "not a lease (too large)"))
            continue
        out.append((rel, path, data, mtime, blob.generation, ""))
    return sorted(out)
  try:
    entries = sorted(os.scandir(folder), key=lambda e: e.name)
  except (FileNotFoundError, NotADirectoryError):
    return []
  for e in entries:
    try:
      st = e.stat(follow_symlinks=False)
    except FileNotFoundError:
      continue
    if not stat.S_ISREG(st.st_mode):
      out.append((e.name, e.path, None, st.st_mtime, st.st_mtime, "not a lease (not a regular file)"))
    elif st.st_size > MAX_LEASE_BYTES:
      out.append((e.name, e.path, None, st.st_mtime, st.st_mtime, f"not a lease ({st.st_size} bytes)"))
    else:
      try:
        fd = os.open(e.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
      except FileNotFoundError:
        continue
      with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_LEASE_BYTES + 1)
        mtime = os.fstat(f.fileno()).st_mtime
      out.append((e.name, e.path, data, mtime, mtime, ""))
  return out


def _parse(name: str, data: bytes, age: float, ttl_seconds: float) -> tuple[LeaseInfo | None, str]:
  """(LeaseInfo, "") for a valid lease; (None, why not) for anything else."""
  if not name.endswith(_SUFFIX) or not _ID.fullmatch(name[: -len(_SUFFIX)]):
    return None, "not a lease (its name is not <id>.json)"
  try:
    body = json.loads(data)
  except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
    return None, "malformed (not JSON)"
  if not isinstance(body, dict) or body.get("toolkit") != TOOLKIT:
    return None, "not written by the toolkit"
  generation, host, pid, purpose = (body.get(k) for k in ("generation", "host", "pid", "purpose"))
  if not valid_generation(generation):
    return None, "malformed (names no generation folder)"
  if not (isinstance(host, str) and isinstance(purpose, str) and isinstance(pid, int) and not isinstance(pid, bool)):
    return None, "malformed (host, pid or purpose)"
  if len(host) > _TEXT_LIMIT or len(purpose) > _TEXT_LIMIT or not (host + purpose).isprintable():
    return None, "malformed (host or purpose)"
  info = LeaseInfo(id=name[: -len(_SUFFIX)], generation=generation, host=host, pid=pid, purpose=purpose,
                   age_seconds=age, expired=age >= ttl_seconds)
  return info, ""


def _scan(output: str, ttl_seconds: float, now: float | None) -> list[_Entry]:
  now = time.time() if now is None else now
  entries = []
  for name, path, data, mtime, token, problem in _objects(output):
    age = max(0.0, now - mtime)
    info = None
    if not problem:
      info, problem = _parse(name, data, age, ttl_seconds)
    entries.append(_Entry(name, path, info, problem, token))
  return entries


def list_leases(output: str, ttl_seconds: float = LEASE_TTL_SECONDS, now: float | None = None) -> list[LeaseInfo]:
  """The valid leases under `output`, expired ones included, sorted by id.

  Args:
    output: the output folder, local or gs://.
    ttl_seconds: a lease older than this has expired.
    now: the time ages are measured at (default: now).

  Returns:
    One LeaseInfo per valid lease object (anything else under `_leases/` is left out: `list_invalid`).
  """
  return [e.info for e in _scan(output, ttl_seconds, now) if e.info is not None]


def list_invalid(output: str) -> list[tuple[str, str]]:
  """The objects under `_leases/` that are not valid leases: (name, why it was ignored), sorted.

  Args:
    output: the output folder, local or gs://.

  Returns:
    (object name relative to `_leases/`, reason) pairs; they hold nothing and are never removed.
  """
  return [(e.name, e.problem) for e in _scan(output, LEASE_TTL_SECONDS, None) if e.info is None]


def held_generations(output: str, ttl_seconds: float = LEASE_TTL_SECONDS, *, now: float | None = None) -> set[str]:
  """The generations that unexpired leases hold.

  Args:
    output: the output folder, local or gs://.
    ttl_seconds: a lease older than this has expired and holds nothing.
    now: the time ages are measured at (default: now).

  Returns:
    Generation folder names.
  """
  return {i.generation for i in list_leases(output, ttl_seconds, now) if not i.expired}


def _remove(entries: list[_Entry]) -> list[str]:
  """Deletes the expired valid leases among `entries` (unless refreshed meanwhile); returns their ids."""
  removed = []
  for e in entries:
    if e.info is None or not e.info.expired:
      continue
    try:
      if files.is_gcs(e.path):
        files.gcs_blob(e.path).delete(if_generation_match=e.token, retry=retry.named(e.path))
      else:
        if os.stat(e.path, follow_symlinks=False).st_mtime != e.token:
          continue  # refreshed meanwhile
        os.remove(e.path)
    except FileNotFoundError:
      continue
    except Exception as ex:  # refreshed (412) or released (404) meanwhile on gs://
      if files.is_gcs(e.path) and isinstance(ex, (files.gcs_not_found(), files.gcs_precondition_failed())):
        continue
      raise
    removed.append(e.info.id)
  return removed


def remove_expired(output: str, ttl_seconds: float = LEASE_TTL_SECONDS, *, now: float | None = None) -> list[str]:
  """Deletes expired leases (only valid, toolkit-written ones); returns their ids.

  A lease refreshed between the listing and the delete is kept (on gs:// the
  delete is conditional on the object generation that was read). Arguments as
  `list_leases`'s; returns the removed lease ids.
  """
  return _remove(_scan(output, ttl_seconds, now))
