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
path) walks the same bytes with the same checks but only locates the
features asked for: byte values as (start, stop) spans into the record,
nothing copied. Both refuse malformed bytes with ExampleDecodeError and
nothing else (tests/formats/test_example_finder.py checks they agree on
random and damaged records).
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
      elif wt == _WT_I64 or wt == _WT_I32:
        start, stop = self.pos, self.pos + (8 if wt == _WT_I64 else 4)
        if stop > self.end:
          raise ExampleDecodeError(f"field {field} of {stop - start} bytes runs past the end at byte {start}")
        self.pos = stop
        yield field, wt, (start, stop)
      else:
        raise ExampleDecodeError(f"unsupported wire type {wt} at byte {self.pos}")
    if self.pos != self.end:
      raise ExampleDecodeError("message runs past its length")


def _signed64(n: int) -> int:
  """An Int64List value from its varint: two's complement; a varint past 64 bits is malformed."""
  if n >= 1 << 63:
    if n >= 1 << 64:
      raise ExampleDecodeError(f"int64 value of {n.bit_length()} bits")
    return n - (1 << 64)
  return n


def _decode_feature(buf: memoryview, start: int, stop: int, copy: bool = True) -> list[bytes] | np.ndarray:
  r = _Reader(buf, start, stop)
  result: list[bytes] | np.ndarray = []
  for kind, wt, span in r.fields():
    if wt != _WT_LEN:
      raise ExampleDecodeError(f"Feature field {kind} has wire type {wt}")
    inner = _Reader(buf, *span)
    if kind == 1:  # BytesList: field 1 of any width is a value; a varint field is malformed
      values = []
      for f, w, v in inner.fields():
        if w == _WT_VARINT:
          raise ExampleDecodeError(f"BytesList field {f} has wire type {w}")
        if f == 1:
          values.append(bytes(buf[v[0]:v[1]]) if copy else buf[v[0]:v[1]])
      result = values
    elif kind == 2:  # FloatList
      chunks = []
      for f, w, v in inner.fields():
        if f != 1:
          continue
        if w == _WT_VARINT:
          raise ExampleDecodeError(f"FloatList field {f} has wire type {w}")
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


# --------------------------------------------------------------------------- find features


# What `FeatureFinder` found under a key: the Feature's list (its oneof field number), or none.
NO_LIST, BYTES_LIST, FLOAT_LIST, INT64_LIST = 0, 1, 2, 3


def _varint_at(data, pos: int, end: int) -> tuple[int, int]:
  """(value, position after it) of the varint at `pos`, which must end before `end` (as `_Reader.varint`)."""
  result = shift = 0
  while True:
    if pos >= end:
      raise ExampleDecodeError(f"varint runs past the end at byte {pos}")
    b = data[pos]
    pos += 1
    result |= (b & 0x7F) << shift
    if b < 0x80:
      return result, pos
    shift += 7
    if shift > 63:
      raise ExampleDecodeError(f"varint longer than 10 bytes at byte {pos}")


def _field_at(data, pos: int, end: int) -> tuple[int, int, int, int]:
  """(field number, wire type, a, b) of the field at `pos` < `end`, checked as `_Reader.fields` checks.

  The field ends at b; a LEN or fixed-width value is data[a:b], a varint's value is a.
  """
  tag = data[pos]
  if tag < 0x80:
    pos += 1
  else:
    tag, pos = _varint_at(data, pos, end)
  wt = tag & 7
  if wt == _WT_LEN:
    if pos < end and data[pos] < 0x80:
      n = data[pos]
      pos += 1
    else:
      n, pos = _varint_at(data, pos, end)
    stop = pos + n
    if stop > end:
      raise ExampleDecodeError(f"field {tag >> 3} of {n} bytes runs past the end at byte {pos}")
    return tag >> 3, wt, pos, stop
  if wt == _WT_VARINT:
    value, pos = _varint_at(data, pos, end)
    return tag >> 3, wt, value, pos
  if wt == _WT_I64 or wt == _WT_I32:
    stop = pos + (8 if wt == _WT_I64 else 4)
    if stop > end:
      raise ExampleDecodeError(f"field {tag >> 3} of {stop - pos} bytes runs past the end at byte {pos}")
    return tag >> 3, wt, pos, stop
  raise ExampleDecodeError(f"unsupported wire type {wt} at byte {pos}")


