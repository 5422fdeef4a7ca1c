"""The fault harness of the commit protocol (formats.outputs.commit): races, kills, clean-up, gs:// preconditions.

Each test asserts the invariant, not only an exit status: the output verifies
against its manifest (formats.outputs.inspect --verify) and TFDS reads the same complete
output, the previous complete output is intact when a run did not commit, and
clean-up removes nothing the toolkit did not write.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import pytest

from formats import naming
from formats.outputs import commit, inspect
from formats.storage import files
from formats.features import Features, Text
from formats.manifest import Manifest, Rejected, ShardInfo, SplitInfo
from formats.outputs.output import verify as verify_output
from tests.conftest import CLASSES, PER_CLASS, REPO, run_module

pytestmark = pytest.mark.slow


def _manifest(generation: str, n: int = 1) -> Manifest:
  shard = ShardInfo(f"{generation}/d-train.tfrecord-00000-of-00001", n, 10, "0" * 64)
  return Manifest("d", "tfrecord", Features({"t": Text()}), {"train": SplitInfo((shard,))},
                  Rejected(0, {}, f"{generation}/errors/rejected.jsonl"))


def _put(output: str, rel: str, data: bytes = b"x") -> None:
  files.write_bytes(files.join(output, rel), data)


def _committed_run(output: str) -> str:
  """A run that wrote its shard, committed and finished, as the launcher does; returns its generation."""
  gen, expected = commit.begin(output)
  _put(output, f"{gen}/d-train.tfrecord-00000-of-00001")
  commit.commit(output, gen, _manifest(gen), expected)
  assert commit.finish(output, gen)
  return gen


def _read_manifest(out: str) -> Manifest:
  return Manifest.loads(files.read_bytes(files.join(out, "manifest.json")))


# --------------------------------------------------------------------------- the protocol, local and gs://


@pytest.fixture(params=["local", "gcs"])
def output(request, tmp_path):
  if request.param == "local":
    return str(tmp_path / "out")
  bucket = request.getfixturevalue("gcs_emulator")
  return f"gs://{bucket}/commit/{tmp_path.name}"


def test_the_second_of_two_racing_commits_loses_and_the_winner_stands(output):
  gen_a, expected_a = commit.begin(output)
  gen_b, expected_b = commit.begin(output)
  assert expected_a == expected_b and not expected_a.exists
  commit.commit(output, gen_a, _manifest(gen_a), expected_a)
  with pytest.raises(commit.CommitConflict, match="another run committed"):
    commit.commit(output, gen_b, _manifest(gen_b, 2), expected_b)
  assert commit.current_generation(output) == gen_a
  # A retry of the winner's own commit is a no-op, not a conflict.
  commit.commit(output, gen_a, _manifest(gen_a), expected_a)
  assert _read_manifest(output) == _manifest(gen_a)
  # The next run, started after the commit, replaces it.
  gen_c, expected_c = commit.begin(output)
  assert expected_c.exists and expected_c != expected_a
  replaced = commit.commit(output, gen_c, _manifest(gen_c, 3), expected_c)
  assert replaced == _manifest(gen_a)


def test_cleanup_removes_only_marked_generations_that_nothing_holds(output):
  put = functools.partial(_put, output)
  old = _committed_run(output)
  live, _ = commit.begin(output)  # a run still going: fresh heartbeat
  put(f"{live}/shard")
  dead, _ = commit.begin(output)  # a killed run: its marker is never refreshed
  put(f"{dead}/shard")
  put("gen-notes/todo.txt", b"a user's notes")  # looks like a generation, was not written by the toolkit
  put("report.tmp-draft", b"a user's file")  # the old clean-up deleted anything with .tmp- in its name
  put("gen-20250101T000000-deadbeef/_toolkit_run.json", b'{"toolkit": "someone else"}')
  new, expected = commit.begin(output)
  put(f"{new}/d-train.tfrecord-00000-of-00001")
  replaced = commit.commit(output, new, _manifest(new), expected)

  # Without retention (keep_replaced_seconds=0, as before retention existed): the replaced one goes at once,
  # the live and dead run stay within the lease. Retention is tested in tests/formats/test_retention.py.
  assert commit.cleanup(output, replaced=replaced, lease_seconds=3600, keep_replaced_seconds=0) == [old]
  assert sorted(commit.cleanup(output, replaced=replaced, lease_seconds=0, keep_replaced_seconds=0)) == sorted(
      [live, dead])
  dirs, names = files.list_dir(output)
  assert sorted(dirs) == sorted(["gen-notes", "gen-20250101T000000-deadbeef", new])
  assert "report.tmp-draft" in names
  assert files.read_bytes(files.join(output, "gen-notes/todo.txt")) == b"a user's notes"


def test_an_abandoned_run_keeps_its_generation_for_the_retention_unless_it_committed(output):
  gen, expected = commit.begin(output)
  files.write_bytes(files.join(output, gen, "shard"), b"x")
  assert not commit.finish(output, gen)
  assert commit.generation_state(output, gen) == "abandoned"  # kept: a resumed run may reuse its shards
  assert files.read_bytes(files.join(output, gen, "shard")) == b"x"
  assert commit.cleanup(output) == []  # within the retention
  assert commit.cleanup(output, keep_replaced_seconds=0) == [gen]
  assert not files.walk(files.join(output, gen)) and gen not in files.list_dir(output)[0]
  gen, expected = commit.begin(output)
  commit.commit(output, gen, _manifest(gen), expected)
  assert commit.finish(output, gen)  # failed after its commit (e.g. in clean-up): keeps its output
  assert files.exists(files.join(output, gen, commit.MARKER_FILENAME))
  assert commit.current_generation(output) == gen


def test_a_commit_whose_generation_was_cleaned_up_fails(output):
  gen, expected = commit.begin(output)
  commit.remove_generation(output, gen)
  with pytest.raises(commit.CommitConflict, match="is gone"):
    commit.commit(output, gen, _manifest(gen), expected)
  assert not files.exists(files.join(output, "manifest.json"))


def test_the_proxy_enforces_generation_preconditions(gcs_faults):
  """The emulator alone accepts stale preconditions: without this, the gs:// races above prove nothing."""
  from google.api_core.exceptions import PreconditionFailed

  blob = files.gcs_blob(f"gs://{gcs_faults.bucket}/precondition/obj")
  blob.upload_from_string(b"1", if_generation_match=0)
  with pytest.raises(PreconditionFailed):
    blob.upload_from_string(b"2", if_generation_match=0)
  blob.reload()
  with pytest.raises(PreconditionFailed):
    blob.upload_from_string(b"3", if_generation_match=blob.generation + 1)
  blob.upload_from_string(b"4", if_generation_match=blob.generation)
  assert blob.download_as_bytes() == b"4"


