"""Races of the commit protocol with clean-up (formats.outputs.commit): an undone gs:// switch, and a run that
goes on writing after a clean-up took its generation.

The invariant: a reader that follows the manifest finds every shard it names; nothing the toolkit wrote is
left behind as "foreign" (never removed). gs:// cases run on the emulator behind the proxy that enforces
generation preconditions (tests/gcs_faults.py).
"""

from __future__ import annotations

import os
import time

import pytest

from formats.outputs import commit
from formats.storage import files
from tests.pipelines.test_commit_faults import _committed_run, _manifest, _put, _read_manifest, output  # noqa: F401

SHARD = "d-train.tfrecord-00000-of-00001"


def _missing(output: str) -> list[str]:
  """The data files the output's manifest names that are not there."""
  m = _read_manifest(output)
  named = [s.path for split in m.splits.values() for s in split.shards] + [m.rejected.path]
  return [p for p in named if not files.exists(files.join(output, p))]


def _killed_after_its_switch(output: str) -> str:
  """A run that committed and was killed before `finish`: its marker stays "running", its heartbeat stops."""
  gen, expected = commit.begin(output)
  _put(output, f"{gen}/{SHARD}")
  _put(output, f"{gen}/errors/rejected.jsonl", b"")
  commit.commit(output, gen, _manifest(gen), expected)
  return gen


# Clean-up B runs while the switch is in flight: another run's, with --keep_replaced=0; or any run's with the
# default retention, when the previous output's run was killed after its switch long ago (a "dead" generation).
_CLEANUPS = {
    "keep_replaced=0": (_committed_run, dict(keep_replaced_seconds=0)),
    "old output of a killed run": (_killed_after_its_switch,
                                   dict(now=time.time() + commit.DEFAULT_KEEP_REPLACED_SECONDS + 3600)),
}


@pytest.mark.parametrize("taken", ["abandoned", "removed"])
@pytest.mark.parametrize("previous", sorted(_CLEANUPS))
def test_an_undone_switch_never_restores_a_generation_a_clean_up_removed_meanwhile(gcs_emulator, tmp_path,
                                                                                  monkeypatch, taken, previous):
  """Clean-up A takes the run's generation just before its gs:// switch (A saw the old manifest); the switch
  is undone, putting the old manifest back. Clean-up B, between the switch and the undo, found the old
  generation named by nothing: it must not remove it, or the restored manifest names deleted shards."""
  output = f"gs://{gcs_emulator}/undo_race/{tmp_path.name}"
  make_old, cleanup_kwargs = _CLEANUPS[previous]
  old = make_old(output)
  _put(output, f"{old}/errors/rejected.jsonl", b"")
  gen, expected = commit.begin(output)
  _put(output, f"{gen}/{SHARD}")
  real_point, real_check = commit.fault_point, commit._check_claim
  removed = []

  def clean_up_a(name):  # between the switch's first check and its upload
    if name == "commit:before_switch":
      assert commit._abandon(output, gen, {"removing": True})  # A: nothing names it yet
      if taken == "removed":
        commit.remove_generation(output, gen)
    real_point(name)

  def clean_up_b(out, g):
    if clean_up_b.calls == 1:  # after the upload, before the check that sees A's mark
      removed.extend(commit.cleanup(out, **cleanup_kwargs))
    clean_up_b.calls += 1
    return real_check(out, g)

  clean_up_b.calls = 0
  monkeypatch.setattr(commit, "fault_point", clean_up_a)
  monkeypatch.setattr(commit, "_check_claim", clean_up_b)
  with pytest.raises(commit.CommitConflict):
    commit.commit(output, gen, _manifest(gen, 2), expected)
  assert clean_up_b.calls == 2
  assert commit.current_generation(output) == old  # the switch was undone
  assert _missing(output) == []
  assert old not in removed
  assert commit.generation_state(output, old) not in (None, "abandoned")  # a reader's lease check accepts it
  monkeypatch.setattr(commit, "fault_point", real_point)
  monkeypatch.setattr(commit, "_check_claim", real_check)
  assert old not in commit.cleanup(output, **cleanup_kwargs)  # and so does every later clean-up: it is current
  assert _missing(output) == []


