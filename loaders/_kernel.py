"""The compiled sampling kernel shared by the homogeneous and the heterogeneous neighbour samplers.

numba-compiled, `nogil=True`: two sampler threads sample two batches at once.
One hop samples a fixed fanout of neighbours, uniformly with replacement, for
every node of a frontier, in four passes over the frontier (each a tight loop:
the pass structure is what makes it fast, a fused loop is not):

  1. the start and degree of every frontier node, read from `indptr`;
  2. the position of every draw, from a counter-based random number
     generator: draw `j` of frontier node `i` is `mix(key + (i * fanout + j + 1)
     * GOLDEN)`, so a batch depends only on its key (seed, epoch, batch, shard,
     hop, relation), never on which thread samples it or in what order;
  3. the neighbour at every position, read from `indices`;
  4. relabelling: each neighbour not seen before in this batch gets the next
     free local id of its node type (first occurrence wins), through a
     global -> local table that the caller owns (one per thread and node type)
     and resets after the batch. (A sparse set, never reset but checked
     against the batch's local -> global ids, would cost more: its dependent
     second lookup per draw outweighs the reset.)

The feature gather copies rows by bytes, so any dtype (bfloat16 included)
goes through the same kernel. numba is imported when a sampler is built,
never at `import loaders`; TensorFlow is never imported here.
"""

from __future__ import annotations

from llvmlite import ir
import numba
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
import numpy as np

GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_G = np.uint64(GOLDEN)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)

OVERFLOW = -1  # what sample_hop returns when the nodes found pass node_cap
_AHEAD = 16  # random reads are prefetched this many elements ahead (about 20 % off the relabelling and reset)


def _mix_py(z: int) -> int:
  """splitmix64's finaliser on a Python int (the same function as the kernel's `_mix`)."""
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
  return z ^ (z >> 31)


def stream_key(*parts: int) -> np.uint64:
  """The random stream of one (seed, epoch, batch, shard, hop, relation): a 64-bit hash of the parts.

  Args:
    *parts: non-negative integers (each taken modulo 2**64).

  Returns:
    The key, as np.uint64 for the kernel.
  """
  h = 0
  for p in parts:
    h = _mix_py((h + GOLDEN + (int(p) & _MASK)) & _MASK)
  return np.uint64(h)


@intrinsic
def _prefetch(typingctx, array, index):
  """Hints the CPU to fetch `array[index]` into cache (LLVM's prefetch: read, high locality; no bounds check)."""
  sig = types.void(array, index)

  def codegen(context, builder, signature, args):
    array_type = signature.args[0]
    data = context.make_array(array_type)(context, builder, args[0])
    ptr = cgutils.get_item_pointer(context, builder, array_type, data, [args[1]], wraparound=False)
    byte_ptr = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]),
                                        "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, byte_ptr), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
    return context.get_dummy_value()

  return sig, codegen


@numba.njit(inline="always")
def _mix(z):
  z = (z ^ (z >> _S30)) * _M1
  z = (z ^ (z >> _S27)) * _M2
  return z ^ (z >> _S31)


def scratch_size(frontier: int, fanout: int) -> int:
  """The int64 work space sample_hop needs for a frontier of `frontier` nodes and `fanout` draws each."""
  return 2 * frontier + 2 * frontier * fanout


