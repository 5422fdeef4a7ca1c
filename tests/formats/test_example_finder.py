"""formats.example.FeatureFinder against decode_example: the same records refused, the same values found.

Property tests without TensorFlow: seeded random Examples (every list kind,
packed and unpacked numbers, repeated keys and lists, unknown fields of every
wire type at every level, entries without a value), then the same bytes
truncated, with bytes flipped, inserted and deleted. For each input the finder
must raise ExampleDecodeError exactly when decode_example does (or a key is
missing) and otherwise find what decode_example returns.
"""

from __future__ import annotations

import numpy as np
import pytest

from formats import example as ex
from formats.errors import ExampleDecodeError
from formats.example import BYTES_LIST, FLOAT_LIST, INT64_LIST, NO_LIST, FeatureFinder, decode_example
from formats.features import ClassLabel, Features, Tensor, Text

KEYS = ["image", "label", "name", "x", "é"]


def _tag(field: int, wt: int) -> bytes:
  return ex._varint((field << 3) | wt)


def _len(field: int, payload: bytes) -> bytes:
  return _tag(field, 2) + ex._varint(len(payload)) + payload


def _noise(rng: np.random.Generator) -> bytes:
  """An unknown field of a random wire type (field numbers the decoders skip at every level)."""
  field = int(rng.choice([4, 5, 9, 1000]))
  wt = int(rng.choice([0, 1, 2, 5]))
  if wt == 0:
    return _tag(field, 0) + ex._varint(int(rng.integers(0, 2**63)))
  if wt == 1:
    return _tag(field, 1) + rng.bytes(8)
  if wt == 5:
    return _tag(field, 5) + rng.bytes(4)
  return _len(field, rng.bytes(int(rng.integers(0, 6))))


def _maybe_noise(rng, p=0.15) -> bytes:
  return _noise(rng) if rng.random() < p else b""


def _odd_value(rng, p=0.04) -> bytes:
  """Now and then a list value of another wire type (some are skipped, some are errors, some are values)."""
  if rng.random() >= p:
    return b""
  wt = int(rng.choice([0, 1, 5]))
  return _tag(1, wt) + {0: ex._varint(int(rng.integers(0, 1000))), 1: rng.bytes(8), 5: rng.bytes(4)}[wt]


def _int_list(rng) -> bytes:
  values = rng.integers(-(2**63), 2**63 - 1, int(rng.integers(0, 5)), dtype=np.int64, endpoint=True).tolist()
  values += rng.integers(0, 300, int(rng.integers(0, 3))).tolist()
  if rng.random() < 0.5:  # packed
    packed = b"".join(ex._varint(v) for v in values)
    body = _len(1, packed) if values or rng.random() < 0.5 else b""
  else:  # one varint per field
    body = b"".join(_tag(1, 0) + ex._varint(v) for v in values)
  return _maybe_noise(rng) + body + _odd_value(rng) + _maybe_noise(rng)


def _float_list(rng) -> bytes:
  values = rng.normal(size=int(rng.integers(0, 5))).astype("<f4")
  if rng.random() < 0.1 and values.size:
    values.view("<u4")[0] = 0x7FA00001  # a signalling NaN: its bits must survive
  if rng.random() < 0.5:
    body = _len(1, values.tobytes()) if values.size or rng.random() < 0.5 else b""
  else:
    body = b"".join(_tag(1, 5) + v.tobytes() for v in values)
  return _maybe_noise(rng) + _odd_value(rng) + body + _maybe_noise(rng)


def _bytes_list(rng) -> bytes:
  parts = []
  for _ in range(int(rng.integers(0, 4))):
    r = rng.random()
    if r < 0.03:  # a payload as large as an image's (lengths of 3 bytes)
      parts.append(_len(1, rng.bytes(int(rng.integers(16_000, 40_000)))))
    elif r < 0.8:
      parts.append(_len(1, rng.bytes(int(rng.integers(0, 300)))))
    elif r < 0.9:
      parts.append(_tag(1, 1) + rng.bytes(8))  # decode_example takes fixed-width field 1 values as bytes
    else:
      parts.append(_tag(1, 5) + rng.bytes(4))
  return _maybe_noise(rng) + b"".join(parts) + _odd_value(rng) + _maybe_noise(rng)


