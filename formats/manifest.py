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
import math
import re
from typing import Any

from formats import kinds, naming
from formats.features import Features

MANIFEST_FILENAME = "manifest.json"
MANIFEST_VERSION = 1
ERRORS_DIR = "errors"
REJECTED_FILENAME = "errors/rejected.jsonl"
# Sharded record outputs, plus the single-file graph blob.
OUTPUT_FORMATS = (*naming.FILE_FORMATS, "graphbin")
# What a manifest may claim (it is untrusted input: outputs live in buckets others can write to).
MAX_PATH_BYTES = 1024  # a data file's path, relative to the output (GCS's longest object name)
MAX_NAME_LENGTH = 128  # dataset, split and feature names
MAX_COUNT = 2**63 - 1  # records, bytes and nodes: int64
MAX_TENSOR_DIMS = 32
MAX_TENSOR_ELEMENTS = 2**62
TENSOR_DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
                 "float32", "float64")
# Or numpy's explicit form of one of them ("<i4", ">f8", "|u1"): a converter may declare a byte order.
_TENSOR_DTYPE_CODE_RE = re.compile(r"[<>=]?[iuf][248]|[<>=|]?[iub]1")
_FEATURE_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,%d}$" % MAX_NAME_LENGTH)
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def check_path(field: str, path: Any) -> str:
  """Checks that a path a manifest names stays inside its output.

  A data file's path is relative to the output root, normalised and plain:
  segments of printable characters separated by single '/', none of them
  '.' or '..', no leading '/', no backslash and no ':' (no scheme such as
  gs:// or file:, no drive), at most MAX_PATH_BYTES bytes of UTF-8.

      check_path("rejected.path", "gen-20260101T000000-0123abcd/errors/rejected.jsonl")

  Args:
    field: where the manifest holds it, for the message ("splits.train.shards[3].path").
    path: the value.

  Returns:
    `path`.

  Raises:
    ValueError: "manifest <field>: path <path> <why>: ...".
  """
  if not isinstance(path, str):
    raise ValueError(f"manifest {field}: expected a relative path, found {path!r}")
  why = None
  if not path:
    why = "is empty"
  elif len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
    why = f"is longer than {MAX_PATH_BYTES} bytes"
  elif any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in path):
    why = "holds a control character"
  elif path.startswith("/"):
    why = "is absolute"
  elif ":" in path:
    why = "has a ':' (a scheme or drive)"
  elif "\\" in path:
    why = "has a backslash"
  elif any(seg in ("", ".", "..") for seg in path.split("/")):
    why = "is not normalised (an empty, '.' or '..' segment)"
  if why:
    raise ValueError(f"manifest {field}: path {path!r:.200} {why}: a manifest names files inside its output only, "
                     f"by relative, normalised paths")
  return path


def _count(field: str, value: Any) -> int:
  if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT:
    raise ValueError(f"manifest {field}: expected a non-negative integer, found {value!r:.100}")
  return value


def _sha256(field: str, value: Any) -> str:
  if not isinstance(value, str) or not _SHA256_RE.match(value):
    raise ValueError(f"manifest {field}: expected 64 lowercase hex digits, found {value!r:.100}")
  return value


def _typed(field: str, value: Any, kind: type, name: str) -> Any:
  if not isinstance(value, kind):
    raise ValueError(f"manifest {field}: expected {name}, found {type(value).__name__}")
  return value


def _strings(field: str, value: Any) -> list[str]:
  if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
    raise ValueError(f"manifest {field}: expected a list of strings, found {value!r:.200}")
  return value


