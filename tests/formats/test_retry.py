"""One retry policy for every network path (formats.storage.retry).

The unit layer: the classifier, and the backoff schedule and deadline on a fake
clock with a seeded random source. The emulator layer: every network path behind
the fault proxy (tests/gcs_faults.py) meets a storm of 503s and is retried the same
way (the same number of attempts, counted at the proxy), gives up with the same
error type naming its object when the storm outlasts the deadline, and does not
retry a 404 or a 412 (a fault met once: a retry would have succeeded).
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import itertools
import pickle
import random
import socket
import ssl
import time
import uuid

from google.api_core import exceptions as api
from google.auth import exceptions as auth_exceptions
from google.cloud.storage import exceptions as storage_exceptions
from scripts import make_sample_images
import numpy as np
import pytest
import requests
import urllib3

from formats.errors import CorruptRecordError
from formats.outputs import commit, leases
from formats.outputs.output import open_output
from formats.storage import files, gcs_download, gcs_media, retry
from loaders import ShardedRecords
from loaders._stream import RecordStream, ShardStream, WindowOrder
from pipelines import image_folder
from pipelines.core import inputs
from tests.conftest import upload_tree
from tests.pipelines.test_commit_faults import _manifest


# --------------------------------------------------------------------------- the classifier


class _Response:
  def __init__(self, status_code: int):
    self.status_code = status_code


TRANSIENT = [
    gcs_media.TransientHTTPError(503, "gs://b/o: HTTP 503"), gcs_media.TransientHTTPError(429, "429"),
    gcs_media.TransientHTTPError(408, "408"), api.ServiceUnavailable("503"), api.TooManyRequests("429"),
    api.InternalServerError("500"), api.BadGateway("502"), api.GatewayTimeout("504"),
    api.from_http_status(408, "408"), storage_exceptions.InvalidResponse(_Response(503), "503"),
    storage_exceptions.InvalidResponse(_Response(429), "429"), requests.exceptions.ConnectionError("reset"),
    requests.exceptions.ReadTimeout("slow"), requests.exceptions.ChunkedEncodingError("cut"),
    urllib3.exceptions.ProtocolError("cut"), urllib3.exceptions.ReadTimeoutError(None, "/", "slow"),
    auth_exceptions.TransportError("refresh: reset"), http.client.IncompleteRead(b"12"),
    http.client.RemoteDisconnected("closed"), ConnectionResetError(errno.ECONNRESET, "reset"),
    ConnectionRefusedError(errno.ECONNREFUSED, "refused"), BrokenPipeError(errno.EPIPE, "pipe"),
    TimeoutError("no bytes"), socket.timeout("no bytes"), socket.gaierror(-3, "name resolution"),
    ssl.SSLError("handshake"), OSError(errno.ENETUNREACH, "unreachable"), OSError(errno.ESTALE, "stale"),
]
FINAL = [
    FileNotFoundError("gs://b/o: HTTP 404"), FileNotFoundError(errno.ENOENT, "absent"), api.NotFound("404"),
    api.PreconditionFailed("412"), gcs_media.GenerationMismatch("412"), api.Unauthorized("401"),
    api.Forbidden("403"), PermissionError("gs://b/o: HTTP 401"), storage_exceptions.InvalidResponse(_Response(404), "404"),
    storage_exceptions.InvalidResponse(_Response(412), "412"), CorruptRecordError("sha256 differs"),
    storage_exceptions.DataCorruption(_Response(200), "crc32c differs"), gcs_media.ObjectTooShort(5, "short"),
    OSError(errno.ENOSPC, "full"), gcs_download.NotEnoughSpaceError(errno.ENOSPC, "full"),
    gcs_download.SourceChangedError("replaced"), retry.RetryExhausted("gave up"),
    inputs.TransientInputError("gave up"), api.RetryError("gave up", None), ValueError("bad"),
]


@pytest.mark.parametrize("error", TRANSIENT, ids=lambda e: f"{type(e).__name__}:{e}"[:40])
def test_transient_errors(error):
  assert retry.is_transient(error)


@pytest.mark.parametrize("error", FINAL, ids=lambda e: f"{type(e).__name__}:{e}"[:40])
def test_final_errors(error):
  assert not retry.is_transient(error)


# --------------------------------------------------------------------------- the backoff and the deadline


class _Clock:
  """time.monotonic and time.sleep of a clock that only moves when slept on."""

  def __init__(self):
    self.now, self.sleeps = 1000.0, []

  def monotonic(self) -> float:
    return self.now

  def sleep(self, seconds: float) -> None:
    self.sleeps.append(seconds)
    self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> _Clock:
  c = _Clock()
  monkeypatch.setattr(time, "monotonic", c.monotonic)
  monkeypatch.setattr(time, "sleep", c.sleep)
  return c


def _failing(n: int, error: Exception | None = None):
  """A call that fails `n` times (a 503), then returns "ok"; `calls` counts its attempts."""
  calls = []

  def fn(timeout):
    calls.append(timeout)
    if len(calls) <= n:
      raise error or gcs_media.TransientHTTPError(503, "gs://b/o: HTTP 503: injected")
    return "ok"
  return fn, calls


def test_the_waits_are_full_jitter_exponential_and_capped():
  policy = retry.Policy(initial=1.0, maximum=8.0, multiplier=2.0, rng=random.Random(7))
  expected, rng = [], random.Random(7)
  for bound in (1, 2, 4, 8, 8, 8):
    expected.append(rng.uniform(0.0, bound))
  assert list(itertools.islice(policy.delays(), 6)) == expected
  waits = list(itertools.islice(retry.Policy(initial=0.5, maximum=4.0).delays(), 200))
  assert all(0 <= w <= min(0.5 * 2**i, 4.0) for i, w in enumerate(waits))
  assert max(waits[3:]) > 2.0 and min(waits) < 0.5  # spread over the whole interval


def test_a_storm_shorter_than_the_deadline_is_retried_with_those_waits(clock):
  policy = retry.Policy(initial=1.0, maximum=8.0, timeout=100.0, rng=random.Random(3))
  fn, calls = _failing(4)
  assert policy.call(fn, "reading gs://b/o") == "ok"
  assert len(calls) == 5
  assert clock.sleeps == list(itertools.islice(retry.Policy(initial=1.0, maximum=8.0, rng=random.Random(3)).delays(), 4))
  assert all(1.0 <= t <= retry.ATTEMPT_TIMEOUT_S for t in calls)  # each attempt's timeout: what is left, capped


def test_a_storm_longer_than_the_deadline_raises_one_error_naming_what_how_often_how_long_and_why(clock):
  policy = retry.Policy(initial=1.0, maximum=8.0, timeout=20.0, rng=random.Random(3), flag="--deadline_flag")
  fn, calls = _failing(10**6)
  started = clock.now
  with pytest.raises(retry.RetryExhausted) as e:
    policy.call(fn, "reading gs://b/o")
  waits = list(itertools.islice(retry.Policy(initial=1.0, maximum=8.0, rng=random.Random(3)).delays(), len(calls)))
  assert sum(waits[:len(calls) - 1]) <= 20.0 < sum(waits)  # no wait ended past the deadline: the next would have
  assert e.value.attempts == len(calls) and e.value.what == "reading gs://b/o"
  assert e.value.seconds == pytest.approx(clock.now - started)
  message = str(e.value)
  assert message.startswith(f"reading gs://b/o: failed {len(calls)} times in ")
  assert "persisted past the 20 s deadline (--deadline_flag)" in message
  assert message.endswith("last: TransientHTTPError: gs://b/o: HTTP 503: injected") and "\n" not in message
  assert isinstance(e.value.__cause__, gcs_media.TransientHTTPError)


def test_a_deadline_of_zero_is_one_attempt_and_an_attempt_limit_is_honoured(clock):
  fn, calls = _failing(10)
  with pytest.raises(retry.RetryExhausted, match="failed 1 time in"):
    retry.Policy(timeout=0.0).call(fn, "x")
  fn, calls = _failing(10)
  with pytest.raises(retry.RetryExhausted, match="failed 3 times in .* past the limit of 3 attempts"):
    retry.Policy(timeout=1e6, attempts=3).call(fn, "x")
  assert len(calls) == 3


@pytest.mark.parametrize("error", [FileNotFoundError("gs://b/o: HTTP 404"), api.PreconditionFailed("412"),
                                   CorruptRecordError("bad"), retry.RetryExhausted("an inner level gave up")])
def test_a_final_error_is_raised_at_once_unchanged(clock, error):
  fn, calls = _failing(1, error)
  with pytest.raises(type(error)) as e:
    retry.Policy().call(fn, "x")
  assert e.value is error and len(calls) == 1 and clock.sleeps == []


def test_the_policy_is_what_google_cloud_storage_calls_and_it_keeps_its_settings(clock):
  """google-cloud-storage wraps each request: `retry(func)()`; the same loop, waits and error."""
  seen = []
  policy = retry.Policy(initial=0.5, maximum=1.0, timeout=30.0, on_error=seen.append).named("gs://b/o")
  fn, calls = _failing(2)
  assert policy(lambda: fn(None))() == "ok" and len(calls) == 3 and len(seen) == 2
  for copy in (policy.with_timeout(5.0), policy.with_delay(0.1, 0.2), policy.with_predicate(retry.is_transient)):
    assert isinstance(copy, retry.Policy) and copy._what == "gs://b/o" and copy._on_error == seen.append
  assert policy.with_timeout(5.0).timeout == 5.0 and policy.with_delay(0.1, 0.2).maximum == 0.2
  fn, _ = _failing(10**6)
  with pytest.raises(retry.RetryExhausted, match="^gs://b/o: failed"):
    policy.with_timeout(3.0)(lambda: fn(None))()


def test_bad_settings_are_refused():
  for kw in ({"timeout": None}, {"timeout": -1}, {"timeout": float("inf")}, {"initial": 2, "maximum": 1},
             {"multiplier": 0.5}, {"attempts": 0}, {"error": ValueError}):
    with pytest.raises(ValueError):
      retry.Policy(**kw)


def test_policies_and_their_errors_travel_as_beam_ships_them():
  policy = pickle.loads(pickle.dumps(inputs.ReadPolicy(7.0).retry_policy))
  assert policy.timeout == 7.0 and policy._error is inputs.TransientInputError
  for error in (retry.RetryExhausted("m", what="w", attempts=2), inputs.TransientInputError("m"),
                leases.LeaseUnreachable("m")):
    again = type(error)(error.args[0] + " [while running 'Read']")  # what Beam does to a DoFn's error
    assert type(again) is type(error) and isinstance(again, retry.RetryExhausted)
    assert type(pickle.loads(pickle.dumps(error))) is type(error)
  assert isinstance(leases.LeaseUnreachable("m"), leases.LeaseError)


def test_the_process_default_is_set_for_a_block_and_put_back():
  before = retry.default()
  short = retry.Policy(timeout=1.0)
  with retry.using(short):
    assert retry.default() is short and retry.named("gs://b/o").timeout == 1.0
    assert inputs.retry_policy(9.0).timeout == 9.0  # the pipelines' deadline is their flag's
    assert gcs_download.DownloadOptions(retries=2).policy.attempts == 3
  assert retry.default() is before


# --------------------------------------------------------------------------- every path through the fault proxy

K = 3  # 503s in a storm the policy outlasts
FAST = retry.Policy(initial=0.001, maximum=0.01, timeout=30.0)  # small waits, a deadline no storm of K meets
SHORT_S = 0.3  # the deadline a storm until cleared outlasts
GEN = "gen-20260101T000000-00000000"
DATA = bytes(range(256)) * 40


def _media(path: str) -> str:
  """The part of a media read's request (lean path or google-cloud-storage) that names the object."""
  return f"/o/{files.split_gcs(path)[1]}?alt=media"


