"""A graph output opened for reading: the memory-mapped `.graphbin` and how it is found, fetched and verified.

`load(path)` takes a graph output folder (or the .graphbin in it), local or
gs://; a gs:// graph is downloaded once into a cache by parallel ranged reads
(formats.storage.gcs_download), its manifest SHA-256 and every section's CRC checked
as the bytes arrive, and resumed when interrupted. `Graph` is the mapped file:
its arrays are read-only views. No framework.
"""

from __future__ import annotations

import os

import numpy as np

from formats.storage import files, gcs_download
from formats.errors import CorruptRecordError, GraphBinError
from formats.graphbin import HEADER, GraphBin, check_graph, check_listed, parse_header, parse_table
from formats.outputs.integrity import Verify, check_local_file, remember_verified, verify_level
from formats.manifest import MANIFEST_FILENAME, FileInfo, Manifest
from formats.outputs.output import DEFAULT_CACHE_ROOT, is_output, open_output


class Graph:
  """A .graphbin opened for reading: arrays are read-only views of the mapped file.

  Attributes:
    path: the local .graphbin.
    meta: the file's metadata (node counts per type, ...).
    num_nodes: nodes of every type together.
    indptr, indices: the homogeneous CSR (None when the graph has none).
    node_features, labels: `node/feat` and `node/label` (None when absent).
  """

  def __init__(self, path: str, verify: bool = True, check_values: bool = True):
    """Maps `path`.

    Args:
      path: a local .graphbin file.
      verify: check every section's CRC now (the whole file is read once).
      check_values: also scan the index arrays (CSR order, neighbour and split ids in range; one
        pass over each). Shapes, dtypes and counts are checked either way; the samplers check the
        CSR and the seeds they use again.

    Raises:
      GraphBinError: the file is not a valid .graphbin, its sections contradict `meta` or each other
        (formats.graphbin.check_graph: shapes, dtypes, CSR order and id ranges, checked whatever
        `verify` says), or (verify) a section's CRC is wrong.
    """
    self.path = path
    self.bin = GraphBin(path, verify=verify)
    check_graph(self.bin, values=check_values)  # CRCs prove the writer's bytes, not that they agree
    self.meta = self.bin.meta
    self.num_nodes: int = int(sum(self.meta.get("num_nodes", {}).values()))
    self.indptr = self.bin["indptr"] if "indptr" in self.bin else None
    self.indices = self.bin["indices"] if "indices" in self.bin else None
    self.node_features = self.bin["node/feat"] if "node/feat" in self.bin else None
    self.labels = self.bin["node/label"] if "node/label" in self.bin else None

  @property
  def num_edges(self) -> int:
    """Edges of the homogeneous CSR (0 when there is none)."""
    return 0 if self.indices is None else len(self.indices)

  @property
  def splits(self) -> dict[str, np.ndarray]:
    """{"<split name>/<train|valid|test>[/<key>]": ids}, e.g. {"time/train": ...}."""
    return {n[len("split/"):]: self.bin[n] for n in self.bin.names("split/")}

  def split(self, part: str = "train") -> np.ndarray:
    """The node ids of one part of the graph's split.

    Args:
      part: "train", "valid" or "test"; the data set's split name may be omitted
        ("train" finds "time/train").

    Returns:
      The ids, a read-only view.

    Raises:
      KeyError: `part` matches no split, or more than one.
    """
    matches = [v for k, v in self.splits.items() if k == part or k.endswith("/" + part)]
    if len(matches) != 1:
      raise KeyError(f"{self.path}: split {part!r} matches {len(matches)} of {sorted(self.splits)}")
    return matches[0]

  def relation(self, name: str) -> tuple[np.ndarray, np.ndarray]:
    """The CSR of one relation of a heterogeneous graph.

    Args:
      name: the relation, e.g. "paper___cites___paper".

    Returns:
      (indptr, indices), read-only views.

    Raises:
      KeyError: the graph has no such relation.
    """
    return self.bin[f"rel/{name}/indptr"], self.bin[f"rel/{name}/indices"]

  @property
  def node_type_offsets(self) -> dict[str, int]:
    """Heterogeneous graphs: global id = offset of the type + id within the type."""
    counts = self.meta.get("num_nodes", {})
    out, acc = {}, 0
    for t in sorted(counts):
      out[t], acc = acc, acc + counts[t]
    return out


