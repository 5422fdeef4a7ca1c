"""Committed outputs for loader tests, written with `formats` alone: no Beam, no converter, milliseconds each.

A test about a loader builds its input here, so that it fails only for what
the loader does. `write` leaves what a converter's last steps leave
(pipelines/core/sink.py `write_shard`, `commit_records`, `commit_output`, and
the launcher's claim and finish): shards and an empty rejects list in a fresh
generation folder, then the manifest switched by formats.outputs.commit and
the TFDS metadata beside it. Writing to a folder that holds an output is a
rerun: the new generation replaces the old one, which is kept for its
retention (formats.outputs.commit.cleanup removes it).

    features, payloads = make_outputs.raw_images(np.random.default_rng(0), 12)
    out = make_outputs.write(str(tmp_path / "out"), features, {"train": payloads}, kind="image", num_shards=3)

`write_graph` commits a graph output the same way (one .graphbin that the
caller's function fills; `write_mag` fills one laid out as ogb_graphs writes
ogbn-mag), `write_tensors` a "tensors" output of `tensor_record`s.

The record makers below return (features, encoded records) for each record
kind (formats.kinds), as the converters shape them: `raw_images` and
`jpeg_images` (image_folder), `volumes` and `labelled_volumes` (ct_volumes,
without and with masks), `graphs` (ogb_graphs' graph-property records) and
`tensors` (array_folder and other generic ones).
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from PIL import Image as PILImage

from formats import adapters, naming
from formats.features import ClassLabel, Features, Image, Tensor, Text
from formats.graphbin import GraphBinWriter
from formats.manifest import REJECTED_FILENAME, FileInfo, Manifest, Rejected, ShardInfo, SplitInfo, sha256_file
from formats.outputs import commit
from formats.storage import files

CLASSES = ("cat", "dog", "yak")


def write(output: str, features: Features, splits: Mapping[str, Sequence[bytes]], *, kind: str,
          file_format: str = "array_record", num_shards: int | Mapping[str, int] = 1, name: str = "things") -> str:
  """Commits an output of record shards at `output` (local or gs://).

  Args:
    output: the output folder; one that holds an output already gets a new generation (a rerun).
    features: the records' features.
    splits: split name -> its encoded records, in order; each split's records are cut into
      `num_shards` consecutive runs of equal length (the last one shorter).
    kind: the record kind the manifest records (formats.kinds).
    file_format: "array_record" or "tfrecord".
    num_shards: shards per split, or split name -> its shard count.
    name: the data set's name (part of every shard's name).

  Returns:
    `output`.
  """
  generation, version = _claim(output)
  infos = {}
  with tempfile.TemporaryDirectory(prefix="loader-test-output-") as tmp:
    for split, payloads in splits.items():
      count = num_shards[split] if isinstance(num_shards, Mapping) else num_shards
      per = -(-len(payloads) // count)
      shards = []
      for k in range(count):
        shard = naming.ShardName(name, split, file_format, k, count).filename
        local = os.path.join(tmp, shard)
        written = adapters.get(file_format).write_file(local, payloads[k * per:(k + 1) * per])
        shards.append(ShardInfo(_publish(local, output, generation, shard), written, os.path.getsize(local),
                                sha256_file(local)))
      infos[split] = SplitInfo(tuple(shards))
  manifest = Manifest(name=name, file_format=file_format, features=features, splits=infos,
                      rejected=Rejected(path=f"{generation}/{REJECTED_FILENAME}"), kind=kind)
  return _commit(output, generation, version, manifest)


def write_graph(output: str, build: Callable[[GraphBinWriter], None], *, name: str = "g",
                graph: Mapping | None = None) -> str:
  """Commits a graph output at `output`: one .graphbin, which `build` fills (a rerun when one exists already).

  Args:
    output: the output folder, local or gs://.
    build: called with an open `GraphBinWriter` (add_meta, add ...).
    name: the data set's name; the file is `<name>.graphbin`.
    graph: the manifest's graph summary (ogb_graphs writes layout, task, num_nodes, num_edges, ...); None: none.

  Returns:
    `output`.
  """
  generation, version = _claim(output)
  with tempfile.TemporaryDirectory(prefix="loader-test-output-") as tmp:
    local = os.path.join(tmp, f"{name}.graphbin")
    with GraphBinWriter(local) as w:
      build(w)
    info = FileInfo(_publish(local, output, generation, os.path.basename(local)), os.path.getsize(local),
                    sha256_file(local), "graphbin")
  manifest = Manifest(name=name, file_format="graphbin", features=Features({}), splits={}, files=(info,),
                      graph=graph, rejected=Rejected(path=f"{generation}/{REJECTED_FILENAME}"), kind="graphbin")
  return _commit(output, generation, version, manifest)


def _claim(output: str) -> tuple[str, commit.Version]:
  """The launcher's first step: a fresh generation claimed, and the manifest version it replaces."""
  return commit.begin(output, {"pipeline": "tests.loaders.make_outputs"})