def _find_feature(data, pos: int, end: int, build: bool) -> tuple[int, object]:
  """(list kind, values) of the Feature in data[pos:end], checked exactly as `_decode_feature` checks it.

  Values: BYTES_LIST a list of (start, stop) spans; FLOAT_LIST a float32 array;
  INT64_LIST a list of ints; NO_LIST None. build=False only checks (values None).
  The one-byte tags of LEN fields are read inline, their lengths too when
  they take 1 to 3 bytes (the same checks as `_field_at`, which reads every
  other field).
  """
  kind, values = NO_LIST, None
  while pos < end:
    tag = data[pos]
    if tag == 0x0A or tag == 0x12 or tag == 0x1A:  # a BytesList, FloatList or Int64List
      f = tag >> 3
      a = pos + 1
      if a < end and data[a] < 0x80:  # a 1-byte length
        pos = a + 1 + data[a]
        a += 1
      elif a + 2 < end and data[a] >= 0x80 and data[a + 1] >= 0x80 and data[a + 2] < 0x80:  # 3 bytes
        pos = a + 3 + ((data[a] & 0x7F) | ((data[a + 1] & 0x7F) << 7) | (data[a + 2] << 14))
        a += 3
      else:
        n, a = _varint_at(data, a, end)
        pos = a + n
      if pos > end:
        raise ExampleDecodeError(f"field {f} of {pos - a} bytes runs past the end at byte {a}")
    else:
      f, wt, a, pos = _field_at(data, pos, end)
      if wt != _WT_LEN:
        raise ExampleDecodeError(f"Feature field {f} has wire type {wt}")
    if f == 1:  # BytesList: field 1 of any width is a value; a varint field is malformed
      spans = []
      while a < pos:
        if data[a] == 0x0A:  # field 1, LEN: a value
          x = a + 1
          if x < pos and data[x] < 0x80:  # a 1-byte length
            a = x + 1 + data[x]
            x += 1
          elif x + 2 < pos and data[x] >= 0x80 and data[x + 1] >= 0x80 and data[x + 2] < 0x80:  # 3 bytes
            a = x + 3 + ((data[x] & 0x7F) | ((data[x + 1] & 0x7F) << 7) | (data[x + 2] << 14))
            x += 3
          else:
            n, x = _varint_at(data, x, pos)
            a = x + n
          if a > pos:
            raise ExampleDecodeError(f"field 1 of {a - x} bytes runs past the end at byte {x}")
          spans.append((x, a))
          continue
        f2, w2, x, a = _field_at(data, a, pos)
        if w2 == _WT_VARINT:
          raise ExampleDecodeError(f"BytesList field {f2} has wire type {w2}")
        if f2 == 1:
          spans.append((x, a))
      kind, values = BYTES_LIST, spans if build else None
    elif f == 2:  # FloatList: packed or one float32 per field
      chunks = []
      while a < pos:
        f2, w2, x, a = _field_at(data, a, pos)
        if f2 != 1:
          continue
        if w2 == _WT_VARINT:
          raise ExampleDecodeError(f"FloatList field {f2} has wire type {w2}")
        if w2 == _WT_LEN:
          if (a - x) % 4:
            raise ExampleDecodeError("packed float list length is not a multiple of 4")
          chunks.append((x, a))
        elif w2 == _WT_I32:
          chunks.append((x, a))
      if build:
        view = memoryview(data)
        values = (np.concatenate([np.frombuffer(view[x:y], dtype="<f4") for x, y in chunks]).astype(np.float32)
                  if chunks else np.zeros(0, np.float32))
      else:
        values = None
      kind = FLOAT_LIST
    elif f == 3:  # Int64List: packed or one varint per field
      ints: list[int] = []
      while a < pos:
        if data[a] == 0x0A:  # field 1, LEN: packed values
          x = a + 1
          if x < pos and data[x] < 0x80:  # a 1-byte length
            a = x + 1 + data[x]
            x += 1
          elif x + 2 < pos and data[x] >= 0x80 and data[x + 1] >= 0x80 and data[x + 2] < 0x80:  # 3 bytes
            a = x + 3 + ((data[x] & 0x7F) | ((data[x + 1] & 0x7F) << 7) | (data[x + 2] << 14))
            x += 3
          else:
            n, x = _varint_at(data, x, pos)
            a = x + n
          if a > pos:
            raise ExampleDecodeError(f"field 1 of {a - x} bytes runs past the end at byte {x}")
          w2 = _WT_LEN
        else:
          f2, w2, x, a = _field_at(data, a, pos)
          if f2 != 1:
            continue
        if w2 == _WT_LEN:
          while x < a:
            v = data[x]
            if v < 0x80:
              x += 1
            else:
              v, x = _varint_at(data, x, a)
              v = _signed64(v)
            ints.append(v)
        elif w2 == _WT_VARINT:
          ints.append(_signed64(x))
      kind, values = INT64_LIST, ints if build else None
  return kind, values


