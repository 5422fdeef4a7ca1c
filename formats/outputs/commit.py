"""How a run replaces an output folder: generations, a compare-and-swap of the manifest, safe cleanup.

An output folder holds `manifest.json` (the commit: its presence means the
output is complete), the TFDS metadata beside it, and one folder per run,
`gen-<UTC time>-<random>/`, with that run's data files. The protocol (the
layout and its guarantees are in docs/manifest.md):

  1. `begin`: the launcher reads the manifest's version (`read_version`: the
     object generation on gs://, the content's SHA-256 locally; absent is
     its own version) and claims a fresh generation by writing a marker
     `gen-.../_toolkit_run.json` into it. The marker is the record that the
     toolkit wrote the folder; its modification time is a heartbeat the
     launcher refreshes (`heartbeat`) while the run is alive.
  2. The run writes every data file into its generation, never elsewhere.
  3. `commit`: the switch is a compare-and-swap of `manifest.json` against the
     version read in 1: on gs:// an upload with `ifGenerationMatch`, locally
     `os.replace` under an exclusive `flock` on `.manifest.lock`. A run whose
     output was replaced by another run meanwhile loses: `CommitConflict`, and
     the winner's output is left as it is. Committing a manifest that already
     names this generation is a no-op (a retried bundle).
  4. `sync_tfds_metadata`: TFDS reads `dataset_info.json` (which names the
     generation folder of the shards and carries the features inline) and
     the label files at the root. They are rewritten from the current
     manifest after the switch, each in one atomic write, and they never name
     a generation that cleanup could remove: between the switch and the sync a
     TFDS reader sees the previous complete output, afterwards the new one.
  5. `cleanup`: removes generation folders that carry a toolkit marker, that
     neither the manifest nor the TFDS metadata names, that no unexpired reader
     lease holds (`formats.outputs.leases`), and whose retention is over: a replaced
     generation (marker state "replaced", written by the commit that replaced
     it) and a failed run's (state "abandoned", written by `finish`) are kept
     for `keep_replaced_seconds` from that marker's modification time, a
     killed run's (state "running", no heartbeat for `LEASE_SECONDS`) for as
     long from its last heartbeat. Each is marked abandoned before it is
     deleted. Plus root files the replaced manifest listed (outputs written
     before generations existed) and expired lease objects. Nothing without a
     record is touched.

Every step is idempotent, so a killed or retried step is repaired by running
it again (`repair` does 4 and 5 for an output found in any state). Every gs://
request is retried on transient errors by the process's retry policy
(`formats.storage.retry`), and only there: the switch carries its generation
precondition, so a retried upload whose first answer was lost meets a 412, which
the commit resolves by reading back which generation the manifest names.

Parameters shared by this module's functions: `output` is the output folder,
local or gs://, and `generation` a generation folder name in it (`gen-...`),
the run's own where the function acts for a run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import hashlib
import json
import logging
import os
import posixpath
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Mapping

from formats import naming, tfds_metadata
from formats.outputs import leases
from formats.storage import files, retry
from formats.errors import CommitConflict
from formats.manifest import MANIFEST_FILENAME, Manifest

MARKER_FILENAME = "_toolkit_run.json"
# In the generation that replaced an output written before generations: the root shards it replaced and when,
# removed once the retention is over (readers of such an output hold no lease: the retention is their time).
LEGACY_FILENAME = "_replaced_root_shards.json"
LOCK_FILENAME = ".manifest.lock"
TOOLKIT = "tpu-shards"
# A run refreshes its marker every HEARTBEAT_SECONDS; a running generation whose marker
# is older than LEASE_SECONDS belongs to a run that died (kill -9, lost machine).
HEARTBEAT_SECONDS = 60.0
LEASE_SECONDS = 15 * 60.0
# How long clean-up keeps a replaced generation (and a failed or killed run's) after it was
# replaced: readers that opened it keep reading, a resumed run reuses its shards. Costs up to one
# extra copy of the output per run within the window (docs/manifest.md, "Generations and retention").
DEFAULT_KEEP_REPLACED_SECONDS = 7 * 86400
# The states a marker records (docs/manifest.md, "Generations and retention").
RUNNING, COMMITTED, REPLACED, ABANDONED = "running", "committed", "replaced", "abandoned"
# The environment variable naming a step at which a run kills itself (the fault
# harness of the tests: kill -9 at every step of a commit). Unset in production.
FAULT_POINT_ENV = "TPU_SHARDS_FAULT_POINT"


@dataclasses.dataclass(frozen=True)
class Version:
  """The identity of `manifest.json` as a run saw it: `token` is "" when there was none."""

  token: str = ""

  @property
  def exists(self) -> bool:
    """Whether the manifest existed when it was read."""
    return bool(self.token)


def fault_point(name: str) -> None:
  """The fault harness's hook at step `name` of a commit (a no-op unless the variable is set).

  `TPU_SHARDS_FAULT_POINT=<step>` kills the process there (SIGKILL, as a lost
  machine would); `<step>=pause:<file>` waits there until `<file>` exists (a slow run).

  Args:
    name: the step, e.g. "commit:before_switch".
  """
  value = os.environ.get(FAULT_POINT_ENV)
  if not value:
    return
  step, _, action = value.partition("=")
  if step != name:
    return
  if action.startswith("pause:"):
    flag = action[len("pause:"):]
    open(flag + ".reached", "w").close()
    while not os.path.exists(flag):
      time.sleep(0.05)
    return
  os.kill(os.getpid(), 9)


# --------------------------------------------------------------------------- versions


def _manifest_path(output: str) -> str:
  return files.join(output, MANIFEST_FILENAME)


def read_manifest_versioned(output: str) -> tuple[bytes | None, Version]:
  """(manifest bytes or None, its version), read as one consistent pair.

  Returns:
    (the bytes of manifest.json, or None when there is none; its `Version`).
  """
  path = _manifest_path(output)
  if files.is_gcs(path):
    data, generation = _read_gcs_versioned(path)
    return (data, Version(str(generation))) if data is not None else (None, Version())
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    return None, Version()
  return data, Version("sha256:" + hashlib.sha256(data).hexdigest())


def _read_gcs_versioned(path: str) -> tuple[bytes | None, int]:
  """(content, object generation) of a gs:// object read as one consistent pair; (None, 0) when absent."""
  blob, policy = files.gcs_blob(path), retry.named(path)
  while True:
    try:
      blob.reload(retry=policy)
      generation = blob.generation  # before the download, which may reset it
      return blob.download_as_bytes(if_generation_match=generation, retry=policy), generation
    except files.gcs_not_found():
      return None, 0
    except files.gcs_precondition_failed():  # replaced between the two calls: read again
      continue


