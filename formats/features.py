"""What each record holds: a small feature schema shared by writers and readers.

A `Features` maps names to feature specs. Each spec knows how its value is
stored in a `tf.train.Example` (the TFDS encoding of the same feature), how it
is described in `manifest.json`, and how TFDS describes it in `features.json`,
so the same schema drives the pipelines' encoders, the loaders' decoders and
TFDS interop.

>>> spec = Features({"image": Image(shape=(None, None, 3)), "label": ClassLabel(("cat", "dog"))})
>>> spec.decode(spec.encode({"image": b"...jpeg...", "label": 1}))["label"]
1
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from typing import Any, ClassVar

import numpy as np

from formats import example as example_lib

_TFDS = "tensorflow_datasets.core.features."


def _dims(shape: tuple[int | None, ...]) -> dict:
  return {"dimensions": [str(-1 if d is None else d) for d in shape]}


class _Spec:
  """What every feature spec does: store a value in Example features, read it back, describe itself."""

  kind: ClassVar[str]  # as in manifest.json's feature descriptions

  def encode_into(self, name: str, value) -> dict[str, bytes]:
    """The Example features holding one value of the feature `name`: Example key -> serialized Feature."""
    raise NotImplementedError

  def decode_from(self, name: str, raw) -> Any:
    """The value of the feature `name` from a decoded Example (`decode_example`)."""
    raise NotImplementedError

  def keys(self, name: str) -> tuple[str, ...]:
    """The Example keys the feature `name` uses."""
    raise NotImplementedError

  def to_json(self) -> dict:
    """The JSON object describing this feature in manifest.json."""
    raise NotImplementedError

  def to_tfds(self) -> dict:
    """The JSON object describing this feature in TFDS's features.json."""
    raise NotImplementedError


class _OneKey(_Spec):
  """Features stored under their own name as one Example feature (all but unknown-shape Tensors).

  A subclass defines `encode(value) -> bytes`, the serialized Feature holding
  `value`, and `decode(entry)`, the value back from its entry as
  `decode_example` returns it.
  """

  def encode_into(self, name: str, value) -> dict[str, bytes]:
    """See _Spec.encode_into."""
    return {name: self.encode(value)}

  def decode_from(self, name: str, raw) -> Any:
    """See _Spec.decode_from."""
    return self.decode(raw[name])

  def keys(self, name: str) -> tuple[str, ...]:
    """See _Spec.keys."""
    return (name,)


def _one_bytes(value, what: str):
  """The single bytes value of a decoded BytesList entry.

  Raises:
    ValueError: the entry is not a BytesList of exactly one value (a record that contradicts its schema).
  """
  if not isinstance(value, list) or len(value) != 1:
    raise ValueError(f"{what}: {_form(value)}, expected one bytes value")
  return value[0]


def _form(value) -> str:
  """How a decoded Example entry is stored, for a message (never its values)."""
  if isinstance(value, list):
    return f"{len(value)} bytes values"
  return f"{np.size(value)} {'int64' if np.asarray(value).dtype.kind in 'iu' else 'float'} values"


@dataclasses.dataclass(frozen=True)
class Image(_OneKey):
  """An encoded image (JPEG/PNG bytes), TFDS `Image`. Shape entries may be None."""

  shape: tuple[int | None, ...] = (None, None, 3)
  encoding: str = "jpeg"
  kind: ClassVar[str] = "image"

  def __post_init__(self):
    if self.encoding not in ("jpeg", "png"):
      raise ValueError(f"Image encoding must be jpeg or png, got {self.encoding!r}")
    if len(self.shape) != 3:
      raise ValueError(f"Image shape must be (height, width, channels), got {self.shape}")

  def encode(self, value: bytes) -> bytes:
    """The serialized Feature holding `value`, the encoded image bytes."""
    return example_lib.bytes_feature(value)

  def decode(self, value) -> bytes:
    """The encoded image bytes from their decoded Example entry `value`.

    Raises:
      ValueError: the entry is not one bytes value.
    """
    return _one_bytes(value, "Image")

  def to_json(self) -> dict:
    """See _Spec.to_json."""
    return {"kind": self.kind, "shape": list(self.shape), "dtype": "uint8", "encoding": self.encoding}

  def to_tfds(self) -> dict:
    """See _Spec.to_tfds."""
    return {
        "pythonClassName": _TFDS + "image_feature.Image",
        "image": {"shape": _dims(self.shape), "dtype": "uint8", "encodingFormat": self.encoding},
    }


