"""`tf.train.Example` encoded and decoded without TensorFlow.

The wire format is protobuf's; the messages are (from
``tensorflow/core/example/{example,feature}.proto``)::

    Example   { Features features = 1; }
    Features  { map<string, Feature> feature = 1; }   # entry: key = 1, value = 2
    Feature   { oneof kind { BytesList bytes_list = 1;
                             FloatList float_list = 2;   # packed float32
                             Int64List int64_list = 3; } } # packed varint
    *List     { repeated <type> value = 1; }

Encoding is deterministic: features are written in sorted key order and
numeric lists packed, as TensorFlow itself does, so equal inputs give equal
bytes. Decoding accepts packed and unpacked numeric lists.

`decode_example` builds the whole dict; `FeatureFinder` (the loaders' fast
path) walks the bytes the same way, on formats.protowire, but only builds
the features asked for: byte values as (start, stop) spans into the record,
nothing copied. Both refuse malformed bytes with ExampleDecodeError and
nothing else (tests/formats/test_example_finder.py checks them on random and
damaged records).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from formats.errors import ExampleDecodeError, WireFormatError
from formats.protowire import I32, LEN, VARINT, field, tag, varint


# --------------------------------------------------------------------------- encode


def _varint(n: int) -> bytes:
  if n < 0:
    n &= (1 << 64) - 1  # int64 as protobuf does: ten bytes, two's complement
  out = bytearray()
  while n > 0x7F:
    out.append((n & 0x7F) | 0x80)
    n >>= 7
  out.append(n)
  return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
  return _len_header(number, len(payload)) + payload


def _len_header(number: int, length: int) -> bytes:
  return _varint((number << 3) | LEN) + _varint(length)


def bytes_feature(values: bytes | str | Iterable[bytes | str]) -> bytes:
  """A serialized `Feature` holding a BytesList (one copy of the payload, however large).

  Args:
    values: one value or a sequence of them; str is encoded as UTF-8.

  Returns:
    The serialized Feature.
  """
  if isinstance(values, (bytes, bytearray, memoryview, str)):
    values = [values]
  parts = []
  for v in values:
    v = v.encode("utf-8") if isinstance(v, str) else v
    parts += [_len_header(1, len(v)), v]
  size = sum(len(p) for p in parts)
  return b"".join([_len_header(1, size), *parts])


def int64_feature(values: int | Iterable[int] | np.ndarray) -> bytes:
  """A serialized `Feature` holding a packed Int64List.

  Args:
    values: integers (any shape; flattened).

  Returns:
    The serialized Feature.

  Raises:
    TypeError: the values are not integers.
  """
  arr = np.asarray(values)
  if arr.dtype.kind not in "iub":
    raise TypeError(f"int64 feature needs integers, got dtype {arr.dtype}")
  packed = b"".join(_varint(int(v)) for v in arr.reshape(-1).tolist())
  inner = _len_field(1, packed) if packed else b""
  return _len_field(3, inner)


def float_feature(values: float | Iterable[float] | np.ndarray) -> bytes:
  """A serialized `Feature` holding a packed FloatList (float32).

  Args:
    values: numbers (any shape; flattened, stored as float32).

  Returns:
    The serialized Feature.
  """
  arr = np.asarray(values, dtype="<f4").reshape(-1)
  inner = _len_field(1, arr.tobytes()) if arr.size else b""
  return _len_field(2, inner)


def encode_example(features: Mapping[str, bytes]) -> bytes:
  """Serializes an Example from already-serialized `Feature`s, keys sorted.

  >>> encode_example({"label": int64_feature(3), "name": bytes_feature("a.jpg")})[:4]
  b'\\n\\x1f\\n\\x0e'

  Args:
    features: feature name -> a serialized Feature (`bytes_feature` & co.).

  Returns:
    The serialized Example.
  """
  parts = []
  for key in sorted(features):
    k = _len_field(1, key.encode("utf-8"))
    value = features[key]
    value_header = _len_header(2, len(value))
    parts += [_len_header(1, len(k) + len(value_header) + len(value)), k, value_header, value]
  size = sum(len(p) for p in parts)
  return b"".join([_len_header(1, size), *parts])  # the payloads are copied once


# --------------------------------------------------------------------------- decode


# What a Feature holds, as `FeatureFinder` reports it: its list (the Feature's oneof field number), or none.
NO_LIST, BYTES_LIST, FLOAT_LIST, INT64_LIST = 0, 1, 2, 3
_EMPTY = (NO_LIST, None)  # a map entry without a value
# The tags of field 1 (Example.features, Features.feature, a map entry's key, a list's values), 2 and 3.
_LEN_1, _LEN_2, _LEN_3 = tag(1, LEN), tag(2, LEN), tag(3, LEN)
_VARINT_1, _I32_1 = tag(1, VARINT), tag(1, I32)


def _signed64(n: int) -> int:
  """An Int64List value from its varint: two's complement; a varint past 64 bits is malformed."""
  if n >= 1 << 63:
    if n >= 1 << 64:
      raise ExampleDecodeError(f"int64 value of {n.bit_length()} bits")
    return n - (1 << 64)
  return n