def read_version(output: str) -> Version:
  """The version of the output's manifest.json (`Version()` when there is none).

  Returns:
    The version a later `commit` compares against.
  """
  return read_manifest_versioned(output)[1]


def current_generation(output: str) -> str | None:
  """The generation folder the committed manifest names (None: no manifest, or root files).

  Returns:
    The generation folder name, or None.
  """
  data, _ = read_manifest_versioned(output)
  return None if data is None else _generation_of(Manifest.loads(data))


def _generation_of(manifest: Manifest) -> str | None:
  """The generation folder holding the manifest's data files (its rejected list is always one)."""
  folders = {p.split("/", 1)[0] for p in _data_paths(manifest) if "/" in p}
  return folders.pop() if len(folders) == 1 else None


def _data_paths(manifest: Manifest) -> set[str]:
  return ({s.path for split in manifest.splits.values() for s in split.shards}
          | {f.path for f in manifest.files} | {manifest.rejected.path})


# --------------------------------------------------------------------------- markers


def _marker_path(output: str, generation: str) -> str:
  return files.join(output, generation, MARKER_FILENAME)


def _now_iso() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat()


def _marker_bytes(generation: str, state: str, info: Mapping | None = None) -> bytes:
  marker = {"toolkit": TOOLKIT, "generation": generation, "state": state, "host": socket.gethostname(),
            "pid": os.getpid(), "written": _now_iso(), **(info or {})}
  return json.dumps(marker, sort_keys=True).encode() + b"\n"


def _write_marker(output: str, generation: str, state: str, info: Mapping | None = None) -> None:
  files.write_bytes(_marker_path(output, generation), _marker_bytes(generation, state, info))


def _mark(output: str, generation: str, state: str, info: Mapping | None = None,
          previous: Mapping | None = None) -> dict:
  """Rewrites the marker to `state`, keeping the run's fields (`previous`: the marker as read,
  default read now); a "removing" flag is kept only when `info` sets it. Returns the marker."""
  if previous is None:
    previous = _read_marker(output, generation)[0] or {}
  marker = {"host": socket.gethostname(), "pid": os.getpid(),
            **{k: v for k, v in previous.items() if k != "removing"},
            "toolkit": TOOLKIT, "generation": generation, "state": state, "written": _now_iso(), **(info or {})}
  _put_marker(output, generation, marker)
  return marker


def _put_marker(output: str, generation: str, marker: Mapping) -> None:
  """Writes `marker` (a whole marker, as read or made) as `generation`'s marker."""
  files.write_bytes(_marker_path(output, generation), json.dumps(marker, sort_keys=True).encode() + b"\n")


def begin(output: str, info: Mapping | None = None) -> tuple[str, Version]:
  """Claims a fresh generation for a run; returns (generation, the manifest version to replace).

  Args:
    info: extra fields for the run's marker (e.g. the pipeline and its host).

  Returns:
    (the new generation folder name, the version of the manifest it will replace).
  """
  version = read_version(output)
  generation = naming.new_generation()
  claim(output, generation, info)
  return generation, version


def claim(output: str, generation: str, info: Mapping | None = None) -> None:
  """Records that `generation` (a fresh name) is the toolkit's, held by a live run.

  Args:
    info: extra fields for the marker.
  """
  _write_marker(output, generation, "running", info)


