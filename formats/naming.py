"""Shard file names, produced and parsed in one place.

The names are the ones TFDS writes (``core/naming.py``)::

    {name}-{split}.{file_format}-{index:05d}-of-{num_shards:05d}
    imagenette-train.array_record-00003-of-00016

so that ``tfds.builder_from_directory`` finds the shards of an output
without a custom template. `ShardName` formats and parses them;
`ShardName.pattern` gives the glob of one split's shards and `tfds_template`
the template TFDS stores in dataset_info.json: no other code formats shard
names by hand. The file formats are those of `formats.adapters`.
"""

from __future__ import annotations

import dataclasses
import datetime
import posixpath
import re
import uuid

from formats import adapters

# The record file formats, the default first: one per entry of the adapter table.
FILE_FORMATS = tuple(adapters.ADAPTERS)

# TFDS's own template string, stored in dataset_info.json as `filepathTemplate`.
TFDS_FILEPATH_TEMPLATE = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"

_NAME_RE = re.compile(r"^[A-Za-z0-9_]+(?:[A-Za-z0-9_.]*[A-Za-z0-9_])?$")
_SPLIT_RE = re.compile(r"^[A-Za-z0-9_]+$")
_SHARD_RE = re.compile(
    r"^(?P<name>.+)-(?P<split>[A-Za-z0-9_]+)\.(?P<file_format>"
    + "|".join(re.escape(adapters.ADAPTERS[f].suffix) for f in FILE_FORMATS) + ")"
    r"-(?P<index>\d{5,})-of-(?P<num_shards>\d{5,})$"
)
_FORMAT_OF_SUFFIX = {adapters.ADAPTERS[f].suffix: f for f in FILE_FORMATS}


def check_dataset_name(name: str) -> str:
  """Checks that `name` can be a dataset name (the first part of every shard name).

  Args:
    name: the dataset name.

  Returns:
    `name`.

  Raises:
    ValueError: it has characters other than letters, digits, '_' and '.'.
  """
  if not _NAME_RE.match(name) or "-" in name:
    raise ValueError(
        f"dataset name {name!r} must use letters, digits, '_' and '.' only"
        " (TFDS splits shard names on '-')"
    )
  return name


def check_split_name(split: str) -> str:
  """Checks that `split` can be a split name.

  Args:
    split: the split name.

  Returns:
    `split`.

  Raises:
    ValueError: it has characters other than letters, digits and '_'.
  """
  if not _SPLIT_RE.match(split):
    raise ValueError(f"split name {split!r} must use letters, digits and '_' only")
  return split


def _check_split_of(name: str, split: str, file_format: str) -> None:
  """Checks the names and format that every shard of one split shares."""
  check_dataset_name(name)
  check_split_name(split)
  if file_format not in FILE_FORMATS:
    raise ValueError(f"file_format must be one of {FILE_FORMATS}, got {file_format!r}")


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
    _check_split_of(self.name, self.split, self.file_format)
    if not 0 <= self.index < self.num_shards:
      raise ValueError(
          f"shard index {self.index} is outside [0, {self.num_shards})"
      )

  def __str__(self) -> str:
    return (
        f"{self.name}-{self.split}.{adapters.get(self.file_format).suffix}"
        f"-{self.index:05d}-of-{self.num_shards:05d}"
    )

  @property
  def filename(self) -> str:
    """The shard's file name (no folder)."""
    return str(self)

  @classmethod
  def pattern(cls, name: str, split: str, file_format: str) -> str:
    """The glob matching every shard of one split, whatever their number.

    >>> ShardName.pattern("cats", "train", "tfrecord")
    'cats-train.tfrecord-*-of-*'

    Args:
      name: the dataset name.
      split: the split name.
      file_format: a name in FILE_FORMATS.

    Returns:
      A glob (`fnmatch`, `tf.io.gfile.glob`, `gcloud storage ls`) for the file names.

    Raises:
      ValueError: a name or the format is invalid.
    """
    _check_split_of(name, split, file_format)
    return f"{name}-{split}.{adapters.get(file_format).suffix}-*-of-*"

  @classmethod
  def parse(cls, filename: str) -> ShardName:
    """Parses a bare file name (no folder).

    Args:
      filename: e.g. "cats-train.tfrecord-00000-of-00004".

    Returns:
      The shard it names.

    Raises:
      ValueError: it is not a shard name.
    """
    m = _SHARD_RE.match(filename)
    if not m:
      raise ValueError(f"{filename!r} is not a shard name ({TFDS_FILEPATH_TEMPLATE})")
    return cls(
        name=m["name"],
        split=m["split"],
        file_format=_FORMAT_OF_SUFFIX[m["file_format"]],
        index=int(m["index"]),
        num_shards=int(m["num_shards"]),
    )

  @classmethod
  def is_shard_of(cls, filename: str, name: str, file_format: str | None = None) -> bool:
    """Whether `filename` is a shard of dataset `name` (any split, any count).

    Args:
      filename: a bare file name.
      name: the dataset name.
      file_format: when given, the shard must also be of this format.

    Returns:
      True for a shard of `name` (in `file_format`).
    """
    try:
      shard = cls.parse(filename)
    except ValueError:
      return False
    return shard.name == name and (file_format is None or shard.file_format == file_format)

  @classmethod
  def all_of(cls, name: str, split: str, file_format: str, num_shards: int) -> list[ShardName]:
    """Every shard name of one split, in order.

    Args:
      name, split, file_format: the split, as `pattern` takes it.
      num_shards: how many shards the split has.

    Returns:
      The `num_shards` names, index 0 first.
    """
    return [cls(name, split, file_format, i, num_shards) for i in range(num_shards)]


def tfds_template(folder: str = "") -> str:
  """The `filepathTemplate` TFDS reads from dataset_info.json for shards in `folder`.

  >>> tfds_template("gen-20260101T000000-0123abcd")
  'gen-20260101T000000-0123abcd/{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}'

  Args:
    folder: the shards' folder relative to the output root ("" for the root).

  Returns:
    The template, relative to the output root.
  """
  return posixpath.join(folder, TFDS_FILEPATH_TEMPLATE) if folder else TFDS_FILEPATH_TEMPLATE


def tfds_template_folder(template: str) -> str:
  """The folder part of a TFDS `filepathTemplate` (the inverse of `tfds_template`).

  Args:
    template: a `filepathTemplate` relative to the output root.

  Returns:
    The folder of the shards it names, "" for the root.
  """
  return posixpath.dirname(template)


GENERATION_PREFIX = "gen-"


def new_generation() -> str:
  """A fresh folder name for one run's data files: `gen-<UTC time>-<random>`.

  Every run writes its shards into its own generation folder and switches the
  output over by writing manifest.json last, so a re-run never touches the files
  the current manifest points at; older generations are removed afterwards.

  Returns:
    The folder name, e.g. "gen-20260101T120000-0123abcd".
  """
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
  return f"{GENERATION_PREFIX}{now}-{uuid.uuid4().hex[:8]}"


def is_generation(name: str) -> bool:
  """Whether a folder name is a generation's (see `new_generation`).

  Args:
    name: a folder name.

  Returns:
    True when it has the generation prefix.
  """
  return name.startswith(GENERATION_PREFIX)
