"""`python -m pipelines.<name> --help` and `-h` for every registered converter: exit 0, the usage,
the input, every declared flag with its default (read from the options classes), nothing written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipelines import registry
from pipelines.core import flags, launch, shards
from tests.conftest import REPO


def _help(name: str, argv: list[str], capsys) -> str:
  with pytest.raises(SystemExit) as e:
    launch.main(registry.converter(name), argv)
  assert e.value.code == 0
  out = capsys.readouterr()
  assert "unrecognized" not in out.err and "error" not in out.err
  return out.out


def _check_help(name: str, text: str) -> None:
  converter = registry.converter(name)
  assert text.startswith(f"usage: python -m pipelines.{name} ")
  assert f"Input (--input): {converter.input_kind}, local or gs://." in text
  own_at, shared_at = text.index(f"{name} flags:"), text.index("shared flags:")
  assert own_at < shared_at < text.index("Beam's runner and worker flags")
  for cls, start, end in ((converter.options, own_at, shared_at), (flags.ConverterOptions, shared_at, len(text))):
    section = text[start:end]
    for action in flags.declared_flags(cls):
      flag = action.option_strings[0]
      assert f"  {flag} " in section, (name, flag)
      entry = section[section.index(f"  {flag} "):].split("\n  --")[0]  # the flag's lines, up to the next flag
      if action.default is not None:
        assert f"(default: {flags.shown_default(action.default)})" in " ".join(entry.split()), (name, flag, entry)


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--input=nowhere", "--output=out", "--help", "--fromat=x"]])
@pytest.mark.parametrize("name", registry.names())
def test_help_lists_the_converters_flags_then_the_shared_ones(name, argv, capsys, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  _check_help(name, _help(name, argv, capsys))
  assert os.listdir(tmp_path) == []  # nothing written, not even the --output folder


def test_the_plan_help_states_the_launchers_listing_limit(capsys):
  assert f"more than {shards.LAUNCHER_LISTING_LIMIT:,} files" in " ".join(_help("image_folder", ["-h"], capsys).split())


def test_help_builds_no_pipeline(monkeypatch, capsys):
  monkeypatch.setattr(launch, "run_pipeline", lambda *a: pytest.fail("a pipeline was run"))
  monkeypatch.setattr(flags, "parse_options", lambda *a: pytest.fail("the flags were parsed"))
  _help("ct_volumes", ["--help"], capsys)


@pytest.mark.slow  # a fresh process per converter, about 2 s each (Beam's import)
@pytest.mark.parametrize("name", registry.names())
def test_help_from_the_command_line(name, tmp_path):
  for flag in ("--help", "-h"):
    r = subprocess.run([sys.executable, "-m", f"pipelines.{name}", flag], capture_output=True, text=True,
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO}, timeout=120)
    assert r.returncode == 0 and "unrecognized" not in r.stderr, r.stderr
    _check_help(name, r.stdout)
  assert os.listdir(tmp_path) == []