class _Path:
  """One network path: `key`/`method` select its requests at the proxy, `named` what its error must name."""

  method = "GET"

  def __init__(self, env, tag: str):
    self.env, self.tag = env, tag
    self.root = f"{env.root}/{type(self).__name__}/{tag}"

  def run(self, deadline: float) -> None:
    raise NotImplementedError


class InputRead(_Path):
  def __init__(self, env, tag):
    super().__init__(env, tag)
    self.path = self.named = f"{self.root}/in.bin"
    files.write_bytes(self.path, DATA)
    self.key = _media(self.path)

  def run(self, deadline):
    assert inputs.read_input(self.path, deadline) == DATA


class Listing(_Path):
  def __init__(self, env, tag):
    super().__init__(env, tag)
    for name in ("a/1.bin", "b/2.bin"):
      files.write_bytes(f"{self.root}/{name}", b"x")
    self.named = self.root
    self.key = f"prefix={files.split_gcs(self.root)[1]}/"

  def run(self, deadline):
    assert [f.path for f in inputs.list_tree(self.root, deadline).files] == [f"{self.root}/a/1.bin",
                                                                             f"{self.root}/b/2.bin"]


class RangedRead(InputRead):
  def run(self, deadline):
    assert gcs_download.read_range(gcs_download.RemoteObject(self.path, len(DATA)), 100, 5000) == DATA[100:5000]