def heartbeat(output: str, generation: str, info: Mapping | None = None) -> None:
  """Refreshes the run's marker with a new time, so that clean-up knows the run is alive.

  Only a marker still "running" is rewritten, and only if nothing changed it
  since it was read (locally under the output's lock, as `abandon` takes it;
  on gs:// on the condition that the marker object is the one read): a
  heartbeat never brings back a generation a clean-up gave up and removed
  while the run was silent, which a commit would then have taken for a live
  run's. A committed marker is left as it is. Arguments as `claim`'s (pass
  the claim's `info` to keep its fields).

  Raises:
    CommitConflict: the marker is gone or marked otherwise (a clean-up took
      the generation): the run cannot commit.
  """
  path = _marker_path(output, generation)
  with _lock_if_local(output):
    if files.is_gcs(path):
      data, token = _read_gcs_versioned(path)
      marker = _parse_marker(data, generation)
    else:
      marker = _read_marker(output, generation)[0]
    state = None if marker is None else marker.get("state")
    if state == COMMITTED:
      return
    if state != RUNNING:
      raise CommitConflict(f"{output}: this run's generation {generation} is {state or 'gone'} (a clean-up took "
                           "it while this run was silent for a lease); this run cannot commit")
    if not files.is_gcs(path):
      _write_marker(output, generation, RUNNING, info)
      return
    try:
      files.gcs_blob(path).upload_from_string(_marker_bytes(generation, RUNNING, info), if_generation_match=token,
                                              retry=retry.named(path))
    except files.gcs_precondition_failed():
      raise CommitConflict(f"{output}: this run's generation {generation} was changed by a clean-up while its "
                           "heartbeat was written; this run cannot commit") from None


def finish(output: str, generation: str) -> bool:
  """Records that the run ended; returns whether it committed.

  A generation that the manifest or the TFDS metadata names is the run's
  committed output (even if the run failed afterwards, e.g. in clean-up);
  any other is marked abandoned and kept for the retention period (a resumed
  run reuses its shards; clean-up removes it afterwards): the output is the
  record, not the caller's belief.

  Returns:
    True when the manifest or the TFDS metadata names `generation` (it committed).
  """
  if not abandon(output, generation):
    _mark(output, generation, COMMITTED)
    return True
  return False


def abandon(output: str, generation: str) -> bool:
  """Marks `generation` abandoned unless the manifest or the TFDS metadata names it;
  returns whether it did. After it, the generation's data may be deleted.

  The mark comes first and the check second, and `commit` checks the mark before
  its switch and again after it (undoing a switch that raced with this call): of
  an abandon and a commit of the same generation, exactly one wins. Locally both
  also hold the lock of the output.

  Returns:
    True when the generation was marked abandoned; False when it is committed.
  """
  return _abandon(output, generation)


def _abandon(output: str, generation: str, info: Mapping | None = None) -> bool:
  """`abandon`, with extra marker fields (clean-up's "removing": the retention is over). A generation being
  removed is also kept, its marker as it was, while the manifest names one that is abandoned or gone: that is
  a gs:// switch that raced an abandon, and its undo puts back the manifest it replaced (`_undo_switch`)."""
  with _lock_if_local(output):
    previous = _read_marker(output, generation)[0] or {}
    _mark(output, generation, ABANDONED, info, previous)
    current = current_generation(output)
    if generation in (current, _tfds_generation(output)):
      _mark(output, generation, COMMITTED, previous=previous)
      return False
    if info and info.get("removing") and _being_undone(output, current):
      if previous:
        _put_marker(output, generation, previous)
      return False
  return True


def _being_undone(output: str, current: str | None) -> bool:
  """Whether the manifest names a generation that is abandoned or gone (its switch is about to be undone)."""
  if current is None:
    return False
  marker, _ = _read_marker(output, current)
  return marker is None or marker.get("state") == ABANDONED


def _read_marker(output: str, generation: str) -> tuple[dict | None, float]:
  """(marker or None when the folder has no toolkit marker, its modification time).

  Markers are read as untrusted input: one larger than MAX_MARKER_BYTES, or not a
  regular file, is no marker (and its folder is never touched).
  """
  path = _marker_path(output, generation)
  for _ in range(5):
    try:
      data, mtime = _read_small(path)
      break
    except FileNotFoundError:
      return None, 0.0
    except Exception as e:  # rewritten between its metadata and its content (a heartbeat): read again
      if not (files.is_gcs(path) and isinstance(e, files.gcs_precondition_failed())):
        raise
  else:
    return None, 0.0
  marker = _parse_marker(data, generation)
  return (marker, mtime) if marker is not None else (None, 0.0)


def _parse_marker(data: bytes | None, generation: str) -> dict | None:
  """The marker `data` holds, or None when it is not the toolkit's marker of `generation`."""
  if data is None or len(data) > MAX_MARKER_BYTES:
    return None
  try:
    marker = json.loads(data)
  except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the parser goes
    return None
  if not isinstance(marker, dict) or marker.get("toolkit") != TOOLKIT or marker.get("generation") != generation:
    return None
  return marker


MAX_MARKER_BYTES = 64 * 1024  # a marker is a few hundred bytes


def _read_small(path: str) -> tuple[bytes | None, float]:
  """(content, mtime) of a regular file of at most MAX_MARKER_BYTES; (None, mtime) for anything else."""
  return files.read_small(path, MAX_MARKER_BYTES)


def _marker(output: str, generation: str) -> tuple[dict | None, float]:
  """(marker or None when the folder has no toolkit marker, seconds since it was written)."""
  marker, mtime = _read_marker(output, generation)
  return (marker, max(0.0, time.time() - mtime)) if marker is not None else (None, 0.0)


def generation_state(output: str, generation: str) -> str | None:
  """The state the generation's marker records: "running", "committed", "replaced" or "abandoned".

  A reader that took a lease checks it: "abandoned" means a clean-up is
  removing the generation (its lease came too late), None that it is gone.

  Returns:
    The state, or None when the folder has no toolkit marker.
  """
  marker, _ = _read_marker(output, generation)
  return None if marker is None else str(marker.get("state"))


