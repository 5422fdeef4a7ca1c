"""`Closing`: what every record reader of `formats` does with its `close()`, written once."""

from __future__ import annotations

from typing import Self


class Closing:
  """A mixin for an object with an idempotent `close()`: closed when its `with` block ends and when collected.

      with tfrecord.IndexedReader(path) as reader:
        record = reader.read(0)

  A subclass defines `close()`, safe to call twice and on an object whose
  `__init__` raised part way (the collector calls it then too).
  """

  def close(self) -> None:
    """Releases what the object holds; closing twice is fine."""
    raise NotImplementedError

  def __enter__(self) -> Self:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    self.close()
