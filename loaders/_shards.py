"""Random access to the decoded records of one split of an output, local or gs://. No framework.

`ShardedRecords(path, split)` opens the output through formats.outputs.output (its
manifest, every shard made local and proven at the `verify` level: "sha256",
the default, "size" or "none"; a gs:// shard is downloaded once into a cache)
and serves record i as decoded numpy values plus its `record_index`. A
damaged record raises `CorruptRecordError` naming the shard and the record.
ArrayRecord shards are read by each thread through its own readers
(formats.outputs.output.SplitRecords). The manifest is read once: the records are
those of the generation it named, for the object's life, held by a lease
(loaders._pinning) until `close()` or collection.

`record_bytes(i)` gives record i where it lies in its shard (a
formats.record_slices.RecordBytes) for reads of parts of it (CT patches),
only where those reads rest on a proof of every byte: ArrayRecord shards
checked at verify="sha256" (each shard's digest against the manifest, once
per process; its size, mtime and ctime compared again before each record's
read). Otherwise it is None and records are read whole, each chunk's hash
checked by array_record's reader (docs/loaders.md).
"""

from __future__ import annotations

from collections.abc import Iterator
import os
import threading

import numpy as np

from formats.errors import CorruptRecordError
from formats.outputs.integrity import Verify, check_local_file, verify_level
from formats.outputs.output import DEFAULT_CACHE_ROOT, Output
from formats.storage import files
from formats.record_slices import ArrayRecordFile, RecordBytes
from loaders._pinning import DataIdentity, Pin, pin_output

__all__ = ["ShardedRecords", "check_fits"]


class ShardedRecords:
  """Records of one split, addressed 0..len-1 across its shards in order; a grain RandomAccessDataSource.

  A record's `index` is its position in the split, 0 <= index < len(self); the methods that take one
  raise IndexError outside that range.

  Attributes:
    path: the output folder.
    split: the split read.
    output: the opened output (formats.outputs.output.Output).
    manifest: its manifest.
    features: the records' schema.
    pin: what was opened and the lease that holds it (None when given an opened Output).
  """

  def __init__(self, path: str | Output, split: str = "train", cache_dir: str | None = None,
               verify: Verify = "sha256", *, lease: bool = True):
    """Opens one split and makes its shards local, each proven at level `verify`.

    Args:
      path: the output folder, local or gs://; or an Output already opened (formats.outputs.output.open_output),
        whose manifest is read as it is (the caller holds its lease).
      split: the split to read.
      cache_dir: where gs:// shards are cached (default ~/.cache/tpu_shards/shards).
      verify: "sha256" (default; True), "size" or "none" (False); see docs/loaders.md.
      lease: hold a lease on the generation read while this object lives (formats.outputs.leases; a read-only
        output logs one warning and is read without one). Ignored when `path` is an Output.

    Raises:
      NotAnOutputError: `path` has no manifest.json (a FileNotFoundError).
      ValueError: `verify` is not a level, or the output holds no record shards.
      KeyError: the output has no such split.
      CorruptRecordError: a shard differs from the manifest.
    """
    level = verify_level(verify)
    self.pin: Pin | None = None
    if isinstance(path, Output):
      self.output = path
    else:
      self.pin = pin_output(path, lease=lease, purpose=f"loaders.ShardedRecords {split}")
      self.output = self.pin.output
    self.path = self.output.path
    self.split = split
    self.manifest = self.output.manifest
    self.features = self.manifest.features
    self._records = self.output.open_records(split, cache_dir, verify)
    # Reads in parts rest on the SHA-256 of the whole shard: only then are they offered.
    self._in_parts = level == "sha256" and self.output.file_format == "array_record"
    self._files: dict[int, ArrayRecordFile | None] = {}  # shard -> its file for reads in parts (None: read whole)
    self._files_lock = threading.Lock()

  def __len__(self) -> int:
    return len(self._records)

  @property
  def identity(self) -> DataIdentity:
    """The data read: the output's generation and manifest digest, and the split."""
    return DataIdentity.of(self.output, self.split)

  @property
  def kind(self) -> str:
    """The record kind of the output (formats.kinds.kind_of its manifest): "image", "volume", ..."""
    return self.output.kind

  def raw(self, index: int) -> bytes:
    """The payload (a serialized tf.train.Example) of record `index`, read by this thread's reader of its shard.

    Raises:
      CorruptRecordError: the record is damaged; the message names the shard and the record.
    """
    k, local = self._records.locate(index)
    try:
      return self._records.shard(k).read(local)  # this thread's reader of the shard
    except CorruptRecordError:
      raise
    except Exception as e:  # the C++ reader's own error: name the shard and record
      raise CorruptRecordError(f"{self._records.paths[k]}: record {local}: {type(e).__name__}: {e}") from None

  def record_bytes(self, index: int) -> RecordBytes | None:
    """Record `index` where it lies in its shard, for reads of parts of it; None where it is read whole.

    None unless the shards are ArrayRecord files proven at verify="sha256", and
    for a shard written with options that do not store records as they are.

    Raises:
      CorruptRecordError: the shard changed since its digest was checked, or
        the record's chunk disagrees with the shard's footer (names shard and record).
    """
    if not self._in_parts:
      return None
    k, local = self._records.locate(index)
    file = self._files.get(k, False)
    if file is False:
      file = self._open_file(k)
    if file is None:
      return None
    file.check_unchanged(f"{self._records.paths[k]}: record {local}")
    return file.record(local)

  def _open_file(self, k: int) -> ArrayRecordFile | None:
    """Opens shard k for reads in parts: the file whose digest is the manifest's, as it is now."""
    with self._files_lock:
      if k in self._files:
        return self._files[k]
      path, info = self._records.paths[k], self.output.shards(self.split)[k]
      check_local_file(path, info.num_bytes, info.sha256, "sha256")  # remembered: a stat, unless it changed
      try:
        file = ArrayRecordFile(path)
      except ValueError as e:
        if isinstance(e, CorruptRecordError):
          raise
        file = None  # a layout read whole (compressed or transposed chunks)
      if file is not None:
        st = os.stat(path)
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) != file.identity:
          file.close()
          raise CorruptRecordError(f"{path}: changed while it was opened")
        if len(file) != info.num_records:
          file.close()
          raise CorruptRecordError(f"{path}: {len(file)} records, the manifest says {info.num_records}")
      self._files[k] = file
      return file

  def where(self, index: int) -> str:
    """"<shard path>: record <k>", the local path of record `index`'s shard and its number there, as errors name it."""
    return self._records.where(index)

  def close(self) -> None:
    """Closes every open reader (every thread's) and shard file and releases the lease; collection does both too.

    A later read opens readers again, without a lease.
    """
    self._records.close()
    with self._files_lock:
      files, self._files = self._files, {}
    for file in files.values():
      if file is not None:
        file.close()
    if self.pin is not None:
      self.pin.release()

  def __getitem__(self, index: int) -> dict:
    return self.get(index)

  def __iter__(self) -> Iterator[dict]:
    """Every record in order (an error reading one is raised, never taken for the end, as the sequence
    protocol would take an IndexError)."""
    for index in range(len(self)):
      yield self.get(index)

  def get(self, index: int, copy: bool = True) -> dict:
    """Record `index` decoded, plus its `record_index`.

    Args:
      index: the record.
      copy: False gives payloads as views into the record's bytes (see Features.decode).

    Returns:
      Feature name → value, and `record_index` (int64).

    Raises:
      CorruptRecordError: the record is damaged or does not parse against the schema.
    """
    return decoded(self, index, copy)

  def __repr__(self) -> str:
    return f"ShardedRecords({self.path!r}, split={self.split!r}, records={len(self)})"


