"""The launcher's listing of split and class folders, shared by image_folder, audio_folder and array_folder
(pipelines.core.inputs.scan_level): links, colliding escaped names, line breaks and unlistable folders.

Each case asserts the invariant: every file is one record under its one label, every odd folder one reject
with its reason, and the output verifies.
"""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest

from formats.manifest import Manifest
from formats.outputs import inspect
from pipelines import array_folder, audio_folder, image_folder
from pipelines.core import UsageError, inputs
from tests.pipelines.test_audio_folder import RATE, wav
from tests.pipelines.test_hostile_inputs import _jpeg


def _npy(value: int) -> bytes:
  import io

  buf = io.BytesIO()
  np.save(buf, np.full((2, 3), value, np.float32))
  return buf.getvalue()


# name: (run, flags, file suffix, file bytes of seed i, whose records carry a label)
PIPELINES = {
    "image_folder": (image_folder.run, [], ".jpg", _jpeg, True),
    "audio_folder": (audio_folder.run, [f"--sample_rate={RATE}", "--clip_seconds=0.05"], ".wav",
                     lambda i: wav(np.full(400, 1000 * i, np.int16)), True),
    "array_folder": (array_folder.run, ["--shape=2,3", "--dtype=float32"], ".npy", _npy, False),
}


def _tree(root, pipeline: str, folders: dict[str, int]) -> None:
  """`folders`: {relative folder: files in it}; class folders for image and audio, split folders for arrays."""
  _, _, suffix, data, _ = PIPELINES[pipeline]
  for rel, n in folders.items():
    os.makedirs(os.path.join(root, rel), exist_ok=True)
    for i in range(n):
      with open(os.path.join(root, rel, f"{i}{suffix}"), "wb") as f:
        f.write(data(i + 1))


def _run(pipeline: str, root, out) -> tuple[Manifest, dict[str, str]]:
  run, flags, _, _, _ = PIPELINES[pipeline]
  run([f"--input={root}", f"--output={out}", *flags])
  m = Manifest.loads(open(os.path.join(out, "manifest.json"), "rb").read())
  rejects = {}
  for line in open(os.path.join(out, m.rejected.path)):
    r = json.loads(line)
    rejects[os.path.relpath(r["input"], root)] = r["reason"]
  assert inspect.main([str(out), "--verify"]) == 0
  return m, rejects


def _records(m: Manifest) -> dict[str, int]:
  return {s: info.num_records for s, info in m.splits.items()}


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["image_folder", "audio_folder"])
def test_links_between_class_and_split_folders_never_duplicate_records(pipeline, tmp_path):
  """audio_folder listed folders with fs.list_dir: `val -> train` copied the training set into val (a leak),
  `train/kitty -> cat` made cat's files a second class, `train/all -> .` listed the split under a class."""
  root = tmp_path / "in"
  _tree(root, pipeline, {"train/cat": 2, "train/dog": 3, "test/cat": 1})
  os.symlink("train", root / "val")  # a split under two names
  os.symlink("cat", root / "train" / "a_kitty")  # a class under two names (the link first in name order)
  os.symlink(".", root / "train" / "all")  # the split itself
  os.symlink("../train/dog", root / "test" / "dog")  # a class of another split
  os.symlink("..", root / "test" / "up")  # the input
  m, rejects = _run(pipeline, root, tmp_path / "out")
  assert _records(m) == {"train": 5, "test": 1}
  assert list(m.features["label"].names) == ["cat", "dog"]
  assert rejects == {"val": inputs.OTHER_PART_OF_INPUT, "train/a_kitty": inputs.OTHER_PART_OF_INPUT,
                     "train/all": "symbolic link loop", "test/dog": inputs.OTHER_PART_OF_INPUT,
                     "test/up": "symbolic link loop"}