# --------------------------------------------------------------------------- real runs in subprocesses


def _run(*flags: str, env: dict | None = None, wait: bool = True, module: str = "pipelines.image_folder",
         setup: str = ""):
  return run_module(module, *flags, env={**os.environ, "PYTHONPATH": REPO, **(env or {})}, setup=setup, wait=wait)


def _paused_at_switch(tmp_path, *flags: str, module: str = "pipelines.image_folder"):
  """A run started now and held just before its switch; returns (process, release())."""
  flag = str(tmp_path / "go")
  slow = _run(*flags, env={commit.FAULT_POINT_ENV: f"commit:before_switch=pause:{flag}"}, wait=False, module=module)
  deadline = time.monotonic() + 240
  while not os.path.exists(flag + ".reached"):
    assert slow.poll() is None and time.monotonic() < deadline, slow.communicate()
    time.sleep(0.2)
  return slow, lambda: open(flag, "w").close()


def _tfds_view(out: str) -> tuple[dict[str, int], tuple[str, ...]]:
  """What TFDS serves: {split: records it reads}, class names. Raises if TFDS cannot open it."""
  code = f"""
import json, tensorflow_datasets as tfds
b = tfds.builder_from_directory({out!r})
ds = b.as_data_source()
print(json.dumps([{{s: len(ds[s]) for s in ds}}, b.info.features["label"].names,
                  [len(ds[s][i]["file_name"]) > 0 for s in ds for i in range(len(ds[s]))]]))
"""
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
  if proc.returncode:
    raise RuntimeError(proc.stderr.strip().splitlines()[-1])
  counts, names, read = json.loads(proc.stdout.strip().splitlines()[-1])
  assert all(read)  # every record of every shard TFDS lists was read
  return counts, tuple(names)


