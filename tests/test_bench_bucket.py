"""scripts/bench_bucket.py against gcp-storage-emulator, byte for byte, and against GCS's own rules.

The same objects live in both: uploaded to the session's emulator (through its fault
proxy, no faults set) and staged into a bench bucket of the same name, so one gs://
path names either and only STORAGE_EMULATOR_HOST differs. What the emulator does not
do as GCS does (generation preconditions) is asserted for the bench bucket alone.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import os
import random
import threading
import urllib.parse
import uuid

import google_crc32c
import pytest

from formats.storage import files, gcs_download
from scripts import bench_bucket
from tests.conftest import upload_tree

pytestmark = [pytest.mark.slow, pytest.mark.gcs]

MiB = 1 << 20
# Object names below the test's prefix: spaces, unicode, '+', '%', '#', nesting, and neighbours that sort
# around '/' ('dir-' < 'dir.' < 'dir/'), with sizes 0, 1, small, around a page and above 1 MiB.
SIZES = {
    "empty.bin": 0, "one.bin": 1, "two bytes.bin": 2, "plus+sign.bin": 100, "per%cent.bin": 4096,
    "hash#tag.bin": 65537, "unicodé/ñame ü.bin": 777, "nested/top.bin": 10, "nested/a/sib.bin": 5000,
    "nested/a/b/c/deep.bin": 3, "dir-/y": 7, "dir.txt": 8, "dir/x": 9, "big.bin": MiB + 12345,
    **{f"list/p{i:03d}": 20 + i for i in range(11)},
}
PREFIX = f"bbcmp-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def _env_host(host: str):
  old = os.environ.get("STORAGE_EMULATOR_HOST")
  os.environ["STORAGE_EMULATOR_HOST"] = host
  try:
    yield
  finally:
    os.environ["STORAGE_EMULATOR_HOST"] = old


def _client(host: str):
  """A google-cloud-storage client of its own for `host` (the client reads the variable when it is made)."""
  from google.auth.credentials import AnonymousCredentials
  from google.cloud import storage

  with _env_host(host):
    return storage.Client(project="test", credentials=AnonymousCredentials())


@pytest.fixture(scope="module")
def world(gcs_emulator, tmp_path_factory):
  """(data by name, emulator client, bench bucket, bench client, bucket name): the same objects in both."""
  rng = random.Random(22)
  data = {name: rng.randbytes(n) for name, n in SIZES.items()}
  local = tmp_path_factory.mktemp("bench_src")
  for name, blob in data.items():
    path = local / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
  assert upload_tree(str(local), f"gs://{gcs_emulator}/{PREFIX}") == len(data)
  root = str(tmp_path_factory.mktemp("bench_root"))
  staged = bench_bucket.stage(root, gcs_emulator, str(local), PREFIX)
  assert staged == f"gs://{gcs_emulator}/{PREFIX}"
  emulator = _client(os.environ["STORAGE_EMULATOR_HOST"])
  with bench_bucket.BenchBucket(root, latency_ms=0.0, mbps=0.0) as bench:
    yield data, emulator, bench, _client(bench.host), gcs_emulator


def _outcome(fn):
  """What a call gave: ('ok', value) or ('error', exception class name)."""
  try:
    return "ok", fn()
  except Exception as e:
    return "error", type(e).__name__


# --------------------------------------------------------------------------- the same answers as the emulator


def test_metadata_matches_the_emulator(world):
  data, emulator, _, bench, bucket = world
  for name, blob in data.items():
    a, b = emulator.bucket(bucket).get_blob(f"{PREFIX}/{name}"), bench.bucket(bucket).get_blob(f"{PREFIX}/{name}")
    assert (b.name, b.size, b.crc32c, b.md5_hash) == (a.name, a.size, a.crc32c, a.md5_hash), name
    assert b.size == len(blob)
    assert b.crc32c == base64.b64encode(google_crc32c.value(blob).to_bytes(4, "big")).decode()
    assert b.md5_hash == base64.b64encode(hashlib.md5(blob).digest()).decode()
    assert b.generation > 0
    assert b.metageneration == 1
    assert b.bucket.name == bucket


def test_full_downloads_match_the_emulator(world, tmp_path):
  data, emulator, bench_server, bench, bucket = world
  for name, blob in data.items():
    path = f"{PREFIX}/{name}"
    got = bench.bucket(bucket).blob(path).download_as_bytes()  # checks x-goog-hash (crc32c) on the way
    assert got == emulator.bucket(bucket).blob(path).download_as_bytes() == blob, name
    reloaded = bench.bucket(bucket).get_blob(path)  # then downloads go through its mediaLink
    assert reloaded.download_as_bytes(checksum="md5") == blob, name
  options = gcs_download.DownloadOptions(streams=4, chunk_bytes=64 * 1024, progress=False, durable=False)
  for name in ("big.bin", "hash#tag.bin", "unicodé/ñame ü.bin", "empty.bin"):
    gs = f"gs://{bucket}/{PREFIX}/{name}"
    sha = hashlib.sha256(data[name]).hexdigest()
    gcs_download.download(gcs_download.remote_object(gs), str(tmp_path / "emu" / name), sha, options=options)
    with bench_server.active():
      stats = gcs_download.download(gcs_download.remote_object(gs), str(tmp_path / "bench" / name), sha,
                                    options=options)
    assert stats.bytes_fetched == len(data[name])
    assert (tmp_path / "bench" / name).read_bytes() == (tmp_path / "emu" / name).read_bytes() == data[name]


def _ranges(size: int, rng: random.Random) -> list[tuple[int | None, int | None]]:
  """(start, end) pairs for download_as_bytes: random, first and last byte, suffixes, past the end."""
  out = [(None, None), (0, 0), (0, None), (None, 0), (-1, None), (-size - 5, None), (size + 3, None), (size, None),
         (0, size + 100)]
  if size:
    out += [(size - 1, size - 1), (size - 1, None), (size - 1, size + 10), (-size, None), (1, size - 1)]
  for _ in range(8 if size > 1 else 0):
    a = rng.randrange(size)
    out.append((a, rng.randrange(a, size)))
    out.append((-rng.randrange(1, size + 1), None))
  return out


def _gcs_range(blob: bytes, start: int | None, end: int | None) -> tuple[str, object]:
  """What GCS answers to download_as_bytes(start=, end=) (the Range header google-cloud-storage builds)."""
  size = len(blob)
  if start is None and end is None:
    return "ok", blob
  if start is None:
    start = 0
  if start < 0:  # bytes=-n: the last n bytes
    return ("error", "RequestRangeNotSatisfiable") if size == 0 else ("ok", blob[max(0, size + start):])
  if end is not None and end < start:  # an invalid range is ignored (RFC 9110)
    return "ok", blob
  if start >= size:  # an empty object has no satisfiable range: 416 'bytes */0'
    return "error", "RequestRangeNotSatisfiable"
  return "ok", blob[start:None if end is None else end + 1]


def test_ranged_reads_match_the_emulator(world):
  data, emulator, _, bench, bucket = world
  rng = random.Random(5)
  compared = 0
  for name, blob in data.items():
    a, b = emulator.bucket(bucket).blob(f"{PREFIX}/{name}"), bench.bucket(bucket).blob(f"{PREFIX}/{name}")
    for start, end in _ranges(len(blob), rng):
      got = _outcome(lambda: b.download_as_bytes(start=start, end=end))
      assert got == _gcs_range(blob, start, end), (name, start, end)
      # The emulator ignores suffix ranges (it sends the whole object) and answers a range starting at or
      # past the end with no bytes instead of 416: compare with it where it follows GCS.
      lo = 0 if start is None else start
      if (start, end) == (None, None) or (0 <= lo < len(blob) and (end is None or end >= lo)):
        assert got == _outcome(lambda: a.download_as_bytes(start=start, end=end)), (name, start, end)
        compared += 1
  assert compared > 150


def test_toolkit_range_reads_match_the_emulator(world):
  data, _, bench_server, _, bucket = world
  rng = random.Random(7)
  for name, blob in data.items():
    gs = f"gs://{bucket}/{PREFIX}/{name}"
    size = len(blob)
    spans = [(0, size), (0, 1), (size - 1, size), (size, size)] if size else [(0, 0)]
    spans += [tuple(sorted((rng.randrange(size + 1), rng.randrange(size + 1)))) for _ in range(10 if size else 0)]
    emu_obj = gcs_download.remote_object(gs)
    want = [gcs_download.read_range(emu_obj, a, z) for a, z in spans if a >= 0]
    with bench_server.active():
      obj = gcs_download.remote_object(gs)
      got = [gcs_download.read_range(obj, a, z) for a, z in spans if a >= 0]
    assert (obj.size, obj.path) == (emu_obj.size, emu_obj.path)
    assert got == want == [blob[a:z] for a, z in spans if a >= 0], name


def _listing(client, bucket: str, **kw) -> tuple[list[str], list[str], int]:
  """(names, prefixes, pages) of a whole listing, paths relative to the test's prefix."""
  it = client.list_blobs(bucket, **kw)
  names, prefixes, pages = [], [], 0
  for page in it.pages:
    pages += 1
    names += [b.name for b in page]
    prefixes += sorted(page.prefixes)
  strip = len(PREFIX) + 1
  return [n[strip:] for n in names], [p[strip:] for p in prefixes], pages


