"""Building the `.graphbin`: edges read in chunks and keyed by source-node partition; each
partition sorted by one worker, which writes its share of `indptr`, `indices` and the edge arrays
as pieces of the final file; node arrays written as pieces by the workers that read them; then one
step joins the pieces (pipelines.ogb_graphs.pieces: concatenated locally, composed on gs://) with the
splits and the section table, in the run's generation folder.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pickle

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
import google_crc32c
import numpy as np

from formats.outputs import commit
from formats.storage import files as fs
from formats.graphbin import META, index_dtype
from formats.manifest import FileInfo
from pipelines.core import reuse
from pipelines.ogb_graphs.csr import csr_from_coo, interleave_inverse
from pipelines.ogb_graphs.pieces import Piece, PieceWriter, SectionParts, glue_array, join_gcs, join_local, layout
from pipelines.ogb_graphs.plan import (
    PIPELINE, EdgeSource, GraphPlan, cast_like_ogb, open_input, read_small, relation_types)
from pipelines.ogb_graphs.read import (
    LINK_ID_ENTRIES, NpzMember, OgbFormatError, check_ids, check_rows, first_nonfinite, load_pt_split,
    read_csv_chunks)
from pipelines.ogb_graphs.reverse import reverse_relations

PARTS_DIR = "_parts"
NPZ_EDGE_CHUNK = 1 << 22  # edges per chunk of a data.npz edge_index
NODE_PIECE_BYTES = 256 << 20  # a stored data.npz node array is written in pieces of about this size


class CountingFile:
  """A binary file whose `read`s are counted (`count`: bytes read so far), for the bytes_read counter."""

  def __init__(self, f):
    self._f = f
    self.count = 0

  def read(self, n: int = -1) -> bytes:
    data = self._f.read(n)
    self.count += len(data)
    return data

  def __getattr__(self, name):
    return getattr(self._f, name)

  def __enter__(self) -> CountingFile:
    return self

  def __exit__(self, *exc) -> None:
    self._f.close()


class CountedInputs:
  """A DoFn's input files, opened as CountingFiles, whose bytes read go to a counter at each `report()`.

      inputs = CountedInputs(self._bytes)
      for chunk in _edge_chunks(source, rows, opener=inputs.open):
        inputs.report()   # the bytes read since the last report
  """

  def __init__(self, counter):
    self._counter, self._opened, self._reported = counter, [], 0

  def open(self, path: str) -> CountingFile:
    """Opens `path` (open_input) and counts what is read from it."""
    self._opened.append(CountingFile(open_input(path)))
    return self._opened[-1]

  def report(self) -> None:
    """Adds the bytes read since the last report to the counter."""
    now = sum(f.count for f in self._opened)
    self._counter.inc(now - self._reported)
    self._reported = now


def _edge_chunks(source: EdgeSource, chunk_rows: int, nonfinite: str = "error", opener=open_input
                 ) -> Iterator[tuple[int, np.ndarray, np.ndarray, dict]]:
  """(first edge index, src, dst, {extra section: rows}) in file order.

  The edge CSV must hold as many rows as its num-edge-list says, and every extra file
  as many as the edge CSV: the first line that disagrees is named. An added reverse
  relation (`source.reverse_of`) reads the file's columns the other way round.
  """
  first, second = (1, 0) if source.reverse_of else (0, 1)  # the file's columns that are src and dst
  if source.npz_range is not None:
    a, b = source.npz_range
    with opener(source.path) as f:
      # A deflated edge_index (one source for all edges) is streamed: row `first` and row `second`
      # side by side, each decompressed once from the member's start (row 1's stream passes over row 0).
      member = NpzMember(f, source.path, "edge_index")
      srcs = member.chunks(a, b, NPZ_EDGE_CHUNK, row=first)
      dsts = member.chunks(a, b, NPZ_EDGE_CHUNK, row=second)
      # The edge-aligned members (edge_feat, edge_*: rows [E, ...], shapes checked at launch), each from its
      # own handle, cut at the same rows.
      with contextlib.ExitStack() as stack:
        extras = [(section, NpzMember(stack.enter_context(opener(source.path)), source.path, path.split("#", 1)[1]))
                  for section, path in source.extras]
        extra_chunks = [m.chunks(a, b, NPZ_EDGE_CHUNK) for _, m in extras]
        for k, (src, dst) in enumerate(zip(srcs, dsts)):
          at = a + k * NPZ_EDGE_CHUNK
          src, dst = src.astype(np.int64), dst.astype(np.int64)
          check_ids(src, source.num_rows, f"{source.path}:edge_index[{first}]", at, unit="element")
          check_ids(dst, source.num_cols, f"{source.path}:edge_index[{second}]", at, unit="element")
          rows = {}
          for (section, m), it in zip(extras, extra_chunks):
            arr = next(it)
            bad = first_nonfinite(arr, nonfinite)
            if bad is not None:
              raise OgbFormatError(f"{m.name}: row {at + bad}: non-finite value "
                                   "(--allow_nonfinite=true keeps NaN/inf)")
            rows[section] = arr
          yield at, src, dst, rows
    return
  handles = [opener(source.path)] + [opener(p) for _, p in source.extras]
  try:
    edges = read_csv_chunks(handles[0], source.path, "int", 2, chunk_rows)
    extra_iters = [read_csv_chunks(h, p, "auto", None, chunk_rows, nonfinite=nonfinite)
                   for h, (_, p) in zip(handles[1:], source.extras)]
    total = 0
    for line, arr in edges:
      total += len(arr)
      if 0 <= source.num_edges < total:
        check_rows(source.path, total, source.num_edges, "edges", source.count_file)
      check_ids(arr[:, first], source.num_rows, source.path, line)
      check_ids(arr[:, second], source.num_cols, source.path, line)
      extras = {}
      for (section, path), it in zip(source.extras, extra_iters):
        _, rows = next(it, (line, arr[:0]))
        if len(rows) != len(arr):  # chunks are cut at the same rows: only the file's end differs
          raise OgbFormatError(f"{path}: line {line + len(rows)}: file ends before {source.path} does")
        extras[section] = rows
      yield line - 1, arr[:, first], arr[:, second], extras
    if source.num_edges >= 0:
      check_rows(source.path, total, source.num_edges, "edges", source.count_file)
    for (section, path), it in zip(source.extras, extra_iters):
      if next(it, None) is not None:
        raise OgbFormatError(f"{path}: line {total + 1}: more rows than the {total} of {source.path}")
  finally:
    for h in handles:
      h.close()


class _ReadEdgesFn(beam.DoFn):
  """An EdgeSource → ((relation, partition), chunk) with OGB's inverse edges interleaved."""

  def __init__(self, plan: GraphPlan, feature_dtype: str = "float32", chunk_rows: int = 1 << 21):
    self._plan = plan
    self._feature_dtype = feature_dtype
    self._chunk_rows = chunk_rows

  def setup(self):
    self._edges = Metrics.counter(PIPELINE, "edges_read")
    self._bytes = Metrics.counter(PIPELINE, "bytes_read")

  def process(self, source: EdgeSource):
    key_rel = ("csc:" if source.reverse else "") + source.relation
    part_size = self._plan.rows_per_partition(key_rel)
    inputs = CountedInputs(self._bytes)
    for first, src, dst, extras in _edge_chunks(source, self._chunk_rows, self._plan.nonfinite("edge/feat"),
                                                inputs.open):
      self._edges.inc(len(src))
      inputs.report()
      # As the section stores them (docs/graphbin.md): `edge/feat` as features, other edge files as OGB types them.
      extras = {k: cast_like_ogb(v, "float" if k == "edge/feat" else "auto", self._feature_dtype,
                                 dict(source.extras).get(k, source.path)) for k, v in extras.items()}
      pos = np.arange(first, first + len(src), dtype=np.int64)
      if self._plan.add_inverse:
        src, dst = interleave_inverse(src, dst)
        pos = np.repeat(pos * 2, 2)
        pos[1::2] += 1
        extras = {k: np.repeat(v, 2, axis=0) for k, v in extras.items()}
      if source.reverse:
        src, dst, extras = dst, src, {}
      # Ids as the CSR stores them (int32 while they fit): the chunks cross a stage, a third of the bytes.
      itype = index_dtype(max(source.num_rows, source.num_cols) + 1)
      src, dst = src.astype(itype, copy=False), dst.astype(itype, copy=False)
      part = src // part_size
      order = np.argsort(part, kind="stable")
      for p in np.unique(part):
        idx = order[np.searchsorted(part[order], p, "left"):np.searchsorted(part[order], p, "right")]
        yield (key_rel, int(p)), (int(pos[idx[0]]), src[idx], dst[idx], {k: v[idx] for k, v in extras.items()})
    inputs.report()