def _complete(out: str) -> Manifest:
  """The output verifies, and TFDS serves exactly what the manifest describes."""
  m = _read_manifest(out)
  assert verify_output(out, m) == 0
  counts, names = _tfds_view(out)
  assert counts == {k: v.num_records for k, v in m.splits.items() if v.num_records}
  assert names == tuple(m.features["label"].names)
  return m


def _generations(out: str) -> list[str]:
  return sorted(d for d in os.listdir(out) if naming.is_generation(d))


def _loser_kept_then_removed(out: str, winner: str) -> None:
  """The losing run marked its own generation abandoned and left it for the retention period (a
  resumed run reuses its shards); a clean-up without retention then leaves only the winner's."""
  states = {g.name: g.state for g in commit.list_generations(out)}
  assert states.pop(winner) == "current"
  assert list(states.values()) == ["abandoned"], states
  commit.cleanup(out, keep_replaced_seconds=0)
  assert [g.name for g in commit.list_generations(out)] == [winner]


def test_two_overlapping_runs_never_leave_a_manifest_that_fails_verify(class_folder, tmp_path):
  """An Airflow retry overlapping a slow job: the slow one reaches its switch after the fast one
  committed. It must lose loudly, and the winner's output must stay whole (the old clean-up
  deleted the slow run's shards, or the slow run's manifest then named deleted shards)."""
  out = str(tmp_path / "out")
  slow, release = _paused_at_switch(tmp_path, f"--input={class_folder}", f"--output={out}", "--num_shards=2")
  fast = _run(f"--input={class_folder}", f"--output={out}", "--num_shards=3")
  assert fast.returncode == 0, fast.stderr
  winner = _complete(out)
  assert len(_generations(out)) == 2  # the slow run's generation is live: not the fast run's to delete
  release()
  _, err = slow.communicate(timeout=240)
  assert slow.returncode == 1
  assert "another run committed a new manifest.json after this run started" in err.strip().splitlines()[-1]
  assert _complete(out) == winner
  _loser_kept_then_removed(out, winner.splits["train"].shards[0].path.split("/")[0])


# Every step of a switch, in order: a kill at any of them leaves the old or the new output.
_STEPS = ["finalize:start", "finalize:rejects_written", "commit:before_switch", "commit:after_switch",
          "commit:marked_replaced", "tfds:info_removed", "tfds:wrote_features.json", "tfds:wrote_label.labels.txt",
          "cleanup:done"]


@pytest.fixture(scope="module")
def old_output(tmp_path_factory, class_folder):
  """(a complete output of the class folder, a copy of that folder with one more class)."""
  import shutil

  other = str(tmp_path_factory.mktemp("more") / "pets")
  shutil.copytree(class_folder, other)
  shutil.copytree(os.path.join(other, CLASSES[0]), os.path.join(other, "yak"))
  out = str(tmp_path_factory.mktemp("old") / "out")
  assert _run(f"--input={class_folder}", f"--output={out}", "--num_shards=2").returncode == 0
  return out, _complete(out), other


@pytest.mark.parametrize("step", _STEPS)
def test_a_kill_at_any_step_leaves_the_old_or_the_new_output(old_output, tmp_path, step, capsys):
  import shutil

  old_out, old, new_input = old_output
  out = str(tmp_path / "out")
  shutil.copytree(old_out, out)
  killed = _run(f"--input={new_input}", f"--output={out}", "--num_shards=3", "--overwrite=true",
                env={commit.FAULT_POINT_ENV: step})
  assert killed.returncode == -9, killed.stderr  # the fault point was reached
  now = _read_manifest(out)
  assert verify_output(out, now) == 0
  assert now == old or now.splits["train"].num_records == (len(CLASSES) + 1) * PER_CLASS
  try:
    counts, names = _tfds_view(out)
  except RuntimeError as e:
    # Only while the class names change: dataset_info.json is removed before the label files are
    # rewritten, so TFDS finds no dataset (a clear error) rather than old shards with new names.
    assert step.startswith("tfds:") and "dataset_info.json" in str(e), e
  else:
    assert (counts, names) in [
        ({"train": m.splits["train"].num_records}, tuple(m.features["label"].names)) for m in (old, now)]
    if step in ("commit:after_switch",):  # the switch happened, TFDS not yet synced: it still serves the old output
      assert names == tuple(old.features["label"].names)
      assert inspect.main([out, "--verify"]) == 0  # the committed output is complete...
      assert "--repair" in capsys.readouterr().out  # ...and the lagging TFDS view is reported, with the fix
      assert inspect.main([out, "--repair", "--verify"]) == 0
      assert "TFDS metadata does not describe" not in capsys.readouterr().out
      assert _tfds_view(out) == ({"train": now.splits["train"].num_records}, tuple(now.features["label"].names))
  # The retry (what Airflow does) completes the job and repairs whatever the kill left.
  again = _run(f"--input={new_input}", f"--output={out}", "--num_shards=3", "--overwrite=true")
  assert again.returncode == 0, again.stderr
  final = _complete(out)
  assert final.splits["train"].num_records == (len(CLASSES) + 1) * PER_CLASS
  # At most the previous output's (replaced: kept for the retention) and the killed run's (kept until its
  # lease and the retention expire); no other.
  assert len(_generations(out)) <= 3
  states = {g.name: g.state for g in commit.list_generations(out)}
  assert sorted(states.values()).count("current") == 1
  assert set(states.values()) <= {"current", "replaced", "running", "abandoned"}, states
  old_gen = old.splits["train"].shards[0].path.split("/")[0]
  assert states[old_gen] == "replaced"  # the previous output stays readable for the retention period
  assert verify_output(out, old) == 0
  commit.cleanup(out, lease_seconds=0, keep_replaced_seconds=0)
  assert _generations(out) == [final.splits["train"].shards[0].path.split("/")[0]]
  assert verify_output(out, final) == 0