class Download(InputRead):
  def run(self, deadline):
    dest = str(self.env.tmp / f"download-{uuid.uuid4().hex}")
    gcs_download.download(gcs_download.remote_object(self.path), dest, hashlib.sha256(DATA).hexdigest(),
                          options=gcs_download.DownloadOptions(progress=False))
    with open(dest, "rb") as f:
      assert f.read() == DATA


class _Stream(_Path):
  """The records of batch 0 of the streamed output, each one checked against the local output."""

  def __init__(self, env, tag):
    super().__init__(env, tag)
    self.output = open_output(env.stream_output)
    info = self.output.shards("train")
    self.order = self.make_order([s.num_records for s in info])
    first = int(self.order.indices(0)[0])
    k = int(np.searchsorted(self.order.starts, first, side="right")) - 1
    self.named = self.output.shard_path(info[k])
    self.key = _media(self.named)

  def run(self, deadline):
    stream = self.stream_type(self.output, "train", self.order, 1, cache_dir=str(self.env.tmp / uuid.uuid4().hex))
    try:
      with stream.batch(0) as indices:
        assert [stream.raw(int(i)) for i in indices] == [self.env.local.raw(int(i)) for i in indices]
    finally:
      stream.close()


class ShardStreamRead(_Stream):
  stream_type = ShardStream

  @staticmethod
  def make_order(counts):
    return WindowOrder(counts, 1, 4, seed=0)


