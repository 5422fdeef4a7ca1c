"""Random access to the records of one split of an output, local or gs://. No framework.

`ShardedRecords(path, split)` reads the manifest, makes every shard local (a
gs:// shard is downloaded once into a cache and its SHA-256 checked against
the manifest), and serves record i as decoded numpy values. ArrayRecord shards
are read with array_record's reader (random access, GIL released); TFRecord
shards get an offset index built once by walking their framing, and records
are read with `os.pread` and CRC-checked. A damaged record raises
`CorruptRecordError` naming the shard and the record index.

`verify` says how much of a local shard is proven against the manifest before
it is read (loaders._verify): "sha256" (the default), "size" or "none".
"""

from __future__ import annotations

import bisect
import os
import threading

import numpy as np

from formats import arrayrecord, files, tfrecord
from formats.errors import CorruptRecordError
from formats.kinds import kind_of
from formats.manifest import MANIFEST_FILENAME, Manifest, ShardInfo
from loaders._verify import Verify, check_local_file, verify_level

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tpu_shards", "shards")

__all__ = ["CorruptRecordError", "ShardedRecords", "load_manifest", "local_shard", "tfrecord_index"]


def load_manifest(path: str) -> Manifest:
  manifest_path = files.join(path, MANIFEST_FILENAME)
  if not files.exists(manifest_path):
    raise FileNotFoundError(f"{manifest_path} not found: {path} is not a complete output")
  return Manifest.loads(files.read_bytes(manifest_path))


def local_shard(output: str, shard: ShardInfo, cache_dir: str | None, verify: Verify = "sha256",
                file_format: str = "") -> str:
  """A local path of `shard`: itself when local (checked at level `verify`), else a verified cached download.

  gs:// shards are checked by SHA-256 when they are downloaded, and their cached
  copies at level `verify` like local shards.
  """
  src = files.join(output, shard.path)
  if not files.is_gcs(output):
    check_local_file(src, shard.num_bytes, shard.sha256, verify,
                     locate=tfrecord_damage if file_format == "tfrecord" else None)
    return src
  verify_level(verify)
  for attempt in (1, 2):
    try:
      local = files.cached_copy(src, shard.sha256, cache_dir or DEFAULT_CACHE)
    except ValueError as e:
      raise CorruptRecordError(str(e)) from None
    try:
      # The cache outlives processes: its copy is checked like a local shard (by default
      # hashed once per process), and a copy damaged since its download is fetched again.
      check_local_file(local, shard.num_bytes, shard.sha256, verify)
      return local
    except CorruptRecordError:
      if attempt == 2:
        raise
      for stale in (local + ".verified", local):
        if os.path.exists(stale):
          os.remove(stale)
  raise AssertionError("unreachable")


def tfrecord_index(path: str) -> tuple[list[int], list[int]]:
  """(payload offsets, payload lengths) of a TFRecord file, from its framing alone.

  Reads only the 12-byte headers; raises CorruptRecordError naming the file,
  the record and the byte when a length checksum is wrong or the file is truncated.
  """
  offsets, lengths = [], []
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    pos = 0
    while pos < size:
      header = f.read(12)
      if len(header) < 12:
        raise CorruptRecordError(f"{path}: record {len(offsets)}: truncated header at byte {pos}")
      length = int.from_bytes(header[:8], "little")
      if tfrecord.masked_crc32c(header[:8]) != int.from_bytes(header[8:12], "little"):
        raise CorruptRecordError(f"{path}: record {len(offsets)}: bad length checksum at byte {pos}")
      if pos + 16 + length > size:
        raise CorruptRecordError(f"{path}: record {len(offsets)}: truncated data at byte {pos}")
      offsets.append(pos + 12)
      lengths.append(length)
      pos += 16 + length
      f.seek(pos)
  return offsets, lengths


def tfrecord_damage(path: str) -> str | None:
  """The first record of a TFRecord file whose framing or checksums are wrong, if any."""
  try:
    tfrecord_index(path)  # the framing first: no read is longer than the file
    for _ in tfrecord.read_file(path):
      pass
  except (CorruptRecordError, tfrecord.TFRecordCorruptError) as e:
    return str(e)[len(path) + 2:]  # "record N ...: reason"
  return None


