"""Every pipeline's Dataflow job, built with --dry_run=True (no cloud account): what a worker gets."""

from __future__ import annotations

import pytest
from apache_beam.options.pipeline_options import GoogleCloudOptions, SetupOptions
from apache_beam.portability.api import beam_runner_api_pb2

import make_sample_ct as ct
import make_sample_ogb as mo
from pipelines import UsageError, ct_volumes, image_folder, ogb_graphs
from tests.conftest import upload_tree

pytestmark = [pytest.mark.slow, pytest.mark.gcs]


def dataflow_flags(bucket: str) -> list[str]:
  return ["--runner=DataflowRunner", "--project=toolkit-test", "--region=europe-west4",
          f"--temp_location=gs://{bucket}/tmp", "--dry_run=True"]


@pytest.fixture(scope="module")
def gcs_inputs(gcs_emulator, class_folder, tmp_path_factory):
  base = tmp_path_factory.mktemp("df")
  dicom = str(base / "dicom")
  ct.make_mixed_tree(dicom, seed=1)
  arxiv = mo.write_homogeneous_node(str(base / "ogbn_arxiv"), 0, num_nodes=200, num_edges=800)
  upload_tree(class_folder, f"gs://{gcs_emulator}/df/pets")
  upload_tree(dicom, f"gs://{gcs_emulator}/df/dicom")
  upload_tree(arxiv.folder, f"gs://{gcs_emulator}/df/ogbn_arxiv")
  return {"image_folder": [f"--input=gs://{gcs_emulator}/df/pets"],
          "ct_volumes": [f"--input=gs://{gcs_emulator}/df/dicom", "--id_salt=s"],
          "ogb_graphs": [f"--input=gs://{gcs_emulator}/df/ogbn_arxiv"]}


EXPECTED_STEPS = {
    "image_folder": {"ListFiles", "Convert", "Write"},
    "ct_volumes": {"ListFiles", "ReadHeaders", "GroupBySeries", "PlanVolumes", "SpreadVolumes", "ReadVolumes", "Write"},
    "ogb_graphs": {"EdgeSources", "ReadEdges", "GroupByPartition", "SortPartitions", "Assemble"},
}
MODULES = {"image_folder": image_folder, "ct_volumes": ct_volumes, "ogb_graphs": ogb_graphs}


def _staged(job) -> set[str]:
  names = set()
  for env in job.proto_pipeline.components.environments.values():
    for dep in env.dependencies:
      names.add(beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(dep.role_payload).staged_name)
  return names


@pytest.mark.parametrize("pipeline", sorted(MODULES))
def test_dry_run_job_carries_the_toolkit_and_its_worker_dependencies(pipeline, gcs_inputs, gcs_emulator):
  result = MODULES[pipeline].run([*gcs_inputs[pipeline], f"--output=gs://{gcs_emulator}/df/out_{pipeline}",
                                  *dataflow_flags(gcs_emulator)])
  job = result.job
  staged = _staged(job)
  assert any(n.startswith("tpu_shards-") and n.endswith(".whl") for n in staged), staged
  assert "requirements.txt" in staged
  requirements = open(job.options.view_as(SetupOptions).requirements_file).read().split()
  names = {r.split("==")[0] for r in requirements}
  assert {"array-record", "pydicom", "python-gdcm", "pylibjpeg-openjpeg", "pandas", "scipy", "pillow"} <= names
  assert "apache-beam" not in names and all("==" in r for r in requirements)
  steps = {t.unique_name for t in job.proto_pipeline.components.transforms.values()}
  assert EXPECTED_STEPS[pipeline] <= steps
  gcp = job.options.view_as(GoogleCloudOptions)
  assert (gcp.project, gcp.region) == ("toolkit-test", "europe-west4")
  assert gcp.temp_location.startswith(f"gs://{gcs_emulator}/tmp")  # Beam appends the job's own folder


def test_a_user_container_is_left_alone(gcs_inputs, gcs_emulator):
  result = ct_volumes.run([*gcs_inputs["ct_volumes"], f"--output=gs://{gcs_emulator}/df/out_container",
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
    ct_volumes.run(argv)
