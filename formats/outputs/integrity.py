"""How much of a local data file is proven against its manifest entry before it is read.

Levels, cheapest first:
  "none"    trust the manifest: nothing is checked up front.
  "size"    the file's size equals the manifest's `num_bytes`.
  "sha256"  also its full SHA-256 equals the manifest's (the default). Hashed
            once per file per process: the verified (path, device, inode, size,
            mtime, ctime, digest) is remembered, so reopening costs a stat,
            while a changed or replaced file is hashed again.
True and False are accepted for "sha256" and "none".
"""

from __future__ import annotations

from collections.abc import Callable
import os
import threading
from typing import Literal

from formats.errors import CorruptRecordError
from formats.manifest import sha256_file

__all__ = ["VERIFY_LEVELS", "Verify", "check_local_file", "remember_verified", "verify_level"]

VERIFY_LEVELS = ("sha256", "size", "none")
Verify = Literal["sha256", "size", "none"] | bool

# Local files whose SHA-256 matched, keyed by what a change to the file would change.
_verified: set[tuple] = set()
_verified_lock = threading.Lock()


def verify_level(verify: Verify) -> str:
  """The level `verify` names.

  Args:
    verify: one of VERIFY_LEVELS, or True ("sha256") or False ("none").

  Returns:
    One of VERIFY_LEVELS.

  Raises:
    ValueError: `verify` is neither.
  """
  if verify is True or verify is False:
    return "sha256" if verify else "none"
  if not isinstance(verify, str) or verify not in VERIFY_LEVELS:
    raise ValueError(f"verify must be one of {VERIFY_LEVELS} or a bool, got {verify!r}")
  return verify


def remember_verified(path: str, sha256: str) -> None:
  """Records that the local file at `path`, as it is now, has this SHA-256 (a download that checked every byte
  as it arrived), so that check_local_file does not hash it again in this process."""
  st = os.stat(path)
  with _verified_lock:
    _verified.add((os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, sha256))


def check_local_file(path: str, num_bytes: int, sha256: str, verify: Verify,
                     locate: Callable[[str], str | None] | None = None) -> None:
  """Checks that the local file at `path` is what the manifest describes.

  Args:
    path: a local file.
    num_bytes: its size according to the manifest.
    sha256: its hex SHA-256 according to the manifest.
    verify: the level (see VERIFY_LEVELS).
    locate: may name the first damaged record of a file whose digest differs
      (`FileAdapter.locate_damage`).

  Raises:
    CorruptRecordError: the size or digest differs; the message names the file.
    ValueError: `verify` is not a level.
  """
  level = verify_level(verify)
  if level == "none":
    return
  st = os.stat(path)
  if st.st_size != num_bytes:
    raise CorruptRecordError(f"{path}: {st.st_size} bytes, the manifest says {num_bytes}")
  if level == "size":
    return
  key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, sha256)
  with _verified_lock:
    if key in _verified:
      return
  digest = sha256_file(path)
  if digest != sha256:
    where = locate(path) if locate else None
    raise CorruptRecordError(f"{path}: sha256 {digest[:12]}... differs from the manifest's {sha256[:12]}... "
                             f"({where or 'a changed, replaced or damaged file'})")
  with _verified_lock:
    _verified.add(key)
