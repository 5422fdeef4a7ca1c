"""A lean local GCS JSON API server over a folder, for benchmarks that measure the client.

    python scripts/bench_bucket.py --root /tmp/buckets --port 0 --latency_ms 30 --mbps 100
    # prints http://127.0.0.1:PORT; then STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT

    sys.path.insert(0, "scripts"); import bench_bucket
    gs = bench_bucket.stage("/tmp/buckets", "bench", "/data/shards", "shards")  # gs://bench/shards
    with bench_bucket.BenchBucket("/tmp/buckets", latency_ms=30.0, mbps=100.0) as bucket, bucket.active():
      bucket.warm(gs)                             # hashes every object once, before measuring
      cpu0, srv0 = bench_bucket.client_cpu_seconds(), bucket.server_cpu_seconds()
      ...                                         # read gs:// through formats.storage.files / google-cloud-storage
      client_cpu = bench_bucket.client_cpu_seconds() - cpu0

Why: benchmarks report client CPU-seconds per GB read from gs://. Against
gcp-storage-emulator (pure Python, tens of MB/s, several ms of CPU per request)
on the same 2 cores, the emulator's own CPU hid the client's cost. This
server runs in its own process (its CPU is measured apart, see
`BenchBucket.server_cpu_seconds`), sends object bytes with sendfile(2)
(zero-copy) and does little Python work per request, while adding what a
real bucket has and loopback lacks: first-byte latency and a per-connection
bandwidth cap.

What it serves (what google-cloud-storage 3.x sends with STORAGE_EMULATOR_HOST):
  * bucket B is the folder ROOT/B, object N (may contain '/') the file ROOT/B/N;
    only regular files inside ROOT are served (a '..', '.' or empty name
    component is a 400, a symbolic link resolving outside ROOT a 404);
  * GET  /storage/v1/b/B                        bucket metadata (POST /storage/v1/b creates one);
  * GET  /storage/v1/b/B/o/N                    object metadata (size, generation, crc32c, md5Hash, ...);
  * GET  /storage/v1/b/B/o/N?alt=media and /download/storage/v1/b/B/o/N?alt=media
                                                the bytes, with `Range: bytes=a-b | a- | -n` (206, 416);
  * GET  /storage/v1/b/B/o                      listing: prefix, delimiter, pageToken, maxResults
                                                (at most 1000), startOffset, endOffset;
  * POST /upload/storage/v1/b/B/o               uploadType=media | multipart | resumable (then PUT
                                                chunks to the session URL; DELETE cancels it);
  * DELETE /storage/v1/b/B/o/N;
  * GET  /_bench/stats                          {requests, bytes_sent, throttle_sleeps, ..., the flags}.
Preconditions are enforced as GCS does, atomically under one write lock:
`generation` (404 when it is not the current one), `ifGenerationMatch` (0: must
not exist), `ifGenerationNotMatch` (304 on reads), `ifMetagenerationMatch` /
`ifMetagenerationNotMatch` (412). The generation of an object is derived from
its file, `(st_mtime_ns // 1000) * 1000 + st_ino % 1000`: stable while the file
is unchanged, new when it is replaced (an upload keeps it increasing). CRC32C
and MD5 are computed once per (device, inode, size, mtime) and cached: the first
touch of a large object hashes it (`warm` does that before a measurement;
`hash_seconds` in the stats reports the time spent).

What it does not: no authentication or ACLs, no versioned buckets (only the
live generation exists), no compose, rewrite or copy, no custom metadata (the
content type is always application/octet-stream), no gzip transcoding, no
`fields=` filtering (whole resources are returned, which GCS clients accept),
no `matchGlob`. Anything else gets a 501 in GCS's error shape, never a hang.
Symbolic links to folders are not descended by listings; the pages after a
listing's first reuse its walk of the folder (for _LIST_REUSE_S, unless
something was written through the server meanwhile). Files staged by hard
link (`stage`) are the source files: changing a source in place changes the
object.

Flags: --root (the folder of buckets), --host (127.0.0.1), --port (0: a free
one; the URL is printed on stdout), --latency_ms (first-byte latency added
before the status line of every request, 30), --jitter_ms (a uniform extra,
0), --mbps (per-connection cap in MB/s for object bytes, 100; 0: none),
--verbose (one line per request on stderr; quiet by default).
"""

from __future__ import annotations

import argparse
import base64
import bisect
import contextlib
import dataclasses
import errno
import hashlib
import http
import itertools
import json
import os
import random
import re
import resource
import select
import shutil
import socket
import socketserver
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid

DEFAULT_LATENCY_MS = 30.0
DEFAULT_MBPS = 100.0
PAGE_SIZE = 1000  # GCS's default and largest listing page
SLICE_BYTES = 256 * 1024  # bytes per sendfile call when a bandwidth cap paces a body
_MIN_SLEEP_S = 0.0002  # a shorter wait for the cap is not worth a sleep
_LIST_REUSE_S = 60.0  # how long the pages after a listing's first reuse its walk of the folder
_MAX_CHAR = chr(0x10FFFF)  # sorts after every character of an object name
_HASH_BLOCK = 4 * 1024 * 1024
_HASH_CACHE_MAX = 200_000  # entries; the cache is dropped whole when it grows past this
_TMP_DIR = ".bench_tmp"  # under ROOT; a name no bucket can have (bucket names start with a letter or digit)
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
_CONTENT_RANGE_RE = re.compile(r"^bytes (?:(\d+)-(\d+)|\*)/(\d+|\*)$")
_MAX_LINE = 65536
_REASONS = {s.value: s.phrase for s in http.HTTPStatus}
_REASONS[499] = "Client Closed Request"
_ERROR_REASONS = {400: "invalid", 304: "notModified", 404: "notFound", 405: "methodNotAllowed", 409: "conflict",
                  412: "conditionNotMet", 416: "requestedRangeNotSatisfiable", 499: "clientClosedRequest",
                  500: "backendError", 501: "notImplemented"}


