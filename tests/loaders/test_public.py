"""The `loaders` facade: its names exist, and importing it (or loaders.xla / loaders.graph) stays framework-light."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import loaders
from tests.conftest import REPO

_FRAMEWORKS = ("grain", "torch", "torch_xla", "tensorflow", "apache_beam", "pipelines")

_IMPORTS = r"""
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
importlib.import_module(sys.argv[2])
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[3])))))
"""


def _frameworks_after_import(module: str) -> list[str]:
  r = subprocess.run([sys.executable, "-c", _IMPORTS, REPO, module, json.dumps(_FRAMEWORKS)], capture_output=True,
                     text=True, env={**os.environ, "PYTHONPATH": REPO}, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_every_public_name_exists():
  assert loaders.__all__
  assert len(set(loaders.__all__)) == len(loaders.__all__)
  for name in loaders.__all__:
    assert getattr(loaders, name) is not None, name
  assert not [n for n in loaders.__all__ if n.startswith("_")]


@pytest.mark.slow  # a fresh process
def test_the_facade_imports_no_framework():
  assert _frameworks_after_import("loaders") == []


@pytest.mark.slow  # fresh processes
def test_graph_imports_no_framework_and_xla_never_tensorflow():
  assert _frameworks_after_import("loaders.graph") == []
  assert "tensorflow" not in _frameworks_after_import("loaders.xla")
