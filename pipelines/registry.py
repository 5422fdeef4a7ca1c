"""The converters this toolkit has: one entry each, read by everything that lists them.

The CLIs (`python -m pipelines.<name>`), the Airflow DAG factory
(scheduling.airflow_dags), Dataflow packaging and the Docker image check
(`python -c "from pipelines import registry; registry.check()"`), and the tests that run every
converter all read `CONVERTERS`. Plain data, no Beam import: a scheduler can
read it without loading the converters. Adding a converter is one line here
and a subpackage `pipelines/<name>/` whose `__init__` defines `CONVERTER`
(docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class Entry:
  """One converter: its name (`python -m pipelines.<name>`), one line on what it converts,
  and the third-party modules its workers import (checked in the Docker image)."""

  name: str
  summary: str
  worker_imports: tuple[str, ...] = ()

  @property
  def module(self) -> str:
    """The converter's package, `pipelines.<name>`."""
    return f"pipelines.{self.name}"


CONVERTERS: dict[str, Entry] = {e.name: e for e in (
    Entry("image_folder", "image folders (ImageNet style) → ArrayRecord/TFRecord shards", ("PIL",)),
    Entry("ct_volumes", "DICOM CT series → Hounsfield-unit volumes in shards",
          ("pydicom", "gdcm", "openjpeg", "jpeg_ls")),
    Entry("ogb_graphs", "Open Graph Benchmark data sets → .graphbin CSR blobs or graph shards",
          ("pandas", "scipy")),
    Entry("array_folder", "folders of NumPy .npy arrays → ArrayRecord/TFRecord shards", ("numpy",)),
    Entry("audio_folder", "folders of WAV clips → fixed-length audio in ArrayRecord/TFRecord shards", ("numpy",)),
)}


def names() -> tuple[str, ...]:
  """The registered converters' names.

  Returns:
    The names, in registry order.
  """
  return tuple(CONVERTERS)


def converter(name: str):
  """The converter object (`pipelines.core.Converter`) registered as `name`; imports it.

  Args:
    name: a key of `CONVERTERS`.

  Returns:
    The subpackage's `CONVERTER`.

  Raises:
    KeyError: no converter has that name.
  """
  if name not in CONVERTERS:
    raise KeyError(f"no converter {name!r}; the registry has {', '.join(CONVERTERS)}")
  return importlib.import_module(CONVERTERS[name].module).CONVERTER


def check() -> None:
  """Imports every converter and its workers' modules; a converter whose object disagrees with
  its entry, or a missing worker dependency, raises (the Docker image runs this at build time).

  Raises:
    RuntimeError: a subpackage's `CONVERTER` has another name than its entry.
    ImportError: a converter or one of its workers' modules cannot be imported.
  """
  for entry in CONVERTERS.values():
    c = converter(entry.name)
    if c.name != entry.name:
      raise RuntimeError(f"{entry.module}.CONVERTER is named {c.name!r}, not {entry.name!r}")
    for module in entry.worker_imports:
      importlib.import_module(module)

