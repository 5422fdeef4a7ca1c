"""The converter protocol's record path (`pipelines.core.converter`): a converter that supplies only its
hooks gets listing, planning, conversion, accounting and the commit from core."""

from __future__ import annotations

import dataclasses
import json
import os

from apache_beam.options.pipeline_options import PipelineOptions
import pytest

from formats import tfrecord
from formats.features import ClassLabel, Features, Text
from formats.manifest import MANIFEST_FILENAME, Manifest
from formats.storage import files as fs
from pipelines.core import (
    Converter, Event, OutputPlan, PlanUnit, Record, Reject, Sources, UnitConverter, UsageError, inputs, launch)
from pipelines.core.converter import appended_feature
from pipelines.core.flags import CommonConfig

FEATURES = Features({"text": Text()})


class _NoFlags(PipelineOptions):
  pass


class _Numbers(UnitConverter):
  """Even numbers become records, odd ones rejects; multiples of 3 also raise an event; 7 makes nothing
  when `lose_seven`."""

  def __init__(self, lose_seven: bool = False):
    self._lose_seven = lose_seven

  def convert(self, n: int):
    if n % 3 == 0:
      yield Event("triple")
    if n == 7 and self._lose_seven:
      return
    if n % 2:
      yield Reject(f"n{n}", "odd", "train")
    else:
      yield Record("train", f"n{n:02d}", FEATURES.encode({"text": str(n)}))


class _NumbersConverter(Converter, name="numbers", kind="tensors", options=_NoFlags):
  """Units the plan knows (no listing): the numbers 0..9."""

  def __init__(self, lose_seven: bool = False):
    self.lose_seven = lose_seven

  def configure(self, own, common):
    return None

  def plan(self, common, config):
    return OutputPlan(FEATURES, ("train",), "numbers", {"pipeline": "numbers"})

  def sources(self, common, config, plan):  # each record estimated at 600 KiB
    return Sources(units=[PlanUnit("train", f"n{n:02d}", n, 600 << 10) for n in range(10)], num_inputs=10)

  def unit_converter(self, common, config, plan):
    return _Numbers(self.lose_seven)

  def warnings(self, config, plan, found):
    return [f"{found.events.get('triple', 0)} triples"]


class _TextFiles(UnitConverter):
  def __init__(self, policy: inputs.ReadPolicy):
    self._policy = policy

  def convert(self, unit):
    (split, _), f = unit
    data = self._policy.read(f.location)
    if not data:
      yield Reject(f.path, "empty", split)
      return
    yield Record(split, f.path.rsplit("/", 2)[-2] + "/" + f.path.rsplit("/", 1)[-1],
                 FEATURES.encode({"text": data.decode()}))


class _TextConverter(Converter, name="texts", kind="tensors", options=_NoFlags):
  """Folders core lists: <input>/<split>/<group>/<file>, keyed (split, group)."""

  def configure(self, own, common):
    return None

  def plan(self, common, config):
    splits = tuple(sorted(fs.list_dir(common.input)[0]))
    return OutputPlan(FEATURES, splits, "texts", {"pipeline": "texts"}, state=splits)

  def sources(self, common, config, plan):
    return Sources(folders=[((s, g), fs.join(common.input, s, g)) for s in plan.state
                            for g in sorted(fs.list_dir(fs.join(common.input, s))[0])], root=common.input)

  def unit_converter(self, common, config, plan):
    return _TextFiles(common.read_policy)

  def warnings(self, config, plan, found):
    return [f"{key[0]}/{key[1]}: {n} files" for key, n in sorted(found.per_key.items())]


def _manifest(out: str) -> Manifest:
  with open(os.path.join(out, MANIFEST_FILENAME), "rb") as f:
    return Manifest.loads(f.read())


def _texts(out: str, m: Manifest, split: str) -> list[str]:
  return [FEATURES.decode(r)["text"] for s in m.splits[split].shards for r in tfrecord.read_file(os.path.join(out, s.path))]


