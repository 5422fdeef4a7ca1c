"""Reader leases (formats.outputs.leases): written, refreshed, released, expired; hostile lease files hold nothing."""

from __future__ import annotations

import gc
import json
import logging
import os
import pickle
import time

import pytest

from formats.outputs import leases
from formats.storage import files

GEN = "gen-20260101T000000-0123abcd"


@pytest.fixture(params=["local", pytest.param("gcs", marks=[pytest.mark.gcs, pytest.mark.slow])])
def output(request, tmp_path):
  if request.param == "local":
    return str(tmp_path / "out")
  bucket = request.getfixturevalue("gcs_emulator")
  return f"gs://{bucket}/leases/{tmp_path.name}"


def _lease_path(output: str, lease_id: str) -> str:
  return files.join(output, leases.LEASES_FOLDER, f"{lease_id}.json")


def _mtime(path: str) -> float:
  return files.read_small(path, leases.MAX_LEASE_BYTES)[1]


def _wait_for(condition, what: str, deadline_s: float = 60.0) -> None:
  deadline = time.monotonic() + deadline_s
  while not condition():
    assert time.monotonic() < deadline, what
    time.sleep(0.05)


def test_a_lease_is_written_listed_and_released(output):
  lease = leases.acquire(output, GEN, purpose="train job 7", heartbeat=False)
  body = json.loads(files.read_bytes(_lease_path(output, lease.id)))
  assert body == {"toolkit": "tpu-shards", "generation": GEN, "host": body["host"], "pid": os.getpid(),
                  "purpose": "train job 7"}
  (info,) = leases.list_leases(output)
  assert (info.id, info.generation, info.pid, info.purpose, info.expired) == (lease.id, GEN, os.getpid(),
                                                                              "train job 7", False)
  assert leases.held_generations(output) == {GEN}
  assert leases.list_invalid(output) == []
  lease.release()
  lease.release()  # idempotent
  assert not files.exists(_lease_path(output, lease.id))
  assert leases.held_generations(output) == set()
  with leases.acquire(output, GEN) as held:
    assert leases.held_generations(output) == {GEN}
  assert not files.exists(_lease_path(output, held.id))


def test_a_lease_expires_after_its_ttl_and_only_then_is_removed(output):
  lease = leases.acquire(output, GEN, heartbeat=False)
  assert leases.remove_expired(output) == []  # fresh: kept
  later = time.time() + leases.LEASE_TTL_SECONDS + 1
  (info,) = leases.list_leases(output, now=later)
  assert info.expired
  assert info.age_seconds > leases.LEASE_TTL_SECONDS
  assert leases.held_generations(output, now=later) == set()
  assert leases.remove_expired(output, now=later) == [lease.id]
  assert leases.list_leases(output) == []
  lease.release()  # its object is gone already: fine


def test_the_heartbeat_thread_refreshes_the_lease(output):
  lease = leases.acquire(output, GEN, refresh_seconds=0.05)
  path = _lease_path(output, lease.id)
  if files.is_gcs(output):
    first = _mtime(path)
    _wait_for(lambda: _mtime(path) != first, "the lease object was never rewritten")
  else:
    os.utime(path, (time.time() - 3600, time.time() - 3600))  # as if an hour had passed
    _wait_for(lambda: time.time() - _mtime(path) < 600, "the lease was never refreshed")
  lease.release()
  assert not files.exists(path)
  time.sleep(0.3)
  assert not files.exists(path)  # no late beat re-created it


def test_a_removed_lease_is_written_again_by_the_next_beat(tmp_path, caplog):
  output = str(tmp_path / "out")
  lease = leases.acquire(output, GEN, refresh_seconds=0.05)
  path = _lease_path(output, lease.id)
  with caplog.at_level(logging.WARNING, logger="formats.outputs.leases"):
    os.remove(path)  # a clean-up took it for expired (the reader was paused past the TTL)
    _wait_for(lambda: os.path.exists(path), "the lease was not written again")
  lease.release()
  assert any("had been removed" in r.getMessage() for r in caplog.records)


def test_a_failed_refresh_warns_without_paths_and_the_next_beat_retries(tmp_path, caplog, monkeypatch):
  output = str(tmp_path / "secret-patient-folder")
  real, calls = leases._touch, []

  def flaky(path, data):
    calls.append(path)
    if len(calls) == 1:
      raise PermissionError(13, "denied", path)
    return real(path, data)

  monkeypatch.setattr(leases, "_touch", flaky)
  with caplog.at_level(logging.WARNING, logger="formats.outputs.leases"):
    lease = leases.acquire(output, GEN, refresh_seconds=0.05)
    _wait_for(lambda: len(calls) >= 2, "the beat after a failure did not run")
    lease.release()
  (warning,) = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
  assert lease.id in warning
  assert "PermissionError" in warning
  assert "secret-patient-folder" not in warning


def test_a_collected_lease_is_released_and_a_pickled_copy_does_not_own_it(output):
  lease = leases.acquire(output, GEN, refresh_seconds=0.05)
  path = _lease_path(output, lease.id)
  copy = pickle.loads(pickle.dumps(lease))  # what a worker process receives
  assert (copy.output, copy.generation, copy.id) == (lease.output, lease.generation, lease.id)
  copy.release()
  del copy
  gc.collect()
  assert files.exists(path)  # the copy neither released nor deleted the owner's lease
  del lease
  gc.collect()
  assert not files.exists(path)