@pytest.mark.parametrize("sub", ["", "nested/", "nested/a", "dir", "unicodé/", "list/p00", "nope/"])
@pytest.mark.parametrize("delimiter", [None, "/"])
def test_listing_matches_the_emulator(world, sub, delimiter):
  _, emulator, _, bench, bucket = world
  prefix = f"{PREFIX}/{sub}"
  for page_size in (None, 2, 3):
    want = _listing(emulator, bucket, prefix=prefix, delimiter=delimiter, page_size=page_size)
    got = _listing(bench, bucket, prefix=prefix, delimiter=delimiter, page_size=page_size)
    assert got[:2] == want[:2], (sub, delimiter, page_size)
    assert got[0] == sorted(got[0])
    if page_size and len(got[0]) + len(got[1]) > page_size:
      assert got[2] > 1  # paging happened
  # The emulator ignores maxResults (its one page holds everything): GCS gives the first max_results.
  capped = [b.name for b in bench.list_blobs(bucket, prefix=prefix, delimiter=delimiter, max_results=3)]
  assert capped == [b.name for b in emulator.list_blobs(bucket, prefix=prefix, delimiter=delimiter)][:3]


def test_toolkit_listing_matches_the_emulator(world):
  _, _, bench_server, _, bucket = world
  folders = ["", "nested", "nested/a", "unicodé", "list", "dir"]
  want = {f: (files.list_dir(f"gs://{bucket}/{PREFIX}/{f}"), files.walk(f"gs://{bucket}/{PREFIX}/{f}"))
          for f in folders}
  with bench_server.active():
    got = {f: (files.list_dir(f"gs://{bucket}/{PREFIX}/{f}"), files.walk(f"gs://{bucket}/{PREFIX}/{f}"))
           for f in folders}
    assert files.is_dir(f"gs://{bucket}/{PREFIX}/nested")
    assert not files.is_dir(f"gs://{bucket}/{PREFIX}/nope")
  assert got == want
  assert got[""][0] == (["dir", "dir-", "list", "nested", "unicodé"], sorted(
      n for n in SIZES if "/" not in n))


