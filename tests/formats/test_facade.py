"""The public surface of `formats`: every name in __all__ imports, and is the object its module defines."""

from __future__ import annotations

import subprocess
import sys

import pytest

import formats
from formats import errors, kinds
from formats.outputs import output


def test_every_public_name_imports():
  assert sorted(formats.__all__) == sorted(set(formats.__all__))
  for name in formats.__all__:
    assert getattr(formats, name) is not None, name


def test_the_facade_reexports_the_defining_objects():
  assert formats.open_output is output.open_output
  assert formats.load_manifest is output.load_manifest
  assert formats.NotAnOutputError is errors.NotAnOutputError
  assert formats.KINDS is kinds.KINDS


def test_old_inspect_names_still_import():
  from formats.outputs import inspect

  # tests/pipelines still call inspect.verify (the command line's own import of it).
  assert inspect.verify is output.verify


@pytest.mark.slow  # a fresh process
def test_formats_imports_no_framework():
  code = "import formats, formats.outputs.output, formats.outputs.inspect, formats.adapters\nimport sys\nprint('\\n'.join(sys.modules))"
  mods = {m.split(".")[0] for m in subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                    check=True).stdout.split()}
  assert not mods & {"apache_beam", "tensorflow", "torch", "pipelines", "loaders"}
