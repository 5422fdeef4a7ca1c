"""pipelines.core.dataflow.staging: the launcher's local copies of what it staged for the workers go as soon as
the submission has uploaded them, and on every way out of the block (the real wheel build: test_dataflow.py)."""

from __future__ import annotations

import pytest

from pipelines.core import dataflow


@pytest.fixture
def folder(tmp_path, monkeypatch):
  """What `prepare` stages, as a folder holding a file: `prepare` replaced, the Dataflow options aside."""
  staged = tmp_path / "toolkit-dataflow-x"
  staged.mkdir()
  (staged / "requirements.txt").write_text("pydicom==3.0.1\n")
  monkeypatch.setattr(dataflow, "prepare", lambda *args: str(staged))
  return staged


def test_the_folder_goes_when_the_submission_is_done_not_when_the_job_ends(folder):
  with dataflow.staging(None, None) as uploaded:
    assert folder.exists()  # the submission reads it
    uploaded()
    assert not folder.exists()  # the job may run for hours: nothing waits for it
    uploaded()  # and again at the block's end: no error


@pytest.mark.parametrize("error", [RuntimeError("claim failed"), KeyboardInterrupt()])
def test_the_folder_goes_when_the_launch_fails_before_the_submission(folder, error):
  with pytest.raises(type(error)):
    with dataflow.staging(None, None):
      raise error
  assert not folder.exists()


def test_nothing_staged_nothing_removed(monkeypatch):
  monkeypatch.setattr(dataflow, "prepare", lambda *args: None)
  with dataflow.staging(None, None) as uploaded:
    uploaded()