def test_listing_offsets_and_page_tokens(world):
  _, _, _, bench, bucket = world
  names, _, _ = _listing(bench, bucket, prefix=f"{PREFIX}/list/", start_offset=f"{PREFIX}/list/p003",
                         end_offset=f"{PREFIX}/list/p007", page_size=2)
  assert names == [f"list/p{i:03d}" for i in range(3, 7)]
  # Prefixes count towards a page and a page ends on a prefix without repeating it on the next one.
  _, prefixes, pages = _listing(bench, bucket, prefix=f"{PREFIX}/", delimiter="/", page_size=1)
  assert prefixes == ["dir-/", "dir/", "list/", "nested/", "unicodé/"]
  assert pages >= 5


def test_listing_pages_of_a_large_tree(world, tmp_path):
  _, _, bench_server, _, bucket = world
  src = tmp_path / "many"
  names = sorted(f"d{i % 7}/f{i:05d}" for i in range(2345))  # more than two default pages (1000)
  for name in names:
    (src / name).parent.mkdir(parents=True, exist_ok=True)
    (src / name).write_bytes(name.encode())
  gs = bench_bucket.stage(bench_server.root, bucket, str(src), f"{PREFIX}/many")
  before = bench_server.requests()
  with bench_server.active():
    assert files.walk(gs) == [f"{gs}/{n}" for n in names]
    assert files.list_dir(gs) == ([f"d{i}" for i in range(7)], [])
  # Three pages, one with the delimiter, and perhaps the new client's background GET of the bucket
  # (google-cloud-storage 3.x fetches a bucket's metadata once per client, for its tracing attributes).
  assert bench_server.requests() - before in (4, 5)
  assert bench_server.warm(gs) == len(names)