_CLEANUP_STEPS = ["cleanup:marked_replaced", "cleanup:abandoned", "remove:before_marker"]


@pytest.mark.parametrize("step", _CLEANUP_STEPS)
def test_a_kill_in_a_retention_cleanup_leaves_the_output_and_the_next_cleanup_finishes(output, step):
  """A clean-up killed while it marks a replaced generation or removes one whose retention is over:
  the current output is untouched, and the next clean-up (with the default retention) finishes the
  job: a generation whose removal had begun is not kept for another retention period."""
  put = functools.partial(_put, output)
  old = _committed_run(output)
  new, expected = commit.begin(output)
  put(f"{new}/d-train.tfrecord-00000-of-00001", b"new")
  commit.commit(output, new, _manifest(new), expected)
  assert commit.finish(output, new)
  assert commit.generation_state(output, old) == "replaced"  # marked by the switch
  commit._write_marker(output, old, "committed")  # as if the switch had been killed before marking it
  before = files.read_bytes(files.join(output, "manifest.json"))
  code = f"from formats.outputs import commit; commit.cleanup({output!r}, keep_replaced_seconds=0)"
  killed = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO, commit.FAULT_POINT_ENV: step})
  assert killed.returncode == -9, killed.stderr  # the fault point was reached
  assert files.read_bytes(files.join(output, "manifest.json")) == before
  assert files.read_bytes(files.join(output, new, "d-train.tfrecord-00000-of-00001")) == b"new"
  assert commit.generation_state(output, new) == "committed"
  state = commit.generation_state(output, old)
  if step == "cleanup:marked_replaced":
    assert state == "replaced"
    assert commit.cleanup(output) == []  # its retention started when it was marked
    assert commit.cleanup(output, keep_replaced_seconds=0) == [old]
  else:
    assert state == "abandoned"  # removal had begun: the marker is kept to the last
    assert commit.cleanup(output) == [old]  # the default retention does not start over
  assert files.walk(files.join(output, old)) == []
  assert [g.name for g in commit.list_generations(output)] == [new]
  assert files.read_bytes(files.join(output, "manifest.json")) == before


def test_gcs_overlapping_runs_the_loser_fails_and_the_winner_verifies(gcs_faults, class_folder, tmp_path):
  from tests.conftest import upload_tree

  src = f"gs://{gcs_faults.bucket}/overlap-in/pets"
  upload_tree(class_folder, src)
  out = f"gs://{gcs_faults.bucket}/overlap-out/{tmp_path.name}"
  slow, release = _paused_at_switch(tmp_path, f"--input={src}", f"--output={out}", "--num_shards=2")
  fast = _run(f"--input={src}", f"--output={out}", "--num_shards=3")
  assert fast.returncode == 0, fast.stderr
  winner = _read_manifest(out)
  release()
  _, err = slow.communicate(timeout=240)
  assert slow.returncode == 1 and "another run committed" in err
  assert _read_manifest(out) == winner
  assert verify_output(out, winner) == 0
  _loser_kept_then_removed(out, winner.splits["train"].shards[0].path.split("/")[0])
  gens = sorted({p[len(out) + 1:].split("/")[0] for p in files.walk(out) if "/gen-" in p})
  assert gens == [winner.splits["train"].shards[0].path.split("/")[0]]