def remove_generation(output: str, generation: str) -> None:
  """Deletes one generation folder, the marker last (a half-removed folder stays recognisable).

  Raises:
    ValueError: `generation` is not a generation folder name.
  """
  if not naming.is_generation(generation) or "/" in generation:
    raise ValueError(f"{generation!r} is not a generation folder")
  folder = files.join(output, generation)
  paths = _data_files(folder)
  files.delete_many(paths)
  fault_point("remove:before_marker")
  files.delete_many([_marker_path(output, generation)])
  # What a run still writing put there meanwhile (its commit, which found the marker there, left no record).
  files.delete_many(_data_files(folder))
  files.remove_empty_dirs(folder)


# --------------------------------------------------------------------------- the switch


@contextlib.contextmanager
def _local_lock(output: str) -> Iterator[None]:
  import fcntl  # POSIX; local outputs only

  os.makedirs(output, exist_ok=True)
  fd = os.open(os.path.join(output, LOCK_FILENAME), os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # releases the lock; so does the death of the process


@contextlib.contextmanager
def _lock_if_local(output: str) -> Iterator[None]:
  if files.is_gcs(output):
    yield
  else:
    with _local_lock(output):
      yield


def _conflict(output: str, generation: str) -> CommitConflict:
  return CommitConflict(
      f"{output}: another run committed a new manifest.json after this run started; this run's "
      f"generation {generation} was not committed (the other run's output is left as it is)")


def commit(output: str, generation: str, manifest: Manifest, expected: Version | None) -> Manifest | None:
  """Switches `output` to `manifest` (whose data lie in `generation`) if the manifest is still `expected`.

  Returns the manifest it replaced (None if there was none, or on a retry).
  Raises CommitConflict when another run switched it meanwhile, or when this
  run's generation was removed under it. Idempotent: if the manifest already
  names `generation`, this run committed it before (a retried bundle).

  Args:
    generation: the run's generation folder, which holds every data file of `manifest`.
    manifest: the new manifest.
    expected: the version read by `begin` (None: no manifest was expected).

  Returns:
    The replaced manifest, or None.

  Raises:
    CommitConflict: another run switched the output meanwhile, or this run's
      generation was removed or abandoned.
    ValueError: the manifest's files are not all in `generation`.
  """
  if _generation_of(manifest) != generation:
    raise ValueError(f"the manifest's files are not all in generation {generation!r}")
  expected = expected or Version()
  _check_claim(output, generation)
  data = manifest.dumps()
  path = _manifest_path(output)
  fault_point("commit:before_switch")
  current, version = read_manifest_versioned(output)
  replaced = Manifest.loads(current) if current is not None and version == expected else None
  if files.is_gcs(path):
    blob = files.gcs_blob(path)
    try:
      blob.upload_from_string(data, content_type="application/json",
                              if_generation_match=int(expected.token) if expected.exists else 0,
                              retry=retry.named(path))
    except files.gcs_precondition_failed():
      if current_generation(output) != generation:  # not our own earlier, acknowledged-late upload
        raise _conflict(output, generation) from None
      replaced = None
    else:
      try:
        _check_claim(output, generation)  # abandoned (and being deleted) while we switched?
      except CommitConflict:
        _undo_switch(blob, int(blob.generation), current if replaced is not None else None)
        raise
  else:
    _sync_files(files.join(output, p) for p in _data_paths(manifest))  # on disk before a manifest names them
    with _local_lock(output):
      _check_claim(output, generation)
      current, version = read_manifest_versioned(output)
      if version != expected:
        if current is not None and _generation_of(Manifest.loads(current)) == generation:
          return None  # committed by an earlier attempt of this run
        raise _conflict(output, generation)
      replaced = Manifest.loads(current) if current is not None else None
      tmp = files.join(output, generation, f".{MANIFEST_FILENAME}.{uuid.uuid4().hex}")
      files.write_bytes(tmp, data)  # beside the data: same file system, so the rename is atomic
      _sync_files([tmp])
      os.replace(tmp, path)
      _fsync_dir(output)
  fault_point("commit:after_switch")
  previous = _generation_of(replaced) if replaced is not None else None
  if previous and previous != generation:
    _mark_replaced(output, previous, generation)
    fault_point("commit:marked_replaced")
  return replaced


def _mark_replaced(output: str, generation: str, by: str) -> None:
  """Marks a generation the manifest no longer names "replaced": its retention starts now.

  Also one already marked so: a clean-up marks the old generation replaced while an undone gs:// switch names
  another (`_abandon`), and the undo makes it current again with that early mark.
  A failure is logged, not raised (the switch is done): the next clean-up marks it then.
  """
  try:
    marker, _ = _read_marker(output, generation)
    if marker is not None and marker.get("state") in (RUNNING, COMMITTED, REPLACED):
      _mark(output, generation, REPLACED, {"replaced_at": _now_iso(), "replaced_by": by}, marker)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("could not mark generation %s replaced (%s); the next clean-up does", generation,
                    type(e).__name__)


def _data_files(folder: str) -> list[str]:
  """Every file below a generation's folder but its marker."""
  return [p for p in files.walk(folder) if posixpath.basename(p.replace(os.sep, "/")) != MARKER_FILENAME]


def _check_claim(output: str, generation: str) -> None:
  """Raises CommitConflict unless the run still holds its generation (marker state running).

  A generation found gone (a clean-up removed it while the run was silent) is marked abandoned again: what
  the run wrote into it since is the toolkit's, and clean-up removes it after the retention.
  """
  marker, _ = _marker(output, generation)
  if marker is None:
    try:
      _write_marker(output, generation, ABANDONED)
    except Exception as e:  # pylint: disable=broad-except  # the conflict below is the error to report
      logging.warning("could not mark generation %s abandoned (%s)", generation, type(e).__name__)
  if marker is None or marker.get("state") not in ("running", "committed"):
    raise CommitConflict(
        f"{output}: this run's generation {generation} is "
        f"{'gone' if marker is None else marker.get('state')} (removed by a clean-up after this run "
        "stopped heartbeating, or its launcher gave it up); nothing was committed")


def _undo_switch(blob, our_generation: int, previous: bytes | None) -> None:
  """Puts back the manifest our switch replaced, if nothing replaced ours since."""
  policy = retry.named(f"gs://{blob.bucket.name}/{blob.name}")
  try:
    if previous is None:
      blob.delete(if_generation_match=our_generation, retry=policy)
    else:
      blob.upload_from_string(previous, content_type="application/json", if_generation_match=our_generation,
                              retry=policy)
  except files.gcs_precondition_failed():
    pass  # another run switched after ours: its manifest stands


def _sync_files(paths) -> None:
  """fsyncs local files and their folders: a rename then never names bytes a power loss took."""
  folders = set()
  for path in paths:
    try:
      fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
      continue  # nothing to make durable (the pipelines' checks, not the switch, judge what a manifest names)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
    folders.add(os.path.dirname(path))
  for folder in sorted(folders):
    _fsync_dir(folder)


def _fsync_dir(path: str) -> None:
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError as e:  # some file systems cannot sync a directory
    if e.errno not in (errno.EINVAL, errno.EBADF):
      raise
  finally:
    os.close(fd)


# --------------------------------------------------------------------------- TFDS metadata


_MAX_DATASET_INFO_BYTES = 64 << 20  # a dataset_info.json past this is not the one a commit wrote


def _tfds_generation(output: str) -> str | None:
  """The generation folder the root dataset_info.json names (None: none, or the root)."""
  try:
    data, _ = files.read_small(files.join(output, tfds_metadata.DATASET_INFO_FILENAME), _MAX_DATASET_INFO_BYTES)
    if data is None:  # larger than any a commit writes, or not a regular file: anyone may write it
      return None
    info = json.loads(data)
    template = info["splits"][0]["filepathTemplate"]
  except (FileNotFoundError, ValueError, KeyError, IndexError, TypeError, RecursionError):
    return None
  if not isinstance(template, str):
    return None
  folder = naming.tfds_template_folder(template).split("/", 1)[0]
  return folder if naming.is_generation(folder) else None


def sync_tfds_metadata(output: str, description: str = "") -> None:
  """Rewrites the root TFDS metadata from the committed manifest (a no-op when they agree).

  TFDS reads `dataset_info.json` (splits, shard lengths, the shards' folder),
  `features.json` and `<feature>.labels.txt`. When only `dataset_info.json`
  changes (the same schema, the usual re-run) one atomic write switches the
  TFDS view. When the schema or class names change too, `dataset_info.json` is
  removed first and written last: in between a TFDS reader finds no dataset
  (a clear error), never old shards with new class names.

  Safe to run by any number of processes at any time: syncs are serialised
  (locally by the output's lock, on gs:// by a lease object), every write is
  derived from the manifest as it is now, and it repeats until the manifest
  has not changed under it. On gs:// each root write is also conditional on
  the object being as this sync read it, so a holder that outlived its lease
  (an upload retried past SYNC_LEASE_SECONDS) cannot land its write over a
  later sync's: it reads again instead.

  Args:
    description: the data set description written to dataset_info.json.
  """
  for _ in range(10):
    with _sync_lock(output):
      data, version = read_manifest_versioned(output)
      if data is None:
        return
      manifest = Manifest.loads(data)
      if manifest.file_format not in naming.FILE_FORMATS:
        return  # graph outputs have no TFDS view
      wanted = tfds_metadata.metadata_files(manifest, description)
      info_name = tfds_metadata.DATASET_INFO_FILENAME
      seen = {rel: _read_root_file(output, rel) for rel in wanted}  # (content, gs:// generation) of each
      stale = {rel for rel, content in wanted.items() if seen[rel][0] != content}
      staging = _generation_of(manifest)
      try:
        if stale - {info_name}:
          _delete_root_file(output, info_name, seen[info_name][1])
          seen[info_name] = (None, 0)
          fault_point("tfds:info_removed")
        for rel in sorted(stale - {info_name}):
          _write_root_file(output, rel, wanted[rel], staging, seen[rel][1])
          fault_point(f"tfds:wrote_{rel}")
        if stale:
          _write_root_file(output, info_name, wanted[info_name], staging, seen[info_name][1])
      except _RootFileChanged:
        continue  # a later sync wrote it after this one read it: read everything again
    if read_version(output) == version:
      return


SYNC_LOCK_FILENAME = ".tfds-sync.lock"
SYNC_LEASE_SECONDS = 30.0  # a gs:// sync lock older than this belongs to a killed process


@contextlib.contextmanager
def _sync_lock(output: str) -> Iterator[None]:
  """Serialises TFDS metadata syncs: the output's flock locally; on gs:// an object created
  only if absent (ifGenerationMatch=0) and deleted after, taken over once its lease expired.
  Its content is unique to the holder, so a create whose answer was lost (a retry then meets
  412) is recognised as this holder's own."""
  if not files.is_gcs(output):
    with _local_lock(output):
      yield
    return
  path = files.join(output, SYNC_LOCK_FILENAME)
  blob, policy = files.gcs_blob(path), retry.named(path)
  mine = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex}).encode()
  deadline = time.monotonic() + 4 * SYNC_LEASE_SECONDS
  while True:
    try:
      blob.upload_from_string(mine, if_generation_match=0, retry=policy)
      break
    except files.gcs_precondition_failed():
      try:
        blob.reload(retry=policy)
        if blob.download_as_bytes(if_generation_match=blob.generation, retry=policy) == mine:
          break  # our own create, answered late
        if time.time() - blob.updated.timestamp() > SYNC_LEASE_SECONDS:
          blob.delete(if_generation_match=blob.generation, retry=policy)  # its holder died
          continue
      except (files.gcs_not_found(), files.gcs_precondition_failed()):
        continue
      if time.monotonic() > deadline:
        raise TimeoutError(f"{output}: the TFDS metadata sync lock is held by another process") from None
      time.sleep(0.2)
  owned = blob.generation
  try:
    yield
  finally:
    try:
      blob.delete(if_generation_match=owned, retry=policy)
    except (files.gcs_not_found(), files.gcs_precondition_failed()):
      pass  # taken over after our lease expired