# --------------------------------------------------------------------------- GCS's rules (the emulator ignores them)


def test_missing_object_is_404(world):
  _, _, bench_server, bench, bucket = world
  from google.api_core.exceptions import NotFound

  blob = bench.bucket(bucket).blob(f"{PREFIX}/missing.bin")
  for call in (blob.reload, blob.download_as_bytes, blob.delete, lambda: blob.download_as_bytes(start=0, end=3)):
    with pytest.raises(NotFound):
      call()
  assert not blob.exists()
  with pytest.raises(NotFound):
    bench.bucket("no-such-bucket").blob("x").download_as_bytes()
  with bench_server.active(), pytest.raises(FileNotFoundError):
    gcs_download.remote_object(f"gs://{bucket}/{PREFIX}/missing.bin")


def test_stale_generation_is_412_on_read(world):
  data, _, bench_server, bench, bucket = world
  from google.api_core.exceptions import NotFound, NotModified, PreconditionFailed

  blob = bench.bucket(bucket).get_blob(f"{PREFIX}/hash#tag.bin")
  gen = blob.generation
  assert blob.download_as_bytes(if_generation_match=gen) == data["hash#tag.bin"]
  with pytest.raises(PreconditionFailed):
    blob.download_as_bytes(if_generation_match=gen + 1)
  with pytest.raises(PreconditionFailed):
    blob.download_as_bytes(start=5, end=10, if_generation_match=gen - 1)
  with pytest.raises(PreconditionFailed):
    blob.reload(if_generation_match=gen + 1)
  with pytest.raises(NotModified):
    blob.reload(if_generation_not_match=gen)
  with pytest.raises(NotFound):  # a generation that is not the live one does not exist (no versioning)
    bench.bucket(bucket).blob(blob.name, generation=gen + 1).download_as_bytes()
  assert bench.bucket(bucket).blob(blob.name, generation=gen).download_as_bytes() == data["hash#tag.bin"]
  with bench_server.active():
    stale = gcs_download.RemoteObject(f"gs://{bucket}/{blob.name}", blob.size, gen + 1)
    with pytest.raises(gcs_download.SourceChangedError):
      gcs_download.read_range(stale, 0, 10)