pytestmark = pytest.mark.slow  # each test runs a Beam pipeline


def _empty_input(tmp_path) -> str:
  os.makedirs(tmp_path / "in")
  return str(tmp_path / "in")


def test_units_the_plan_knows_become_records_rejects_and_warnings(tmp_path):
  out = str(tmp_path / "out")
  launch.run(_NumbersConverter(), [f"--input={_empty_input(tmp_path)}", f"--output={out}", "--format=tfrecord", "--num_shards=2"])
  m = _manifest(out)
  assert sorted(_texts(out, m, "train"), key=int) == ["0", "2", "4", "6", "8"]
  assert [s.num_records for s in m.splits["train"].shards] in ([2, 3], [3, 2])
  assert m.rejected.count == 5
  assert "4 triples" in m.warnings  # 0, 3, 6, 9


def test_a_unit_that_makes_neither_a_record_nor_a_reject_fails_the_job_and_commits_nothing(tmp_path):
  out = str(tmp_path / "out")
  with pytest.raises(Exception, match="made no record and no reject"):
    launch.run(_NumbersConverter(lose_seven=True), [f"--input={_empty_input(tmp_path)}", f"--output={out}"])
  assert not os.path.exists(os.path.join(out, MANIFEST_FILENAME))


def test_appended_feature_is_the_held_one_of_an_append_and_a_usage_error_when_the_output_lacks_it(tmp_path):
  out = str(tmp_path / "out")
  launch.run(_NumbersConverter(), [f"--input={_empty_input(tmp_path)}", f"--output={out}"])
  common = CommonConfig(input=str(tmp_path / "in"), output=out, name="numbers", file_format="array_record",
                        mode="append")
  assert appended_feature(common, "text", Text, "text output") == Text()
  assert appended_feature(dataclasses.replace(common, mode="rebuild"), "text", Text, "text output") is None
  with pytest.raises(UsageError, match=r"^--mode=append: .* holds no image output \(no class label feature\)$"):
    appended_feature(common, "label", ClassLabel, "image output (no class label feature)")


@pytest.mark.parametrize("plan", ["launcher", "workers"])
def test_listed_folders_give_the_same_output_planned_at_launch_or_on_the_workers(plan, tmp_path):
  src = tmp_path / "in"
  for split, group, name, text in [("train", "a", "1.txt", "one"), ("train", "a", "2.txt", "two"),
                                   ("train", "b", "3.txt", "three"), ("test", "a", "4.txt", ""),
                                   ("test", "c", "5.txt", "five")]:
    os.makedirs(src / split / group, exist_ok=True)
    (src / split / group / name).write_text(text)
  out = str(tmp_path / plan)
  launch.run(_TextConverter(), [f"--input={src}", f"--output={out}", "--format=tfrecord", f"--plan={plan}"])
  m = _manifest(out)
  assert sorted(_texts(out, m, "train")) == ["one", "three", "two"]
  assert _texts(out, m, "test") == ["five"]
  assert [json.loads(line)["input"].rsplit("/", 1)[1] for line in open(os.path.join(out, m.rejected.path))] == ["4.txt"]
  assert sorted(w for w in m.warnings if "files" in w) == [
      "test/a: 1 files", "test/c: 1 files", "train/a: 2 files", "train/b: 1 files"]


@pytest.mark.parametrize("flags,shards", [([], 1), (["--shard_size_mb=1"], 6)])
def test_the_automatic_shard_count_aims_at_shard_size_mb(flags, shards, tmp_path):
  """10 units of 600 KiB: one shard at the default 128 MiB; 6 (5.9 MiB / 1 MiB, rounded up) at 1 MiB."""
  out = str(tmp_path / "out")
  launch.run(_NumbersConverter(), [f"--input={_empty_input(tmp_path)}", f"--output={out}", *flags])
  assert len(_manifest(out).splits["train"].shards) == shards