def csr_keys(plan: GraphPlan, csc: bool) -> list[str]:
  """The CSRs the file holds, in file order: each relation, then its CSC ("csc:<relation>") with --csc."""
  keys = []
  for relation in dict.fromkeys(s.relation for s in plan.edge_files):  # a binary layout has many sources, one CSR
    keys.append(relation)
    if csc:
      keys.append("csc:" + relation)
  return keys


def csr_shape(plan: GraphPlan, key_rel: str) -> tuple[int, int, int]:
  """(rows, columns, partitions) of the CSR `key_rel` ("<relation>" or "csc:<relation>")."""
  relation = key_rel.removeprefix("csc:")
  head, tail = relation_types(relation)
  reverse = key_rel.startswith("csc:")
  n_rows, n_cols = plan.num_nodes[tail if reverse else head], plan.num_nodes[head if reverse else tail]
  return n_rows, n_cols, max(1, math.ceil(n_rows / plan.rows_per_partition(key_rel)))


def all_partitions(plan: GraphPlan, csc: bool) -> list[tuple[str, int]]:
  """Every (CSR, partition) of the file: each gets a sort step, edges or not (it writes its share of indptr)."""
  return [(key, p) for key in csr_keys(plan, csc) for p in range(csr_shape(plan, key)[2])]