def tfds_metadata_lags(output: str) -> bool:
  """True when the root TFDS metadata does not point at the committed manifest's generation.

  Returns:
    Whether TFDS readers see an older output than the manifest describes
    (False when there is no manifest or no TFDS view).
  """
  data, _ = read_manifest_versioned(output)
  if data is None:
    return False
  manifest = Manifest.loads(data)
  if manifest.file_format not in naming.FILE_FORMATS or not any(s.num_records for s in manifest.splits.values()):
    return False
  return _tfds_generation(output) != _generation_of(manifest)


class _RootFileChanged(Exception):
  """A gs:// root file is not the object the sync read (another sync wrote it since)."""


def _read_root_file(output: str, rel: str) -> tuple[bytes | None, int | None]:
  """(content or None when absent, on gs:// the object's generation (0: absent); None locally)."""
  path = files.join(output, rel)
  return _read_gcs_versioned(path) if files.is_gcs(path) else (_read_or_none(path), None)


def _delete_root_file(output: str, rel: str, token: int | None) -> None:
  """Deletes a root file (gone already is fine); on gs:// only the object read (`token`)."""
  path = files.join(output, rel)
  if token is None:
    files.delete_many([path], missing_ok=True)
    return
  if token == 0:
    return
  try:
    files.gcs_blob(path).delete(if_generation_match=token, retry=retry.named(path))
  except files.gcs_not_found():
    pass
  except files.gcs_precondition_failed():
    raise _RootFileChanged(path) from None


