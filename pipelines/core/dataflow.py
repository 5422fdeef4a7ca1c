"""Getting a job ready for Dataflow: checks first, then the toolkit and its worker dependencies.

A pipeline that runs on the DirectRunner but whose Dataflow workers lack the
toolkit, pydicom's decoders or array_record fails only after the job started.
`with staging(options, common, extras):` runs on the launcher around the
submission (`prepare` is its first half):

- one-line UsageErrors for what Dataflow cannot work with: no --project or
  --region, a --temp_location / --input / --output that is not gs://;
- the `upload_graph` experiment: the job's graph (which carries a shard plan
  made at launch, ~13 MB compressed for ImageNet) is staged to GCS, because
  Dataflow refuses job requests over 10 MB;
- unless the user chose how workers get their code (--setup_file,
  --extra_package(s), --requirements_file or --sdk_container_image), it builds
  a wheel of this project (staged with --extra_package) and a requirements file
  pinning the worker-side dependencies to the launcher's installed versions
  (--requirements_file, installed by the workers from PyPI at start-up). For
  workers without internet access, or for fast start-up, use the container of
  the Dockerfile (docs/dataflow.md). The launcher's local copies of the two
  files are removed once the submission has uploaded them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import importlib.metadata
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile

from apache_beam.options.pipeline_options import (
    DebugOptions, GoogleCloudOptions, PipelineOptions, SetupOptions, StandardOptions, WorkerOptions)

from pipelines.core.errors import UsageError

DISTRIBUTION = "tpu-shards"
_NOT_ON_WORKERS = {"apache-beam"}  # the SDK container has it
_log = logging.getLogger(__name__)


def is_dataflow(options: PipelineOptions) -> bool:
  """Whether the job runs on Dataflow (its --runner names Dataflow).

  Args:
    options: the job's options.

  Returns:
    True for DataflowRunner (or a runner path that names it).
  """
  runner = options.view_as(StandardOptions).runner or ""
  return "dataflow" in str(runner).lower()


def check(options: PipelineOptions, common) -> None:
  """UsageError for the Dataflow flags that are missing or point at local files.

  Args:
    options: the job's options (--project, --region, --temp_location, --staging_location).
    common: the converter's `flags.CommonConfig` (its input and output).

  Raises:
    UsageError: a flag is missing, or a location is not gs:// (an input may be a service's URL: a DICOM store).
  """
  gcp = options.view_as(GoogleCloudOptions)
  if not gcp.project:
    raise UsageError("--project is required with --runner=DataflowRunner")
  if not gcp.region:
    raise UsageError("--region is required with --runner=DataflowRunner")
  if not (gcp.temp_location or "").startswith("gs://"):
    raise UsageError(f"--temp_location must be a gs:// path on Dataflow, got {gcp.temp_location!r}")
  if gcp.staging_location and not gcp.staging_location.startswith("gs://"):
    raise UsageError(f"--staging_location must be a gs:// path on Dataflow, got {gcp.staging_location!r}")
  for name, value in (("--input", common.input), ("--output", common.output)):
    if not str(value).startswith(("gs://", "https://", "http://") if name == "--input" else "gs://"):
      raise UsageError(f"{name} must be a gs:// path on Dataflow (workers cannot read this machine's disk), "
                       f"got {value!r}")


def project_root() -> str | None:
  """The source tree this toolkit runs from, when it runs from one (pyproject.toml beside the packages).

  Returns:
    The project's root folder, or None for an installed (non-editable) toolkit.
  """
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # pipelines/core/..
  return root if os.path.exists(os.path.join(root, "pyproject.toml")) else None


def build_wheel(out_dir: str) -> str:
  """A wheel of this project (no dependencies inside) in `out_dir`, for the workers.

  Args:
    out_dir: an empty local folder.

  Returns:
    The wheel's path.

  Raises:
    UsageError: the toolkit is not running from its source tree.
    RuntimeError: `pip wheel` failed or did not make exactly one wheel.
  """
  root = project_root()
  if root is None:
    raise UsageError("cannot build the toolkit for the workers (not running from its source tree): "
                     "pass --sdk_container_image (see the Dockerfile) or --extra_package")
  # Built from a clean copy of the sources: setuptools would pack whatever an earlier build left
  # in the tree's build/ folder (modules since moved or deleted) into the workers' wheel.
  src = tempfile.mkdtemp(prefix="toolkit-src-")
  try:
    for name in sorted(os.listdir(root)):
      path = os.path.join(root, name)
      if name in ("pyproject.toml", "README.md"):
        shutil.copy(path, src)
      elif name != "tests" and os.path.isfile(os.path.join(path, "__init__.py")):  # a package
        shutil.copytree(path, os.path.join(src, name), ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", out_dir, src],
        capture_output=True, text=True)
  finally:
    shutil.rmtree(src, ignore_errors=True)
  wheels = [f for f in os.listdir(out_dir) if f.endswith(".whl")]
  if result.returncode != 0 or len(wheels) != 1:
    raise RuntimeError(f"building the toolkit's wheel failed: {result.stderr.strip()[-2000:]}")
  return os.path.join(out_dir, wheels[0])


def _name(requirement: str) -> str:
  return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def worker_requirements(extras: tuple[str, ...] = ("pipelines",)) -> list[str]:
  """`name==version` of every worker-side dependency (base + `extras`), as installed here.

  Args:
    extras: the pyproject extras the workers need.

  Returns:
    The pins, sorted (apache-beam left out: the SDK container has it).

  Raises:
    UsageError: the toolkit or one of the dependencies is not installed here.
  """
  try:
    requires = importlib.metadata.requires(DISTRIBUTION) or []
  except importlib.metadata.PackageNotFoundError:
    raise UsageError(f"{DISTRIBUTION} is not installed (pip install -e .): its dependencies are unknown") from None
  names = []
  for req in requires:
    marker = req.split(";", 1)[1] if ";" in req else ""
    needed_by = re.findall(r'extra\s*==\s*"([^"]+)"', marker)
    if needed_by and not set(needed_by) & set(extras):
      continue
    name = _name(req)
    if name not in _NOT_ON_WORKERS and name not in names:
      names.append(name)
  out = []
  for name in names:
    try:
      out.append(f"{name}=={importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
      raise UsageError(f"worker dependency {name} is not installed here; install the [pipelines] extra") from None
  return sorted(out)


@contextlib.contextmanager
def staging(options: PipelineOptions, common,
            extras: tuple[str, ...] = ("pipelines",)) -> Iterator[Callable[[], None]]:
  """`prepare`, then the block that submits the job; the local folder `prepare` made is removed at the end.

      with dataflow.staging(options, common, extras) as uploaded:
        result = p.run()   # the submission uploads the wheel and the requirements file
        uploaded()         # their local copies go now, not when the job (hours later) ends
        result.wait_until_finish()

  Args:
    options, common, extras: as in `prepare`.

  Yields:
    A callable that removes the folder at once (idempotent); the block's end removes it in any case.

  Raises:
    UsageError, RuntimeError: as in `prepare`, before the block runs.
  """
  folder = prepare(options, common, extras)

  def remove() -> None:
    if folder is not None:
      shutil.rmtree(folder, ignore_errors=True)

  try:
    yield remove
  finally:
    remove()


def prepare(options: PipelineOptions, common, extras: tuple[str, ...] = ("pipelines",)) -> str | None:
  """Checks the Dataflow flags and, unless the user chose otherwise, stages the toolkit.

  Args:
    options: the job's options; staging flags are added to them.
    common: the converter's `flags.CommonConfig` (its input and output must be gs://).
    extras: the pyproject extras the converter's workers need (`Converter.worker_extras`).

  Returns:
    The local folder holding the wheel and the requirements file, which the caller removes once the job is
    submitted (`staging`); None when nothing was built.

  Raises:
    UsageError: a Dataflow flag is missing or local, or the toolkit cannot be staged.
    RuntimeError: building the toolkit's wheel failed.
  """
  if not is_dataflow(options):
    return None
  check(options, common)
  # A shard plan made at launch travels inside the job's graph (ImageNet's: about 13 MB compressed);
  # Dataflow refuses a job request over 10 MB unless the graph is staged to GCS instead.
  options.view_as(DebugOptions).add_experiment("upload_graph")
  setup = options.view_as(SetupOptions)
  if (setup.setup_file or setup.extra_packages or setup.requirements_file
      or options.view_as(WorkerOptions).sdk_container_image):
    return None
  staging = tempfile.mkdtemp(prefix="toolkit-dataflow-")
  try:
    wheel = build_wheel(staging)
    requirements = os.path.join(staging, "requirements.txt")
    with open(requirements, "w") as f:
      f.write("".join(r + "\n" for r in worker_requirements(extras)))
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  setup.extra_packages = [wheel]
  setup.requirements_file = requirements
  if setup.requirements_cache is None:
    setup.requirements_cache = "skip"  # workers install from PyPI; nothing is downloaded here
  _log.info("staging %s and %s for the Dataflow workers", os.path.basename(wheel), requirements)
  return staging
