"""Scheduled conversions as Airflow 3 DAGs: one small config → one DAG per data set.

A config is a JSON file (one DAG each), for example::

    {
      "dag_id": "flowers_daily",
      "pipeline": "image_folder",                  # a name in pipelines.registry
      "schedule": "@daily",
      "start_date": "2026-01-01",
      "input": "gs://bucket/incoming/flowers/{{ ds }}",
      "output": "gs://bucket/shards/flowers/{{ ds }}",   # must contain the logical date
      "options": {"format": "array_record", "image_size": "224,224"},
      "runner": "DataflowRunner",                   # or DirectRunner
      "beam_options": {"temp_location": "gs://bucket/tmp", "max_num_workers": 20},
      "dataflow": {"project_id": "P", "location": "europe-west4", "job_name": "flowers-{{ ds_nodash }}"},
      "retries": 2
    }

Each DAG has one task, a `BeamRunPythonPipelineOperator` running
`python -m pipelines.<pipeline>` with the options as flags, on the DirectRunner
or on Dataflow (`DataflowConfiguration`). Every run writes its own dated output
with `--overwrite=true`: a retry or a re-run of the same date replaces that
output atomically (the pipelines write a new generation of data files and
switch by writing manifest.json last; the previous complete output stays
readable until then), and reuses the shards a failed attempt already published.
With `"options": {"mode": "append"}` the output is one fixed folder instead
(no date in it): each run converts only the inputs it does not hold yet.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import datetime
import json
import os
from typing import Any

from pipelines import registry

_DATE_MACROS = ("{{ ds }}", "{{ ds_nodash }}", "{{ logical_date", "{{ data_interval_start", "{{ ts")


@dataclasses.dataclass(frozen=True)
class ConversionConfig:
  """One scheduled conversion. Validated on construction; errors name the field."""

  dag_id: str
  pipeline: str
  input: str
  output: str
  schedule: str | None = "@daily"
  start_date: str = "2026-01-01"
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  runner: str = "DirectRunner"
  beam_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  dataflow: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  py_interpreter: str = "python3"
  retries: int = 2
  catchup: bool = False

  def __post_init__(self):
    if self.pipeline not in registry.CONVERTERS:
      raise ValueError(f"{self.dag_id}: pipeline must be one of {registry.names()}, got {self.pipeline!r}")
    appends = self.options.get("mode") == "append"
    if not appends and not any(m in self.output for m in _DATE_MACROS):
      raise ValueError(f"{self.dag_id}: output {self.output!r} must contain the logical date (e.g. {{{{ ds }}}}) "
                       "so that every run writes its own output (or set options.mode to append: one output that "
                       "each run adds the new inputs to)")
    if appends and any(m in self.output for m in _DATE_MACROS):
      raise ValueError(f"{self.dag_id}: with options.mode append, output {self.output!r} must be one fixed folder "
                       "that every run adds to, without the logical date")
    if self.runner not in ("DirectRunner", "DataflowRunner"):
      raise ValueError(f"{self.dag_id}: runner must be DirectRunner or DataflowRunner, got {self.runner!r}")
    if self.runner == "DataflowRunner":
      missing = [k for k in ("project_id", "location") if not self.dataflow.get(k)]
      if missing:
        raise ValueError(f"{self.dag_id}: DataflowRunner needs dataflow.{' and dataflow.'.join(missing)}")
      if not str(self.beam_options.get("temp_location", "")).startswith("gs://"):
        raise ValueError(f"{self.dag_id}: DataflowRunner needs beam_options.temp_location on gs://")
    reserved = {"input", "output", "overwrite", "runner"} & (set(self.options) | set(self.beam_options))
    if reserved:
      raise ValueError(f"{self.dag_id}: set {sorted(reserved)} through the config's own fields")
    datetime.date.fromisoformat(self.start_date)

  @classmethod
  def from_file(cls, path: str) -> ConversionConfig:
    """The config in a JSON file; `dag_id` defaults to the file's name without `.json`.

    Args:
      path: the JSON file.

    Returns:
      The validated config.

    Raises:
      OSError: the file cannot be read.
      ValueError: the file is not JSON, has unknown fields, or a field has a bad value.
      TypeError: a required field (pipeline, input, output) is missing.
    """
    with open(path) as f:
      data = json.load(f)
    data.setdefault("dag_id", os.path.splitext(os.path.basename(path))[0])
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"{path}: unknown fields {sorted(unknown)}")
    return cls(**data)

  def pipeline_options(self) -> dict[str, Any]:
    """The flags of the pipeline run (templated by Airflow).

    Returns:
      {flag: value}: input, output, overwrite=true, then `options` and `beam_options`.
    """
    return {"input": self.input, "output": self.output, "overwrite": "true",
            **{k: v for k, v in self.options.items()}, **dict(self.beam_options)}


def make_dag(config: ConversionConfig):
  """The DAG of one conversion: one task running `python -m pipelines.<pipeline>` on its runner.

  Args:
    config: the conversion.

  Returns:
    The Airflow `DAG`.

  Raises:
    ImportError: Airflow, its Beam provider or (for Dataflow) its Google provider is not installed.
  """
  from airflow.providers.apache.beam.operators.beam import BeamRunPythonPipelineOperator
  from airflow.sdk import DAG

  dataflow_config = None
  if config.runner == "DataflowRunner":
    from airflow.providers.google.cloud.operators.dataflow import DataflowConfiguration

    job_name = config.dag_id.replace("_", "-") + "-{{ ds_nodash }}"  # Dataflow job names take no "_"
    dataflow_config = DataflowConfiguration(**{"job_name": job_name, **dict(config.dataflow)})
  start = datetime.datetime.fromisoformat(config.start_date).replace(tzinfo=datetime.timezone.utc)
  with DAG(dag_id=config.dag_id, schedule=config.schedule, start_date=start, catchup=config.catchup,
           default_args={"retries": config.retries, "retry_delay": datetime.timedelta(minutes=5)},
           tags=["tpu-shards", config.pipeline], max_active_runs=1,
           doc_md=f"`python -m pipelines.{config.pipeline}`: `{config.input}` → `{config.output}`") as dag:
    BeamRunPythonPipelineOperator(
        task_id="convert",
        py_file=f"pipelines.{config.pipeline}",
        py_options=["-m"],
        runner=config.runner,
        pipeline_options=config.pipeline_options(),
        py_interpreter=config.py_interpreter,
        dataflow_config=dataflow_config,
    )
  return dag


def dags_from_folder(folder: str) -> dict[str, Any]:
  """{dag_id: DAG} for every `*.json` config in `folder`, in name order.

  Args:
    folder: a local folder of JSON configs.

  Returns:
    The DAGs by their `dag_id`.

  Raises:
    ValueError, TypeError: a config is bad (see `ConversionConfig.from_file`).
    OSError: the folder or a config cannot be read.
    ImportError: Airflow or a provider is not installed (see `make_dag`).
  """
  dags = {}
  for name in sorted(os.listdir(folder)):
    if name.endswith(".json"):
      config = ConversionConfig.from_file(os.path.join(folder, name))
      dags[config.dag_id] = make_dag(config)
  return dags
