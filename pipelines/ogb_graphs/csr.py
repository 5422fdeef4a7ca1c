"""COO edge lists → CSR, the building block of the graph pipeline. No Beam.

`csr_from_coo` is a stable counting sort: neighbours keep their input order,
which the pipeline makes the data set's file order, so the output is canonical.
It runs scipy's C++ COO → CSR conversion (O(E + N)) through the public API with
the edge's index as its column: no two entries share a (row, column), so
nothing is summed, and the "column" read back is each neighbour's input position.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse

from formats.graphbin import index_dtype


def csr_from_coo(src: np.ndarray, dst: np.ndarray, num_rows: int, num_cols: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The CSR of a COO edge list, neighbours in input order.

  Args:
    src: row of each edge, 0 <= src < num_rows.
    dst: column of each edge.
    num_rows: rows of the CSR (nodes of the head type).
    num_cols: columns (nodes of the tail type); `num_rows` when None.

  Returns:
    (indptr int64 [num_rows + 1], indices [E], order [E]) with indices = dst[order];
    indices and order are int32 when every index fits, else int64.
  """
  e = len(src)
  num_cols = num_rows if num_cols is None else num_cols
  itype = index_dtype(max(e, num_rows + 1, num_cols))
  m = scipy.sparse.coo_array(
      (np.asarray(dst, itype), (np.asarray(src, itype), np.arange(e, dtype=itype))), shape=(num_rows, e)).tocsr()
  return m.indptr.astype(np.int64, copy=False), m.data.astype(itype, copy=False), m.indices.astype(itype, copy=False)


def interleave_inverse(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """OGB's add_inverse_edge: each edge followed by its reverse (read_graph_raw's layout).

  Args:
    src: the edges' source nodes.
    dst: the edges' destination nodes.

  Returns:
    (sources, destinations), twice as long: edge i at 2i, its reverse at 2i + 1.
  """
  s = np.empty(2 * len(src), src.dtype)
  d = np.empty(2 * len(dst), dst.dtype)
  s[0::2], s[1::2] = src, dst
  d[0::2], d[1::2] = dst, src
  return s, d
