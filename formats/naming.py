"""Shard file names, produced and parsed in one place.

The names are the ones TFDS writes (``core/naming.py``)::

    {name}-{split}.{file_format}-{index:05d}-of-{num_shards:05d}
    imagenette-train.array_record-00003-of-00016

so that ``tfds.builder_from_directory`` finds the shards of an output
without a custom template.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import uuid

FILE_FORMATS = ("array_record", "tfrecord")

# TFDS's own template string, stored in dataset_info.json as `filepathTemplate`.
TFDS_FILEPATH_TEMPLATE = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"

_NAME_RE = re.compile(r"^[A-Za-z0-9_]+(?:[A-Za-z0-9_.]*[A-Za-z0-9_])?$")
_SPLIT_RE = re.compile(r"^[A-Za-z0-9_]+$")
_SHARD_RE = re.compile(
    r"^(?P<name>.+)-(?P<split>[A-Za-z0-9_]+)\.(?P<file_format>array_record|tfrecord)"
    r"-(?P<index>\d{5,})-of-(?P<num_shards>\d{5,})$"
)


def check_dataset_name(name: str) -> str:
  """Returns `name` if it can be a dataset name, else raises ValueError."""
  if not _NAME_RE.match(name) or "-" in name:
    raise ValueError(
        f"dataset name {name!r} must use letters, digits, '_' and '.' only"
        " (TFDS splits shard names on '-')"
    )
  return name


def check_split_name(split: str) -> str:
  """Returns `split` if it can be a split name, else raises ValueError."""
  if not _SPLIT_RE.match(split):
    raise ValueError(f"split name {split!r} must use letters, digits and '_' only")
  return split


@dataclasses.dataclass(frozen=True, order=True)
class ShardName:
  """One shard of one split: formats itself to, and parses from, a file name.

  >>> str(ShardName("cats", "train", "tfrecord", 0, 4))
  'cats-train.tfrecord-00000-of-00004'
  >>> ShardName.parse("cats-train.tfrecord-00000-of-00004").num_shards
  4
  """

  name: str
  split: str
  file_format: str
  index: int
  num_shards: int

  def __post_init__(self):
    check_dataset_name(self.name)
    check_split_name(self.split)
    if self.file_format not in FILE_FORMATS:
      raise ValueError(
          f"file_format must be one of {FILE_FORMATS}, got {self.file_format!r}"
      )
    if not 0 <= self.index < self.num_shards:
      raise ValueError(
          f"shard index {self.index} is outside [0, {self.num_shards})"
      )

  def __str__(self) -> str:
    return (
        f"{self.name}-{self.split}.{self.file_format}"
        f"-{self.index:05d}-of-{self.num_shards:05d}"
    )

  @property
  def filename(self) -> str:
    return str(self)

  @classmethod
  def parse(cls, filename: str) -> ShardName:
    """Parses a bare file name (no folder); raises ValueError if it is not a shard."""
    m = _SHARD_RE.match(filename)
    if not m:
      raise ValueError(f"{filename!r} is not a shard name ({TFDS_FILEPATH_TEMPLATE})")
    return cls(
        name=m["name"],
        split=m["split"],
        file_format=m["file_format"],
        index=int(m["index"]),
        num_shards=int(m["num_shards"]),
    )

  @classmethod
  def is_shard_of(cls, filename: str, name: str, file_format: str | None = None) -> bool:
    """True if `filename` is a shard of dataset `name` (any split, any count)."""
    try:
      shard = cls.parse(filename)
    except ValueError:
      return False
    return shard.name == name and (file_format is None or shard.file_format == file_format)

  @classmethod
  def all_of(cls, name: str, split: str, file_format: str, num_shards: int) -> list[ShardName]:
    """Every shard name of one split, in order."""
    return [cls(name, split, file_format, i, num_shards) for i in range(num_shards)]


GENERATION_PREFIX = "gen-"


def new_generation() -> str:
  """A fresh folder name for one run's data files: `gen-<UTC time>-<random>`.

  Every run writes its shards into its own generation folder and switches the
  output over by writing manifest.json last, so a re-run never touches the files
  the current manifest points at; older generations are removed afterwards.
  """
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
  return f"{GENERATION_PREFIX}{now}-{uuid.uuid4().hex[:8]}"


def is_generation(name: str) -> bool:
  return name.startswith(GENERATION_PREFIX)
