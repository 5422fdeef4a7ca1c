"""Listing and reading input files, local or gs://, whatever a file system holds.

Paths are data, never patterns: a folder named `scans[2024]` is listed as that
folder (no glob matching anywhere), and a gs:// folder is listed by its literal
object-name prefix. Listing is recursive and literal:

- local folders are walked with `os.scandir`; symbolic links are followed, and
  every real folder is listed once (a visited set of (st_dev, st_ino)), so a
  link loop ends as a reject "symbolic link loop"; a link from one part of
  the input (a class folder) into another is a reject too (its files would be
  listed twice, under two labels);
- anything that is not a regular file or a folder (FIFO, socket, device,
  dangling link, link loop, unreadable folder) is a reject with a fixed reason;
  no such entry is ever opened, so nothing blocks on a FIFO;
- names that are not valid UTF-8 are kept exactly (`InputFile.raw`, the bytes) and
  shown with Python's backslashreplace escapes (byte 0xff → `\\xff`) in
  `InputFile.path`, which is what records and errors/ hold; escapes are not
  injective, so a name whose escaped form equals a sibling's is a reject;
- gs:// objects whose names end with "/" are folder markers, not files.

`read_input` reads a whole file, up to a cap (`ReadPolicy.max_bytes`). Errors
that are properties of the file (not a regular file, vanished, permission
denied, over the cap) raise `Unreadable`, a reject.
Transient errors (formats.storage.retry: HTTP 408/429/5xx, timeouts, connection
resets or aborts) are retried by the toolkit's one retry policy, each request for up
to `budget` seconds (--transient_retry_seconds), then raise `TransientInputError`,
which fails the job: a network blip never becomes a reject.
Reasons never contain file contents or `str()` of an arbitrary exception.

Only the `ListFiles` transform at the end needs Beam.
"""

from __future__ import annotations

from collections.abc import Iterator
import dataclasses
import errno
import os
import stat
from typing import NamedTuple

import apache_beam as beam
from google.api_core import exceptions as gexc

from formats import naming
from formats.storage import files as fs
from formats.storage import retry
from pipelines.core.errors import UsageError, usage_errors

DEFAULT_TRANSIENT_RETRY_SECONDS = retry.DEFAULT_DEADLINE_S
TRANSIENT_RETRY_FLAG = "--transient_retry_seconds"
# Largest input file read; a larger one is a reject, found before it is read into memory.
DEFAULT_MAX_INPUT_BYTES = 2 << 30


class Unreadable(Exception):
  """The file itself cannot be read (not a regular file, vanished, permission denied).

  The message is the reject's reason, a fixed phrase.
  """


class TransientInputError(retry.RetryExhausted):
  """A transient error (5xx, timeout, connection reset) persisted past --transient_retry_seconds: the job fails."""


def retry_policy(budget: float) -> retry.Policy:
  """The retry policy of the inputs' reads and listings: the process's, with a deadline of `budget` seconds
  per request, giving up with TransientInputError.

  Args:
    budget: seconds (--transient_retry_seconds).

  Returns:
    The policy.
  """
  return retry.default().replace(timeout=budget, flag=TRANSIENT_RETRY_FLAG, error=TransientInputError)


@dataclasses.dataclass(frozen=True)
class ReadPolicy:
  """How inputs are read: the transient-error retry budget and the largest file accepted."""

  retry_seconds: float = DEFAULT_TRANSIENT_RETRY_SECONDS
  max_bytes: int = DEFAULT_MAX_INPUT_BYTES

  def __post_init__(self):
    if not 0 <= self.retry_seconds < float("inf"):
      raise ValueError(f"retry_seconds must be >= 0 and finite, got {self.retry_seconds}")
    if self.max_bytes < 1:
      raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes}")

  @property
  def retry_policy(self) -> retry.Policy:
    """The retry policy of the reads (`retry_policy(retry_seconds)`)."""
    return retry_policy(self.retry_seconds)

  def read(self, path: str) -> bytes:
    """`read_input` under this policy.

    Args:
      path: the file, local (as the OS gives it) or gs://.

    Returns:
      The file's bytes.

    Raises:
      Unreadable: the file's own fault (a reject), including one over `max_bytes`.
      TransientInputError: transient errors persisted past `retry_seconds`.
    """
    return read_input(path, self.retry_seconds, self.max_bytes)


