"""Errors shared by the pipelines' modules (no Beam)."""


class UsageError(ValueError):
  """A bad command-line argument; the message names the flag and the value."""


class InputDataError(ValueError):
  """The input data is malformed as a whole (not one bad record that can be set aside);
  the message names the file and the line or element."""
