"""COO edge lists → CSR, the building block of the graph pipeline. No Beam.

`csr_from_coo` is a stable counting sort: neighbours keep their input order,
which the pipeline makes the data set's file order, so the output is canonical.
It uses scipy's C++ `coo_tocsr` kernel (O(E + N), no duplicate summing) when
available and numpy's stable argsort otherwise.
"""

from __future__ import annotations

import numpy as np

try:  # scipy's private but long-stable kernel: the public API sums duplicate edges
  from scipy.sparse import _sparsetools
except ImportError:  # pragma: no cover - scipy is a dependency of the pipelines extra
  _sparsetools = None


def index_dtype(n: int) -> np.dtype:
  """int32 when every index fits, else int64."""
  return np.dtype(np.int32) if n < 2**31 - 1 else np.dtype(np.int64)


def csr_from_coo(src: np.ndarray, dst: np.ndarray, num_rows: int, num_cols: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(indptr int64 [num_rows+1], indices [E], order [E]) with indices = dst[order].

  Rows are `src` (0 <= src < num_rows); within a row, edges keep their input order.
  """
  e = len(src)
  num_cols = num_rows if num_cols is None else num_cols
  itype = index_dtype(max(e, num_rows + 1, num_cols))
  if _sparsetools is not None:
    indptr = np.empty(num_rows + 1, itype)
    indices = np.empty(e, itype)
    order = np.empty(e, itype)
    _sparsetools.coo_tocsr(num_rows, num_cols, e, np.asarray(src, itype), np.asarray(dst, itype),
                           np.arange(e, dtype=itype), indptr, indices, order)
    return indptr.astype(np.int64, copy=False), indices, order
  order = np.argsort(src, kind="stable").astype(itype)
  indptr = np.zeros(num_rows + 1, np.int64)
  np.cumsum(np.bincount(src, minlength=num_rows), out=indptr[1:])
  return indptr, np.asarray(dst, itype)[order], order


def interleave_inverse(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """OGB's add_inverse_edge: each edge followed by its reverse (read_graph_raw's layout)."""
  s = np.empty(2 * len(src), src.dtype)
  d = np.empty(2 * len(dst), dst.dtype)
  s[0::2], s[1::2] = src, dst
  d[0::2], d[1::2] = dst, src
  return s, d
