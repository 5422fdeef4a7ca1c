"""The one way to open an output: its manifest, its shards' paths, local copies, random access, verification.

    out = open_output("gs://bucket/flowers")         # NotAnOutputError without manifest.json
    out.kind, out.file_format, sorted(out.splits)     # "image", "array_record", ["train", ...]
    out.generation, out.manifest_sha256               # "gen-20250101T000000Z-1a2b3c4d", the manifest's SHA-256
    local = out.local_copy(out.shards("train")[0])    # gs://: downloaded once, SHA-256 checked
    records = out.open_records("train")               # records[i] across the split's shards
    bad = out.verify()                                # re-reads every file; prints one line per bad one

Every reader (`formats.outputs.inspect`, the loaders, the graph loader, the
pipelines' checks of an existing output) goes through this module, so what
"an output" is (manifest.json written last, data files relative to it, each
with its size and SHA-256) is written down once. Paths are local or gs://; a
function's `path` or `output` string is the output folder.

An `Output` is what its manifest said when it was read: its shard paths name
that manifest's generation folder for as long as the object lives, whatever
is committed later. `Output.identity` (the generation and the SHA-256 of the
manifest's bytes as read) is how a reader names the data it opened.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Iterator, Mapping
import concurrent.futures
import dataclasses
import functools
import hashlib
import os
import resource
import sys
import threading
from typing import TextIO
import weakref

from formats import adapters, kinds, naming
from formats.storage import files, gcs_download
from formats.errors import CorruptRecordError, NotAnOutputError
from formats.features import Features
from formats.graphbin import GraphBin, check_graph, check_listed
from formats.outputs.integrity import Verify, check_local_file, remember_verified, verify_level
from formats.manifest import MANIFEST_FILENAME, FileInfo, Manifest, ShardInfo, SplitInfo, sha256_file

__all__ = [
    "DEFAULT_CACHE_ROOT", "Output", "OutputIdentity", "SplitRecords", "data_generations", "generation_of", "is_output",
    "iter_records", "load_manifest", "open_output", "verify", "verify_file", "verify_shard",
]

# Where local copies of gs:// data files are cached: <root>/shards for shards, <root>/graphs for other files.
DEFAULT_CACHE_ROOT = os.path.join(os.path.expanduser("~"), ".cache", "tpu_shards")


def is_output(path: str) -> bool:
  """Whether `path` holds a committed output (its manifest.json exists).

  Returns:
    True when `<path>/manifest.json` exists.
  """
  return files.exists(files.join(path, MANIFEST_FILENAME))


def load_manifest(path: str) -> Manifest:
  """The manifest of the output at `path`.

  Returns:
    Its parsed `manifest.json`.

  Raises:
    NotAnOutputError: there is no manifest.json ("<path>/manifest.json not
      found: <path> is not a complete output").
    ValueError: the manifest is malformed or of an unknown version.
    KeyError: the manifest lacks a required field.
  """
  return _read_manifest(path)[0]


def _read_manifest(path: str) -> tuple[Manifest, str]:
  """(the manifest of the output at `path`, the hex SHA-256 of its bytes as read); raises as `load_manifest`."""
  manifest_path = files.join(path, MANIFEST_FILENAME)
  try:
    data = files.read_bytes(manifest_path)
  except (FileNotFoundError, NotADirectoryError):
    raise NotAnOutputError(f"{manifest_path} not found: {path} is not a complete output") from None
  return Manifest.loads(data), hashlib.sha256(data).hexdigest()


def open_output(path: str) -> Output:
  """Opens the output at `path` (reads its manifest once; no data file is touched).

  The result keeps what that manifest said for its whole life: a later commit
  to `path` changes nothing in it (`Output.identity` names what was read).

  Returns:
    The `Output`.

  Raises:
    NotAnOutputError: there is no manifest.json.
    ValueError: the manifest is malformed.
    KeyError: the manifest lacks a required field.
  """
  manifest, digest = _read_manifest(path)
  return Output(path, manifest, manifest_sha256=digest)


def generation_of(manifest: Manifest) -> str | None:
  """The generation folder (`gen-<time>-<random>`) of the run that committed `manifest`.

  That run writes its rejected list into its own generation, so the folder of
  `rejected.path` names it; otherwise the one generation folder holding every
  data file. None for an output written before generations existed (data
  files at the root).

  Returns:
    The generation folder name, or None.
  """
  own = manifest.rejected.path.split("/", 1)[0]
  if "/" in manifest.rejected.path and naming.is_generation(own):
    return own
  folders = data_generations(manifest)
  return folders[0] if len(folders) == 1 else None


def data_generations(manifest: Manifest) -> tuple[str, ...]:
  """Every generation folder that holds a data file (shard or file) of `manifest`, sorted.

  One for an output a single run wrote; more when a run's manifest lists
  files of earlier generations (an appended output). A reader must keep all
  of them.

  Returns:
    The folder names.
  """
  paths = [s.path for split in manifest.splits.values() for s in split.shards] + [f.path for f in manifest.files]
  return tuple(sorted({p.split("/", 1)[0] for p in paths if "/" in p and naming.is_generation(p.split("/", 1)[0])}))


@dataclasses.dataclass(frozen=True)
class OutputIdentity:
  """Which data an opened output is: the generation its manifest names and the manifest's SHA-256.

  Two outputs with the same `manifest_sha256` hold the same data (a copy of
  an output, e.g. local and gs://, has the same identity).

  Attributes:
    generation: the generation folder of the run that committed the manifest (None: an output without
      generations).
    manifest_sha256: the hex SHA-256 of the bytes of manifest.json as read.
  """

  generation: str | None
  manifest_sha256: str

  def __str__(self) -> str:
    return f"{self.generation or 'an output without generations'} (manifest sha256 {self.manifest_sha256[:12]})"


@dataclasses.dataclass(frozen=True)
class Output:
  """A committed output: its folder and manifest, and the paths of its data files.

  Attributes:
    path: the output folder, local or gs://.
    manifest: its manifest.
    manifest_sha256: the hex SHA-256 of manifest.json's bytes as `open_output` read them (for an `Output`
      built from a `Manifest` instead: of `manifest.dumps()`).
  """

  path: str
  manifest: Manifest
  manifest_sha256: str = dataclasses.field(default="", compare=False)

  def __post_init__(self):
    if not self.manifest_sha256:
      object.__setattr__(self, "manifest_sha256", hashlib.sha256(self.manifest.dumps()).hexdigest())

  @property
  def generation(self) -> str | None:
    """The generation folder the manifest names (`generation_of`); None for an output without generations."""
    return generation_of(self.manifest)

  @property
  def identity(self) -> OutputIdentity:
    """The generation and the manifest's SHA-256: which data this output is."""
    return OutputIdentity(self.generation, self.manifest_sha256)

  @property
  def kind(self) -> str:
    """The record kind (formats.kinds.kind_of): the manifest's, or inferred from its features for an older one.

    Raises:
      ValueError: the manifest records no kind and none fits its features (see kinds.kind_of).
    """
    return kinds.kind_of(self.manifest)

  @property
  def file_format(self) -> str:
    """"array_record", "tfrecord" or "graphbin"."""
    return self.manifest.file_format

  @property
  def features(self) -> Features:
    """The records' schema."""
    return self.manifest.features

  @property
  def splits(self) -> Mapping[str, SplitInfo]:
    """Split name -> its shards, as the manifest lists them."""
    return self.manifest.splits

  @property
  def files(self) -> tuple[FileInfo, ...]:
    """The data files that are not shards (the .graphbin of a graph output)."""
    return self.manifest.files

  @property
  def adapter(self) -> adapters.FileAdapter:
    """The file adapter of the shards.

    Raises:
      ValueError: the output holds no record shards (a graph file output).
    """
    if self.file_format not in adapters.ADAPTERS:
      raise ValueError(f"{self.path} holds a {self.file_format} output, not record shards")
    return adapters.get(self.file_format)

  def shards(self, split: str) -> tuple[ShardInfo, ...]:
    """The shards of one split, in index order.

    Args:
      split: a split name.

    Returns:
      Their manifest entries.

    Raises:
      KeyError: the output has no such split.
    """
    if split not in self.splits:
      raise KeyError(f"{self.path} has no split {split!r} (it has {sorted(self.splits)})")
    return self.splits[split].shards

  def shard_path(self, info: ShardInfo | FileInfo) -> str:
    """The full path (local or gs://) of a data file the manifest lists.

    Args:
      info: a shard's or file's manifest entry.

    Returns:
      `<output>/<info.path>`.
    """
    return files.join(self.path, info.path)

  def local_copy(self, info: ShardInfo | FileInfo, cache_dir: str | None = None, verify: Verify = "sha256") -> str:
    """A local path of a data file, checked against the manifest.

    A local output's file is itself, checked at level `verify` (formats.outputs.integrity).
    A gs:// file is downloaded once into `cache_dir/<sha256[:16]>/<name>` by
    parallel ranged reads (formats.storage.gcs_download: pinned to one generation,
    resumable, the SHA-256 checked as the bytes arrive; two processes share one
    download); the cached copy is then checked at level `verify` like a local
    file, and fetched again once if it was damaged since.

    Args:
      info: a shard's or file's manifest entry.
      cache_dir: where gs:// copies are kept (default: DEFAULT_CACHE_ROOT/shards
        for shards, DEFAULT_CACHE_ROOT/graphs for other files).
      verify: "sha256" (default), "size" or "none" (or True / False).

    Returns:
      The local path.

    Raises:
      CorruptRecordError: the file differs from the manifest (a local TFRecord
        shard's message names its first damaged record).
      FileNotFoundError: the file is missing.
      ValueError: `verify` is not a level.
    """
    src = self.shard_path(info)
    if not files.is_gcs(src):
      locate = self.adapter.locate_damage if isinstance(info, ShardInfo) else None
      check_local_file(src, info.num_bytes, info.sha256, verify, locate=locate)
      return src
    verify_level(verify)
    cache = cache_dir or os.path.join(DEFAULT_CACHE_ROOT, "shards" if isinstance(info, ShardInfo) else "graphs")
    local = files.cache_path(src, info.sha256, cache)
    for attempt in (1, 2):
      if not os.path.exists(local + _VERIFIED):
        _fetch(src, info, local)
      try:
        # The cache outlives processes: its copy is checked like a local file (by default
        # hashed once per process), and a copy damaged since its download is fetched again.
        check_local_file(local, info.num_bytes, info.sha256, verify)
        return local
      except (CorruptRecordError, FileNotFoundError):
        if attempt == 2:
          raise
        for stale in (local + _VERIFIED, local + gcs_download.FETCHED_SUFFIX, local):
          if os.path.exists(stale):
            os.remove(stale)
    raise AssertionError("unreachable")

  def local_copies(self, infos, cache_dir: str | None = None, verify: Verify = "sha256") -> list[str]:
    """`local_copy` of each entry, gs:// files FETCH_PARALLEL at a time (each by parallel ranged reads).

    Args:
      infos: shard or file entries of this manifest.
      cache_dir, verify: as in `local_copy`.

    Returns:
      Their local paths, in order.

    Raises:
      As `local_copy`, the first error in the entries' order.
    """
    infos = list(infos)
    if not files.is_gcs(self.path) or len(infos) < 2:
      return [self.local_copy(i, cache_dir, verify) for i in infos]
    with concurrent.futures.ThreadPoolExecutor(FETCH_PARALLEL, thread_name_prefix="local-copies") as pool:
      futures = [pool.submit(self.local_copy, i, cache_dir, verify) for i in infos]
      try:
        return [f.result() for f in futures]
      except BaseException:
        for f in futures:
          f.cancel()
        raise

  def open_records(self, split: str, cache_dir: str | None = None, verify: Verify = "sha256") -> SplitRecords:
    """Random access to the records of one split (every shard made local first).

    Args:
      split: a split name.
      cache_dir: where gs:// shards are cached (see `local_copy`).
      verify: how each local shard is checked before it is read (see `local_copy`).

    Returns:
      The split's records, addressed 0..len-1 across its shards in order.

    Raises:
      ValueError: the output holds no record shards, or `verify` is not a level.
      KeyError: the output has no such split.
      CorruptRecordError: a shard differs from the manifest.
    """
    return SplitRecords(self, split, cache_dir, verify)

  def verify(self, out: TextIO | None = None) -> int:
    """Re-reads every data file and checks it against the manifest (see `verify`).

    Args:
      out: where the report goes (default stdout).

    Returns:
      The number of bad files.
    """
    return verify(self.path, self.manifest, out)


class _ThreadReaders:
  """One thread's open readers of one split: shard number -> reader, least recently used first.

  Held by the thread (a threading.local of the SplitRecords) and closed when
  it is dropped: when the thread ends, or the SplitRecords is closed or collected.
  """

  __slots__ = ("readers", "generation", "__weakref__")

  def __init__(self, generation: int):
    self.readers: collections.OrderedDict[int, adapters.RandomAccessFile] = collections.OrderedDict()
    self.generation = generation

  def close(self) -> None:
    readers, self.readers = self.readers, collections.OrderedDict()
    for reader in readers.values():
      reader.close()

  def __del__(self):
    self.close()


def _open_files_budget() -> int:
  """How many readers a split may hold open at once: half of this process's file descriptor limit."""
  try:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
  except (OSError, ValueError):
    return 512
  return 1 << 20 if soft == resource.RLIM_INFINITY else max(16, soft // 2)


# gs:// files of one output fetched at once by local_copies, each by DOWNLOAD_OPTIONS' parallel ranged reads (32
# requests and 64 MiB in flight: sized for GCS's 20-50 ms to the first byte and ~100 MB/s per connection).
FETCH_PARALLEL = 4
DOWNLOAD_OPTIONS = gcs_download.DownloadOptions(streams=8, chunk_bytes=2 << 20, progress=False)
_VERIFIED = ".verified"  # beside a cached copy: its SHA-256 matched the manifest when it was fetched


def _fetch(src: str, info: ShardInfo | FileInfo, local: str) -> None:
  """Downloads a gs:// data file into the cache, its SHA-256 checked as the bytes arrive; then marks it verified.

  Raises:
    CorruptRecordError: the bytes differ from the manifest (nothing is kept).
    FileNotFoundError: the manifest lists the file but the bucket does not hold it.
  """
  try:  # looked up (one request): its generation lets an interrupted download resume
    obj = gcs_download.remote_object(src)
  except FileNotFoundError:
    raise FileNotFoundError(f"{src}: the manifest lists this file but it is gone") from None
  if obj.size != info.num_bytes:
    raise CorruptRecordError(f"{src}: {obj.size} bytes, the manifest says {info.num_bytes}")
  gcs_download.download(obj, local, info.sha256, options=DOWNLOAD_OPTIONS)
  with open(local + _VERIFIED, "w"):
    pass
  remember_verified(local, info.sha256)  # every byte was hashed as it arrived: not again in this process


class SplitRecords:
  """The records of one split of an output, addressed 0..len-1 across its shards in order.

  Readers are opened lazily; a shard whose record count differs from the
  manifest is refused when opened. A format whose reader threads may share
  (`FileAdapter.shared_reads`: TFRecord's os.pread) has one reader per shard.
  Otherwise (ArrayRecord) every thread reads through its own reader of each
  shard it touches, so that no thread waits on another's read: a thread's
  readers are closed when the thread ends, and its least recently used ones
  when the threads together would hold more than half the process's file
  descriptor limit. `close()` (or garbage collection) closes every reader;
  it must not race reads in flight, and a later read opens readers again.
  """

  def __init__(self, output: Output, split: str, cache_dir: str | None = None, verify: Verify = "sha256"):
    verify_level(verify)
    self.output = output
    self.split = split
    self._adapter = output.adapter
    self._infos = output.shards(split)
    self.paths = output.local_copies(self._infos, cache_dir, verify)
    self._starts = [0]
    for s in self._infos:
      self._starts.append(self._starts[-1] + s.num_records)
    self._open: dict[int, adapters.RandomAccessFile] = {}  # shared_reads formats: one reader per shard
    self._local = threading.local()  # otherwise: .readers, this thread's _ThreadReaders
    self._threads: weakref.WeakSet[_ThreadReaders] = weakref.WeakSet()
    self._generation = 0  # bumped by close(): older _ThreadReaders are closed
    self._budget = _open_files_budget()
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return self._starts[-1]

  def locate(self, index: int) -> tuple[int, int]:
    """(shard number, record number in that shard) of record `index` of the split.

    Args:
      index: 0 <= index < len(self).

    Returns:
      Where the record lies.

    Raises:
      IndexError: `index` is outside the split.
    """
    if not 0 <= index < len(self):
      raise IndexError(f"record {index} outside [0, {len(self)})")
    k = bisect.bisect_right(self._starts, index) - 1
    return k, index - self._starts[k]

  def where(self, index: int) -> str:
    """"<shard path>: record <k>", which names record `index` of the split in error messages.

    Args:
      index: 0 <= index < len(self).

    Returns:
      The local path of its shard and its record number there.

    Raises:
      IndexError: `index` is outside the split.
    """
    k, local = self.locate(index)
    return f"{self.paths[k]}: record {local}"

  def _open_reader(self, k: int) -> adapters.RandomAccessFile:
    reader = self._adapter.open_random(self.paths[k])
    if len(reader) != self._infos[k].num_records:
      reader.close()
      raise CorruptRecordError(f"{self.paths[k]}: {len(reader)} records, the manifest says "
                               f"{self._infos[k].num_records}")
    return reader

  def shard(self, k: int) -> adapters.RandomAccessFile:
    """The open reader of shard `k` for the calling thread (shared by all threads when the format allows).

    Args:
      k: the shard's number in the split.

    Returns:
      Its reader.

    Raises:
      CorruptRecordError: its record count differs from the manifest, or its framing is damaged.
    """
    if self._adapter.shared_reads:
      with self._lock:
        if k not in self._open:
          self._open[k] = self._open_reader(k)
        return self._open[k]
    mine = getattr(self._local, "readers", None)
    if mine is None or mine.generation != self._generation:
      with self._lock:
        mine = self._local.readers = _ThreadReaders(self._generation)
        self._threads.add(mine)
    reader = mine.readers.get(k)
    if reader is not None:
      mine.readers.move_to_end(k)
      return reader
    reader = mine.readers[k] = self._open_reader(k)
    keep = max(2, self._budget // max(1, len(self._threads)))
    while len(mine.readers) > keep:  # this thread's least recently used; others trim their own
      mine.readers.popitem(last=False)[1].close()
    return reader

  def read(self, index: int) -> bytes:
    """The bytes of record `index` of the split.

    Args:
      index: 0 <= index < len(self).

    Returns:
      The record's payload.

    Raises:
      IndexError: `index` is outside the split.
      CorruptRecordError: the record is damaged; the message names the shard and the record.
    """
    k, local = self.locate(index)
    return self.shard(k).read(local)

  def close(self) -> None:
    """Closes every open reader, every thread's included (not while reads are in flight)."""
    with self._lock:
      self._generation += 1
      threads = list(self._threads)
      self._threads = weakref.WeakSet()
      for reader in self._open.values():
        reader.close()
      self._open.clear()
    for mine in threads:
      mine.close()

  def __del__(self):
    if hasattr(self, "_lock"):
      self.close()

  def __repr__(self) -> str:
    return f"SplitRecords({self.output.path!r}, split={self.split!r}, records={len(self)})"


# --------------------------------------------------------------------------- verification


def iter_records(local_path: str, file_format: str) -> Iterator[bytes]:
  """Every record of a local shard, in order, checked as its format allows.

  Args:
    local_path: a local shard file.
    file_format: its format ("array_record" or "tfrecord").

  Returns:
    An iterator over the records' bytes.

  Raises:
    ValueError: `file_format` is not a record format.
  """
  return adapters.get(file_format).read_file(local_path)


def verify_shard(output: str, shard: ShardInfo, file_format: str, features: Features) -> list[str]:
  """Problems found in one shard: presence, size, SHA-256, record count, and every record decoded.

  A gs:// shard is downloaded to a temporary file.

  Args:
    shard: the shard's manifest entry.
    file_format: the shards' format.
    features: the schema every record must decode with.

  Returns:
    One line per problem; empty when the shard matches the manifest.
  """
  return _verify_entry(output, shard, lambda local: _record_problems(local, shard, file_format, features))


def verify_file(output: str, info: FileInfo, manifest: Manifest | None = None) -> list[str]:
  """Problems of a non-shard data file (a .graphbin): presence, size, SHA-256, section checksums, and what the
  loaders refuse (formats.graphbin.check_graph, and the node counts `manifest`'s graph entry states).

  Args:
    info: the file's manifest entry.
    manifest: the output's manifest (None: the node counts are not compared).

  Returns:
    One line per problem; empty when the file matches the manifest.
  """
  listed = ((manifest.graph if manifest is not None else None) or {}).get("num_nodes")
  check = functools.partial(_graphbin_problems, listed=listed)
  return _verify_entry(output, info, check if info.kind == "graphbin" else None)


def _verify_entry(
    output: str, entry: ShardInfo | FileInfo, check_content: Callable[[str], list[str]] | None
) -> list[str]:
  """Problems of one data file of an output: "missing", else its size and SHA-256, then `check_content`'s.

  `check_content` gets the local copy (a gs:// file is downloaded once for all the checks).
  """
  src = files.join(output, entry.path)
  if not files.exists(src):
    return ["missing"]
  problems = []
  with files.LocalCopy(src) as local:
    size = os.path.getsize(local)
    if size != entry.num_bytes:
      problems.append(f"size {size} != manifest {entry.num_bytes}")
    digest = sha256_file(local)
    if digest != entry.sha256:
      problems.append(f"sha256 {digest[:12]}... != manifest {entry.sha256[:12]}...")
    if check_content is not None:
      problems += check_content(local)
  return problems


def _record_problems(local: str, shard: ShardInfo, file_format: str, features: Features) -> list[str]:
  """Problems of a local shard's records: the first that does not decode, a read error, a wrong count."""
  problems = []
  n = 0
  try:
    for n, record in enumerate(iter_records(local, file_format), start=1):
      try:
        features.decode(record)
      except ValueError as e:
        problems.append(f"record {n - 1}: {e}")
        break
  except Exception as e:  # a C++ reader error or a framing error: name it, do not crash
    return [f"unreadable after record {n}: {e}"]
  if n != shard.num_records:
    problems.append(f"{n} records != manifest {shard.num_records}")
  return problems


def _graphbin_problems(local: str, listed: Mapping[str, int] | None) -> list[str]:
  """Problems of a local .graphbin file: its header and section checksums, then the checks a loader makes
  (a file whose CRCs are right can still contradict itself: an index past the node count)."""
  try:
    gb = GraphBin(local, verify=True)
    check_graph(gb)
    check_listed(gb, listed)
  except ValueError as e:
    return [str(e)]
  return []


def verify(output: str, manifest: Manifest, out: TextIO | None = None) -> int:
  """Checks every shard and data file of an output against its manifest.

  Prints "BAD <path>: <problems>" for each bad file, then
  "verify: <good>/<total> shards OK" (or "files OK" for a graph output).

  Args:
    manifest: its manifest.
    out: where the report goes (default stdout).

  Returns:
    The number of bad files.
  """
  out = out or sys.stdout
  bad = 0
  for _, split in sorted(manifest.splits.items()):
    for shard in split.shards:
      problems = verify_shard(output, shard, manifest.file_format, manifest.features)
      if problems:
        bad += 1
        print(f"BAD {shard.path}: {'; '.join(problems)}", file=out)
  for info in manifest.files:
    problems = verify_file(output, info, manifest)
    if problems:
      bad += 1
      print(f"BAD {info.path}: {'; '.join(problems)}", file=out)
  total = sum(len(s.shards) for s in manifest.splits.values()) + len(manifest.files)
  print(f"verify: {total - bad}/{total} {'files' if manifest.files else 'shards'} OK", file=out)
  return bad
