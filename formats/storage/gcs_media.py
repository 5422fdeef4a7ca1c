"""Ranged reads of gs:// objects on a lean path: pooled keep-alive connections, bytes straight into a buffer.

    answer = read_into("gs://bucket/shards/x-00000-of-00016", 4096, buffer, generation=None)
    answer.generation, answer.size      # what the object is (from the response's headers)

One GET of the JSON API's media endpoint per call, on a connection taken from
a per-process pool (http.client, kept alive), the body read with `readinto`
into the caller's buffer: no metadata request, no intermediate bytes, no
per-request session machinery. The response's `x-goog-generation` and
`Content-Range` say which generation answered and the object's whole size, so
the caller pins a generation from its first read and checks the size against
its manifest without asking for metadata.

Why not google-cloud-storage's `Blob.download_as_bytes` or its authorised
requests session: measured on this machine's two cores against a local server
(client CPU only), 150 KB ranges cost 0.69 ms through the Blob, 0.56 ms through
the session with `readinto`, 0.17 ms here; 8 MiB ranges 1.17, 1.30 and 0.28
CPU-seconds per GB. Credentials are google-auth's (application default
credentials, refreshed by google-auth); against STORAGE_EMULATOR_HOST no
credentials are sent, as google-cloud-storage does. An HTTPS proxy from the
environment (`https_proxy`, `no_proxy`) is tunnelled through (CONNECT).

Each call is one attempt (formats.storage.retry classifies its errors; the
caller's policy retries). Errors: 404 FileNotFoundError, 412 GenerationMismatch,
an object shorter than the range ObjectTooShort (its size), 408, 429 and 5xx
TransientHTTPError, a dropped, timed-out, cut or refused connection, a TLS or
name-resolution failure ConnectionError or TimeoutError (all transient), 401
(after one refresh of the credentials) and 403 PermissionError, any other
answer OSError (none of those transient). A
connection is reused only after its answer was read to the end, and not after
_IDLE_S idle; one the far end closed while idle is replaced at once, without
counting as a failed try. The pool is emptied in a forked child.
"""

from __future__ import annotations

import dataclasses
import http.client
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request

__all__ = ["DEFAULT_TIMEOUT_S", "GenerationMismatch", "MediaAnswer", "ObjectTooShort", "TransientHTTPError",
           "endpoint", "read_into"]

# A socket read that waits longer than this fails (a stalled stream), and the caller's retry policy takes over.
DEFAULT_TIMEOUT_S = 60.0
_GCS = "https://storage.googleapis.com"
_SCOPES = ("https://www.googleapis.com/auth/devstorage.read_only",)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
_ERROR_BODY = 64 << 10  # bytes of an error answer read (for its message), at most
_IDLE_PER_HOST = 64  # idle connections kept per host
# A connection idle longer than this is not reused: GCP's firewall drops idle flows after minutes without a reset,
# and a read on such a connection would wait for its whole timeout.
_IDLE_S = 30.0


class TransientHTTPError(ConnectionError):
  """HTTP 408, 429 or 5xx: worth another try."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


class ObjectTooShort(OSError):
  """The object ends before the range asked for (the answer is clipped at its end): `size` says where."""

  def __init__(self, size: int, message: str):
    super().__init__(message)
    self.size = size


class GenerationMismatch(RuntimeError):
  """HTTP 412, or an answer from another generation than the one asked for: the object was replaced."""


@dataclasses.dataclass(frozen=True)
class MediaAnswer:
  """What the server said about the object while answering a read."""

  generation: int | None  # None: the server does not say (gcp-storage-emulator); GCS always does
  size: int  # the whole object's size


def endpoint() -> str:
  """The JSON API's root: STORAGE_EMULATOR_HOST when set (a test server), else GCS."""
  host = os.environ.get("STORAGE_EMULATOR_HOST")
  if not host:
    return _GCS
  return host.rstrip("/") if "://" in host else "http://" + host.rstrip("/")


