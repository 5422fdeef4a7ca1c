"""loaders.graph.load of a gs:// graph: parallel ranged reads, checked as they arrive, resumable."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import sys

import numpy as np
import pytest

from formats.storage import files, gcs_download
from formats.errors import CorruptRecordError
from formats.features import Features
from formats.graphbin import GraphBin, GraphBinWriter
from formats.manifest import MANIFEST_FILENAME, FileInfo, Manifest, sha256_file
from loaders import graph as lg
from tests.conftest import upload_tree
from tests.damage import flip_byte

N = 20_000
CHUNK = 64 << 10  # ~20 chunks for the ~1.3 MB graph
OPTS = {"streams": 4, "chunk_bytes": CHUNK, "progress": False}


@pytest.fixture(scope="module")
def graph_output(tmp_path_factory) -> str:
  """A graph output of ~1.3 MB (several sections, each over more than one chunk)."""
  rng = np.random.default_rng(5)
  out = tmp_path_factory.mktemp("graph_download")
  path = str(out / "g.graphbin")
  degree = rng.integers(0, 10, N)
  with GraphBinWriter(path) as w:
    w.add_meta({"num_nodes": {"": N}})
    w.add("indptr", np.concatenate([[0], np.cumsum(degree)]).astype(np.int64))
    w.add("indices", rng.integers(0, N, int(degree.sum())).astype(np.int32))
    w.add("node/feat", rng.normal(size=(N, 8)).astype(np.float32))
    w.add("split/random/train", np.arange(0, N, 3, dtype=np.int64))
  info = FileInfo("g.graphbin", os.path.getsize(path), sha256_file(path), "graphbin")
  manifest = Manifest(name="g", file_format="graphbin", features=Features({}), splits={}, files=(info,))
  (out / MANIFEST_FILENAME).write_bytes(manifest.dumps())
  return str(out)


@pytest.fixture
def remote(graph_output, gcs_faults, tmp_path):
  """(gs:// output folder, object name of its .graphbin, fault proxy): a fresh copy per test."""
  gs = f"gs://{gcs_faults.bucket}/graph_download/{tmp_path.name}"
  upload_tree(graph_output, gs)
  return gs, f"graph_download/{tmp_path.name}/g.graphbin", gcs_faults


def _original(graph_output) -> bytes:
  with open(os.path.join(graph_output, "g.graphbin"), "rb") as f:
    return f.read()


def _cache_files(cache: str) -> list[str]:
  """The cache's files, but the empty lock file a download leaves (it must never be deleted: see download())."""
  return sorted(os.path.relpath(os.path.join(d, f), cache) for d, _, fs in os.walk(cache) for f in fs
                if not (f.endswith(".lock") and os.path.getsize(os.path.join(d, f)) == 0))


def _media_requests(proxy, name: str) -> int:
  return proxy.requests_seen(f"/o/{name}?alt=media", method="GET")


class _Interrupted(Exception):
  pass


_read_range_into = gcs_download.read_range_into


def _recording_reads(monkeypatch, fail_after: int | None = None) -> list[tuple[int, int]]:
  """Records every ranged read of the download machinery; raises _Interrupted at read `fail_after` + 1."""
  calls: list[tuple[int, int]] = []

  def read_range_into(obj, start, buffer, *a, **k):
    stop = start + len(buffer)
    if fail_after is not None and len(calls) >= fail_after:
      raise _Interrupted(f"bytes [{start}, {stop})")
    calls.append((start, stop))
    return _read_range_into(obj, start, buffer, *a, **k)

  monkeypatch.setattr(gcs_download, "read_range_into", read_range_into)
  return calls


def _chunks(calls: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """The chunk reads of one load: every read after the header's and the table's."""
  return sorted(calls[2:])


@pytest.mark.gcs
@pytest.mark.slow
def test_parallel_download_is_byte_identical_and_checked_without_a_second_pass(remote, graph_output, tmp_path,
                                                                              monkeypatch):
  gs, name, proxy = remote
  cache = str(tmp_path / "cache")
  section_checks = []
  real = GraphBin.verify
  monkeypatch.setattr(GraphBin, "verify", lambda self, *a, **k: section_checks.append(self.path) or real(self, *a, **k))
  before = _media_requests(proxy, name)
  g = lg.load(gs, cache_dir=cache, **OPTS)
  size = len(_original(graph_output))
  chunks = -(-size // CHUNK)
  assert _media_requests(proxy, name) - before == 2 + chunks > 10  # header, table, then every chunk once
  with open(g.path, "rb") as f:
    assert f.read() == _original(graph_output)
  local = lg.Graph(os.path.join(graph_output, "g.graphbin"), verify=False)
  np.testing.assert_array_equal(g.indices, local.indices)
  np.testing.assert_array_equal(g.node_features, local.node_features)
  assert section_checks == []  # every section's CRC was checked as it arrived, not in a pass of its own
  assert [os.path.basename(p) for p in _cache_files(cache)] == [
      "g.graphbin", "g.graphbin.fetched", "g.graphbin.sections-verified", "g.graphbin.verified"]
  before = _media_requests(proxy, name)
  lg.load(gs, cache_dir=cache, **OPTS)
  assert _media_requests(proxy, name) == before  # the verified copy is reused


@pytest.mark.gcs
@pytest.mark.slow
def test_a_section_damaged_in_the_bucket_is_named_and_nothing_is_cached(remote, graph_output, tmp_path):
  gs, _, _ = remote
  damaged = str(tmp_path / "g.graphbin")
  shutil.copy(os.path.join(graph_output, "g.graphbin"), damaged)
  feat = GraphBin(damaged).sections["node/feat"]
  flip_byte(damaged, feat.offset + feat.nbytes // 2)
  with open(damaged, "rb") as f:
    files.write_bytes(files.join(gs, "g.graphbin"), f.read())  # the manifest is unchanged
  cache = str(tmp_path / "cache")
  with pytest.raises(CorruptRecordError, match=r"section 'node/feat' at offset \d+ fails its checksum"):
    lg.load(gs, cache_dir=cache, **OPTS)
  assert _cache_files(cache) == []


@pytest.mark.gcs
@pytest.mark.slow
def test_an_interrupted_download_resumes_with_only_the_missing_ranges(remote, graph_output, tmp_path, monkeypatch):
  gs, name, proxy = remote
  cache = str(tmp_path / "cache")
  _recording_reads(monkeypatch, fail_after=2 + 5)  # the header, the table, then 5 chunks
  with pytest.raises(_Interrupted):
    lg.load(gs, cache_dir=cache, **{**OPTS, "streams": 2})
  [partial] = [p for p in _cache_files(cache) if p.endswith(".partial")]
  with open(os.path.join(cache, partial + ".json")) as f:
    done = [tuple(r) for r in json.load(f)["done"]]
  size = len(_original(graph_output))
  on_disk = sum(b - a for a, b in done)
  assert 5 * CHUNK <= on_disk < size

  calls = _recording_reads(monkeypatch)
  before = _media_requests(proxy, name)
  g = lg.load(gs, cache_dir=cache, **{**OPTS, "streams": 2})
  fetched = _chunks(calls)
  assert gcs_download._merge(fetched + done) == [(0, size)]  # together they cover the file ...
  assert all(b <= c or d <= a for a, b in fetched for c, d in done)  # ... and nothing on disk was fetched again
  assert sum(b - a for a, b in fetched) == size - on_disk
  assert _media_requests(proxy, name) - before == 2 + len(fetched)
  with open(g.path, "rb") as f:
    assert f.read() == _original(graph_output)
  assert not [p for p in _cache_files(cache) if ".partial" in p]


@pytest.mark.gcs
@pytest.mark.slow
def test_a_new_generation_between_runs_starts_over(remote, graph_output, tmp_path, monkeypatch):
  gs, _, _ = remote
  cache = str(tmp_path / "cache")
  _recording_reads(monkeypatch, fail_after=2 + 5)
  with pytest.raises(_Interrupted):
    lg.load(gs, cache_dir=cache, **{**OPTS, "streams": 2})
  files.write_bytes(files.join(gs, "g.graphbin"), _original(graph_output))  # same bytes, a new generation
  calls = _recording_reads(monkeypatch)
  g = lg.load(gs, cache_dir=cache, **OPTS)
  size = len(_original(graph_output))
  assert sum(b - a for a, b in _chunks(calls)) == size  # everything fetched again
  with open(g.path, "rb") as f:
    assert f.read() == _original(graph_output)


@pytest.mark.gcs
@pytest.mark.slow
def test_a_damaged_partial_is_fetched_again_rather_than_reported(remote, graph_output, tmp_path, monkeypatch,
                                                                  caplog):
  gs, _, _ = remote
  cache = str(tmp_path / "cache")
  _recording_reads(monkeypatch, fail_after=2 + 5)
  with pytest.raises(_Interrupted):
    lg.load(gs, cache_dir=cache, **{**OPTS, "streams": 2})
  [partial] = [p for p in _cache_files(cache) if p.endswith(".partial")]
  with open(os.path.join(cache, partial + ".json")) as f:
    assert any(a <= 100 < b for a, b in json.load(f)["done"])  # the damaged byte is one the sidecar says is on disk
  flip_byte(os.path.join(cache, partial), 100)
  monkeypatch.undo()
  calls = _recording_reads(monkeypatch)
  with caplog.at_level(logging.WARNING, logger="formats.storage.gcs_download"):
    g = lg.load(gs, cache_dir=cache, **OPTS)
  with open(g.path, "rb") as f:
    assert f.read() == _original(graph_output)
  assert "fetching it again from scratch" in caplog.text
  size = len(_original(graph_output))
  assert sorted(c for c in calls[2:] if c[0] == 0 and c[1] == min(CHUNK, size))  # the first chunk, fetched again


@pytest.mark.gcs
@pytest.mark.slow
def test_an_object_replaced_during_the_download_is_refused(remote, graph_output, tmp_path, monkeypatch):
  gs, name, proxy = remote
  cache = str(tmp_path / "cache")
  calls = []

  def read_range_into(obj, start, buffer, *a, **k):
    calls.append(start)
    if len(calls) == 4:  # after the header, the table and a chunk: a writer replaces the object
      files.write_bytes(files.join(gs, "g.graphbin"), _original(graph_output))
    return _read_range_into(obj, start, buffer, *a, **k)

  monkeypatch.setattr(gcs_download, "read_range_into", read_range_into)
  with pytest.raises(gcs_download.SourceChangedError, match="replaced during the download"):
    lg.load(gs, cache_dir=cache, **OPTS)
  assert _cache_files(cache) == []
  monkeypatch.undo()
  proxy.add_fault(f"/o/{name}?alt=media", status=412, times=1)  # how GCS answers a read of a stale generation
  with pytest.raises(gcs_download.SourceChangedError, match="replaced during the download"):
    lg.load(gs, cache_dir=cache, **OPTS)
  assert _cache_files(cache) == []


@pytest.mark.gcs
@pytest.mark.slow
def test_503s_and_dropped_connections_are_retried_not_reported(remote, graph_output, tmp_path, caplog,
                                                                monkeypatch):
  gs, name, proxy = remote
  calls = []

  def read_range_into(obj, start, buffer, *a, **k):  # the faults start with the chunks, which run in parallel
    calls.append(start)
    if len(calls) == 3:
      proxy.add_fault(f"/o/{name}?alt=media", status=503, times=3)
      proxy.add_fault(f"/o/{name}?alt=media", mode="drop", times=3)
    return _read_range_into(obj, start, buffer, *a, **k)

  monkeypatch.setattr(gcs_download, "read_range_into", read_range_into)
  caplog.set_level(logging.INFO, logger="formats.storage.gcs_download")
  g = lg.load(gs, cache_dir=str(tmp_path / "cache"), **OPTS)
  with open(g.path, "rb") as f:
    assert f.read() == _original(graph_output)
  assert not proxy._faults  # all six faults were met
  # each 503 is a counted retry; a dropped connection that had been kept alive is replaced at once, uncounted
  # (gcs_media: it looks like a stale keep-alive), so the drops add 0 to 3 counted retries
  assert 3 <= sum("retrying" in r.message for r in caplog.records) <= 6


@pytest.mark.gcs
@pytest.mark.slow
def test_a_chunk_that_keeps_failing_leaves_a_resumable_partial(remote, graph_output, tmp_path):
  gs, name, proxy = remote
  src = files.join(gs, "g.graphbin")
  obj = gcs_download.remote_object(src)
  dest = str(tmp_path / "cache" / "g.graphbin")
  options = gcs_download.DownloadOptions(streams=2, chunk_bytes=CHUNK, retries=2, backoff_s=0.01, progress=False)
  proxy.add_fault(f"/o/{name}?alt=media", mode="drop")  # until cleared
  with pytest.raises(ConnectionError, match=r"failed 3 times") as e:
    gcs_download.download(obj, dest, sha256_file(os.path.join(graph_output, "g.graphbin")), options=options)
  assert not isinstance(e.value, CorruptRecordError)
  assert os.path.exists(dest + ".partial")
  assert os.path.exists(dest + ".partial.json")
  assert not os.path.exists(dest)
  proxy.clear_faults()
  stats = gcs_download.download(obj, dest, sha256_file(os.path.join(graph_output, "g.graphbin")), options=options)
  assert stats.bytes_fetched == obj.size
  assert stats.bytes_resumed == 0
  with open(dest, "rb") as f:
    assert f.read() == _original(graph_output)


@pytest.mark.gcs
@pytest.mark.slow
def test_a_disk_too_small_is_named_before_anything_is_written(remote, graph_output, tmp_path, monkeypatch):
  gs, name, proxy = remote
  cache = str(tmp_path / "cache")
  monkeypatch.setattr(files.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
  before = _media_requests(proxy, name)
  with pytest.raises(gcs_download.NotEnoughSpaceError) as e:
    lg.load(gs, cache_dir=cache, **OPTS)
  size = len(_original(graph_output))
  message = str(e.value)
  assert "\n" not in message
  assert f"needs {size:,} bytes" in message
  assert "1,000 free" in message
  assert os.path.join(cache, "") in message
  assert isinstance(e.value, OSError)
  assert not os.path.exists(cache)
  assert _media_requests(proxy, name) - before == 2  # only the header and the table were read


@pytest.mark.gcs
@pytest.mark.slow
def test_progress_is_a_bar_on_a_terminal_a_log_line_otherwise_and_can_be_off(remote, tmp_path, monkeypatch, caplog,
                                                                             capsys):
  gs, _, _ = remote
  monkeypatch.setattr(gcs_download, "LOG_EVERY_S", 0.0)
  caplog.set_level(logging.INFO, logger="formats.storage.gcs_download")
  lg.load(gs, cache_dir=str(tmp_path / "logged"), streams=2, chunk_bytes=CHUNK)
  lines = [r.getMessage() for r in caplog.records]
  assert any("MB/s" in m and "ETA" in m for m in lines)
  assert any(m.endswith("0 retries)") for m in lines)
  assert capsys.readouterr().err == ""

  class Terminal(io.StringIO):
    def isatty(self):
      return True

  terminal = Terminal()
  monkeypatch.setattr(sys, "stderr", terminal)
  monkeypatch.setattr(gcs_download, "_BAR_EVERY_S", 0.0)
  lg.load(gs, cache_dir=str(tmp_path / "bar"), streams=2, chunk_bytes=CHUNK)
  bar = terminal.getvalue()
  assert bar.startswith("\r")
  assert bar.endswith("\n")
  assert "(100%)" in bar
  assert "MB/s" in bar
  assert "ETA" in bar

  caplog.clear()
  quiet = Terminal()
  monkeypatch.setattr(sys, "stderr", quiet)
  lg.load(gs, cache_dir=str(tmp_path / "quiet"), streams=2, chunk_bytes=CHUNK, progress=False)
  assert quiet.getvalue() == ""
  assert caplog.records == []


def test_options_are_checked():
  with pytest.raises(ValueError, match="streams must be an integer >= 1, got 0"):
    gcs_download.DownloadOptions(streams=0)
  with pytest.raises(ValueError, match="chunk_bytes must be an integer >= 4096, got 100"):
    gcs_download.DownloadOptions(chunk_bytes=100)


@pytest.mark.gcs
@pytest.mark.slow
def test_a_version_2_graph_is_fetched_and_checked(gcs_faults, tmp_path):
  """Section names over 56 bytes make a version 2 file (wider table entries): parsed by formats.graphbin."""
  out = tmp_path / "v2"
  out.mkdir()
  path = str(out / "g.graphbin")
  name = "aux/" + "x" * 60 + "/values"  # a section no check reads (a relation needs a typed graph)
  with GraphBinWriter(path) as w:
    w.add_meta({"num_nodes": {"": 10}})
    w.add(name, np.arange(200_000, dtype=np.int64))
  assert GraphBin(path).header.version == 2
  info = FileInfo("g.graphbin", os.path.getsize(path), sha256_file(path), "graphbin")
  (out / MANIFEST_FILENAME).write_bytes(
      Manifest(name="g", file_format="graphbin", features=Features({}), splits={}, files=(info,)).dumps())
  gs = f"gs://{gcs_faults.bucket}/graph_download/{tmp_path.name}"
  upload_tree(str(out), gs)
  g = lg.load(gs, cache_dir=str(tmp_path / "cache"), **OPTS)
  np.testing.assert_array_equal(g.bin[name], np.arange(200_000))


@pytest.mark.gcs
@pytest.mark.slow
def test_an_unstamped_file_in_the_cache_is_not_trusted(remote, graph_output, tmp_path):
  """A .graphbin in the cache without the stamp a verified download writes (an interrupted older version's
  leftover, a file put there by hand) is fetched again, never marked verified as it is."""
  gs, name, proxy = remote
  cache = str(tmp_path / "cache")
  g = lg.load(gs, cache_dir=cache, **OPTS)
  path = g.path
  del g
  for suffix in (".verified", ".sections-verified", ".fetched"):
    os.remove(path + suffix)
  flip_byte(path, 200)  # damaged and unstamped
  g = lg.load(gs, cache_dir=cache, **OPTS)
  with open(g.path, "rb") as f:
    assert f.read() == _original(graph_output)


@pytest.mark.gcs
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_a_cached_copy_damaged_since_its_download_is_fetched_again(remote, graph_output, tmp_path, damage):
  """The stamped copy was trusted forever: a byte changed in the cache came back as data, a cut copy failed
  every later load. It is checked like a local file (verify="sha256": hashed once per process) and fetched
  again when it differs."""
  gs, name, proxy = remote
  cache = str(tmp_path / "cache")
  path = lg.load(gs, cache_dir=cache, **OPTS).path
  if damage == "flip":
    flip_byte(path, os.path.getsize(path) // 2)
  else:
    os.truncate(path, os.path.getsize(path) - 100)
  with open(lg.load(gs, cache_dir=cache, **OPTS).path, "rb") as f:
    assert f.read() == _original(graph_output)


@pytest.mark.gcs
@pytest.mark.slow
def test_two_loads_at_once_share_one_download(remote, graph_output, tmp_path, monkeypatch):
  """Two loaders of one graph into one cache (threads here: each opens the partial file itself, so the
  lock between them is the one between processes): the second waits, then uses the first's verified copy."""
  import threading

  gs, name, proxy = remote
  cache = str(tmp_path / "cache")
  first_started = threading.Event()
  calls = _recording_reads(monkeypatch)
  slow_read = gcs_download.read_range_into

  def read_range_into(obj, start, buffer, *a, **k):
    if len(calls) > 2:  # the first load is fetching chunks: let the second one start meanwhile
      first_started.set()
    return slow_read(obj, start, buffer, *a, **k)

  monkeypatch.setattr(gcs_download, "read_range_into", read_range_into)
  results, errors = {}, []

  def load(key):
    try:
      if key == "second":
        first_started.wait(30)
      results[key] = lg.load(gs, cache_dir=cache, **{**OPTS, "streams": 1})
    except Exception as e:  # noqa: BLE001 - reported below
      errors.append(repr(e))

  threads = [threading.Thread(target=load, args=(k,)) for k in ("first", "second")]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  assert errors == []
  size = len(_original(graph_output))
  assert results["first"].path == results["second"].path
  with open(results["second"].path, "rb") as f:
    assert f.read() == _original(graph_output)
  assert len(calls) == 2 + -(-size // CHUNK) + 2  # one download; the second load read only the header and table
  assert not [f for f in _cache_files(cache) if f.endswith((".partial", ".partial.json"))]
