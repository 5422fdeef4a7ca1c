"""scripts/check_venv.py: finds the half-installed packages a full disk or a killed pip leaves."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scripts import check_venv
from tests.conftest import REPO

SCRIPT = os.path.join(REPO, "scripts", "check_venv.py")


def _dist(site, name, version, files, *, installer=True, metadata=True, record=True):
  """A dist-info the way pip leaves it; `files` maps paths to write, None to list only."""
  info = site / f"{name}-{version}.dist-info"
  info.mkdir(parents=True)
  if metadata:
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nName: not-me\n")
  rows = [f"{info.name}/METADATA,,"]
  for rel, content in files.items():
    rows.append(f"{rel},sha256=x,1")
    if content is not None:
      (site / rel).parent.mkdir(parents=True, exist_ok=True)
      (site / rel).write_text(content)
  if record:
    rows.append(f"{info.name}/RECORD,,")
    (info / "RECORD").write_text("\n".join(rows) + "\n")
  if installer:
    (info / "INSTALLER").write_text("pip\n")


def _site(tmp_path):
  site = tmp_path / "lib" / "python3.11" / "site-packages"  # so ../../../bin is tmp_path/bin
  _dist(site, "whole", "1.0", {"whole/__init__.py": "", "../../../bin/whole": None})
  # What CI saw: the top-level __init__ written, the subpackage and INSTALLER not.
  _dist(site, "tensorflow_cpu", "2.21.0", {"tensorflow/__init__.py": "", "tensorflow/python/__init__.py": None}, installer=False)
  _dist(site, "lost", "0.3", {"lost.py": None, "lost_too.py": None})
  _dist(site, "norecord", "2.0", {"norecord.py": ""}, record=False)
  _dist(site, "nometa", "5.1", {}, metadata=False)
  (site / "loose_module.py").write_text("")  # not a dist-info: ignored
  return site


def test_finds_each_kind_of_half_install(tmp_path):
  site = _site(tmp_path)
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "whole").write_text("#!")  # a RECORD path outside site-packages
  found = {b.requirement: b.reason for b in check_venv.check(str(site))}
  assert found == {
    "lost==0.3": "lost.py missing and 1 more",
    "nometa==5.1": "METADATA missing or without Name and Version",
    "norecord==2.0": "RECORD missing",
    "tensorflow_cpu==2.21.0": "INSTALLER missing (the install stopped part-way)",
  }


def test_a_file_outside_site_packages_counts(tmp_path):
  site = _site(tmp_path)  # no bin/whole this time
  found = {b.requirement for b in check_venv.check(str(site))}
  assert "whole==1.0" in found


@pytest.mark.slow  # a subprocess
def test_cli_prints_requirements_pip_can_reinstall(tmp_path):
  site = _site(tmp_path)
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "whole").write_text("#!")
  r = subprocess.run([sys.executable, SCRIPT, "--site-packages", str(site), "--explain"], capture_output=True, text=True)
  assert r.returncode == 1
  assert r.stdout.split() == ["lost==0.3", "nometa==5.1", "norecord==2.0", "tensorflow_cpu==2.21.0"]
  assert "tensorflow_cpu==2.21.0: INSTALLER missing" in r.stderr


@pytest.mark.slow  # subprocesses
def test_cli_clean_and_bad_argument(tmp_path):
  site = tmp_path / "site-packages"
  _dist(site, "whole", "1.0", {"whole/__init__.py": ""})
  r = subprocess.run([sys.executable, SCRIPT, "--site-packages", str(site)], capture_output=True, text=True)
  assert (r.returncode, r.stdout) == (0, "")
  r = subprocess.run([sys.executable, SCRIPT, "--site-packages", str(tmp_path / "nope")], capture_output=True, text=True)
  assert r.returncode == 2
  assert "is not a folder" in r.stderr


def test_this_environment_is_whole():
  """The venv the tests run in: CI once ran on a TensorFlow cut short by a full disk."""
  broken = [f"{b.requirement}: {b.reason}" for b in check_venv.check(check_venv.sysconfig.get_paths()["purelib"])]
  assert broken == []