def _feature(data, pos: int, end: int, build: bool) -> tuple[int, object]:
  """(list kind, values) of the Feature in data[pos:end], every byte of it checked.

  Values: BYTES_LIST a list of (start, stop) spans; FLOAT_LIST a float32 array;
  INT64_LIST a list of ints; NO_LIST None. build=False only checks (values None).
  A Feature holding several lists holds its last; a list field that is not LEN
  is malformed, as are a varint in a BytesList or FloatList and an int past 64
  bits; unknown fields of any wire type are skipped.
  """
  kind, values = NO_LIST, None
  while pos < end:
    t, a, pos = field(data, pos, end)
    if t & 7 != LEN:
      raise ExampleDecodeError(f"Feature field {t >> 3} has wire type {t & 7}")
    if t == _LEN_1:  # BytesList: field 1 of any width is a value
      spans = []
      while a < pos:
        t, x, a = field(data, a, pos)
        if t & 7 == VARINT:
          raise ExampleDecodeError(f"BytesList field {t >> 3} has wire type {VARINT}")
        if t >> 3 == 1:
          spans.append((x, a))
      kind, values = BYTES_LIST, spans if build else None
    elif t == _LEN_2:  # FloatList: packed or one float32 per field
      chunks = []
      while a < pos:
        t, x, a = field(data, a, pos)
        if t == _LEN_1:
          if (a - x) % 4:
            raise ExampleDecodeError("packed float list length is not a multiple of 4")
          chunks.append((x, a))
        elif t == _I32_1:
          chunks.append((x, a))
        elif t == _VARINT_1:
          raise ExampleDecodeError(f"FloatList field 1 has wire type {VARINT}")
      if build:
        view = memoryview(data)
        values = (np.concatenate([np.frombuffer(view[x:y], dtype="<f4") for x, y in chunks]).astype(np.float32)
                  if chunks else np.zeros(0, np.float32))
      kind = FLOAT_LIST
    elif t == _LEN_3:  # Int64List: packed or one varint per field
      ints: list[int] = []
      while a < pos:
        t, x, a = field(data, a, pos)
        if t == _LEN_1:
          while x < a:
            v = data[x]
            if v < 0x80:
              x += 1
            else:
              v, x = varint(data, x, a)
              v = _signed64(v)
            ints.append(v)
        elif t == _VARINT_1:
          ints.append(_signed64(x))
      kind, values = INT64_LIST, ints if build else None
  return kind, values


class _EveryKey:
  """Stands for the slots of `_walk` when every key is wanted: each key's slot is the key as text."""

  @staticmethod
  def get(key: bytes) -> str:
    return str(key, "utf-8")


def _walk(data, slots, found) -> None:
  """Walks a serialized Example and puts each wanted feature's (kind, values) in `found[slots.get(key)]`.

  `key` is the entry's key as bytes (a slice of `data`); `slots.get(key)` is
  None for a key not wanted. Every byte is checked, entries of keys not
  wanted too, so a record is refused the same way whatever is wanted. The
  last entry of a key repeated wins.

  Raises:
    ExampleDecodeError: the bytes are not a well-formed Example.
  """
  end = len(data)
  pos = 0
  try:
    while pos < end:  # Example: Features at field 1
      t, a, pos = field(data, pos, end)
      if t != _LEN_1:
        continue
      while a < pos:  # Features: map entries at field 1
        t, e, a = field(data, a, pos)
        if t != _LEN_1:
          continue
        slot = key = None
        value, built, vx, ve = _EMPTY, True, 0, 0
        while e < a:  # one entry: key = 1, value = 2
          t, x, e = field(data, e, a)
          if t == _LEN_1:
            key = data[x:e]
            slot = slots.get(key)
            if slot is None:
              str(key, "utf-8")  # a key not wanted is only checked
          elif t == _LEN_2:
            built = key is None or slot is not None  # a value for a key not wanted is only checked
            value, vx, ve = _feature(data, x, e, built), x, e
        if key is None:
          raise ExampleDecodeError("feature map entry without a key")
        if slot is not None:
          found[slot] = value if built else _feature(data, vx, ve, True)
  except (UnicodeDecodeError, WireFormatError) as e:
    raise decode_error(e) from None


