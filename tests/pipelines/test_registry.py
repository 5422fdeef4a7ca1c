"""Every registered converter, through the shared machinery: the registry is what the CLIs,
Airflow, Dataflow packaging and these tests read, so a new converter is covered by adding it.

A converter's own test file, `tests/pipelines/test_<name>.py`, defines
`sample_input(base) -> (input folder, its own flags)`: a small input these
tests (and tests/pipelines/test_dataflow.py) convert.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from formats import kinds
from formats.outputs import commit
from formats.manifest import MANIFEST_FILENAME, Manifest
from pipelines import registry
from pipelines.core import ConverterOptions, UsageError, flags, launch
from tests.conftest import REPO


def sample_input(name: str, base: str) -> tuple[str, list[str]]:
  """(input folder, own flags) of converter `name`, from its test file's `sample_input`."""
  module = importlib.import_module(f"tests.pipelines.test_{name}")
  make = getattr(module, "sample_input", None)
  assert make is not None, f"tests/pipelines/test_{name}.py must define sample_input(base) for the registry tests"
  os.makedirs(base, exist_ok=True)
  return make(base)


@pytest.mark.slow  # a fresh process
def test_the_registry_names_each_converter_once_and_imports_without_beam():
  code = "import sys, pipelines; print(','.join(pipelines.names())); print('apache_beam' in sys.modules)"
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
  names, beam_loaded = r.stdout.split()
  assert names.split(",") == list(registry.CONVERTERS) and len(set(registry.names())) == len(registry.names())
  assert beam_loaded == "False"  # a scheduler reads the registry without loading the converters


@pytest.mark.parametrize("name", registry.names())
def test_each_entry_loads_its_converter(name):
  c = registry.converter(name)
  assert c.name == name and c.prog == f"pipelines.{name}"
  assert c.kind in kinds.KINDS
  assert issubclass(c.options, PipelineOptions) and c.options is not ConverterOptions
  assert all(isinstance(e, str) for e in c.worker_extras)


def test_registry_check_imports_every_worker_dependency():
  registry.check()
  with pytest.raises(KeyError, match="no converter 'nope'"):
    registry.converter("nope")


def test_a_converter_flag_that_clashes_with_a_shared_one_is_refused():
  class Clashing:  # not a PipelineOptions subclass: Beam registers those for the whole process
    @classmethod
    def _add_argparse_args(cls, parser):
      parser.add_argument("--seed", default="1")

  with pytest.raises(TypeError, match="Clashing defines a flag that is already defined"):
    flags.parse_options(["--input=x"], [Clashing])


@pytest.mark.parametrize("name", registry.names())
@pytest.mark.parametrize("args,message", [
    ([], "--input is required"),
    (["--input={src}"], "--output is required"),
    (["--input={src}/nope", "--output={out}"], "does not exist"),
    (["--input={src}", "--output={out}", "--format=parquet"], "--format must be one of array_record, tfrecord"),
    (["--input={src}", "--output={out}", "--num_shards=-1"], "--num_shards must be >= 0"),
    (["--input={src}", "--output={out}", "--seed=x"], "--seed must be an integer"),
    (["--input={src}", "--output={out}", "--overwrite=maybe"], "--overwrite must be true or false"),
    (["--input={src}", "--output={out}", "--fromat=tfrecord"], "unrecognized arguments: --fromat=tfrecord"),
    (["--input={src}", "--output={src}/out"], "must not be inside --input"),
    (["--input={src}", "--output={out}", "--runner=NoSuchRunner"], "is not a Beam runner"),
    (["--input={src}", "--output={out}", "--runner=collections.OrderedDict"], "is not a Beam runner"),  # importable
    (["--input={src}", "--output={out}", "--direct_num_workers=-3"], "--direct_num_workers must be >= 0"),
    (["--input={src}", "--output={out}", "--direct_num_workers=two"],
     "argument --direct_num_workers: invalid int value: 'two'"),
    (["--input={src}", "--output={out}", "--num_workers=-1"], "--num_workers must be >= 1"),
    (["--input={src}", "--output={out}", "--sdk_worker_parallelism=-4"], "--sdk_worker_parallelism must be >= 0"),
    (["--input={src}", "--output={out}", "--environment_type=NOPE"], "--environment_type 'NOPE' is not a Beam"),
    (["--input={src}", "--output={out}", "--transient_retry_seconds=-5"], "--transient_retry_seconds must be"),
    (["--input={src}", "--output={out}", "--max_input_bytes=-1"], "--max_input_bytes must be >= 1"),
])
def test_shared_flag_errors_are_usage_errors_and_write_nothing(name, args, message, tmp_path):
  src = str(tmp_path / "in")
  os.makedirs(src)
  out = str(tmp_path / "out")
  with pytest.raises(UsageError, match=message):
    launch.parse(registry.converter(name), [a.format(src=src, out=out) for a in args])
  assert not os.path.exists(out) and os.listdir(src) == []