# --------------------------------------------------------------------------- leftovers


def test_no_temporary_folder_or_parts_folder_is_left_behind(class_folder, tmp_path):
  """Runners need not call DoFn.teardown: per-shard temp folders must go in process itself.
  Graph outputs kept an empty `_parts/` at the root."""
  from scripts import make_sample_ogb

  tmpdir = tmp_path / "tmp"
  tmpdir.mkdir()
  # A runner need not call DoFn.teardown (Dataflow may not): run with every teardown a no-op.
  no_teardown = (
      "import sys\nfrom pipelines import image_folder, ogb_graphs\nfrom pipelines.core import shards\n"
      "from pipelines.ogb_graphs import assemble\n"
      "for c in (shards._ConvertShardFn, assemble._BuildPartFn, assemble._AssembleFn):\n"
      "  c.teardown = lambda self: None\n"
      "{'image': image_folder, 'graph': ogb_graphs}[sys.argv[1]].run(sys.argv[2:])\n")

  def run(kind, *flags):
    return subprocess.run([sys.executable, "-c", no_teardown, kind, *flags], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmpdir)})

  proc = run("image", f"--input={class_folder}", f"--output={tmp_path / 'img'}", "--num_shards=2")
  assert proc.returncode == 0, proc.stderr
  graph_in = tmp_path / "ogbn_arxiv"
  make_sample_ogb.write_homogeneous_node(graph_in, seed=0, num_nodes=200, num_edges=800)
  out = tmp_path / "graph"
  os.makedirs(out / "gen-notes")
  (out / "gen-notes" / "keep.txt").write_text("a user's")  # not the toolkit's: never removed
  proc = run("graph", f"--input={graph_in}", f"--output={out}")
  assert proc.returncode == 0, proc.stderr
  ours = ("toolkit-shards-", "ogb-parts-", "ogb-assemble-")  # Beam's own temp folders are Beam's
  assert [d for d in os.listdir(tmpdir) if d.startswith(ours)] == []
  m = _read_manifest(str(out))
  (gen,) = {f.path.split("/")[0] for f in m.files}
  assert sorted(os.listdir(out)) == sorted(["manifest.json", ".manifest.lock", gen, "gen-notes"])
  assert sorted(os.listdir(out / gen)) == sorted([commit.MARKER_FILENAME, "errors", os.path.basename(m.files[0].path)])
  assert (out / "gen-notes" / "keep.txt").read_text() == "a user's"
  assert verify_output(str(out), m) == 0


def test_graph_outputs_use_the_same_switch(tmp_path):
  """The graph pipeline writes its own manifest (a .graphbin, no shards): the same
  compare-and-swap, so an overlapping graph run loses the same way."""
  from scripts import make_sample_ogb

  src = tmp_path / "ogbn_arxiv"
  make_sample_ogb.write_homogeneous_node(src, seed=0, num_nodes=200, num_edges=800)
  out = str(tmp_path / "out")
  slow, release = _paused_at_switch(tmp_path, f"--input={src}", f"--output={out}", module="pipelines.ogb_graphs")
  fast = _run(f"--input={src}", f"--output={out}", "--csc=true", module="pipelines.ogb_graphs")
  assert fast.returncode == 0, fast.stderr
  winner = _read_manifest(out)
  release()
  _, err = slow.communicate(timeout=240)
  assert slow.returncode == 1 and "another run committed" in err.strip().splitlines()[-1], err
  assert _read_manifest(out) == winner and winner.graph["csc"] is True
  assert verify_output(out, winner) == 0
  _loser_kept_then_removed(out, winner.files[0].path.split("/")[0])


