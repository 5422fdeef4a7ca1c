"""Hostile inputs: whatever a file system holds, odd flags, transient faults.

Each case asserts the invariant, not just the exit status: the output verifies,
every entry of the input tree is counted once (records + rejects), nothing
hangs (the CLI runs in a subprocess with a timeout), a bad flag is one line and
exit 2 with nothing written.
"""

from __future__ import annotations

import errno
import io
import json
import os
import socket
import subprocess
import sys

import pytest
from PIL import Image

from scripts import make_sample_ct as ct
from formats.outputs import inspect
from formats.storage import files
from formats.manifest import Manifest
from pipelines import ct_volumes, image_folder
from pipelines.core import UsageError, inputs
from tests.conftest import REPO

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
NON_UTF8 = b"caf\xe9.jpg"  # Latin-1 "café.jpg": not valid UTF-8


def _jpeg(seed: int) -> bytes:
  buf = io.BytesIO()
  Image.new("RGB", (16, 12), (seed * 40 % 256, 80, 160)).save(buf, "JPEG")
  return buf.getvalue()


def _write(path: str | bytes, data: bytes) -> None:
  with open(path, "wb") as f:
    f.write(data)


def _socket_at(path: str) -> None:
  """A UNIX socket file at `path` (bound at a short name, then moved: sun_path is short)."""
  short = f"/tmp/s{os.getpid()}-{len(path)}"
  s = socket.socket(socket.AF_UNIX)
  try:
    s.bind(short)
  finally:
    s.close()
  os.rename(short, path)


def make_hostile_tree(root: str) -> tuple[int, dict[str, str]]:
  """Two classes of good images among every odd entry a local file system can hold.

  Returns (number of images that must become records, {printable relative path:
  reason prefix} of the entries that must be rejects).
  """
  for cls in ("cat", "dog"):
    os.makedirs(os.path.join(root, cls))
    for i in range(2):
      _write(os.path.join(root, cls, f"{cls}{i}.jpg"), _jpeg(i))
  cat, dog = os.path.join(root, "cat"), os.path.join(root, "dog")
  _write(os.path.join(os.fsencode(cat), NON_UTF8), _jpeg(7))  # a good image with a non-UTF-8 name
  os.symlink("loop.jpg", os.path.join(cat, "loop.jpg"))  # a self-referencing link
  os.symlink("nowhere.jpg", os.path.join(cat, "gone.jpg"))  # a dangling link
  os.mkfifo(os.path.join(cat, "pipe.jpg"))  # a FIFO: opening it would wait for a writer forever
  _socket_at(os.path.join(cat, "sock.jpg"))
  os.symlink("/dev/null", os.path.join(cat, "null.jpg"))  # a character device, without root
  os.symlink("..", os.path.join(cat, "up"))  # a link to an ancestor: a loop
  os.makedirs(os.path.join(dog, "x"))
  os.makedirs(os.path.join(dog, "y"))
  os.symlink("../y", os.path.join(dog, "x", "to_y"))  # x/to_y -> y and y/to_x -> x: a loop between folders
  os.symlink("../x", os.path.join(dog, "y", "to_x"))
  _write(os.path.join(dog, "y", "deep.jpg"), _jpeg(3))  # listed once, as y/deep.jpg: real folders first
  os.symlink("../dog/dog0.jpg", os.path.join(cat, "linked.jpg"))  # a link to a good image: a record
  rejects = {
      "cat/loop.jpg": "symbolic link loop", "cat/gone.jpg": "dangling symbolic link",
      "cat/pipe.jpg": "not a regular file (FIFO)", "cat/sock.jpg": "not a regular file (socket)",
      "cat/null.jpg": "not a regular file (character device)", "cat/up": "symbolic link loop",
      "dog/x/to_y": "folder already listed", "dog/y/to_x": "folder already listed",
  }
  return 4 + 1 + 1 + 1, rejects  # cat0 cat1 dog0 dog1, café, deep, linked


