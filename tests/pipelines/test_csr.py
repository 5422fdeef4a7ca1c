"""`pipelines.ogb_graphs.csr`: COO → CSR as a stable counting sort, and OGB's inverse-edge layout. No Beam."""

from __future__ import annotations

import numpy as np
import pytest

from formats.graphbin import index_dtype
from pipelines.ogb_graphs.csr import csr_from_coo, interleave_inverse


def _reference(src: np.ndarray, dst: np.ndarray, num_rows: int):
  """The same CSR by a plain numpy stable argsort."""
  order = np.argsort(src, kind="stable")
  indptr = np.concatenate([[0], np.cumsum(np.bincount(src, minlength=num_rows))])
  return indptr, dst[order], order


def test_an_empty_graph_has_zero_offsets_and_no_indices():
  indptr, indices, order = csr_from_coo(np.zeros(0, np.int64), np.zeros(0, np.int64), 4)
  np.testing.assert_array_equal(indptr, np.zeros(5, np.int64))
  assert indptr.dtype == np.int64
  assert indices.shape == order.shape == (0,)


def test_zero_rows():
  indptr, indices, order = csr_from_coo(np.zeros(0, np.int64), np.zeros(0, np.int64), 0)
  np.testing.assert_array_equal(indptr, [0])
  assert len(indices) == len(order) == 0


def test_neighbours_keep_their_input_order_within_a_row():
  src = np.array([2, 0, 2, 0, 2, 1])
  dst = np.array([9, 5, 3, 7, 1, 4])
  indptr, indices, order = csr_from_coo(src, dst, 3, 10)
  np.testing.assert_array_equal(indptr, [0, 2, 3, 6])
  np.testing.assert_array_equal(indices, [5, 7, 4, 9, 3, 1])  # row 2: 9, 3, 1 as given, not sorted
  np.testing.assert_array_equal(order, [1, 3, 5, 0, 2, 4])
  np.testing.assert_array_equal(indices, dst[order])


def test_duplicate_edges_are_kept_not_summed():
  src = np.array([1, 1, 1, 0])
  dst = np.array([2, 2, 2, 2])
  indptr, indices, order = csr_from_coo(src, dst, 3)
  np.testing.assert_array_equal(indptr, [0, 1, 4, 4])
  np.testing.assert_array_equal(indices, [2, 2, 2, 2])
  np.testing.assert_array_equal(order, [3, 0, 1, 2])


def test_index_width_follows_formats_graphbin_index_dtype():
  src, dst = np.array([0, 1]), np.array([1, 0])
  _, indices, order = csr_from_coo(src, dst, 2)
  assert indices.dtype == order.dtype == index_dtype(2) == np.int32
  wide = 2**31  # a column count past int32: the indices widen, as a reader expects
  assert index_dtype(wide) == np.int64
  indptr, indices, order = csr_from_coo(src, np.array([wide - 1, 0]), 2, num_cols=wide)
  assert indices.dtype == order.dtype == np.int64
  assert indptr.dtype == np.int64
  np.testing.assert_array_equal(indices, [wide - 1, 0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_agrees_with_a_stable_argsort_on_random_graphs(seed):
  rng = np.random.default_rng(seed)
  num_rows, num_cols, e = int(rng.integers(1, 50)), int(rng.integers(1, 70)), int(rng.integers(0, 400))
  src = rng.integers(0, num_rows, e)
  dst = rng.integers(0, num_cols, e)
  indptr, indices, order = csr_from_coo(src, dst, num_rows, num_cols)
  ref_indptr, ref_indices, ref_order = _reference(src, dst, num_rows)
  np.testing.assert_array_equal(indptr, ref_indptr)
  np.testing.assert_array_equal(indices, ref_indices)
  np.testing.assert_array_equal(order, ref_order)


def test_interleave_inverse_follows_each_edge_by_its_reverse():
  src, dst = np.array([0, 1, 2], np.int32), np.array([5, 6, 7], np.int32)
  s, d = interleave_inverse(src, dst)
  np.testing.assert_array_equal(s, [0, 5, 1, 6, 2, 7])
  np.testing.assert_array_equal(d, [5, 0, 6, 1, 7, 2])
  assert s.dtype == d.dtype == np.int32


def test_interleave_inverse_of_no_edges():
  s, d = interleave_inverse(np.zeros(0, np.int64), np.zeros(0, np.int64))
  assert s.shape == d.shape == (0,)