def _piece_name(parts_dir: str, key_rel: str, p: int, section: str) -> str:
  return fs.join(parts_dir, f"{key_rel.replace(':', '_') or 'graph'}-{p:06d}-{section.replace('/', '~')}.bin")


class _BuildPartFn(beam.DoFn):
  """All chunks of one partition → its pieces of the file: `indptr` rows (offset by the edges of the
  partitions before it, from the side input of counts), `indices` and the edge arrays in CSR order."""

  def __init__(self, plan: GraphPlan, parts_dir: str):
    self._plan = plan
    self._parts_dir = parts_dir

  def setup(self):
    self._sorted = Metrics.counter(PIPELINE, "partitions_sorted")
    self._written = Metrics.counter(PIPELINE, "bytes_written")

  def process(self, element, counts):
    (key_rel, p), chunks = element
    chunks = sorted((c for c in chunks if c is not None), key=lambda c: c[0])  # file order, whatever the shuffle gave
    before = sum(counts.get((key_rel, q), 0) for q in range(p))
    got = sum(len(c[1]) for c in chunks)
    if got != counts.get((key_rel, p), 0):  # a runner that lost or repeated a chunk
      raise RuntimeError(f"{key_rel or 'graph'} partition {p}: {got} edges grouped, {counts.get((key_rel, p), 0)} read")
    relation = key_rel.removeprefix("csc:")
    part_size = self._plan.rows_per_partition(key_rel)
    n_rows, n_cols, _ = csr_shape(self._plan, key_rel)
    start = p * part_size
    rows = min(part_size, n_rows - start)
    prefix = ("csc/" if key_rel.startswith("csc:") else "") + (f"rel/{relation}/" if relation else "")
    src = np.concatenate([c[1] for c in chunks]) if chunks else np.zeros(0, np.int64)
    dst = np.concatenate([c[2] for c in chunks]) if chunks else np.zeros(0, np.int64)
    src = src - np.asarray(p * self._plan.rows_per_partition(key_rel), src.dtype)  # rows within the partition
    extras = {}
    for k in (chunks[0][3] if chunks else {}):
      kinds = {c[3][k].dtype.kind for c in chunks}
      if len(kinds) > 1:  # one chunk all integers, another not: never widen silently
        raise OgbFormatError(f"{dict(self._plan_extras(relation))[k]}: integer and non-integer rows mixed "
                             f"(section {k})")
      extras[k] = np.concatenate([c[3][k] for c in chunks])
    indptr, indices, order = csr_from_coo(src, dst, rows, n_cols)
    yield self._write(prefix + "indptr", key_rel, p, indptr[1:] + before, "<i8")
    if len(src):
      yield self._write(prefix + "indices", key_rel, p, indices, index_dtype(n_cols).str)
    for name, values in sorted(extras.items()):
      yield self._write(prefix + name, key_rel, p, values[order], values.dtype.str,
                        dict(self._plan_extras(relation)).get(name, ""))
    self._sorted.inc()

  def _write(self, section: str, key_rel: str, p: int, arr: np.ndarray, dtype: str, source: str = "") -> Piece:
    with PieceWriter(_piece_name(self._parts_dir, key_rel, p, section)) as w:
      w.write_array(arr, dtype)
    self._written.inc(w.nbytes)
    stored = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).itemsize > 1 else np.dtype(dtype)
    return Piece(section, p, w.dest, w.nbytes, w.crc32c, stored.str, len(arr), tuple(arr.shape[1:]), source)

  def _plan_extras(self, relation: str) -> tuple[tuple[str, str], ...]:
    return next((s.extras for s in self._plan.edge_files if s.relation == relation), ())


