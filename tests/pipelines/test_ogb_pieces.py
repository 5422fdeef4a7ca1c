"""The `.graphbin` joined from pieces (pipelines.ogb_graphs.pieces), locally and on gs:// by
composition, the CSV fast path and streamed npz members: the same bytes as one writer would write."""

from __future__ import annotations

import gzip
import io
import os
import zipfile

import google_crc32c
import numpy as np
import pytest

from scripts import make_sample_ogb as mo
from formats.storage import files as fs
from formats.storage import retry
from formats.graphbin import GraphBinWriter, crc32c_combine
from formats.manifest import sha256_file
from formats.outputs.output import load_manifest, verify
from pipelines import ogb_graphs
from pipelines.ogb_graphs import pieces, read
from pipelines.ogb_graphs.pieces import Piece, PieceWriter, SectionParts, join_local, layout
from tests.conftest import upload_tree


# --------------------------------------------------------------------------- pure


@pytest.mark.parametrize("la,lb", [(0, 0), (0, 7), (7, 0), (1, 1), (63, 64), (1000, 1 << 16), (5, 3 << 20)])
def test_crc32c_combine_is_the_crc_of_the_concatenation(la, lb):
  rng = np.random.default_rng(la * 31 + lb)
  a, b = rng.bytes(la), rng.bytes(lb)
  assert crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), lb) == google_crc32c.value(a + b)


def test_pieces_joined_locally_are_what_one_writer_writes(tmp_path):
  rng = np.random.default_rng(0)
  arrays = {"meta": np.frombuffer(b'{"a": 1}', np.uint8), "indptr": np.cumsum(rng.integers(0, 5, 1001)),
            "indices": rng.integers(0, 1000, 2500).astype(np.int32),
            "node/feat": rng.standard_normal((1000, 3)).astype(np.float32),
            "split/x/train": np.arange(17, dtype=np.int64)}
  with GraphBinWriter(str(tmp_path / "one.graphbin")) as w:
    for name, arr in arrays.items():
      w.add(name, arr)
  sections = []
  for name, arr in arrays.items():
    if name in ("meta", "split/x/train"):  # glue: bytes the join writes itself
      sections.append(SectionParts(name, arr.dtype.str, arr.shape, (pieces.glue_array(arr),)))
      continue
    parts = []
    cuts = sorted(rng.choice(np.arange(1, len(arr)), 3, replace=False))
    for k, chunk in enumerate(np.split(arr, cuts)):
      with PieceWriter(str(tmp_path / "parts" / f"{name.replace('/', '~')}-{k}")) as pw:
        pw.write_array(chunk, arr.dtype)
      parts.append(Piece(name, k, pw.dest, pw.nbytes, pw.crc32c, arr.dtype.str, len(chunk), arr.shape[1:]))
    sections.append(SectionParts(name, arr.dtype.str, arr.shape, tuple(parts)))
  segments, _ = layout(sections)
  digest, size = join_local(segments, str(tmp_path / "joined.graphbin"))
  assert (tmp_path / "joined.graphbin").read_bytes() == (tmp_path / "one.graphbin").read_bytes()
  assert (digest, size) == (sha256_file(str(tmp_path / "one.graphbin")), os.path.getsize(tmp_path / "one.graphbin"))
  assert os.listdir(tmp_path / "parts") == []  # each piece removed once copied


def test_layout_refuses_a_missing_piece(tmp_path):
  with PieceWriter(str(tmp_path / "p")) as pw:
    pw.write_array(np.arange(4), "<i8")
  p = Piece("indices", 0, pw.dest, pw.nbytes, pw.crc32c, "<i8", 4)
  with pytest.raises(ValueError, match=r"section 'indices': its parts hold 32 bytes, shape \(8,\) of <i8 needs 64"):
    layout([SectionParts("indices", "<i8", (8,), (p,))])


CELLS = ["0", "-0", "+5", "007", "9223372036854775807", "-9223372036854775808", "1.5", "-0.057943", "1e5",
         "1E-5", "2.2250738585072011e-308", "4.9406564584124654e-324", "1.7976931348623157e308",
         "0.1000000000000000055511151231257827021181583404541015625", "123456789012345678901234567890.5",
         "3.14159265358979323846264338327950288", ".5", "5.", "1e400"]