def test_shards_a_run_writes_after_a_clean_up_took_its_generation_are_removed_too(output):
  """A run silent for a lease (its launcher killed, its Dataflow job going on) whose generation a clean-up
  removed: the shards its job writes afterwards, and its failed commit, leave no folder that is never removed."""
  old = _committed_run(output)
  gen, expected = commit.begin(output)
  _put(output, f"{gen}/d-train.tfrecord-00000-of-00002")
  assert commit.cleanup(output, lease_seconds=0, keep_replaced_seconds=0) == [gen]
  _put(output, f"{gen}/d-train.tfrecord-00001-of-00002")  # the job goes on
  with pytest.raises(commit.CommitConflict, match="is gone"):
    commit.commit(output, gen, _manifest(gen), expected)
  assert commit.generation_state(output, gen) == "abandoned"  # the toolkit's again: kept for the retention
  assert commit.cleanup(output) == []
  assert commit.cleanup(output, keep_replaced_seconds=0) == [gen]
  assert files.walk(files.join(output, gen)) == []
  assert {g.name: g.state for g in commit.list_generations(output)} == {old: "current"}


def test_a_shard_written_while_its_generation_is_removed_is_removed_too(output, monkeypatch):
  """The same race inside the removal: a shard lands after clean-up listed the folder, and the run's commit
  looks before the marker goes (it sees "abandoned")."""
  old = _committed_run(output)
  gen, expected = commit.begin(output)
  _put(output, f"{gen}/d-train.tfrecord-00000-of-00002")
  real_point = commit.fault_point

  def late_writer(name):
    if name == "remove:before_marker":
      _put(output, f"{gen}/d-train.tfrecord-00001-of-00002")
      with pytest.raises(commit.CommitConflict, match="is abandoned"):
        commit.commit(output, gen, _manifest(gen), expected)
    real_point(name)

  monkeypatch.setattr(commit, "fault_point", late_writer)
  assert commit.cleanup(output, lease_seconds=0, keep_replaced_seconds=0) == [gen]
  monkeypatch.setattr(commit, "fault_point", real_point)
  assert files.walk(files.join(output, gen)) == []
  assert {g.name: g.state for g in commit.list_generations(output)} == {old: "current"}


def test_a_restored_generation_marked_replaced_meanwhile_gets_its_full_retention_when_replaced_again(output):
  """A clean-up between an undone switch and its undo marks the old generation "replaced" (nothing named it;
  the first test here makes that state); the undo makes it current again. When a later run replaces it, its
  retention must start then, not at that early mark, or readers of it lose it before keep_replaced_seconds."""
  old = _committed_run(output)
  commit._mark(output, old, commit.REPLACED, {"replaced_at": "2026-01-01T00:00:00Z", "replaced_by": ""})
  if not files.is_gcs(output):  # the mark was made long ago (a gs:// object's time cannot be set back)
    marker = files.join(output, old, commit.MARKER_FILENAME)
    month_ago = time.time() - 30 * 86400
    os.utime(marker, (month_ago, month_ago))
  assert commit.current_generation(output) == old  # current again after the undo
  new = _committed_run(output)
  marker, _ = commit._read_marker(output, old)
  assert marker["state"] == "replaced" and marker["replaced_by"] == new
  keep = commit.DEFAULT_KEEP_REPLACED_SECONDS
  status = {g.name: g for g in commit.list_generations(output, now=time.time() + keep - 3600)}
  assert status[old].state == "replaced" and not status[old].removable
  assert old not in commit.cleanup(output, now=time.time() + keep - 3600)
  assert files.exists(files.join(output, old, "d-train.tfrecord-00000-of-00001"))
