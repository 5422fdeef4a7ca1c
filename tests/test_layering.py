"""The layering the toolkit is built on: formats at the bottom; pipelines and loaders on it, never on
each other; scripts/ and tests/ on top, imported by none of them; TensorFlow never on the torch_xla
path. Checked twice: statically, on every import statement of every module, and dynamically, on what a
fresh process has loaded after importing every module of a package."""

from __future__ import annotations

import ast
import os
import pkgutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

FRAMEWORKS = {"apache_beam", "tensorflow", "tensorflow_datasets", "torch", "torch_xla", "grain", "jax"}
# The command-line programs and the tests (both packages) stand on the library, never under it.
PROGRAMS = {"scripts", "tests"}
# package -> top-level modules none of its modules may import
FORBIDDEN = {
    "formats": FRAMEWORKS | PROGRAMS | {"pipelines", "loaders", "scheduling"},
    "pipelines": PROGRAMS | {"loaders", "scheduling", "tensorflow", "tensorflow_datasets", "torch", "torch_xla",
                             "grain"},
    "loaders": PROGRAMS | {"pipelines", "scheduling", "apache_beam"},
    "scheduling": PROGRAMS | {"loaders", "apache_beam"},
}
# The one deliberate exception: OGB's link-prediction splits are torch .pt files, read lazily
# with weights_only=True when a data set has them.
ALLOWED = {("pipelines.ogb_graphs.read", "torch")}
# modules that run in the same process as torch_xla: never TensorFlow (both bundle LLVM)
TORCH_XLA_PATH = ("loaders", "loaders.xla", "loaders.graph", "loaders.grain", "loaders._batch", "loaders._device",
                  "loaders._graph_file", "loaders._sampler", "loaders._shards", "loaders._transforms")


def _modules(package: str) -> list[str]:
  """Every module of `package`, found on disk (subpackages included)."""
  root = os.path.join(REPO, package)
  out = [package]
  for info in pkgutil.walk_packages([root], prefix=package + "."):
    if not info.name.endswith("__main__"):
      out.append(info.name)
  return sorted(out)


def _imports(module: str) -> set[str]:
  """Top-level names of everything `module`'s source imports, at any depth (lazy imports too)."""
  parts = module.split(".")
  path = os.path.join(REPO, *parts)
  path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names.add(node.module.split(".")[0])
  return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_module_imports_across_the_layers(package):
  modules = _modules(package)
  assert len(modules) > 1, f"found no modules of {package}"
  bad = {m: sorted(n for n in _imports(m) & FORBIDDEN[package] if (m, n) not in ALLOWED) for m in modules}
  assert not {m: b for m, b in bad.items() if b}


def test_nothing_on_the_torch_xla_path_imports_tensorflow():
  bad = {m: sorted(_imports(m) & {"tensorflow", "tensorflow_datasets"}) for m in TORCH_XLA_PATH}
  assert not {m: b for m, b in bad.items() if b}


def _loaded_after_importing(modules: list[str]) -> set[str]:
  code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
  code += "print('\\n'.join(sys.modules))"
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
  return {line.split(".")[0] for line in out.splitlines()}


@pytest.mark.slow  # a fresh process per check: the static check above is the fast one
def test_formats_loads_no_framework():
  assert not _loaded_after_importing(_modules("formats")) & FORBIDDEN["formats"]


@pytest.mark.slow
def test_pipelines_load_neither_loaders_nor_tensorflow_nor_torch():
  assert not _loaded_after_importing(_modules("pipelines")) & FORBIDDEN["pipelines"]


@pytest.mark.slow
def test_loaders_framework_free_modules_load_neither_pipelines_nor_beam():
  framework_modules = {"loaders.tfdata", "loaders.xla", "loaders.grain", "loaders.jax"}  # each pulls in its own
  modules = [m for m in _modules("loaders") if m not in framework_modules]
  assert not _loaded_after_importing(modules) & (FORBIDDEN["loaders"] | {"tensorflow", "torch"})


@pytest.mark.slow
def test_the_jax_loader_loads_neither_tensorflow_nor_torch():
  assert not _loaded_after_importing(["loaders.jax"]) & (FORBIDDEN["loaders"] | {"tensorflow", "torch"})