def _publish(local: str, output: str, generation: str, name: str) -> str:
  """Copies a finished local file into the run's generation; returns its path relative to the output."""
  rel = f"{generation}/{name}"
  with open(local, "rb") as f:
    files.write_bytes(files.join(output, rel), f.read())
  return rel


def _commit(output: str, generation: str, version: commit.Version, manifest: Manifest) -> str:
  """A converter's last steps: the (empty) rejects list, the switch, the TFDS view, the run marked finished."""
  files.write_bytes(files.join(output, manifest.rejected.path), b"")
  commit.commit(output, generation, manifest, version)
  commit.sync_tfds_metadata(output)
  commit.finish(output, generation)
  return output


# --------------------------------------------------------------------------- records of each kind


def encode_image(rng: np.random.Generator, size: tuple[int, int], mode: str = "RGB", fmt: str = "JPEG") -> bytes:
  """A random (height, width) picture with some structure (its top half darker), encoded as `fmt` in `mode`."""
  h, w = size
  pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
  pixels[: h // 2] //= 3  # some structure, so that resizing matters
  out = io.BytesIO()
  PILImage.fromarray(pixels).convert(mode).save(out, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
  return out.getvalue()


def image_features(size: tuple[int, int] | None = None, raw: bool = False,
                   classes: Sequence[str] = CLASSES) -> Features:
  """image_folder's schema: `image` (encoded, of one (height, width) `size` when given; or, `raw`, uint8
  pixels of `size`), `label` and `file_name`."""
  if raw:
    image = Tensor((*size, 3), "uint8")
  else:
    image = Image(shape=(*size, 3) if size else (None, None, 3))
  return Features({"image": image, "label": ClassLabel(tuple(classes)), "file_name": Text()})


def raw_images(rng: np.random.Generator, n: int, size: tuple[int, int] = (12, 10),
               classes: Sequence[str] = CLASSES) -> tuple[Features, list[bytes]]:
  """`n` image records of raw uint8 pixels, all of one (height, width): image_folder's --encoding=raw.

  Record i has label i % len(classes) and file name `c/<i>.png`: two calls with the same `n` give records of
  the same encoded sizes.
  """
  features = image_features(size, raw=True, classes=classes)
  return features, [features.encode({"image": rng.integers(0, 256, (*size, 3), dtype=np.uint8),
                                     "label": i % len(classes), "file_name": f"c/{i}.png"}) for i in range(n)]


_MODES = (("RGB", "JPEG"), ("L", "JPEG"), ("CMYK", "JPEG"), ("RGBA", "PNG"), ("P", "PNG"))


def jpeg_images(rng: np.random.Generator, n: int, fixed: tuple[int, int] | None = None, mixed: bool = True,
                classes: Sequence[str] = CLASSES) -> tuple[Features, list[bytes]]:
  """`n` encoded image records: each of its own size (8..59 pixels a side) unless `fixed` (height, width).

  `mixed` cycles through RGB, gray and CMYK JPEGs and RGBA and palette PNGs (what a reader must still
  decode); without it every image is an RGB JPEG, as image_folder writes them. Record i has label
  i % len(classes).
  """
  features = image_features(fixed, classes=classes)
  payloads = []
  for i in range(n):
    size = fixed or (int(rng.integers(8, 60)), int(rng.integers(8, 60)))
    mode, fmt = _MODES[i % len(_MODES)] if mixed else _MODES[0]
    payloads.append(features.encode({"image": encode_image(rng, size, mode, fmt), "label": i % len(classes),
                                     "file_name": f"{i}.x"}))
  return features, payloads


VOLUME_FEATURES = Features({
    "volume": Tensor((None, None, None), "int16"), "spacing": Tensor((3,), "float32", encoding="none"),
    "origin": Tensor((3,), "float32", encoding="none"), "direction": Tensor((3, 3), "float32", encoding="none"),
    "num_slices": Tensor((), "int64", encoding="none"), "series_id": Text(), "patient_id": Text(), "sorted_by": Text(),
})


def volumes(rng: np.random.Generator, n: int, depth: tuple[int, int] = (2, 9),
            side: tuple[int, int] = (6, 20), dtype: str = "int16") -> tuple[Features, list[bytes]]:
  """`n` CT volume records of random HU values (0 and up for an unsigned `dtype`), each of its own shape: depth
  in [depth[0], depth[1]), rows and columns in [side[0], side[1])."""
  features = Features({**{k: VOLUME_FEATURES[k] for k in VOLUME_FEATURES}, "volume": Tensor((None, None, None), dtype)})
  low = 0 if np.dtype(dtype).kind == "u" else -1500
  payloads = []
  for i in range(n):
    shape = (int(rng.integers(*depth)), int(rng.integers(*side)), int(rng.integers(*side)))
    payloads.append(features.encode({
        "volume": rng.integers(low, 3500, shape).astype(dtype), "spacing": rng.random(3).astype(np.float32),
        "origin": rng.random(3).astype(np.float32), "direction": np.eye(3, dtype=np.float32),
        "num_slices": shape[0], "series_id": f"s{i}", "patient_id": "p", "sorted_by": "z"}))
  return features, payloads


# A labelled volume's foreground voxel holds LABEL_HU_STEP * its code (the class id, or the bitmask of its
# channels, bit c - 1 for class c); background holds less than 0 HU. Codes up to MAX_HU_CODE are readable back
# from the volume (`code_of_hu`); larger ones are written as MAX_HU_CODE.
LABEL_HU_STEP = 100
MAX_HU_CODE = 30


def labelled_volume_features(layout: str = "classes", num_classes: int = 3) -> Features:
  """ct_volumes' schema with masks: VOLUME_FEATURES, `label` ("classes": [D, H, W] class ids, uint8, or uint16
  past 255; "channels": [D, H, W, num_classes] uint8 0/1) and `label_source`."""
  if layout == "classes":
    label = Tensor((None, None, None), "uint8" if num_classes <= 255 else "uint16")
  else:
    label = Tensor((None, None, None, num_classes), "uint8")
  return Features({**dict(VOLUME_FEATURES.items()), "label": label, "label_source": Text()})


def code_of_hu(hu: np.ndarray) -> np.ndarray:
  """The label code (int64) a labelled volume's HU values encode: 0 for background and for padding."""
  return np.where(hu >= LABEL_HU_STEP, np.round(hu / LABEL_HU_STEP), 0).astype(np.int64)


def label_code(label: np.ndarray, layout: str) -> np.ndarray:
  """The code (int64) of each voxel of a label or a batch of them: its class id ("classes"), or the bitmask of
  its channels, the last axis ("channels")."""
  if layout == "classes":
    return label.astype(np.int64)
  return (label.astype(np.int64) << np.arange(label.shape[-1])).sum(axis=-1)


def labelled_volumes(rng: np.random.Generator, n: int, layout: str = "classes", num_classes: int = 3,
                     depth: tuple[int, int] = (8, 17), side: tuple[int, int] = (16, 33),
                     blobs: tuple[int, int] = (1, 4), empty_every: int | None = 4) -> tuple[Features, list[bytes]]:
  """`n` CT volume records with masks (`labelled_volume_features`), each of its own shape (depth in
  [depth[0], depth[1]), rows and columns in [side[0], side[1])).

  Each label holds a few small boxes (blobs[0] to blobs[1] - 1, 1 to 3 voxels a side, at random places, of
  random classes 1..num_classes; later boxes overwrite earlier ones in the classes layout, overlap in the
  channels one); record i has none when i % empty_every == empty_every - 1. The volume encodes its label
  (LABEL_HU_STEP * `label_code`, background in [-1000, 0) HU), so a patch's label can be read from its pixels.
  """
  features = labelled_volume_features(layout, num_classes)
  payloads = []
  for i in range(n):
    shape = (int(rng.integers(*depth)), int(rng.integers(*side)), int(rng.integers(*side)))
    label = np.zeros(shape if layout == "classes" else (*shape, num_classes), features["label"].dtype)
    count = 0 if empty_every and i % empty_every == empty_every - 1 else int(rng.integers(*blobs))
    for _ in range(count):
      size = rng.integers(1, 4, 3)
      at = [int(rng.integers(0, max(d - s, 0) + 1)) for d, s in zip(shape, size)]
      box = tuple(slice(a, a + int(s)) for a, s in zip(at, size))
      c = int(rng.integers(1, num_classes + 1))
      if layout == "classes":
        label[box] = c
      else:
        label[(*box, c - 1)] = 1
    code = np.minimum(label_code(label, layout), MAX_HU_CODE)
    volume = np.where(code > 0, code * LABEL_HU_STEP, rng.integers(-1000, 0, shape)).astype(np.int16)
    payloads.append(features.encode({
        "volume": volume, "spacing": rng.random(3).astype(np.float32), "origin": rng.random(3).astype(np.float32),
        "direction": np.eye(3, dtype=np.float32), "num_slices": shape[0], "series_id": f"s{i}", "patient_id": "p",
        "sorted_by": "z", "label": label, "label_source": "seg"}))
  return features, payloads


GRAPH_FEATURES = Features({
    "edge_index": Tensor((2, None), "int64"), "num_nodes": Tensor((), "int64", encoding="none"),
    "label": Tensor((2,), "float32", encoding="none"), "node_feat": Tensor((None, 3), "int64"),
    "edge_feat": Tensor((None, 2), "float32"),
})


def graph(rng: np.random.Generator, nodes: int, edges: int) -> dict:
  """One graph-property record's values: `edges` random edges among `nodes` nodes (edge ends are 0 when
  there are no nodes), a label with a missing task (NaN)."""
  return {"edge_index": rng.integers(0, max(nodes, 1), (2, edges)), "num_nodes": nodes,
          "label": np.array([rng.random(), np.nan], np.float32), "node_feat": rng.integers(-5, 5, (nodes, 3)),
          "edge_feat": rng.normal(size=(edges, 2)).astype(np.float32)}


def graphs(rng: np.random.Generator, n: int, min_nodes: int = 0) -> tuple[Features, list[bytes]]:
  """`n` graph records of min_nodes..11 nodes and 0..19 edges (with min_nodes=0 some have edges but no node)."""
  sizes = [(int(rng.integers(min_nodes, 12)), int(rng.integers(0, 20))) for _ in range(n)]
  return GRAPH_FEATURES, [GRAPH_FEATURES.encode(graph(rng, *s)) for s in sizes]


TENSOR_FEATURES = Features({
    "x": Tensor((4, 3), "float32"),
    "ids": Tensor((5,), "int16"),
    "flag": Tensor((), "bool"),
    "spacing": Tensor((3,), "float32", encoding="none"),
    "count": Tensor((), "int64", encoding="none"),
    "label": ClassLabel(("a", "b", "c")),
    "name": Text(),
})


def tensor_record(i: int) -> dict:
  """Record i's values of TENSOR_FEATURES, a pure function of i."""
  rng = np.random.default_rng(i)
  return {"x": rng.normal(size=(4, 3)).astype(np.float32), "ids": rng.integers(-999, 999, 5).astype(np.int16),
          "flag": np.asarray(i % 2 == 0), "spacing": np.asarray([0.5, 0.5, i], np.float32),
          "count": np.asarray(i * 7, np.int64), "label": i % 3, "name": f"item {i}"}


def tensors(n: int, features: Features = TENSOR_FEATURES) -> tuple[Features, list[bytes]]:
  """Records 0..n-1 of `tensor_record`, each with the features of `features` (a subset of TENSOR_FEATURES')."""
  return features, [features.encode({f: tensor_record(i)[f] for f in features}) for i in range(n)]


def write_tensors(output: str, file_format: str, num_records: int = 22, num_shards: int = 2,
                  features: Features = TENSOR_FEATURES) -> str:
  """A committed "tensors" output: split "train" holding records 0..num_records-1 of `tensor_record`."""
  return write(output, features, {"train": tensors(num_records, features)[1]}, kind="tensors",
               file_format=file_format, num_shards=num_shards)


# --------------------------------------------------------------------------- graphs


def csr(src: np.ndarray, dst: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
  """The CSR (indptr int64, indices int32) of the edges src -> dst, rows in [0, num_rows), edges of a row in
  input order."""
  order = np.argsort(src, kind="stable")
  indptr = np.concatenate([[0], np.cumsum(np.bincount(src, minlength=num_rows))]).astype(np.int64)
  return indptr, dst[order].astype(np.int32)


MAG_RELATIONS = (("author", "affiliated_with", "institution"), ("author", "writes", "paper"),
                 ("paper", "cites", "paper"), ("paper", "has_topic", "field_of_study"))


def write_mag(output: str, num_nodes: Mapping[str, int], num_edges: Mapping[tuple[str, str, str], int],
              seed: int = 0, feat_dim: int = 16, num_classes: int = 349) -> str:
  """Commits a MAG-shaped graph laid out as ogb_graphs writes ogbn-mag with --add_reverse_relations=true.

  Random edges for each relation of `num_edges` ((head, name, tail) -> count), each relation's CSR by head
  node and its reverse `<tail>___rev_<name>___<head>` by tail node, every edge's relation number as
  `edge/reltype`; papers have features, a year (2010..2019) and a label, split by year (train to 2017,
  valid 2018, test 2019); the other node types have nothing but their count.

  Args:
    output: the output folder, local or gs://.
    num_nodes: node type -> count; "paper" is required.
    num_edges: relation triplet -> its edge count.
    seed: the random seed.
    feat_dim: paper features per node.
    num_classes: paper labels are in [0, num_classes).

  Returns:
    `output`.
  """
  rng = np.random.default_rng(seed)
  types = sorted(num_nodes)
  forward, reverse, sections = [], [], {}
  for number, (head, name, tail) in enumerate(num_edges):
    count = num_edges[head, name, tail]
    src, dst = rng.integers(0, num_nodes[head], count), rng.integers(0, num_nodes[tail], count)
    for rel, rows, (a, b), kept in ((f"{head}___{name}___{tail}", num_nodes[head], (src, dst), forward),
                                    (f"{tail}___rev_{name}___{head}", num_nodes[tail], (dst, src), reverse)):
      sections[f"rel/{rel}/indptr"], sections[f"rel/{rel}/indices"] = csr(a, b, rows)
      sections[f"rel/{rel}/edge/reltype"] = np.full((count, 1), number, np.int64)
      kept.append(rel)
  papers = num_nodes["paper"]
  years = rng.integers(2010, 2020, (papers, 1))
  sections["node/paper/feat"] = rng.normal(0, 0.1, (papers, feat_dim)).astype(np.float32)
  sections["node/paper/year"] = years.astype(np.int64)
  sections["node/paper/label"] = rng.integers(0, num_classes, (papers, 1)).astype(np.int64)
  sections["node_type_offsets"] = np.concatenate([[0], np.cumsum([num_nodes[t] for t in types])]).astype(np.int64)
  for split, keep in (("test", years[:, 0] == 2019), ("train", years[:, 0] <= 2017), ("valid", years[:, 0] == 2018)):
    sections[f"split/time/paper/{split}"] = np.flatnonzero(keep).astype(np.int64)
  edges = {rel: num_edges[triplet] for rels in (forward, reverse) for rel, triplet in zip(rels, num_edges)}
  reverse_relations = {rev: {"num_edges": edges[fwd], "reverse_of": fwd} for fwd, rev in zip(forward, reverse)}
  meta = {"format": "graphbin", "layout": "heterogeneous", "name": "ogbn-mag", "node_types": types,
          "num_nodes": dict(num_nodes), "relations": forward + reverse, "reverse_relations": reverse_relations,
          "splits": ["split/time/paper"], "task": "node"}

  def build(w: GraphBinWriter) -> None:
    w.add_meta(meta)
    for section, array in sections.items():
      w.add(section, array)

  summary = {"layout": "heterogeneous", "task": "node", "num_nodes": dict(num_nodes), "num_edges": edges,
             "add_inverse_edges": False, "csc": False, "reverse_relations": reverse_relations}
  return write_graph(output, build, name="ogbn_mag", graph=summary)