def _write_root_file(output: str, rel: str, data: bytes, staging: str | None, token: int | None = None) -> None:
  """One atomic write of a root file; locally staged in a generation folder, so that a
  kill leaves no stray temporary file at the root (cleanup never guesses at those); on
  gs:// only over the object read (`token`: its generation, 0 for none)."""
  path = files.join(output, rel)
  if files.is_gcs(path):
    try:
      files.gcs_blob(path).upload_from_string(data, if_generation_match=token, retry=retry.named(path))
    except files.gcs_precondition_failed():
      raise _RootFileChanged(path) from None
    return
  if not staging:
    files.write_bytes(path, data)
    return
  tmp = files.join(output, staging, f".{rel}.{uuid.uuid4().hex}")
  files.write_bytes(tmp, data)
  os.replace(tmp, path)


def _read_or_none(path: str) -> bytes | None:
  try:
    return files.read_bytes(path)
  except FileNotFoundError:
    return None


# --------------------------------------------------------------------------- cleanup


@dataclasses.dataclass(frozen=True)
class GenerationStatus:
  """One generation folder of an output as clean-up sees it (what `formats.outputs.inspect` prints).

  `state` is "current" (the manifest names it), "tfds" (only dataset_info.json
  names it: the TFDS view lags), "running" (a live run), "dead" (a run that
  stopped heartbeating), "committed" (replaced, not yet marked so), "replaced",
  "abandoned" (a failed or given-up run), or "foreign" (no toolkit marker:
  never touched). `age_seconds` runs from the marker's last write (for a
  replaced generation, from its replacement; for a run, its last heartbeat);
  `leases` counts the unexpired reader leases on it; `removable` says whether
  a clean-up with the same settings would remove it now, and `reason` why.
  """

  name: str
  state: str
  age_seconds: float
  leases: int
  removable: bool
  reason: str


