"""formats.errors holds every error type; the modules that raise them export the same objects."""

from __future__ import annotations

import pytest

from formats import errors, example, graphbin, protowire, tfrecord
from formats.outputs import commit


@pytest.mark.parametrize("module, name", [
    (example, "ExampleDecodeError"),
    (tfrecord, "TFRecordCorruptError"),
    (graphbin, "GraphBinError"),
    (protowire, "WireFormatError"),
    (commit, "CommitConflict"),
])
def test_the_raising_modules_name_the_same_class(module, name):
  assert getattr(module, name) is getattr(errors, name)


@pytest.mark.parametrize("name, base", [
    ("CorruptRecordError", ValueError),
    ("TFRecordCorruptError", errors.CorruptRecordError),
    ("ExampleDecodeError", ValueError),
    ("GraphBinError", ValueError),
    ("WireFormatError", ValueError),
    ("NotAnOutputError", FileNotFoundError),
    ("CommitConflict", RuntimeError),
])
def test_errors_keep_the_base_classes_callers_catch(name, base):
  assert issubclass(getattr(errors, name), base)


def test_a_decode_error_raised_by_example_is_the_errors_class():
  with pytest.raises(errors.ExampleDecodeError):
    example.decode_example(b"\x0a\x05\x0a")  # a length running past the end
