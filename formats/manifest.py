"""`manifest.json`: what a finished output holds. Written last; its presence
means the output is complete. The schema is documented in docs/manifest.md.

    {
      "manifest_version": 1,
      "name": "flowers", "format": "array_record", "kind": "image",
      "features": {"image": {"kind": "image", ...}, "label": {...}, ...},
      "splits": {"train": {"num_records": 1200, "num_bytes": 91234567,
                           "shards": [{"path": "flowers-train.array_record-00000-of-00004",
                                       "num_records": 300, "num_bytes": 22800000,
                                       "sha256": "ab12..."}, ...]}},
      "rejected": {"count": 3, "path": "errors/rejected.jsonl", "by_reason": {...}},
      "source": {"pipeline": "pipelines.image_folder", "input": "...", "options": {...}}
    }
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import hashlib
import json
from typing import Any

from formats import kinds, naming
from formats.features import Features

MANIFEST_FILENAME = "manifest.json"
MANIFEST_VERSION = 1
ERRORS_DIR = "errors"
REJECTED_FILENAME = "errors/rejected.jsonl"
# Sharded record outputs, plus the single-file graph blob.
OUTPUT_FORMATS = (*naming.FILE_FORMATS, "graphbin")


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
  """The hex SHA-256 of a local file, read in chunks.

  Args:
    path: a local file.
    chunk: bytes read at a time.

  Returns:
    The hex digest.
  """
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(chunk):
      h.update(block)
  return h.hexdigest()


class _FieldsAsJson:
  """A manifest entry whose JSON object is its dataclass fields, in order (read back as `cls(**d)`)."""

  def to_json(self) -> dict:
    """This entry in manifest.json.

    Returns:
      Its fields by name, in declaration order.
    """
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ShardInfo(_FieldsAsJson):
  """One shard as the manifest lists it."""

  path: str  # relative to the output root
  num_records: int
  num_bytes: int
  sha256: str


@dataclasses.dataclass(frozen=True)
class FileInfo(_FieldsAsJson):
  """A data file that is not a shard (e.g. the .graphbin of a graph output)."""

  path: str  # relative to the output root
  num_bytes: int
  sha256: str
  kind: str  # "graphbin"


@dataclasses.dataclass(frozen=True)
class SplitInfo:
  """The shards of one split, in index order."""

  shards: tuple[ShardInfo, ...]

  @property
  def num_records(self) -> int:
    """Records in the split (the sum over its shards)."""
    return sum(s.num_records for s in self.shards)

  @property
  def num_bytes(self) -> int:
    """Bytes of the split's shard files."""
    return sum(s.num_bytes for s in self.shards)

  @property
  def shard_lengths(self) -> list[int]:
    """Records per shard, in index order."""
    return [s.num_records for s in self.shards]

  def to_json(self) -> dict:
    """This split's entry in manifest.json.

    Returns:
      The split's entry in manifest.json.
    """
    return {
        "num_records": self.num_records,
        "num_bytes": self.num_bytes,
        "shards": [s.to_json() for s in self.shards],
    }


@dataclasses.dataclass(frozen=True)
class Rejected:
  """The inputs that did not become records: how many, why, and the file listing them."""

  count: int = 0
  by_reason: Mapping[str, int] = dataclasses.field(default_factory=dict)
  path: str = REJECTED_FILENAME

  def to_json(self) -> dict:
    """The `rejected` entry of manifest.json.

    Returns:
      The `rejected` entry of manifest.json.
    """
    return {"count": self.count, "path": self.path, "by_reason": dict(sorted(self.by_reason.items()))}


@dataclasses.dataclass(frozen=True)
class Manifest:
  """What a finished output holds (manifest.json; the schema is in docs/manifest.md).

  Raises (on construction):
    ValueError: a bad name, format or split name, or features that do not fit `kind`.
  """

  name: str
  file_format: str
  features: Features
  splits: Mapping[str, SplitInfo]
  rejected: Rejected = Rejected()
  source: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  warnings: tuple[str, ...] = ()
  files: tuple[FileInfo, ...] = ()  # non-shard data files
  graph: Mapping[str, Any] | None = None  # graph outputs: layout, node and edge counts
  kind: str = ""  # the record kind (formats.kinds); "" in manifests written before kinds existed

  def __post_init__(self):
    naming.check_dataset_name(self.name)
    if self.file_format not in OUTPUT_FORMATS:
      raise ValueError(f"format must be one of {OUTPUT_FORMATS}, got {self.file_format!r}")
    if self.kind:
      kinds.check(self.kind, self.features)
    for split in self.splits:
      naming.check_split_name(split)

  @property
  def num_records(self) -> int:
    """Records in every split."""
    return sum(s.num_records for s in self.splits.values())

  def to_json(self) -> dict:
    """The manifest as a JSON object.

    Returns:
      The manifest as a JSON object (`kind` only when set).
    """
    return {
        "manifest_version": MANIFEST_VERSION,
        "name": self.name,
        "format": self.file_format,
        **({"kind": self.kind} if self.kind else {}),
        "features": self.features.to_json(),
        "splits": {k: v.to_json() for k, v in sorted(self.splits.items())},
        "rejected": self.rejected.to_json(),
        "warnings": list(self.warnings),
        "source": dict(self.source),
        **({"files": [f.to_json() for f in self.files]} if self.files else {}),
        **({"graph": dict(self.graph)} if self.graph is not None else {}),
    }

  def dumps(self) -> bytes:
    """The bytes of manifest.json (indented JSON, one trailing newline).

    Returns:
      The bytes of manifest.json.
    """
    return (json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n").encode("utf-8")

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> Manifest:
    """The manifest from parsed manifest.json.

    Args:
      d: the parsed JSON.

    Returns:
      The manifest.

    Raises:
      ValueError: an unknown version, counts that disagree, or features that do not fit the kind.
      KeyError: a required field is missing.
    """
    version = d.get("manifest_version")
    if version != MANIFEST_VERSION:
      raise ValueError(f"manifest_version {version!r} is not supported (expected {MANIFEST_VERSION})")
    splits = {
        name: SplitInfo(tuple(ShardInfo(**s) for s in split["shards"]))
        for name, split in d["splits"].items()
    }
    for name, split in d["splits"].items():
      if split["num_records"] != splits[name].num_records:
        raise ValueError(f"manifest split {name!r}: num_records disagrees with its shards")
    rej = d.get("rejected", {})
    return cls(
        name=d["name"],
        file_format=d["format"],
        features=Features.from_json(d["features"]),
        splits=splits,
        rejected=Rejected(rej.get("count", 0), rej.get("by_reason", {}), rej.get("path", REJECTED_FILENAME)),
        source=d.get("source", {}),
        warnings=tuple(d.get("warnings", ())),
        files=tuple(FileInfo(**f) for f in d.get("files", ())),
        graph=d.get("graph"),
        kind=d.get("kind", ""),
    )

  @classmethod
  def loads(cls, data: bytes | str) -> Manifest:
    """The manifest from the bytes of manifest.json.

    Args:
      data: the file's content.

    Returns:
      The manifest.

    Raises:
      ValueError: malformed JSON or an invalid manifest (see `from_json`).
      KeyError: a required field is missing.
    """
    return cls.from_json(json.loads(data))
