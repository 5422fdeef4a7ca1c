"""The layering the toolkit is built on, checked on what a fresh process imports."""

import subprocess
import sys


from tests.conftest import REPO


def _modules_after(code: str) -> set[str]:
  out = subprocess.run(
      [sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sys.modules))"],
      cwd=REPO, capture_output=True, text=True, check=True,
  ).stdout
  return {line.split(".")[0] for line in out.splitlines()}


def test_formats_imports_no_framework():
  mods = _modules_after("import formats, formats.inspect, formats.files, formats.tfds_metadata, formats.commit")
  assert not mods & {"apache_beam", "tensorflow", "tensorflow_datasets", "torch", "torch_xla", "pipelines", "loaders"}


def test_pipelines_do_not_import_loaders_or_tensorflow():
  mods = _modules_after("import pipelines.image_folder")
  assert not mods & {"loaders", "tensorflow", "torch"}


def test_loaders_do_not_import_pipelines_or_beam():
  mods = _modules_after("import loaders")
  assert not mods & {"pipelines", "apache_beam"}