def _entry(cls: type, field: str, d: Any, checks: Mapping[str, Any]) -> Any:
  """A dataclass entry from its JSON object: known fields only, each checked."""
  _typed(field, d, dict, "an object")
  known = {f.name for f in dataclasses.fields(cls)}
  for key in d:
    if key not in known:
      raise ValueError(f"manifest {field}: unknown field {key!r:.100}")
  required = [f.name for f in dataclasses.fields(cls)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
  missing = [k for k in required if k not in d]
  if missing:
    raise ValueError(f"manifest {field}: missing field {missing[0]!r}")
  values = {k: checks[k](f"{field}.{k}", v) if k in checks else v for k, v in d.items()}
  return cls(**values)


def _check_features(d: Any) -> Any:
  """The claims of manifest.json's `features` that the feature classes do not check themselves."""
  _typed("features", d, dict, "an object")
  for name, spec in d.items():
    field = f"features.{name}"
    _typed(field, spec, dict, "an object")
    kind = spec.get("kind")
    if kind in ("tensor", "image"):
      shape = spec.get("shape")
      if not isinstance(shape, list) or not all(
          v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT) for v in shape):
        raise ValueError(f"manifest {field}.shape: expected a list of non-negative integers or null, "
                         f"found {shape!r:.200}")
      if len(shape) > MAX_TENSOR_DIMS:
        raise ValueError(f"manifest {field}.shape: expected at most {MAX_TENSOR_DIMS} dimensions, found {len(shape)}")
      elements = math.prod(v for v in shape if v is not None)
      if elements > MAX_TENSOR_ELEMENTS:
        raise ValueError(f"manifest {field}.shape: expected at most 2**62 elements, found {elements}")
    dtype = spec.get("dtype")
    if kind == "tensor" and dtype not in TENSOR_DTYPES and not (
        isinstance(dtype, str) and _TENSOR_DTYPE_CODE_RE.fullmatch(dtype)):
      raise ValueError(f"manifest {field}.dtype: expected one of {', '.join(TENSOR_DTYPES)} (or numpy's code for "
                       f"one, such as '<i4'), found {dtype!r:.100}")
    if kind == "class_label":
      names = _strings(f"{field}.names", spec.get("names"))
      if "num_classes" in spec and spec["num_classes"] != len(names):
        raise ValueError(f"manifest {field}.num_classes: {spec['num_classes']!r:.100} disagrees with its "
                         f"{len(names)} names")
  return d