def _feature(rng) -> bytes:
  lists = []
  for _ in range(1 if rng.random() < 0.85 else int(rng.integers(0, 3))):  # sometimes none, or several (the last wins)
    kind = int(rng.integers(1, 4))
    lists.append(_len(kind, {1: _bytes_list, 2: _float_list, 3: _int_list}[kind](rng)))
  if rng.random() < 0.1:
    lists.append(_len(7, rng.bytes(3)))  # an unknown list kind: skipped unread
  return b"".join(lists)


def _entry(rng, key: str) -> bytes:
  k = _len(1, key.encode("utf-8"))
  v = _len(2, _feature(rng)) if rng.random() < 0.95 else b""
  parts = [k, v] if rng.random() < 0.8 else [v, k]  # the value may come first
  return _maybe_noise(rng) + b"".join(parts) + _maybe_noise(rng)


def random_example(rng) -> bytes:
  keys = [k for k in KEYS if rng.random() < 0.8]
  if rng.random() < 0.2 and keys:
    keys.append(keys[0])  # a repeated key: the last entry wins
  rng.shuffle(keys)
  body = b"".join(_maybe_noise(rng) + _len(1, _entry(rng, k)) for k in keys)
  features = _len(1, body)
  if rng.random() < 0.1:  # Features split over two fields: their entries add up
    cut = int(rng.integers(0, len(keys) + 1))
    features = (_len(1, b"".join(_len(1, _entry(rng, k)) for k in keys[:cut]))
                + _maybe_noise(rng) + _len(1, b"".join(_len(1, _entry(rng, k)) for k in keys[cut:])))
  return _maybe_noise(rng) + features + _maybe_noise(rng)


def damaged(rng, data: bytes) -> bytes:
  """`data` truncated, with a byte flipped or set, or with bytes inserted or deleted."""
  b = bytearray(data)
  how = int(rng.integers(0, 5))
  at = int(rng.integers(0, len(b) + 1))
  if how == 0:
    return bytes(b[:at])
  if how == 1 and b:
    b[min(at, len(b) - 1)] ^= 1 << int(rng.integers(0, 8))
  elif how == 2 and b:
    b[min(at, len(b) - 1)] = int(rng.choice([0x00, 0x7F, 0x80, 0xFF, 0x0A, 0x12, 0x08]))
  elif how == 3:
    b[at:at] = rng.bytes(int(rng.integers(1, 4)))
  elif b:
    del b[at:at + int(rng.integers(1, 4))]
  return bytes(b)


def _same(data: bytes, keys, got, want) -> None:
  for key, (kind, values) in zip(keys, got):
    ref = want[key]
    if kind == NO_LIST:
      assert values is None and isinstance(ref, list) and ref == []
    elif kind == BYTES_LIST:
      assert isinstance(ref, list) and [data[a:b] for a, b in values] == ref
    elif kind == FLOAT_LIST:
      assert ref.dtype == values.dtype == np.float32 and ref.tobytes() == values.tobytes()
    else:
      assert kind == INT64_LIST and ref.dtype == np.int64 and np.array(values, np.int64).tolist() == ref.tolist()


def agree(data: bytes, keys=KEYS[:3]) -> bool:
  """Checks the finder against decode_example on `data`; returns whether the record was refused."""
  try:
    want = decode_example(data)
  except ExampleDecodeError:
    want = None  # any other exception type fails the test: decode_example refuses only with its own error
  refused = want is None or bool(set(keys) - set(want))
  try:
    got = FeatureFinder(keys)(data)
  except ExampleDecodeError:
    assert refused, "the finder refused a record decode_example reads"
    return True
  assert not refused, "the finder read a record decode_example refuses"
  _same(data, keys, got, want)
  return False


def test_values_of_records_the_schema_writes():
  features = Features({"image": Tensor((2, 3, 3), "uint8"), "label": ClassLabel(("a", "b", "c")),
                       "spacing": Tensor((3,), "float32", encoding="none"), "name": Text()})
  image = np.arange(18, dtype=np.uint8).reshape(2, 3, 3)
  data = features.encode({"image": image, "label": 2, "spacing": np.array([0.5, 1, -2], np.float32),
                          "name": "a.jpg"})
  (k1, spans), (k2, labels), (k3, spacing), (k4, names) = FeatureFinder(["image", "label", "spacing", "name"])(data)
  assert (k1, k2, k3, k4) == (BYTES_LIST, INT64_LIST, FLOAT_LIST, BYTES_LIST)
  assert [data[a:b] for a, b in spans] == [image.tobytes()] and labels == [2]
  assert spacing.tolist() == [0.5, 1.0, -2.0] and data[names[0][0]:names[0][1]] == b"a.jpg"
  with pytest.raises(ExampleDecodeError, match=r"record lacks features \['other'\]"):
    FeatureFinder(["image", "other"])(data)


