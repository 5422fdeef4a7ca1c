"""The protocol buffer wire format, walked in place: varints and the fields of a message.

A message is a run of fields, each a varint tag (`tag(number, wire type)`:
number << 3 | wire type) and a value: a varint (VARINT), 8 or 4 bytes (I64,
I32), or a varint length and that many bytes (LEN: a nested message, bytes or
a packed list). `field` reads one field at a position and returns its tag and
where its value lies, so a caller walks a nested message as a span of its
parent, copying nothing:

    pos, end = 0, len(data)
    while pos < end:
      t, a, pos = protowire.field(data, pos, end)
      if t == protowire.tag(1, protowire.LEN):
        ...  # field 1 is data[a:pos]: walk [a, pos) the same way

Every read stays inside [pos, end) and every step advances, so any bytes end;
bytes that are not wire format raise WireFormatError, and each caller
re-raises it as its own error (formats.example, formats.arrayrecord_index).

The walker is the toolkit's own: protobuf's public Python API parses bytes
into generated message classes, copying every bytes field (an Example's image
once per nesting level) and keeping fields of an unexpected wire type as
unknown fields where the callers here refuse them; its wire decoder
(google.protobuf.internal.decoder) is internal.
"""

from __future__ import annotations

from formats.errors import WireFormatError

__all__ = ["I32", "I64", "LEN", "VARINT", "WireFormatError", "field", "tag", "varint"]

VARINT, I64, LEN, I32 = 0, 1, 2, 5


def tag(number: int, wire_type: int) -> int:
  """The tag of field `number` with `wire_type`, as `field` returns it (number = tag >> 3, wire type = tag & 7)."""
  return number << 3 | wire_type


def varint(data, pos: int, end: int) -> tuple[int, int]:
  """Reads the varint at `pos`, which must end before `end`.

  Args:
    data: bytes-like, indexable to ints.
    pos: where the varint starts.
    end: where the bytes it may use end.

  Returns:
    (value, the position after it). A varint has at most 10 bytes; their
    value may reach 70 bits, where protobuf keeps the low 64: a caller that
    wants an int64 checks the range.

  Raises:
    WireFormatError: the varint runs past `end` or past 10 bytes (`field` None).
  """
  result = shift = 0
  while True:
    if pos >= end:
      raise WireFormatError(f"varint runs past the end at byte {pos}")
    b = data[pos]
    pos += 1
    result |= (b & 0x7F) << shift
    if b < 0x80:
      return result, pos
    shift += 7
    if shift > 63:
      raise WireFormatError(f"varint longer than 10 bytes at byte {pos}")


def field(data, pos: int, end: int) -> tuple[int, int, int]:
  """Reads the field at `pos` < `end`: (tag, a, b).

  The field ends at b. A LEN, I64 or I32 value is data[a:b]; a VARINT's value
  is a itself. The tag is returned whole (callers compare it with `tag(...)`
  constants, one comparison for number and wire type). One-byte tags and
  varints and lengths of 1 to 3 bytes (any LEN value under 2 MiB) are read
  without a further call: this runs for every field of every record a loader
  reads.

  Args:
    data: bytes-like, indexable to ints.
    pos: where the field's tag starts (< end).
    end: where the message holding it ends.

  Returns:
    (tag, a, b) as above.

  Raises:
    WireFormatError: the field runs past `end` (`field` set), a varint is
      malformed (`field` None) or the wire type is a group or unknown (`field`
      and `wire_type` set).
  """
  t = data[pos]
  pos += 1
  if t >= 0x80:
    t, pos = varint(data, pos - 1, end)
  wire_type = t & 7
  if wire_type == LEN:
    if pos < end and data[pos] < 0x80:
      a = pos + 1
      b = a + data[pos]
    elif pos + 1 < end and data[pos + 1] < 0x80:
      a = pos + 2
      b = a + ((data[pos] & 0x7F) | (data[pos + 1] << 7))
    elif pos + 2 < end and data[pos + 2] < 0x80:
      a = pos + 3
      b = a + ((data[pos] & 0x7F) | ((data[pos + 1] & 0x7F) << 7) | (data[pos + 2] << 14))
    else:
      n, a = varint(data, pos, end)
      b = a + n
  elif wire_type == VARINT:
    if pos < end and data[pos] < 0x80:
      return t, data[pos], pos + 1
    value, b = varint(data, pos, end)
    return t, value, b
  elif wire_type == I64 or wire_type == I32:
    a = pos
    b = pos + (8 if wire_type == I64 else 4)
  else:
    raise WireFormatError(f"unsupported wire type {wire_type} at byte {pos}", field=t >> 3, wire_type=wire_type)
  if b > end:
    raise WireFormatError(f"field {t >> 3} of {b - a} bytes runs past the end at byte {a}", field=t >> 3)
  return t, a, b

