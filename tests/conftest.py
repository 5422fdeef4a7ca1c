"""Shared fixtures (generated image folders, a GCS emulator on loopback), the markers a test's fixtures imply,
and `run_module`, the tests' `python -m <pipeline>` in a process of its own."""

from __future__ import annotations

import atexit
import functools
import gc
import multiprocessing
import os
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
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
  suite's `where`/`output` parameters that fetch the emulator with `request.getfixturevalue`).

  The tests of a module that share a module- or class-scoped fixture are one `xdist_group`: under
  `--dist loadgroup` (scripts/run_tests.sh) they run on one pytest-xdist worker, which makes the fixture once;
  every other test goes to whichever worker is free."""
  for item in items:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if _EMULATOR_FIXTURES & set(getattr(item, "fixturenames", ())) or "gcs" in [
        v for v in params.values() if isinstance(v, str)]:
      item.add_marker(pytest.mark.gcs)
      item.add_marker(pytest.mark.slow)
    fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    if any(defs[-1].scope in ("module", "class") for defs in fixtures.values()):
      item.add_marker(pytest.mark.xdist_group(item.module.__name__))


_frozen_after = [None]  # the module whose tests last ran


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
  """Before a module's first test: the garbage collected, then what is left alive frozen (gc.freeze).

  TensorFlow, torch and Beam leave ~650k objects that live as long as the process; unfrozen, every full
  collection (Python's own, as objects pile up, or a test's gc.collect) walks them all, ~0.5 s each: about a
  quarter of the unit layer's time. A frozen object is still freed when its last reference goes; only a cycle of
  frozen objects stays (what is alive between modules: imported modules, session fixtures, caches). What a
  test or its module's fixtures make comes after the freeze and is collected as before."""
  module = item.nodeid.split("::")[0]
  if module != _frozen_after[0]:
    _frozen_after[0] = module
    gc.collect()
    gc.freeze()


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


def _start_emulator(bucket: str) -> tuple[subprocess.Popen, str]:
  """gcp-storage-emulator on a free loopback port, serving `bucket`: (its process, its address). A server that
  finds its port taken (by another test process since `_free_port` looked) exits, and another port is tried."""
  exe = shutil.which("gcp-storage-emulator") or os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
  for _ in range(5):
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "start", "--host=127.0.0.1", f"--port={port}", f"--default-bucket={bucket}", "--in-memory"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    host = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
      try:
        urllib.request.urlopen(f"{host}/storage/v1/b/{bucket}", timeout=1).read()
        return proc, host
      except Exception:
        time.sleep(0.2)
    proc.kill()
    proc.wait()
  raise RuntimeError("gcp-storage-emulator did not start")


@pytest.fixture(scope="session")
def _gcs_server():
  """A real GCS JSON API server (gcp-storage-emulator) on loopback, for the whole session (each pytest-xdist
  worker's own), behind the fault proxy (tests/gcs_faults.py), which also enforces generation
  preconditions the emulator ignores. Yields (bucket, proxy); STORAGE_EMULATOR_HOST
  names the proxy while it runs. The bucket is named after this process: a server on the port that answers
  for it is this session's, never another's that took the port first.
  """
  bucket = f"toolkit-test-{os.getpid()}"
  proc, host = _start_emulator(bucket)
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


# The libraries a pipeline run imports before it starts (Beam above all: 2-3 s of every `python -m` run),
# imported once per test process by a fork server (multiprocessing's "forkserver": a fresh interpreter, not a
# fork of pytest) whose forks each run one command. The toolkit's own modules are imported by each run, with
# its environment, as `python -m` does (pipelines.core reads STORAGE_EMULATOR_HOST when it is imported).
_WARM_MODULES = ["tests.conftest", "apache_beam", "google.cloud.storage", "PIL.Image", "pydicom", "nibabel",
                 "highdicom", "scipy.sparse"]


