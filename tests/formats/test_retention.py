"""Retention of replaced generations and the reader leases that clean-up honours (formats.outputs.commit, formats.outputs.leases).

Times are moved with `now=` (or the retention set to 0), never waited for.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from formats.outputs import commit, inspect, leases
from formats.storage import files
from tests.conftest import REPO
from tests.pipelines.test_commit_faults import _manifest, output  # noqa: F401 (output: the fixture, local and gs://)

WEEK = commit.DEFAULT_KEEP_REPLACED_SECONDS
SHARD = "d-train.tfrecord-00000-of-00001"


def _run(output: str, commit_it: bool = True) -> str:
  """One run: a generation with a shard, committed (or failed), finished as the launcher does."""
  gen, expected = commit.begin(output)
  files.write_bytes(files.join(output, gen, SHARD), gen.encode())
  if commit_it:
    commit.commit(output, gen, _manifest(gen), expected)
  assert commit.finish(output, gen) is commit_it
  return gen


def _present(output: str, gen: str) -> bool:
  return files.exists(files.join(output, gen, SHARD))


def _states(output: str, **kw) -> dict[str, str]:
  return {g.name: g.state for g in commit.list_generations(output, **kw)}


def test_a_replaced_generation_is_kept_for_the_retention_then_removed(output):
  old = _run(output)
  new = _run(output)
  assert _states(output) == {old: "replaced", new: "current"}
  marker = json.loads(files.read_bytes(files.join(output, old, commit.MARKER_FILENAME)))
  assert marker["state"] == "replaced" and marker["replaced_by"] == new and marker["replaced_at"]
  assert commit.cleanup(output) == []
  assert commit.cleanup(output, now=time.time() + WEEK - 3600) == []  # an hour before the retention ends
  assert _present(output, old)
  (status,) = [g for g in commit.list_generations(output, now=time.time() + WEEK + 60) if g.name == old]
  assert status.removable and "retention over" in status.reason
  assert commit.cleanup(output, now=time.time() + WEEK + 60) == [old]
  assert not _present(output, old) and _states(output) == {new: "current"}
  assert _present(output, new)


def test_retention_zero_removes_a_replaced_generation_at_once(output):
  old = _run(output)
  new = _run(output)
  assert commit.cleanup(output, keep_replaced_seconds=0) == [old]
  assert _states(output) == {new: "current"}


def test_the_retention_of_an_unmarked_generation_starts_when_cleanup_marks_it(tmp_path):
  """A switch killed before it marked the generation it replaced: the marker's old time is not the clock."""
  output = str(tmp_path / "out")
  old = _run(output)
  new = _run(output)
  commit._write_marker(output, old, "committed")  # as the kill left it
  month_ago = time.time() - 30 * 86400
  os.utime(os.path.join(output, old, commit.MARKER_FILENAME), (month_ago, month_ago))
  assert _states(output)[old] == "committed"
  assert commit.cleanup(output) == []  # marked replaced now, kept a week from now
  assert _states(output) == {old: "replaced", new: "current"}
  assert commit.cleanup(output, now=time.time() + WEEK + 60) == [old]


def test_a_live_lease_holds_a_replaced_generation_past_its_retention(output):
  old = _run(output)
  new = _run(output)
  with leases.acquire(output, old, purpose="train") as lease:
    assert commit.cleanup(output, keep_replaced_seconds=0) == []
    (status,) = [g for g in commit.list_generations(output, keep_replaced_seconds=0) if g.name == old]
    assert (status.leases, status.removable) == (1, False) and "held by 1 reader lease" in status.reason
    assert _present(output, old)
    lease.refresh()
  assert commit.cleanup(output, keep_replaced_seconds=0) == [old]  # released: free
  assert _states(output) == {new: "current"}