def read_into(path: str, start: int, buffer, *, generation: int | None = None,
              timeout: float | None = None) -> MediaAnswer:
  """Fills `buffer` with the object's bytes [start, start + len(buffer)).

  Args:
    path: gs://bucket/name.
    start: the first byte.
    buffer: a writable buffer (bytearray, memoryview, mmap) of at least 1 byte.
    generation: answer only from this generation (ifGenerationMatch), or None (any; the answer says which).
    timeout: seconds a socket read may wait (DEFAULT_TIMEOUT_S when None).

  Returns:
    The generation that answered and the object's whole size.

  Raises:
    FileNotFoundError: no such object (HTTP 404).
    GenerationMismatch: `generation` is no longer the object's (HTTP 412), or another generation answered.
    TransientHTTPError, ConnectionError, TimeoutError: worth another try (formats.storage.retry.is_transient).
    PermissionError: HTTP 401 or 403.
    OSError: any other answer, or bytes past the object's end asked for.
  """
  view = memoryview(buffer).cast("B")
  n = len(view)
  if n < 1:
    raise ValueError("read_into needs a buffer of at least 1 byte")
  bucket, name = _split(path)
  query = "alt=media" + (f"&ifGenerationMatch={int(generation)}" if generation is not None else "")
  target = f"/download/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o/{urllib.parse.quote(name, safe='')}"
  for refreshed in (False, True):
    headers = {"Range": f"bytes={start}-{start + n - 1}", "Accept-Encoding": "identity"}
    _POOL.authorize(headers, refresh=refreshed)
    try:
      return _read_once(path, f"{_POOL.prefix}{target}?{query}", headers, start, view, generation, timeout)
    except PermissionError as e:
      if refreshed or "HTTP 401" not in str(e) or _POOL.anonymous():
        raise  # a 401 is tried once more with fresh credentials (an expired token); a 403 is final
  raise AssertionError("unreachable")


def _read_once(path: str, url: str, headers: dict, start: int, view: memoryview, generation: int | None,
               timeout: float | None) -> MediaAnswer:
  """One GET; on an idle pooled connection that the far end had closed, once more on a new one."""
  n = len(view)
  conn, reused = _POOL.take(timeout)
  reusable = False
  try:
    try:
      conn.request("GET", url, headers=headers)
      response = conn.getresponse()
    except (http.client.HTTPException, ConnectionError):
      if not reused:
        raise
      conn.close()  # a kept connection the far end closed while it was idle: no byte came, try a new one
      conn, _ = _POOL.take(timeout, fresh=True)
      conn.request("GET", url, headers=headers)
      response = conn.getresponse()
    if response.status == 416:  # a range past the end: how long the object is, if the server says
      size = re.fullmatch(r"bytes \*/(\d+)", response.getheader("Content-Range", ""))
      if size is not None:
        response.read(_ERROR_BODY)
        raise ObjectTooShort(int(size.group(1)), f"{path}: {size.group(1)} bytes, fewer than the {start + n} "
                             "asked for")
    if response.status not in (200, 206):
      body = response.read(_ERROR_BODY)
      reusable = not response.will_close and response.isclosed()
      raise _error(path, response.status, body)
    answer = _answer(path, response, start, n, generation)
    got = 0
    try:
      while got < n:
        k = response.readinto(view[got:])
        if not k:
          break
        got += k
    except http.client.IncompleteRead:
      pass
    if got != n:
      raise ConnectionError(f"{path}: the answer ended after {got} of {n} bytes of [{start}, {start + n})")
    if not response.isclosed() and response.read(1):  # more than asked for: not an answer to this request
      raise OSError(f"{path}: the server sent more than the {n} bytes of [{start}, {start + n})")
    reusable = not response.will_close and response.isclosed()
    return answer
  except socket.timeout:
    raise TimeoutError(f"{path}: no bytes for {timeout or DEFAULT_TIMEOUT_S:g} s while reading [{start}, "
                       f"{start + n})") from None
  except http.client.HTTPException as e:  # a bad status line, a broken chunk: the network's doing
    raise ConnectionError(f"{path}: {type(e).__name__}: {e}") from None
  except (ssl.SSLError, socket.gaierror) as e:  # a TLS or name-resolution failure: transient, as requests says
    raise ConnectionError(f"{path}: {type(e).__name__}: {e}") from None
  except OSError as e:
    if e.errno is None or isinstance(e, (FileNotFoundError, PermissionError)):
      raise  # this module's own answers (no errno): a wrong answer, not the network
    raise ConnectionError(f"{path}: {type(e).__name__}: {e}") from None  # unreachable network, reset, ...
  finally:
    if reusable:
      _POOL.give(conn)
    else:
      conn.close()