class RecordStreamRead(_Stream):
  stream_type = RecordStream

  @staticmethod
  def make_order(counts):
    return WindowOrder(counts, 2, 4, seed=0, order="global", shard_count=2)


class Compose(_Path):
  method = "POST"

  def __init__(self, env, tag):
    super().__init__(env, tag)
    self.parts = [f"{self.root}/part-{i}" for i in range(3)]
    for i, p in enumerate(self.parts):
      files.write_bytes(p, DATA[i::3])
    self.dest = f"{self.root}/joined"
    self.named = f"composing {self.dest}"
    self.key = f"/o/{files.split_gcs(self.dest)[1]}/compose"

  def run(self, deadline):
    files.compose(self.parts, self.dest, f"{self.root}/scratch")
    assert files.read_bytes(self.dest) == b"".join(DATA[i::3] for i in range(3))


class CommitSwitch(_Path):
  """The manifest's compare-and-swap upload (ifGenerationMatch=0: no manifest yet)."""

  method = "POST"
  key = "ifGenerationMatch=0"

  def __init__(self, env, tag):
    super().__init__(env, tag)
    self.generation, self.expected = commit.begin(self.root)
    self.named = f"{self.root}/manifest.json"

  def run(self, deadline):
    commit.commit(self.root, self.generation, _manifest(self.generation), self.expected)
    assert commit.current_generation(self.root) == self.generation


