"""Command-line plumbing shared by the pipelines: strict flag parsing and exit codes.

A bad argument is a `UsageError`; `main` prints it as one line and exits 2
before anything is written. Unknown flags are errors too (Beam itself only
warns and drops them, so a typo would silently change a job).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import logging
import sys

from apache_beam.options.pipeline_options import PipelineOptions


class UsageError(ValueError):
  """A bad command-line argument; the message names the flag and the value."""


class _RaisingParser(argparse.ArgumentParser):
  def error(self, message):
    raise UsageError(message)


def _all_option_classes(cls=PipelineOptions):
  for sub in cls.__subclasses__():
    yield sub
    yield from _all_option_classes(sub)


def parse_options(argv: Sequence[str] | None, options_cls: type[PipelineOptions]) -> PipelineOptions:
  """Beam options from `argv`, rejecting flags no options class knows."""
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = _RaisingParser(allow_abbrev=False, add_help=False)
  seen = set()
  for cls in [options_cls, *_all_option_classes()]:
    if cls in seen:
      continue
    seen.add(cls)
    try:
      cls._add_argparse_args(parser)
    except argparse.ArgumentError:
      pass  # a flag defined by two classes; the first definition wins
  _, unknown = parser.parse_known_args(argv)
  if unknown:
    raise UsageError(f"unrecognized arguments: {' '.join(unknown)}")
  return options_cls(argv)


def main(run: Callable[[Sequence[str] | None], object], prog: str) -> None:
  """Runs `run(sys.argv[1:])`: one-line errors with exit status 2 for bad arguments."""
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  for noisy in ("apache_beam", "google", "urllib3", "absl"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  try:
    run(sys.argv[1:])
  except UsageError as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    sys.exit(2)
