"""Finds half-installed packages in a virtual environment.

An install cut short (a full disk, a killed process) can leave a
``*.dist-info`` folder that still names the package and version while the
package's files are missing (pip writes a wheel's files one by one and its
``INSTALLER`` file last), so the next install sees the requirement as
satisfied and skips it: ``import tensorflow`` then fails with "No module named
'tensorflow.python'". This script finds such packages so that
``scripts/_env.sh`` can reinstall them.

A distribution is broken when its ``INSTALLER`` or ``RECORD`` file is
missing, or when a file its ``RECORD`` lists is not on disk.

Usage: python scripts/check_venv.py [--site-packages DIR]
Prints one ``name==version`` per broken distribution (what pip takes to
reinstall it) and exits 1 if there is any; prints nothing and exits 0 if none.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Broken:
  name: str
  version: str
  reason: str

  @property
  def requirement(self) -> str:
    return f"{self.name}=={self.version}"


def _metadata(info_dir: str) -> tuple[str, str] | None:
  """Name and version from METADATA's header, or None if it is unreadable."""
  name = version = None
  try:
    with open(os.path.join(info_dir, "METADATA"), encoding="utf-8", errors="replace") as f:
      for line in f:
        if not line.strip():
          break  # the header ends at the first blank line
        key, _, value = line.partition(":")
        if key == "Name":
          name = value.strip()
        elif key == "Version":
          version = value.strip()
  except OSError:
    return None
  return (name, version) if name and version else None


def _name_version_from_dir(entry: str) -> tuple[str, str]:
  stem = entry[: -len(".dist-info")]
  name, _, version = stem.partition("-")
  return name, version


def check(site_packages: str) -> Iterator[Broken]:
  """Yields each broken distribution under ``site_packages``, sorted by folder."""
  for entry in sorted(os.listdir(site_packages)):
    if not entry.endswith(".dist-info"):
      continue
    info_dir = os.path.join(site_packages, entry)
    meta = _metadata(info_dir)
    name, version = meta if meta else _name_version_from_dir(entry)
    if meta is None:
      yield Broken(name, version, "METADATA missing or without Name and Version")
      continue
    if not os.path.exists(os.path.join(info_dir, "INSTALLER")):
      yield Broken(name, version, "INSTALLER missing (the install stopped part-way)")
      continue
    record = os.path.join(info_dir, "RECORD")
    if not os.path.exists(record):
      yield Broken(name, version, "RECORD missing")
      continue
    missing = _missing_files(site_packages, record)
    if missing:
      more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
      yield Broken(name, version, f"{missing[0]} missing{more}")


def _missing_files(site_packages: str, record: str) -> list[str]:
  missing = []
  with open(record, newline="", encoding="utf-8") as f:
    for row in csv.reader(f):
      if not row or not row[0]:
        continue
      path = os.path.normpath(os.path.join(site_packages, row[0]))
      if not os.path.lexists(path):
        missing.append(row[0])
  return missing


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--site-packages",
    default=sysconfig.get_paths()["purelib"],
    help="the folder to check (default: this interpreter's site-packages)",
  )
  parser.add_argument("--explain", action="store_true", help="print why, to stderr")
  args = parser.parse_args(argv)
  if not os.path.isdir(args.site_packages):
    parser.error(f"--site-packages {args.site_packages!r} is not a folder")
  broken = list(check(args.site_packages))
  for b in broken:
    print(b.requirement)
    if args.explain:
      print(f"{b.requirement}: {b.reason}", file=sys.stderr)
  return 1 if broken else 0


if __name__ == "__main__":
  sys.exit(main())
