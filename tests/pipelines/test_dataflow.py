"""Every pipeline's Dataflow job, built with --dry_run=True (no cloud account): what a worker gets."""

from __future__ import annotations

import os

import pytest
from apache_beam.options.pipeline_options import DebugOptions, GoogleCloudOptions, SetupOptions
from apache_beam.portability.api import beam_runner_api_pb2

from pipelines import registry
from pipelines.core import UsageError, launch
from tests.conftest import upload_tree
from tests.pipelines.test_registry import sample_input

pytestmark = [pytest.mark.slow, pytest.mark.gcs]


def dataflow_flags(bucket: str) -> list[str]:
  return ["--runner=DataflowRunner", "--project=toolkit-test", "--region=europe-west4",
          f"--temp_location=gs://{bucket}/tmp", "--dry_run=True"]


@pytest.fixture(scope="module")
def gcs_inputs(gcs_emulator, tmp_path_factory):
  """Every registered converter's sample input, uploaded: {name: its --input and own flags}."""
  base = tmp_path_factory.mktemp("df")
  out = {}
  for name in registry.names():
    folder, flags = sample_input(name, str(base / name))
    upload_tree(folder, f"gs://{gcs_emulator}/df/{name}/{os.path.basename(folder)}")
    out[name] = [f"--input=gs://{gcs_emulator}/df/{name}/{os.path.basename(folder)}", *flags]
  return out


# Steps a converter's job must have, beyond the commit every job ends with.
EXPECTED_STEPS = {
    "image_folder": {"ShardPlan", "Convert", "Finalize"},  # planned at launch: no listing step
    "array_folder": {"ShardPlan", "Convert", "Finalize"},
    "ct_volumes": {"ListFiles", "ReadHeaders", "GroupBySeries", "PlanVolumes", "PlanOnWorkers", "Convert",
                   "Finalize"},
    "ogb_graphs": {"EdgeSources", "ReadEdges", "GroupByPartition", "SortPartitions", "Assemble", "Commit"},
}


def _staged(job) -> set[str]:
  names = set()
  for env in job.proto_pipeline.components.environments.values():
    for dep in env.dependencies:
      names.add(beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(dep.role_payload).staged_name)
  return names


@pytest.mark.parametrize("pipeline", registry.names())
def test_dry_run_job_carries_the_toolkit_and_its_worker_dependencies(pipeline, gcs_inputs, gcs_emulator,
                                                                      dataflow_staging):
  result = launch.run(registry.converter(pipeline), [*gcs_inputs[pipeline], f"--output=gs://{gcs_emulator}/df/out_{pipeline}",
                                  *dataflow_flags(gcs_emulator)])
  job = result.job
  staged = _staged(job)
  assert any(n.startswith("tpu_shards-") and n.endswith(".whl") for n in staged), staged
  assert "requirements.txt" in staged
  setup = job.options.view_as(SetupOptions)
  assert os.path.dirname(setup.requirements_file) == dataflow_staging["folder"]
  assert not os.path.exists(dataflow_staging["folder"])  # the launcher's copies go once the job is submitted
  requirements = dataflow_staging["requirements"].split()
  names = {r.split("==")[0] for r in requirements}
  assert {"array-record", "pydicom", "python-gdcm", "pylibjpeg-openjpeg", "pandas", "scipy", "pillow"} <= names
  assert "apache-beam" not in names
  assert all("==" in r for r in requirements)
  steps = {t.unique_name for t in job.proto_pipeline.components.transforms.values()}
  assert EXPECTED_STEPS.get(pipeline, set()) <= steps
  assert {"Write", "Commit", "Finalize"} & steps  # every job ends in the shared commit
  # A plan made at launch travels in the job's graph: staged to GCS, not sent in the request (10 MB limit).
  assert "upload_graph" in job.options.view_as(DebugOptions).experiments
  gcp = job.options.view_as(GoogleCloudOptions)
  assert (gcp.project, gcp.region) == ("toolkit-test", "europe-west4")
  assert gcp.temp_location.startswith(f"gs://{gcs_emulator}/tmp")  # Beam appends the job's own folder


def test_a_user_container_is_left_alone(gcs_inputs, gcs_emulator):
  result = launch.run(registry.converter("ct_volumes"), [*gcs_inputs["ct_volumes"], f"--output=gs://{gcs_emulator}/df/out_container",
                           *dataflow_flags(gcs_emulator), "--sdk_container_image=example.org/toolkit:1"])
  assert not any(n.endswith(".whl") for n in _staged(result.job))


@pytest.mark.parametrize("change,message", [
    ({"--project=toolkit-test": None}, "--project is required"),
    ({"--region=europe-west4": None}, "--region is required"),
    ({"--temp_location": "--temp_location=/tmp/x"}, "--temp_location must be a gs:// path"),
    ({"--output": "--output=/tmp/local_out"}, "--output must be a gs:// path"),
])
def test_dataflow_flags_are_checked_before_submission(gcs_inputs, gcs_emulator, change, message):
  argv = [*gcs_inputs["ct_volumes"], f"--output=gs://{gcs_emulator}/df/out_checks", *dataflow_flags(gcs_emulator)]
  for old, new in change.items():
    argv = [a for a in argv if not a.startswith(old)] + ([new] if new else [])
  with pytest.raises(UsageError, match=message):
    launch.run(registry.converter("ct_volumes"), argv)