@dataclasses.dataclass(frozen=True)
class Tensor(_Spec):
  """An array, as TFDS `Tensor` stores it.

  encoding="bytes": the raw little-endian bytes in a bytes_list; a shape with more
  than one unknown dimension is stored beside it (`<name>/shape`, `<name>/value`,
  as TFDS does). encoding="none": the values in an int64_list or float_list (a
  fixed, small shape: spacing, a 3x3 matrix, a scalar).
  """

  shape: tuple[int | None, ...]
  dtype: str = "uint8"
  encoding: str = "bytes"
  kind: ClassVar[str] = "tensor"

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(self.shape))
    dt = np.dtype(self.dtype)  # raises TypeError for an unknown dtype
    if self.encoding not in ("bytes", "none"):
      raise ValueError(f"Tensor encoding must be bytes or none, got {self.encoding!r}")
    if any(d is not None and d < 0 for d in self.shape):
      raise ValueError(f"Tensor shape entries must be >= 0 or None, got {self.shape}")
    if self.encoding == "none":
      if None in self.shape:
        raise ValueError(f"Tensor(encoding='none') needs a fully known shape, got {self.shape}")
      if dt.kind not in "iuf":
        raise ValueError(f"Tensor(encoding='none') holds numbers, got dtype {self.dtype}")

  @property
  def _le_dtype(self) -> np.dtype:
    return np.dtype(self.dtype).newbyteorder("<")

  @property
  def dynamic(self) -> bool:
    """Whether more than one dimension is unknown (the shape is then stored beside the value)."""
    return self.shape.count(None) > 1

  def _check_shape(self, arr: np.ndarray) -> None:
    if len(arr.shape) != len(self.shape) or any(
        d is not None and d != a for d, a in zip(self.shape, arr.shape)):
      raise ValueError(f"Tensor expects shape {self.shape}, got {arr.shape}")

  def encode_into(self, name: str, value) -> dict[str, bytes]:
    """See _Spec.encode_into: two keys for a dynamic shape.

    Args:
      value: an array of this dtype and shape (or its raw bytes, for a known shape).

    Raises:
      ValueError: the dtype or shape differs.
    """
    if self.encoding == "none":
      arr = np.asarray(value)
      self._check_shape(arr)
      if np.dtype(self.dtype).kind == "f":
        return {name: example_lib.float_feature(arr)}
      if arr.dtype.kind not in "biu":  # a fraction into an integer feature would be cut silently
        raise ValueError(f"Tensor expects dtype {self.dtype}, got {arr.dtype}")
      dt = np.dtype(self.dtype)
      if arr.size and (int(arr.min()) < np.iinfo(dt).min or int(arr.max()) > np.iinfo(dt).max):
        raise ValueError(f"Tensor expects values in {dt.name}'s range")
      # uint64 past 2**63 is stored wrapped, as TFDS and tf.cast do; decode views it back.
      return {name: example_lib.int64_feature(arr.astype(dt).view(np.int64) if dt == np.uint64
                                              else arr.astype(np.int64))}
    if isinstance(value, (bytes, bytearray)):
      if self.dynamic:
        raise ValueError("a Tensor with unknown dimensions needs an array, not bytes")
      return {name: example_lib.bytes_feature(value)}
    arr = np.asarray(value)
    if arr.dtype != np.dtype(self.dtype):
      raise ValueError(f"Tensor expects dtype {self.dtype}, got {arr.dtype}")
    self._check_shape(arr)
    data = np.ascontiguousarray(arr, dtype=self._le_dtype).tobytes()
    if self.dynamic:
      return {f"{name}/shape": example_lib.int64_feature(np.array(arr.shape, np.int64)),
              f"{name}/value": example_lib.bytes_feature(data)}
    return {name: example_lib.bytes_feature(data)}

  def decode_from(self, name: str, raw) -> np.ndarray:
    """See _Spec.decode_from: the array (a read-only view of the record's bytes for encoding="bytes").

    Raises:
      ValueError: the stored entries contradict the spec: another list kind or count, a stored shape of
        another rank or other fixed sides, or an integer the dtype cannot hold.
    """
    if self.encoding == "none":
      return self._decode_values(name, raw[name])
    if self.dynamic:
      stored = raw[f"{name}/shape"]
      if isinstance(stored, list) or np.asarray(stored).dtype != np.int64 or len(stored) != len(self.shape):
        raise ValueError(f"Tensor {name!r}: a stored shape of {_form(stored)}, expected {len(self.shape)} int64")
      shape = tuple(int(d) for d in stored)
      if any(a < 0 or (d is not None and d != a) for d, a in zip(self.shape, shape)):
        raise ValueError(f"Tensor {name!r}: stored shape {shape}, expected {self.shape}")
      return np.frombuffer(_one_bytes(raw[f"{name}/value"], f"Tensor {name!r}"), self._le_dtype).reshape(shape)
    shape = tuple(-1 if d is None else d for d in self.shape)
    return np.frombuffer(_one_bytes(raw[name], f"Tensor {name!r}"), dtype=self._le_dtype).reshape(shape)

  def _decode_values(self, name: str, value) -> np.ndarray:
    """encoding="none": an int64 list for an integer dtype (each value in its range), a float list for a float."""
    dt = np.dtype(self.dtype)
    want = np.int64 if dt.kind in "iu" else np.float32
    if isinstance(value, list) or np.asarray(value).dtype != want:
      raise ValueError(f"Tensor {name!r}: {_form(value)}, expected {'int64' if want is np.int64 else 'float'} "
                       f"values")
    value = np.asarray(value)
    if dt == np.uint64:  # stored wrapped (see encode_into): every int64 is one uint64
      return value.view(np.uint64).reshape(self.shape)
    if dt.kind in "iu" and value.size:
      info = np.iinfo(dt)
      if int(value.min()) < info.min or int(value.max()) > info.max:  # astype would wrap it
        raise ValueError(f"Tensor {name!r}: a value outside {dt.name}'s range")
    return value.astype(dt).reshape(self.shape)

  def keys(self, name: str) -> tuple[str, ...]:
    """See _Spec.keys: (name,), or (name/shape, name/value) for a dynamic shape."""
    return (f"{name}/shape", f"{name}/value") if self.dynamic else (name,)

  def to_json(self) -> dict:
    """See _Spec.to_json."""
    return {"kind": self.kind, "shape": list(self.shape), "dtype": self.dtype, "encoding": self.encoding}

  def to_tfds(self) -> dict:
    """See _Spec.to_tfds."""
    shape = _dims(self.shape) if self.shape else {}
    return {
        "pythonClassName": _TFDS + "tensor_feature.Tensor",
        "tensor": {"shape": shape, "dtype": self.dtype, "encoding": self.encoding},
    }


