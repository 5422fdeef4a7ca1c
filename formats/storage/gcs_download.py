"""Parallel, resumable, verified download of one gs:// object into a local file.

    obj = remote_object("gs://bucket/graphs/g.graphbin")      # size and generation, pinned from here on
    download(obj, "/cache/ab12/g.graphbin", sha256=info.sha256,
             checks=[RangeCheck("indptr", 64, 8008, 0x1c2b3a49)], options=DownloadOptions(streams=8))

How: `streams` threads fetch `chunk_bytes` ranges of the object (each read
pinned to the generation seen first, each retried on transient errors by the
formats.storage.retry policy that `DownloadOptions` describes; nothing above a
read retries) and os.pwrite them into a preallocated `<dest>.partial`. The calling
thread walks the chunks on disk in file order, reading them back, and extends
the SHA-256 of the whole file (the manifest's digest, the trust anchor) and
the CRC32C of every `RangeCheck` as it goes: verification ends with the last
chunk, and a bad range stops the download at once. Only a verified file is
renamed to `dest`; a mismatch discards the partial and raises CorruptRecordError.

Resuming: `<dest>.partial.json` records the object's generation and size and
the byte ranges on disk (rewritten atomically, by rename, after each chunk is
written). An interrupted call (an exception, a killed process) leaves both
files; the next call fetches only the missing ranges when the generation and
size still match, and starts over otherwise. Resumed bytes are hashed again
from the partial file, so the digest still covers every byte; a resumed
download that fails verification (a partial damaged since, chunks a power
loss took) is fetched again from scratch once before anything is reported.

Format-agnostic: the caller says which ranges carry which CRC32C.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import concurrent.futures
import dataclasses
import errno
import fcntl
import hashlib
import itertools
import json
import logging
import os
import sys
import threading
import time

import google_crc32c
import tqdm

from formats.storage import files, gcs_media, retry
from formats.errors import CorruptRecordError

__all__ = [
    "DownloadOptions", "DownloadStats", "NotEnoughSpaceError", "RangeCheck", "RemoteObject", "SourceChangedError",
    "download", "read_range", "remote_object",
]

logger = logging.getLogger(__name__)

MiB = 1 << 20
PARTIAL_SUFFIX = ".partial"
SIDECAR_SUFFIX = ".partial.json"
FETCHED_SUFFIX = ".fetched"  # the SHA-256 of a verified download, written just before it is renamed into place
LOCK_SUFFIX = ".lock"  # taken by one download at a time; never deleted (a waiter must lock the same file)
_SIDECAR_FORMAT = "tpu_shards.partial_download"
_HASH_BLOCK = 8 * MiB  # bytes read back from the partial file at a time for hashing
# How long a read of a range is retried on transient errors by default (google-cloud-storage's own default).
RETRY_SECONDS = 120.0
# How often a non-TTY progress line is logged, and how often a TTY bar is redrawn (seconds; tqdm's mininterval).
LOG_EVERY_S = 5.0
_BAR_EVERY_S = 0.2


class NotEnoughSpaceError(OSError):
  """The local disk cannot hold the download; nothing was written."""


class SourceChangedError(RuntimeError):
  """The object was replaced or deleted during the download; nothing of it was kept."""


@dataclasses.dataclass(frozen=True)
class DownloadOptions:
  """How a download runs.

  Attributes:
    streams: ranged reads in flight at once (threads).
    chunk_bytes: bytes per ranged read; each stream holds one chunk in memory.
    retries: at most this many further tries of a range after a transient error
      (formats.storage.retry.is_transient: HTTP 408/429/5xx, a dropped, cut or
      timed-out connection); None: as many as `retry_seconds` allows.
    backoff_s: the first wait's upper bound, doubled each retry (full jitter, at most the policy's
      maximum); None: the process policy's (formats.storage.retry.default(), INITIAL_S unless set).
    retry_seconds: the deadline of a range's retries, from its first try.
    progress: show progress: a bar on stderr when it is a terminal, else a log line every LOG_EVERY_S seconds.
    durable: fsync the file before it is renamed into place, and record what is on disk for a later call to
      resume (a cache that outlives the process); False for a copy nobody reads after a crash (the loaders'
      private stream folders): no fsync, no resume record.
    timeout_s: seconds a read may wait for the next bytes before it fails (a stalled stream) and is retried;
      None: formats.storage.gcs_media.DEFAULT_TIMEOUT_S.
  """

  streams: int = 8
  chunk_bytes: int = 32 * MiB
  retries: int | None = 5
  backoff_s: float | None = None
  retry_seconds: float = RETRY_SECONDS
  progress: bool = True
  durable: bool = True
  timeout_s: float | None = None

  def __post_init__(self):
    if not isinstance(self.streams, int) or self.streams < 1:
      raise ValueError(f"streams must be an integer >= 1, got {self.streams!r}")
    if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 4096:
      raise ValueError(f"chunk_bytes must be an integer >= 4096, got {self.chunk_bytes!r}")
    if self.retries is not None and (not isinstance(self.retries, int) or self.retries < 0):
      raise ValueError(f"retries must be an integer >= 0 or None, got {self.retries!r}")
    if self.backoff_s is not None and not 0 <= self.backoff_s <= retry.MAXIMUM_S:
      raise ValueError(f"backoff_s must be in [0, {retry.MAXIMUM_S:g}] or None, got {self.backoff_s!r}")
    if not 0 <= self.retry_seconds < float("inf"):
      raise ValueError(f"retry_seconds must be >= 0 and finite, got {self.retry_seconds!r}")
    if self.timeout_s is not None and not self.timeout_s > 0:
      raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")

  @property
  def policy(self) -> retry.Policy:
    """The retry policy of one range: the process's waits (from `backoff_s` when set), `retries` further tries
    at most, within `retry_seconds`."""
    policy = retry.default()
    initial = policy.initial if self.backoff_s is None else min(self.backoff_s, policy.maximum)
    attempts = None if self.retries is None else self.retries + 1
    return policy.replace(initial=initial, timeout=self.retry_seconds, attempts=attempts)


@dataclasses.dataclass(frozen=True)
class RangeCheck:
  """A byte range of the object whose CRC32C is known (a .graphbin section)."""

  name: str
  offset: int
  nbytes: int
  crc32c: int


class RemoteObject:
  """A gs:// object: its size, and the generation every read is pinned to.

  `remote_object(path)` asks the server for both (one metadata request). A
  reader that already knows the size (from a manifest) makes
  `RemoteObject(path, size)` instead: its first read pins the generation that
  answered, and every later read, from any thread, must come from that one.
  """

  def __init__(self, path: str, size: int, generation: int | None = None):
    self.path, self.size = path, int(size)
    self._generation = None if generation is None else int(generation)
    self._lock = threading.Lock()
    self.unconfirmed = False  # an answer did not name its generation: check it again when done (confirm)

  @property
  def generation(self) -> int | None:
    """The pinned generation (None until the first read of an object made without one)."""
    return self._generation

  def _answered(self, answer: gcs_media.MediaAnswer) -> None:
    """Pins the generation of a first answer; refuses an answer of another generation or size."""
    generation = answer.generation
    if generation is None:  # a server that does not name it (the emulator): one metadata request pins it
      self.unconfirmed = True
      if self._generation is not None:
        generation = self._generation  # ifGenerationMatch was sent: trust the server to have enforced it
      else:
        generation = remote_object(self.path).generation
    with self._lock:
      if self._generation is None:
        self._generation = generation
      elif generation != self._generation:
        raise SourceChangedError(f"{self.path} was replaced during the read (generation {self._generation} -> "
                                 f"{generation}); load it again")
    if answer.size != self.size:
      raise CorruptRecordError(f"{self.path}: {answer.size} bytes, the manifest says {self.size}")

  def confirm(self) -> None:
    """After the reads: if an answer did not name its generation, checks (one request) that it is still current.

    Raises:
      SourceChangedError: the object was replaced or deleted meanwhile.
    """
    if not self.unconfirmed:
      return
    try:
      now = remote_object(self.path)
    except FileNotFoundError:
      raise SourceChangedError(f"{self.path} was deleted during the download") from None
    if now.generation != self._generation:  # a server that ignores if_generation_match
      raise SourceChangedError(f"{self.path} was replaced during the download (generation {self._generation} "
                               f"-> {now.generation}); load it again")

  def __repr__(self) -> str:
    return f"RemoteObject({self.path!r}, size={self.size}, generation={self._generation})"


@dataclasses.dataclass
class DownloadStats:
  """What one call did (for tests, benchmarks and logs).

  Attributes:
    bytes_fetched: bytes read from the object in this call.
    ranges_fetched: the [start, stop) ranges read in this call, sorted.
    bytes_resumed: bytes an earlier call had left in the partial file and this one kept.
    retries: transient errors the range reads met (each retried unless the policy then gave up).
    seconds: wall time of the call.
  """

  bytes_fetched: int = 0
  ranges_fetched: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  bytes_resumed: int = 0
  retries: int = 0
  seconds: float = 0.0


def remote_object(path: str) -> RemoteObject:
  """The size and generation of a gs:// object (one metadata request).

  Args:
    path: a gs:// path.

  Returns:
    The object as it is now.

  Raises:
    FileNotFoundError: there is no such object.
  """
  blob = files.gcs_blob(path)
  try:
    blob.reload(retry=retry.named(path))
  except files.gcs_not_found():
    raise FileNotFoundError(path) from None
  return RemoteObject(path, int(blob.size), int(blob.generation))


def read_range(obj: RemoteObject, start: int, stop: int, options: DownloadOptions = DownloadOptions(),
               stats: DownloadStats | None = None) -> bytes:
  """Bytes [start, stop) of the object's pinned generation, retried on transient errors.

  Args:
    obj: the object (its generation, once pinned, is required to match).
    start: the first byte.
    stop: one past the last byte.
    options: the retry policy (`DownloadOptions.policy`) and the read timeout.
    stats: counts the transient errors met when given.

  Returns:
    Exactly stop - start bytes.

  Raises:
    SourceChangedError: the object was replaced (HTTP 412, or another generation answered) or deleted.
    CorruptRecordError: the object's size is not `obj.size`.
    formats.storage.retry.RetryExhausted: (a ConnectionError) transient errors outlasted the retries.
  """
  if stop <= start:
    return b""
  buffer = bytearray(stop - start)
  read_range_into(obj, start, buffer, options, stats)
  return bytes(buffer)


def read_range_into(obj: RemoteObject, start: int, buffer, options: DownloadOptions = DownloadOptions(),
                    stats: DownloadStats | None = None) -> None:
  """Fills `buffer` with the object's bytes [start, start + len(buffer)); as `read_range`, without a copy."""
  stop = start + len(buffer)
  read_timeout = options.timeout_s or gcs_media.DEFAULT_TIMEOUT_S

  def attempt(timeout: float) -> None:
    try:
      obj._answered(gcs_media.read_into(obj.path, start, buffer, generation=obj.generation,
                                        timeout=min(timeout, read_timeout)))
    except gcs_media.ObjectTooShort as e:
      raise CorruptRecordError(f"{obj.path}: {e.size} bytes, the manifest says {obj.size}") from None
    except gcs_media.GenerationMismatch:
      raise SourceChangedError(f"{obj.path} was replaced during the download (generation {obj.generation} "
                               "no longer current); load it again") from None
    except FileNotFoundError:
      if obj.generation is None:
        raise
      raise SourceChangedError(f"{obj.path} was deleted during the download") from None

  def failed(e: BaseException) -> None:
    if stats is not None:
      stats.retries += 1  # a racy count across threads is fine: it is a report
    logger.info("%s: bytes [%d, %d): %s: %s; retrying while the policy allows", obj.path, start, stop,
                type(e).__name__, e)

  options.policy.call(attempt, f"{obj.path}: bytes [{start}, {stop})", on_error=failed)