def test_uploads_enforce_preconditions(world):
  _, _, bench_server, bench, bucket = world
  from google.api_core.exceptions import PreconditionFailed

  blob = bench.bucket(bucket).blob(f"{PREFIX}/writes/lease.json")
  blob.upload_from_string(b"first", if_generation_match=0)
  g1 = bench.bucket(bucket).get_blob(blob.name).generation
  with pytest.raises(PreconditionFailed):
    blob.upload_from_string(b"again", if_generation_match=0)  # must not exist: it does
  with pytest.raises(PreconditionFailed):
    blob.upload_from_string(b"stale", if_generation_match=g1 + 1)
  blob.upload_from_string(b"second", if_generation_match=g1)
  g2 = bench.bucket(bucket).get_blob(blob.name).generation
  assert g2 > g1
  assert blob.download_as_bytes() == b"second"
  with pytest.raises(PreconditionFailed):
    blob.delete(if_generation_match=g1)
  # Larger than 8 MiB: google-cloud-storage switches to a resumable upload (a session, then PUTs).
  big = random.Random(1).randbytes(9 * MiB + 3)
  large = bench.bucket(bucket).blob(f"{PREFIX}/writes/big.bin")
  large.upload_from_string(big, if_generation_match=0)
  with pytest.raises(PreconditionFailed):
    large.upload_from_string(big[:10 * MiB], if_generation_match=0)
  assert large.download_as_bytes() == big
  assert bench.bucket(bucket).get_blob(large.name).size == len(big)
  with bench_server.active():
    files.write_bytes(f"gs://{bucket}/{PREFIX}/writes/toolkit.txt", b"via formats.storage.files")
    assert files.read_bytes(f"gs://{bucket}/{PREFIX}/writes/toolkit.txt") == b"via formats.storage.files"
    files.delete_many([f"gs://{bucket}/{PREFIX}/writes/toolkit.txt", f"gs://{bucket}/{PREFIX}/writes/none"])
    assert not files.exists(f"gs://{bucket}/{PREFIX}/writes/toolkit.txt")
  blob.delete(if_generation_match=g2)
  large.delete()
  assert not blob.exists()
  assert not large.exists()


def test_racing_creates_let_exactly_one_win(world):
  _, _, bench_server, _, bucket = world
  from google.api_core.exceptions import PreconditionFailed

  name = f"{PREFIX}/race/only-one"
  results = []

  def create(i: int) -> None:
    client = _client(bench_server.host)  # one client per thread: their own connections
    try:
      client.bucket(bucket).blob(name).upload_from_string(f"writer {i}".encode(), if_generation_match=0)
      results.append(i)
    except PreconditionFailed:
      results.append(None)

  threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  winners = [r for r in results if r is not None]
  assert len(results) == 6
  assert len(winners) == 1
  assert _client(bench_server.host).bucket(bucket).blob(name).download_as_bytes() == f"writer {winners[0]}".encode()


def test_a_replaced_file_gets_a_new_generation(world):
  _, _, bench_server, bench, bucket = world
  path = os.path.join(bench_server.root, bucket, PREFIX, "replaced", "f.bin")
  os.makedirs(os.path.dirname(path))
  with open(path, "wb") as f:
    f.write(b"one")
  blob = bench.bucket(bucket).blob(f"{PREFIX}/replaced/f.bin")
  blob.reload()
  g1 = blob.generation
  blob.reload()
  assert blob.generation == g1  # stable while the file is unchanged
  with open(path + ".tmp", "wb") as f:
    f.write(b"two!")
  os.replace(path + ".tmp", path)
  fresh = bench.bucket(bucket).get_blob(blob.name)
  assert fresh.generation != g1
  assert fresh.size == 4
  assert fresh.crc32c == base64.b64encode(google_crc32c.value(b"two!").to_bytes(4, "big")).decode()
  from google.api_core.exceptions import NotFound

  with pytest.raises(NotFound):  # the old mediaLink names the old generation
    blob.download_as_bytes()