@dataclasses.dataclass(frozen=True)
class _Policy:
  """What clean-up keeps: runs within `lease_seconds` of a heartbeat, ended generations for
  `keep_replaced_seconds`, leases refreshed within `lease_ttl_seconds`, measured at `now`."""

  lease_seconds: float
  keep_replaced_seconds: float
  lease_ttl_seconds: float
  now: float

  def __post_init__(self):
    for field in ("lease_seconds", "keep_replaced_seconds", "lease_ttl_seconds"):
      value = getattr(self, field)
      if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"{field} must be a number of seconds >= 0, got {value!r}")


def _when(t: float) -> str:
  return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(name: str, marker: Mapping | None, mtime: float, named: tuple[str | None, str | None], held: int,
            policy: _Policy) -> GenerationStatus:
  """What clean-up does with one generation folder under `policy`, and why."""
  age = max(0.0, policy.now - mtime)
  until = mtime + policy.keep_replaced_seconds
  retention = (f"retention over since {_when(until)}" if policy.now >= until
               else f"kept until {_when(until)}")
  current, tfds = named
  state = marker.get("state") if marker is not None else None
  removable = False
  if marker is None:
    out_state, reason = "foreign", "no toolkit marker: not the toolkit's, never removed"
  elif name == current:
    out_state, reason = "current", "named by manifest.json" + (" and dataset_info.json" if name == tfds else "")
  elif name == tfds:
    out_state, reason = "tfds", "named by dataset_info.json (the TFDS view lags the manifest: --repair)"
  elif state == RUNNING and age < policy.lease_seconds:
    out_state, reason = "running", f"a live run (heartbeat {age:.0f} s ago)"
  elif state == RUNNING:
    out_state, removable = "dead", policy.now >= until
    reason = f"a killed run (no heartbeat since {_when(mtime)}); {retention}"
  elif state == COMMITTED:
    out_state = "committed"
    reason = "replaced, not yet marked: the next clean-up marks it replaced, and its retention starts then"
  elif state == REPLACED:
    out_state, removable = "replaced", policy.now >= until
    by = marker.get("replaced_by")
    reason = f"replaced{f' by {by}' if leases.valid_generation(by) else ''} at {_when(mtime)}; {retention}"
  elif state == ABANDONED:
    out_state = "abandoned"
    removable = bool(marker.get("removing")) or policy.now >= until
    reason = ("retention over, being removed" if marker.get("removing")
              else f"a failed or given-up run, abandoned at {_when(mtime)}; {retention}")
  else:
    out_state, reason = "foreign", f"unknown marker state {str(state)[:40]!r}: never removed"
  if held:
    reason += f"; held by {held} reader lease{'s' if held > 1 else ''}"
    removable = False
  return GenerationStatus(name, out_state, age, held, removable, reason)


def _survey(output: str, policy: _Policy, mark: bool = False,
            log: Callable[[str], None] | None = None) -> list[GenerationStatus]:
  """Every generation folder's status; with `mark`, committed ones nothing names are marked
  replaced first (their retention starts now)."""
  try:
    dirs, _ = files.list_dir(output)
  except (FileNotFoundError, NotADirectoryError):
    return []
  named = (current_generation(output), _tfds_generation(output))
  held: dict[str, int] = {}
  for info in leases.list_leases(output, policy.lease_ttl_seconds, policy.now):
    if not info.expired:
      held[info.generation] = held.get(info.generation, 0) + 1
  out = []
  for d in dirs:
    if not naming.is_generation(d):
      continue
    marker, mtime = _read_marker(output, d)
    if mark and marker is not None and marker.get("state") == COMMITTED and d not in named:
      marker = _mark(output, d, REPLACED, {"replaced_at": _now_iso(), "replaced_by": named[0] or ""}, marker)
      mtime = policy.now  # its retention starts now
      if log:
        log(f"marked generation {d} replaced (nothing names it); kept for {policy.keep_replaced_seconds:.0f} s")
      fault_point("cleanup:marked_replaced")
    out.append(_status(d, marker, mtime, named, held.get(d, 0), policy))
  return out


def list_generations(output: str, *, lease_seconds: float = LEASE_SECONDS,
                     keep_replaced_seconds: float = DEFAULT_KEEP_REPLACED_SECONDS,
                     lease_ttl_seconds: float = leases.LEASE_TTL_SECONDS,
                     now: float | None = None) -> list[GenerationStatus]:
  """The generation folders of `output`, sorted by name (oldest first), with what clean-up would do.

  Reads only. For example, the generations a resumed run may reuse:

      [g.name for g in commit.list_generations(out) if g.state in ("abandoned", "dead")]

  Args:
    lease_seconds: a running generation's marker is live this long after a heartbeat.
    keep_replaced_seconds: how long ended generations are kept.
    lease_ttl_seconds: how long a reader lease holds after its last refresh.
    now: the time ages are measured at (default: now).

  Returns:
    One GenerationStatus per folder named like a generation.
  """
  policy = _Policy(lease_seconds, keep_replaced_seconds, lease_ttl_seconds, time.time() if now is None else now)
  return _survey(output, policy)