class _TFRecordShard:
  """Random access to a TFRecord file through an index of record offsets."""

  def __init__(self, path: str):
    self.path = path
    self._offsets, self._lengths = tfrecord_index(path)
    self._fd = os.open(path, os.O_RDONLY)

  def __len__(self) -> int:
    return len(self._offsets)

  def read(self, i: int) -> bytes:
    n = self._lengths[i]
    data = os.pread(self._fd, n + 4, self._offsets[i])
    if len(data) != n + 4 or tfrecord.masked_crc32c(data[:n]) != int.from_bytes(data[n:], "little"):
      raise CorruptRecordError(f"{self.path}: record {i}: bad data checksum")
    return data[:n]


class _ArrayRecordShard:
  def __init__(self, path: str):
    self.path = path
    self._reader = arrayrecord.open_reader(path)
    self._n = self._reader.num_records()

  def __len__(self) -> int:
    return self._n

  def read(self, i: int) -> bytes:
    return self._reader.read([i])[0]


class ShardedRecords:
  """Records of one split, addressed 0..len-1 across its shards in order."""

  def __init__(self, path: str, split: str = "train", cache_dir: str | None = None, verify: Verify = "sha256"):
    verify_level(verify)
    self.path = path
    self.manifest = load_manifest(path)
    if self.manifest.file_format not in ("array_record", "tfrecord"):
      raise ValueError(f"{path} holds a {self.manifest.file_format} output, not record shards")
    if split not in self.manifest.splits:
      raise KeyError(f"{path} has no split {split!r} (it has {sorted(self.manifest.splits)})")
    self.split = split
    self.features = self.manifest.features
    self._shards_info = self.manifest.splits[split].shards
    self._paths = [local_shard(path, s, cache_dir, verify, self.manifest.file_format) for s in self._shards_info]
    self._starts = list(np.cumsum([0] + [s.num_records for s in self._shards_info]))
    self._open: dict[int, object] = {}
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return int(self._starts[-1])

  @property
  def kind(self) -> str:
    """The record kind of the output (formats.kinds.kind_of its manifest): "image", "volume", ..."""
    return kind_of(self.manifest)

  def _shard(self, k: int):
    with self._lock:
      if k not in self._open:
        reader = (_ArrayRecordShard if self.manifest.file_format == "array_record" else _TFRecordShard)(self._paths[k])
        if len(reader) != self._shards_info[k].num_records:
          raise CorruptRecordError(f"{self._paths[k]}: {len(reader)} records, the manifest says "
                                   f"{self._shards_info[k].num_records}")
        self._open[k] = reader
      return self._open[k]

  def raw(self, index: int) -> bytes:
    if not 0 <= index < len(self):
      raise IndexError(f"record {index} outside [0, {len(self)})")
    k = bisect.bisect_right(self._starts, index) - 1
    local = index - int(self._starts[k])
    shard = self._shard(k)
    try:
      return shard.read(local)
    except CorruptRecordError:
      raise
    except Exception as e:  # the C++ reader's own error: name the shard and record
      raise CorruptRecordError(f"{self._paths[k]}: record {local}: {type(e).__name__}: {e}") from None

  def __getitem__(self, index: int) -> dict:
    return self.get(index)

  def get(self, index: int, copy: bool = True) -> dict:
    """The decoded record, plus `record_index` (its position in the split).

    copy=False: payloads are views into the record's bytes (see Features.decode).
    """
    data = self.raw(index)
    try:
      return {**self.features.decode(data, copy=copy), "record_index": np.int64(index)}
    except ValueError as e:
      k = bisect.bisect_right(self._starts, index) - 1
      raise CorruptRecordError(f"{self._paths[k]}: record {index - int(self._starts[k])}: {e}") from None

  def __repr__(self) -> str:
    return f"ShardedRecords({self.path!r}, split={self.split!r}, records={len(self)})"