@pytest.fixture
def dataflow_staging(monkeypatch) -> dict[str, str]:
  """What a Dataflow launch staged for the workers, read before the launcher removes it.

  {"folder": the local staging folder, "requirements": its requirements file's text}; empty if nothing was built.
  """
  from pipelines.core import dataflow

  seen: dict[str, str] = {}
  prepare = dataflow.prepare

  def spy(*args, **kwargs):
    folder = prepare(*args, **kwargs)
    if folder is not None:
      with open(os.path.join(folder, "requirements.txt")) as f:
        seen.update(folder=folder, requirements=f.read())
    return folder

  monkeypatch.setattr(dataflow, "prepare", spy)
  return seen


@functools.cache
def _fork_server() -> multiprocessing.context.BaseContext:
  ctx = multiprocessing.get_context("forkserver")
  ctx.set_forkserver_preload(_WARM_MODULES)
  return ctx


def _main(module: str, args: list[str], env: dict[str, str], cwd: str, out: str, err: str, setup: str = "") -> None:
  """In the fork: what `python -m module *args` does in `cwd` with the environment `env` (after running the
  code `setup`), its standard output and error in the files `out` and `err`. Exits as the interpreter would:
  SystemExit's code, 1 for an uncaught exception (its traceback on stderr), the signal for a process killed by one."""
  os.chdir(cwd)
  os.environ.clear()
  os.environ.update(env)
  for fd, path in ((1, out), (2, err)):
    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(f, fd)
    os.close(f)
  sys.argv = [module, *args]  # run_module puts the module's path first, as `-m` does
  code = 0
  try:
    exec(setup, {})
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  except SystemExit as e:
    code = e.code
  except BaseException:
    traceback.print_exc()
    code = 1
  atexit._run_exitfuncs()
  sys.exit(code)


class Run:
  """A `run_module` started with wait=False: the part of subprocess.Popen the tests use."""

  def __init__(self, module: str, args: tuple[str, ...], env: dict[str, str], cwd: str, setup: str):
    self.args = [sys.executable, "-m", module, *args]
    self._dir = tempfile.mkdtemp(prefix="run-module-")
    self._out, self._err = os.path.join(self._dir, "out"), os.path.join(self._dir, "err")
    self._proc = _fork_server().Process(target=_main,
                                        args=(module, list(args), env, cwd, self._out, self._err, setup))
    self._proc.start()
    self.returncode: int | None = None
    self._output: tuple[str, str] | None = None

  def poll(self) -> int | None:
    if self.returncode is None and not self._proc.is_alive():
      self.wait()
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    self._proc.join(timeout)
    if self._proc.exitcode is None:
      raise subprocess.TimeoutExpired(self.args, timeout)
    self.returncode = self._proc.exitcode
    return self.returncode

  def kill(self) -> None:
    self._proc.kill()

  def communicate(self, timeout: float | None = None) -> tuple[str, str]:
    """(stdout, stderr), once the run has ended (a TimeoutExpired if it has not after `timeout` seconds)."""
    if self._output is None:
      self.wait(timeout)
      with open(self._out, errors="replace") as o, open(self._err, errors="replace") as e:
        self._output = o.read(), e.read()
      shutil.rmtree(self._dir, ignore_errors=True)
      self._proc.close()
    return self._output


def run_module(module: str, *args: str, env: dict[str, str] | None = None, setup: str = "", timeout: float = 300,
               wait: bool = True) -> subprocess.CompletedProcess | Run:
  """`python -m module *args` in the repository, in a process of its own (forked from an interpreter that has
  imported the libraries the pipelines use): a CompletedProcess with its exit status and text output, as
  subprocess.run(capture_output=True, text=True) gives; a Run when not `wait`.

  Args:
    env: the run's whole environment (default: this process's, with the repository on PYTHONPATH).
    setup: Python code the run executes before the module (e.g. to shorten one of the toolkit's waits).

  Raises:
    subprocess.TimeoutExpired: the run lasted more than `timeout` seconds (it is killed).
  """
  run = Run(module, args, {**os.environ, "PYTHONPATH": REPO} if env is None else env, REPO, setup)
  if not wait:
    return run
  try:
    out, err = run.communicate(timeout)
  except subprocess.TimeoutExpired:
    run.kill()
    run.communicate()
    raise
  return subprocess.CompletedProcess(run.args, run.returncode, out, err)


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