class InputFile(NamedTuple):
  """A listed path, safe to carry in Beam elements (every str is valid UTF-8).

  `path` is printable: a local name that is not valid UTF-8 has its undecodable
  bytes as `\\xNN` escapes (Python's backslashreplace). Then `raw` holds the exact
  bytes of the path (os.fsencode); otherwise `raw` is empty and `path` is exact.
  """

  path: str
  raw: bytes = b""

  @classmethod
  def of(cls, location: str) -> InputFile:
    """From a path as the OS gives it (undecodable bytes as surrogate escapes).

    Args:
      location: a local path (surrogate escapes where not UTF-8) or gs://.

    Returns:
      The `InputFile`; `raw` is set only when the name is not valid UTF-8.
    """
    shown = printable(location)
    return cls(shown) if shown == location else cls(shown, os.fsencode(location))

  @property
  def location(self) -> str:
    """The path to open (with surrogate escapes where the name is not UTF-8)."""
    return os.fsdecode(self.raw) if self.raw else self.path

  @property
  def undecodable(self) -> bool:
    """True when the name is not valid UTF-8 (and `path` shows escapes)."""
    return bool(self.raw)


def printable(location: str) -> str:
  """`location` with bytes that are not UTF-8 as `\\xNN`; unchanged for UTF-8 names.

  Args:
    location: a path as the OS gives it, or gs://.

  Returns:
    A str that encodes as UTF-8.
  """
  if is_gcs(location):
    return location
  try:
    location.encode("utf-8")
    return location
  except UnicodeEncodeError:
    return os.fsencode(location).decode("utf-8", "backslashreplace")


def split_folder(name: str) -> str:
  """`name`, the name of an input's split folder, checked as a split name (`formats.naming.check_split_name`).

  Raises:
    UsageError: it is not a valid split name.
  """
  with usage_errors("split folder"):
    return naming.check_split_name(name)


def undecodable_warning(count: int) -> str:
  """The manifest's warning when `count` names are not valid UTF-8.

  Args:
    count: how many input names are not valid UTF-8.

  Returns:
    The warning, one sentence.
  """
  return (f"{count} input name{' is' if count == 1 else 's are'} not valid UTF-8; "
          "shown with \\xNN escapes of the bytes that are not (Python's backslashreplace)")


class Listing(NamedTuple):
  """Files found below a folder, and entries that are not files, with the reason.

  `sizes[i]` is the size in bytes of `files[i]` as listed (a plan's estimate;
  the file may change before it is read).
  """

  files: list[InputFile]
  rejects: list[tuple[InputFile, str]]
  sizes: list[int] = []  # noqa: RUF012 (never mutated: each listing builds its own)


is_gcs = fs.is_gcs


# ---------------------------------------------------------------- local listing

_KINDS = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"))


def _kind(mode: int) -> str:
  return next((name for test, name in _KINDS if test(mode)), f"file type {stat.S_IFMT(mode):o}")


def _os_reason(e: OSError) -> str:
  """A fixed phrase for an OS error (never its message, which may echo anything)."""
  if e.errno in (errno.EACCES, errno.EPERM):
    return "permission denied"
  if e.errno in (errno.ENOENT, errno.ENOTDIR):
    return "vanished (listed, then gone)"
  if e.errno == errno.ELOOP:
    return "symbolic link loop"
  return f"unreadable: {type(e).__name__} ({errno.errorcode.get(e.errno, e.errno)})"


def scan_dir(folder: str) -> tuple[list[str], list[str], list[tuple[str, str]]]:
  """(folder names, regular file names, (name, reason) of anything else) directly in a
  local `folder`, each sorted; symbolic links are judged by their target.

  Args:
    folder: a local folder.

  Returns:
    (folders, regular files, (name, reason) of the rest), names only.

  Raises:
    OSError: `folder` itself cannot be listed.
  """
  dirs, files, others = [], [], []
  with os.scandir(folder) as it:
    entries = sorted(it, key=lambda e: e.name)
  for e in entries:
    mode, reason = _mode_of(e.path, e.is_symlink())
    if mode is None:
      others.append((e.name, reason))
    elif stat.S_ISDIR(mode):
      dirs.append(e.name)
    elif stat.S_ISREG(mode):
      files.append(e.name)
    else:
      others.append((e.name, f"not a regular file ({_kind(mode)})"))
  return dirs, files, others