def _answer(path: str, response, start: int, n: int, generation: int | None) -> MediaAnswer:
  """The generation and whole size the answer's headers give; raises unless it answers [start, start + n)."""
  if response.getheader("Content-Encoding", "identity") not in ("identity", ""):
    raise OSError(f"{path}: served with Content-Encoding {response.getheader('Content-Encoding')!r}; shards are "
                  "read byte for byte (store them without a content encoding)")
  got_gen = response.getheader("x-goog-generation")
  if got_gen is not None and not got_gen.isdigit():
    raise OSError(f"{path}: the answer names generation {got_gen[:40]!r}")
  if generation is not None and got_gen is not None and int(got_gen) != generation:  # ignores ifGenerationMatch
    raise GenerationMismatch(f"{path}: generation {got_gen} answered, {generation} was asked for")
  if response.status == 206:
    m = _CONTENT_RANGE.fullmatch(response.getheader("Content-Range", ""))
    if m is not None and int(m.group(1)) == start and int(m.group(2)) == int(m.group(3)) - 1 < start + n - 1:
      raise ObjectTooShort(int(m.group(3)), f"{path}: {m.group(3)} bytes, fewer than the {start + n} asked for")
    if m is None or int(m.group(1)) != start or int(m.group(2)) != start + n - 1:
      raise OSError(f"{path}: asked for bytes [{start}, {start + n}), the answer is "
                    f"{response.getheader('Content-Range')!r}")
    size = int(m.group(3))
  else:  # the whole object: only an answer to a range that is the whole object
    size = response.length if response.length is not None else -1
    if start != 0 or size != n:
      raise OSError(f"{path}: asked for bytes [{start}, {start + n}), the server sent the whole object "
                    f"({size} bytes)")
  return MediaAnswer(None if got_gen is None else int(got_gen), size)


def _error(path: str, status: int, body: bytes) -> OSError | RuntimeError:
  message = _message(body) or http.client.responses.get(status, "")
  text = f"{path}: HTTP {status}: {message}"
  if status == 404:
    return FileNotFoundError(text)
  if status == 412:
    return GenerationMismatch(text)
  if status == 416:
    return OSError(f"{text} (a range past the object's end)")
  if status in (408, 429) or status >= 500:
    return TransientHTTPError(status, text)
  if status in (401, 403):
    return PermissionError(text)
  return OSError(text)


def _message(body: bytes) -> str:
  import json

  try:
    return str(json.loads(body)["error"]["message"])[:200]
  except (ValueError, KeyError, TypeError):
    return body[:200].decode("utf-8", "replace").strip()


def _split(path: str) -> tuple[str, str]:
  if not path.startswith("gs://") or "/" not in path[5:]:
    raise ValueError(f"not a gs:// object path: {path!r}")
  bucket, name = path[5:].split("/", 1)
  if not bucket or not name:
    raise ValueError(f"not a gs:// object path: {path!r}")
  return bucket, name


