"""How much of a local data file is proven against its manifest entry before it is read.

Levels, cheapest first:
  "none"    trust the manifest: nothing is checked up front.
  "size"    the file's size equals the manifest's `num_bytes`.
  "sha256"  also its full SHA-256 equals the manifest's (the default). Hashed
            once per file per process: the verified (path, device, inode, size,
            mtime, ctime, digest) is remembered, so reloading costs a stat,
            while a changed or replaced file is hashed again.
True and False are accepted for "sha256" and "none". A file that differs
raises formats.errors.CorruptRecordError (loaders.CorruptRecordError). No
framework.
"""

from __future__ import annotations

from collections.abc import Callable
import os
import threading
from typing import Literal

from formats.errors import CorruptRecordError
from formats.manifest import sha256_file

VERIFY_LEVELS = ("sha256", "size", "none")
Verify = Literal["sha256", "size", "none"] | bool

# Local files whose SHA-256 matched, keyed by what a change to the file would change.
_verified: set[tuple] = set()
_verified_lock = threading.Lock()


def verify_level(verify: Verify) -> str:
  """The level `verify` names.

  Args:
    verify: a level in VERIFY_LEVELS, or True ("sha256") or False ("none").

  Returns:
    The level's name.

  Raises:
    ValueError: `verify` names no level.
  """
  if verify is True or verify is False:
    return "sha256" if verify else "none"
  if not isinstance(verify, str) or verify not in VERIFY_LEVELS:
    raise ValueError(f"verify must be one of {VERIFY_LEVELS} or a bool, got {verify!r}")
  return verify


def check_local_file(path: str, num_bytes: int, sha256: str, verify: Verify,
                     locate: Callable[[str], str | None] | None = None) -> None:
  """Proves that the local file at `path` is what the manifest describes.

  "size" compares the size; "sha256" also the full digest, computed once per
  process for each (path, device, inode, size, mtime, ctime): a changed or
  replaced file is hashed again.

  Args:
    path: the local file.
    num_bytes: its size according to the manifest.
    sha256: its digest according to the manifest.
    verify: the level (see verify_level).
    locate: locate(path) may name the first damaged record of a file whose digest differs.

  Raises:
    CorruptRecordError: the file's size or digest differs; the message names the file and both digests.
    ValueError: `verify` names no level.
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