def load(path: str, cache_dir: str | None = None, verify: Verify = "sha256", *, streams: int = 8,
         chunk_bytes: int = 32 << 20, progress: bool = True) -> Graph:
  """Opens a graph output (its folder, or the .graphbin itself), local or gs://.

  The output is opened through formats.outputs.output. A gs:// graph is downloaded
  once into `cache_dir` by `streams` parallel ranged reads pinned to one
  generation of the object; its SHA-256 (the manifest's) and every section's
  CRC are checked as the bytes arrive, and an interrupted download is resumed
  by the next load. Later loads reuse the verified copy.

      graph = load("gs://bucket/graphs/ogbn_products", streams=16)

  Args:
    path: the output folder, or the .graphbin in it; local or gs://. A local
      .graphbin without a manifest beside it is opened on its own.
    cache_dir: where gs:// graphs are cached (default ~/.cache/tpu_shards/graphs).
    verify: how a local graph is proven: "sha256" (default; once per file per
      process, or every section's CRC when there is no manifest), "size" or "none".
      Every level checks the sections' shapes, dtypes and counts against `meta`;
      "sha256" also scans the index arrays' values (see `Graph`).
    streams: gs:// only: ranged reads in flight at once.
    chunk_bytes: gs:// only: bytes per ranged read (each stream holds one in memory).
    progress: gs:// only: a progress bar on stderr when it is a terminal, else a log line every few seconds.

  Returns:
    The mapped graph.

  Raises:
    NotAnOutputError: the folder has no manifest (a FileNotFoundError).
    FileNotFoundError: the manifest lists no such graph, or the object is missing.
    CorruptRecordError: the file differs from the manifest at level `verify`, or
      (gs://) a section's CRC or the SHA-256 differs; nothing is left in the cache.
    GraphBinError: the file is not a valid .graphbin, its sections contradict each other or `meta`
      (see `Graph`), or its node counts differ from the manifest's `graph` entry.
    NotEnoughSpaceError: (gs://) the cache's disk cannot hold the graph (an OSError); nothing is written.
    SourceChangedError: (gs://) the object was replaced during the download.
    ConnectionError: (gs://) a range kept failing; the next load resumes the download.
    ValueError: `verify`, `streams` or `chunk_bytes` is not valid.
  """
  level = verify_level(verify)
  folder, file_name = path, None
  if path.endswith(".graphbin"):
    folder, file_name = path.rsplit("/", 1)[0] if files.is_gcs(path) else os.path.dirname(path), os.path.basename(path)
    if not files.is_gcs(path) and not is_output(folder):
      # no manifest: every section's CRC stands in for its digest
      return Graph(path, verify=level == "sha256", check_values=level == "sha256")
  options = gcs_download.DownloadOptions(streams=streams, chunk_bytes=chunk_bytes, progress=progress)
  output = open_output(folder)
  blobs = [f for f in output.files
           if f.kind == "graphbin" and (file_name is None or os.path.basename(f.path) == file_name)]
  if len(blobs) != 1:
    raise FileNotFoundError(f"{files.join(folder, MANIFEST_FILENAME)} lists no graph {file_name or ''}".rstrip())
  info = blobs[0]
  if not files.is_gcs(folder):
    graph = Graph(output.local_copy(info, verify=level), verify=False, check_values=level == "sha256")
    return _as_listed(graph, output.manifest)
  src = output.shard_path(info)
  local = files.cache_path(src, info.sha256, cache_dir or os.path.join(DEFAULT_CACHE_ROOT, "graphs"))
  # The cached copy was proven when it was downloaded (its digest and every section's CRC). The cache outlives
  # processes: the copy is checked at level `verify` like a local file (by default hashed once per process), and
  # one damaged or cut since its download is fetched again (as Output.local_copy does for shards).
  verified, sections_verified = local + ".verified", local + ".sections-verified"
  for attempt in (1, 2):
    if not (os.path.exists(verified) and os.path.exists(local)):
      _download(src, info, local, options)
      open(sections_verified, "w").close()
      open(verified, "w").close()
      remember_verified(local, info.sha256)  # every byte was hashed as it arrived: not again in this process
    try:
      check_local_file(local, info.num_bytes, info.sha256, level)
      break
    except (CorruptRecordError, FileNotFoundError):
      if attempt == 2:
        raise
      for stale in (verified, sections_verified, local):
        if os.path.exists(stale):
          os.remove(stale)
  if not os.path.exists(sections_verified):  # a cached copy whose sections are unchecked: checked once, here
    Graph(local, verify=True)
    open(sections_verified, "w").close()
  return _as_listed(Graph(local, verify=False), output.manifest)


def _as_listed(graph: Graph, manifest: Manifest) -> Graph:
  """`graph`, once its node counts are the ones the manifest's `graph` entry states (check_listed)."""
  check_listed(graph.bin, (manifest.graph or {}).get("num_nodes"))
  return graph


def _download(src: str, info: FileInfo, local: str, options: gcs_download.DownloadOptions) -> None:
  """Fetches the .graphbin `src` into `local`: its header and section table first, then every byte, checked."""
  obj = gcs_download.remote_object(src)
  if obj.size != info.num_bytes:
    raise CorruptRecordError(f"{src}: {obj.size} bytes, the manifest says {info.num_bytes} (corrupt or changed)")
  header = parse_header(gcs_download.read_range(obj, 0, min(HEADER.size, obj.size), options), src, obj.size)
  table = gcs_download.read_range(obj, header.table_offset, header.table_offset + header.table_nbytes, options) \
      if header.table_nbytes else b""
  try:
    sections = parse_table(table, header, src)
  except GraphBinError as e:  # the table's checksum or contents: bytes that differ from what the writer wrote
    raise CorruptRecordError(str(e)) from None
  checks = [gcs_download.RangeCheck(s.name, s.offset, s.nbytes, s.crc32c) for s in sections.values()]
  gcs_download.download(obj, local, info.sha256, checks, options)
