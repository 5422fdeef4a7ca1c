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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
import struct

import numpy as np

from formats.errors import ExampleDecodeError

_WT_VARINT = 0
_WT_I64 = 1
_WT_LEN = 2
_WT_I32 = 5


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


def _len_field(field: int, payload: bytes) -> bytes:
  return _varint((field << 3) | _WT_LEN) + _varint(len(payload)) + payload


def _len_header(field: int, length: int) -> bytes:
  return _varint((field << 3) | _WT_LEN) + _varint(length)


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


class _Reader:
  __slots__ = ("buf", "pos", "end")

  def __init__(self, buf: memoryview, pos: int = 0, end: int | None = None):
    self.buf = buf
    self.pos = pos
    self.end = len(buf) if end is None else end

  def varint(self) -> int:
    result = shift = 0
    buf, pos, end = self.buf, self.pos, self.end
    while True:
      if pos >= end:
        raise ExampleDecodeError(f"varint runs past the end at byte {pos}")
      b = buf[pos]
      pos += 1
      result |= (b & 0x7F) << shift
      if not b & 0x80:
        break
      shift += 7
      if shift > 63:
        raise ExampleDecodeError(f"varint longer than 10 bytes at byte {pos}")
    self.pos = pos
    return result

  def fields(self):
    """Yields (field_number, wire_type, value) until `end`; LEN values are (start, stop)."""
    while self.pos < self.end:
      tag = self.varint()
      field, wt = tag >> 3, tag & 7
      if wt == _WT_VARINT:
        yield field, wt, self.varint()
      elif wt == _WT_LEN:
        n = self.varint()
        start, stop = self.pos, self.pos + n
        if stop > self.end:
          raise ExampleDecodeError(f"field {field} of {n} bytes runs past the end at byte {start}")
        self.pos = stop
        yield field, wt, (start, stop)
      elif wt == _WT_I64:
        self.pos += 8
        yield field, wt, (self.pos - 8, self.pos)
      elif wt == _WT_I32:
        self.pos += 4
        yield field, wt, (self.pos - 4, self.pos)
      else:
        raise ExampleDecodeError(f"unsupported wire type {wt} at byte {self.pos}")
    if self.pos != self.end:
      raise ExampleDecodeError("message runs past its length")


def _signed64(n: int) -> int:
  return n - (1 << 64) if n >= 1 << 63 else n


def _decode_feature(buf: memoryview, start: int, stop: int, copy: bool = True) -> list[bytes] | np.ndarray:
  r = _Reader(buf, start, stop)
  result: list[bytes] | np.ndarray = []
  for kind, wt, span in r.fields():
    if wt != _WT_LEN:
      raise ExampleDecodeError(f"Feature field {kind} has wire type {wt}")
    inner = _Reader(buf, *span)
    if kind == 1:  # BytesList
      result = [bytes(buf[a:b]) if copy else buf[a:b] for f, w, (a, b) in inner.fields() if f == 1]
    elif kind == 2:  # FloatList
      chunks = []
      for f, w, v in inner.fields():
        if f != 1:
          continue
        a, b = v
        if w == _WT_LEN:
          if (b - a) % 4:
            raise ExampleDecodeError("packed float list length is not a multiple of 4")
          chunks.append(np.frombuffer(buf[a:b], dtype="<f4"))
        elif w == _WT_I32:
          chunks.append(np.frombuffer(buf[a:b], dtype="<f4"))
      result = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    elif kind == 3:  # Int64List
      values: list[int] = []
      for f, w, v in inner.fields():
        if f != 1:
          continue
        if w == _WT_LEN:
          packed = _Reader(buf, *v)
          while packed.pos < packed.end:
            values.append(_signed64(packed.varint()))
        elif w == _WT_VARINT:
          values.append(_signed64(v))
      result = np.array(values, dtype=np.int64)
  return result


def decode_example(data: bytes | memoryview, copy: bool = True) -> dict[str, list[bytes] | np.ndarray]:
  """Parses a serialized Example into {key: list of bytes | int64 array | float32 array}.

  copy=False returns bytes values as memoryviews into `data` (no copy of large
  payloads). Raises ExampleDecodeError (a ValueError) on malformed bytes.

  Args:
    data: a serialized Example.
    copy: False to return bytes values as memoryviews into `data`.

  Returns:
    feature name -> a list of bytes, an int64 array or a float32 array.

  Raises:
    ExampleDecodeError: the bytes are not a well-formed Example.
  """
  buf = memoryview(data)
  out: dict[str, list[bytes] | np.ndarray] = {}
  try:
    for f, w, span in _Reader(buf).fields():
      if f != 1 or w != _WT_LEN:
        continue
      for f2, w2, entry_span in _Reader(buf, *span).fields():
        if f2 != 1 or w2 != _WT_LEN:
          continue
        key, value = None, []
        for f3, w3, v in _Reader(buf, *entry_span).fields():
          if f3 == 1 and w3 == _WT_LEN:
            key = bytes(buf[v[0]:v[1]]).decode("utf-8")
          elif f3 == 2 and w3 == _WT_LEN:
            value = _decode_feature(buf, *v, copy=copy)
        if key is None:
          raise ExampleDecodeError("feature map entry without a key")
        out[key] = value
  except (IndexError, UnicodeDecodeError, struct.error) as e:
    raise ExampleDecodeError(str(e)) from e
  return out