@pytest.mark.slow
def test_array_split_folders_linked_to_each_other_never_duplicate_records(tmp_path):
  """array_folder listed split folders with fs.list_dir: `test -> train` made the test split a copy of train."""
  root = tmp_path / "in"
  _tree(root, "array_folder", {"train": 3, "val": 1})
  os.symlink("train", root / "test")
  os.symlink(".", root / "loop")
  m, rejects = _run("array_folder", root, tmp_path / "out")
  assert _records(m) == {"train": 3, "val": 1}
  assert rejects == {"test": inputs.OTHER_PART_OF_INPUT, "loop": "symbolic link loop"}


@pytest.mark.slow
def test_audio_escaped_names_that_collide_are_rejects_not_merged_classes(tmp_path):
  """A class folder named with the byte 0xe9 and one named with the text `\\xe9` were one label."""
  root = tmp_path / "in"
  _tree(root, "audio_folder", {"train/dog": 1})
  raw = os.fsencode(str(root / "train"))
  for name in (b"caf\xe9", b"caf\\xe9"):
    os.makedirs(raw + b"/" + name)
    with open(raw + b"/" + name + b"/a.wav", "wb") as f:
      f.write(wav(np.zeros(400, np.int16)))
  m, rejects = _run("audio_folder", root, tmp_path / "out")
  assert list(m.features["label"].names) == ["caf\\xe9", "dog"] and _records(m) == {"train": 2}
  assert rejects == {"train/caf\\xe9": inputs.COLLIDING_NAME}


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["image_folder", "audio_folder"])
def test_a_class_folder_name_with_a_line_break_is_a_reject(pipeline, tmp_path):
  """labels.txt holds one name a line: the name stopped the launch with a ValueError traceback."""
  root = tmp_path / "in"
  _tree(root, pipeline, {"train/cat": 1, "train/two\nlines": 2})
  m, rejects = _run(pipeline, root, tmp_path / "out")
  assert list(m.features["label"].names) == ["cat"] and _records(m) == {"train": 1}
  assert rejects == {"train/two\nlines": inputs.LINE_BREAK_NAME}


def _refuse_listing(monkeypatch, *paths) -> None:
  """os.scandir of `paths` fails as the kernel fails a folder of mode 000 for anyone but root (CI runs as root)."""
  real = os.scandir
  refused = {os.fspath(p) for p in paths}

  def scandir(path="."):
    if not isinstance(path, int) and os.fspath(path) in refused:
      raise PermissionError(errno.EACCES, "Permission denied", path)
    return real(path)

  monkeypatch.setattr(os, "scandir", scandir)


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["image_folder", "audio_folder"])
def test_an_unlistable_split_folder_is_a_reject_not_a_traceback(pipeline, tmp_path, monkeypatch):
  root = tmp_path / "in"
  _tree(root, pipeline, {"train/cat": 2, "val/cat": 1})
  _refuse_listing(monkeypatch, root / "val")
  m, rejects = _run(pipeline, root, tmp_path / "out")
  assert _records(m) == {"train": 2}
  assert rejects == {"val": "unreadable folder: permission denied"}


@pytest.mark.slow
def test_an_unlistable_class_folder_at_the_top_is_a_reject_not_a_traceback(tmp_path, monkeypatch):
  """image_folder's classes layout: the folder stays a class (its label kept), its listing is the reject."""
  root = tmp_path / "in"
  _tree(root, "image_folder", {"cat": 2, "dog": 1})
  _refuse_listing(monkeypatch, root / "dog")
  m, rejects = _run("image_folder", root, tmp_path / "out")
  assert list(m.features["label"].names) == ["cat", "dog"] and _records(m) == {"train": 2}
  assert rejects == {"dog": "unreadable folder: permission denied"}


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_an_unlistable_input_is_a_usage_error_with_nothing_written(pipeline, tmp_path, monkeypatch):
  root = tmp_path / "in"
  _tree(root, pipeline, {"train/cat" if PIPELINES[pipeline][4] else "train": 1})
  _refuse_listing(monkeypatch, root)
  run, flags, _, _, _ = PIPELINES[pipeline]
  with pytest.raises(UsageError, match=r"cannot be listed \(unreadable folder: permission denied\)"):
    run([f"--input={root}", f"--output={tmp_path / 'out'}", *flags])
  assert not os.path.exists(tmp_path / "out")
