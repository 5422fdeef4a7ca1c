"""Writing and committing an output: where it goes (`OutputSpec`), one shard written and published
(`write_shard`), the input accounting and the manifest (`commit_records`), and the switch every output
ends with (`commit_output`; `CommitFiles` for whole-file outputs).

The record path that calls them is `pipelines.core.shards` (shards as work units); the commit protocol
itself is formats.outputs.commit (docs/manifest.md).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence
import dataclasses
import json
import logging
import os
from typing import Any

import apache_beam as beam

from formats import adapters, naming
from formats.outputs import commit
from formats.features import Features
from formats.manifest import (
    MANIFEST_FILENAME,
    REJECTED_FILENAME,
    Manifest,
    Rejected,
    ShardInfo,
    SplitInfo,
    sha256_file,
)
from formats.storage import files as fs
from pipelines.core import fileio
from pipelines.core.records import InputSummary, Reject

DEFAULT_TARGET_SHARD_BYTES = 128 << 20


@dataclasses.dataclass(frozen=True)
class OutputSpec:
  """Where and how an output is written. Validated on construction."""

  output: str
  name: str
  file_format: str
  features: Features
  splits: tuple[str, ...]
  num_shards: int = 0
  seed: int = 0
  target_shard_bytes: int = DEFAULT_TARGET_SHARD_BYTES
  description: str = ""
  source: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  warnings: tuple[str, ...] = ()
  # The run's generation folder and the manifest version its commit replaces (formats.outputs.commit.begin,
  # called by the launcher).
  generation: str = ""
  expected: commit.Version | None = None
  kind: str = ""  # the record kind (formats.kinds) the manifest records
  mode: str = "rebuild"  # rebuild, or append: new shards after the current output's (pipelines/core/shards.py)
  keep_replaced_seconds: float = commit.DEFAULT_KEEP_REPLACED_SECONDS  # clean-up's retention (--keep_replaced)
  fingerprint: str = ""  # OutputPlan.fingerprint: recorded with every shard, checked by an append
  reuse_shards: bool = True  # copy shards an earlier run of the same plan published (pipelines/core/reuse.py)

  def __post_init__(self):
    naming.check_dataset_name(self.name)
    for s in self.splits:
      naming.check_split_name(s)
    if self.file_format not in naming.FILE_FORMATS:
      raise ValueError(f"format must be one of {naming.FILE_FORMATS}, got {self.file_format!r}")
    if self.num_shards < 0:
      raise ValueError(f"num_shards must be >= 0 (0 = automatic), got {self.num_shards}")
    if self.target_shard_bytes <= 0:
      raise ValueError(f"target_shard_bytes must be > 0, got {self.target_shard_bytes}")

  def reuse_settings(self) -> dict:
    """What of this spec shapes a shard's bytes besides its units: part of every shard's plan digest.

    Returns:
      The settings, JSON-able (the output folder, generation and expected version left out).
    """
    return {"name": self.name, "file_format": self.file_format, "features": self.features.to_json(),
            "num_shards": self.num_shards, "seed": self.seed, "target_shard_bytes": self.target_shard_bytes,
            "source": dict(self.source), "kind": self.kind}

  def shard_name(self, split: str, index: int, num_shards: int) -> naming.ShardName:
    """The name of one shard of `split` (`naming.ShardName`).

    Args:
      split: the split's name.
      index: the shard's index, from 0.
      num_shards: the split's number of shards.

    Returns:
      The `naming.ShardName`.
    """
    return naming.ShardName(self.name, split, self.file_format, index, num_shards)

  def relative(self, name: str) -> str:
    """Path of a data file of this run, relative to the output root.

    Args:
      name: the file's name (a shard name, the rejects file).

    Returns:
      `generation/name`, or `name` when the spec has no generation.
    """
    return f"{self.generation}/{name}" if self.generation else name


def write_shard(spec: OutputSpec, split: str, index: int, num_shards: int, payloads: Iterable[bytes]) -> ShardInfo:
  """Writes one shard locally, hashes it and publishes it to the output in one atomic step.

  Args:
    spec: the output.
    split: the shard's split.
    index: its index in [0, num_shards).
    num_shards: the split's shard count (part of the name).
    payloads: the records, in order (an iterator is written as it yields: nothing is published
      when it raises).

  Returns:
    The shard's manifest entry (path relative to the output, records, bytes, SHA-256).
  """
  name = spec.relative(spec.shard_name(split, index, num_shards).filename)
  dest = fs.join(spec.output, name)
  with fileio.staged(dest) as local:
    count = adapters.get(spec.file_format).write_file(local, payloads)
    size = os.path.getsize(local)
    digest = sha256_file(local)
  return ShardInfo(name, count, size, digest)


def commit_records(spec: OutputSpec, splits: Mapping[str, SplitInfo], all_splits, rejects: Sequence[Reject],
                   summary: InputSummary | None, used: int, warnings: Sequence[str] = ()) -> Manifest:
  """The end of a record output: the input accounting, then the manifest committed (`commit_output`).

  Args:
    spec: the output.
    splits: the splits that hold records, with their shards.
    all_splits: every split planned or expected; those without records get the manifest's warning.
    rejects: every reject (the launcher's included).
    summary: the input units found (None: not checked).
    used: the input units the records were made from (appending: adjusted for what was carried and skipped).
    warnings: more warnings for the manifest (an append's changed and vanished inputs).

  Returns:
    The committed manifest.

  Raises:
    RuntimeError: records + rejects do not account for every input unit found.
  """
  # TFDS cannot open a split without records (a split of one empty shard file is refused by
  # both as_data_source and as_dataset), so neither the manifest nor the metadata lists one.
  empty = sorted(set(all_splits) - set(splits))
  empty_warning = (f"empty splits left out: {', '.join(empty)} (no records)",) if empty else ()
  rejects = sorted(rejects)
  rejected_units = sum(r.units for r in rejects)
  if summary is not None and used + rejected_units != summary.num_inputs:
    raise RuntimeError(
        f"{summary.num_inputs} input units but {used} in records + {rejected_units} rejected: "
        "an input was lost or counted twice"
    )
  by_reason = collections.Counter(r.reason.split(":")[0] for r in rejects)
  manifest = Manifest(
      name=spec.name,
      file_format=spec.file_format,
      features=spec.features,
      splits=dict(splits),
      rejected=Rejected(len(rejects), dict(by_reason), spec.relative(REJECTED_FILENAME)),
      source=spec.source,
      warnings=(tuple(spec.warnings) + tuple(sorted(summary.warnings if summary else ())) + tuple(warnings)
                + empty_warning),
      kind=spec.kind,
  )
  commit_output(spec, manifest, rejects)
  return manifest


def commit_output(spec: OutputSpec, manifest: Manifest, rejects: Sequence[Reject]) -> None:
  """The end of every run: errors/rejected.jsonl, the switch to `manifest`, the TFDS view, clean-up.

  The one commit path of all converters (formats.outputs.commit, docs/manifest.md).

  Args:
    spec: the output (its folder, generation, expected manifest version, description).
    manifest: the manifest to switch to; its data files are already published.
    rejects: the rejects, written to errors/rejected.jsonl first.

  Raises:
    commit.CommitConflict: another run switched the manifest first (this run loses the race).
  """
  out = spec.output
  commit.fault_point("finalize:start")
  fs.write_bytes(
      fs.join(out, manifest.rejected.path),
      b"".join(json.dumps(r.to_json(), sort_keys=True).encode() + b"\n" for r in rejects),
  )
  commit.fault_point("finalize:rejects_written")
  replaced = commit.commit(out, spec.generation, manifest, spec.expected)  # the switch
  logging.info("committed %s (generation %s)", fs.join(out, MANIFEST_FILENAME), spec.generation)
  commit.sync_tfds_metadata(out, spec.description)  # a no-op for file outputs: they have no TFDS view
  commit.cleanup(out, replaced=replaced, log=logging.info, keep_replaced_seconds=spec.keep_replaced_seconds)


class _CommitFilesFn(beam.DoFn):
  """The published files of a file converter → the manifest, committed like any output."""

  def __init__(self, spec: OutputSpec, graph):
    self._spec = spec
    self._graph = graph

  def process(self, _, infos):
    spec = self._spec
    manifest = Manifest(
        name=spec.name, file_format=infos[0].kind if infos else spec.file_format, features=spec.features,
        splits={}, source=spec.source, files=tuple(sorted(infos, key=lambda f: f.path)),
        rejected=Rejected(0, {}, spec.relative(REJECTED_FILENAME)), graph=self._graph, kind=spec.kind)
    commit_output(spec, manifest, ())
    yield manifest.to_json()


class CommitFiles(beam.PTransform):
  """PCollection[FileInfo] (files published in the run's generation) → the committed manifest.

  For converters whose output is whole files (a `.graphbin`) rather than record shards.
  """

  def __init__(self, spec: OutputSpec, graph=None):
    super().__init__()
    self._spec = spec
    self._graph = graph

  def expand(self, infos):
    return (infos.pipeline
            | "CommitTrigger" >> beam.Create([None])
            | "CommitManifest" >> beam.ParDo(_CommitFilesFn(self._spec, self._graph), infos=beam.pvalue.AsList(infos)))
