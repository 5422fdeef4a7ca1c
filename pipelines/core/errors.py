"""Errors shared by the pipelines' modules (no Beam)."""

from __future__ import annotations

from collections.abc import Iterator
import contextlib


class UsageError(ValueError):
  """A bad command-line argument; the message names the flag and the value."""


class InputDataError(ValueError):
  """The input data is malformed as a whole (not one bad record that can be set aside);
  the message names the file and the line or element."""


@contextlib.contextmanager
def usage_errors(what: str = "") -> Iterator[None]:
  """Raises a ValueError of the block as a UsageError, its message after `what: `: a check of a flag's
  value that refuses it is the user's mistake (a UsageError passes unchanged).

      with usage_errors("--name"):
        return naming.check_dataset_name(name)
  """
  try:
    yield
  except UsageError:
    raise
  except ValueError as e:
    raise UsageError(f"{what}: {e}" if what else str(e)) from None
