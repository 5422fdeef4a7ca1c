"""Folders of NumPy `.npy` files → ArrayRecord or TFRecord shards, one record per array.

    python -m pipelines.array_folder --input=DIR_OR_GS --output=DIR_OR_GS \
        --shape=D0,D1,... --dtype=float32 [--format=array_record|tfrecord] [any shared or Beam flag]

The input is `<input>/<split>/.../*.npy`: each top-level folder is a split;
files below it are taken recursively. Every array must have the shape and
dtype the flags give (static shapes: XLA compiles once); one that does not,
a file that is not a `.npy` array (or holds Python objects), and files
outside a split folder are rejects with the reason. Each record holds `array`
(the values) and `file_name` (the path relative to the input). The record
kind is `tensors` (formats.kinds). docs/array_folder.md.
"""

from __future__ import annotations

import dataclasses
import io
import math

from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions
import numpy as np

from formats.storage import files as fs
from formats.features import Features, Tensor, Text
from pipelines.core import flags, inputs
from pipelines.core.converter import Converter, FileUnits, OutputPlan, Sources, UnitConverter
from pipelines.core.errors import UsageError, usage_errors
from pipelines.core.flags import CommonConfig
from pipelines.core.records import Reject

NAME = "array_folder"
PIPELINE = f"pipelines.{NAME}"
_DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
           "float64")


class ArrayFolderOptions(PipelineOptions):
  """Flags of `pipelines.array_folder` beyond the shared ones (`core.flags.ConverterOptions`)."""

  @classmethod
  def _add_argparse_args(cls, parser):
    parser.add_argument("--shape", type=flags.positive_ints("D0,D1,..."), default=None,
                        help="D0,D1,...: the shape every array must have (required).")
    parser.add_argument("--dtype", default=None, choices=_DTYPES, help="The dtype every array must have (required).")


@dataclasses.dataclass(frozen=True)
class ArrayFolderConfig:
  """The array converter's own flags, checked."""

  shape: tuple[int, ...]
  dtype: str

  def __post_init__(self):
    if self.dtype in ("", "None"):
      raise ValueError(f"--dtype is required: one of {', '.join(_DTYPES)}")
    if self.dtype not in _DTYPES:
      raise ValueError(f"--dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
    if any(d <= 0 for d in self.shape):
      raise ValueError(f"--shape sides must be positive, got {self.shape}")


def load_array(data: bytes, config: ArrayFolderConfig) -> np.ndarray:
  """The array in `.npy` bytes, checked against the config.

  Args:
    data: the bytes of one `.npy` file.
    config: the shape and dtype every array must have.

  Returns:
    The array.

  Raises:
    ValueError: the reason the file is a reject (never a value from the file).
  """
  if not data.startswith(b"\x93NUMPY"):  # np.load would take other bytes for a pickle
    raise ValueError("not a .npy array")
  # The header first, checked against the config before any array is made: a damaged header makes np.load
  # raise what it likes (TokenError, TypeError), and one claiming terabytes would be allocated.
  f = io.BytesIO(data)
  try:
    version = np.lib.format.read_magic(f)
    read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}[version]
    shape, fortran, dtype = read(f)
  except Exception:  # noqa: BLE001 (whatever the damaged header makes the parser raise)
    raise ValueError("not a .npy array (malformed header)") from None
  if dtype.hasobject:
    raise ValueError("holds Python objects (not allowed)")
  if dtype != np.dtype(config.dtype):
    raise ValueError(f"dtype {dtype} is not --dtype {config.dtype}")
  if tuple(shape) != config.shape:
    raise ValueError(f"shape {tuple(shape)} is not --shape {config.shape}")
  count = math.prod(shape)
  if len(data) - f.tell() < count * dtype.itemsize:
    raise ValueError("not a .npy array (truncated: fewer bytes than its header says)")
  arr = np.frombuffer(data, dtype, count=count, offset=f.tell())
  return np.array(arr.reshape(shape, order="F" if fortran else "C"), order="C")


class _ArrayUnits(FileUnits):
  """(split, InputFile) → a Record of the array, or a Reject naming the file and the reason."""

  def __init__(self, root: str, features: Features, config: ArrayFolderConfig, read_policy: inputs.ReadPolicy):
    super().__init__(root, read_policy)
    self._features = features
    self._config = config

  def setup(self):
    self._bytes_read = Metrics.counter(PIPELINE, "bytes_read")

  def payload(self, key, rel: str, data: bytes) -> bytes:
    self._bytes_read.inc(len(data))
    return self._features.encode({"array": load_array(data, self._config), "file_name": rel})


class ArrayFolder(Converter, name=NAME, kind="tensors", options=ArrayFolderOptions,
                  input_kind="a folder of split folders holding .npy files"):
  """Folders of `.npy` arrays → shards of (array, file_name) records of one static shape and dtype."""

  def configure(self, o: ArrayFolderOptions, common: CommonConfig) -> ArrayFolderConfig:
    """See Converter.configure: --shape is required (its form and --dtype's choices are checked by their
    declarations)."""
    if o.shape is None:
      raise UsageError("--shape is required: D0,D1,... with positive integers")
    with usage_errors():
      return ArrayFolderConfig(shape=o.shape.values, dtype=str(o.dtype))

  def plan(self, common: CommonConfig, config: ArrayFolderConfig) -> OutputPlan:
    """See Converter.plan. Files and odd-named folders at the top level become launcher rejects.

    Args:
      common: its `input` is listed (one level).
      config: the shape and dtype of the `array` feature.

    Raises:
      UsageError: the input holds no split folders, or a split folder's name is not a valid split name.
    """
    dirs, files, others = inputs.scan_input(common.input)
    splits = tuple(inputs.split_folder(d) for d in dirs if inputs.printable(d) == d)
    if not splits:
      raise UsageError(f"--input {common.input!r} holds no split folders")
    strays = [*files, *(d for d in dirs if d not in splits)]
    return OutputPlan(
        features=Features({"array": Tensor(shape=config.shape, dtype=config.dtype), "file_name": Text()}),
        splits=splits,
        description=f"Arrays from {inputs.printable(common.input)}, converted by {PIPELINE}.",
        source={"pipeline": PIPELINE, "input": inputs.printable(common.input), "shape": list(config.shape),
                "dtype": config.dtype, "seed": common.seed, "num_shards": common.num_shards},
        launcher_rejects=(*(Reject(inputs.printable(fs.join(common.input, n)), "not inside a split folder")
                            for n in sorted(strays)),
                          *(Reject(inputs.printable(fs.join(common.input, n)), reason) for n, reason in others)))

  def sources(self, common: CommonConfig, config: ArrayFolderConfig, plan: OutputPlan) -> Sources:
    """See Converter.sources: every split folder, keyed by its split; each `.npy` file is a unit."""
    return Sources(folders=[(s, fs.join(common.input, s)) for s in plan.splits], root=common.input)

  def unit_converter(self, common: CommonConfig, config: ArrayFolderConfig, plan: OutputPlan) -> UnitConverter:
    """See Converter.unit_converter: one `.npy` file → its record, or a reject."""
    return _ArrayUnits(common.input, plan.features, config, common.read_policy)