def _run_cli(module: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": REPO}, timeout=timeout)


def _manifest(out: str) -> Manifest:
  return Manifest.loads(files.read_bytes(files.join(out, "manifest.json")))


def _rejected(out: str, m: Manifest) -> dict[str, str]:
  rows = [json.loads(line) for line in files.read_bytes(files.join(out, m.rejected.path)).splitlines()]
  return {r["input"]: r["reason"] for r in rows}


# ------------------------------------------------------------------ listing, pure

def test_listing_rejects_every_odd_entry_and_never_opens_them(tmp_path):
  root = str(tmp_path / "in")
  num_good, expected = make_hostile_tree(root)
  listing = inputs.list_tree(root)
  rel = lambda f: f.path[len(root) + 1:]
  assert sorted(rel(f) for f in listing.files) == sorted(
      ["cat/cat0.jpg", "cat/cat1.jpg", "cat/caf\\xe9.jpg", "cat/linked.jpg", "dog/dog0.jpg", "dog/dog1.jpg",
       "dog/y/deep.jpg"])
  assert len(listing.files) == num_good
  got = {rel(f): reason for f, reason in listing.rejects}
  assert got.keys() == expected.keys()
  for path, reason in expected.items():
    assert got[path].startswith(reason), (path, got[path])
  (odd,) = [f for f in listing.files if f.undecodable]
  assert odd.raw.endswith(NON_UTF8) and inputs.read_input(odd.location) == _jpeg(7)


def test_read_input_never_blocks_on_a_fifo_and_names_the_reason(tmp_path):
  fifo = str(tmp_path / "pipe.jpg")
  os.mkfifo(fifo)
  with pytest.raises(inputs.Unreadable, match=r"not a regular file \(FIFO\)"):
    inputs.read_input(fifo)
  with pytest.raises(inputs.Unreadable, match="vanished"):
    inputs.read_input(str(tmp_path / "absent.jpg"))


def test_unreadable_file_is_a_permission_reject(tmp_path, monkeypatch):
  path = str(tmp_path / "secret.jpg")
  _write(path, _jpeg(1))
  os.chmod(path, 0)
  if IS_ROOT:  # chmod 000 does not stop root: the kernel's answer to anyone else, EACCES, is given by hand
    real_open = os.open

    def refusing_open(p, *args, **kw):
      if p == path:
        raise PermissionError(errno.EACCES, "Permission denied", p)
      return real_open(p, *args, **kw)

    monkeypatch.setattr(os, "open", refusing_open)
  with pytest.raises(inputs.Unreadable, match="^permission denied$"):
    inputs.read_input(path)


# ------------------------------------------------------------------ image_folder end to end

@pytest.mark.slow
def test_hostile_tree_converts_with_every_entry_counted(tmp_path):
  root = str(tmp_path / "in")
  num_good, expected = make_hostile_tree(root)
  out = str(tmp_path / "out")
  # --layout: cat/up links to the root, so "auto" would see cat and dog as split folders.
  r = _run_cli("pipelines.image_folder", f"--input={root}", f"--output={out}", "--layout=classes", timeout=240)
  assert r.returncode == 0, r.stderr[-3000:]
  assert inspect.main([out, "--verify"]) == 0
  m = _manifest(out)
  assert m.splits["train"].num_records == num_good
  rejected = {p[len(root) + 1:]: reason for p, reason in _rejected(out, m).items()}
  assert rejected.keys() == expected.keys()  # every odd entry counted once, none lost
  for path, reason in expected.items():
    assert rejected[path].startswith(reason), (path, rejected[path])
  assert any("not valid UTF-8" in w for w in m.warnings), m.warnings


@pytest.mark.slow
def test_non_utf8_name_is_a_record_with_an_escaped_file_name(tmp_path):
  root = tmp_path / "in"
  (root / "cat").mkdir(parents=True)
  _write(os.path.join(os.fsencode(str(root / "cat")), NON_UTF8), _jpeg(1))
  _write(str(root / "cat" / "plain.jpg"), _jpeg(2))
  out = str(tmp_path / "out")
  image_folder.run([f"--input={root}", f"--output={out}"])
  m = _manifest(out)
  from tests.pipelines.test_image_folder import read_split

  names = sorted(rec["file_name"] for rec in read_split(out, m, "train"))
  assert names == ["cat/caf\\xe9.jpg", "cat/plain.jpg"]
  assert m.rejected.count == 0 and inspect.main([out, "--verify"]) == 0
  assert any("1 input name is not valid UTF-8" in w for w in m.warnings), m.warnings


@pytest.mark.slow
def test_symlink_loop_at_the_top_is_a_reject_not_a_traceback(tmp_path):
  root = tmp_path / "in"
  (root / "cat").mkdir(parents=True)
  _write(str(root / "cat" / "a.jpg"), _jpeg(1))
  os.symlink("self", str(root / "self"))
  os.symlink("missing", str(root / "dangling"))
  out = str(tmp_path / "out")
  image_folder.run([f"--input={root}", f"--output={out}"])
  m = _manifest(out)
  assert m.splits["train"].num_records == 1
  assert {os.path.basename(p): r for p, r in _rejected(out, m).items()} == {
      "self": "symbolic link loop", "dangling": "dangling symbolic link"}


@pytest.mark.slow
@pytest.mark.parametrize("folder_name", ["scans[2024]", "a*b?c"])
def test_input_path_with_glob_characters_is_a_path(tmp_path, folder_name):
  root = tmp_path / folder_name
  for cls in ("cat[1]", "dog"):  # a class folder with glob characters works too
    (root / cls).mkdir(parents=True)
    _write(str(root / cls / "x.jpg"), _jpeg(1))
  out = str(tmp_path / "out")
  image_folder.run([f"--input={root}", f"--output={out}"])
  m = _manifest(out)
  assert m.splits["train"].num_records == 2 and m.rejected.count == 0
  assert m.features["label"].names == ("cat[1]", "dog")


@pytest.mark.slow
def test_ct_input_path_with_glob_characters_is_a_path(tmp_path):
  root = str(tmp_path / "scans[2024]")
  ct.write_series(os.path.join(root, "p1"), patient_id="P1", seed=1, rows=8, cols=8, num_slices=3)
  _write(os.path.join(root, "notes.txt"), b"not dicom")
  out = str(tmp_path / "out")
  ct_volumes.run([f"--input={root}", f"--output={out}", "--id_salt=s", "--splits=train=1"])
  m = _manifest(out)
  assert m.num_records == 1 and m.rejected.count == 1
  assert inspect.main([out, "--verify"]) == 0


@pytest.mark.slow
def test_ct_hostile_entries_are_counted(tmp_path):
  root = str(tmp_path / "dicom")
  ct.write_series(os.path.join(root, "p1"), patient_id="P1", seed=1, rows=8, cols=8, num_slices=3)
  os.mkfifo(os.path.join(root, "pipe.dcm"))
  os.symlink("nowhere.dcm", os.path.join(root, "gone.dcm"))
  os.symlink("..", os.path.join(root, "p1", "up"))
  out = str(tmp_path / "out")
  r = _run_cli("pipelines.ct_volumes", f"--input={root}", f"--output={out}", "--id_salt=s", "--splits=train=1")
  assert r.returncode == 0, r.stderr[-3000:]
  m = _manifest(out)
  assert m.num_records == 1
  reasons = {os.path.basename(p): reason for p, reason in _rejected(out, m).items()}
  assert reasons == {"pipe.dcm": "not a regular file (FIFO)", "gone.dcm": "dangling symbolic link",
                     "up": "symbolic link loop"}


# ------------------------------------------------------------------ small input (flag errors: test_registry.py, test_converter_flags.py)

@pytest.fixture
def small_folder(tmp_path) -> str:
  root = tmp_path / "small"
  (root / "cat").mkdir(parents=True)
  _write(str(root / "cat" / "a.jpg"), _jpeg(1))
  return str(root)


# ------------------------------------------------------------------ transient faults (gs://)

@pytest.mark.slow
@pytest.mark.gcs
def test_transient_errors_are_retried_not_rejected(gcs_faults, small_folder, tmp_path):
  from tests.conftest import upload_tree

  src = f"gs://{gcs_faults.bucket}/transient_ok/in"
  upload_tree(small_folder, src)
  gcs_faults.add_fault("transient_ok/in/cat/a.jpg", status=503, times=2)
  gcs_faults.add_fault("transient_ok/in/cat/a.jpg", mode="drop", times=1)
  gcs_faults.add_fault("transient_ok/in/cat/a.jpg", status=429, times=1)
  out = str(tmp_path / "out")
  image_folder.run([f"--input={src}", f"--output={out}", "--transient_retry_seconds=60"])
  m = _manifest(out)
  assert m.splits["train"].num_records == 1 and m.rejected.count == 0
  assert gcs_faults.requests_seen("transient_ok/in/cat/a.jpg") >= 5


@pytest.mark.slow
@pytest.mark.gcs
@pytest.mark.parametrize("mode", ["status", "stall"])
def test_persistent_transient_errors_fail_the_job_and_keep_the_previous_output(gcs_faults, small_folder, tmp_path,
                                                                               mode):
  from tests.conftest import upload_tree

  src = f"gs://{gcs_faults.bucket}/transient_{mode}/in"
  upload_tree(small_folder, src)
  out = str(tmp_path / "out")
  image_folder.run([f"--input={src}", f"--output={out}"])
  before = open(os.path.join(out, "manifest.json"), "rb").read()
  gcs_faults.add_fault(f"transient_{mode}/in/cat/a.jpg", status=503, mode=mode, stall_seconds=8)
  with pytest.raises(Exception) as info:
    image_folder.run([f"--input={src}", f"--output={out}", "--overwrite=true", "--transient_retry_seconds=2"])
  assert "persisted" in str(info.value) and "transient" in str(info.value), info.value
  assert open(os.path.join(out, "manifest.json"), "rb").read() == before  # no new manifest
  assert inspect.main([out, "--verify"]) == 0


@pytest.mark.slow
@pytest.mark.gcs
def test_persistent_transient_error_is_one_line_and_exit_1_from_the_cli(gcs_faults, small_folder, tmp_path):
  """What an operator sees when the network stays down: one line, exit 1, nothing written."""
  from tests.conftest import upload_tree

  src = f"gs://{gcs_faults.bucket}/transient_cli/in"
  upload_tree(small_folder, src)
  gcs_faults.add_fault("transient_cli/in/cat/a.jpg", status=503)
  out = str(tmp_path / "out")
  r = subprocess.run([sys.executable, "-m", "pipelines.image_folder", f"--input={src}", f"--output={out}",
                      "--transient_retry_seconds=2"], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 1, r.stderr
  last = r.stderr.rstrip("\n").splitlines()[-1]
  assert last.startswith("pipelines.image_folder: error: reading gs://") and "transient" in last, r.stderr
  assert last.endswith("nothing was committed, run again") and "Traceback" not in r.stderr, r.stderr
  assert not os.path.exists(os.path.join(out, "manifest.json"))
  # The failed run's generation is kept, abandoned, for a resumed run (docs/manifest.md): nothing names it.
  from formats.outputs import commit
  assert {g.state for g in commit.list_generations(out)} <= {"abandoned"} if os.path.isdir(out) else True
  assert gcs_faults.requests_seen("transient_cli/in/cat/a.jpg") >= 2  # retried, not given up at once


@pytest.mark.slow
@pytest.mark.gcs
def test_ct_persistent_transient_error_fails_the_job(gcs_faults, tmp_path):
  from tests.conftest import upload_tree

  local = str(tmp_path / "dicom")
  ct.write_series(os.path.join(local, "p1"), patient_id="P1", seed=1, rows=8, cols=8, num_slices=3)
  src = f"gs://{gcs_faults.bucket}/transient_ct/dicom"
  upload_tree(local, src)
  gcs_faults.add_fault("transient_ct/dicom/p1/", status=503)
  out = str(tmp_path / "out")
  with pytest.raises(Exception, match="persisted"):
    ct_volumes.run([f"--input={src}", f"--output={out}", "--id_salt=s", "--transient_retry_seconds=1"])
  assert not os.path.exists(os.path.join(out, "manifest.json"))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "gcs"])