def test_the_launcher_heartbeat_keeps_a_long_run_alive_and_stops_before_the_run_ends(tmp_path, monkeypatch):
  from pipelines.core import launch

  out = str(tmp_path / "out")
  monkeypatch.setattr(commit, "HEARTBEAT_SECONDS", 0.05)
  gen, _ = commit.begin(out)
  marker = os.path.join(out, gen, commit.MARKER_FILENAME)
  os.utime(marker, (time.time() - 3600, time.time() - 3600))  # as if the run had been going for an hour
  with launch._Heartbeat(out, gen, "test"):
    time.sleep(0.5)
  assert time.time() - os.path.getmtime(marker) < 60
  assert commit.cleanup(out, lease_seconds=600, keep_replaced_seconds=0) == []  # alive: another run's clean-up leaves it
  assert not commit.finish(out, gen)  # never committed: abandoned (kept for the retention)
  time.sleep(0.3)
  assert commit.generation_state(out, gen) == "abandoned"  # no late beat marked it running again


def test_a_heartbeat_never_brings_back_a_generation_a_clean_up_took(output):
  """A run silent for a lease (a suspended launcher, a partition) whose generation another run's clean-up gave up
  and removed: its next heartbeat rewrote the marker as "running" (heartbeat was claim), and its commit then
  switched to a manifest naming deleted shards. Now the heartbeat refuses and so does the commit; a live run's
  heartbeat still refreshes its marker, and a committed one's leaves it committed."""
  old = _committed_run(output)
  gen, expected = commit.begin(output)
  _put(output, f"{gen}/d-train.tfrecord-00000-of-00001")
  commit.heartbeat(output, gen)  # alive: refreshed
  assert commit.generation_state(output, gen) == "running"
  removed = commit.cleanup(output, lease_seconds=0, keep_replaced_seconds=0)  # the run looks dead
  assert gen in removed and commit.generation_state(output, gen) is None
  with pytest.raises(commit.CommitConflict, match="is gone"):
    commit.heartbeat(output, gen)
  assert commit.generation_state(output, gen) is None
  with pytest.raises(commit.CommitConflict):
    commit.commit(output, gen, _manifest(gen), expected)
  assert commit.current_generation(output) == old
  abandoned, _ = commit.begin(output)
  assert commit.abandon(output, abandoned)
  with pytest.raises(commit.CommitConflict, match="is abandoned"):
    commit.heartbeat(output, abandoned)
  assert commit.generation_state(output, abandoned) == "abandoned"
  assert commit.generation_state(output, old) == "committed"
  commit.heartbeat(output, old)  # a beat in flight while its run commits
  assert commit.generation_state(output, old) == "committed"


def test_the_launcher_stops_beating_once_the_generation_is_taken(tmp_path, monkeypatch, caplog):
  from pipelines.core import launch

  out = str(tmp_path / "out")
  monkeypatch.setattr(commit, "HEARTBEAT_SECONDS", 0.05)
  gen, _ = commit.begin(out)
  with launch._Heartbeat(out, gen, "test") as beat:
    assert commit.abandon(out, gen)
    beat._thread.join(5)
    assert not beat._thread.is_alive()
  assert commit.generation_state(out, gen) == "abandoned"
  assert any("cannot commit" in r.getMessage() for r in caplog.records)


@pytest.mark.gcs
@pytest.mark.parametrize("step", ["finalize:rejects_written", "commit:before_switch", "commit:after_switch",
                                  "tfds:wrote_features.json", "cleanup:done"])
def test_gcs_a_kill_at_a_step_leaves_the_old_or_the_new_output(gcs_faults, old_output, class_folder, tmp_path,
                                                              step):
  """The same on gs:// (the conditional upload instead of the local lock). TFDS's own gs://
  support does not reach the emulator, so its view is checked through the metadata files."""
  from tests.conftest import upload_tree

  new_input = old_output[2]  # one more class than class_folder: the TFDS schema changes too
  old_src, src = (f"gs://{gcs_faults.bucket}/kill_in/{tmp_path.name}/{v}/pets" for v in ("old", "new"))
  upload_tree(class_folder, old_src)
  upload_tree(new_input, src)
  out = f"gs://{gcs_faults.bucket}/kill_out/{tmp_path.name}"
  assert _run(f"--input={old_src}", f"--output={out}", "--num_shards=2").returncode == 0
  old = _read_manifest(out)
  killed = _run(f"--input={src}", f"--output={out}", "--num_shards=3", "--overwrite=true",
                env={commit.FAULT_POINT_ENV: step})
  assert killed.returncode == -9, killed.stderr
  now = _read_manifest(out)
  assert now == old or now.splits["train"].num_records == (len(CLASSES) + 1) * PER_CLASS
  assert verify_output(out, now) == 0
  gen = lambda m: m.splits["train"].shards[0].path.split("/")[0]  # noqa: E731
  info_gen = commit._tfds_generation(out)  # the generation TFDS would read: old or new, complete
  if info_gen is None:  # only while the class names change (docs/manifest.md, step 4)
    assert step.startswith("tfds:") and not files.exists(files.join(out, "dataset_info.json"))
  else:
    assert info_gen in {gen(old), gen(now)}
    assert verify_output(out, old if info_gen == gen(old) else now) == 0
    labels = files.read_bytes(files.join(out, "label.labels.txt")).decode().split()
    assert labels == list((old if info_gen == gen(old) else now).features["label"].names)
  # A kill inside the TFDS sync leaves its lock object: the retry takes it over once its lease is over (1 s here).
  again = _run(f"--input={src}", f"--output={out}", "--num_shards=3", "--overwrite=true",
               setup="from formats.outputs import commit; commit.SYNC_LEASE_SECONDS = 1.0")
  assert again.returncode == 0, again.stderr
  final = _read_manifest(out)
  assert verify_output(out, final) == 0 and not commit.tfds_metadata_lags(out)