def _mode_of(path: str, is_link: bool) -> tuple[int | None, str]:
  """(st_mode of what `path` points to, "") or (None, the reason it cannot be known)."""
  try:
    return os.stat(path).st_mode, ""
  except OSError as e:
    if is_link and e.errno in (errno.ENOENT, errno.ENOTDIR):
      return None, "dangling symbolic link"
    return None, _os_reason(e)


def _ancestor_ids(folder: str) -> list[tuple[int, int]]:
  """(st_dev, st_ino) of `folder` and of every folder above its real path."""
  ids, path = [], os.path.realpath(folder)
  while True:
    st = os.stat(path)
    ids.append((st.st_dev, st.st_ino))
    parent = os.path.dirname(path)
    if parent == path:
      return ids
    path = parent


COLLIDING_NAME = "name not valid UTF-8, and its escaped form is another entry's name"
OTHER_PART_OF_INPUT = "folder already listed through another path"


def colliding(names: list[str]) -> set[str]:
  """The names (as the OS gives them) among siblings `names` that are not valid UTF-8 and whose
  printable form equals another sibling's: `\\xNN` escapes are not injective, so such a name is
  a reject, never a second entry under the same printable path (or class).

  Args:
    names: the entries of one folder, as the OS gives them.

  Returns:
    The names to reject (empty when every printable form is unique).
  """
  by_shown: dict[str, list[str]] = {}
  for n in names:
    by_shown.setdefault(printable(n), []).append(n)
  return {n for group in by_shown.values() if len(group) > 1 for n in group if printable(n) != n}


def _inside(path: str, folder: str) -> bool:
  return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def unreadable_folder(e: OSError) -> str:
  """The reject reason of a folder that cannot be listed."""
  return f"unreadable folder: {_os_reason(e)}"


LINE_BREAK_NAME = "folder name holds a line break (names are one line in labels.txt)"


def scan_input(root: str) -> tuple[list[str], list[str], list[tuple[str, str]]]:
  """`scan_level` of the input root itself.

  Raises:
    UsageError: the input cannot be listed.
  """
  try:
    return scan_level(root, root, [])
  except OSError as e:
    raise UsageError(f"--input {printable(root)!r} cannot be listed ({unreadable_folder(e)})") from None


def scan_level(folder: str, root: str, taken: list[str]) -> tuple[list[str], list[str], list[tuple[str, str]]]:
  """(folder names, file names, (name, reason) of other entries) directly in `folder`, one level of an input
  whose folders become splits or classes, each sorted.

  Locally a sub-folder is judged by where it leads: back to `folder`, `root`
  or above either is a link loop; into a folder already `taken` (real paths of
  the layout's folders so far, extended here: real folders before links) or
  one that holds it, it lists files twice (under another label). Both are odd
  entries, as are names whose escaped form collides and folder names with a
  line break. On gs:// there are no links and every name is UTF-8.

  Raises:
    OSError: `folder` itself cannot be listed.
  """
  if is_gcs(folder):
    dirs, files = fs.list_dir(folder)
    return dirs, files, []
  dirs, files, others = scan_dir(folder)
  clashes = colliding([*dirs, *files])
  others += [(n, COLLIDING_NAME) for n in sorted(clashes)]
  files = [f for f in files if f not in clashes]
  above = (os.path.realpath(folder), os.path.realpath(root))
  kept = set()
  for d in sorted(dirs, key=lambda d: os.path.islink(os.path.join(folder, d))):  # real folders first
    real = os.path.realpath(os.path.join(folder, d))
    if d in clashes:
      continue
    if "\n" in d:
      others.append((d, LINE_BREAK_NAME))
    elif any(_inside(a, real) for a in above):
      others.append((d, "symbolic link loop"))
    elif any(_inside(real, t) or _inside(t, real) for t in taken):
      others.append((d, OTHER_PART_OF_INPUT))
    else:
      taken.append(real)
      kept.add(d)
  return [d for d in dirs if d in kept], files, sorted(others)