def test_a_file_over_the_input_cap_is_a_reject_found_before_it_is_read(where, small_folder, tmp_path, request):
  """A huge file named .jpg must not be read into a worker's memory: its size is the reason."""
  big = os.path.join(small_folder, "cat", "huge.jpg")
  _write(big, _jpeg(2) + b"\0" * 50_000)
  cap = os.path.getsize(os.path.join(small_folder, "cat", "a.jpg"))  # a.jpg is exactly at the cap: accepted
  src = small_folder
  if where == "gcs":
    from tests.conftest import upload_tree

    bucket = request.getfixturevalue("gcs_emulator")
    src = f"gs://{bucket}/input_cap/{tmp_path.name}"
    upload_tree(small_folder, src)
  out = str(tmp_path / "out")
  image_folder.run([f"--input={src}", f"--output={out}", f"--max_input_bytes={cap}"])
  m = Manifest.loads(open(os.path.join(out, "manifest.json"), "rb").read())
  assert m.splits["train"].num_records == 1 and m.rejected.count == 1
  (reject,) = [json.loads(line) for line in open(os.path.join(out, m.rejected.path))]
  assert reject["input"].endswith("cat/huge.jpg")
  assert reject["reason"].startswith("file too large: ") and f"> {cap} (--max_input_bytes)" in reject["reason"]
  with pytest.raises(UsageError, match="--max_input_bytes must be >= 1"):
    image_folder.run([f"--input={src}", f"--output={tmp_path / 'o2'}", "--max_input_bytes=0"])