class _Pool:
  """Idle keep-alive connections to the endpoint, and the credentials that authorise requests on them.

  The endpoint is read once per process, when the first read is made, unless it changes (tests switch servers).
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._idle: list[tuple[http.client.HTTPConnection, float, str]] = []  # (connection, idle since, endpoint)
    self._root: str | None = None
    self.prefix = ""
    self._credentials = None
    self._auth_lock = threading.Lock()

  def _configure(self) -> None:
    root = endpoint()
    if root == self._root:
      return
    with self._lock:
      for conn, _, _ in self._idle:
        conn.close()
      self._idle = []
      parts = urllib.parse.urlsplit(root)
      self._scheme, self._netloc, self.prefix = parts.scheme, parts.netloc, parts.path.rstrip("/")
      self._credentials = None if os.environ.get("STORAGE_EMULATOR_HOST") else _default_credentials()
      self._root = root

  def anonymous(self) -> bool:
    return self._credentials is None

  def authorize(self, headers: dict, refresh: bool = False) -> None:
    self._configure()
    creds = self._credentials
    if creds is None:
      return
    with self._auth_lock:  # google-auth's refresh is not thread-safe
      if refresh or not creds.valid:
        import google.auth.transport.requests

        creds.refresh(google.auth.transport.requests.Request())
      creds.apply(headers)

  def take(self, timeout: float | None, fresh: bool = False) -> tuple[http.client.HTTPConnection, bool]:
    """(a connection, whether it was kept from an earlier request); idle ones past _IDLE_S are closed."""
    self._configure()
    conn = None
    now = time.monotonic()
    with self._lock:
      while self._idle and not fresh:
        conn, since, root = self._idle.pop()
        if now - since <= _IDLE_S and root == self._root:
          break
        conn.close()
        conn = None
    reused = conn is not None
    if conn is None:
      conn = self._connect()
      conn._toolkit_root = self._root
    conn.timeout = timeout or DEFAULT_TIMEOUT_S
    if conn.sock is not None:
      conn.sock.settimeout(conn.timeout)
    return conn, reused

  def give(self, conn: http.client.HTTPConnection) -> None:
    with self._lock:
      if len(self._idle) < _IDLE_PER_HOST and getattr(conn, "_toolkit_root", None) == self._root:
        self._idle.append((conn, time.monotonic(), self._root))
        return
    conn.close()

  def forget(self) -> None:
    """Drops every idle connection and the credentials (a forked child must not share its parent's sockets)."""
    self._idle = []
    self._lock = threading.Lock()
    self._auth_lock = threading.Lock()
    self._root = None

  def _connect(self) -> http.client.HTTPConnection:
    parts = urllib.parse.urlsplit(f"{self._scheme}://{self._netloc}")
    if self._scheme != "https":  # a test server on loopback: no proxy
      return http.client.HTTPConnection(parts.hostname, parts.port)
    proxy = urllib.request.getproxies().get("https")
    if proxy and not urllib.request.proxy_bypass(parts.hostname):  # CONNECT through it, then TLS with GCS
      p = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
      conn = http.client.HTTPSConnection(p.hostname, p.port or 80, context=_tls_context())
      conn.set_tunnel(parts.hostname, parts.port or 443)
      return conn
    return http.client.HTTPSConnection(parts.hostname, parts.port, context=_tls_context())


def _default_credentials():
  import google.auth

  credentials, _ = google.auth.default(scopes=list(_SCOPES))
  return credentials


_TLS: ssl.SSLContext | None = None


def _tls_context() -> ssl.SSLContext:
  global _TLS
  if _TLS is None:
    try:
      import certifi  # the CA bundle requests (and so google-cloud-storage) trusts

      _TLS = ssl.create_default_context(cafile=certifi.where())
    except ImportError:
      _TLS = ssl.create_default_context()
  return _TLS


_POOL = _Pool()
os.register_at_fork(after_in_child=_POOL.forget)