@dataclasses.dataclass(frozen=True)
class ClassLabel(_OneKey):
  """An int64 class id with its names (TFDS `ClassLabel`; names go to `<feature>.labels.txt`)."""

  names: tuple[str, ...]
  kind: ClassVar[str] = "class_label"

  def __post_init__(self):
    object.__setattr__(self, "names", tuple(self.names))
    for n in self.names:
      if not n or "\n" in n:
        raise ValueError(f"class name {n!r} must be non-empty and on one line")
    if len(set(self.names)) != len(self.names):
      raise ValueError("class names must be unique")

  @property
  def num_classes(self) -> int:
    """How many classes there are."""
    return len(self.names)

  def encode(self, value: int) -> bytes:
    """The serialized Feature holding `value`, a class id.

    Raises:
      ValueError: the id is outside [0, num_classes).
    """
    if not 0 <= int(value) < self.num_classes:
      raise ValueError(f"label {value} is outside [0, {self.num_classes})")
    return example_lib.int64_feature([int(value)])

  def decode(self, value) -> int:
    """The class id from its decoded Example entry `value`.

    Raises:
      ValueError: the entry is not one int64 value, or the id is outside [0, num_classes).
    """
    if isinstance(value, list) or np.asarray(value).dtype != np.int64 or np.size(value) != 1:
      raise ValueError(f"ClassLabel: {_form(value)}, expected one int64 value")
    label = int(value[0])
    if not 0 <= label < self.num_classes:
      raise ValueError(f"label {label} is outside [0, {self.num_classes})")
    return label

  def to_json(self) -> dict:
    """See _Spec.to_json."""
    return {"kind": self.kind, "dtype": "int64", "num_classes": self.num_classes, "names": list(self.names)}

  def to_tfds(self) -> dict:
    """See _Spec.to_tfds."""
    return {
        "pythonClassName": _TFDS + "class_label_feature.ClassLabel",
        "classLabel": {"numClasses": str(self.num_classes)},
    }