def _classes_and_rejects(out: str) -> tuple[list[str], int, dict[str, str]]:
  m = Manifest.loads(open(os.path.join(out, "manifest.json"), "rb").read())
  rejects = {json.loads(line)["input"]: json.loads(line)["reason"] for line in open(os.path.join(out, m.rejected.path))}
  return list(m.features["label"].names), m.splits["train"].num_records, rejects


@pytest.mark.slow
def test_links_between_parts_of_the_input_never_duplicate_records(tmp_path):
  """`loop -> .` at class level made the whole dataset a third class (12 records from 6 images);
  a class folder linked twice, or a link from one class into another, listed files twice
  under two labels."""
  root = tmp_path / "in"
  for cls in ("cat", "dog"):
    os.makedirs(root / cls)
    for i in range(3):
      _write(str(root / cls / f"{i}.jpg"), _jpeg(i))
  os.symlink(".", root / "loop")  # the input itself
  os.symlink("..", root / "cat" / "up")  # above the class folder
  os.symlink("cat", root / "kitty")  # another name for a class folder
  os.symlink("../dog", root / "cat" / "dogs")  # one class into another
  outside = tmp_path / "elsewhere" / "bird"  # a class kept outside the input: a legitimate link
  os.makedirs(outside)
  _write(str(outside / "b.jpg"), _jpeg(7))
  os.symlink(outside, root / "bird")
  out = str(tmp_path / "out")
  image_folder.run([f"--input={root}", f"--output={out}"])
  classes, records, rejects = _classes_and_rejects(out)
  assert classes == ["bird", "cat", "dog"] and records == 7
  assert {os.path.relpath(p, root): r for p, r in rejects.items()} == {
      "loop": "symbolic link loop", "cat/up": "symbolic link loop",
      "kitty": inputs.OTHER_PART_OF_INPUT, "cat/dogs": inputs.OTHER_PART_OF_INPUT}
  assert inspect.main([out, "--verify"]) == 0


@pytest.mark.slow
def test_escaped_names_that_collide_are_rejects_not_merged_classes(tmp_path):
  """`\\xNN` escapes are not injective: a folder named with the byte 0xff and one named with the
  text `\\xff` would be one class (and two records with one key)."""
  root = tmp_path / "in"
  raw_root = os.fsencode(str(root))
  for name in (b"cat\xff", b"cat\\xff", b"dog"):
    os.makedirs(raw_root + b"/" + name)
    _write(raw_root + b"/" + name + b"/a.jpg", _jpeg(len(name)))
  _write(raw_root + b"/dog/b\xff.jpg", _jpeg(1))
  _write(raw_root + b"/dog/b\\xff.jpg", _jpeg(2))
  out = str(tmp_path / "out")
  image_folder.run([f"--input={root}", f"--output={out}"])
  classes, records, rejects = _classes_and_rejects(out)
  assert classes == ["cat\\xff", "dog"] and records == 3  # cat\xff (text), dog/a.jpg, dog/b\xff.jpg (text)
  assert sorted(os.path.relpath(p, root) for p in rejects) == ["cat\\xff", "dog/b\\xff.jpg"]
  assert set(rejects.values()) == {inputs.COLLIDING_NAME}