# --------------------------------------------------------------------------- the server itself


def _raw(host: str, method: str, target: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
  parsed = urllib.parse.urlsplit(host)
  conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=10)
  try:
    conn.request(method, target, headers=headers or {})
    r = conn.getresponse()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
  finally:
    conn.close()


def test_path_escapes_are_refused(world, tmp_path):
  _, _, bench_server, bench, bucket = world
  secret = tmp_path / "secret.txt"
  secret.write_bytes(b"outside the root")
  folder = os.path.join(bench_server.root, bucket, PREFIX, "links")
  os.makedirs(folder)
  os.symlink(secret, os.path.join(folder, "out.txt"))
  os.symlink(tmp_path, os.path.join(folder, "outdir"))
  os.symlink(os.path.join(bench_server.root, bucket, PREFIX, "one.bin"), os.path.join(folder, "in.bin"))
  o = f"/storage/v1/b/{bucket}/o/"
  quote = lambda name: urllib.parse.quote(name, safe="")  # noqa: E731
  for name, want in [(f"{PREFIX}/links/out.txt", 404), (f"{PREFIX}/links/outdir/secret.txt", 404),
                     (f"{PREFIX}/../{PREFIX}/one.bin", 400), ("../../secret.txt", 400), ("/etc/passwd", 400),
                     (f"{PREFIX}/./one.bin", 400), (f"{PREFIX}//one.bin", 400)]:
    for target in (o + quote(name), o + quote(name) + "?alt=media",
                   f"/download/storage/v1/b/{bucket}/o/{quote(name)}?alt=media"):
      status, _, body = _raw(bench_server.host, "GET", target)
      assert status == want, (name, target)
      assert b"outside the root" not in body
      assert json.loads(body)["error"]["code"] == want
  for target in ("/storage/v1/b/../o/x", "/storage/v1/b/%2E%2E/o/x", "/storage/v1/b/.bench_tmp/o"):
    assert _raw(bench_server.host, "GET", target)[0] in (400, 404), target
  # A link that stays inside the root is an ordinary object; the ones leading out are neither listed nor read.
  names, _, _ = _listing(bench, bucket, prefix=f"{PREFIX}/links/")
  assert names == ["links/in.bin"]
  assert bench.bucket(bucket).blob(f"{PREFIX}/links/in.bin").download_as_bytes() == world[0]["one.bin"]


def test_errors_have_gcs_shape_and_unknown_calls_answer_501(world):
  _, _, bench_server, bench, bucket = world
  from google.api_core.exceptions import MethodNotImplemented

  status, headers, body = _raw(bench_server.host, "GET", f"/storage/v1/b/{bucket}/o/{PREFIX}%2Fmissing")
  error = json.loads(body)["error"]
  assert status == 404
  assert error["code"] == 404
  assert error["errors"][0]["reason"] == "notFound"
  assert headers["content-type"].startswith("application/json")
  for method, target in [("GET", "/nothing/here"), ("PATCH", f"/storage/v1/b/{bucket}/o/x"),
                         ("POST", f"/storage/v1/b/{bucket}/o/x/compose"), ("GET", f"/storage/v1/b/{bucket}/acl")]:
    status, _, body = _raw(bench_server.host, method, target)
    assert status == 501, (method, target)
    assert json.loads(body)["error"]["code"] == 501, (method, target)
  src = bench.bucket(bucket).blob(f"{PREFIX}/one.bin")
  with pytest.raises(MethodNotImplemented):
    bench.bucket(bucket).blob(f"{PREFIX}/composed").compose([src, src])
  # Ranges: 206 with Content-Range and GCS's headers, 416 past the end.
  status, headers, body = _raw(bench_server.host, "GET", f"/download/storage/v1/b/{bucket}/o/{PREFIX}%2Fbig.bin"
                               "?alt=media", {"Range": "bytes=-5"})
  size = SIZES["big.bin"]
  assert status == 206
  assert headers["content-range"] == f"bytes {size - 5}-{size - 1}/{size}"
  assert len(body) == 5
  assert headers["x-goog-stored-content-length"] == str(size)
  assert headers["x-goog-hash"].startswith("crc32c=")
  assert int(headers["x-goog-generation"]) > 0
  assert headers["x-goog-metageneration"] == "1"
  status, headers, _ = _raw(bench_server.host, "GET", f"/storage/v1/b/{bucket}/o/{PREFIX}%2Fbig.bin?alt=media",
                            {"Range": f"bytes={size}-"})
  assert status == 416
  assert headers["content-range"] == f"bytes */{size}"
  bucket_json = bench.get_bucket(bucket)
  assert bucket_json.name == bucket