@dataclasses.dataclass(frozen=True)
class ServerOptions:
  """What the server adds to loopback.

  Attributes:
    latency_ms: first-byte latency added to every request, before its status line.
    jitter_ms: a uniform random extra on top of `latency_ms`.
    mbps: per-connection bandwidth cap for object bytes in MB/s (10**6 bytes); 0 for none.
  """

  latency_ms: float = DEFAULT_LATENCY_MS
  jitter_ms: float = 0.0
  mbps: float = DEFAULT_MBPS

  def __post_init__(self):
    for name in ("latency_ms", "jitter_ms", "mbps"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")


class _HttpError(Exception):
  """An answer in GCS's error shape."""

  def __init__(self, code: int, message: str, headers: dict[str, str] | None = None):
    super().__init__(message)
    self.code, self.message, self.headers = code, message, headers or {}


def _error_body(code: int, message: str) -> bytes:
  reason = _ERROR_REASONS.get(code, "error")
  return json.dumps({"error": {"code": code, "message": message,
                               "errors": [{"message": message, "domain": "global", "reason": reason}]}}).encode()


def _rfc3339(ns: int) -> str:
  return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns // 10**9)) + f".{ns // 10**6 % 1000:03d}Z"


def generation_of(st: os.stat_result) -> int:
  """The object generation of a file: stable while unchanged, new when the file is replaced."""
  return (st.st_mtime_ns // 1000) * 1000 + st.st_ino % 1000


def _hashes_of(data: bytes) -> tuple[str, str]:
  import google_crc32c

  crc = google_crc32c.value(data)
  return base64.b64encode(crc.to_bytes(4, "big")).decode(), base64.b64encode(hashlib.md5(data).digest()).decode()


def _query_int(params: dict[str, str], key: str) -> int | None:
  value = params.get(key)
  if value is None:
    return None
  try:
    return int(value)
  except ValueError:
    raise _HttpError(400, f"Invalid value for {key}: {value!r}") from None


# --------------------------------------------------------------------------- the folder of buckets


class _Store:
  """Buckets as folders: name checks, metadata, hashes, listing and atomic writes."""

  def __init__(self, root: str):
    self.root = os.path.realpath(root)
    self.tmp = os.path.join(self.root, _TMP_DIR)
    os.makedirs(self.tmp, exist_ok=True)
    self.write_lock = threading.Lock()  # every write and delete checks its preconditions and commits under it
    self.hash_lock = threading.Lock()
    self.hashes: dict[tuple[int, int, int, int], tuple[str, str]] = {}
    self.hash_seconds = 0.0
    self.uploads: dict[str, _Upload] = {}
    self.writes = 0  # commits and deletes so far: a listing walked before one is not reused
    self.last_listing: tuple | None = None

  def _inside(self, real: str) -> bool:
    return real.startswith(self.root + os.sep)

  def bucket_dir(self, bucket: str) -> str:
    """The folder of a bucket; 404 when there is none."""
    if not _BUCKET_RE.match(bucket):
      raise _HttpError(400, f"Invalid bucket name: {bucket!r}")
    path = os.path.join(self.root, bucket)
    real = os.path.realpath(path)
    if not (self._inside(real) and os.path.isdir(real)):
      raise _HttpError(404, f"The specified bucket does not exist: {bucket}")
    return real

  def object_path(self, bucket: str, name: str) -> str:
    """The file path of an object name (not checked for existence); 400 for a name no file can carry."""
    parts = name.split("/")
    if not name or "\0" in name or len(name.encode()) > 1024 or any(p in ("", ".", "..") for p in parts):
      raise _HttpError(400, f"Invalid object name for a folder bucket: {name!r}")
    return os.path.join(self.bucket_dir(bucket), *parts)

  def open(self, bucket: str, name: str) -> tuple[int, os.stat_result]:
    """An fd and the fstat of an object's file (the caller closes the fd); 404 when there is none."""
    path = self.object_path(bucket, name)
    real = os.path.realpath(path)
    if not self._inside(real):
      raise _HttpError(404, f"No such object: {bucket}/{name}")
    try:
      fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
      raise _HttpError(404, f"No such object: {bucket}/{name}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      os.close(fd)
      raise _HttpError(404, f"No such object: {bucket}/{name}")
    return fd, st

  def current(self, bucket: str, name: str) -> os.stat_result | None:
    """The stat of an object's file, None when there is none."""
    try:
      fd, st = self.open(bucket, name)
    except _HttpError as e:
      if e.code == 404:
        return None
      raise
    os.close(fd)
    return st

  def object_hashes(self, fd: int, st: os.stat_result) -> tuple[str, str]:
    """(crc32c, md5Hash) in base64, as GCS gives them; computed once per file version."""
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    found = self.hashes.get(key)
    if found is not None:
      return found
    import google_crc32c

    with self.hash_lock:
      found = self.hashes.get(key)
      if found is not None:
        return found
      started = time.monotonic()
      crc, md5, at = 0, hashlib.md5(), 0
      while at < st.st_size:
        block = os.pread(fd, min(_HASH_BLOCK, st.st_size - at), at)
        if not block:
          break
        crc = google_crc32c.extend(crc, block)
        md5.update(block)
        at += len(block)
      found = (base64.b64encode(crc.to_bytes(4, "big")).decode(), base64.b64encode(md5.digest()).decode())
      if len(self.hashes) >= _HASH_CACHE_MAX:
        self.hashes.clear()
      self.hashes[key] = found
      self.hash_seconds += time.monotonic() - started
      return found

  def resource(self, bucket: str, name: str, fd: int, st: os.stat_result, host: str) -> dict:
    """The object's JSON resource (storage#object)."""
    gen = generation_of(st)
    crc, md5 = self.object_hashes(fd, st)
    quoted = urllib.parse.quote(name, safe="~")
    stamp = _rfc3339(st.st_mtime_ns)
    return {
        "kind": "storage#object", "id": f"{bucket}/{name}/{gen}",
        "selfLink": f"{host}/storage/v1/b/{bucket}/o/{quoted}",
        "mediaLink": f"{host}/download/storage/v1/b/{bucket}/o/{quoted}?generation={gen}&alt=media",
        "name": name, "bucket": bucket, "generation": str(gen), "metageneration": "1",
        "contentType": "application/octet-stream", "storageClass": "STANDARD", "size": str(st.st_size),
        "md5Hash": md5, "crc32c": crc, "etag": base64.b64encode(gen.to_bytes(8, "big")).decode().rstrip("="),
        "timeCreated": stamp, "updated": stamp, "timeStorageClassUpdated": stamp,
    }

  def resource_of(self, bucket: str, name: str, host: str) -> dict:
    fd, st = self.open(bucket, name)
    try:
      return self.resource(bucket, name, fd, st, host)
    finally:
      os.close(fd)

  # ------------------------------------------------------------------------- listing

  def _names(self, bucket: str, prefix: str, collapse: bool) -> list[str]:
    """Object names under `prefix`, plus, when `collapse`, 'dir/' for each folder one level past it that holds
    a file (its names would all collapse into that prefix with delimiter '/')."""
    base = self.bucket_dir(bucket)
    head = prefix.rpartition("/")[0]
    if head:
      parts = head.split("/")
      if any(p in ("", ".", "..") for p in parts):
        return []
      start = os.path.join(base, *parts)
      real = os.path.realpath(start)
      if not (self._inside(real) and os.path.isdir(real)) or os.path.islink(start):
        return []
      head += "/"
    else:
      start = base
    out: list[str] = []
    stack = [(start, head)]
    while stack:
      folder, rel = stack.pop()
      try:
        entries = list(os.scandir(folder))
      except OSError:
        continue
      for e in entries:
        name = rel + e.name
        if e.is_dir(follow_symlinks=False):
          if not (name + "/").startswith(prefix) and not prefix.startswith(name + "/"):
            continue
          if collapse and len(name) >= len(prefix):
            if self._holds_file(e.path):
              out.append(name + "/")
          else:
            stack.append((e.path, name + "/"))
        elif name.startswith(prefix) and self._is_file(e):
          out.append(name)
    out.sort()
    return out

  def _is_file(self, e: os.DirEntry) -> bool:
    if not e.is_symlink():
      return e.is_file()
    real = os.path.realpath(e.path)
    return self._inside(real) and os.path.isfile(real)

  def _holds_file(self, folder: str) -> bool:
    stack = [folder]
    while stack:
      try:
        entries = list(os.scandir(stack.pop()))
      except OSError:
        continue
      for e in entries:
        if e.is_dir(follow_symlinks=False):
          stack.append(e.path)
        elif self._is_file(e):
          return True
    return False

  def _listing(self, bucket: str, prefix: str, collapse: bool, continued: bool) -> list[str]:
    """The sorted keys of a listing; a continued one (a pageToken) reuses the walk of its first page while
    nothing was written through the server and _LIST_REUSE_S has not passed."""
    key = (bucket, prefix, collapse)
    cached = self.last_listing
    if continued and cached and cached[0] == key and cached[1] == self.writes and \
        time.monotonic() - cached[2] < _LIST_REUSE_S:
      return cached[3]
    keys = self._names(bucket, prefix, collapse)
    self.last_listing = (key, self.writes, time.monotonic(), keys)
    return keys

  def list(self, bucket: str, params: dict[str, str], host: str) -> dict:
    """One page of a listing (storage#objects)."""
    if "matchGlob" in params:
      raise _HttpError(501, "matchGlob is not implemented by the bench bucket")
    prefix, delimiter = params.get("prefix", ""), params.get("delimiter", "")
    start, end = params.get("startOffset", ""), params.get("endOffset", "")
    limit = _query_int(params, "maxResults") or PAGE_SIZE
    limit = max(1, min(limit, PAGE_SIZE))
    token = params.get("pageToken", "")
    try:
      after = base64.urlsafe_b64decode(token.encode()).decode() if token else None
    except ValueError:
      raise _HttpError(400, f"Invalid pageToken: {token!r}") from None
    # Folders are pruned into prefixes only when no offset could exclude some of their names.
    keys = self._listing(bucket, prefix, delimiter == "/" and not start and not end, continued=bool(token))
    at = bisect.bisect_left(keys, start) if start else 0
    if after is not None:
      at = max(at, bisect.bisect_right(keys, after))
      if delimiter and after.endswith(delimiter):  # the last page ended on a prefix: skip its names
        at = max(at, bisect.bisect_left(keys, after + _MAX_CHAR))
    items, prefixes, last, more = [], [], None, False
    for key in itertools.islice(keys, at, None):
      if end and key >= end:
        break
      entry, is_prefix = key, False
      if delimiter:
        i = key.find(delimiter, len(prefix))
        if i >= 0:  # a name that ends with the delimiter is a prefix too, as in GCS
          entry, is_prefix = key[:i + len(delimiter)], True
      if entry == last:  # the names of one prefix are contiguous in sorted order
        continue
      if len(items) + len(prefixes) == limit:
        more = True
        break
      last = entry
      (prefixes if is_prefix else items).append(entry)
    out: dict = {"kind": "storage#objects"}
    resources = []
    for name in items:
      try:
        resources.append(self.resource_of(bucket, name, host))
      except _HttpError:  # removed since it was listed
        pass
    if resources:
      out["items"] = resources
    if prefixes:
      out["prefixes"] = prefixes
    if more:
      out["nextPageToken"] = base64.urlsafe_b64encode(last.encode()).decode()
    return out

  # ------------------------------------------------------------------------- writes

  def check(self, st: os.stat_result | None, params: dict[str, str], read: bool) -> None:
    """Raises GCS's answer when a precondition in `params` fails for the current file `st` (None: absent)."""
    gen = generation_of(st) if st is not None else 0
    match = _query_int(params, "ifGenerationMatch")
    if match is not None and match != gen:
      raise _HttpError(412, "At least one of the pre-conditions you specified did not hold.")
    not_match = _query_int(params, "ifGenerationNotMatch")
    if not_match is not None and not_match == gen:
      raise _HttpError(304 if read else 412, "At least one of the pre-conditions you specified did not hold.")
    meta = _query_int(params, "ifMetagenerationMatch")
    if meta is not None and (st is None or meta != 1):
      raise _HttpError(412, "At least one of the pre-conditions you specified did not hold.")
    not_meta = _query_int(params, "ifMetagenerationNotMatch")
    if not_meta is not None and st is not None and not_meta == 1:
      raise _HttpError(304 if read else 412, "At least one of the pre-conditions you specified did not hold.")

  def new_tmp(self) -> str:
    return os.path.join(self.tmp, uuid.uuid4().hex)

  def commit(self, bucket: str, name: str, tmp: str, params: dict[str, str], host: str,
             hashes: tuple[str, str] | None = None) -> dict:
    """Moves the finished temp file into place if the preconditions hold (one lock: compare and swap)."""
    try:
      path = self.object_path(bucket, name)
      with self.write_lock:
        old = self.current(bucket, name)
        self.check(old, params, read=False)
        if os.path.isdir(path):
          raise _HttpError(409, f"{name!r} is a folder in this bench bucket and cannot be an object too")
        parent = os.path.dirname(path)
        try:
          os.makedirs(parent, exist_ok=True)
        except OSError:
          raise _HttpError(409, f"a folder of {name!r} is an object in this bench bucket") from None
        if not self._inside(os.path.realpath(parent) + os.sep + "x"):
          raise _HttpError(404, f"No such object: {bucket}/{name}")
        os.replace(tmp, path)
        self.writes += 1
        st = os.stat(path)
        if old is not None and generation_of(st) <= generation_of(old):  # same microsecond: keep it increasing
          os.utime(path, ns=(st.st_atime_ns, (generation_of(old) // 1000 + 1) * 1000))
          st = os.stat(path)
        if hashes is not None:
          self.hashes[(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)] = hashes
      return self.resource_of(bucket, name, host)
    finally:
      with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)

  def delete(self, bucket: str, name: str, params: dict[str, str]) -> None:
    path = self.object_path(bucket, name)
    with self.write_lock:
      old = self.current(bucket, name)
      if old is None:
        raise _HttpError(404, f"No such object: {bucket}/{name}")
      self.check(old, params, read=False)
      gen = _query_int(params, "generation")
      if gen is not None and gen != generation_of(old):
        raise _HttpError(404, f"No such object: {bucket}/{name}")
      os.remove(path)
      self.writes += 1
      base, folder = self.bucket_dir(bucket), os.path.dirname(path)
      while folder != base and folder.startswith(base):
        try:
          os.rmdir(folder)
        except OSError:
          break
        folder = os.path.dirname(folder)


@dataclasses.dataclass
class _Upload:
  """A resumable upload in progress."""

  bucket: str
  name: str
  tmp: str
  params: dict[str, str]
  total: int | None
  received: int = 0
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


# --------------------------------------------------------------------------- HTTP


@dataclasses.dataclass
class _Request:
  """One parsed request: `path` still URL-quoted, `params` decoded, header names lower-case."""

  method: str
  target: str
  path: str
  params: dict[str, str]
  headers: dict[str, str]
  body: bytes
  close: bool


class _Handler(socketserver.BaseRequestHandler):
  """One connection: requests in a loop (HTTP/1.1 keep-alive), answered in order."""

  server: _Server

  def setup(self):
    self.sock: socket.socket = self.request
    self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    self.rfile = self.sock.makefile("rb", buffering=65536)
    self.schedule = 0.0  # when this connection's capped bytes so far are delivered (time.monotonic)
    self.server.stats_add("connections", 1)

  def finish(self):
    self.rfile.close()

  def handle(self):
    while True:
      try:
        req = self._read()
      except (ConnectionError, TimeoutError, ValueError, OSError):
        return
      if req is None:
        return
      try:
        close = self._serve(req) or req.close
      except (ConnectionError, BrokenPipeError, TimeoutError):
        return
      if close:
        return

  def _read(self) -> _Request | None:
    line = self.rfile.readline(_MAX_LINE)
    while line in (b"\r\n", b"\n"):  # stray blank lines between requests
      line = self.rfile.readline(_MAX_LINE)
    if not line:
      return None
    method, target, version = line.decode("latin-1").split()
    headers = {}
    while True:
      h = self.rfile.readline(_MAX_LINE)
      if h in (b"\r\n", b"\n", b""):
        break
      k, _, v = h.decode("latin-1").partition(":")
      headers[k.strip().lower()] = v.strip()
    if headers.get("expect", "").lower() == "100-continue":
      self.sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if headers.get("transfer-encoding", "").lower() == "chunked":
      body = self._read_chunked()
    else:
      n = int(headers.get("content-length") or 0)
      body = self.rfile.read(n) if n else b""
      if len(body) != n:
        raise ConnectionError("short body")
    conn = headers.get("connection", "").lower()
    close = conn == "close" or (version == "HTTP/1.0" and conn != "keep-alive")
    path, _, query = target.partition("?")
    params = dict(urllib.parse.parse_qsl(query, keep_blank_values=True)) if query else {}
    return _Request(method, target, path, params, headers, body, close)

  def _read_chunked(self) -> bytes:
    parts = []
    while True:
      size = int(self.rfile.readline(_MAX_LINE).split(b";")[0].strip() or b"0", 16)
      if size == 0:
        while self.rfile.readline(_MAX_LINE) not in (b"\r\n", b"\n", b""):  # trailers
          pass
        return b"".join(parts)
      parts.append(self.rfile.read(size))
      self.rfile.readline(_MAX_LINE)

  def _serve(self, req: _Request) -> bool:
    """Answers one request; True when the connection must be closed."""
    server = self.server
    if req.path.startswith("/_bench/"):
      if req.path == "/_bench/stats" and req.method == "GET":
        return self._json(200, server.stats_json())
      return self._error(_HttpError(501, f"{req.method} {req.path} is not implemented"))
    server.stats_add("requests", 1)
    if server.verbose:
      print(f"{req.method} {req.target} range={req.headers.get('range')} len={len(req.body)}", file=sys.stderr,
            flush=True)
    server.wait_first_byte()
    try:
      return self._route(req)
    except _HttpError as e:
      return self._error(e)
    except Exception as e:  # a bug here must answer, never hang the client
      import traceback

      traceback.print_exc(file=sys.stderr)
      self._error(_HttpError(500, f"{type(e).__name__}: {e}"))
      return True

  def _route(self, req: _Request) -> bool:
    store, host = self.server.store, "http://" + req.headers.get("host", self.server.url_host)
    path, m = req.path, req.method
    if path.startswith("/download/storage/v1/b/"):
      bucket, name = _bucket_object(path[len("/download/storage/v1/b/"):])
      if m == "GET" and name and "/" not in name:
        return self._media(req, bucket, urllib.parse.unquote(name))
    elif path.startswith("/upload/storage/v1/b/"):
      bucket, name = _bucket_object(path[len("/upload/storage/v1/b/"):])
      if name == "" and path.endswith("/o"):
        return self._upload(req, bucket, host)
    elif path.startswith("/storage/v1/b"):
      rest = path[len("/storage/v1/b"):]
      if rest in ("", "/"):
        if m == "POST":
          return self._create_bucket(req)
      else:
        bucket, name = _bucket_object(rest[1:])
        if name is None:
          if m == "GET":
            store.bucket_dir(bucket)
            return self._json(200, {"kind": "storage#bucket", "id": bucket, "name": bucket, "projectNumber": "0",
                                    "metageneration": "1", "location": "US", "storageClass": "STANDARD",
                                    "etag": "CAE=", "timeCreated": _rfc3339(0), "updated": _rfc3339(0)})
        elif name == "":
          if m == "GET":
            return self._json(200, store.list(bucket, req.params, host))
        elif "/" not in name:
          name = urllib.parse.unquote(name)
          if m == "GET" and req.params.get("alt") == "media":
            return self._media(req, bucket, name)
          if m == "GET":
            fd, st = self._open_checked(bucket, name, req.params)
            try:
              return self._json(200, store.resource(bucket, name, fd, st, host))
            finally:
              os.close(fd)
          if m == "DELETE":
            store.delete(bucket, name, req.params)
            return self._send(204, {}, b"")
    raise _HttpError(501, f"{m} {path} is not implemented by the bench bucket")

  def _open_checked(self, bucket: str, name: str, params: dict[str, str]) -> tuple[int, os.stat_result]:
    fd, st = self.server.store.open(bucket, name)
    try:
      gen = _query_int(params, "generation")
      if gen is not None and gen != generation_of(st):
        raise _HttpError(404, f"No such object: {bucket}/{name}#{gen}")
      self.server.store.check(st, params, read=True)
    except BaseException:
      os.close(fd)
      raise
    return fd, st

  # ------------------------------------------------------------------------- media

  def _media(self, req: _Request, bucket: str, name: str) -> bool:
    fd, st = self._open_checked(bucket, name, req.params)
    try:
      size = st.st_size
      crc, md5 = self.server.store.object_hashes(fd, st)
      gen = generation_of(st)
      headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                 "x-goog-generation": str(gen), "x-goog-metageneration": "1",
                 "x-goog-hash": f"crc32c={crc},md5={md5}", "x-goog-stored-content-length": str(size),
                 "x-goog-stored-content-encoding": "identity", "ETag": f'"{base64.b64decode(md5).hex()}"'}
      start, stop, status = 0, size, 200
      rng = req.headers.get("range")
      if rng:
        parsed = _parse_range(rng, size)
        if parsed is None:  # unsatisfiable
          raise _HttpError(416, "The requested range cannot be satisfied.",
                           {"Content-Range": f"bytes */{size}"})
        start, stop = parsed
        status = 206
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
      headers["Content-Length"] = str(stop - start)
      self._send_head(status, headers)
      self._send_file(fd, start, stop - start)
      return False
    finally:
      os.close(fd)

  def _send_file(self, fd: int, offset: int, count: int) -> None:
    server = self.server
    rate = server.options.mbps * 1e6
    if not rate:
      self._sendfile(fd, offset, count)
      return
    while count > 0:  # each slice goes when the cap would have delivered it: the body ends count / rate late
      n = min(SLICE_BYTES, count)
      now = time.monotonic()
      due = max(self.schedule, now) + n / rate
      if due - now > _MIN_SLEEP_S:
        server.stats_add("throttle_sleeps", 1)
        time.sleep(due - now)
      self._sendfile(fd, offset, n)
      self.schedule = due
      offset, count = offset + n, count - n

  def _sendfile(self, fd: int, offset: int, count: int) -> None:
    sock_fd = self.sock.fileno()
    sent_total = 0
    while count > 0:
      try:
        sent = os.sendfile(sock_fd, fd, offset, count)
      except BlockingIOError:
        select.select([], [sock_fd], [])
        continue
      if sent == 0:
        raise ConnectionError("the file ended early or the peer went away")
      offset, count, sent_total = offset + sent, count - sent, sent_total + sent
    self.server.stats_add("bytes_sent", sent_total)

  # ------------------------------------------------------------------------- uploads

  def _upload(self, req: _Request, bucket: str, host: str) -> bool:
    store, params, kind = self.server.store, req.params, req.params.get("uploadType", "")
    store.bucket_dir(bucket)
    if req.method == "POST" and kind == "media":
      name = params.get("name") or ""
      return self._write(bucket, name, req.body, params, host, {})
    if req.method == "POST" and kind == "multipart":
      meta, data = _parse_multipart(req.headers.get("content-type", ""), req.body)
      name = params.get("name") or meta.get("name") or ""
      return self._write(bucket, name, data, params, host, meta)
    if req.method == "POST" and kind == "resumable" and "upload_id" not in params:
      meta = json.loads(req.body) if req.body.strip() else {}
      name = params.get("name") or meta.get("name") or ""
      store.object_path(bucket, name)
      store.check(store.current(bucket, name), params, read=False)
      total = req.headers.get("x-upload-content-length")
      upload_id = uuid.uuid4().hex
      tmp = store.new_tmp()
      open(tmp, "wb").close()
      store.uploads[upload_id] = _Upload(bucket, name, tmp, dict(params), int(total) if total else None)
      location = f"{host}/upload/storage/v1/b/{bucket}/o?uploadType=resumable&upload_id={upload_id}"
      return self._send(200, {"Location": location}, b"")
    if kind == "resumable" and "upload_id" in params:
      up = store.uploads.get(params["upload_id"])
      if up is None:
        raise _HttpError(404, "No such upload session")
      if req.method == "DELETE":
        store.uploads.pop(params["upload_id"], None)
        with contextlib.suppress(FileNotFoundError):
          os.remove(up.tmp)
        return self._send(499, {}, b"")
      if req.method == "PUT":
        return self._resumable_put(req, params["upload_id"], up, host)
    raise _HttpError(501, f"{req.method} upload {kind!r} is not implemented by the bench bucket")

  def _write(self, bucket: str, name: str, data: bytes, params: dict[str, str], host: str, meta: dict) -> bool:
    store = self.server.store
    store.object_path(bucket, name)
    hashes = _hashes_of(data)
    for key, got in (("crc32c", hashes[0]), ("md5Hash", hashes[1])):
      if key in meta and meta[key] != got:
        raise _HttpError(400, f"Provided {key} {meta[key]!r} doesn't match calculated {key} {got!r}.")
    tmp = store.new_tmp()
    with open(tmp, "wb") as f:
      f.write(data)
    return self._json(200, store.commit(bucket, name, tmp, params, host, hashes))

  def _resumable_put(self, req: _Request, upload_id: str, up: _Upload, host: str) -> bool:
    store = self.server.store
    m = _CONTENT_RANGE_RE.match(req.headers.get("content-range", f"bytes */{len(req.body)}"))
    if m is None:
      raise _HttpError(400, f"Bad Content-Range: {req.headers.get('content-range')!r}")
    first, last, total = m.groups()
    with up.lock:
      if total != "*":
        up.total = int(total)
      if first is not None:
        first, last = int(first), int(last)
        if last - first + 1 != len(req.body) or first > up.received:
          raise _HttpError(400, f"Content-Range {first}-{last} does not fit {len(req.body)} bytes at "
                           f"{up.received}")
        with open(up.tmp, "r+b") as f:
          f.seek(first)
          f.write(req.body)
        up.received = max(up.received, last + 1)
      if up.total is not None and up.received >= up.total:
        store.uploads.pop(upload_id, None)
        return self._json(200, store.commit(up.bucket, up.name, up.tmp, up.params, host))
    headers = {"Range": f"bytes=0-{up.received - 1}"} if up.received else {}
    return self._send(308, headers, b"")

  def _create_bucket(self, req: _Request) -> bool:
    meta = json.loads(req.body or b"{}")
    name = meta.get("name", "")
    if not _BUCKET_RE.match(name):
      raise _HttpError(400, f"Invalid bucket name: {name!r}")
    path = os.path.join(self.server.store.root, name)
    try:
      os.mkdir(path)
    except FileExistsError:
      raise _HttpError(409, "Your previous request to create the named bucket succeeded and you already own it.")
    return self._json(200, {"kind": "storage#bucket", "id": name, "name": name, "projectNumber": "0",
                            "metageneration": "1", "location": "US", "storageClass": "STANDARD"})

  # ------------------------------------------------------------------------- answers

  def _send_head(self, code: int, headers: dict[str, str]) -> None:
    lines = [f"HTTP/1.1 {code} {_REASONS.get(code, 'Unknown')}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

  def _send(self, code: int, headers: dict[str, str], body: bytes) -> bool:
    if code not in (204, 304):
      headers["Content-Length"] = str(len(body))
    self._send_head(code, headers)
    if body:
      self.sock.sendall(body)
    return False

  def _json(self, code: int, obj: dict) -> bool:
    return self._send(code, {"Content-Type": "application/json; charset=UTF-8"}, json.dumps(obj).encode())

  def _error(self, e: _HttpError) -> bool:
    headers = {"Content-Type": "application/json; charset=UTF-8", **e.headers}
    return self._send(e.code, headers, b"" if e.code == 304 else _error_body(e.code, e.message))


def _bucket_object(rest: str) -> tuple[str, str | None]:
  """'B' → (B, None); 'B/o' → (B, ''); 'B/o/NAME' → (B, NAME, still quoted)."""
  bucket, sep, tail = rest.partition("/")
  if not sep:
    return bucket, None
  if tail == "o":
    return bucket, ""
  if tail.startswith("o/"):
    return bucket, tail[2:]
  return bucket, "/"  # a sub-resource of the bucket: not implemented


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
  """[start, stop) of a single `bytes=` range; the whole object for one this server ignores (RFC 9110: an
  invalid or multi-range header may be ignored); None when unsatisfiable."""
  m = _RANGE_RE.match(header.strip())
  if m is None:
    return 0, size
  a, b = m.groups()
  if not a:
    if not b:
      return 0, size
    n = int(b)
    if n == 0 or size == 0:
      return None
    return max(0, size - n), size
  start = int(a)
  if b and int(b) < start:
    return 0, size
  if start >= size:
    return None
  return start, min(int(b) + 1, size) if b else size


def _parse_multipart(content_type: str, body: bytes) -> tuple[dict, bytes]:
  """(metadata, data) of a multipart/related upload: a JSON part, then the media part."""
  m = re.search(r'boundary="?([^";]+)"?', content_type)
  if m is None:
    raise _HttpError(400, f"multipart upload without a boundary: {content_type!r}")
  sep = b"\r\n--" + m.group(1).encode("latin-1")
  body = b"\r\n" + body
  first, second, last = body.find(sep), body.find(sep, len(sep)), body.rfind(sep)
  if first != 0 or second < 0 or last <= second:
    raise _HttpError(400, "malformed multipart/related body")
  parts = []
  for part in (body[len(sep):second], body[second + len(sep):last]):
    head_end = part.find(b"\r\n\r\n")
    if head_end < 0:
      raise _HttpError(400, "malformed multipart/related part")
    parts.append(part[head_end + 4:])
  try:
    meta = json.loads(parts[0])
  except ValueError:
    raise _HttpError(400, "the first multipart part is not JSON metadata") from None
  return meta, parts[1]


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
  """The listening socket, a thread per connection, and the counters of /_bench/stats."""

  daemon_threads = True
  allow_reuse_address = True
  request_queue_size = 256

  def __init__(self, address: tuple[str, int], root: str, options: ServerOptions, verbose: bool = False):
    super().__init__(address, _Handler)
    self.store = _Store(root)
    self.options = options
    self.verbose = verbose
    self.url_host = f"{address[0]}:{self.server_address[1]}"
    self._stats_lock = threading.Lock()
    self.stats = {"requests": 0, "bytes_sent": 0, "throttle_sleeps": 0, "latency_sleeps": 0, "connections": 0}

  def stats_add(self, key: str, n: int) -> None:
    if n:
      with self._stats_lock:
        self.stats[key] += n

  def stats_json(self) -> dict:
    with self._stats_lock:
      out = dict(self.stats)
    out.update(dataclasses.asdict(self.options), hash_seconds=round(self.store.hash_seconds, 6),
               pid=os.getpid())
    return out

  def wait_first_byte(self) -> None:
    delay = self.options.latency_ms + (random.uniform(0, self.options.jitter_ms) if self.options.jitter_ms else 0)
    if delay > 0:
      self.stats_add("latency_sleeps", 1)
      time.sleep(delay / 1000)


def serve(root: str, host: str = "127.0.0.1", port: int = 0, options: ServerOptions = ServerOptions(),
          verbose: bool = False) -> None:
  """Runs the server in this process until it is killed; prints its URL on stdout first."""
  server = _Server((host, port), root, options, verbose)
  print(f"http://{server.url_host}", flush=True)
  server.serve_forever(poll_interval=0.5)


# --------------------------------------------------------------------------- the benchmark API


def _cpu_of(pid: int) -> float:
  try:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system
  except ImportError:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client_cpu_seconds() -> float:
  """User + system CPU seconds of this process so far (all its threads)."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


class BenchBucket:
  """A bench bucket server in its own process, for the length of a `with` block.

      with BenchBucket(root, latency_ms=30.0, mbps=100.0) as bucket, bucket.active():
        ...  # gs://B/... reads ROOT/B/...

  `active()` points STORAGE_EMULATOR_HOST at it and drops the toolkit's cached
  storage client (formats.storage.files) on entry and exit, so the toolkit's reads go to
  it inside the block and to the previous host after. Clients or Blobs made
  before the block keep talking to their own host; Beam's GCS clients are not
  touched.
  """

  def __init__(self, root: str, latency_ms: float = DEFAULT_LATENCY_MS, mbps: float = DEFAULT_MBPS,
               jitter_ms: float = 0.0, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 30.0,
               verbose: bool = False):
    self.root = root
    self.options = ServerOptions(latency_ms=latency_ms, jitter_ms=jitter_ms, mbps=mbps)
    self._bind, self._port, self._timeout, self._verbose = host, port, start_timeout_s, verbose
    self.host: str = ""
    self.proc: subprocess.Popen | None = None
    self._log = None

  def __enter__(self) -> BenchBucket:
    self.start()
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def start(self) -> None:
    """Starts the server process and waits until it answers; RuntimeError (with its stderr) if it does not."""
    os.makedirs(self.root, exist_ok=True)
    self._log = tempfile.TemporaryFile()
    o = self.options
    self.proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--root", self.root, "--host", self._bind,
         "--port", str(self._port), "--latency_ms", str(o.latency_ms), "--jitter_ms", str(o.jitter_ms),
         "--mbps", str(o.mbps)] + (["--verbose"] if self._verbose else []),
        stdout=subprocess.PIPE, stderr=self._log)
    deadline = time.monotonic() + self._timeout
    try:
      ready, _, _ = select.select([self.proc.stdout], [], [], self._timeout)
      line = self.proc.stdout.readline().decode().strip() if ready else ""
      if not line.startswith("http://"):
        raise RuntimeError("did not print its URL")
      self.host = line
      while True:
        try:
          self.stats()
          return
        except OSError:
          if self.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("did not answer") from None
          time.sleep(0.05)
    except RuntimeError as e:
      err = self._stderr_tail()
      self.close()
      raise RuntimeError(f"bench bucket server ({self.root}) {e} within {self._timeout:.0f} s; stderr: {err}")

  def _stderr_tail(self) -> str:
    if self._log is None:
      return ""
    self._log.seek(0)
    return self._log.read()[-2000:].decode(errors="replace")

  def close(self) -> None:
    """Stops the server process."""
    if self.proc is not None:
      self.proc.kill()
      self.proc.wait(timeout=10)
      self.proc.stdout.close()
      self.proc = None
    if self._log is not None:
      self._log.close()
      self._log = None

  @contextlib.contextmanager
  def active(self):
    """Sets STORAGE_EMULATOR_HOST to this server for the block (restored after), with a fresh toolkit client."""
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = self.host
    _drop_toolkit_client()
    try:
      yield self
    finally:
      if old is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
      else:
        os.environ["STORAGE_EMULATOR_HOST"] = old
      _drop_toolkit_client()

  def stats(self) -> dict:
    """The server's counters (requests, bytes_sent, throttle_sleeps, latency_sleeps, connections,
    hash_seconds) and its settings."""
    with urllib.request.urlopen(f"{self.host}/_bench/stats", timeout=5) as r:
      return json.loads(r.read())

  def requests(self) -> int:
    """Requests served so far (/_bench/ requests are not counted)."""
    return self.stats()["requests"]

  def server_cpu_seconds(self) -> float:
    """User + system CPU seconds the server process has used so far."""
    if self.proc is None:
      raise RuntimeError("the bench bucket server is not running")
    return _cpu_of(self.proc.pid)

  def warm(self, gs_prefix: str) -> int:
    """Lists every object under a gs:// prefix once, so the server hashes them before a measurement.

    Returns:
      How many objects were listed.
    """
    bucket, _, prefix = gs_prefix[len("gs://"):].partition("/")
    n, token = 0, ""
    while True:
      query = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
      with urllib.request.urlopen(f"{self.host}/storage/v1/b/{bucket}/o?{query}", timeout=600) as r:
        page = json.loads(r.read())
      n += len(page.get("items", []))
      token = page.get("nextPageToken", "")
      if not token:
        return n


def _drop_toolkit_client() -> None:
  """Drops the toolkit's process-wide storage client, which is bound to the host it was made for."""
  files = sys.modules.get("formats.storage.files")
  if files is not None:
    files._gcs_client.cache_clear()  # formats.storage.files has no public reset; its tests' fixture does the same


def stage(root: str, bucket: str, local_tree: str, prefix: str = "") -> str:
  """Places a local folder tree into a bench bucket's folder: hard links where possible, else copies.

  Args:
    root: the server's folder of buckets.
    bucket: the bucket (its folder is created).
    local_tree: the folder whose files become objects.
    prefix: the object name prefix they get ('' for the bucket's top).

  Returns:
    The gs:// path of the staged tree.
  """
  if not _BUCKET_RE.match(bucket):
    raise ValueError(f"not a bucket name: {bucket!r}")
  prefix = prefix.strip("/")
  dest_root = os.path.join(root, bucket, *prefix.split("/")) if prefix else os.path.join(root, bucket)
  os.makedirs(dest_root, exist_ok=True)
  for dirpath, _, names in os.walk(local_tree):
    rel = os.path.relpath(dirpath, local_tree)
    folder = dest_root if rel == "." else os.path.join(dest_root, rel)
    os.makedirs(folder, exist_ok=True)
    for name in names:
      src, dst = os.path.join(dirpath, name), os.path.join(folder, name)
      if os.path.lexists(dst):
        os.remove(dst)
      try:
        if os.path.islink(src):  # a link would be linked itself, not its target
          raise OSError(errno.EXDEV, "a symbolic link")
        os.link(src, dst)
      except OSError:
        shutil.copyfile(src, dst)
  return f"gs://{bucket}/{prefix}" if prefix else f"gs://{bucket}"


def main(argv: list[str] | None = None) -> None:
  """The command line: serves ROOT until killed."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--root", required=True, help="the folder of buckets: bucket B is ROOT/B")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=0, help="0: a free port (the URL is printed on stdout)")
  p.add_argument("--latency_ms", type=float, default=DEFAULT_LATENCY_MS, help="first-byte latency per request")
  p.add_argument("--jitter_ms", type=float, default=0.0, help="a uniform random extra latency per request")
  p.add_argument("--mbps", type=float, default=DEFAULT_MBPS, help="per-connection cap in MB/s; 0 for none")
  p.add_argument("--verbose", action="store_true", help="log one line per request on stderr")
  p.add_argument("--quiet", dest="verbose", action="store_false", help="log nothing (the default)")
  args = p.parse_args(argv)
  options = ServerOptions(latency_ms=args.latency_ms, jitter_ms=args.jitter_ms, mbps=args.mbps)
  serve(args.root, args.host, args.port, options, args.verbose)


if __name__ == "__main__":
  main()