def _list_local(root: str, input_root: str | None = None, max_files: int | None = None) -> Listing:
  """`input_root`: the whole input `root` is one part of; a link from `root` to a folder
  elsewhere in the input would list those files twice (under another label): a reject."""
  files: list[InputFile] = []
  sizes: list[int] = []
  rejects: list[tuple[InputFile, str]] = []
  visited = set(_ancestor_ids(root))  # a link to a folder above `root` is a loop too
  real_root = os.path.realpath(root)
  real_input = os.path.realpath(input_root) if input_root else None
  stack: list[tuple[str, frozenset]] = [(root, frozenset(visited))]  # (folder, its ancestors' ids)
  while stack:
    folder, ancestors = stack.pop()
    try:
      with os.scandir(folder) as it:
        entries = sorted(it, key=lambda e: e.name)
    except OSError as e:
      rejects.append((InputFile.of(folder), unreadable_folder(e)))
      continue
    below = []
    clashes = colliding([e.name for e in entries])
    for e in entries:
      if e.name in clashes:
        rejects.append((InputFile.of(e.path), COLLIDING_NAME))
        continue
      is_link = e.is_symlink()
      try:
        st = os.stat(e.path)
      except OSError:
        rejects.append((InputFile.of(e.path), _mode_of(e.path, is_link)[1]))
        continue
      if stat.S_ISDIR(st.st_mode):
        key = (st.st_dev, st.st_ino)
        if key in ancestors:
          rejects.append((InputFile.of(e.path), "symbolic link loop"))
        elif key in visited:
          rejects.append((InputFile.of(e.path), OTHER_PART_OF_INPUT))
        elif (is_link and real_input and _inside(real := os.path.realpath(e.path), real_input)
              and not _inside(real, real_root)):
          rejects.append((InputFile.of(e.path), OTHER_PART_OF_INPUT))
        else:
          visited.add(key)
          below.append((e.path, ancestors | {key}))
      elif stat.S_ISREG(st.st_mode):
        files.append(InputFile.of(e.path))
        sizes.append(st.st_size)
        if max_files is not None and len(files) > max_files:
          raise TooManyFiles(root, max_files)
      else:
        rejects.append((InputFile.of(e.path), f"not a regular file ({_kind(st.st_mode)})"))
    stack.extend(reversed(below))  # depth first, in name order
  return Listing(files, rejects, sizes)


# ---------------------------------------------------------------- gs://

def _list_gcs(root: str, budget: float, max_files: int | None = None) -> Listing:
  bucket, name = fs.split_gcs(root)
  return _list_gcs_prefix(bucket, name.rstrip("/") + "/" if name else "", budget, max_files)


def _list_gcs_prefix(bucket: str, prefix: str, budget: float, max_files: int | None = None) -> Listing:
  """Every object under exactly `prefix` (no folder rule applied: `a//` stays `a//`)."""
  root = f"gs://{bucket}/{prefix}"
  policy = retry_policy(budget)
  names = []
  for b in fs.gcs_client().list_blobs(bucket, prefix=prefix, retry=policy.named(f"listing {root}"),
                                      timeout=policy.attempt_timeout()):  # each page retried
    names.append((b.name, b.size or 0))
    if max_files is not None and len(names) > max_files:  # page by page: stop as soon as the limit is passed
      raise TooManyFiles(root, max_files)
  found = sorted(n for n in names if not n[0].endswith("/"))
  return Listing([InputFile(f"gs://{bucket}/{n}") for n, _ in found], [], [size for _, size in found])


def list_gcs_level(folder: str, budget: float = DEFAULT_TRANSIENT_RETRY_SECONDS) -> tuple[Listing, list[str]]:
  """The files directly in a gs:// `folder` (with sizes) and its sub-folders' exact prefixes: one level.

  What lets the workers list a big tree in parallel: each sub-folder is then
  listed whole (`list_tree`) by whichever worker gets it.

  Args:
    folder: a gs:// folder.
    budget: seconds to retry transient errors.

  Returns:
    (the level's files, sorted; the sub-folders as gs://bucket/<prefix ending in '/'>, sorted;
    list one whole with `list_gcs_prefix`).

  Raises:
    TransientInputError: listing kept failing for `budget` seconds.
  """
  bucket, name = fs.split_gcs(folder)
  prefix = name.rstrip("/") + "/" if name else ""
  policy = retry_policy(budget)
  it = fs.gcs_client().list_blobs(bucket, prefix=prefix, delimiter="/", retry=policy.named(f"listing {folder}"),
                                  timeout=policy.attempt_timeout())
  blobs = [(b.name, b.size or 0) for b in it]  # each page retried; the prefixes are known once the pages are read
  prefixes = sorted(it.prefixes)
  found = sorted(b for b in blobs if not b[0].endswith("/"))
  return (Listing([InputFile(f"gs://{bucket}/{n}") for n, _ in found], [], [size for _, size in found]),
          [f"gs://{bucket}/{p}" for p in prefixes])


