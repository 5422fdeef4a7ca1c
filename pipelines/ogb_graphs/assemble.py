"""Building the `.graphbin`: edges read in chunks and keyed by source-node partition, each
partition sorted into a part file, then one step streams the parts, node arrays and splits
into the final file and publishes it in the run's generation folder.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import math
import os
import shutil
import tempfile

import apache_beam as beam
from apache_beam.metrics import Metrics
import numpy as np

from formats import files as fs
from formats.graphbin import GraphBin, GraphBinWriter, index_dtype
from formats.manifest import FileInfo, sha256_file
from pipelines.core import fileio
from pipelines.ogb_graphs.csr import csr_from_coo, interleave_inverse
from pipelines.ogb_graphs.plan import (
    PIPELINE, EdgeSource, GraphPlan, cast_like_ogb, open_input, read_small, relation_types)
from pipelines.ogb_graphs.read import (
    NpzMember, OgbFormatError, check_ids, check_rows, first_nonfinite, load_pt_split, read_csv_chunks)
from pipelines.ogb_graphs.reverse import reverse_relations

PARTS_DIR = "_parts"


def _edge_chunks(source: EdgeSource, chunk_rows: int, nonfinite: str = "error"
                 ) -> Iterator[tuple[int, np.ndarray, np.ndarray, dict]]:
  """(first edge index, src, dst, {extra section: rows}) in file order.

  The edge CSV must hold as many rows as its num-edge-list says, and every extra file
  as many as the edge CSV: the first line that disagrees is named. An added reverse
  relation (`source.reverse_of`) reads the file's columns the other way round.
  """
  first, second = (1, 0) if source.reverse_of else (0, 1)  # the file's columns that are src and dst
  if source.npz_range is not None:
    a, b = source.npz_range
    with open_input(source.path) as f:
      member = NpzMember(f, source.path, "edge_index")
      src, dst = member.read(a, b, row=first).astype(np.int64), member.read(a, b, row=second).astype(np.int64)
    check_ids(src, source.num_rows, f"{source.path}:edge_index[{first}]", a, unit="element")
    check_ids(dst, source.num_cols, f"{source.path}:edge_index[{second}]", a, unit="element")
    yield a, src, dst, {}
    return
  handles = [open_input(source.path)] + [open_input(p) for _, p in source.extras]
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

  def process(self, source: EdgeSource):
    key_rel = ("csc:" if source.reverse else "") + source.relation
    part_size = self._plan.rows_per_partition(key_rel)
    for first, src, dst, extras in _edge_chunks(source, self._chunk_rows, self._plan.nonfinite("edge/feat")):
      self._edges.inc(len(src))
      # As the section stores them (docs/graphbin.md): `edge/feat` as features, other edge files as OGB types them.
      extras = {k: cast_like_ogb(v, "float" if k == "edge/feat" else "auto", self._feature_dtype) for k, v in extras.items()}
      pos = np.arange(first, first + len(src), dtype=np.int64)
      if self._plan.add_inverse:
        src, dst = interleave_inverse(src, dst)
        pos = np.repeat(pos * 2, 2)
        pos[1::2] += 1
        extras = {k: np.repeat(v, 2, axis=0) for k, v in extras.items()}
      if source.reverse:
        src, dst, extras = dst, src, {}
      part = src // part_size
      order = np.argsort(part, kind="stable")
      for p in np.unique(part):
        idx = order[np.searchsorted(part[order], p, "left"):np.searchsorted(part[order], p, "right")]
        yield (key_rel, int(p)), (int(pos[idx[0]]), src[idx], dst[idx], pos[idx],
                                  {k: v[idx] for k, v in extras.items()})


class _BuildPartFn(beam.DoFn):
  """All chunks of one partition → a part file (local CSR of its node range)."""

  def __init__(self, plan: GraphPlan, parts_dir: str):
    self._plan = plan
    self._parts_dir = parts_dir

  def process(self, element):
    # One temp folder per part, removed here: runners do not promise to call teardown.
    tmp = tempfile.mkdtemp(prefix="ogb-parts-")
    try:
      yield self._build(element, tmp)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)

  def _build(self, element, tmp: str):
    (key_rel, p), chunks = element
    chunks = sorted(chunks, key=lambda c: c[0])  # file order, whatever order the shuffle gave
    relation = key_rel.removeprefix("csc:")
    part_size = self._plan.rows_per_partition(key_rel)
    src = np.concatenate([c[1] for c in chunks])
    dst = np.concatenate([c[2] for c in chunks])
    extras = {}
    for k in chunks[0][4]:
      kinds = {c[4][k].dtype.kind for c in chunks}
      if len(kinds) > 1:  # one chunk all integers, another not: never widen silently
        raise OgbFormatError(f"{dict(self._plan_extras(relation))[k]}: integer and non-integer rows mixed "
                             f"(section {k})")
      extras[k] = np.concatenate([c[4][k] for c in chunks])
    start = p * part_size
    head, tail = relation_types(relation)
    rows_total = self._plan.num_nodes[tail if key_rel.startswith("csc:") else head]
    rows = min(part_size, rows_total - start)
    cols = self._plan.num_nodes[head if key_rel.startswith("csc:") else tail]
    indptr, indices, order = csr_from_coo(src - start, dst, rows, cols)
    dest = fs.join(self._parts_dir, f"{key_rel.replace(':', '_') or 'graph'}-{p:06d}.graphbin")
    local = fileio.local_staging_path(dest, tmp)
    with GraphBinWriter(local) as w:
      w.add("indptr", indptr)
      w.add("indices", indices.astype(index_dtype(cols), copy=False))
      for name, values in sorted(extras.items()):
        w.add(name, values[order])
    fileio.publish(local, dest)
    return key_rel, p, len(src), dest


  def _plan_extras(self, relation: str) -> tuple[tuple[str, str], ...]:
    return next((s.extras for s in self._plan.edge_files if s.relation == relation), ())


def _node_array_chunks(path: str, kind: str, feature_dtype: str, n: int, nonfinite: str = "error",
                       count_file: str = "num-node-list") -> Iterator[np.ndarray]:
  """Rows of a node file (CSV or `file.npz#key`), cast as the section will store them.

  The file must hold one row per node and no value that `nonfinite` refuses.
  """
  if "#" in path:
    file, key = path.split("#", 1)
    with open_input(file) as f:
      member = NpzMember(f, file, key)
      if not member.shape or member.shape[0] != n:
        raise OgbFormatError(f"{member.name}: shape {member.shape} for {n} nodes ({count_file})")
      step = 1 << 20
      for a in range(0, n, step):
        arr = member.read(a, min(n, a + step))
        bad = first_nonfinite(arr, nonfinite)
        if bad is not None:
          raise OgbFormatError(f"{member.name}: row {a + bad}: non-finite value "
                               "(--allow_nonfinite=true keeps NaN/inf)")
        yield cast_like_ogb(arr, kind, feature_dtype)
    return
  rows = 0
  with open_input(path) as f:
    for line, arr in read_csv_chunks(f, path, "auto", nonfinite=nonfinite):
      rows += len(arr)
      if rows > n:
        check_rows(path, rows, n, "nodes", count_file)
      yield cast_like_ogb(arr, kind, feature_dtype)
  check_rows(path, rows, n, "nodes", count_file)




class _AssembleFn(beam.DoFn):
  """Streams parts, node arrays and splits into the .graphbin, publishes it in the run's
  generation and removes the parts; yields its `FileInfo` (the commit is shared: core.sink)."""

  def __init__(self, plan: GraphPlan, output: str, file_name: str, feature_dtype: str, csc: bool, generation: str):
    self._plan, self._output, self._file = plan, output, file_name
    self._generation = generation
    self._feature_dtype, self._csc = feature_dtype, csc

  def process(self, _, parts):
    plan = self._plan
    by_rel: dict[str, dict[int, tuple[int, str]]] = {}
    for key_rel, p, count, path in parts:
      by_rel.setdefault(key_rel, {})[p] = (count, path)
    tmp = tempfile.mkdtemp(prefix="ogb-assemble-")
    try:
      local = os.path.join(tmp, self._file)
      meta = self._meta()
      with GraphBinWriter(local) as w:
        w.add_meta(meta)
        for source in plan.edge_files if plan.layout != "binary" else plan.edge_files[:1]:
          self._write_csr(w, source.relation, by_rel.get(source.relation, {}), source.extras, reverse=False)
          if self._csc:
            self._write_csr(w, source.relation, by_rel.get("csc:" + source.relation, {}), (), reverse=True)
        for section, path, kind in plan.node_files:
          t = section.split("/")[1] if plan.layout == "heterogeneous" else ""
          n = plan.num_nodes[t]
          chunks = _node_array_chunks(path, kind, self._feature_dtype, n, plan.nonfinite(section),
                                      plan.node_count_file)
          first = next(chunks, None)
          if first is None:  # a type without nodes
            continue
          with w.stream(section, first.dtype.str, (n, first.shape[1])) as s:
            s.write(first)
            for c in chunks:
              if c.dtype.kind != first.dtype.kind:
                raise OgbFormatError(f"{path}: integer and non-integer rows mixed (section {section})")
              s.write(c.astype(first.dtype, copy=False))
        if plan.layout == "heterogeneous":
          counts = [plan.num_nodes[t] for t in sorted(plan.num_nodes)]
          w.add("node_type_offsets", np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
        for prefix, path in plan.split_files:
          self._write_split(w, prefix, path)
      digest, size = sha256_file(local), os.path.getsize(local)
      GraphBin(local, verify=False)  # the file parses: header, table, shapes
      fileio.publish(local, fs.join(self._output, self._relative(self._file)))
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
    parts_dir = fs.join(self._output, self._relative(PARTS_DIR))
    fs.delete_many(fs.walk(parts_dir))  # the parts live in this run's generation
    fs.remove_empty_dirs(parts_dir)
    yield FileInfo(self._relative(self._file), size, digest, "graphbin")

  def _relative(self, name: str) -> str:
    return f"{self._generation}/{name}" if self._generation else name

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

  def _write_csr(self, w: GraphBinWriter, relation: str, parts: dict[int, tuple[int, str]],
                 extras: Sequence[tuple[str, str]], reverse: bool) -> None:
    plan = self._plan
    head, tail = relation_types(relation)
    rows_type, cols_type = (tail, head) if reverse else (head, tail)
    n_rows, n_cols = plan.num_nodes[rows_type], plan.num_nodes[cols_type]
    part_size = plan.rows_per_partition(("csc:" if reverse else "") + relation)
    num_parts = max(1, math.ceil(n_rows / part_size))
    total = sum(c for c, _ in parts.values())
    prefix = ("csc/" if reverse else "") + (f"rel/{relation}/" if relation else "")
    opened: dict[int, GraphBin] = {}
    tmp = tempfile.mkdtemp(prefix="ogb-part-")

    def part(p: int) -> GraphBin | None:
      if p not in parts:
        return None
      if p not in opened:
        opened.clear()
        path = parts[p][1]
        local = path if not fs.is_gcs(path) else os.path.join(tmp, os.path.basename(path))
        if local != path:
          fs.download(path, local)
        opened[p] = GraphBin(local)
      return opened[p]

    try:
      with w.stream(prefix + "indptr", "<i8", (n_rows + 1,)) as s:
        s.write(np.zeros(1, np.int64))
        offset = 0
        for p in range(num_parts):
          rows = min(part_size, n_rows - p * part_size)
          g = part(p)
          local = np.zeros(rows, np.int64) if g is None else np.asarray(g["indptr"][1:])
          s.write(local + offset)
          offset += 0 if g is None else int(g["indptr"][-1])
      if offset != total:
        raise RuntimeError(f"{relation or 'graph'}: parts hold {total} edges, indptr ends at {offset}")
      idtype = index_dtype(n_cols).str
      with w.stream(prefix + "indices", idtype, (total,)) as s:
        for p in range(num_parts):
          g = part(p)
          if g is not None:
            s.write(g["indices"])
      for section, path in extras:
        first = next((part(p)[section] for p in range(num_parts) if part(p) is not None), None)
        if first is None:
          continue
        with w.stream(prefix + section, first.dtype.str, (total, *first.shape[1:])) as s:
          for p in range(num_parts):
            g = part(p)
            if g is not None:
              if g[section].dtype != first.dtype:
                raise OgbFormatError(f"{path}: integer and non-integer rows mixed (section {prefix + section})")
              s.write(g[section])
    finally:
      opened.clear()
      shutil.rmtree(tmp, ignore_errors=True)

  def _write_split(self, w: GraphBinWriter, prefix: str, path: str) -> None:
    if path.endswith(".pt"):
      with open_input(path) as f:
        arrays = load_pt_split(f, path)
      for key, arr in sorted(arrays.items()):
        w.add(f"{prefix}/{key}", np.asarray(arr))
      return
    t = prefix.split("/")[2] if self._plan.layout == "heterogeneous" else ""
    ids = read_small(path, "int", 1)[:, 0]
    check_ids(ids, self._plan.num_nodes[t] if self._plan.task == "node" else 2**62, path, 1)
    w.add(prefix, ids.astype(np.int64))


