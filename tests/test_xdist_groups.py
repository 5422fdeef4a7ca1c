"""The suite's xdist groups hold: under `--dist loadgroup` (scripts/run_tests.sh) the tests of a module that share
a module-scoped fixture run on one worker, which makes the fixture once (tests/conftest.py marks them).

pytest 9.2's structured node ids broke this silently (pytest-dev/pytest-xdist#1386: xdist's group suffix no
longer reaches the scheduler, and the tests spread as if unmarked, each worker making the fixture again);
constraints.txt keeps pytest 9.1.1 until an xdist release handles them, and this test fails on an upgrade that
brings the breakage back."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

MODULE = "tests/loaders/test_options.py"  # cheap tests, some of them on a module-scoped fixture
GROUP = "tests.loaders.test_options"


@pytest.mark.slow  # a pytest run of its own
def test_the_tests_sharing_a_module_fixture_run_on_one_worker():
  r = subprocess.run([sys.executable, "-m", "pytest", MODULE, "-n", "2", "--dist", "loadgroup", "-v",
                      "-p", "no:cacheprovider"], capture_output=True, text=True, cwd=REPO, timeout=300)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  ran = re.findall(r"^\[(gw\d+)\] \[ *\d+%\] PASSED (\S+)", r.stdout, re.M)
  grouped = [(worker, test) for worker, test in ran if test.endswith("@" + GROUP)]
  assert len(grouped) >= 2, r.stdout[-3000:]
  workers = {worker for worker, _ in grouped}
  assert len(workers) == 1, f"the group ran on {sorted(workers)}"