def test_random_records_agree():
  rng = np.random.default_rng(0)
  refused = 0
  for _ in range(3000):
    data = random_example(rng)
    keys = [k for k in KEYS if rng.random() < 0.6]
    refused += agree(data, keys)
  assert 0 < refused < 3000  # both outcomes were exercised (keys are missing now and then)


def test_damaged_records_agree():
  rng = np.random.default_rng(1)
  refused = 0
  n = 0
  for _ in range(1500):
    data = random_example(rng)
    for _ in range(4):
      data = damaged(rng, data) if rng.random() < 0.7 else data
      refused += agree(data, KEYS)
      n += 1
  assert n // 5 < refused < n  # most damage is refused, some is not: both were compared


def test_every_truncation_of_a_record_agrees():
  rng = np.random.default_rng(2)
  for _ in range(40):
    data = random_example(rng)
    for cut in range(len(data)):
      agree(data[:cut], KEYS)


def test_truncations_and_flips_in_the_headers_of_an_image_sized_record_agree():
  """Lengths of 3 bytes (payloads of 16 KiB and more), read inline by the finder: every cut and flip near them."""
  rng = np.random.default_rng(3)
  features = Features({"image": Tensor((100, 100, 3), "uint8"), "label": ClassLabel(("a", "b")), "name": Text()})
  data = features.encode({"image": rng.integers(0, 256, (100, 100, 3), dtype=np.uint8), "label": 1, "name": "n"})
  image_at = data.index(b"image")
  near = [*range(0, 12), *range(image_at - 4, image_at + 20), *range(len(data) - 30, len(data))]
  for at in near:
    agree(data[:at], KEYS[:3])
    for bit in range(8):
      flipped = bytearray(data)
      flipped[at] ^= 1 << bit
      agree(bytes(flipped), KEYS[:3])


@pytest.mark.parametrize("data,why", [
    (b"\x0a\xff", "varint runs past the end"),
    (b"\x0a\x05abc", "runs past the end"),
    (b"\x0f", "unsupported wire type 7"),
    (b"\x0a" + b"\xff" * 10 + b"\x01", "varint longer than 10 bytes"),
    (_len(1, _len(1, _len(1, b"k"))), r"lacks features \['image'\]"),
    (_len(1, _len(1, _len(2, b""))), "entry without a key"),
    (_len(1, _len(1, _len(1, b"image") + _len(2, _tag(1, 0) + b"\x01"))), "Feature field 1 has wire type 0"),
    (_len(1, _len(1, _len(1, b"image") + _len(2, _len(1, _tag(1, 0) + b"\x01")))), "BytesList field 1"),
    (_len(1, _len(1, _len(1, b"image") + _len(2, _len(2, _len(1, b"abc"))))), "not a multiple of 4"),
    (_len(1, _len(1, _len(1, b"image") + _len(2, _len(2, _tag(1, 0) + b"\x01")))), "FloatList field 1"),
    (_len(1, _len(1, _len(1, b"image") + _len(2, _len(3, _len(1, b"\xff" * 9 + b"\x7f"))))), "int64 value of 70 bits"),
    (_len(1, _len(1, _len(1, b"image") + _len(2, _len(2, _tag(1, 5) + b"ab")))), "field 1 of 4 bytes runs past"),
    (_len(1, _len(1, _len(1, b"\xff"))), "not UTF-8"),
])
def test_malformed_records_are_refused_by_both(data, why):
  with pytest.raises(ExampleDecodeError, match=why):
    FeatureFinder(["image"])(data)
  if "lacks" not in why:
    with pytest.raises(ExampleDecodeError):
      decode_example(data)


def test_refuses_repeated_keys():
  with pytest.raises(ValueError, match="repeat"):
    FeatureFinder(["a", "a"])
