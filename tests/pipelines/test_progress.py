"""`pipelines.core.progress`: the stage figures a person plans by (rates, ETA, the summary's rates)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from pipelines.core import progress
from tests.conftest import REPO


def test_eta_is_the_remaining_plan_at_this_workers_rate():
  assert progress.eta_text(done=25, total=100, rate=5.0, processes=1) == "ETA 15s"
  assert progress.eta_text(done=25, total=1000, rate=5.0, processes=2) == (
      "ETA 1m35s (if 2 processes go at this one's rate)")
  assert progress.eta_text(done=0, total=7_200_000, rate=1000.0, processes=1) == "ETA 2h00m"
  assert progress.eta_text(done=5, total=0, rate=5.0, processes=1) == ""  # no plan total: no ETA
  assert progress.eta_text(done=200, total=100, rate=5.0, processes=1) == "ETA 0s"


def test_the_log_line_counts_every_thread_of_the_process_per_run(monkeypatch, caplog):
  import threading

  monkeypatch.setenv("TOOLKIT_PROGRESS_SECONDS", "0")
  monkeypatch.setattr(progress, "_STAGES", {})
  old = progress.Progress("tests.progress", "stage", total_units=100, run="gen-old")
  old.add(units=90)  # an earlier run in this process: not this run's progress
  stage = [progress.Progress("tests.progress", "stage", total_units=100, run="gen-new") for _ in range(4)]
  threads = [threading.Thread(target=lambda p=p: [p.add(units=1, records=1) for _ in range(10)]) for p in stage]
  with caplog.at_level(logging.INFO, logger=progress.__name__):
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    stage[0].add(bytes_out=5_000_000)
  line = caplog.records[-1].getMessage()
  assert "stage: 40/100 units on this worker" in line
  assert "ETA" in line
  assert "processes" not in line


def test_a_bad_progress_interval_falls_back_with_a_warning(monkeypatch, caplog):
  monkeypatch.setenv("TOOLKIT_PROGRESS_SECONDS", "often")
  with caplog.at_level(logging.WARNING, logger=progress.__name__):
    assert progress._every_s() == 10.0
  assert "TOOLKIT_PROGRESS_SECONDS must be a number of seconds >= 0, got 'often'" in caplog.text


def test_rates_line_reports_each_stage_that_counted():
  line = progress.rates_line("pipelines.x", {"convert_shards_units": 100, "convert_shards_records": 90,
                                             "convert_shards_bytes": 20_000_000, "images_read": 7}, 10.0)
  assert line == "pipelines.x: rates over 10.0s: convert_shards 100 units, 9 records/s, 2.0 MB/s"
  assert progress.rates_line("pipelines.x", {"images_read": 7}, 1.0) == ""


@pytest.mark.slow  # an end-to-end run in a subprocess
def test_a_run_prints_its_stage_rates_after_the_summary(class_folder, tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "pipelines.image_folder", f"--input={class_folder}", f"--output={tmp_path / 'o'}",
       "--image_size=16,16"], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.strip().splitlines()
  assert lines[0].startswith("pipelines.image_folder: 18 records in 1 shards")
  assert lines[1].startswith("pipelines.image_folder: rates over ")
  assert "convert_shards 21 units" in lines[1]


@pytest.mark.slow  # end-to-end runs in subprocesses
@pytest.mark.parametrize("plan", ["launcher", "workers"])
def test_workers_log_progress_against_the_plan_however_it_was_made(class_folder, tmp_path, plan):
  proc = subprocess.run(
      [sys.executable, "-m", "pipelines.image_folder", f"--input={class_folder}", f"--output={tmp_path / 'o'}",
       "--image_size=16,16", f"--plan={plan}"], cwd=REPO, capture_output=True, text=True, timeout=300,
      env={**os.environ, "TOOLKIT_PROGRESS_SECONDS": "0"})
  assert proc.returncode == 0, proc.stderr
  lines = [ln for ln in proc.stderr.splitlines() if "convert_shards: " in ln]
  assert lines
  assert "convert_shards: 21/21 units on this worker" in lines[-1]
  assert "ETA 0s" in lines[-1]