def test_an_abandoned_generation_cannot_be_committed(output):
  """A launcher that gives its run up (Ctrl-C while its Dataflow job goes on), or another run's
  clean-up of a run that stopped heartbeating, marks the generation abandoned before deleting it:
  the job's switch then fails instead of naming deleted shards."""
  gen, expected = commit.begin(output)
  assert commit.abandon(output, gen)
  with pytest.raises(commit.CommitConflict, match="is abandoned"):
    commit.commit(output, gen, _manifest(gen), expected)
  assert not files.exists(files.join(output, "manifest.json"))


@pytest.mark.parametrize("previous", [False, True])
def test_a_switch_that_raced_an_abandon_is_undone_on_gcs(gcs_emulator, tmp_path, monkeypatch, previous):
  """gs:// has no lock: the abandon lands between the switch's check and its upload. The
  switch sees the mark right after its upload and puts the previous manifest back."""
  output = f"gs://{gcs_emulator}/undo/{tmp_path.name}"
  if previous:
    old, expected = commit.begin(output)
    commit.commit(output, old, _manifest(old), expected)
  before = files.read_bytes(files.join(output, "manifest.json")) if previous else None
  gen, expected = commit.begin(output)
  real = commit._check_claim
  calls = []

  def racing(out, g):
    calls.append(g)
    if len(calls) == 2:  # after the upload: the launcher's finish() got in just before
      assert commit.abandon(out, g) is False  # too late: the manifest names it now...
      commit._write_marker(out, g, "abandoned")  # ...so force the interleaving the lock-free race allows
    return real(out, g)

  monkeypatch.setattr(commit, "_check_claim", racing)
  with pytest.raises(commit.CommitConflict, match="is abandoned"):
    commit.commit(output, gen, _manifest(gen, 2), expected)
  if previous:
    assert files.read_bytes(files.join(output, "manifest.json")) == before
  else:
    assert not files.exists(files.join(output, "manifest.json"))


def test_a_local_switch_makes_what_the_manifest_names_durable_first(tmp_path, monkeypatch):
  """A power loss (not a kill: the page cache goes too) after an un-synced switch could leave a manifest naming
  empty shards. Every data file, its folder and the new manifest are fsynced before the rename onto
  manifest.json, and the output folder after it."""
  out = str(tmp_path / "out")
  gen, expected = commit.begin(out)
  _put(out, f"{gen}/d-train.tfrecord-00000-of-00001")
  _put(out, f"{gen}/errors/rejected.jsonl", b"")
  events = []
  real_fsync, real_replace = os.fsync, os.replace
  monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                               real_fsync(fd))[1])
  monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
  commit.commit(out, gen, _manifest(gen), expected)
  switch = events.index(("replace", os.path.join(out, "manifest.json")))
  synced = {p for what, p in events[:switch] if what == "fsync"}
  g = os.path.join(out, gen)
  assert {os.path.join(g, "d-train.tfrecord-00000-of-00001"), os.path.join(g, "errors", "rejected.jsonl"), g,
          os.path.join(g, "errors")} <= synced
  assert any(p.startswith(os.path.join(g, ".manifest.json.")) for p in synced)
  assert ("fsync", out) in events[switch:]


@pytest.mark.parametrize("held_at,killed_after", [("tfds:wrote_label.labels.txt", "dataset_info.json"),
                                                  ("tfds:info_removed", "label.labels.txt")])
