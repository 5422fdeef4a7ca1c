"""Errors shared by the pipelines' pure modules (no Beam)."""


class InputDataError(ValueError):
  """The input data is malformed as a whole (not one bad record that can be set aside);
  the message names the file and the line or element."""