@dataclasses.dataclass(frozen=True)
class Text(_OneKey):
  """A UTF-8 string (TFDS `Text`)."""

  kind: ClassVar[str] = "text"

  def encode(self, value: str) -> bytes:
    """The serialized Feature holding `value`, a string (stored as UTF-8)."""
    return example_lib.bytes_feature(value)

  def decode(self, value) -> str:
    """The string from its decoded Example entry `value`.

    Raises:
      ValueError: the entry is not one bytes value, or not UTF-8 (UnicodeDecodeError).
    """
    return bytes(_one_bytes(value, "Text")).decode("utf-8")

  def to_json(self) -> dict:
    """See _Spec.to_json."""
    return {"kind": self.kind, "dtype": "string"}

  def to_tfds(self) -> dict:
    """See _Spec.to_tfds."""
    return {"pythonClassName": _TFDS + "text_feature.Text", "text": {}}


Feature = Image | Tensor | ClassLabel | Text


def feature_from_json(d: Mapping[str, Any]) -> Feature:
  """A feature from its manifest.json description.

  Args:
    d: the description (`to_json`).

  Returns:
    The feature.

  Raises:
    ValueError: an unknown feature kind.
  """
  kind = d.get("kind")
  if kind == "image":
    return Image(shape=tuple(d["shape"]), encoding=d["encoding"])
  if kind == "tensor":
    return Tensor(shape=tuple(d["shape"]), dtype=d["dtype"], encoding=d.get("encoding", "bytes"))
  if kind == "class_label":
    return ClassLabel(names=tuple(d["names"]))
  if kind == "text":
    return Text()
  raise ValueError(f"unknown feature kind {kind!r}")


class Features(Mapping[str, Feature]):
  """An ordered mapping of feature name → spec that encodes and decodes records."""

  def __init__(self, specs: Mapping[str, Feature]):
    self._specs = dict(specs)

  def __getitem__(self, key: str) -> Feature:
    return self._specs[key]

  def __iter__(self):
    return iter(self._specs)

  def __len__(self) -> int:
    return len(self._specs)

  def __eq__(self, other) -> bool:
    return isinstance(other, Features) and self._specs == other._specs

  def __repr__(self) -> str:
    return f"Features({self._specs!r})"

  def encode(self, values: Mapping[str, Any]) -> bytes:
    """One serialized tf.train.Example; every feature must be present.

    Args:
      values: feature name -> value.

    Returns:
      The serialized Example.

    Raises:
      ValueError: keys differ from the features, or a value does not fit its feature.
    """
    missing = set(self._specs) - set(values)
    extra = set(values) - set(self._specs)
    if missing or extra:
      raise ValueError(f"record keys differ from the features: missing {sorted(missing)}, extra {sorted(extra)}")
    encoded: dict[str, bytes] = {}
    for k, spec in self._specs.items():
      encoded.update(spec.encode_into(k, values[k]))
    return example_lib.encode_example(encoded)

  def decode(self, record: bytes, copy: bool = True) -> dict[str, Any]:
    """The values of one serialized Example (raises ValueError on malformed bytes).

    copy=False: bytes values (encoded images) are memoryviews and tensors are
    read-only arrays over `record`, without copying the payload.

    Args:
      record: a serialized Example.
      copy: False for views instead of copies.

    Returns:
      feature name -> value.

    Raises:
      ValueError: malformed bytes, or a feature is missing.
    """
    raw = example_lib.decode_example(record, copy=copy)
    missing = {key for k, spec in self._specs.items() for key in spec.keys(k)} - set(raw)
    if missing:
      raise ValueError(f"record lacks features {sorted(missing)}")
    return {k: spec.decode_from(k, raw) for k, spec in self._specs.items()}

  def to_json(self) -> dict:
    """The schema as manifest.json's `features`.

    Returns:
      feature name -> description.
    """
    return {k: v.to_json() for k, v in self._specs.items()}

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> Features:
    """The schema from manifest.json's `features`.

    Args:
      d: feature name -> description.

    Returns:
      The Features.

    Raises:
      ValueError: an unknown feature kind.
    """
    return cls({k: feature_from_json(v) for k, v in d.items()})

  def to_tfds(self) -> dict:
    """The content of TFDS's features.json for this schema.

    Returns:
      A JSON object.
    """
    return {
        "pythonClassName": _TFDS + "features_dict.FeaturesDict",
        "featuresDict": {"features": {k: v.to_tfds() for k, v in sorted(self._specs.items())}},
    }
