"""Shared fixtures (generated image folders, a GCS emulator on loopback) and the markers a test's fixtures imply."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from scripts import make_sample_images
from tests.gcs_faults import FaultProxy

os.environ.setdefault("OUTDATED_IGNORE", "1")  # the ogb package would look for updates online

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_EMULATOR_FIXTURES = {"_gcs_server", "gcs_emulator", "gcs_faults"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
  """A test that runs against the GCS emulator is marked `gcs` and `slow` (pyproject.toml's markers), whether
  or not its module says so: one that uses an emulator fixture, or a case whose parameter is "gcs" (the
  suite's `where`/`output` parameters that fetch the emulator with `request.getfixturevalue`)."""
  for item in items:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if _EMULATOR_FIXTURES & set(getattr(item, "fixturenames", ())) or "gcs" in [
        v for v in params.values() if isinstance(v, str)]:
      item.add_marker(pytest.mark.gcs)
      item.add_marker(pytest.mark.slow)


CLASSES = ["cat", "dog", "zebra"]
PER_CLASS = 6
CORRUPT = 3  # per split: a truncated JPEG, a text file named .jpg, an empty .png


@pytest.fixture(scope="session")
def class_folder(tmp_path_factory) -> str:
  """<root>/<class>/<files>: 18 good images in mixed modes/formats + 3 corrupt files."""
  root = str(tmp_path_factory.mktemp("class_folder") / "pets")
  make_sample_images.make_folder(root, CLASSES, PER_CLASS, None, (64, 48), CORRUPT, seed=1)
  return root


@pytest.fixture(scope="session")
def split_folder(tmp_path_factory) -> str:
  """<root>/{train,validation}/<class>/<files> with an empty class folder in validation."""
  root = str(tmp_path_factory.mktemp("split_folder") / "pets")
  make_sample_images.make_folder(root, CLASSES, PER_CLASS, ["train", "validation"], (64, 48), CORRUPT, seed=2)
  os.makedirs(os.path.join(root, "validation", "yak"))  # an empty class folder
  return root


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="session")
def _gcs_server():
  """A real GCS JSON API server (gcp-storage-emulator) on loopback, for the whole session,
  behind the fault proxy (tests/gcs_faults.py), which also enforces generation
  preconditions the emulator ignores. Yields (bucket, proxy); STORAGE_EMULATOR_HOST
  names the proxy while it runs.
  """
  exe = shutil.which("gcp-storage-emulator") or os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
  port = _free_port()
  bucket = "toolkit-test"
  proc = subprocess.Popen(
      [exe, "start", "--host=127.0.0.1", f"--port={port}", f"--default-bucket={bucket}", "--in-memory"],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
  )
  host = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 30
  while True:
    try:
      urllib.request.urlopen(f"{host}/storage/v1/b/{bucket}", timeout=1).read()
      break
    except Exception:
      if proc.poll() is not None or time.monotonic() > deadline:
        proc.kill()
        raise RuntimeError("gcp-storage-emulator did not start")
      time.sleep(0.2)
  proxy = FaultProxy(host)
  old = os.environ.get("STORAGE_EMULATOR_HOST")
  os.environ["STORAGE_EMULATOR_HOST"] = proxy.host
  # Both clients read the variable when they are created: start from fresh ones.
  from formats.storage import files
  from pipelines.core import emulator

  files._gcs_client.cache_clear()
  emulator.use_anonymous_credentials()
  try:
    yield bucket, proxy
  finally:
    proxy.close()
    proc.terminate()
    proc.wait(timeout=10)
    if old is None:
      os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
      os.environ["STORAGE_EMULATOR_HOST"] = old
    files._gcs_client.cache_clear()


@pytest.fixture(scope="session")
def gcs_emulator(_gcs_server) -> str:
  """The bucket of the session's GCS emulator (through the fault proxy, no faults set)."""
  return _gcs_server[0]


@pytest.fixture
def gcs_faults(_gcs_server) -> FaultProxy:
  """The fault proxy in front of the emulator (`.bucket` names the bucket); faults are cleared afterwards."""
  bucket, proxy = _gcs_server
  proxy.bucket = bucket
  proxy.clear_faults()
  try:
    yield proxy
  finally:
    proxy.clear_faults()


def upload_tree(local_root: str, gs_root: str) -> int:
  """Copies a local folder to gs:// (through formats.storage.files); returns the file count."""
  from formats.storage import files

  n = 0
  for dirpath, _, names in os.walk(local_root):
    for name in names:
      rel = os.path.relpath(os.path.join(dirpath, name), local_root).replace(os.sep, "/")
      with open(os.path.join(dirpath, name), "rb") as f:
        files.write_bytes(files.join(gs_root, rel), f.read())
      n += 1
  return n
