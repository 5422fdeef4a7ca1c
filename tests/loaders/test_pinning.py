"""Readers pin what they opened: one generation for their whole life, named in every state, held by a lease.

The issue's scenario end to end (a loader reading while the same conversion
is rerun twice and a retention clean-up runs), states refused on another
generation (grain, torch_xla, the graph feeders), leases while a reader
lives, and read-only outputs.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from formats.outputs import commit, leases
from formats.features import Features
from formats.graphbin import GraphBinWriter
from formats.manifest import MANIFEST_FILENAME, FileInfo, Manifest, sha256_file
from formats.naming import new_generation
from formats.outputs.output import open_output
from loaders import ShardedRecords, StateMismatchError, UnverifiedStateWarning
from loaders import grain as grain_loader
from loaders import graph as lg
from tests.conftest import REPO
from tests.loaders import make_outputs

CLASSES = ("a", "b", "c")
ARGS = dict(batch_size=4, seed=3, num_threads=1, prefetch_buffer_size=1, num_epochs=3)  # reads 1 batch ahead


@pytest.fixture
def images() -> dict[str, list[int]]:
  """The input the scenario converts again and again: class -> the numbers of its 8 images."""
  return {cls: list(range(8)) for cls in CLASSES}


def _convert(images: dict[str, list[int]], out: str, size: int = 16, num_shards: int = 6,
             file_format: str = "array_record") -> None:
  """The conversion the scenario reruns: raw size x size images (16x16 in 6 ArrayRecord shards unless told),
  committed as a converter commits them (on an existing output: a rerun, which replaces it). An image's pixels
  are a function of its class and number."""
  features = make_outputs.image_features((size, size), raw=True, classes=CLASSES)
  payloads = [features.encode({"image": np.random.default_rng([label, i]).integers(0, 256, (size, size, 3), np.uint8),
                               "label": label, "file_name": f"{cls}/{i}.png"})
              for label, cls in enumerate(CLASSES) for i in images[cls]]
  make_outputs.write(out, features, {"train": payloads}, kind="image", file_format=file_format,
                     num_shards=num_shards)


def _change(images: dict[str, list[int]], k: int) -> None:
  """The input changes between runs: image k of every class goes."""
  for cls in CLASSES:
    del images[cls][k]


def _output(where: str, tmp_path, request) -> str:
  if where == "gcs":
    return f"gs://{request.getfixturevalue('gcs_emulator')}/pinning/{tmp_path.name}"
  return str(tmp_path / "out")


def _equal(a: list[dict], b: list[dict]) -> bool:
  return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
                                  for x, y in zip(a, b))


def _names(output: str) -> set[str]:
  return {info.purpose for info in leases.list_leases(output)}


@pytest.mark.parametrize("where,window", [("local", None), ("local", 1),
                                          pytest.param("gcs", 1, marks=[pytest.mark.gcs, pytest.mark.slow])])
def test_a_loader_finishes_every_epoch_on_its_generation_across_two_reruns_and_a_cleanup(
    where, window, images, tmp_path, request):
  """The issue's scenario: two batches read, the same conversion rerun twice on a changed folder, a clean-up
  with no retention; the loader's batches are those of a run without reruns, all epochs long."""
  out = _output(where, tmp_path, request)
  _convert(images, out)
  first = open_output(out).generation
  largest = max(s.num_bytes for s in open_output(out).shards("train"))
  stream = dict(window_shards=window, cache_dir=str(tmp_path / "cache"),  # 3 of the 6 shards at a time
                cache_limit_bytes=4096 + 3 * (largest + 4 * 4096)) if window else {}
  want = list(grain_loader.dataset(out, "train", **ARGS, **stream))
  ds = grain_loader.dataset(out, "train", **ARGS, **stream)
  it = iter(ds)
  got = [next(it) for _ in range(2)]
  for k in (0, 1):  # the daily reruns
    _change(images, k)
    _convert(images, out)
  assert open_output(out).generation != first
  commit.cleanup(out, keep_replaced_seconds=0)
  assert first in leases.held_generations(out)
  got += list(it)
  assert len(got) == len(want) == 3 * (24 // 4)
  assert _equal(got, want)
  ds.close()
  del it, ds
  assert first not in leases.held_generations(out)
  assert first in commit.cleanup(out, keep_replaced_seconds=0)  # free now: removed
  assert len(list(grain_loader.dataset(out, "train", **ARGS, **stream))) == 3 * (18 // 4)  # the new data


@pytest.fixture
def rerun(images, tmp_path):
  """(output, a grain state saved 7 batches in (epoch 1) on its first generation, the first generation) after
  a rerun on a changed folder."""
  out = str(tmp_path / "out")
  _convert(images, out)
  it = iter(grain_loader.dataset(out, "train", **ARGS))
  for _ in range(7):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  old = open_output(out).generation
  _change(images, 0)
  _convert(images, out)
  return out, state, old


def test_a_grain_state_of_another_generation_is_refused_unless_asked(rerun):
  out, state, old = rerun
  new = open_output(out).generation
  assert state["data"]["generation"] == old
  assert state["epoch"] == 1
  assert state["data"]["split"] == "train"
  it = iter(grain_loader.dataset(out, "train", **ARGS))
  with pytest.raises(StateMismatchError) as e:
    it.set_state(state)
  message = str(e.value)
  assert old in message
  assert new in message
  assert "\n" not in message
  assert isinstance(e.value, ValueError)
  ds = grain_loader.dataset(out, "train", **ARGS, on_new_data="restart_epoch")
  it = iter(ds)
  it.set_state(state)
  per_epoch = 21 // 4
  fresh = list(ds)
  assert _equal(list(it), fresh[per_epoch:])  # epoch 1 from its first batch, on the new data
  with pytest.raises(StateMismatchError, match="split 'validation'"):  # another split is other data too
    iter(grain_loader.dataset(out, "train", **ARGS)).set_state(
        {**state, "data": {**state["data"], "manifest_sha256": open_output(out).manifest_sha256,
                           "split": "validation"}})
  with pytest.raises(ValueError, match="on_new_data must be one of"):
    grain_loader.dataset(out, "train", **ARGS, on_new_data="ignore")


def test_a_state_without_identity_resumes_with_a_warning_and_the_same_data_resumes_silently(rerun, recwarn):
  out, _, _ = rerun
  ds = grain_loader.dataset(out, "train", **ARGS)
  all_batches = list(ds)
  it = iter(ds)
  with pytest.warns(UnverifiedStateWarning, match="without the data's identity"):
    it.set_state({"next_index": 3})  # a state of the previous release
  assert _equal(list(it), all_batches[3:])
  it = iter(ds)
  next(it)
  state = json.loads(json.dumps(it.get_state()))
  again = iter(grain_loader.map_dataset(out, "train", batch_size=4, seed=3, num_epochs=3).to_iter_dataset())
  again.set_state(state)  # the same data, another dataset object (map_dataset's iterator): no warning
  assert _equal(list(again), all_batches[1:])
  assert not [w for w in recwarn.list if issubclass(w.category, UnverifiedStateWarning)]


def test_a_dataset_holds_a_lease_while_it_lives(images, tmp_path):
  out = str(tmp_path / "out")
  _convert(images, out)
  gen = open_output(out).generation
  for options in ({}, {"window_shards": 2}):
    ds = grain_loader.dataset(out, "train", batch_size=4, **options)
    assert _names(out) == {"loaders.grain train"}
    assert leases.held_generations(out) == {gen}
    ds.close()
    assert not leases.list_leases(out)
    ds = grain_loader.dataset(out, "train", batch_size=4, **options)
    it = iter(ds)
    next(it)
    del ds
    assert leases.held_generations(out) == {gen}  # its iterator keeps it
    it.close()  # grain's: stops its prefetch thread, which holds the iterator while it runs
    del it
    for _ in range(50):  # the iterator sits in reference cycles, some held a moment longer by grain's threads
      gc.collect()
      if not leases.list_leases(out):
        break
      time.sleep(0.1)
    assert not leases.list_leases(out)  # collected: released
  records = ShardedRecords(out)
  assert records.identity.generation == gen
  assert _names(out) == {"loaders.ShardedRecords train"}
  records.close()
  assert not leases.list_leases(out)
  ds = grain_loader.dataset(out, "train", batch_size=4, lease=False)
  assert not leases.list_leases(out)
  assert ds.identity.generation == gen


def test_the_pinned_manifest_is_read_once(images, tmp_path, monkeypatch):
  """Every epoch reads what the manifest named at open: nothing reads manifest.json after construction."""
  from formats.outputs import output as output_module

  out = str(tmp_path / "out")
  _convert(images, out)
  reads = []
  real = output_module._read_manifest
  monkeypatch.setattr(output_module, "_read_manifest", lambda path: reads.append(path) or real(path))
  for options in ({}, {"window_shards": 1}):
    ds = grain_loader.dataset(out, "train", **ARGS, **options)
    opened = len(reads)
    assert opened == 2  # the read, and the one that proves the lease came in time
    assert len(list(ds)) == 3 * 6
    assert len(reads) == opened
    reads.clear()


def _graph_output(out: str, num_nodes: int, seed: int) -> str:
  """A graph output committed by hand: <out>/gen-.../g.graphbin and a manifest listing it (a rerun when it
  exists already). Returns the new generation."""
  rng = np.random.default_rng(seed)
  gen = new_generation()
  os.makedirs(os.path.join(out, gen), exist_ok=True)
  path = os.path.join(out, gen, "g.graphbin")
  src, dst = rng.integers(0, num_nodes, 8 * num_nodes), rng.integers(0, num_nodes, 8 * num_nodes)
  order = np.argsort(src, kind="stable")
  with GraphBinWriter(path) as w:
    w.add_meta({"num_nodes": {"": num_nodes}})
    w.add("indptr", np.concatenate([[0], np.cumsum(np.bincount(src, minlength=num_nodes))]).astype(np.int64))
    w.add("indices", dst[order].astype(np.int32))
    w.add("node/feat", rng.normal(size=(num_nodes, 4)).astype(np.float32))
    w.add("split/random/train", np.arange(0, num_nodes, 2, dtype=np.int64))
  info = FileInfo(f"{gen}/g.graphbin", os.path.getsize(path), sha256_file(path), "graphbin")
  manifest = Manifest(name="g", file_format="graphbin", features=Features({}), splits={}, files=(info,))
  with open(os.path.join(out, MANIFEST_FILENAME), "wb") as f:
    f.write(manifest.dumps())
  return gen


def test_a_graph_feeder_state_of_another_generation_is_refused_unless_asked(tmp_path):
  out = str(tmp_path / "graph")
  old = _graph_output(out, 200, 0)
  graph = lg.load(out)
  assert graph.identity.generation == old
  assert graph.identity.file == f"{old}/g.graphbin"
  assert _names(out) == {"loaders.graph"}
  sampler = lg.NeighborSampler(graph, fanouts=[3, 2], batch_size=16, seed=1)
  it = iter(lg.grain_dataset(sampler, num_epochs=2, num_threads=1))
  for _ in range(len(sampler) + 2):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  assert state["epoch"] == 1
  assert state["data"]["file_sha256"] == graph.identity.file_sha256
  new = _graph_output(out, 240, 1)
  sampler2 = lg.NeighborSampler(lg.load(out), fanouts=[3, 2], batch_size=16, seed=1)
  with pytest.raises(StateMismatchError) as e:
    iter(lg.grain_dataset(sampler2, num_epochs=2, num_threads=1)).set_state(state)
  assert old in str(e.value)
  assert new in str(e.value)
  it2 = iter(lg.grain_dataset(sampler2, num_epochs=2, num_threads=1, on_new_data="restart_epoch"))
  it2.set_state(state)
  first = next(it2)
  np.testing.assert_array_equal(first["seeds"], sampler2.batch(0, 1)["seeds"])  # epoch 1, batch 0 of the new graph
  other_seeds = lg.NeighborSampler(graph, fanouts=[3, 2], batch_size=16, seed=1, seed_nodes=np.arange(40))
  with pytest.raises(StateMismatchError, match="seed_nodes:"):  # the same graph, other seeds
    iter(lg.grain_dataset(other_seeds, num_epochs=2, num_threads=1)).set_state(state)
  it3 = iter(lg.grain_dataset(lg.NeighborSampler(graph, fanouts=[3, 2], batch_size=16, seed=1), num_epochs=2,
                              num_threads=1))
  it3.set_state(state)  # the same graph and seeds: resumes
  assert len(list(it3)) == len(sampler) - 2
  graph.pin.release()
  assert old not in leases.held_generations(out)


def test_a_state_saved_on_a_bare_graphbin_is_refused_on_another_graph_at_that_path(tmp_path):
  """A bare .graphbin (no manifest) had an identity of its path alone: a state saved on it resumed on any graph
  written there since. Its section table's fingerprint now stands in for the manifest's digest."""
  out = str(tmp_path / "graph")
  path = os.path.join(out, _graph_output(out, 200, 0), "g.graphbin")
  bare = str(tmp_path / "bare.graphbin")
  shutil.copy(path, bare)

  def saved_after(n: int, graph) -> dict:
    it = iter(lg.grain_dataset(lg.NeighborSampler(graph, fanouts=[3, 2], batch_size=16, seed=1), num_threads=1))
    for _ in range(n):
      next(it)
    return json.loads(json.dumps(it.get_state()))

  state = saved_after(3, lg.load(bare))
  assert state["data"]["file_sha256"].startswith("sections:")
  again = iter(lg.grain_dataset(lg.NeighborSampler(lg.load(bare), fanouts=[3, 2], batch_size=16, seed=1),
                                num_threads=1))
  again.set_state(state)  # the same file: resumes
  shutil.copy(os.path.join(out, _graph_output(out, 240, 1), "g.graphbin"), bare)  # another graph, same path
  other = iter(lg.grain_dataset(lg.NeighborSampler(lg.load(bare), fanouts=[3, 2], batch_size=16, seed=1),
                                num_threads=1))
  with pytest.raises(StateMismatchError):
    other.set_state(state)
  older = {**state, "data": {**state["data"], "file": None, "file_sha256": None}}  # saved by an earlier release
  with pytest.warns(UnverifiedStateWarning, match="bare .graphbin"):
    other.set_state(older)


_XLA = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from loaders import StateMismatchError, xla
from loaders import graph as lg
out, graph_out, state, graph_state = sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5])
result = {}
try:
  xla.device_loader(out, batch_size=4, seed=3, num_threads=2, num_epochs=3, state=state)
  result["records"] = "accepted"