class FeatureFinder:
  """Finds named features in serialized Examples without decoding the others: the loaders' fast path.

      finder = FeatureFinder(["image", "label", "file_name"])
      (kind, spans), (_, labels), _ = finder(record)   # kind BYTES_LIST, spans [(start, stop)]
      pixels = record[spans[0][0]:spans[0][1]]; label = labels[0]

  Every byte of the record is walked and checked exactly as `decode_example`
  checks it, so a record is refused (ExampleDecodeError) exactly when
  `decode_example` refuses it or lacks one of `keys` (Features.decode's
  "record lacks features"); what is found under a key is what
  `decode_example` returns for it (the last entry of a key repeated, the last
  list of a Feature holding several), in another form: byte values as
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
    self._slots = {k: i for i, k in enumerate(self.keys)}
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
    slots = self._slots
    found: list = [None] * len(slots)
    end = len(data)
    pos = 0
    try:
      while pos < end:  # Example: Features at field 1
        if data[pos] == 0x0A:  # field 1, LEN
          a = pos + 1
          if a < end and data[a] < 0x80:  # a 1-byte length
            pos = a + 1 + data[a]
            a += 1
          elif a + 2 < end and data[a] >= 0x80 and data[a + 1] >= 0x80 and data[a + 2] < 0x80:  # 3 bytes
            pos = a + 3 + ((data[a] & 0x7F) | ((data[a + 1] & 0x7F) << 7) | (data[a + 2] << 14))
            a += 3
          else:
            n, a = _varint_at(data, a, end)
            pos = a + n
          if pos > end:
            raise ExampleDecodeError(f"field 1 of {pos - a} bytes runs past the end at byte {a}")
        else:
          f, wt, a, pos = _field_at(data, pos, end)
          if f != 1 or wt != _WT_LEN:
            continue
        while a < pos:  # Features: map entries at field 1
          if data[a] == 0x0A:  # field 1, LEN: an entry
            e = a + 1
            if e < pos and data[e] < 0x80:  # a 1-byte length
              a = e + 1 + data[e]
              e += 1
            elif e + 2 < pos and data[e] >= 0x80 and data[e + 1] >= 0x80 and data[e + 2] < 0x80:  # 3 bytes
              a = e + 3 + ((data[e] & 0x7F) | ((data[e + 1] & 0x7F) << 7) | (data[e + 2] << 14))
              e += 3
            else:
              n, e = _varint_at(data, e, pos)
              a = e + n
            if a > pos:
              raise ExampleDecodeError(f"field 1 of {a - e} bytes runs past the end at byte {e}")
          else:
            f, wt, e, a = _field_at(data, a, pos)
            if f != 1 or wt != _WT_LEN:
              continue
          slot = key = None
          value, span, built = (NO_LIST, None), None, True
          while e < a:  # one entry: key = 1, value = 2
            tag = data[e]
            if tag == 0x0A or tag == 0x12:
              f = tag >> 3
              x = e + 1
              if x < a and data[x] < 0x80:  # a 1-byte length
                e = x + 1 + data[x]
                x += 1
              elif x + 2 < a and data[x] >= 0x80 and data[x + 1] >= 0x80 and data[x + 2] < 0x80:  # 3 bytes
                e = x + 3 + ((data[x] & 0x7F) | ((data[x + 1] & 0x7F) << 7) | (data[x + 2] << 14))
                x += 3
              else:
                n, x = _varint_at(data, x, a)
                e = x + n
              if e > a:
                raise ExampleDecodeError(f"field {f} of {e - x} bytes runs past the end at byte {x}")
            else:
              f, wt, x, e = _field_at(data, e, a)
              if wt != _WT_LEN:
                continue
            if f == 1:
              key = str(data[x:e], "utf-8")
              slot = slots.get(key)
            elif f == 2:
              built = key is None or slot is not None  # a value for a key not wanted is only checked
              value, span = _find_feature(data, x, e, built), (x, e)
          if key is None:
            raise ExampleDecodeError("feature map entry without a key")
          if slot is not None:
            found[slot] = value if built else _find_feature(data, span[0], span[1], True)
    except UnicodeDecodeError as e:
      raise ExampleDecodeError(f"feature key is not UTF-8: {e.reason} at byte {e.start}") from None
    if None in found:
      raise ExampleDecodeError(f"record lacks features {sorted(k for k, v in zip(self.keys, found) if v is None)}")
    return found