@pytest.mark.parametrize("dtype", ["int", "float", "auto"])
@pytest.mark.parametrize("nonfinite", ["error", "nan", "allow"])
def test_fast_path_gives_the_text_paths_numbers_and_errors(dtype, nonfinite):
  """Every block the pandas fast path takes gives what the cell-by-cell text path gives (or the same error)."""
  rng = np.random.default_rng(1)
  texts = ["1,2\n3,4\n", "-1,0\n5,6\n", "1,2.5\n3,4\n", ",1\n2,3\n", "1,2\n3\n", "1,2,3\n4,5\n", "1,x\n2,3\n",
           "nan,1\n2,3\n", "1,2\n\n3,4\n", "1_0,2\n3,4\n", " 1,2\n3,4\n", "1e3,2\n3,4\n",
           "99999999999999999999,1\n2,3\n"]
  for _ in range(20):
    cells = rng.choice(CELLS, (6, 3))
    texts.append("".join(",".join(r) + "\n" for r in cells))
  for text in texts:
    def run(fast: bool):
      saved = read._fast_numbers
      if not fast:
        read._fast_numbers = lambda *a: None
      try:
        return [a for _, a in read.read_csv_chunks(io.BytesIO(gzip.compress(text.encode())), "f.csv.gz", dtype,
                                                  nonfinite=nonfinite)]
      except read.OgbFormatError as e:
        return str(e)
      finally:
        read._fast_numbers = saved
    fast, slow = run(True), run(False)
    if isinstance(slow, str):
      assert fast == slow, text
    else:
      assert not isinstance(fast, str), (text, fast)
      assert [a.dtype for a in fast] == [a.dtype for a in slow], text
      for a, b in zip(fast, slow):
        np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8),
                                      err_msg=text)  # bit for bit


def test_a_deflated_npz_member_is_streamed_once(tmp_path):
  rng = np.random.default_rng(2)
  arr = rng.integers(0, 1000, (2, 100_003))
  np.savez_compressed(tmp_path / "c.npz", edge_index=arr)
  with open(tmp_path / "c.npz", "rb") as f:
    member = read.NpzMember(f, "c.npz", "edge_index")
    assert member.compressed
    got = np.concatenate(list(member.chunks(5, 90_000, 7_000, row=1)))
    np.testing.assert_array_equal(got, arr[1, 5:90_000])
    rows = np.concatenate(list(member.chunks(0, 2, 1)))
    np.testing.assert_array_equal(rows, arr)


# --------------------------------------------------------------------------- end to end


def _convert(src: str, out: str, *flags: str):
  ogb_graphs.run([f"--input={src}", f"--output={out}", *flags])
  return load_manifest(out)


@pytest.fixture(scope="module")
def papers(tmp_path_factory):
  """A papers100M-style folder whose data.npz is deflated (as np.savez_compressed writes it), and its stored twin."""
  base = tmp_path_factory.mktemp("papers")
  t = mo.write_binary_node(base / "ogbn_papers100M", 0, num_nodes=3000, num_edges=20000)
  stored = base / "stored" / "ogbn_papers100M"
  import shutil
  shutil.copytree(t.folder, stored)
  with np.load(t.folder / "raw" / "data.npz") as z:
    np.savez(stored / "raw" / "data.npz", **{k: z[k] for k in z.files})
  return str(t.folder), str(stored)


def test_a_deflated_edge_index_is_one_source_a_stored_one_ranges(papers, monkeypatch):
  from pipelines.ogb_graphs import plan as plan_module

  monkeypatch.setattr(plan_module, "NPZ_EDGE_RANGE", 6000)
  deflated, stored = (plan_module.plan_graph(f, "ogbn-papers100M", "auto", 3000) for f in papers)
  assert [s.npz_range for s in deflated.edge_files] == [(0, 20000)]
  assert [s.npz_range for s in stored.edge_files] == [(0, 6000), (6000, 12000), (12000, 18000), (18000, 20000)]


@pytest.mark.slow  # end-to-end ogb_graphs runs (Beam)
def test_deflated_and_stored_npz_give_the_same_file(papers, tmp_path, monkeypatch):
  from pipelines.ogb_graphs import plan as plan_module

  monkeypatch.setattr(plan_module, "NPZ_EDGE_RANGE", 6000)  # several ranges for the stored one
  deflated, stored = papers
  with zipfile.ZipFile(os.path.join(deflated, "raw", "data.npz")) as z:
    assert all(i.compress_type == zipfile.ZIP_DEFLATED for i in z.infolist())
  a = _convert(deflated, str(tmp_path / "a"), "--edges_per_partition=3000")
  b = _convert(stored, str(tmp_path / "b"), "--edges_per_partition=3000")
  assert a.files[0].sha256 == b.files[0].sha256


@pytest.fixture(scope="module")
def arxiv(tmp_path_factory):
  base = tmp_path_factory.mktemp("arxiv")
  t = mo.write_homogeneous_node(base / "ogbn_arxiv", 0, num_nodes=400, num_edges=3000)
  out = str(base / "local")
  m = _convert(str(t.folder), out, "--edges_per_partition=300", "--csc=true")
  return str(t.folder), m


def _left_over(out: str, m) -> list[str]:
  gen = m.files[0].path.split("/")[0]
  return [p for p in fs.walk(fs.join(out, gen)) if "_parts" in p or "compose-" in p or "glue-" in p]