def decode_error(e: UnicodeDecodeError | WireFormatError) -> ExampleDecodeError:
  """The ExampleDecodeError of a walk of an Example that met a key not in UTF-8 or bytes not in wire format."""
  if isinstance(e, UnicodeDecodeError):
    return ExampleDecodeError(f"feature key is not UTF-8: {e.reason} at byte {e.start}")
  return ExampleDecodeError(str(e))


def decode_example(data: bytes | memoryview, copy: bool = True) -> dict[str, list[bytes] | np.ndarray]:
  """Parses a serialized Example into {key: list of bytes | int64 array | float32 array}.

  copy=False returns bytes values as memoryviews into `data` (no copy of large
  payloads). An entry without a value decodes to an empty list.

  Args:
    data: a serialized Example.
    copy: False to return bytes values as memoryviews into `data`.

  Returns:
    feature name -> a list of bytes, an int64 array or a float32 array.

  Raises:
    ExampleDecodeError: (a ValueError) the bytes are not a well-formed Example.
  """
  view = memoryview(data)
  found: dict[str, tuple[int, object]] = {}
  _walk(view, _EveryKey, found)
  out: dict[str, list[bytes] | np.ndarray] = {}
  for key, (kind, values) in found.items():
    if kind == BYTES_LIST:
      out[key] = [bytes(view[a:b]) if copy else view[a:b] for a, b in values]
    elif kind == INT64_LIST:
      out[key] = np.array(values, dtype=np.int64)
    else:
      out[key] = [] if kind == NO_LIST else values
  return out


class FeatureFinder:
  """Finds named features in serialized Examples without decoding the others: the loaders' fast path.

      finder = FeatureFinder(["image", "label", "file_name"])
      (kind, spans), (_, labels), _ = finder(record)   # kind BYTES_LIST, spans [(start, stop)]
      pixels = record[spans[0][0]:spans[0][1]]; label = labels[0]

  The walk is `decode_example`'s, so a record is refused (ExampleDecodeError)
  exactly when `decode_example` refuses it or lacks one of `keys`
  (Features.decode's "record lacks features"); what is found under a key is
  what `decode_example` returns for it, in another form: byte values as
  (start, stop) spans into the record instead of copies, Int64List values as
  Python ints. Only bytes-like records are indexed; nothing outside
  `len(record)` is read, and every step advances, so any input ends.

  Args:
    keys: the Example keys to find (Features' `keys(name)` of each feature).

  Raises:
    ValueError: (on construction) a key is repeated.
  """

  __slots__ = ("keys", "_slots")

  def __init__(self, keys):
    self.keys = tuple(keys)
    self._slots = {k.encode("utf-8"): i for i, k in enumerate(self.keys)}
    if len(self._slots) != len(self.keys):
      raise ValueError(f"keys repeat: {self.keys}")

  def __call__(self, data: bytes | memoryview) -> list[tuple[int, object]]:
    """Locates `keys` in one serialized Example.

    Args:
      data: the serialized Example.

    Returns:
      One (kind, values) per key, in `keys` order: kind NO_LIST (the entry
      holds no list; values None), BYTES_LIST (values: a list of (start, stop)
      spans of `data`), FLOAT_LIST (a float32 array) or INT64_LIST (a list of
      ints).

    Raises:
      ExampleDecodeError: the bytes are not a well-formed Example, or a key is missing.
    """
    if type(data) is not bytes:
      data = memoryview(data).toreadonly()  # its slices look keys up in `_slots`: a writable view's cannot
    found: list = [None] * len(self.keys)
    _walk(data, self._slots, found)
    if None in found:
      raise ExampleDecodeError(f"record lacks features {sorted(k for k, v in zip(self.keys, found) if v is None)}")
    return found