def list_gcs_prefix(location: str, budget: float = DEFAULT_TRANSIENT_RETRY_SECONDS) -> Listing:
  """Every object under a sub-folder prefix from `list_gcs_level` (exactly that prefix).

  Args:
    location: gs://bucket/<prefix ending in '/'>.
    budget: seconds to retry transient errors.

  Returns:
    The files, sorted, with sizes.
  """
  bucket, prefix = fs.split_gcs(location)
  return _list_gcs_prefix(bucket, prefix, budget)


class TooManyFiles(Exception):
  """A listing passed its `max_files` (it stopped there)."""

  def __init__(self, folder: str, max_files: int):
    super().__init__(f"{folder}: more than {max_files} files")


def list_tree(folder: str, budget: float = DEFAULT_TRANSIENT_RETRY_SECONDS, input_root: str | None = None,
              max_files: int | None = None) -> Listing:
  """Every file below `folder` (recursively, literally), sorted, and the rejects.

      list_tree("/data/scans[2024]")  # the folder of that name, not a pattern

  Args:
    folder: the folder to list, local or gs://.
    budget: seconds to retry transient errors while listing gs://.
    input_root: the whole input `folder` is part of (a class folder's input): a
      link into another part of it is a reject.
    max_files: stop (TooManyFiles) as soon as more files than this are found; None: no limit.

  Returns:
    The `Listing`: files, and (entry, reason) of what is not a file.

  Raises:
    TransientInputError: listing gs:// kept failing for `budget` seconds.
    OSError: a local `folder` (or a folder above it) cannot be stat'ed.
    TooManyFiles: more than `max_files` files (the listing stopped there).
  """
  if is_gcs(folder):
    return _list_gcs(folder, budget, max_files)
  return _list_local(folder, input_root, max_files)


# ---------------------------------------------------------------- reading

def _too_large(size: int | str, max_bytes: int) -> Unreadable:
  return Unreadable(f"file too large: {size} bytes > {max_bytes} (--max_input_bytes)")


