"""Damaging files on purpose, for tests of what readers do with bad bytes."""

from __future__ import annotations


def flip_byte(path: str, at: int) -> None:
  """Inverts the byte at offset `at` of the file `path` in place (the size stays the same)."""
  with open(path, "r+b") as f:
    f.seek(at)
    byte = f.read(1)
    f.seek(at)
    f.write(bytes([byte[0] ^ 0xFF]))
