"""formats.protowire against protobuf's own parser, and its bounds checks on hostile bytes.

protobuf parses any message into an `Empty` keeping every field as an
unknown field (google.protobuf.unknown_fields, public): the walker must find
the same fields in random messages (tags and lengths of every width), and
refuse a cut message exactly when protobuf does.
"""

from __future__ import annotations

from google.protobuf import empty_pb2
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
import numpy as np
import pytest

from formats import protowire
from formats.errors import WireFormatError
from formats.example import _varint


def _field(number: int, wire_type: int, value) -> bytes:
  tag = _varint(protowire.tag(number, wire_type))
  if wire_type == protowire.VARINT:
    return tag + _varint(value)
  if wire_type == protowire.LEN:
    return tag + _varint(len(value)) + value
  return tag + value


def _random_messages(seed: int, n: int):
  """`n` random messages of `_random_message`, from a seeded generator."""
  rng = np.random.default_rng(seed)
  return [_random_message(rng) for _ in range(n)]


def _random_message(rng) -> tuple[bytes, list[tuple[int, int, object]]]:
  """Wire bytes and the fields they hold: (number, wire type, int for VARINT, bytes otherwise)."""
  fields = []
  for _ in range(int(rng.integers(0, 8))):
    number = int(rng.choice([1, 2, 15, 16, 2047, 2048, 2**29 - 1]))  # tags of 1 to 5 bytes
    wire_type = int(rng.choice([protowire.VARINT, protowire.I64, protowire.LEN, protowire.I32]))
    if wire_type == protowire.VARINT:
      value = [0, 1, 127, 128, 2**14, 2**35, 2**63, 2**64 - 1][int(rng.integers(0, 8))]  # exact past 2**53
    elif wire_type == protowire.LEN:
      value = rng.bytes(int(rng.choice([0, 1, 127, 128, 300, 16383, 16384, 20000])))  # lengths of 1 to 3 bytes
    else:
      value = rng.bytes(8 if wire_type == protowire.I64 else 4)
    fields.append((number, wire_type, value))
  return b"".join(_field(*f) for f in fields), fields


def _walk(data: bytes) -> list[tuple[int, int, object]]:
  out, pos = [], 0
  while pos < len(data):
    tag, a, pos = protowire.field(data, pos, len(data))
    out.append((tag >> 3, tag & 7, a if tag & 7 == protowire.VARINT else data[a:pos]))
  return out


def _protobuf(data: bytes) -> list[tuple[int, int, object]]:
  out = []
  for f in UnknownFieldSet(empty_pb2.Empty.FromString(data)):
    if f.wire_type in (protowire.I64, protowire.I32):  # protobuf gives fixed-width values as ints
      out.append((f.field_number, f.wire_type, f.data.to_bytes(8 if f.wire_type == protowire.I64 else 4, "little")))
    else:
      out.append((f.field_number, f.wire_type, f.data))
  return out


def _refused_by_protobuf(data: bytes) -> bool:
  try:
    empty_pb2.Empty.FromString(data)
  except DecodeError:
    return True
  return False


def test_random_messages_read_as_protobuf_reads_them():
  for data, fields in _random_messages(0, 300):
    assert _walk(data) == _protobuf(data) == fields


def test_a_length_past_two_mib_takes_the_varint_path():
  data = _field(1, protowire.LEN, bytes(3 << 20))
  assert _walk(data) == _protobuf(data)


def test_every_cut_of_a_message_is_refused_exactly_when_protobuf_refuses_it():
  for data, _ in _random_messages(1, 40):
    for cut in range(len(data)):
      refused = False
      try:
        _walk(data[:cut])
      except WireFormatError:
        refused = True
      assert refused == _refused_by_protobuf(data[:cut]), (data[:cut].hex(), refused)


def test_the_walker_reads_inside_its_span_only():
  data = b"\xff" + _field(1, protowire.LEN, b"abc") + b"\xff"
  assert protowire.field(data, 1, 6) == (protowire.tag(1, protowire.LEN), 3, 6)
  with pytest.raises(WireFormatError, match="field 1 of 3 bytes runs past the end at byte 3") as e:
    protowire.field(data, 1, 5)  # the message ends inside the value
  assert (e.value.field, e.value.wire_type) == (1, None)


@pytest.mark.parametrize("data, message, field, wire_type", [
    (b"\x80", "varint runs past the end at byte 1", None, None),
    (b"\x08", "varint runs past the end at byte 1", None, None),  # a VARINT field without its value
    (b"\x0a\x80\x80", "varint runs past the end at byte 3", None, None),  # a length cut short
    (b"\x08" + b"\xff" * 9 + b"\x81", "varint longer than 10 bytes at byte 11", None, None),
    (b"\x09" + bytes(7), "field 1 of 8 bytes runs past the end at byte 1", 1, None),
    (b"\x15abc", "field 2 of 4 bytes runs past the end at byte 1", 2, None),
    (b"\x0b", "unsupported wire type 3 at byte 1", 1, 3),  # a group
    (b"\xa7\x01", "unsupported wire type 7 at byte 2", 20, 7),
])
def test_hostile_bytes_are_refused_with_where(data, message, field, wire_type):
  with pytest.raises(WireFormatError, match=f"^{message}$") as e:
    protowire.field(data, 0, len(data))
  assert (e.value.field, e.value.wire_type) == (field, wire_type)
  assert isinstance(e.value, ValueError)


def test_varints_of_every_width():
  for value in (0, 1, 127, 128, 2**21 - 1, 2**21, 2**63, 2**64 - 1):
    data = _varint(value)
    assert protowire.varint(data + b"\x00", 0, len(data)) == (value, len(data))
  assert protowire.varint(b"\x80\x00", 0, 2) == (0, 2)  # overlong, as protobuf allows