except StateMismatchError as e:
  result["records"] = str(e)
loader = xla.device_loader(out, batch_size=4, seed=3, num_threads=2, num_epochs=3, state=state,
                           on_new_data="restart_epoch")
result["restarted"] = [b["record_index"].cpu().tolist() for b in loader]
saved = loader.get_state()
result["saved"] = saved["data"]["generation"]
loader.close()
g = lg.load(graph_out)
s = lg.NeighborSampler(g, fanouts=[3, 2], batch_size=16, seed=1)
try:
  lg.xla_loader(s, num_epochs=2, num_threads=1, state=graph_state)
  result["graph"] = "accepted"
except StateMismatchError as e:
  result["graph"] = str(e)
resumed = lg.xla_loader(s, num_epochs=2, num_threads=1, state=graph_state, on_new_data="restart_epoch")
result["graph_restarted"] = [b["seeds"].cpu().tolist() for b in resumed]
result["graph_want"] = [s.batch(i, 1)["seeds"].tolist() for i in range(len(s))]
print(json.dumps(result))
"""


@pytest.mark.slow  # a subprocess (torch_xla)
def test_torch_xla_states_of_another_generation_are_refused_unless_asked(rerun, tmp_path):
  """torch_xla's DeviceLoader and the graph xla_loader on an XLA CPU device (their own process)."""
  out, state, old = rerun
  new = open_output(out).generation
  graph_out = str(tmp_path / "graph")
  _graph_output(graph_out, 200, 0)
  s = lg.NeighborSampler(lg.load(graph_out), fanouts=[3, 2], batch_size=16, seed=1)
  it = iter(lg.grain_dataset(s, num_epochs=2, num_threads=1))
  for _ in range(len(s) + 1):
    next(it)
  graph_state = it.get_state()
  _graph_output(graph_out, 240, 1)
  env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
  r = subprocess.run([sys.executable, "-c", _XLA, REPO, out, graph_out, json.dumps(state), json.dumps(graph_state)],
                     capture_output=True, text=True, env=env, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert old in got["records"], got["records"]
  assert new in got["records"], got["records"]
  fresh = [b["record_index"].tolist() for b in grain_loader.dataset(out, "train", **ARGS)]
  assert got["restarted"] == fresh[21 // 4:]
  assert got["saved"] == new  # epoch 1 over, on the new data
  assert "seed_nodes" not in got["graph"]
  assert "no generation" not in got["graph"]
  assert got["graph"] != "accepted"
  assert got["graph_restarted"] == got["graph_want"]


@pytest.mark.parametrize("where", ["local", pytest.param("gcs", marks=[pytest.mark.gcs, pytest.mark.slow])])
def test_a_read_only_output_loads_with_one_warning(where, images, tmp_path, request, caplog):
  out = _output(where, tmp_path, request)
  _convert(images, out)
  if where == "gcs":
    faults = request.getfixturevalue("gcs_faults")
    faults.add_fault("/upload/", status=403, method="POST")  # every upload refused: a read-only bucket
  else:  # the tests run as root, whom permissions do not stop: a file where the leases folder would be
    with open(os.path.join(out, leases.LEASES_FOLDER), "w") as f:
      f.write("not a folder\n")
  caplog.set_level(logging.WARNING)
  batches = list(grain_loader.dataset(out, "train", batch_size=4, seed=3, cache_dir=str(tmp_path / "cache")))
  assert len(batches) == 24 // 4
  warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warned) == 1, [r.getMessage() for r in warned]
  assert "without a lease" in warned[0].getMessage()
  assert "retention" in warned[0].getMessage()
  if where == "local":
    os.remove(os.path.join(out, leases.LEASES_FOLDER))
  shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def test_a_tfdata_dataset_holds_a_lease_while_it_or_a_dataset_made_from_it_lives(images, tmp_path):
  from loaders import tfdata

  out = str(tmp_path / "out")
  _convert(images, out, size=8, num_shards=2, file_format="tfrecord")
  ds = tfdata.dataset(out, "train", batch_size=4).prefetch(1)
  assert _names(out) == {"loaders.tfdata train"}
  assert len(list(ds.as_numpy_iterator())) == 24 // 4
  del ds
  gc.collect()
  assert not leases.list_leases(out)