class LeaseWrite(_Path):
  method = "POST"
  key = "uploadType=multipart"

  @property
  def named(self) -> str:
    return f"writing the reader lease {self.root}/_leases/"

  def run(self, deadline):
    with leases.acquire(self.root, GEN, heartbeat=False):
      assert leases.held_generations(self.root) == {GEN}


PATHS = [InputRead, Listing, RangedRead, Download, ShardStreamRead, RecordStreamRead, Compose, CommitSwitch,
         LeaseWrite]


class _Env:
  def __init__(self, root, stream_output, local, tmp):
    self.root, self.stream_output, self.local, self.tmp = root, stream_output, local, tmp


@pytest.fixture(scope="module")
def env(_gcs_server, tmp_path_factory):
  """A folder in the emulator's bucket, and a small ArrayRecord output there (4 shards) with its local twin."""
  bucket, _ = _gcs_server
  base = tmp_path_factory.mktemp("retry")
  make_sample_images.make_folder(str(base / "images"), ["a", "b"], 8, None, (64, 48), 0, seed=4)
  local = str(base / "out")
  image_folder.run([f"--input={base / 'images'}", f"--output={local}", "--num_shards=4", "--encoding=raw",
                    "--image_size=8,8"])
  remote = f"gs://{bucket}/retry/stream"
  upload_tree(local, remote)
  return _Env(f"gs://{bucket}/retry", remote, ShardedRecords(local), base)


def _seen(proxy, path: _Path) -> int:
  return proxy.requests_seen(path.key, method=path.method)


@pytest.mark.slow
@pytest.mark.gcs
@pytest.mark.parametrize("kind", PATHS, ids=lambda p: p.__name__)
def test_a_storm_of_503s_is_retried_the_same_way_on_every_path(kind, env, gcs_faults):
  """K 503s then success: the data is right, and the request took K + 1 attempts on every path."""
  with retry.using(FAST):
    clean = kind(env, "clean")
    before = _seen(gcs_faults, clean)
    clean.run(FAST.timeout)
    requests_clean = _seen(gcs_faults, clean) - before
    stormy = kind(env, "storm")
    gcs_faults.add_fault(stormy.key, status=503, times=K, method=stormy.method)
    before = _seen(gcs_faults, stormy)
    stormy.run(FAST.timeout)
    assert not gcs_faults._faults, "the storm was not met"
    assert _seen(gcs_faults, stormy) - before - requests_clean == K


@pytest.mark.slow
@pytest.mark.gcs
@pytest.mark.parametrize("kind", PATHS, ids=lambda p: p.__name__)
def test_a_storm_longer_than_the_deadline_gives_up_with_one_error_type_naming_the_object(kind, env, gcs_faults):
  with retry.using(FAST.with_timeout(SHORT_S)):
    path = kind(env, "outage")
    gcs_faults.add_fault(path.key, status=503, method=path.method)  # until cleared
    started, before = time.monotonic(), _seen(gcs_faults, path)
    with pytest.raises(retry.RetryExhausted) as e:
      path.run(SHORT_S)
    gcs_faults.clear_faults()
  assert time.monotonic() - started < 20
  message = str(e.value)
  assert path.named in message and "transient errors persisted" in message and "503" in message, message
  assert e.value.attempts >= 2
  if not issubclass(kind, _Stream):  # one request, retried at one level: every attempt is the policy's
    assert _seen(gcs_faults, path) - before == e.value.attempts


@pytest.mark.slow
@pytest.mark.gcs
@pytest.mark.parametrize("status", [404, 412])
@pytest.mark.parametrize("kind", PATHS, ids=lambda p: p.__name__)
def test_a_404_or_412_is_not_retried(kind, status, env, gcs_faults):
  """The fault is met once: had the path retried it, the retry would have succeeded."""
  with retry.using(FAST):
    path = kind(env, f"final-{status}")
    gcs_faults.add_fault(path.key, status=status, times=1, method=path.method)
    with pytest.raises(Exception) as e:
      path.run(FAST.timeout)
  assert not gcs_faults._faults, "the fault was not met"
  assert not isinstance(e.value, retry.RetryExhausted), e.value
