"""The DAG factory in a real Airflow 3: the DAG folder loads, operators carry what they should,
and one scheduled conversion runs end to end (twice for the same date: replaced, not damaged)."""

from __future__ import annotations

import datetime
import glob
import json
import os
import shutil
import sys

import pytest
from airflow.models.dagbag import DagBag

from formats.outputs import inspect
from formats.manifest import Manifest
from pipelines import registry
from scheduling.airflow_dags import ConversionConfig, dags_from_folder, make_dag

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DAG_FOLDER = os.path.join(REPO, "scripts", "airflow", "dags")
# The pipelines run in the main environment (Beam's GCP extra cannot share Airflow's Google provider).
PIPELINE_PYTHON = os.environ.get("TOOLKIT_PIPELINE_PYTHON", os.path.join(REPO, ".venv", "bin", "python"))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import make_sample_images  # noqa: E402


def test_dag_folder_loads_without_import_errors():
  bag = DagBag(dag_folder=DAG_FOLDER, include_examples=False)
  assert not bag.import_errors, bag.import_errors
  assert {"flowers_daily", "ct_weekly", "ct_dicomweb_daily"} <= set(bag.dag_ids)


def test_operators_carry_module_arguments_and_dataflow_options():
  dags = dags_from_folder(os.path.join(DAG_FOLDER, "configs"))
  task = dags["flowers_daily"].get_task("convert")
  assert task.py_file == "pipelines.image_folder" and task.py_options == ["-m"]
  assert task.runner == "DataflowRunner"
  assert task.pipeline_options["output"] == "gs://example-bucket/shards/flowers/{{ ds }}"
  assert task.pipeline_options["overwrite"] == "true" and task.pipeline_options["image_size"] == "224,224"
  assert task.pipeline_options["temp_location"] == "gs://example-bucket/tmp"
  assert task.dataflow_config.project_id == "example-project"
  assert task.dataflow_config.location == "europe-west4"
  assert task.dataflow_config.job_name == "flowers-daily-{{ ds_nodash }}"
  assert dags["flowers_daily"].schedule == "@daily" or str(dags["flowers_daily"].timetable.summary) == "@daily"
  assert dags["ct_weekly"].get_task("convert").py_file == "pipelines.ct_volumes"


@pytest.mark.parametrize("name", registry.names())
def test_every_registered_converter_can_be_scheduled(name):
  dag = make_dag(ConversionConfig(dag_id=f"d_{name}", pipeline=name, input="/in", output="/out/{{ ds }}"))
  assert dag.get_task("convert").py_file == f"pipelines.{name}"
  assert f"pipelines.{name}.pipeline" not in sys.modules  # reading the registry loads no converter


@pytest.mark.parametrize("change,message", [
    ({"output": "/data/out"}, "must contain the logical date"),
    ({"pipeline": "nope"}, "pipeline must be one of"),
    ({"runner": "DataflowRunner"}, "needs dataflow.project_id"),
    ({"options": {"output": "x"}}, "through the config's own fields"),
    ({"options": {"mode": "append"}}, "must be one fixed folder"),
])
def test_bad_configs_are_rejected_with_the_field(change, message):
  base = dict(dag_id="d", pipeline="image_folder", input="/in", output="/out/{{ ds }}")
  with pytest.raises(ValueError, match=message):
    ConversionConfig(**{**base, **change})


def test_an_appending_conversion_writes_one_fixed_output():
  config = ConversionConfig(dag_id="d", pipeline="ct_volumes", input="/pacs/export", output="/shards/ct",
                            options={"mode": "append", "id_salt": "s"})
  assert make_dag(config).get_task("convert").pipeline_options["mode"] == "append"


def _scheduled_dag(configs, dag_id: str):
  """The real DAG file in Airflow's dags folder, reading the config folder `configs`: dag.test()
  serialises the DAGs it finds there."""
  dags_folder = os.environ["AIRFLOW__CORE__DAGS_FOLDER"]
  os.makedirs(dags_folder, exist_ok=True)
  shutil.copy(os.path.join(DAG_FOLDER, "conversions.py"), dags_folder)
  os.environ["TOOLKIT_DAG_CONFIGS"] = str(configs)
  return DagBag(dag_folder=dags_folder, include_examples=False).get_dag(dag_id)