def test_a_gcs_sync_that_outlived_its_lock_cannot_write_over_a_later_one(gcs_emulator, tmp_path, monkeypatch,
                                                                         held_at, killed_after):
  """A sync slow past SYNC_LEASE_SECONDS (a root write retried through 503s) whose lock another run's sync took
  over: its later writes landed over the newer sync's, and if its process died then, dataset_info.json named the
  old generation beside the new class names (docs/manifest.md: never). Its writes are conditional on the objects
  it read: they fail, it reads again, and the root ends as the manifest says."""
  import threading

  from formats.features import ClassLabel

  out = f"gs://{gcs_emulator}/fence/{tmp_path.name}"

  def manifest(gen, names):
    shard = ShardInfo(f"{gen}/d-train.tfrecord-00000-of-00001", 1, 10, "0" * 64)
    return Manifest("d", "tfrecord", Features({"label": ClassLabel(names)}), {"train": SplitInfo((shard,))},
                    Rejected(0, {}, f"{gen}/errors/rejected.jsonl"))

  monkeypatch.setattr(commit, "SYNC_LEASE_SECONDS", 1.0)
  slow, resume = [], threading.Event()
  real_point, real_write = commit.fault_point, commit._write_root_file

  class Killed(BaseException):
    pass

  def point(name):
    if threading.get_ident() in slow and name == held_at:
      resume.wait(30)  # held past its lock's lease
    real_point(name)

  def write(output, rel, *args):
    real_write(output, rel, *args)
    if threading.get_ident() in slow and rel == killed_after:
      raise Killed()  # its process dies right after this write landed

  gen_0, expected = commit.begin(out)  # an earlier output: the root files exist when A reads them
  commit.commit(out, gen_0, manifest(gen_0, ["p", "q"]), expected)
  commit.sync_tfds_metadata(out)
  monkeypatch.setattr(commit, "fault_point", point)
  monkeypatch.setattr(commit, "_write_root_file", write)
  gen_a, expected = commit.begin(out)
  commit.commit(out, gen_a, manifest(gen_a, ["a", "b"]), expected)
  outcome = []

  def sync_a():
    slow.append(threading.get_ident())
    try:
      commit.sync_tfds_metadata(out)
      outcome.append("synced")
    except Killed:
      outcome.append("killed")

  a = threading.Thread(target=sync_a)
  a.start()
  time.sleep(1.5)
  gen_b, expected = commit.begin(out)
  commit.commit(out, gen_b, manifest(gen_b, ["x", "y", "z"]), expected)
  commit.sync_tfds_metadata(out)  # takes A's expired lock over
  resume.set()
  a.join(60)
  assert outcome == ["synced"]  # its stale write was refused, so no kill after a landed one
  info = json.loads(files.read_bytes(files.join(out, "dataset_info.json")))
  assert info["splits"][0]["filepathTemplate"].split("/")[0] == gen_b
  assert files.read_bytes(files.join(out, "label.labels.txt")).split() == [b"x", b"y", b"z"]
  assert not commit.tfds_metadata_lags(out)


def test_tfds_syncs_are_serialised_and_a_dead_holders_lock_expires(output, monkeypatch):
  """Two syncs with different manifests must not interleave their writes (old dataset_info.json
  over new label files); a lock left by a killed process is taken over after its lease."""
  import threading

  gen, expected = commit.begin(output)
  commit.commit(output, gen, _manifest(gen), expected)
  monkeypatch.setattr(commit, "SYNC_LEASE_SECONDS", 1.0)
  if files.is_gcs(output):  # a lock object left behind by a killed process
    files.write_bytes(files.join(output, commit.SYNC_LOCK_FILENAME), b"{}")
    t0 = time.monotonic()
    commit.sync_tfds_metadata(output)
    assert time.monotonic() - t0 >= 0.9  # it waited for the lease, then took the lock over
    assert not files.exists(files.join(output, commit.SYNC_LOCK_FILENAME))
  else:
    held, done = threading.Event(), threading.Event()

    def hold():
      with commit._local_lock(output):
        held.set()
        time.sleep(0.5)
        done.set()

    threading.Thread(target=hold).start()
    held.wait()
    commit.sync_tfds_metadata(output)
    assert done.is_set()  # the sync ran only after the holder let go
  assert commit._tfds_generation(output) == gen