def test_flags_take_effect(world):
  data, _, _, _, bucket = world
  with bench_bucket.BenchBucket(world[2].root, latency_ms=2.0, jitter_ms=1.0, mbps=5.0) as capped:
    stats = capped.stats()
    assert (stats["latency_ms"], stats["jitter_ms"], stats["mbps"]) == (2.0, 1.0, 5.0)
    client = _client(capped.host)
    assert client.bucket(bucket).blob(f"{PREFIX}/big.bin").download_as_bytes() == data["big.bin"]
    stats = capped.stats()
    assert stats["throttle_sleeps"] > 0
    assert stats["latency_sleeps"] == stats["requests"] == capped.requests()
    assert stats["bytes_sent"] == len(data["big.bin"])
    assert capped.server_cpu_seconds() >= 0.0
  with bench_bucket.BenchBucket(world[2].root, latency_ms=0.0, mbps=0.0) as free:
    before = bench_bucket.client_cpu_seconds()
    _client(free.host).bucket(bucket).blob(f"{PREFIX}/big.bin").download_as_bytes()
    stats = free.stats()
    assert stats["throttle_sleeps"] == 0
    assert stats["latency_sleeps"] == 0
    assert stats["requests"] >= 1
    assert bench_bucket.client_cpu_seconds() > before
  with pytest.raises(ValueError, match="mbps"):
    bench_bucket.ServerOptions(mbps=-1)


def test_active_switches_the_toolkit_client_and_restores_it(world):
  _, _, bench_server, _, bucket = world
  emulator_host = os.environ["STORAGE_EMULATOR_HOST"]
  before = files.gcs_client()
  with bench_server.active():
    assert os.environ["STORAGE_EMULATOR_HOST"] == bench_server.host
    assert files.gcs_client() is not before
    assert files.gcs_client()._connection.API_BASE_URL == bench_server.host
    served = bench_server.requests()
    assert files.exists(f"gs://{bucket}/{PREFIX}/one.bin")
    assert bench_server.requests() > served
  assert os.environ["STORAGE_EMULATOR_HOST"] == emulator_host
  assert files.gcs_client()._connection.API_BASE_URL == emulator_host


def test_stage_links_files_and_names_the_prefix(tmp_path):
  src = tmp_path / "src"
  (src / "a" / "b").mkdir(parents=True)
  (src / "a" / "b" / "f.bin").write_bytes(b"x")
  (src / "top.bin").write_bytes(b"y")
  os.symlink(src / "top.bin", src / "link.bin")
  root = tmp_path / "root"
  assert bench_bucket.stage(str(root), "bkt", str(src), "/p/q/") == "gs://bkt/p/q"
  assert bench_bucket.stage(str(root), "bkt2", str(src)) == "gs://bkt2"
  staged = root / "bkt" / "p" / "q"
  assert os.stat(staged / "a" / "b" / "f.bin").st_ino == os.stat(src / "a" / "b" / "f.bin").st_ino
  assert not os.path.islink(staged / "link.bin")
  assert (staged / "link.bin").read_bytes() == b"y"
  with pytest.raises(ValueError):
    bench_bucket.stage(str(root), "Bad_Bucket!", str(src))