@pytest.mark.gcs
def test_gcs_pieces_composed_in_a_tree_give_the_local_bytes(arxiv, gcs_faults, monkeypatch):
  folder, local = arxiv
  src = f"gs://{gcs_faults.bucket}/pieces/ogbn_arxiv"
  upload_tree(folder, src)
  out = f"gs://{gcs_faults.bucket}/pieces/out_tree"
  monkeypatch.setattr(fs, "COMPOSE_MAX_SOURCES", 2)  # binary tree: many levels
  before = gcs_faults.requests_seen("/compose?")
  m = _convert(src, out, "--edges_per_partition=300", "--csc=true")
  assert m.files[0].sha256 == local.files[0].sha256 and m.files[0].num_bytes == local.files[0].num_bytes
  # 20+ segments two at a time: more compose requests than segments / 2, i.e. more than one level
  assert gcs_faults.requests_seen("/compose?") - before > 20
  assert _left_over(out, m) == []  # pieces, glue and intermediate objects deleted
  assert verify(out, m) == 0


@pytest.mark.gcs
def test_gcs_a_503_on_a_compose_is_retried_to_the_same_bytes(arxiv, gcs_faults):
  folder, local = arxiv
  src = f"gs://{gcs_faults.bucket}/pieces/c503/ogbn_arxiv"
  upload_tree(folder, src)
  out = f"gs://{gcs_faults.bucket}/pieces/out_503"
  gcs_faults.add_fault("/compose?", status=503, times=2)
  m = _convert(src, out, "--edges_per_partition=300", "--csc=true")
  assert gcs_faults.requests_seen("/compose?") >= 3
  assert m.files[0].sha256 == local.files[0].sha256
  assert _left_over(out, m) == []


@pytest.mark.gcs
def test_gcs_a_503_on_a_piece_upload_gives_the_same_bytes_or_no_manifest(arxiv, gcs_faults):
  folder, local = arxiv
  src = f"gs://{gcs_faults.bucket}/pieces/up/ogbn_arxiv"
  upload_tree(folder, src)
  out = f"gs://{gcs_faults.bucket}/pieces/out_up"
  gcs_faults.add_fault("_parts/graph-000001-indices", status=503, times=1, method="POST")
  m = _convert(src, out, "--edges_per_partition=300", "--csc=true")
  assert gcs_faults.requests_seen("_parts/graph-000001-indices") >= 2  # failed once, then sent again
  assert m.files[0].sha256 == local.files[0].sha256


@pytest.mark.gcs
def test_gcs_a_compose_that_keeps_failing_switches_no_manifest(arxiv, gcs_faults):
  folder, local = arxiv
  src = f"gs://{gcs_faults.bucket}/pieces/fail/ogbn_arxiv"
  upload_tree(folder, src)
  out = f"gs://{gcs_faults.bucket}/pieces/out_fail"
  first = _convert(src, out, "--edges_per_partition=300")  # a complete earlier output
  gcs_faults.add_fault("/compose?", status=503)  # until cleared
  # A short deadline: the launcher makes --transient_retry_seconds the process's policy, which the join's
  # compose (run by the in-process DirectRunner) uses.
  with pytest.raises(retry.RetryExhausted, match=r"composing gs://.*transient errors persisted.*503"):
    _convert(src, out, "--edges_per_partition=300", "--csc=true", "--overwrite=true", "--transient_retry_seconds=2")
  assert gcs_faults.requests_seen("/compose?") >= 2
  gcs_faults.clear_faults()
  assert load_manifest(out) == first  # the earlier output stays the complete one
  assert verify(out, first) == 0


@pytest.mark.slow  # end-to-end ogb_graphs runs (Beam)
def test_counters_of_the_graph_stages(tmp_path):
  from apache_beam.metrics.metric import MetricsFilter

  t = mo.write_homogeneous_node(tmp_path / "ogbn_arxiv", 0, num_nodes=300, num_edges=2000)
  result = ogb_graphs.run([f"--input={t.folder}", f"--output={tmp_path / 'out'}", "--edges_per_partition=500"])
  got: dict[str, int] = {}
  for r in result.metrics().query(MetricsFilter().with_namespace("pipelines.ogb_graphs"))["counters"]:
    got[r.key.metric.name] = got.get(r.key.metric.name, 0) + r.committed  # summed over the steps
  m = load_manifest(str(tmp_path / "out"))
  raw = t.folder / "raw"
  assert got["edges_read"] == 2000
  assert got["node_rows_read"] == 300 * 3  # node-feat, node-label, node_year
  assert got["partitions_sorted"] == 4  # 2000 edges, 500 a partition
  assert got["bytes_read"] == sum(os.path.getsize(raw / f) for f in os.listdir(raw) if f.startswith(("edge", "node")))
  assert got["bytes_written"] > m.files[0].num_bytes  # the pieces, then the file