def decoded(source, index: int, copy: bool = True) -> dict:
  """Record `index` of `source` (its `raw`, `where` and `features`) decoded, plus its `record_index`.

  Raises:
    CorruptRecordError: the record is damaged or does not parse against the schema; names the shard and record.
  """
  data = source.raw(index)
  try:
    return {**source.features.decode(data, copy=copy), "record_index": np.int64(index)}
  except ValueError as e:
    raise CorruptRecordError(f"{source.where(index)}: {e}") from None


def check_fits(output: Output, split: str, cache_dir: str | None, cache_limit_bytes: int | None) -> None:
  """Random access to a gs:// split copies all of it: refuse early (not after hours) when it cannot fit."""
  if not files.is_gcs(output.path):
    return
  total = sum(s.num_bytes for s in output.shards(split))
  if cache_limit_bytes is not None and total > cache_limit_bytes:
    where = f"cache_limit_bytes={cache_limit_bytes:,}"
  else:
    root = cache_dir or os.path.join(DEFAULT_CACHE_ROOT, "shards")
    missing = sum(s.num_bytes for s in output.shards(split)
                  if not os.path.exists(files.cache_path(output.shard_path(s), s.sha256, root) + ".verified"))
    free = files.free_bytes(root)
    if missing <= free:
      return
    where = f"the {free:,} bytes free in {root}"
  raise ValueError(f"{output.path} split {split!r} holds {total:,} bytes, more than {where}: random access needs "
                   f"all of it on local disk; pass window_shards=N to stream it in windows of N shards through a "
                   f"cache bounded by cache_limit_bytes (see docs/loaders.md)")