@numba.njit(nogil=True, cache=True)
def sample_hop(indptr, indices, frontier, fanout, key, table, node_ids, num_local, node_cap, unknown,
               src_out, dst_out, mask_out, dst_base, scratch):
  """Samples `fanout` neighbours of every frontier node and relabels them.

  Args:
    indptr, indices: the CSR (rows: the frontier's node type; indices: the neighbours' type).
    frontier: global ids (within the row type) of the frontier nodes.
    fanout: draws per frontier node.
    key: the hop's random stream (`stream_key`), np.uint64.
    table: global -> local ids of the neighbours' type; `unknown` where not seen yet.
    node_ids: local -> global ids of the neighbours' type (written from `num_local` on).
    num_local: the first free local id of the neighbours' type.
    node_cap: local ids must stay below it (the node budget).
    unknown: the table's "not seen" value.
    src_out, dst_out, mask_out: per draw (frontier-major), at least len(frontier) * fanout long:
      the neighbour's local id (0 when the node has no neighbours), the frontier node's local
      id (`dst_base + i`) and whether the draw is real.
    dst_base: the local id of the first frontier node.
    scratch: int64 work space of at least scratch_size(len(frontier), fanout) (reused across calls:
      no page faults on fresh arrays).

  Returns:
    How many new local ids were given (from `num_local` on), or OVERFLOW when they would
    pass `node_cap`: the table then holds none of this call's new nodes.
  """
  n = frontier.shape[0]
  m = n * fanout
  start = scratch[:n]
  deg = scratch[n:2 * n]
  pos = scratch[2 * n:2 * n + m]
  nbr = scratch[2 * n + m:2 * n + 2 * m]
  for i in range(n):
    if i + _AHEAD < n:
      _prefetch(indptr, frontier[i + _AHEAD])
    g = frontier[i]
    s = indptr[g]
    start[i] = s
    deg[i] = indptr[g + 1] - s
  counter = np.uint64(0)
  for i in range(n):
    d = deg[i]
    s = start[i]
    base = i * fanout
    if d <= 0:
      for j in range(fanout):
        pos[base + j] = -1
      counter += np.uint64(fanout)
      continue
    ud = np.uint64(d)
    for j in range(fanout):
      counter += np.uint64(1)
      u = _mix(key + counter * _G)
      pos[base + j] = s + np.int64(((u >> _S32) * ud) >> _S32)
  for e in range(m):
    if e + _AHEAD < m and pos[e + _AHEAD] >= 0:
      _prefetch(indices, pos[e + _AHEAD])
    p = pos[e]
    nbr[e] = indices[p] if p >= 0 else 0
  end = num_local
  for i in range(n):
    dst = dst_base + i
    base = i * fanout
    if deg[i] <= 0:
      for e in range(base, base + fanout):
        dst_out[e] = dst
        src_out[e] = 0
        mask_out[e] = False
      continue
    for e in range(base, base + fanout):
      if e + _AHEAD < m:
        _prefetch(table, nbr[e + _AHEAD])
      dst_out[e] = dst
      g = nbr[e]
      loc = table[g]
      if loc == unknown:
        loc = end
        if loc >= node_cap:
          for k in range(num_local, end):
            table[node_ids[k]] = unknown
          return OVERFLOW
        table[g] = loc
        node_ids[loc] = g
        end += 1
      src_out[e] = loc
      mask_out[e] = True
  return end - num_local


@numba.njit(nogil=True, cache=True)
def place(ids, table, node_ids, first):
  """Gives `ids` (distinct, e.g. the seeds) the local ids first, first+1, ... in the table."""
  for i in range(ids.shape[0]):
    table[ids[i]] = first + i
    node_ids[first + i] = ids[i]


@numba.njit(nogil=True, cache=True)
def reset(table, node_ids, lo, hi, unknown):
  """Marks the nodes at local ids [lo, hi) unknown again in the table."""
  for k in range(lo, hi):
    if k + _AHEAD < hi:
      _prefetch(table, node_ids[k + _AHEAD])
    table[node_ids[k]] = unknown


@numba.njit(nogil=True, cache=True)
def gather_rows(rows, ids, out, lo, hi):
  """out[i] = rows[ids[i]] for i in [lo, hi); rows and out are byte views ([N, row bytes] uint8)."""
  width = rows.shape[1]
  for i in range(lo, hi):
    src = rows[ids[i]]
    dst = out[i]
    for b in range(width):
      dst[b] = src[b]
