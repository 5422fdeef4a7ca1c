"""A fault-injecting HTTP proxy in front of the GCS emulator, for the fault harness.

    proxy = FaultProxy("http://127.0.0.1:PORT")     # the emulator
    proxy.add_fault("images/cat/1.jpg", status=503)  # that object answers 503 until cleared
    os.environ["STORAGE_EMULATOR_HOST"] = proxy.host

Two things a real GCS does that `gcp-storage-emulator` does not, both needed to
exercise the toolkit honestly:
  * faults: HTTP 5xx answers, dropped connections and stalls longer than a
    client's retry budget, before the answer or half-way through its body
    ("cut", "stall_body"), per path substring, a number of times or until cleared;
  * generation preconditions: the emulator accepts an upload with a stale
    `ifGenerationMatch` (and a second create with `ifGenerationMatch=0`). The
    proxy enforces them as GCS does (HTTP 412), atomically per proxy: uploads
    that carry a precondition are checked and forwarded under one lock, so two
    racing compare-and-swaps cannot both pass.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import re
import socketserver
import sys
import threading
import time
import urllib.parse

_HOP_HEADERS = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


@dataclasses.dataclass
class _Fault:
  path_contains: str
  status: int
  times: int | None  # None: until cleared
  mode: str  # "status" | "drop" | "stall"
  stall_seconds: float
  method: str | None


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  # An answer is written in two parts (headers, then body): with Nagle's algorithm on, a kept-alive client's
  # delayed ACK holds the body back ~40 ms per request.
  disable_nagle_algorithm = True
  server: _Server

  def log_message(self, *args):  # quiet
    pass

  def _any(self):
    proxy = self.server.proxy
    length = int(self.headers.get("Content-Length") or 0)
    body = self.rfile.read(length) if length else b""
    target = urllib.parse.unquote(self.path)
    proxy._seen(self.command, target)
    fault = proxy._take_fault(self.command, target)
    if fault is not None:
      if fault.mode == "drop":
        self.close_connection = True
        self.connection.shutdown(2)
        return
      if fault.mode == "stall":
        time.sleep(fault.stall_seconds)
        self.close_connection = True
        return
      if fault.mode in ("cut", "stall_body"):  # the answer starts, then the stream breaks or stops
        self._forward(body, fault)
        return
      self._reply(fault.status, {"error": {"code": fault.status, "message": "injected fault"}})
      return
    generation_match = _query(self.path).get("ifGenerationMatch")
    if generation_match is None:
      self._forward(body)
      return
    with proxy._precondition_lock:  # check and write as one step, as GCS does
      name = _object_name(self.path, body, self.headers.get("Content-Type", ""))
      if name is not None:
        current = proxy._generation(name)
        if str(current) != generation_match:
          self._reply(412, {"error": {"code": 412, "message": "conditionNotMet: At least one of the pre-conditions "
                                      "you specified did not hold."}})
          return
      self._forward(body)

  do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _any

  def _reply(self, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    if self.command != "HEAD":
      self.wfile.write(data)

  def _forward(self, body: bytes, fault: _Fault | None = None) -> None:
    up = self.server.proxy._upstream
    conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS and k.lower() != "host"}
    headers["Host"] = up.netloc
    # The emulator answers resumable uploads with a Location on its own address: keep clients on the proxy.
    conn.request(self.command, self.path, body=body or None, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    self.send_response(resp.status)
    for k, v in resp.getheaders():
      if k.lower() in _HOP_HEADERS or k.lower() == "content-length":
        continue
      if k.lower() == "location":
        v = v.replace(up.netloc, f"{self.server.server_address[0]}:{self.server.server_address[1]}")
      self.send_header(k, v)
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    if fault is not None:  # half the body, then a dropped connection or a stall
      self.wfile.write(data[:len(data) // 2])
      self.wfile.flush()
      if fault.mode == "stall_body":
        time.sleep(fault.stall_seconds)
      self.close_connection = True
      self.connection.shutdown(2)
      return
    if self.command != "HEAD":
      self.wfile.write(data)


def _query(path: str) -> dict[str, str]:
  return {k: v[-1] for k, v in urllib.parse.parse_qs(urllib.parse.urlsplit(path).query).items()}


def _object_name(path: str, body: bytes, content_type: str) -> tuple[str, str] | None:
  """(bucket, object) a request with a precondition writes or deletes."""
  parts = urllib.parse.urlsplit(path)
  q = _query(path)
  m = re.match(r"^(?:/upload)?/storage/v1/b/([^/]+)/o(?:/(.+))?$", parts.path)
  if not m:
    return None
  bucket, name = m[1], m[2]
  if name:
    name = urllib.parse.unquote(name)
    if name.endswith("/compose"):
      name = name[: -len("/compose")]
    return bucket, name
  if "name" in q:
    return bucket, q["name"]
  if "multipart" in content_type:  # the JSON metadata part carries the name
    m = re.search(rb'"name"\s*:\s*"((?:[^"\\]|\\.)*)"', body)
    if m:
      return bucket, json.loads(b'"' + m[1] + b'"')
  return None


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
  daemon_threads = True
  proxy: FaultProxy

  def handle_error(self, request, client_address) -> None:
    if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
      return  # a client that hung up (a closed stream, a timed-out read): expected here, not worth a traceback
    super().handle_error(request, client_address)


class FaultProxy:
  """The proxy; `host` is what STORAGE_EMULATOR_HOST should name."""

  def __init__(self, upstream: str):
    self._upstream = urllib.parse.urlsplit(upstream)
    self._faults: list[_Fault] = []
    self._lock = threading.Lock()
    self._precondition_lock = threading.Lock()
    self._requests: list[tuple[str, str]] = []
    self._server = _Server(("127.0.0.1", 0), _Handler)
    self._server.proxy = self
    self._thread = threading.Thread(target=self._server.serve_forever, name="gcs-fault-proxy", daemon=True)
    self._thread.start()
    self.host = f"http://127.0.0.1:{self._server.server_address[1]}"

  def close(self) -> None:
    self._server.shutdown()
    self._server.server_close()

  def add_fault(self, path_contains: str, status: int = 503, times: int | None = None, mode: str = "status",
                stall_seconds: float = 30.0, method: str | None = None) -> None:
    """Requests whose decoded path contains `path_contains` fail: `times` times, or until cleared."""
    if mode not in ("status", "drop", "stall", "cut", "stall_body"):
      raise ValueError(f"mode must be status, drop, stall, cut or stall_body, got {mode!r}")
    with self._lock:
      self._faults.append(_Fault(path_contains, status, times, mode, stall_seconds, method))

  def clear_faults(self) -> None:
    with self._lock:
      self._faults.clear()

  def requests_seen(self, path_contains: str = "", method: str | None = None) -> int:
    with self._lock:
      return sum(1 for m, p in self._requests if path_contains in p and (method is None or m == method))

  def _seen(self, method: str, path: str) -> None:
    with self._lock:
      self._requests.append((method, path))

  def _take_fault(self, method: str, path: str) -> _Fault | None:
    with self._lock:
      for f in self._faults:
        if f.path_contains in path and (f.method is None or f.method == method):
          if f.times is not None:
            f.times -= 1
            if f.times <= 0:
              self._faults.remove(f)
          return f
    return None

  def _generation(self, bucket_and_name: tuple[str, str]) -> int:
    """The object's current generation in the emulator; 0 when it does not exist."""
    bucket, name = bucket_and_name
    conn = http.client.HTTPConnection(self._upstream.hostname, self._upstream.port, timeout=30)
    conn.request("GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}")
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.status == 404:
      return 0
    if resp.status != 200:
      raise RuntimeError(f"emulator answered {resp.status} for {bucket}/{name}")
    return int(json.loads(data)["generation"])