def _read_local(location: str, max_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> bytes:
  """The bytes of a regular file. O_NONBLOCK: opening a FIFO or a device never waits."""
  try:
    fd = os.open(location, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
      st = os.fstat(fd)
      if not stat.S_ISREG(st.st_mode):
        raise Unreadable(f"not a regular file ({'folder' if stat.S_ISDIR(st.st_mode) else _kind(st.st_mode)})")
      if st.st_size > max_bytes:
        raise _too_large(st.st_size, max_bytes)
      chunks, total = [], 0
      while chunk := os.read(fd, 1 << 24):
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:  # it grew while being read
          raise _too_large(f"more than {max_bytes}", max_bytes)
      return b"".join(chunks)
    finally:
      os.close(fd)
  except OSError as e:
    if retry.is_transient(e):  # a network file system's fault (a timeout, a stale handle): retried
      raise
    raise Unreadable(_os_reason(e)) from None


def _read_gcs(path: str, policy: retry.Policy, max_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> bytes:
  bucket, name = fs.split_gcs(path)
  try:
    # One byte past the cap tells a too-large object without downloading all of it.
    data = fs.gcs_client().bucket(bucket).blob(name).download_as_bytes(
        start=0, end=max_bytes, retry=policy.named(f"reading {path}"), timeout=policy.attempt_timeout())
    if len(data) > max_bytes:
      raise _too_large(f"more than {max_bytes}", max_bytes)
    return data
  except gexc.NotFound:
    raise Unreadable("vanished (listed, then gone)") from None
  except gexc.Forbidden:
    raise Unreadable("permission denied") from None


def read_input(path: str, budget: float = DEFAULT_TRANSIENT_RETRY_SECONDS,
               max_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> bytes:
  """The whole file at `path` (local with surrogate escapes, or gs://).

  Args:
    path: the file to read.
    budget: seconds to retry transient errors (the retry policy's deadline).
    max_bytes: the largest file accepted.

  Returns:
    The file's bytes.

  Raises:
    Unreadable: the file's own fault (a reject), including a file larger than `max_bytes`.
    TransientInputError: the job's: transient errors persisted for `budget` seconds.
  """
  policy = retry_policy(budget)
  if is_gcs(path):
    return _read_gcs(path, policy, max_bytes)
  return policy.call(lambda _: _read_local(path, max_bytes), f"reading {printable(path)}")


# ---------------------------------------------------------------- Beam

class _Level(NamedTuple):
  """A gs:// folder to list one level of (files, and the sub-folders to fan out)."""

  path: str


class _Prefix(NamedTuple):
  """A gs:// sub-folder from a `_Level`, listed whole by its exact prefix."""

  path: str


class _ListFolderFn(beam.DoFn):
  """(key, folder InputFile) → (key, InputFile) per file; (key, InputFile, reason) per reject;
  for a `_Level`, (key, sub-folder InputFile) per sub-folder on the `below` output."""

  REJECTS = "rejects"
  BELOW = "below"

  def __init__(self, budget: float, input_root: str | None, with_sizes: bool = False):
    self._budget = budget
    self._input_root = input_root
    self._with_sizes = with_sizes

  def process(self, element) -> Iterator:
    key, folder = element
    if isinstance(folder, _Level):  # a gs:// folder's first level: its files here, its sub-folders fanned out
      listing, below = list_gcs_level(folder.path, self._budget)
      for sub in below:
        yield beam.pvalue.TaggedOutput(self.BELOW, (key, _Prefix(sub)))
    elif isinstance(folder, _Prefix):
      listing = list_gcs_prefix(folder.path, self._budget)
    else:
      listing = list_tree(folder.location, self._budget, self._input_root)
    for f, size in zip(listing.files, listing.sizes, strict=True):
      yield (key, f, size) if self._with_sizes else (key, f)
    for f, reason in listing.rejects:
      yield beam.pvalue.TaggedOutput(self.REJECTS, (key, f, reason))


class ListFiles(beam.PTransform):
  """PCollection[(key, folder InputFile)] → files: (key, InputFile), rejects: (key, InputFile, reason).

  With `with_sizes`, files are (key, InputFile, size in bytes as listed).

      listed = folders | ListFiles(budget)
      listed.files, listed.rejects

  A local folder is listed by one worker. A gs:// folder is listed one level
  first (its files and sub-folders, with the delimiter); each sub-folder is then
  listed whole by whichever worker gets it, so an archive of a million objects in
  a thousand patient folders is listed by many workers at once. The files are
  spread over workers after.
  """

  def __init__(self, budget: float = DEFAULT_TRANSIENT_RETRY_SECONDS, input_root: str | None = None,
               with_sizes: bool = False):
    super().__init__()
    self._budget = budget
    self._input_root = input_root
    self._with_sizes = with_sizes

  def expand(self, folders):
    fn = _ListFolderFn(self._budget, self._input_root, self._with_sizes)
    # gs:// folders are listed one level first, and their sub-folders by whichever worker gets them:
    # a tree of a million objects is not listed by one worker (local folders are one worker's disk).
    levels = folders | "GcsLevels" >> beam.MapTuple(lambda key, f: (key, _Level(f.path) if is_gcs(f.path) else f))
    first = levels | "ListLevel" >> beam.ParDo(fn).with_outputs(_ListFolderFn.REJECTS, _ListFolderFn.BELOW,
                                                               main="files")
    below = (first[_ListFolderFn.BELOW]
             | "SpreadFolders" >> beam.Reshuffle()
             | "ListBelow" >> beam.ParDo(fn).with_outputs(_ListFolderFn.REJECTS, main="files"))
    return _Listed(
        (first.files, below.files) | "AllFiles" >> beam.Flatten(),
        (first[_ListFolderFn.REJECTS], below[_ListFolderFn.REJECTS]) | "AllRejects" >> beam.Flatten())


class _Listed(NamedTuple):
  files: beam.PCollection
  rejects: beam.PCollection