def cleanup(output: str, replaced: Manifest | None = None, lease_seconds: float = LEASE_SECONDS,
            log: Callable[[str], None] | None = None, *,
            keep_replaced_seconds: float = DEFAULT_KEEP_REPLACED_SECONDS,
            lease_ttl_seconds: float = leases.LEASE_TTL_SECONDS, now: float | None = None) -> list[str]:
  """Removes what the toolkit wrote and nothing holds any more; returns the removed generations.

  Held: the generation the manifest names, the one the TFDS metadata names,
  any generation an unexpired reader lease names (`formats.outputs.leases`), any whose
  run is alive (marker state "running", refreshed within `lease_seconds`),
  and, for `keep_replaced_seconds` from their marker's modification time,
  replaced generations, abandoned (failed) runs' and killed runs'. A committed
  generation that nothing names is marked replaced first (its retention
  starts then). Each removed generation is marked abandoned before its files
  are deleted; a lease that appears in between keeps it (it is removed by the
  next clean-up that finds it free), and so does a manifest that names an
  abandoned or removed generation (a gs:// switch about to be undone, which
  may name it again). Expired leases are removed too.
  `replaced`, the manifest this run's commit replaced, names the files of an
  output written before generations existed (removed if the current manifest
  does not list them). `keep_replaced_seconds=0` removes ended generations at once.

  Args:
    replaced: the manifest this run's commit replaced, if any.
    lease_seconds: how long a running generation's marker stays valid without a heartbeat.
    log: called with one line per removed or newly marked generation.
    keep_replaced_seconds: how long replaced, abandoned and killed runs' generations are kept.
    lease_ttl_seconds: how long a reader lease holds after its last refresh.
    now: the time ages are measured at (default: now; tests pass a later time).

  Returns:
    The removed generation folder names.
  """
  policy = _Policy(lease_seconds, keep_replaced_seconds, lease_ttl_seconds, time.time() if now is None else now)
  removed = []
  for status in _survey(output, policy, mark=True, log=log):
    if not status.removable:
      continue
    if not _abandon(output, status.name, {"removing": True}):
      continue  # committed meanwhile, or a switch being undone may name it again
    if status.name in leases.held_generations(output, lease_ttl_seconds, now=policy.now):
      continue  # a reader took a lease meanwhile: stays abandoned, removed once it is free
    fault_point("cleanup:abandoned")
    _retire_root_shards(output, status.name, policy, log, now_or_never=True)
    remove_generation(output, status.name)
    removed.append(status.name)
    if log:
      log(f"removed generation {status.name} ({status.reason})")
  expired = leases.remove_expired(output, lease_ttl_seconds, now=policy.now)
  if log and expired:
    log(f"removed {len(expired)} expired reader lease(s)")
  current_data, _ = read_manifest_versioned(output)
  current = Manifest.loads(current_data) if current_data is not None else None
  gen = _generation_of(current) if current is not None else None
  if replaced is not None and current is not None:
    legacy = sorted(p for p in _data_paths(replaced) if "/" not in p and naming.ShardName.is_shard_of(p, replaced.name))
    if legacy and gen is not None and policy.keep_replaced_seconds > 0:
      record = {"name": replaced.name, "shards": legacy, "replaced_at": policy.now}
      files.write_bytes(files.join(output, gen, LEGACY_FILENAME), json.dumps(record).encode() + b"\n")
      if log:
        log(f"kept the {len(legacy)} root shard(s) of the replaced output for {policy.keep_replaced_seconds:.0f} s")
    else:
      _delete_root_shards(output, replaced.name, legacy)
  if gen is not None:
    _retire_root_shards(output, gen, policy, log)
  fault_point("cleanup:done")
  return removed


def _retire_root_shards(output: str, generation: str, policy: _Policy, log: Callable[[str], None] | None,
                        now_or_never: bool = False) -> None:
  """Deletes the root shards `generation`'s LEGACY_FILENAME lists once their retention is over (or now, when
  the generation itself goes: `now_or_never`); the record goes with them. A record that is not the toolkit's
  form is left alone."""
  path = files.join(output, generation, LEGACY_FILENAME)
  try:
    data, _ = _read_small(path)
  except FileNotFoundError:
    return
  try:
    record = json.loads(data) if data is not None else None
    name, shards, at = record["name"], record["shards"], float(record["replaced_at"])
    if not (isinstance(name, str) and isinstance(shards, list) and all(isinstance(p, str) for p in shards)):
      return
  except (ValueError, RecursionError, TypeError, KeyError):
    return
  if not now_or_never and policy.now < at + policy.keep_replaced_seconds:
    return
  _delete_root_shards(output, name, shards)
  files.delete_many([path], missing_ok=True)
  if log:
    log(f"removed the {len(shards)} root shard(s) of the output {generation} replaced")


def _delete_root_shards(output: str, name: str, shards: list[str]) -> None:
  """Deletes root files that are shards of dataset `name` and that the current manifest does not list."""
  data, _ = read_manifest_versioned(output)
  keep = _data_paths(Manifest.loads(data)) if data is not None else set()
  files.delete_many([files.join(output, p) for p in shards
                     if "/" not in p and p not in keep and naming.ShardName.is_shard_of(p, name)], missing_ok=True)


def repair(output: str, description: str = "") -> None:
  """Brings an output left in any state by killed runs to its committed state.

  The TFDS view is synced, then `cleanup` runs with its defaults: retention
  (`DEFAULT_KEEP_REPLACED_SECONDS`) and reader leases are honoured.

  Args:
    description: the data set description written to dataset_info.json.
  """
  sync_tfds_metadata(output, description)
  cleanup(output)