def check_name(what: str, name: str) -> str:
  """Checks that a dataset, split or feature name is short (MAX_NAME_LENGTH characters).

  Args:
    what: "dataset", "split" or "feature".
    name: the name.

  Returns:
    `name`.

  Raises:
    ValueError: it is longer.
  """
  if len(name) > MAX_NAME_LENGTH:
    raise ValueError(f"{what} name {name!r:.60} is longer than {MAX_NAME_LENGTH} characters")
  return name


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
  kind: str = ""  # the record kind (formats.kinds); "" when the manifest records none (kinds.kind_of infers it)

  def __post_init__(self):
    if not isinstance(self.name, str):
      raise ValueError(f"dataset name must be a string, got {self.name!r:.100}")
    naming.check_dataset_name(check_name("dataset", self.name))
    if self.file_format not in OUTPUT_FORMATS:
      raise ValueError(f"format must be one of {OUTPUT_FORMATS}, got {self.file_format!r:.100}")
    for name in self.features:
      if not isinstance(name, str) or not _FEATURE_NAME_RE.match(name) or name in (".", ".."):
        raise ValueError(f"feature name {name!r:.200} must be 1..{MAX_NAME_LENGTH} letters, digits, '_', '.' or '-'")
    if self.kind:
      kinds.check(self.kind, self.features)
    for split in self.splits:
      naming.check_split_name(check_name("split", split))

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
      ValueError: an unknown version; a path that leaves the output (`check_path`) or is listed
        twice; a count that is not a non-negative integer or disagrees with its parts; a digest
        that is not 64 lowercase hex digits; an unknown field, dtype or shape; a name too long or
        of other characters; features that do not fit the kind. The message names the field.
      KeyError: a required field is missing.
    """
    if not isinstance(d, dict):
      raise ValueError(f"manifest.json: expected a JSON object, found {type(d).__name__}")
    version = d.get("manifest_version")
    if version != MANIFEST_VERSION:
      raise ValueError(f"manifest_version {version!r:.100} is not supported (expected {MANIFEST_VERSION})")
    shard_checks = {"path": check_path, "num_records": _count, "num_bytes": _count, "sha256": _sha256}
    splits = {}
    for name, split in _typed("splits", d["splits"], dict, "an object").items():
      field = f"splits.{name}"
      _typed(field, split, dict, "an object")
      shards = _typed(f"{field}.shards", split["shards"], list, "a list")
      info = splits[name] = SplitInfo(tuple(_entry(ShardInfo, f"{field}.shards[{i}]", s, shard_checks)
                                            for i, s in enumerate(shards)))
      for key, total in (("num_records", info.num_records), ("num_bytes", info.num_bytes)):
        if total > MAX_COUNT:  # each shard's count fits; their sum must too (len() of the split)
          raise ValueError(f"manifest {field}.{key}: its shards' sum, {total}, is over {MAX_COUNT}")
        if key in split and split[key] != total:
          raise ValueError(f"manifest {field}.{key}: {split[key]!r:.100} disagrees with its shards' sum, {total}")
    rej = _typed("rejected", d.get("rejected", {}), dict, "an object")
    by_reason = _typed("rejected.by_reason", rej.get("by_reason", {}), dict, "an object")
    for reason, n in by_reason.items():
      _count(f"rejected.by_reason[{reason!r:.100}]", n)
    rejected = Rejected(_count("rejected.count", rej.get("count", 0)), by_reason,
                        check_path("rejected.path", rej.get("path", REJECTED_FILENAME)))
    file_checks = {"path": check_path, "num_bytes": _count, "sha256": _sha256}
    data_files = tuple(_entry(FileInfo, f"files[{i}]", f, file_checks)
                       for i, f in enumerate(_typed("files", d.get("files", []), list, "a list")))
    graph = d.get("graph")
    if graph is not None:
      _typed("graph", graph, dict, "an object")
      for key in ("num_nodes", "num_edges"):
        counts = graph.get(key, {})
        for t, n in (counts.items() if isinstance(counts, dict) else [("", counts)]):
          _count(f"graph.{key}[{t!r:.100}]", n)
    _check_unique_paths(splits, rejected, data_files)
    return cls(
        name=d["name"],
        file_format=d["format"],
        features=Features.from_json(_check_features(d["features"])),
        splits=splits,
        rejected=rejected,
        source=_typed("source", d.get("source", {}), dict, "an object"),
        warnings=tuple(_strings("warnings", d.get("warnings", []))),
        files=data_files,
        graph=graph,
        kind=_typed("kind", d.get("kind", ""), str, "a string"),
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
    try:
      d = json.loads(data)
    except RecursionError:
      raise ValueError("manifest.json is not JSON (nested too deeply)") from None
    return cls.from_json(d)


def _check_unique_paths(splits: Mapping[str, SplitInfo], rejected: Rejected, data_files: tuple[FileInfo, ...]) -> None:
  """No split lists a shard twice, and no data file is also another file or the rejected list.

  Two splits may name the same path: the SHA-256 each claims for it is what proves (or refutes) it
  at the default verification level, and "size"/"none" take the manifest's paths on trust.
  """
  other = [(f"files[{i}].path", f.path) for i, f in enumerate(data_files)] + [("rejected.path", rejected.path)]
  _unique(other)
  for name, split in sorted(splits.items()):
    _unique([(f"splits.{name}.shards[{i}].path", s.path) for i, s in enumerate(split.shards)] + other)


def _unique(named: list[tuple[str, str]]) -> None:
  seen: dict[str, str] = {}
  for field, path in named:
    if path in seen:
      raise ValueError(f"manifest {field}: path {path!r} is also {seen[path]}")
    seen[path] = field
