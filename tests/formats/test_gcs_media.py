"""formats.storage.gcs_media and the pinning of RemoteObject, against the benchmark bucket (a server that, as GCS does,
names the generation of every answer and enforces ifGenerationMatch)."""

from __future__ import annotations

import os

import pytest

from formats.storage import gcs_download, gcs_media, retry
from formats.errors import CorruptRecordError

from scripts import bench_bucket


@pytest.fixture
def bucket(tmp_path):
  root = tmp_path / "buckets"
  (root / "bkt" / "dir").mkdir(parents=True)
  data = os.urandom(300_000)
  (root / "bkt" / "dir" / "obj bin+1").write_bytes(data)
  with bench_bucket.BenchBucket(str(root), latency_ms=0, mbps=0) as server, server.active():
    yield server, str(root), data


def test_a_range_is_read_into_the_buffer_with_its_generation_and_size_on_one_kept_connection(bucket):
  server, _, data = bucket
  path = "gs://bkt/dir/obj bin+1"
  before = server.stats()["connections"]
  buffers = [bytearray(n) for n in (1, 4096, 100_000)]
  answers = [gcs_media.read_into(path, 7, b) for b in buffers]
  assert all(bytes(b) == data[7:7 + len(b)] for b in buffers)
  assert len({a.generation for a in answers}) == 1 and {a.size for a in answers} == {len(data)}
  whole = bytearray(len(data))
  gcs_media.read_into(path, 0, whole)  # a range that is the whole object
  assert bytes(whole) == data
  # one keep-alive connection served the reads (and one more the stats request)
  assert server.stats()["connections"] - before == 2
  with pytest.raises(FileNotFoundError):
    gcs_media.read_into("gs://bkt/dir/missing", 0, bytearray(10))
  with pytest.raises(gcs_media.ObjectTooShort) as short:  # a range past the end: 416, and the size
    gcs_media.read_into(path, len(data) + 5, bytearray(10))
  assert short.value.size == len(data)
  with pytest.raises(ValueError):
    gcs_media.read_into("gs://bkt", 0, bytearray(10))


def test_the_first_answer_pins_the_generation_and_a_replaced_object_is_refused(bucket):
  _, root, data = bucket
  path = "gs://bkt/dir/obj bin+1"
  obj = gcs_download.RemoteObject(path, len(data))  # from a manifest: no metadata request
  assert obj.generation is None
  assert gcs_download.read_range(obj, 10, 20) == data[10:20]
  pinned = obj.generation
  assert pinned is not None and not obj.unconfirmed
  local = os.path.join(root, "bkt", "dir", "obj bin+1")
  os.remove(local)
  with open(local, "wb") as f:  # a writer replaces it with other bytes of the same size
    f.write(os.urandom(len(data)))
  with pytest.raises(gcs_download.SourceChangedError, match="replaced"):
    gcs_download.read_range(obj, 10, 20)
  os.remove(local)
  with pytest.raises(gcs_download.SourceChangedError, match="deleted"):
    gcs_download.read_range(obj, 10, 20)


def test_an_object_of_another_size_than_the_manifest_says_is_refused(bucket):
  _, _, data = bucket
  obj = gcs_download.RemoteObject("gs://bkt/dir/obj bin+1", len(data) + 1)
  with pytest.raises(CorruptRecordError, match=f"{len(data)} bytes, the manifest says {len(data) + 1}"):
    gcs_download.read_range(obj, 0, 10)


class _Answer:
  """The headers of an HTTP answer, as http.client gives them (for the checks no well-behaved server fails)."""

  def __init__(self, status: int, headers: dict[str, str], length: int | None):
    self.status, self._headers, self.length = status, headers, length

  def getheader(self, name: str, default=None):
    return self._headers.get(name, default)


def test_answers_a_server_should_not_give_are_refused():
  def check(status, headers, length=10, start=0, n=10, generation=None):
    return gcs_media._answer("gs://b/o", _Answer(status, headers, length), start, n, generation)

  ok = {"x-goog-generation": "5", "Content-Range": "bytes 0-9/100"}
  assert check(206, ok) == gcs_media.MediaAnswer(5, 100)
  assert check(206, {"Content-Range": "bytes 0-9/100"}) == gcs_media.MediaAnswer(None, 100)  # the emulator
  with pytest.raises(gcs_media.GenerationMismatch):  # a server that ignores ifGenerationMatch
    check(206, ok, generation=4)
  with pytest.raises(OSError, match="the answer is 'bytes 1-10/100'"):
    check(206, {**ok, "Content-Range": "bytes 1-10/100"})
  with pytest.raises(OSError, match="sent the whole object"):  # a Range the server ignored
    check(200, ok, length=100, start=0, n=10)
  with pytest.raises(OSError, match="Content-Encoding"):
    check(206, {**ok, "Content-Encoding": "gzip"})
  with pytest.raises(OSError, match="names generation"):
    check(206, {**ok, "x-goog-generation": "five"})
  with pytest.raises(gcs_media.ObjectTooShort) as short:  # the object ends inside the range
    check(206, {**ok, "Content-Range": "bytes 0-4/5"})
  assert short.value.size == 5


def test_a_kept_connection_the_server_closed_is_replaced_and_network_errors_are_transient(bucket, monkeypatch):
  import socket

  server, _, data = bucket
  path = "gs://bkt/dir/obj bin+1"
  buffer = bytearray(1000)
  gcs_media.read_into(path, 0, buffer)
  kept = gcs_media._POOL._idle[-1][0]
  kept.sock.shutdown(socket.SHUT_RDWR)  # as a firewall that dropped the idle flow, or a server that timed it out
  gcs_media.read_into(path, 5, buffer)  # no error: a new connection, at once
  assert bytes(buffer) == data[5:1005]

  def unreachable(*a, **k):
    raise socket.gaierror(-3, "Temporary failure in name resolution")
  gcs_media._POOL.forget()
  monkeypatch.setattr(socket, "create_connection", unreachable)
  with pytest.raises(ConnectionError, match="gaierror") as e:
    gcs_media.read_into(path, 0, buffer)
  assert retry.is_transient(e.value)  # retried by read_range, not reported as a bad object
