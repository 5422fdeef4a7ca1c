"""Host-side feature gather for the neighbour samplers: reused buffers, threads, bfloat16, RAM or memmap.

The gather is most of a sampled batch's host time: random rows of a feature
table that may not fit in memory. `FeatureGather` makes it as cheap as it can
be on the host:

* the batch's `x` comes from a pool of reused buffers, so no batch pays for
  page-faulting a freshly allocated array. A buffer is reused only once
  nothing outside the pool refers to it any more (its reference count says
  so: the batch, a view of it, a torch tensor sharing it all count), so a
  consumer that holds batches for as long as it likes never sees one
  overwritten; the pool allocates instead of waiting.
* only the rows written by the buffer's previous batch and not by this one are
  zeroed (the padding stays zero without clearing the whole buffer).
* `threads` > 1 splits the rows over a thread pool (the copy releases the GIL).
* `dtype="bfloat16"` halves the bytes gathered and moved (ml_dtypes' bfloat16).
* `in_memory`: the table is copied into process memory when it fits (the
  default: when it takes at most half of the memory available, divided among
  the host's local processes), and is read through the memory-mapped file
  otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
import concurrent.futures
import os
import sys
import threading

import numpy as np

from loaders._host import local_processes

try:
  from loaders import _kernel
except ModuleNotFoundError as e:  # numba is the `graph` extra
  raise ModuleNotFoundError(f"the neighbour samplers need {e.name} (their compiled kernel): "
                            f"pip install -c constraints.txt -e '.[graph]'", name=e.name) from e

_RAM_FRACTION = 0.5  # in_memory=None: copy when the arrays take at most this share of the available memory
_COPY_CHUNK_BYTES = 64 << 20
_POOL_LIMIT = 16  # buffers kept for reuse; beyond that, batches still held by the consumer get fresh ones


def resolve_dtype(dtype) -> np.dtype | None:
  """The numpy dtype for a user's `feature_dtype` ("bfloat16" needs ml_dtypes); None stays None."""
  if dtype is None:
    return None
  if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(dtype)


def available_memory() -> int:
  """Bytes of memory available to new allocations (MemAvailable; physical memory where /proc is absent)."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def keep_in_memory(nbytes: int, in_memory: bool | None) -> bool:
  """Whether arrays of `nbytes` in all are copied into process memory.

  None decides: when they take at most half of the memory available, shared by the host's local processes
  (`local_processes()`: they start together, each sees the same free memory, and each would make its own
  copy, where the memory-mapped file is shared through the page cache).
  """
  if in_memory is None:
    return nbytes * local_processes() <= _RAM_FRACTION * available_memory()
  return bool(in_memory)


def to_memory(array: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
  """A copy of a (memory-mapped) array in process memory, converted to `dtype`, chunk by chunk."""
  out = np.empty(array.shape, dtype or array.dtype)
  if not out.size:  # an empty CSR's indices (a graph or relation without edges): nothing to copy
    return out
  flat_in, flat_out = array.reshape(len(array), -1) if array.ndim else array, out.reshape(len(out), -1)
  row_bytes = max(1, flat_in[0:1].nbytes) if len(array) else 1
  step = max(1, _COPY_CHUNK_BYTES // row_bytes)
  for lo in range(0, len(array), step):
    flat_out[lo:lo + step] = flat_in[lo:lo + step]
  return out


def _word_rows(a: np.ndarray) -> np.ndarray:
  """`a` [N, ...] (C-contiguous) as [N, row words] of the widest unsigned integer that divides a row's bytes."""
  row_bytes = int(np.prod(a.shape[1:], dtype=np.int64)) * a.dtype.itemsize
  width = next(w for w in (8, 4, 2, 1) if row_bytes % w == 0)
  return a.reshape(len(a), -1).view(np.uint8).view(f"<u{width}")


