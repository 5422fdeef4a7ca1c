"""`pipelines.core.flags` and `launch.summary_line`: the shared flag checks, without running a pipeline."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from formats.features import Features
from formats.manifest import MANIFEST_FILENAME, FileInfo, Manifest, Rejected, ShardInfo, SplitInfo
from pipelines.core import UsageError, flags, inputs, launch
from pipelines.core.flags import CommonConfig


@pytest.mark.parametrize("value,expected", [("0", 0), ("7", 7), (12, 12), ("-0", 0)])
def test_int_flag_accepts_integers_in_range(value, expected):
  assert flags.int_flag("n", value, 0, 12) == expected


@pytest.mark.parametrize("value,minimum,maximum,message", [
    ("x", 0, None, r"^--n must be an integer, got 'x'$"),
    ("1.5", 0, None, r"^--n must be an integer, got '1.5'$"),
    (None, 0, None, r"^--n must be an integer, got None$"),
    ("-1", 0, None, r"^--n must be >= 0, got -1$"),
    ("0", 1, None, r"^--n must be >= 1, got 0$"),
    ("13", 0, 12, r"^--n must be in \[0, 12\], got 13$"),
    ("-1", 0, 12, r"^--n must be in \[0, 12\], got -1$"),
    ("13", None, 12, r"^--n must be <= 12, got 13$"),
])
def test_int_flag_names_the_flag_and_the_bad_value(value, minimum, maximum, message):
  with pytest.raises(UsageError, match=message):
    flags.int_flag("n", value, minimum, maximum)


@pytest.mark.parametrize("value,expected", [
    ("true", True), ("True", True), ("1", True), ("yes", True), (True, True),
    ("false", False), ("FALSE", False), ("0", False), ("no", False), (False, False)])
def test_bool_flag(value, expected):
  assert flags.bool_flag("b", value) is expected


@pytest.mark.parametrize("value", ["maybe", "", "2", None])
def test_bool_flag_refuses_anything_else(value):
  with pytest.raises(UsageError, match=rf"^--b must be true or false, got {value!r}$"):
    flags.bool_flag("b", value)


@pytest.mark.parametrize("value,expected", [("0", 0.0), ("2.5", 2.5), (300, 300.0)])
def test_seconds_flag(value, expected):
  assert flags.seconds_flag("t", value) == expected


@pytest.mark.parametrize("value", ["-1", "inf", "nan", "soon", None])
def test_seconds_flag_refuses_negative_infinite_and_non_numbers(value):
  with pytest.raises(UsageError, match=rf"^--t must be a number of seconds >= 0, got {value!r}$"):
    flags.seconds_flag("t", value)


@pytest.mark.parametrize("value,expected", [("0", 0.0), ("90", 90.0), ("90s", 90.0), ("30m", 1800.0),
                                            ("12h", 43200.0), ("7d", 604800.0), ("1.5d", 129600.0)])
def test_duration(value, expected):
  assert flags.duration(value) == expected


@pytest.mark.parametrize("value", ["-1d", "7w", "d", "", "soon", None, "1e9"])
def test_duration_refuses_anything_else(value):
  with pytest.raises(argparse.ArgumentTypeError,
                     match=rf"^must be a duration such as 7d, 12h, 30m, 90s or 0, got {value!r}$"):
    flags.duration(value)


def test_the_keep_replaced_default_is_the_commit_protocols():
  from formats.outputs import commit
  assert flags.duration(flags.DEFAULT_KEEP_REPLACED) == commit.DEFAULT_KEEP_REPLACED_SECONDS
  assert flags.parse_options([], []).view_as(flags.ConverterOptions).keep_replaced == (
      commit.DEFAULT_KEEP_REPLACED_SECONDS)
  assert CommonConfig(input="/i", output="/o", name="n", file_format="array_record").keep_replaced_seconds == (
      commit.DEFAULT_KEEP_REPLACED_SECONDS)


@pytest.mark.parametrize("form,length,value,expected", [
    ("H,W", 2, "224,224", "224,224"), ("H,W", 2, " 32 , 16 ", "32,16"), ("H,W", 2, "007,8", "7,8"),
    ("D0,D1,...", None, "3", "3"), ("D0,D1,...", None, "3,4,5", "3,4,5")])
def test_positive_ints_keep_their_text_and_give_their_values(form, length, value, expected):
  parsed = flags.positive_ints(form, length)(value)
  assert parsed == expected and parsed.values == tuple(int(d) for d in expected.split(","))


@pytest.mark.parametrize("value", ["224", "0,5", "1,2,3", "a,b", "-1,2", "", "1.5,2"])
def test_positive_ints_refuse_anything_else(value):
  with pytest.raises(argparse.ArgumentTypeError, match=rf"^must be H,W with positive integers, got {value!r}$"):
    flags.positive_ints("H,W", 2)(value)


@pytest.mark.parametrize("value", ["0", "0.5", "-0.1", "x", "nan"])
def test_fraction_is_strictly_inside_its_bounds(value):
  assert flags.fraction(0, 0.5)("0.25") == 0.25
  with pytest.raises(argparse.ArgumentTypeError, match=rf"^must be a fraction in \(0, 0.5\), got {value!r}$"):
    flags.fraction(0, 0.5)(value)


@pytest.mark.parametrize("choices,text", [
    (("rebuild", "append"), "rebuild or append"), (("auto", "int16", "float32"), "auto, int16 or float32"),
    (("array_record", "tfrecord"), "one of array_record, tfrecord"), (("a", "b", "c", "d"), "one of a, b, c, d")])
def test_alternatives(choices, text):
  assert flags.alternatives(choices) == text


@pytest.mark.parametrize("argv,message", [
    (["--mode=merge"], r"^--mode must be rebuild or append, got 'merge'$"),
    (["--plan=everywhere"], r"^--plan must be auto, launcher or workers, got 'everywhere'$"),
    (["--format=parquet"], r"^--format must be one of array_record, tfrecord, got 'parquet'$"),
    (["--num_shards=-1"], r"^--num_shards must be >= 0, got -1$"),
    (["--seed=x"], r"^--seed must be an integer, got 'x'$"),
    (["--overwrite=maybe"], r"^--overwrite must be true or false, got 'maybe'$"),
    (["--reuse_shards="], r"^--reuse_shards must be true or false, got ''$"),
    (["--keep_replaced=7w"], r"^--keep_replaced must be a duration such as 7d, 12h, 30m, 90s or 0, got '7w'$"),
    (["--transient_retry_seconds=inf"], r"^--transient_retry_seconds must be a number of seconds >= 0, got 'inf'$"),
    (["--max_input_bytes=0"], r"^--max_input_bytes must be >= 1, got 0$"),
])
def test_shared_flags_are_checked_by_their_declarations(argv, message):
  with pytest.raises(UsageError, match=message):
    flags.parse_options(argv, [])


def test_shared_flags_parse_to_their_types():
  c = flags.parse_options(["--mode=append", "--plan=workers", "--overwrite=TRUE", "--reuse_shards=no",
                           "--keep_replaced=12h", "--num_shards=3", "--seed=-0"], []).view_as(flags.ConverterOptions)
  assert (c.mode, c.plan, c.overwrite, c.reuse_shards, c.keep_replaced, c.num_shards, c.seed) == (
      "append", "workers", True, False, 43200.0, 3, 0)
  assert flags.parse_options(["--overwrite"], []).view_as(flags.ConverterOptions).overwrite is True


def test_typed_options_survive_beams_round_trip_to_the_workers():
  """Beam hands the options to its workers as flags again (`PipelineOptions.from_dictionary`, every
  option's value, defaults included, through JSON): each must parse back to the same value."""
  from apache_beam.options.pipeline_options import PipelineOptions
  from pipelines import registry
  own_flags = {"image_folder": ["--image_size=32,16", "--jpeg_quality=80"], "ogb_graphs": ["--csc=true"],
               "ct_volumes": ["--slice_tolerance=0.2"], "array_folder": ["--dtype=int8"]}
  for name in registry.names():
    converter = registry.converter(name)
    options = flags.parse_options(["--overwrite=true", "--reuse_shards=false", "--keep_replaced=1.5d",
                                   *own_flags.get(name, [])], [converter.options])
    sent = json.loads(json.dumps(options.get_all_options(retain_unknown_options=True)))
    again = PipelineOptions.from_dictionary({k: v for k, v in sent.items() if v is not None})
    for cls in (flags.ConverterOptions, converter.options):
      got, back = options.view_as(cls).get_all_options(), again.view_as(cls).get_all_options()
      own = {a.dest for a in flags.declared_flags(cls)}
      assert {k: got[k] for k in own if k != "reuse_shards"} == {k: back[k] for k in own if k != "reuse_shards"}


@pytest.mark.parametrize("flag,root,expected", [
    ("given", "/data/whatever", "given"),
    (None, "/data/My Pets-2024/", "my_pets_2024"),
    ("", "/data/pets", "pets"),
    (None, "gs://bucket/a/Scans.v2", "scans.v2"),
    (None, "/data/---/", "data"),  # nothing usable left: the fallback name
    (None, "/", "data"),
])
def test_dataset_name_is_the_flag_or_derived_from_the_input_folder(flag, root, expected):
  assert flags.dataset_name(flag, root) == expected


def test_a_bad_name_flag_is_a_usage_error():
  with pytest.raises(UsageError, match=r"^--name: "):
    flags.dataset_name("no spaces/here", "/data/pets")


# --------------------------------------------------------------------------- check_input_output


@pytest.fixture
def tree(tmp_path, monkeypatch):
  """tmp_path/in (an input folder) as the working directory's neighbour; cwd is tmp_path."""
  os.makedirs(tmp_path / "in")
  monkeypatch.chdir(tmp_path)
  return tmp_path


def test_relative_paths_become_absolute(tree):
  root, output, overwrite = flags.check_input_output("in", "out", False)
  assert root == str(tree / "in") and output == str(tree / "out") and overwrite is False
  assert not os.path.exists(tree / "out")  # checking writes nothing


def test_a_gs_output_is_never_inside_a_local_input(tree, monkeypatch):
  """`--input=. --output=gs://b/out` was refused: the gs:// path was made a local real path
  (<cwd>/gs:/b/out), which lies inside the working directory."""
  monkeypatch.setattr(flags.fs, "exists", lambda path: False)  # no bucket to ask
  monkeypatch.setattr(flags, "is_output", lambda path: False)
  root, output, _ = flags.check_input_output(".", "gs://bucket/out/", False)
  assert root == str(tree) and output == "gs://bucket/out"


@pytest.mark.parametrize("input_flag,output_flag,message", [
    (None, "out", r"^--input is required \(a folder, local or gs://\)$"),
    ("in", "", r"^--output is required"),
    ("nope", "out", r"^--input 'nope' does not exist or is not a folder$"),
    ("in", "in/sub", r"^--output 'in/sub' must not be inside --input$"),
    ("in", "in", r"must not be inside --input"),
])
def test_input_and_output_errors(tree, input_flag, output_flag, message):
  with pytest.raises(UsageError, match=message):
    flags.check_input_output(input_flag, output_flag, False)


def test_the_input_kind_is_in_the_missing_input_message():
  with pytest.raises(UsageError, match=r"^--input is required \(an OGB data set folder, local or gs://\)$"):
    flags.check_input_output("", "out", False, "an OGB data set folder")


def test_a_sibling_whose_name_extends_the_input_is_not_inside_it(tree):
  _, output, _ = flags.check_input_output("in", "in2", False)
  assert output == str(tree / "in2")


def test_an_output_inside_the_input_through_a_symlink_is_refused(tree):
  os.symlink(tree / "in", tree / "link")
  with pytest.raises(UsageError, match=r"^--output 'link/out' must not be inside --input$"):
    flags.check_input_output("in", "link/out", False)


def test_an_output_that_is_a_file_is_refused(tree):
  (tree / "out").write_text("x")
  with pytest.raises(UsageError, match=r"^--output 'out' is a file; it must be a folder"):
    flags.check_input_output("in", "out", True)
  assert (tree / "out").read_text() == "x"


def test_an_existing_output_needs_overwrite(tree):
  os.makedirs(tree / "out")
  flags.check_input_output("in", "out", False)  # an empty folder is no output yet
  (tree / "out" / MANIFEST_FILENAME).write_bytes(Manifest(
      "d", "array_record", Features({}), {"train": SplitInfo((ShardInfo("gen-20260101T000000-00000000/d-train."
                                                                          "array_record-00000-of-00001", 1, 1,
                                                                          "0" * 64),))},
      Rejected(0, {}, "gen-20260101T000000-00000000/errors/rejected.jsonl")).dumps())
  with pytest.raises(UsageError, match=r"^--output 'out' already holds a complete output; pass --overwrite=true"):
    flags.check_input_output("in", "out", False)
  assert flags.check_input_output("in", "out", True)[2] is True
  assert flags.check_input_output("in", "out", False, append=True)[2] is False  # an append adds to it


def test_an_output_whose_manifest_is_not_valid_is_refused_even_with_overwrite(tree):
  """Damaged or written by something else: nothing of it (its paths, its generations) can be trusted."""
  os.makedirs(tree / "out")
  (tree / "out" / MANIFEST_FILENAME).write_text("{}")
  for overwrite, append in ((False, False), (True, False), (False, True)):
    with pytest.raises(UsageError, match=r"^--output 'out' holds a manifest.json that is not a valid manifest \("):
      flags.check_input_output("in", "out", overwrite, append=append)


# --------------------------------------------------------------------------- parse_options


def test_unknown_flags_are_errors_not_warnings():
  with pytest.raises(UsageError, match=r"^unrecognized arguments: --fromat=tfrecord --x$"):
    flags.parse_options(["--input=a", "--fromat=tfrecord", "--x"], [])


def test_abbreviations_are_not_accepted():
  with pytest.raises(UsageError, match=r"unrecognized arguments: --inp=a"):
    flags.parse_options(["--inp=a"], [])


@pytest.mark.parametrize("argv,message", [
    (["--runner=NoSuchRunner"], r"--runner 'NoSuchRunner' is not a Beam runner"),
    (["--runner=os.path"], r"is not a Beam runner"),
    (["--environment_type=PLANE"], r"--environment_type 'PLANE' is not a Beam environment"),
    (["--direct_num_workers=-1"], r"^--direct_num_workers must be >= 0, got -1$"),
    (["--num_workers=0"], r"^--num_workers must be >= 1, got 0$"),
])
def test_beam_flags_beam_would_trip_over_later_are_usage_errors(argv, message):
  with pytest.raises(UsageError, match=message):
    flags.parse_options(argv, [])


def test_known_flags_parse():
  options = flags.parse_options(["--input=a", "--output=b", "--runner=DirectRunner", "--direct_num_workers=2"], [])
  c = options.view_as(flags.ConverterOptions)
  assert (c.input, c.output, c.file_format, c.num_shards, c.seed) == ("a", "b", "array_record", 0, 0)


def test_read_policy_from_the_shared_flags():
  options = flags.parse_options(["--max_input_bytes=10", "--transient_retry_seconds=1.5"], [])
  assert flags.read_policy(options) == inputs.ReadPolicy(1.5, 10)
  with pytest.raises(UsageError, match=r"^--max_input_bytes must be >= 1, got 0$"):
    flags.read_policy(flags.parse_options(["--max_input_bytes=0"], []))


# --------------------------------------------------------------------------- CommonConfig


def test_common_config_is_frozen_and_checks_its_values():
  c = CommonConfig(input="/in", output="/out", name="pets", file_format="tfrecord", num_shards=2, seed=3)
  with pytest.raises(AttributeError):
    c.seed = 4  # type: ignore[misc]
  assert c.generation == "" and c.expected is None  # the launcher sets these
  with pytest.raises(ValueError, match="file_format must be one of"):
    CommonConfig(input="/in", output="/out", name="pets", file_format="parquet")
  with pytest.raises(ValueError, match=r"num_shards and seed must be >= 0, got -1 and 0"):
    CommonConfig(input="/in", output="/out", name="pets", file_format="tfrecord", num_shards=-1)
  with pytest.raises(ValueError, match=r"num_shards and seed must be >= 0, got 0 and -2"):
    CommonConfig(input="/in", output="/out", name="pets", file_format="tfrecord", seed=-2)
  with pytest.raises(ValueError):
    CommonConfig(input="/in", output="/out", name="bad name", file_format="tfrecord")


def test_common_config_from_options(tree):
  options = flags.parse_options(["--input=in", "--output=out", "--format=tfrecord", "--num_shards=3", "--seed=5"], [])
  c = flags.common_config(options, "a folder")
  assert c == CommonConfig(input=str(tree / "in"), output=str(tree / "out"), name="in", file_format="tfrecord",
                           num_shards=3, seed=5)
  assert flags.common_config(options, "a folder", name="given").name == "given"


# --------------------------------------------------------------------------- summary_line


def _shard(path: str, n: int, size: int) -> ShardInfo:
  return ShardInfo(path, n, size, "0" * 64)


def test_summary_line_of_a_record_output():
  m = Manifest(name="pets", file_format="array_record", features=Features({}),
               splits={"train": SplitInfo((_shard("a", 10, 1_500_000), _shard("b", 5, 500_000))),
                       "test": SplitInfo((_shard("c", 3, 250_000),))},
               rejected=Rejected(count=2), warnings=("split 'x' is empty",))
  assert launch.summary_line("pipelines.p", m, "/out", 1.25).splitlines() == [
      "pipelines.p: 18 records in 3 shards (2.2 MB, train=15, test=3), 2 rejected -> /out in 1.2s",
      "pipelines.p: warning: split 'x' is empty"]


def test_summary_line_of_a_file_output():
  m = Manifest(name="g", file_format="array_record", features=Features({}), splits={},
               files=(FileInfo("gen-1/g.graphbin", 3_400_000, "0" * 64, "graphbin"),))
  assert launch.summary_line("pipelines.ogb_graphs", m, "gs://b/o", 10.0) == (
      "pipelines.ogb_graphs: gen-1/g.graphbin (3.4 MB) -> gs://b/o in 10.0s")


@pytest.mark.parametrize("argv,workers,processes", [
    ([], 1, 1),
    (["--direct_num_workers=2", "--direct_running_mode=multi_threading"], 2, 1),  # threads of one process
    (["--direct_num_workers=3", "--direct_running_mode=multi_processing"], 3, 3),
    (["--runner=DataflowRunner", "--max_num_workers=10", "--machine_type=n2-standard-4"], 10, 40),
    (["--runner=dataflow", "--num_workers=3"], 3, 3),  # Beam takes the lowercase name too; n1-standard-1
    (["--runner=DataflowRunner", "--num_workers=2", "--max_num_workers=5", "--machine_type=custom-8-30720"], 5, 40),
])
def test_workers_and_processes_from_the_runner_flags(argv, workers, processes):
  options = flags.parse_options(argv, [])
  assert flags.worker_counts(options) == (workers, processes)