def test_a_lease_that_cannot_be_written_raises_lease_error(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a folder")
  with pytest.raises(leases.LeaseError, match="cannot write the reader lease"):
    leases.acquire(str(blocker / "out"), GEN)
  with pytest.raises(OSError):  # LeaseError is an OSError: callers that catch OSError still do
    leases.acquire(str(blocker / "out"), GEN)


@pytest.mark.gcs
@pytest.mark.slow
def test_a_forbidden_bucket_raises_lease_error(gcs_faults, tmp_path):
  output = f"gs://{gcs_faults.bucket}/leases-403/{tmp_path.name}"
  gcs_faults.add_fault("/upload/storage/v1/b/", status=403)
  with pytest.raises(leases.LeaseError, match="Forbidden"):
    leases.acquire(output, GEN)


@pytest.mark.gcs
@pytest.mark.slow
def test_a_transient_error_on_the_lease_write_is_retried(gcs_faults, tmp_path):
  output = f"gs://{gcs_faults.bucket}/leases-503/{tmp_path.name}"
  gcs_faults.add_fault("/upload/storage/v1/b/", status=503, times=2)
  with leases.acquire(output, GEN, heartbeat=False):
    assert leases.held_generations(output) == {GEN}


@pytest.mark.parametrize("generation", ["", "notgen", "gen-../../etc", "gen-a/b", "gen-\x1b[2J", 7])
def test_acquire_refuses_what_is_not_a_generation(tmp_path, generation):
  with pytest.raises(ValueError, match="not a generation folder name"):
    leases.acquire(str(tmp_path / "out"), generation)


def _hostile(output: str) -> dict[str, bytes]:
  """Objects other teams (or a broken tool) left under _leases/: each must hold nothing."""
  def lease(**fields):
    body = {"toolkit": "tpu-shards", "generation": GEN, "host": "h", "pid": 1, "purpose": "", **fields}
    return json.dumps(body).encode()

  hostile = {
      "0" * 32 + ".json": b"{not json",
      "1" * 32 + ".json": b"[1, 2]",
      "2" * 32 + ".json": lease(toolkit="someone-else"),
      "3" * 32 + ".json": lease(generation="gen-../" + GEN),
      "4" * 32 + ".json": lease(generation="models"),
      "5" * 32 + ".json": lease(generation=["gen-x"]),
      "6" * 32 + ".json": lease(pid="1; rm -rf /"),
      "7" * 32 + ".json": lease(host="\x1b]0;pwned\x07"),
      "8" * 32 + ".json": lease(purpose="x" * 10_000),  # over MAX_LEASE_BYTES
      "notes.txt": b"a user's notes",
      "sub/" + "9" * 32 + ".json": lease(),  # not directly under _leases/
  }
  for name, data in hostile.items():
    files.write_bytes(files.join(output, leases.LEASES_FOLDER, name), data)
  return hostile


def test_hostile_lease_files_hold_nothing_are_reported_and_never_removed(output):
  hostile = _hostile(output)
  later = time.time() + leases.LEASE_TTL_SECONDS + 1
  assert leases.list_leases(output) == []
  assert leases.held_generations(output) == set()
  assert leases.remove_expired(output, now=later) == []
  invalid = dict(leases.list_invalid(output))
  expected = {n for n in hostile if "/" not in n} | {"sub" if not files.is_gcs(output) else "sub/" + "9" * 32 + ".json"}
  assert set(invalid) == expected, invalid
  assert invalid["2" * 32 + ".json"] == "not written by the toolkit"
  assert invalid["3" * 32 + ".json"] == "malformed (names no generation folder)"
  for name, data in hostile.items():  # nothing was removed
    assert files.read_bytes(files.join(output, leases.LEASES_FOLDER, name)) == data


def test_a_symbolic_link_in_the_leases_folder_is_not_followed(tmp_path):
  output = str(tmp_path / "out")
  os.makedirs(os.path.join(output, leases.LEASES_FOLDER))
  target = tmp_path / "elsewhere.json"
  target.write_text(json.dumps({"toolkit": "tpu-shards", "generation": GEN, "host": "h", "pid": 1, "purpose": ""}))
  os.symlink(target, os.path.join(output, leases.LEASES_FOLDER, "a" * 32 + ".json"))
  assert leases.held_generations(output) == set()
  assert leases.list_invalid(output) == [("a" * 32 + ".json", "not a lease (not a regular file)")]


def test_a_release_that_cannot_delete_logs_and_lets_the_lease_expire(tmp_path, monkeypatch, caplog):
  """At interpreter exit the storage client may be gone: the release logs one warning, raises nothing."""
  out = str(tmp_path / "out")
  gen = "gen-20260101T000000-00000001"
  os.makedirs(os.path.join(out, gen))
  lease = leases.acquire(out, gen, heartbeat=False)

  def broken(*a, **k):
    raise RuntimeError("no client")

  monkeypatch.setattr(leases.files, "delete_many", broken)
  with caplog.at_level("WARNING"):
    lease.release()
  assert any("expires by itself" in r.getMessage() for r in caplog.records)