def check_csr(indptr: np.ndarray, indices: np.ndarray, num_cols: int, what: str) -> None:
  """Raises ValueError unless the CSR is well formed: the compiled kernel reads it without bounds checks.

  Args:
    indptr, indices: the CSR.
    num_cols: the number of nodes `indices` may name.
    what: the CSR's name in the message.
  """
  if len(indptr) == 0 or indptr[0] != 0 or indptr[-1] != len(indices) or (np.diff(indptr) < 0).any():
    raise ValueError(f"{what}: indptr is not a CSR's over {len(indices)} indices (first {indptr[:1]}, "
                     f"last {indptr[-1:]}, or decreasing)")
  if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= num_cols):
    raise ValueError(f"{what}: indices outside [0, {num_cols})")


def check_ids(ids: np.ndarray, n: int, what: str) -> None:
  """Raises ValueError unless every id is in [0, n) (the kernel would read or write outside its tables)."""
  if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n):
    raise ValueError(f"{what}: ids outside [0, {n}) (min {int(ids.min())}, max {int(ids.max())})")


def sampling_csrs(csrs: Sequence[tuple[str, np.ndarray, np.ndarray, int, int]], in_memory: bool | None
                  ) -> list[tuple[np.ndarray, np.ndarray]]:
  """The CSRs a sampler draws from, checked for the kernel (it has no bounds checks), in RAM when they fit.

  Args:
    csrs: (name in messages, indptr, indices, rows, columns) of each.
    in_memory: copy them into process memory (None: when all of them fit together; see keep_in_memory).

  Returns:
    (indptr, indices) of each, in order; an empty `indices` becomes one 0 (no position is drawn from an
    empty row).

  Raises:
    ValueError: an indptr with other than rows + 1 entries, or a CSR that check_csr refuses.
  """
  resident = keep_in_memory(sum(indptr.nbytes + indices.nbytes for _, indptr, indices, _, _ in csrs), in_memory)
  out = []
  for name, indptr, indices, rows, cols in csrs:
    indptr, indices = (to_memory(a) if resident else np.asarray(a) for a in (indptr, indices))
    if len(indptr) != rows + 1:
      raise ValueError(f"{name}: indptr has {len(indptr)} entries for {rows} rows")
    check_csr(indptr, indices, cols, name)
    out.append((indptr, indices if len(indices) else np.zeros(1, indices.dtype)))
  return out


class BufferPool:
  """Reused output arrays of one shape: `take(live)` gives an array that is zero outside `live`.

  The caller fills the `live` ranges (along `axis`) completely; everything else is zero, because the
  pool zeroes only what the array's previous use wrote and this one does not. An array is reused only
  once nothing outside the pool refers to it (its reference count says so: a batch dict, a view, a
  torch tensor sharing its memory all count), so a consumer may hold arrays as long as it likes;
  the pool allocates a new one meanwhile, and keeps at most `limit`.
  """

  def __init__(self, shape: Sequence[int], dtype, axis: int = 0, limit: int = _POOL_LIMIT):
    self.shape, self.dtype, self.axis, self.limit = tuple(shape), np.dtype(dtype), axis, limit
    self._buffers: list[np.ndarray] = []
    self._dirty: dict[int, list[tuple[int, int]]] = {}  # id(buffer) -> the ranges its last use wrote
    self._lock = threading.Lock()

  def take(self, live: Sequence[tuple[int, int]]) -> np.ndarray:
    """An array that is zero outside `live` (disjoint, increasing [lo, hi) ranges along `axis`).

    Args:
      live: the ranges the caller is about to fill.

    Returns:
      The array (of the pool's shape and dtype).
    """
    live = [(lo, hi) for lo, hi in live if hi > lo]
    with self._lock:
      for buf in self._buffers:
        # references: the list, this loop's variable and getrefcount's argument
        if sys.getrefcount(buf) <= 3:
          break
      else:
        buf = np.zeros(self.shape, self.dtype)
        if len(self._buffers) < self.limit:
          self._buffers.append(buf)
          self._dirty[id(buf)] = live  # what this first use writes is stale for the next
        return buf
      stale = self._dirty[id(buf)]
      self._dirty[id(buf)] = live
    view = np.moveaxis(buf, self.axis, 0)
    for lo, hi in stale:
      cursor = lo
      for a, b in live:
        if b <= cursor or a >= hi:
          continue
        if a > cursor:
          view[cursor:a] = 0
        cursor = max(cursor, b)
      if cursor < hi:
        view[cursor:hi] = 0
    return buf