@pytest.mark.parametrize("name", registry.names())
def test_an_output_through_a_symlink_into_the_input_or_onto_a_file_is_refused(name, tmp_path):
  src = str(tmp_path / "in")
  os.makedirs(src)
  os.symlink(src, tmp_path / "elsewhere")
  with pytest.raises(UsageError, match="must not be inside --input"):
    launch.parse(registry.converter(name), [f"--input={src}", f"--output={tmp_path}/elsewhere/out"])
  a_file = tmp_path / "a_file"
  a_file.write_bytes(b"mine")
  with pytest.raises(UsageError, match="is a file; it must be a folder"):
    launch.parse(registry.converter(name), [f"--input={src}", f"--output={a_file}"])
  assert os.listdir(src) == [] and a_file.read_bytes() == b"mine"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """Every converter run in-process on its sample: {name: (output, manifest)}."""
  out = {}
  for name in registry.names():
    base = tmp_path_factory.mktemp(name)
    folder, own = sample_input(name, str(base / "in"))
    output = str(base / "out")
    launch.run(registry.converter(name), [f"--input={folder}", f"--output={output}", *own])
    with open(os.path.join(output, MANIFEST_FILENAME), "rb") as f:
      out[name] = (output, Manifest.loads(f.read()))
  return out


@pytest.mark.slow
@pytest.mark.parametrize("name", registry.names())
def test_every_converter_commits_through_the_shared_path(name, converted):
  from formats.outputs import inspect

  output, m = converted[name]
  assert m.kind == registry.converter(name).kind  # the sample of each converter is of its main kind
  generation = commit.current_generation(output)
  assert generation and all(p.startswith(generation + "/") for p in
                            [*(s.path for sp in m.splits.values() for s in sp.shards), *(f.path for f in m.files),
                             m.rejected.path])
  with open(os.path.join(output, m.rejected.path)) as f:
    rejects = [json.loads(line) for line in f]
  assert len(rejects) == m.rejected.count
  assert inspect.main([output, "--verify"]) == 0
  with open(os.path.join(output, generation, "_toolkit_run.json")) as f:
    assert json.load(f)["state"] == "committed"  # the run ended with its switch


@pytest.mark.slow
@pytest.mark.parametrize("name", registry.names())
def test_python_m_runs_the_converter(name, tmp_path):
  """One subprocess per converter: `python -m pipelines.<name>` converts its sample and exits 0,
  and a bad flag exits 2 with one line (the flag checks themselves are tested in-process)."""
  folder, own = sample_input(name, str(tmp_path / "in"))
  out = str(tmp_path / "out")
  env = {**os.environ, "PYTHONPATH": REPO}
  bad = subprocess.run([sys.executable, "-m", f"pipelines.{name}", f"--input={folder}", f"--output={out}",
                        "--num_shards=x", *own], capture_output=True, text=True, env=env, timeout=300)
  assert bad.returncode == 2 and bad.stderr.strip() == f"pipelines.{name}: error: --num_shards must be an integer, got 'x'"
  ok = subprocess.run([sys.executable, "-m", f"pipelines.{name}", f"--input={folder}", f"--output={out}", *own],
                      capture_output=True, text=True, env=env, timeout=600)
  assert ok.returncode == 0, ok.stderr
  assert f"pipelines.{name}: " in ok.stdout and f"-> {out} in " in ok.stdout
  assert os.path.exists(os.path.join(out, MANIFEST_FILENAME))