def test_a_lease_taken_while_cleanup_removes_the_generation_keeps_it(tmp_path, monkeypatch):
  """A reader's lease that lands between clean-up's decision and its delete: the generation stays
  (abandoned), and the next clean-up that finds it free removes it, retention or not."""
  output = str(tmp_path / "out")
  old = _run(output)
  new = _run(output)
  real, taken = commit._abandon, []

  def abandon_then_a_reader_comes(out, gen, info=None):
    done = real(out, gen, info)
    taken.append(leases.acquire(out, gen, heartbeat=False))
    return done

  monkeypatch.setattr(commit, "_abandon", abandon_then_a_reader_comes)
  assert commit.cleanup(output, keep_replaced_seconds=0) == []
  monkeypatch.setattr(commit, "_abandon", real)
  assert _present(output, old) and commit.generation_state(output, old) == "abandoned"
  assert commit.cleanup(output) == []  # still held
  taken[0].release()
  assert commit.cleanup(output) == [old]  # its retention was over: not started again
  assert _states(output) == {new: "current"}


_READER = """
import sys, time
from formats.outputs import leases
lease = leases.acquire(sys.argv[1], sys.argv[2], purpose="dead reader", refresh_seconds=0.2)
print(lease.id, flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # a subprocess (a reader, killed)
def test_a_killed_readers_lease_expires_and_its_generation_is_then_removed(output):
  old = _run(output)
  new = _run(output)
  reader = subprocess.Popen([sys.executable, "-c", _READER, output, old], cwd=REPO, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": REPO})
  try:
    lease_id = reader.stdout.readline().strip()
    assert lease_id, "the reader did not take its lease"
    assert leases.held_generations(output) == {old}
    assert commit.cleanup(output, keep_replaced_seconds=0) == []  # a live reader holds it
  finally:
    reader.send_signal(signal.SIGKILL)
    reader.wait()
  assert reader.returncode == -9
  (info,) = leases.list_leases(output)
  assert info.id == lease_id and info.generation == old and info.purpose == "dead reader"
  assert commit.cleanup(output, keep_replaced_seconds=0) == []  # within its TTL it still holds
  after_ttl = time.time() + leases.LEASE_TTL_SECONDS + 60
  assert commit.cleanup(output, keep_replaced_seconds=0, now=after_ttl) == [old]
  assert leases.list_leases(output) == []  # the expired lease object went too
  assert _states(output) == {new: "current"}


def test_a_failed_runs_generation_is_kept_then_removed(output):
  current = _run(output)
  failed = _run(output, commit_it=False)
  assert _states(output) == {current: "current", failed: "abandoned"}
  assert _present(output, failed)  # a resumed run reads its shards
  assert commit.cleanup(output) == []
  assert commit.cleanup(output, now=time.time() + WEEK + 60) == [failed]
  assert _states(output) == {current: "current"}


def test_a_killed_runs_generation_is_kept_for_the_retention_after_its_last_heartbeat(output):
  current = _run(output)
  killed, _ = commit.begin(output)  # never finished, never heartbeats again
  files.write_bytes(files.join(output, killed, SHARD), b"half")
  assert _states(output)[killed] == "running"
  hour = time.time() + 3600
  assert _states(output, now=hour)[killed] == "dead"
  assert commit.cleanup(output, now=hour) == []  # dead, but within the retention
  assert commit.cleanup(output, lease_seconds=0, keep_replaced_seconds=0) == [killed]  # the old behaviour
  assert _states(output) == {current: "current"}


def test_a_killed_run_is_removed_after_the_retention(output):
  _run(output)
  killed, _ = commit.begin(output)
  assert commit.cleanup(output, now=time.time() + WEEK + 60) == [killed]


def test_hostile_leases_hold_nothing_and_do_not_stop_cleanup(output):
  old = _run(output)
  new = _run(output)
  bad = {"toolkit": "someone-else", "generation": old, "host": "h", "pid": 1, "purpose": ""}
  files.write_bytes(files.join(output, leases.LEASES_FOLDER, "a" * 32 + ".json"), json.dumps(bad).encode())
  files.write_bytes(files.join(output, leases.LEASES_FOLDER, "b" * 32 + ".json"), b"\x00\xff not json")
  sneaky = {**bad, "toolkit": "tpu-shards", "generation": f"{old}/../{old}"}
  files.write_bytes(files.join(output, leases.LEASES_FOLDER, "c" * 32 + ".json"), json.dumps(sneaky).encode())
  files.write_bytes(files.join(output, leases.LEASES_FOLDER, "notes.txt"), b"hello")
  assert commit.cleanup(output, keep_replaced_seconds=0, now=time.time() + 86400) == [old]
  assert _states(output) == {new: "current"}
  assert len(leases.list_invalid(output)) == 4  # all left in place (not the toolkit's to delete)


def test_cleanup_never_removes_what_the_toolkit_did_not_mark(output):
  current = _run(output)
  files.write_bytes(files.join(output, "gen-notes", "todo.txt"), b"a user's")
  assert commit.cleanup(output, lease_seconds=0, keep_replaced_seconds=0, now=time.time() + 10 * WEEK) == []
  assert _states(output) == {current: "current", "gen-notes": "foreign"}
  assert files.read_bytes(files.join(output, "gen-notes", "todo.txt")) == b"a user's"


@pytest.mark.parametrize("bad", [-1, float("nan"), "7d", None])
def test_a_bad_retention_is_refused(tmp_path, bad):
  with pytest.raises(ValueError, match="keep_replaced_seconds must be a number of seconds"):
    commit.cleanup(str(tmp_path), keep_replaced_seconds=bad)


def test_inspect_lists_generations_and_leases_and_repair_honours_them(tmp_path, capsys):
  output = str(tmp_path / "out")
  held = _run(output)
  replaced = _run(output)
  failed = _run(output, commit_it=False)
  current = _run(output)
  live, _ = commit.begin(output)
  files.write_bytes(files.join(output, leases.LEASES_FOLDER, "notes.txt"), b"hello")
  expired = leases.acquire(output, replaced, heartbeat=False)
  month_ago = time.time() - 30 * 86400
  os.utime(files.join(output, leases.LEASES_FOLDER, f"{expired.id}.json"), (month_ago, month_ago))
  with leases.acquire(output, held, purpose="train job 7"):
    capsys.readouterr()
    assert inspect.main([output, "--repair"]) == 0
    out = capsys.readouterr().out
  lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  gen-")}
  assert lines[current].split()[1] == "current"
  assert lines[live].split()[1] == "running"
  assert lines[failed].split()[1] == "abandoned" and "kept until" in lines[failed]
  assert lines[replaced].split()[1] == "replaced" and f"replaced by {current}" in lines[replaced]
  assert "kept until" in lines[replaced]
  assert lines[held].split()[1] == "replaced" and f"replaced by {replaced}" in lines[held]
  assert "held by 1 reader lease" in lines[held]
  assert "reader leases: 1 held, 0 expired" in out  # --repair removed the expired one first
  assert "train job 7" in out and "ignored _leases/notes.txt" in out
  assert all(_present(output, g) for g in (held, replaced, failed, current))  # retention and the lease held


def test_a_marker_that_is_too_large_or_a_link_is_no_marker(tmp_path):
  """Markers are untrusted too: clean-up reads at most MAX_MARKER_BYTES of a regular file, and a
  folder whose marker is not one is never touched (however abandoned its marker claims it is)."""
  output = str(tmp_path / "out")
  current = _run(output)
  claim = {"toolkit": "tpu-shards", "state": "abandoned", "removing": True}
  big, linked = "gen-20250101T000000-0000000b", "gen-20250101T000000-0000000c"
  padded = json.dumps({**claim, "generation": big}) + " " * commit.MAX_MARKER_BYTES
  files.write_bytes(files.join(output, big, commit.MARKER_FILENAME), padded.encode())
  elsewhere = tmp_path / "marker.json"
  elsewhere.write_text(json.dumps({**claim, "generation": linked}))
  os.makedirs(os.path.join(output, linked))
  os.symlink(elsewhere, os.path.join(output, linked, commit.MARKER_FILENAME))
  assert commit.cleanup(output, lease_seconds=0, keep_replaced_seconds=0) == []
  assert _states(output) == {current: "current", big: "foreign", linked: "foreign"}
  assert os.path.exists(os.path.join(output, big, commit.MARKER_FILENAME)) and elsewhere.exists()