@dataclasses.dataclass(frozen=True)
class NodeUnit:
  """Rows [start, stop) of one node file, written as one piece: a whole CSV (gzip is read from its
  start), a whole deflated npz member (streamed once), or a row range of a stored npz member."""

  section: str
  path: str  # a CSV, or `file.npz#key`
  kind: str  # "float" (features), "int" or "auto"
  num_nodes: int  # rows the file must hold
  start: int = 0
  stop: int = -1  # -1: to the end


def node_units(plan: GraphPlan) -> list[NodeUnit]:
  """The node files as units of work: a stored npz member in row ranges of about NODE_PIECE_BYTES, the rest whole."""
  units = []
  for section, path, kind in plan.node_files:
    t = section.split("/")[1] if plan.layout == "heterogeneous" else ""
    n = plan.num_nodes[t]
    if "#" not in path:
      units.append(NodeUnit(section, path, kind, n))
      continue
    file, key = path.split("#", 1)
    with open_input(file) as f:
      member = NpzMember(f, file, key)
    if member.compressed or not member.shape or member.shape[0] != n:  # a bad shape is named by the unit
      units.append(NodeUnit(section, path, kind, n))
      continue
    row_bytes = max(1, int(np.prod(member.shape[1:], dtype=np.int64)) * member.dtype.itemsize)
    step = max(1, NODE_PIECE_BYTES // row_bytes)
    units += [NodeUnit(section, path, kind, n, a, min(n, a + step)) for a in range(0, max(n, 1), step)]
  return units


def _node_array_chunks(unit: NodeUnit, feature_dtype: str, nonfinite: str, count_file: str,
                       opener=open_input) -> Iterator[np.ndarray]:
  """Rows of a node unit, cast as the section will store them.

  The file must hold one row per node and no value that `nonfinite` refuses.
  """
  path, kind, n = unit.path, unit.kind, unit.num_nodes
  if "#" in path:
    file, key = path.split("#", 1)
    with opener(file) as f:
      member = NpzMember(f, file, key)
      if not member.shape or member.shape[0] != n:
        raise OgbFormatError(f"{member.name}: shape {member.shape} for {n} nodes ({count_file})")
      a = unit.start
      for arr in member.chunks(unit.start, n if unit.stop < 0 else unit.stop, 1 << 20):
        bad = first_nonfinite(arr, nonfinite)
        if bad is not None:
          raise OgbFormatError(f"{member.name}: row {a + bad}: non-finite value "
                               "(--allow_nonfinite=true keeps NaN/inf)")
        a += len(arr)
        yield cast_like_ogb(arr, kind, feature_dtype, member.name)
    return
  rows = 0
  with opener(path) as f:
    for line, arr in read_csv_chunks(f, path, "auto", nonfinite=nonfinite):
      rows += len(arr)
      if rows > n:
        check_rows(path, rows, n, "nodes", count_file)
      yield cast_like_ogb(arr, kind, feature_dtype, path)
  check_rows(path, rows, n, "nodes", count_file)


def node_piece_identity(plan: GraphPlan, feature_dtype: str) -> str:
  """What shapes every node piece besides its unit and input files: the plan, the dtype, the code."""
  return reuse.output_identity({"plan": hashlib.sha256(pickle.dumps(plan, protocol=4)).hexdigest(),
                                "feature_dtype": feature_dtype})


def reusable_node_pieces(output: str, generation: str) -> dict[str, tuple[str, str]]:
  """{piece digest: (generation, piece file)} of the node pieces the output's other toolkit generations
  hold with their records (a failed or killed run's `_parts/`; a committed run's pieces are joined and gone)."""
  found = {}
  for g, name, record in reuse.records_in(output, PARTS_DIR, exclude=generation):
    if isinstance(record.get("piece_digest"), str):
      found[record["piece_digest"]] = (g, name[:-len(".json")])
  return found


def _crc32c_of(path: str) -> int:
  """The CRC32C of a file's bytes (read once)."""
  crc = 0
  with (FileSystems.open(path) if fs.is_gcs(path) else open(path, "rb")) as f:
    while block := f.read(16 << 20):
      crc = google_crc32c.extend(crc, block)
  return crc


class _NodeArrayFn(beam.DoFn):
  """A NodeUnit → its piece of the file (rows checked, one dtype throughout).

  A piece whose digest (its unit, its input files' versions, `identity`) names a piece an earlier
  run wrote (`reusable`) is copied from there once its bytes check out, instead of read again: the
  node features are most of a large graph's input (pipelines/core/reuse.py).
  """

  def __init__(self, plan: GraphPlan, feature_dtype: str, parts_dir: str, identity: str = "",
               reusable: dict[str, tuple[str, str]] | None = None):
    self._plan, self._feature_dtype, self._parts_dir = plan, feature_dtype, parts_dir
    self._identity, self._reusable = identity, dict(reusable or {})

  def setup(self):
    self._rows = Metrics.counter(PIPELINE, "node_rows_read")
    self._bytes = Metrics.counter(PIPELINE, "bytes_read")
    self._written = Metrics.counter(PIPELINE, "bytes_written")
    self._reused = Metrics.counter("toolkit", "pieces_reused")

  def process(self, unit: NodeUnit):
    dest = fs.join(self._parts_dir, f"{unit.section.replace('/', '~')}-{unit.start:012d}.bin")
    digest = hashlib.sha256(f"{self._identity}\0{unit!r}\0".encode() + "\0".join(
        reuse.input_versions([unit.path.split("#", 1)[0]])).encode()).hexdigest() if self._identity else ""
    if digest in self._reusable:
      piece = self._reused_piece(digest, dest, unit)
      if piece is not None:
        self._reused.inc()
        yield piece
        return
    piece, sha = self._read(unit, dest)
    if digest:
      fs.write_bytes(dest + ".json", json.dumps({
          "toolkit": "tpu-shards", "piece_digest": digest, "sha256": sha, "nbytes": piece.nbytes,
          "crc32c": piece.crc32c, "dtype": piece.dtype, "rows": piece.rows, "inner": list(piece.inner),
          "section": piece.section, "order": piece.order, "source": piece.source}, sort_keys=True).encode())
    yield piece

  def _reused_piece(self, digest: str, dest: str, unit: NodeUnit) -> Piece | None:
    """The earlier piece copied to `dest`, or None when it is gone or its bytes or record disagree."""
    generation, name = self._reusable[digest]
    src = fs.join(os.path.dirname(os.path.dirname(self._parts_dir)), generation, PARTS_DIR, name)
    try:
      data, _ = fs.read_small(src + ".json", 1 << 20)
      r = json.loads(data)
      piece = Piece(str(r["section"]), int(r["order"]), dest, int(r["nbytes"]), int(r["crc32c"]), str(r["dtype"]),
                    int(r["rows"]), tuple(int(d) for d in r["inner"]), str(r["source"]))
      dt = np.dtype(piece.dtype) if piece.dtype else None
      # A record is untrusted: its claims must be this unit's and agree with each other; its bytes are
      # then checked against its SHA-256, and their CRC32C computed again.
      ok = (r["piece_digest"] == digest and (piece.section, piece.order) == (unit.section, unit.start)
            and (dt is None or dt.kind in "biuf") and piece.rows >= 0 and all(d >= 0 for d in piece.inner)
            and piece.nbytes == (piece.rows * math.prod(piece.inner) * dt.itemsize if dt is not None else 0)
            and self._copy(generation, src, dest, piece.nbytes, str(r["sha256"])))
      if ok and _crc32c_of(dest) != piece.crc32c:
        fs.delete_many([dest])
        ok = False
    except (FileNotFoundError, ValueError, KeyError, TypeError, RecursionError):
      ok = False
    if not ok:
      return None
    fs.write_bytes(dest + ".json", fs.read_bytes(src + ".json"))
    return piece

  def _copy(self, generation: str, src: str, dest: str, nbytes: int, sha256: str) -> bool:
    with reuse.leased(os.path.dirname(os.path.dirname(self._parts_dir)), generation):
      return reuse.copy_verified(src, dest, nbytes, sha256)

  def _read(self, unit: NodeUnit, dest: str) -> tuple[Piece, str]:
    plan = self._plan
    inputs = CountedInputs(self._bytes)
    first, rows = None, 0
    with PieceWriter(dest, sha256=bool(self._identity)) as w:
      for c in _node_array_chunks(unit, self._feature_dtype, plan.nonfinite(unit.section), plan.node_count_file,
                                  inputs.open):
        if first is None:
          first = c
        elif c.dtype.kind != first.dtype.kind:
          raise OgbFormatError(f"{unit.path}: integer and non-integer rows mixed (section {unit.section})")
        w.write_array(c, first.dtype)
        rows += len(c)
        self._rows.inc(len(c))
        inputs.report()
    inputs.report()
    self._written.inc(w.nbytes)
    dtype = "" if first is None else first.dtype.newbyteorder("<").str if first.dtype.itemsize > 1 else first.dtype.str
    return Piece(unit.section, unit.start, w.dest, w.nbytes, w.crc32c, dtype, rows,
                 () if first is None else tuple(first.shape[1:]), unit.path), w.sha256


class _AssembleFn(beam.DoFn):
  """Joins the pieces, the node type offsets and the splits into the .graphbin in the run's generation
  (pieces.join_local / join_gcs), removes the pieces and yields its `FileInfo` (the commit is shared: core.sink)."""

  def __init__(self, plan: GraphPlan, output: str, file_name: str, feature_dtype: str, csc: bool, generation: str):
    self._plan, self._output, self._file = plan, output, file_name
    self._generation = generation
    self._feature_dtype, self._csc = feature_dtype, csc

  def setup(self):
    self._written = Metrics.counter(PIPELINE, "bytes_written")

  def process(self, _, pieces):
    commit.fault_point("graph:assemble")  # every piece written; nothing joined yet
    plan = self._plan
    by_section: dict[str, list[Piece]] = {}
    for piece in pieces:
      by_section.setdefault(piece.section, []).append(piece)
    for v in by_section.values():
      v.sort(key=lambda piece: piece.order)
    sections = [SectionParts(META, "|u1", (len(self._meta_bytes()),), (self._meta_bytes(),))]
    for key_rel in csr_keys(plan, self._csc):
      sections += self._csr_sections(key_rel, by_section)
    for section, path, _ in plan.node_files:
      got = by_section.get(section, [])
      typed = [piece for piece in got if piece.rows]
      if not typed:  # a type without nodes
        continue
      first = typed[0]
      for piece in typed:
        if np.dtype(piece.dtype).kind != np.dtype(first.dtype).kind:
          raise OgbFormatError(f"{path}: integer and non-integer rows mixed (section {section})")
      n = sum(piece.rows for piece in got)
      sections.append(SectionParts(section, first.dtype, (n, *first.inner), tuple(got)))
    if plan.layout == "heterogeneous":
      counts = [plan.num_nodes[t] for t in sorted(plan.num_nodes)]
      offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
      sections.append(SectionParts("node_type_offsets", "<i8", offsets.shape, (glue_array(offsets),)))
    for prefix, path in plan.split_files:
      sections += self._split_sections(prefix, path)
    segments, _ = layout(sections)
    dest = fs.join(self._output, self._relative(self._file))
    parts_dir = fs.join(self._output, self._relative(PARTS_DIR))
    if fs.is_gcs(dest):
      digest, size = join_gcs(segments, dest, parts_dir)
    else:
      digest, size = join_local(segments, dest)
    self._written.inc(size)
    fs.delete_many(fs.walk(parts_dir))  # the pieces live in this run's generation
    fs.remove_empty_dirs(parts_dir)
    yield FileInfo(self._relative(self._file), size, digest, "graphbin")

  def _relative(self, name: str) -> str:
    return f"{self._generation}/{name}" if self._generation else name

  def _meta_bytes(self) -> bytes:
    return json.dumps(self._meta(), sort_keys=True).encode()

  def _meta(self) -> dict:
    plan = self._plan
    meta = {"format": "graphbin", "name": plan.name, "layout": plan.layout, "task": plan.task,
            "num_nodes": plan.num_nodes, "node_types": sorted(plan.num_nodes),
            "relations": [s.relation for s in plan.edge_files if s.relation] if plan.layout == "heterogeneous" else [],
            "add_inverse_edges": plan.add_inverse, "csc": self._csc,
            "splits": sorted({p.rsplit("/", 1)[0] for p, _ in plan.split_files})}
    added = reverse_relations(plan)
    if added:  # only with --add_reverse_relations: every other output stays as it was
      meta["reverse_relations"] = added
    return meta

  def _csr_sections(self, key_rel: str, by_section: dict[str, list[Piece]]) -> list[SectionParts]:
    plan = self._plan
    relation = key_rel.removeprefix("csc:")
    n_rows, n_cols, num_parts = csr_shape(plan, key_rel)
    prefix = ("csc/" if key_rel.startswith("csc:") else "") + (f"rel/{relation}/" if relation else "")
    indptr = by_section.get(prefix + "indptr", [])
    if [piece.order for piece in indptr] != list(range(num_parts)):
      raise RuntimeError(f"{prefix}indptr: pieces of partitions {[piece.order for piece in indptr]}, "
                         f"expected 0..{num_parts - 1}")
    indices = by_section.get(prefix + "indices", [])
    total = sum(piece.rows for piece in indices)
    out = [SectionParts(prefix + "indptr", "<i8", (n_rows + 1,), (glue_array(np.zeros(1, np.int64)), *indptr)),
           SectionParts(prefix + "indices", index_dtype(n_cols).str, (total,), tuple(indices))]
    extras = () if key_rel.startswith("csc:") else next(
        (s.extras for s in plan.edge_files if s.relation == relation), ())
    for section, path in extras:
      got = by_section.get(prefix + section, [])
      if not got:
        continue
      first = got[0]
      for piece in got:
        if piece.dtype != first.dtype:
          raise OgbFormatError(f"{path}: integer and non-integer rows mixed (section {prefix + section})")
      rows = sum(piece.rows for piece in got)
      if rows != total:
        raise RuntimeError(f"{prefix + section}: {rows} rows for {total} edges")
      out.append(SectionParts(prefix + section, first.dtype, (total, *first.inner), tuple(got)))
    return out

  def _split_sections(self, prefix: str, path: str) -> list[SectionParts]:
    if path.endswith(".pt"):
      with open_input(path) as f:
        arrays = load_pt_split(f, path)
      out = []
      for key, arr in sorted(arrays.items()):
        if key in LINK_ID_ENTRIES and self._plan.layout != "heterogeneous":  # ids of the one node type
          check_ids(arr.reshape(len(arr), -1) if arr.ndim else arr.reshape(1), self._plan.num_nodes[""],
                    f"{path}: entry {key!r}", 0, unit="row")
        data = glue_array(arr)
        dtype = np.dtype(arr.dtype).newbyteorder("<") if arr.dtype.itemsize > 1 else arr.dtype
        out.append(SectionParts(f"{prefix}/{key}", dtype.str, arr.shape, (data,)))
      return out
    parts = prefix.split("/")  # split/<name>/[<node type>/]<part>
    t = parts[2] if len(parts) == 4 else ""
    if self._plan.task == "node" and t not in self._plan.num_nodes:
      raise OgbFormatError(f"{path}: a node split of a heterogeneous data set is per node type "
                           f"(split/{parts[1]}/<node type>/{parts[-1]}.csv.gz)")
    ids = read_small(path, "int", 1)[:, 0]
    check_ids(ids, self._plan.num_nodes[t] if self._plan.task == "node" else 2**62, path, 1)
    ids = ids.astype(np.int64)
    return [SectionParts(prefix, "<i8", ids.shape, (glue_array(ids),))]