def test_a_daily_dag_appends_what_a_dicom_store_gained(tmp_path):
  """A real Orthanc holding a study of 2026-01-01 and one of 2026-01-02: the daily DAG's StudyDate window
  converts the first on day 1, adds the second on day 2, and a rerun of day 2 adds nothing."""
  gen = tmp_path / "gen.py"
  gen.write_text(f"""
import sys; sys.path.insert(0, {REPO!r})
import glob, pydicom
from scripts import make_sample_ct as ct
for k, date in enumerate(("20260101", "20260102")):
  folder = {str(tmp_path)!r} + f"/study{{k}}"
  ct.write_series(folder, patient_id=f"SYNDAG{{k}}", seed=k, rows=16, cols=16, num_slices=4)
  for p in glob.glob(folder + "/*"):
    ds = pydicom.dcmread(p); ds.StudyDate = date; ds.save_as(p)
""")
  import subprocess
  subprocess.run([PIPELINE_PYTHON, str(gen)], check=True, capture_output=True, timeout=300)
  import orthanc  # scripts/orthanc.py: a real DICOM store on loopback
  configs = tmp_path / "configs"
  configs.mkdir()
  out = str(tmp_path / "ct")
  with orthanc.Orthanc(str(tmp_path / "orthanc")) as store:
    assert len(store.upload(sorted(glob.glob(str(tmp_path / "study*" / "*"))))) == 8
    (configs / "ct_store.json").write_text(json.dumps({
        "pipeline": "ct_volumes", "input": store.dicomweb, "output": out,
        "options": {"mode": "append", "id_salt": "s", "splits": "train=1.0",
                    "dicomweb_filter": "StudyDate={{ macros.ds_format(macros.ds_add(ds, -1), '%Y-%m-%d', '%Y%m%d') }}-"
                                       "{{ ds_nodash }}"},
        "py_interpreter": PIPELINE_PYTHON, "retries": 0, "schedule": None}))
    dag = _scheduled_dag(configs, "ct_store")
    held = []
    for day in (1, 2, 2):  # day 2 twice: a rerun
      dr = dag.test(logical_date=datetime.datetime(2026, 1, day, tzinfo=datetime.timezone.utc))
      assert str(dr.state) in ("success", "DagRunState.SUCCESS"), dr.state
      m = Manifest.loads(open(os.path.join(out, "manifest.json"), "rb").read())
      held.append((m.splits["train"].num_records, m.rejected.count))
  assert held == [(1, 0), (2, 0), (2, 0)]
  assert list(m.source["dicomweb_filter"]) == ["StudyDate"]  # its value salted: a date is PHI
  assert b"20260101" not in open(os.path.join(out, "manifest.json"), "rb").read()


def test_a_scheduled_run_converts_end_to_end_and_a_rerun_replaces_it(tmp_path):
  src = str(tmp_path / "incoming" / "2026-01-02")
  make_sample_images.make_folder(src, ["a", "b"], 4, None, (64, 48), 1, seed=0)
  configs = tmp_path / "configs"
  configs.mkdir()
  (configs / "local_images.json").write_text(json.dumps({
      "pipeline": "image_folder", "input": str(tmp_path / "incoming" / "{{ ds }}"),
      "output": str(tmp_path / "shards" / "{{ ds }}"), "options": {"format": "array_record", "num_shards": 2},
      "py_interpreter": PIPELINE_PYTHON, "retries": 0, "schedule": None}))
  dag = _scheduled_dag(configs, "local_images")
  out = str(tmp_path / "shards" / "2026-01-02")

  def run_once():
    dr = dag.test(logical_date=datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone.utc))
    assert str(dr.state) in ("success", "DagRunState.SUCCESS"), dr.state
    m = Manifest.loads(open(os.path.join(out, "manifest.json"), "rb").read())
    assert m.splits["train"].num_records == 8 and m.rejected.count == 1
    assert inspect.main([out, "--verify"]) == 0
    return m

  first = run_once()
  second = run_once()  # the same date again: a new generation; the replaced one is kept (retention)
  assert first.splits["train"].shards[0].path != second.splits["train"].shards[0].path
  assert [s.sha256 for s in first.splits["train"].shards] == [s.sha256 for s in second.splits["train"].shards]
  generations = sorted(d for d in os.listdir(out) if d.startswith("gen-"))
  assert generations == sorted(m.splits["train"].shards[0].path.split("/")[0] for m in (first, second))
  marker = json.load(open(os.path.join(out, first.splits["train"].shards[0].path.split("/")[0], "_toolkit_run.json")))
  assert marker["state"] == "replaced"