def node_pools(nodes: int) -> tuple[BufferPool, BufferPool]:
  """The pools of a batch's `node_ids` [nodes] int64 and `node_mask` [nodes] bool."""
  return BufferPool((nodes,), np.int64), BufferPool((nodes,), bool)


def edge_pools(edges: int) -> tuple[BufferPool, BufferPool]:
  """The pools of one hop's `edge_index` [2, edges] int32 (filled along axis 1) and `edge_mask` [edges] bool."""
  return BufferPool((2, edges), np.int32, axis=1), BufferPool((edges,), bool)


class FeatureGather:
  """Gathers feature rows of the nodes of a batch into a pooled [rows, F] buffer, zero elsewhere."""

  def __init__(self, table: np.ndarray, rows: int, dtype=None, threads: int = 1, in_memory: bool | None = None):
    """Prepares gathers of `rows`-row batches from `table`.

    Args:
      table: the feature table [N, F...] (typically a memory-mapped .graphbin section).
      rows: rows of every gathered `x` (the node budget).
      dtype: the dtype of `x` (default: the table's); "bfloat16" halves it.
      threads: threads sharing each gather.
      in_memory: copy the table into process memory (None: when it fits; see keep_in_memory).

    Raises:
      ValueError: threads < 1.
    """
    if threads < 1:
      raise ValueError(f"gather threads must be >= 1, got {threads}")
    self.dtype = resolve_dtype(dtype) or np.dtype(table.dtype)
    self.rows, self.row_shape = rows, tuple(table.shape[1:])
    self.resident = keep_in_memory(len(table) * int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize,
                                   in_memory)
    self._convert = self.dtype != table.dtype and not self.resident  # converted per batch, after the copy
    self._table = to_memory(table, self.dtype) if self.resident else np.asarray(table)
    self._src = _word_rows(self._table)
    self._threads = threads
    self._pool = concurrent.futures.ThreadPoolExecutor(threads - 1, "feature-gather") if threads > 1 else None
    self._buffers = BufferPool((rows, *self.row_shape), self.dtype)

  def __call__(self, ids: np.ndarray, live: Sequence[tuple[int, int]]) -> np.ndarray:
    """`x`: row r is the feature row of node `ids[r]` for r in the `live` ranges, zero elsewhere.

    Args:
      ids: global ids of the batch's local nodes (only the live ranges are read).
      live: disjoint [lo, hi) row ranges holding real nodes, in increasing order.

    Returns:
      A [rows, F...] array of `dtype`, valid until the caller drops every reference to it.
    """
    x = self._buffers.take(live)
    rows_out = x.reshape(self.rows, -1)
    jobs = []
    for lo, hi in live:
      if hi <= lo:
        continue
      step = -(-(hi - lo) // self._threads)
      jobs += [(a, min(a + step, hi)) for a in range(lo, hi, step)]
    if self._pool is None or len(jobs) < 2:
      for lo, hi in jobs:
        self._copy(ids, rows_out, lo, hi)
    else:
      futures = [self._pool.submit(self._copy, ids, rows_out, lo, hi) for lo, hi in jobs[1:]]
      self._copy(ids, rows_out, *jobs[0])
      for f in futures:
        f.result()
    return x

  def _copy(self, ids: np.ndarray, rows_out: np.ndarray, lo: int, hi: int) -> None:
    if not self._convert:
      _kernel.gather_rows(self._src, ids, _word_rows(rows_out), lo, hi)
    else:
      rows_out[lo:hi] = self._table.reshape(len(self._table), -1)[np.clip(ids[lo:hi], 0, len(self._table) - 1)]