def download(obj: RemoteObject, dest: str, sha256: str, checks: Sequence[RangeCheck] = (),
             options: DownloadOptions = DownloadOptions(),
             pool: concurrent.futures.Executor | None = None) -> DownloadStats:
  """Downloads `obj` to the local file `dest`, verified, resuming an earlier partial download.

  Args:
    obj: the object (remote_object()); its generation is pinned.
    dest: the local file (its folder is created). Renamed into place only when verified.
    sha256: the expected hex SHA-256 of the whole object.
    checks: ranges whose CRC32C is checked as their bytes arrive.
    options: streams, chunk size, the retry policy of each range, progress.
    pool: the threads that run the ranged reads (a caller downloading many objects shares one); None: a pool
      of `options.streams` threads for this call. Either way at most `options.streams` reads are in flight.

  Returns:
    What was fetched.

  Raises:
    NotEnoughSpaceError: the disk of `dest` lacks room for what is still missing (checked before anything is written).
    CorruptRecordError: a range's CRC32C or the SHA-256 differs; the partial download is deleted.
    SourceChangedError: the object was replaced or deleted meanwhile; the partial download is deleted.
    formats.storage.retry.RetryExhausted: (a ConnectionError) a range kept failing; the partial download stays,
      and the next call resumes it.

  Two processes downloading into the same `dest` do not race: they take turns on `dest + ".lock"` (a file
  never deleted, so both always lock the same one). The second waits, then returns the copy the first
  renamed into place, or resumes the first's partial if it failed. Only a verified file is renamed
  into place, and a stamp (`dest + ".fetched"`, the SHA-256) is written just before: a `dest` without
  its stamp (a leftover of something else) is not trusted and is fetched again.
  """
  started = time.monotonic()
  stats = DownloadStats()
  folder = os.path.dirname(os.path.abspath(dest))
  if not _fetched(dest, sha256):
    _check_space(obj, folder, dest, _resumable_ranges(dest, obj))  # before anything is created; again below
  os.makedirs(folder, exist_ok=True)
  lock = os.open(dest + LOCK_SUFFIX, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      logger.info("%s: another process is downloading it into %s; waiting for it", obj.path, dest)
      fcntl.flock(lock, fcntl.LOCK_EX)
    if _fetched(dest, sha256):  # another process fetched and verified it (perhaps while this one waited)
      stats.seconds = time.monotonic() - started
      return stats
    _remove(dest)
    for attempt in (1, 2):
      try:
        _download_locked(obj, dest, sha256, checks, options, stats, pool)
        break
      except (CorruptRecordError, SourceChangedError):
        _discard(dest)
        if attempt == 2 or not stats.bytes_resumed:
          raise
        logger.warning("%s: a resumed partial download failed verification; fetching it again from scratch", obj.path)
        stats.bytes_resumed = 0
  finally:
    os.close(lock)  # releases the lock
  stats.seconds = time.monotonic() - started
  stats.ranges_fetched.sort()
  return stats


def _fetched(dest: str, sha256: str) -> bool:
  """Whether `dest` is a download of these very bytes that was verified before it was renamed into place."""
  try:
    with open(dest + FETCHED_SUFFIX) as f:
      return f.read() == sha256 and os.path.exists(dest)
  except OSError:
    return False


def _download_locked(obj: RemoteObject, dest: str, sha256: str, checks: Sequence[RangeCheck],
                     options: DownloadOptions, stats: DownloadStats, pool: concurrent.futures.Executor | None) -> None:
  """One attempt of `download`, with the lock held: resumes a partial that matches, else starts over."""
  folder = os.path.dirname(os.path.abspath(dest))
  done = _resumable_ranges(dest, obj)
  _check_space(obj, folder, dest, done)
  partial = dest + PARTIAL_SUFFIX
  fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    if not done:
      _start_over(fd, obj, dest, preallocate=options.durable)
    stats.bytes_resumed = sum(b - a for a, b in done)
    _Run(obj, dest, fd, sha256, checks, options, stats, done, pool).go()
    with open(dest + FETCHED_SUFFIX + ".tmp", "w") as f:  # the stamp first: a dest is never there without it
      f.write(sha256)
    os.replace(dest + FETCHED_SUFFIX + ".tmp", dest + FETCHED_SUFFIX)
    os.replace(partial, dest)
    _remove(dest + SIDECAR_SUFFIX)
  finally:
    os.close(fd)


class _Run:
  """One call's chunks in flight, the in-order verifier and the progress report."""

  def __init__(self, obj: RemoteObject, dest: str, fd: int, sha256: str, checks: Sequence[RangeCheck],
               options: DownloadOptions, stats: DownloadStats, done: list[tuple[int, int]],
               pool: concurrent.futures.Executor | None):
    self.obj, self.dest, self.fd, self.options, self.stats, self.pool = obj, dest, fd, options, stats, pool
    self.done = list(done)
    self.lock = threading.Lock()
    self.stop = threading.Event()
    self.verifier = _Verifier(obj.path, fd, sha256, checks)
    self.progress = _Progress(obj.path, obj.size, stats.bytes_resumed, options)
    self.buffers = threading.local()
    # Chunks fetched and written whose bytes are still in memory, for the verifier to hash without reading them
    # back: start -> (buffer, length); at most 2 x streams buffers, beyond that a chunk is hashed from disk.
    self.held: dict[int, tuple[bytearray, int]] = {}
    self.free: list[bytearray] = []
    self.allocated = 0

  def go(self) -> None:
    step = self.options.chunk_bytes
    todo = iter([(a, min(a + step, hi)) for lo, hi in _missing(self.done, self.obj.size) for a in range(lo, hi, step)])
    own = self.pool is None
    pool = self.pool or concurrent.futures.ThreadPoolExecutor(self.options.streams, thread_name_prefix="gcs-download")
    pending: set[concurrent.futures.Future] = set()
    ok = False
    try:
      while True:
        for a, b in itertools.islice(todo, self.options.streams - len(pending)):  # `streams` reads in flight
          pending.add(pool.submit(self._fetch, a, b))
        if not pending:
          break
        finished, pending = concurrent.futures.wait(pending, timeout=_BAR_EVERY_S,
                                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for f in finished:
          f.result()
        with self.lock:
          ready, have = _contiguous_end(self.done), sum(b - a for a, b in self.done)
        self.verifier.advance(ready, self)
        self.progress.update(have)
      self.verifier.advance(self.obj.size, self)
      self.verifier.finish()
      self.obj.confirm()  # every answer came from the pinned generation (or a server that does not say is asked)
      if self.options.durable:
        os.fsync(self.fd)
      ok = True
    finally:
      self.stop.set()
      for f in pending:
        f.cancel()
      concurrent.futures.wait(pending)  # the reads in flight end before the file is closed
      if own:
        pool.shutdown(wait=True)
      self.progress.close(ok, self.stats)

  def _fetch(self, start: int, stop: int) -> None:
    if self.stop.is_set():
      return
    buffer = self._buffer()
    view = memoryview(buffer)[:stop - start]
    read_range_into(self.obj, start, view, self.options, self.stats)
    at = start
    try:
      while view:
        n = os.pwrite(self.fd, view, at)
        view, at = view[n:], at + n
    except OSError as e:
      if e.errno != errno.ENOSPC:
        raise
      raise NotEnoughSpaceError(errno.ENOSPC, f"{self.obj.path}: the disk of {self.dest} filled up during the "
                                "download (pass cache_dir= to use another disk)") from None
    # No fdatasync per chunk: a killed process loses nothing the kernel holds, and after a power loss a
    # chunk the sidecar lists but the disk lost fails the digest of the resumed download, which then
    # starts over (see download). One fsync before the rename makes the finished file durable.
    with self.lock:
      if buffer is not getattr(self.buffers, "scratch", None):
        self.held[start] = (buffer, stop - start)
      self.done = _merge(self.done + [(start, stop)])
      self.stats.bytes_fetched += stop - start
      self.stats.ranges_fetched.append((start, stop))
      if self.options.durable:
        _write_sidecar(self.dest, self.obj, self.done)


  def _buffer(self) -> bytearray:
    """A chunk buffer the verifier will hash from (reused: no page faults), or this thread's scratch one."""
    with self.lock:
      if self.free:
        return self.free.pop()
      if self.allocated < 2 * self.options.streams:
        self.allocated += 1
        return bytearray(self.options.chunk_bytes)
    scratch = getattr(self.buffers, "scratch", None)
    if scratch is None:
      scratch = self.buffers.scratch = bytearray(self.options.chunk_bytes)
    return scratch

  def take_held(self, start: int) -> tuple[bytearray, int] | None:
    """The in-memory bytes of the chunk at `start`, if they are still held (the verifier's callback)."""
    with self.lock:
      return self.held.pop(start, None)

  def next_held(self, pos: int) -> int:
    """The start of the first chunk after `pos` still held in memory (or the object's size)."""
    with self.lock:
      return min((a for a in self.held if a > pos), default=self.obj.size)

  def give_back(self, buffer: bytearray) -> None:
    with self.lock:
      self.free.append(buffer)


class _Verifier:
  """The SHA-256 of the whole file and the CRC32C of each check, extended in file order."""

  def __init__(self, source: str, fd: int, sha256: str, checks: Iterable[RangeCheck]):
    self.source, self.fd, self.expected = source, fd, sha256
    self.hash = hashlib.sha256()
    self.pos = 0
    self.checks = sorted(checks, key=lambda c: (c.offset, c.nbytes))
    self.next = 0  # the first check not yet finished
    self.crcs: dict[int, int] = {}

  def advance(self, end: int, run: _Run | None = None) -> None:
    """Hashes the partial file's bytes [pos, end) (all on disk; a chunk still in `run`'s memory from there, not
    read back); raises at the first bad range."""
    while self.pos < end:
      held = run.take_held(self.pos) if run is not None else None
      if held is not None and self.pos + held[1] <= end:
        buffer, n = held
        view = memoryview(buffer)[:n]
        self.hash.update(view)
        if self.next < len(self.checks):  # google_crc32c takes bytes, not views: a copy only where checks remain
          self._extend(bytes(view), self.pos)
        self.pos += n
        run.give_back(buffer)
        continue
      if held is not None:  # not expected (chunks end where `end` may), but never skip: hash it from disk
        run.give_back(held[0])
      n = min(_HASH_BLOCK, end - self.pos, (run.next_held(self.pos) if run is not None else end) - self.pos)
      data = os.pread(self.fd, n, self.pos)
      if len(data) != n:
        raise OSError(f"{self.source}: the partial file ends at {self.pos + len(data)}, expected {end}")
      self.hash.update(data)
      self._extend(data, self.pos)
      self.pos += n

  def _extend(self, data: bytes, at: int) -> None:
    stop = at + len(data)
    i = self.next
    while i < len(self.checks) and self.checks[i].offset <= stop:
      c = self.checks[i]
      lo, hi = max(c.offset, at), min(c.offset + c.nbytes, stop)
      if hi > lo:
        self.crcs[i] = google_crc32c.extend(self.crcs.get(i, 0), data[lo - at:hi - at])
      if c.offset + c.nbytes <= stop:
        self._check(i)
        if i == self.next:
          self.next += 1
      i += 1

  def _check(self, i: int) -> None:
    c = self.checks[i]
    got = self.crcs.pop(i, 0)
    if got != c.crc32c:
      raise CorruptRecordError(f"{self.source}: section {c.name!r} at offset {c.offset} fails its checksum "
                               f"(CRC32C {got:08x}, its table says {c.crc32c:08x}); the download was discarded")

  def finish(self) -> None:
    """Checks the whole file's SHA-256 (every byte has been hashed)."""
    for i in range(self.next, len(self.checks)):  # ranges past the end: a bad table, never silently skipped
      c = self.checks[i]
      raise CorruptRecordError(f"{self.source}: section {c.name!r} at offset {c.offset} runs past the end")
    digest = self.hash.hexdigest()
    if digest != self.expected:
      raise CorruptRecordError(f"{self.source}: sha256 {digest[:12]}... differs from the manifest's "
                               f"{self.expected[:12]}... (corrupt or changed); the download was discarded")


class _Bar(tqdm.tqdm):
  """tqdm with the download's fields: megabytes, and the rate of this call's bytes in MB/s; no monitor thread."""

  monitor_interval = 0

  @property
  def format_dict(self):
    d = super().format_dict
    rate = (d["n"] - d["initial"]) / max(d["elapsed"], 1e-9)
    return {**d, "have": _mb(d["n"]), "size": _mb(d["total"] or 0), "mb_per_s": f"{rate / 1e6:.1f}"}


class _LogLines:
  """Where the bar is drawn when stderr is not a terminal: each line tqdm draws is logged instead."""

  def write(self, text: str) -> None:
    line = text.strip("\r\n ")
    if line:
      logger.info("%s", line)

  def flush(self) -> None:
    pass


class _Progress:
  """tqdm's bar on stderr when it is a terminal (redrawn every _BAR_EVERY_S), else its line logged every
  LOG_EVERY_S seconds; a summary line logged at the end."""

  _FORMAT = "{desc}: {have} / {size} ({percentage:.0f}%), {mb_per_s} MB/s, ETA {remaining}"

  def __init__(self, label: str, total: int, resumed: int, options: DownloadOptions):
    self.label, self.total, self.streams = label, total, options.streams
    self.start = time.monotonic()
    self.bar = None
    if not options.progress:
      return
    tty = sys.stderr.isatty()
    if not tty:
      logger.info("%s: downloading %s with %d streams%s", label, _mb(total), options.streams,
                  f", {_mb(resumed)} already on disk" if resumed else "")
    self.bar = _Bar(total=total, initial=resumed, desc=label, bar_format=self._FORMAT, smoothing=0,
                    file=sys.stderr if tty else _LogLines(), mininterval=_BAR_EVERY_S if tty else LOG_EVERY_S)

  def update(self, have: int) -> None:
    if self.bar is not None and have > self.bar.n:
      self.bar.update(have - self.bar.n)

  def close(self, ok: bool, stats: DownloadStats) -> None:
    if self.bar is None:
      return
    if ok:
      self.update(self.total)
    self.bar.close()
    elapsed = time.monotonic() - self.start
    logger.info("%s: %s %s in %.1f s (%.1f MB/s, %d streams, %d retries)", self.label,
                "downloaded" if ok else "stopped after", _mb(stats.bytes_fetched), elapsed,
                stats.bytes_fetched / max(elapsed, 1e-9) / 1e6, self.streams, stats.retries)


def _mb(n: int) -> str:
  return f"{n / 1e6:.1f} MB"


# --------------------------------------------------------------------------- the partial file and its sidecar


def _resumable_ranges(dest: str, obj: RemoteObject) -> list[tuple[int, int]]:
  """The ranges a partial download of this very object has on disk; [] when there is none to resume."""
  try:
    with open(dest + SIDECAR_SUFFIX, "rb") as f:
      state = json.loads(f.read())
    size = os.path.getsize(dest + PARTIAL_SUFFIX)
  except (OSError, ValueError):
    return []
  if obj.generation is None:  # an object not looked up: which generation the partial holds is unknown
    return []
  same = (isinstance(state, dict) and state.get("format") == _SIDECAR_FORMAT and state.get("source") == obj.path
          and state.get("generation") == str(obj.generation) and state.get("size") == obj.size == size)
  if not same:
    logger.info("%s: the partial download in %s is of another generation or size; starting over", obj.path, dest)
    return []
  try:
    done = _merge([(int(a), int(b)) for a, b in state["done"]])
  except (KeyError, TypeError, ValueError):
    return []
  return [(a, b) for a, b in done if 0 <= a < b <= obj.size]


def _write_sidecar(dest: str, obj: RemoteObject, done: list[tuple[int, int]]) -> None:
  if obj.generation is None:  # nothing answered yet: nothing to resume
    return
  tmp = dest + SIDECAR_SUFFIX + ".tmp"
  with open(tmp, "w") as f:
    json.dump({"format": _SIDECAR_FORMAT, "source": obj.path, "generation": str(obj.generation),
               "size": obj.size, "done": [list(r) for r in done]}, f)
  os.replace(tmp, dest + SIDECAR_SUFFIX)


def _start_over(fd: int, obj: RemoteObject, dest: str, preallocate: bool = True) -> None:
  """Empties the (locked) partial file, preallocates it, and records that nothing is on disk yet.

  preallocate=False leaves it sparse: writing into preallocated (unwritten) extents costs ext4 about 2
  CPU-seconds per GB against 0.2 into a sparse file (measured here), which a private cache that checked its
  room first need not pay; a download that runs out of room then fails with NotEnoughSpaceError mid-way.
  """
  _remove(dest + SIDECAR_SUFFIX)
  os.ftruncate(fd, 0)
  if not preallocate:
    os.ftruncate(fd, obj.size)
    return
  try:
    if obj.size:
      os.posix_fallocate(fd, 0, obj.size)
  except OSError as e:
    if e.errno == errno.ENOSPC:
      os.ftruncate(fd, 0)
      _discard(dest)
      raise NotEnoughSpaceError(errno.ENOSPC, f"{obj.path}: no room for {obj.size:,} bytes in "
                                f"{os.path.dirname(os.path.abspath(dest))} (pass cache_dir= to use another disk)")
    os.ftruncate(fd, obj.size)  # a file system without fallocate: a sparse file
  _write_sidecar(dest, obj, [])


def _discard(dest: str) -> None:
  for p in (dest + PARTIAL_SUFFIX, dest + SIDECAR_SUFFIX, dest + SIDECAR_SUFFIX + ".tmp"):
    _remove(p)


def _remove(path: str) -> None:
  try:
    os.remove(path)
  except FileNotFoundError:
    pass


def _check_space(obj: RemoteObject, folder: str, dest: str, done: list[tuple[int, int]]) -> None:
  """Raises NotEnoughSpaceError unless the disk of `folder` can take what is still missing."""
  try:  # a partial (this call's to resume, or another process's in progress) already holds its blocks
    have = min(os.stat(dest + PARTIAL_SUFFIX).st_blocks * 512, obj.size)
  except OSError:
    have = 0
  needed = obj.size - have
  free = files.free_bytes(folder)
  if needed > free:
    raise NotEnoughSpaceError(errno.ENOSPC, f"not enough space to download {obj.path}: needs {needed:,} bytes, "
                              f"{free:,} free in {folder} (pass cache_dir= to use another disk)")


# --------------------------------------------------------------------------- byte ranges


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
  out: list[tuple[int, int]] = []
  for a, b in sorted(ranges):
    if out and a <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], b))
    else:
      out.append((a, b))
  return out


def _missing(done: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
  out, at = [], 0
  for a, b in done:
    if a > at:
      out.append((at, a))
    at = max(at, b)
  if at < size:
    out.append((at, size))
  return out


def _contiguous_end(done: list[tuple[int, int]]) -> int:
  return done[0][1] if done and done[0][0] == 0 else 0
