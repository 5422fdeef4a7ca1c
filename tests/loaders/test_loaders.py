"""loaders.grain, loaders.tfdata and loaders.xla on committed outputs of each record kind, written without Beam
(tests/loaders/make_outputs.py). What a converter's output gives the loaders is test_parity.py's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from formats.features import Features, Tensor
from loaders import CorruptRecordError, ShardedRecords, grain as grain_loader, tfdata
from tests.conftest import REPO, upload_tree
from tests.loaders import make_outputs
from tests.loaders.elastic import host_steps

N_IMAGES = 18


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, str]:
  """Each loader's inputs: RGB JPEGs of their own sizes (ArrayRecord in 3 shards, TFRecord in 2), raw 32x32
  images (2 shards), CT volumes narrower and wider than the patches below (both formats), graph records."""
  base = tmp_path_factory.mktemp("loader_outputs")
  rng = np.random.default_rng(0)
  jpeg = make_outputs.jpeg_images(rng, N_IMAGES, mixed=False)
  raw = make_outputs.raw_images(rng, N_IMAGES, size=(32, 32))
  ct = make_outputs.volumes(rng, 12, depth=(4, 12), side=(24, 100))
  mol = make_outputs.graphs(rng, 60, min_nodes=1)
  out = {}
  for key, ((features, payloads), kind, fmt, shards) in {
      "jpeg": (jpeg, "image", "array_record", 3),
      "raw": (raw, "image", "array_record", 2),
      "tfrecord": (jpeg, "image", "tfrecord", 2),
      "ct_array_record": (ct, "volume", "array_record", 1),
      "ct_tfrecord": (ct, "volume", "tfrecord", 1),
      "mol": (mol, "graph", "array_record", 1),
  }.items():
    out[key] = make_outputs.write(str(base / key), features, {"train": payloads}, kind=kind, file_format=fmt,
                                  num_shards=shards)
  return out


def _all(ds):
  return list(iter(ds))


def test_grain_images_static_shapes_and_labels(outputs):
  batches = _all(grain_loader.dataset(outputs["jpeg"], batch_size=4, image_size=(24, 24), num_threads=4))
  assert len(batches) == N_IMAGES // 4
  assert {(b["image"].shape, b["image"].dtype, b["label"].shape) for b in batches} == {
      ((4, 24, 24, 3), np.dtype(np.uint8), (4,))}
  records = ShardedRecords(outputs["jpeg"])
  for b in batches:
    for idx, label in zip(b["record_index"], b["label"]):
      assert records[int(idx)]["label"] == label


def test_grain_raw_needs_no_size_and_pads_the_remainder(outputs):
  batches = _all(grain_loader.dataset(outputs["raw"], batch_size=5, drop_remainder=False, shuffle=False))
  assert len(batches) == -(-N_IMAGES // 5)
  assert {b["image"].shape for b in batches} == {(5, 32, 32, 3)}
  assert sum(int(b["mask"].sum()) for b in batches) == N_IMAGES
  assert [int(i) for b in batches for i, m in zip(b["record_index"], b["mask"]) if m] == list(range(N_IMAGES))


def test_images_without_fixed_size_need_image_size(outputs):
  with pytest.raises(ValueError, match="image_size"):
    grain_loader.dataset(outputs["jpeg"], batch_size=4)


def test_shards_are_disjoint_complete_and_equal(outputs):
  seen = []
  counts = set()
  for i in range(4):
    batches = _all(grain_loader.dataset(outputs["raw"], batch_size=2, shard_index=i, shard_count=4, seed=1))
    counts.add(len(batches))
    seen += [int(x) for b in batches for x in b["record_index"]]
  assert len(counts) == 1  # every replica gets the same number of batches
  assert len(seen) == len(set(seen)) == (N_IMAGES // 4 // 2) * 2 * 4


def test_seeded_order_and_reshuffle_per_epoch(outputs):
  def order(seed, epochs=2):
    return [int(x) for b in _all(grain_loader.dataset(outputs["raw"], batch_size=3, seed=seed, num_epochs=epochs))
            for x in b["record_index"]]
  a = order(7)
  assert a == order(7)
  assert a != order(8)
  first, second = a[:len(a) // 2], a[len(a) // 2:]
  assert first != second
  assert sorted(first) == sorted(second)


def test_resume_continues_exactly(outputs):
  ds = grain_loader.dataset(outputs["raw"], batch_size=3, seed=2, num_epochs=2, num_threads=4)
  it = iter(ds)
  for _ in range(4):
    next(it)
  state = it.get_state()
  rest = [b["record_index"].tolist() for b in it]
  it2 = iter(ds)
  it2.set_state(json.loads(json.dumps(state)))  # a state survives serialisation
  assert [b["record_index"].tolist() for b in it2] == rest


def test_usable_from_grain_dataloader(outputs):
  import grain

  source = grain_loader.data_source(outputs["raw"])
  loader = grain.DataLoader(
      data_source=source, operations=grain_loader.operations(source, batch_size=4),
      sampler=grain.samplers.IndexSampler(len(source), shuffle=True, seed=0, num_epochs=1,
                                          shard_options=grain.sharding.ShardOptions(0, 2, drop_remainder=True)),
      worker_count=0)
  batches = list(loader)
  half = len(source) // 2  # ShardOptions(0, 2): this process reads one half of the records
  assert len(batches) == half // 4
  assert {b["image"].shape for b in batches} == {(4, 32, 32, 3)}
  ids = [int(i) for b in batches for i in b["record_index"]]
  assert len(ids) == len(set(ids)) == len(batches) * 4
  assert set(ids) <= set(range(len(source)))
  for b in batches:
    for i, label in zip(b["record_index"], b["label"]):
      assert source[int(i)]["label"] == label


def test_ct_patches_static_and_padded(outputs):
  batches = _all(grain_loader.dataset(outputs["ct_array_record"], batch_size=2, patch_size=(8, 80, 80),
                                      hu_window=(-1000.0, 1000.0)))
  records = ShardedRecords(outputs["ct_array_record"])
  assert len(batches) == len(records) // 2
  assert {b["volume"].shape for b in batches} == {(2, 8, 80, 80)}
  padded = 0
  for b in batches:
    assert b["volume"].min() >= 0.0
    assert b["volume"].max() <= 1.0
    for v, idx in zip(b["volume"], b["record_index"]):
      width = records[int(idx)]["volume"].shape[2]
      if width < 80:  # beyond the volume: padding, -1024 HU, clipped to the window's low end → 0
        assert np.all(v[..., width:] == 0.0)
        padded += 1
  assert padded


def test_graph_records_padded_to_budgets(outputs):
  batches = _all(grain_loader.dataset(outputs["mol"], "train", batch_size=4, max_nodes=64, max_edges=160))
  assert {(b["node_feat"].shape, b["edge_index"].shape, b["edge_mask"].shape) for b in batches} == {
      ((4, 64, 3), (4, 2, 160), (4, 160))}
  for b in batches:
    for i in range(4):
      e = int(b["edge_mask"][i].sum())
      assert b["node_mask"][i].sum() == b["num_nodes"][i]
      assert (b["edge_index"][i][:, :e] < b["num_nodes"][i]).all()


def test_corrupt_shard_names_shard_and_record(outputs, tmp_path):
  for key in ("jpeg", "tfrecord"):
    broken = str(tmp_path / key)
    shutil.copytree(outputs[key], broken)
    records = ShardedRecords(broken, verify=False)
    shard = os.path.join(broken, records.manifest.splits["train"].shards[0].path)
    data = bytearray(open(shard, "rb").read())
    for i in range(400, 464):  # inside the first records (an ArrayRecord file ends in block padding)
      data[i] ^= 0x5A
    open(shard, "wb").write(bytes(data))
    with pytest.raises(CorruptRecordError, match=rf"{os.path.basename(shard)}: record \d+"):
      for i in range(records.manifest.splits["train"].shards[0].num_records):
        ShardedRecords(broken, verify=False)[i]


@pytest.mark.slow
@pytest.mark.gcs
def test_grain_over_gcs(outputs, gcs_emulator, tmp_path):
  gs = f"gs://{gcs_emulator}/loaders/raw"
  upload_tree(outputs["raw"], gs)
  local = [b["record_index"].tolist() for b in _all(grain_loader.dataset(outputs["raw"], batch_size=3, seed=4))]
  remote = [b["record_index"].tolist() for b in _all(
      grain_loader.dataset(gs, batch_size=3, seed=4, cache_dir=str(tmp_path / "cache")))]
  assert local == remote
  assert any(f.endswith(".verified") for _, _, fs in os.walk(tmp_path / "cache") for f in fs)


@pytest.mark.slow
@pytest.mark.gcs
def test_grain_refuses_bad_example_options_before_it_copies_a_gcs_split(outputs, gcs_emulator, tmp_path):
  """JPEGs of their own sizes need image_size: refused before the split is copied into the cache."""
  gs = f"gs://{gcs_emulator}/loaders/jpeg_refused"
  upload_tree(outputs["jpeg"], gs)
  cache = tmp_path / "cache"
  for make in (lambda: grain_loader.dataset(gs, batch_size=3, cache_dir=str(cache)),
               lambda: grain_loader.records(gs, cache_dir=str(cache))):
    with pytest.raises(ValueError, match="these images have no fixed size"):
      make()
  assert not [p for p in cache.rglob("*") if p.is_file()]  # nothing was fetched


@pytest.mark.slow
@pytest.mark.gcs
def test_tfdata_and_xla_over_gcs(outputs, gcs_emulator, tmp_path):
  gs = f"gs://{gcs_emulator}/loaders/tfrecord"
  upload_tree(outputs["tfrecord"], gs)
  local = [b["record_index"].tolist() for b in tfdata.dataset(
      outputs["tfrecord"], batch_size=3, image_size=(8, 8), seed=2).as_numpy_iterator()]
  remote = [b["record_index"].tolist() for b in tfdata.dataset(
      gs, batch_size=3, image_size=(8, 8), seed=2, cache_dir=str(tmp_path / "tf_cache")).as_numpy_iterator()]
  assert local == remote
  assert local
  raw = f"gs://{gcs_emulator}/loaders/raw_for_xla"
  upload_tree(outputs["raw"], raw)
  env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO, "HOME": str(tmp_path)}  # a fresh shard cache
  r = subprocess.run([sys.executable, "-c", _XLA_SCRIPT, REPO, raw], capture_output=True, text=True, env=env,
                     timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert got["batches"] == N_IMAGES // 4
  assert all(d.startswith("xla") for d in got["devices"])


def test_tfdata_images_and_volumes(outputs):
  batches = list(tfdata.dataset(outputs["tfrecord"], batch_size=4, image_size=(20, 20)).as_numpy_iterator())
  assert len(batches) == N_IMAGES // 4
  assert {b["image"].shape for b in batches} == {(4, 20, 20, 3)}
  idx = sorted(int(i) for b in batches for i in b["record_index"])
  assert len(idx) == N_IMAGES - N_IMAGES % 4
  assert len(set(idx)) == len(idx)
  assert set(idx) <= set(range(N_IMAGES))
  records = ShardedRecords(outputs["tfrecord"])
  for b in batches:
    for i, label in zip(b["record_index"], b["label"]):
      assert records[int(i)]["label"] == label
  shards = [sorted(int(i) for b in tfdata.dataset(outputs["tfrecord"], batch_size=1, shard_index=k, shard_count=2,
                                                   image_size=(8, 8)).as_numpy_iterator() for i in b["record_index"])
            for k in range(2)]
  assert not set(shards[0]) & set(shards[1])
  assert len(shards[0]) == len(shards[1])
  vols = list(tfdata.dataset(outputs["ct_tfrecord"], batch_size=1, patch_size=(4, 32, 32)).as_numpy_iterator())
  assert vols
  assert {v["volume"].shape for v in vols} == {(1, 4, 32, 32)}


_XLA_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from loaders import xla
assert "tensorflow" not in sys.modules
loader = xla.device_loader(sys.argv[2], batch_size=4, seed=1, num_threads=2)
shapes, devices, n, ids = set(), set(), 0, []
for batch in loader:
  shapes.add(tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(batch.items())))
  devices.add(str(batch["image"].device))
  ids += batch["record_index"].cpu().tolist()
  n += 1
# resume: stop after 2 batches, restore in a new loader, get exactly the rest
first = xla.device_loader(sys.argv[2], batch_size=4, seed=1, num_threads=2)
it = iter(first)
head = [next(it)["record_index"].cpu().tolist() for _ in range(2)]
state = first.get_state()
resumed = [b["record_index"].cpu().tolist() for b in xla.device_loader(sys.argv[2], batch_size=4, seed=1,
                                                                        num_threads=2, state=state)]
print(json.dumps({"batches": n, "shapes": len(shapes), "devices": sorted(devices), "ids": ids,
                  "tf": "tensorflow" in sys.modules, "head": sum(head, []), "resumed": sum(resumed, [])}))
"""


@pytest.mark.slow  # a subprocess (torch_xla)
def test_xla_device_loader_on_cpu(outputs):
  env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
  r = subprocess.run([sys.executable, "-c", _XLA_SCRIPT, REPO, outputs["raw"]], capture_output=True, text=True,
                     env=env, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert got["batches"] == N_IMAGES // 4
  assert got["shapes"] == 1
  assert not got["tf"]
  assert all(d.startswith("xla") for d in got["devices"])
  assert len(set(got["ids"])) == len(got["ids"]) == got["batches"] * 4
  assert got["head"] + got["resumed"] == got["ids"]  # same seed: same order; resume continues exactly


# torch_xla's reading thread ends a pass on any error as if the data had run out, and a second `for` over its
# loader drops what the first pass's thread read ahead; DeviceLoader raises the one and rereads the other.
_XLA_FAULTS_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch_xla
from loaders import grain as grain_loader, xla

def ids(batch):
  return batch["record_index"].cpu().tolist()

calls = []
def fail_fourth(batch):  # reading the 4th host batch fails
  calls.append(1)
  if len(calls) == 4:
    raise OSError("the 4th batch's shard is gone")
  return batch

host = grain_loader.dataset(sys.argv[2], batch_size=2, seed=1, num_threads=1).map(fail_fourth)
loader = xla.DeviceLoader(host, torch_xla.device(), None, loader_prefetch_size=2, device_prefetch_size=1)
got, error = [], None
try:
  for batch in loader:
    got.append(ids(batch))
except OSError as e:
  error = str(e)
failed = {"got": got, "error": error, "state": loader.get_state()}

every = [ids(b) for b in xla.device_loader(sys.argv[2], batch_size=2, seed=1, num_threads=1)]
loader = xla.device_loader(sys.argv[2], batch_size=2, seed=1, num_threads=1, loader_prefetch_size=2,
                           device_prefetch_size=1)
passes = []
for stop in (2, 1, None):  # two loops that break early, then one to the end
  passes.append([])
  for batch in loader:
    passes[-1].append(ids(batch))
    if len(passes[-1]) == stop:
      break
state = loader.get_state()
print(json.dumps({"failed": failed, "every": every, "passes": passes, "state_at_end": state}))
"""


@pytest.mark.slow  # a subprocess (torch_xla)
def test_xla_device_loader_raises_read_errors_and_a_loop_after_a_break_loses_nothing(outputs):
  env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
  r = subprocess.run([sys.executable, "-c", _XLA_FAULTS_SCRIPT, REPO, outputs["raw"]], capture_output=True,
                     text=True, env=env, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  every = got["every"]
  assert len(every) == N_IMAGES // 2 >= 5
  failed = got["failed"]
  assert failed["error"] == "the 4th batch's shard is gone"  # raised in the loop, not an early end
  assert failed["got"] == every[:3]
  assert failed["state"]["next_index"] == 3  # in batches: after the last one received
  assert sum(got["passes"], []) == every  # each pass goes on after the last batch the one before received
  assert [len(p) for p in got["passes"]] == [2, 1, len(every) - 3]


# torch_xla: close() from another thread while the loop waits (the loop goes on), get_state() from a signal
# handler that lands while the loop's thread holds the loader's lock, a Ctrl-C as a pass starts its threads, and
# loaders dropped after a break (torch_xla's threads must go). A hang ends the process (faulthandler).
_XLA_MEANWHILE_SCRIPT = r"""
import faulthandler, gc, json, signal, sys, threading, time
faulthandler.dump_traceback_later(120, exit=True)
sys.path.insert(0, sys.argv[1])
import torch_xla
from loaders import _device, grain as grain_loader, xla

ids = lambda batch: batch["record_index"].cpu().tolist()
make = lambda: grain_loader.dataset(sys.argv[2], batch_size=2, seed=1, num_threads=1)
every = [ids(b) for b in xla.DeviceLoader(make(), torch_xla.device(), None)]
found = {"every": every}

gate, calls = threading.Event(), []
def hold(batch):  # host batches from the 2nd on wait for the gate
  calls.append(1)
  if len(calls) > 1:
    gate.wait()
  return batch
loader = xla.DeviceLoader(make().map(hold), torch_xla.device(), None, loader_prefetch_size=1, device_prefetch_size=1)
got = []
def close_meanwhile():
  time.sleep(0.5)  # the loop waits for batch 1
  gate.set()
  loader.close()
for batch in loader:
  got.append(ids(batch))
  if len(got) == 1:
    threading.Thread(target=close_meanwhile).start()
found["closed_meanwhile"] = got

source = open(_device.__file__).read().splitlines()
held = 1 + next(i for i, line in enumerate(source) if "self._delivered += 1" in line)  # inside `with self._lock`
loader, states = xla.DeviceLoader(make(), torch_xla.device(), None), []
signal.signal(signal.SIGUSR1, lambda *a: states.append(loader.get_state()))
def tracer(frame, event, arg):
  if frame.f_code.co_filename == _device.__file__ and event == "line" and frame.f_lineno == held and not states:
    signal.raise_signal(signal.SIGUSR1)  # handled at the next bytecode, the lock held
  return tracer
sys.settrace(tracer)
got = [ids(b) for b in loader]
sys.settrace(None)
found["signalled"] = {"got": got, "states": len(states)}

started = 1 + next(i for i, line in enumerate(source) if "for batch in parallel.per_device_loader" in line)
loader, passes, hits = xla.DeviceLoader(make(), torch_xla.device(), None), [], []
def interrupt(frame, event, arg):  # a Ctrl-C as the second pass's threads start reading
  if frame.f_code.co_filename == _device.__file__ and event == "line" and frame.f_lineno == started and not hits:
    hits.append(1)
    raise KeyboardInterrupt
  return interrupt
for stop in (2, "interrupt", None):
  passes.append([])
  sys.settrace(interrupt if stop == "interrupt" else None)
  try:
    for batch in loader:
      passes[-1].append(ids(batch))
      if len(passes[-1]) == stop:
        break
  except KeyboardInterrupt:
    passes[-1].append("interrupted")
sys.settrace(None)
time.sleep(0.5)  # the interrupted pass's threads would read on meanwhile
found["interrupted"] = passes

base = threading.active_count()
for _ in range(3):
  loader = xla.device_loader(sys.argv[2], batch_size=2, seed=1, num_threads=1)
  for batch in loader:
    break
  del batch, loader
  gc.collect()
time.sleep(1)
found["threads_added"] = threading.active_count() - base

wide = [{k: [str(v.dtype), v.cpu().tolist()] for k, v in b.items() if k != "record_index"}
        for b in xla.device_loader(sys.argv[3], batch_size=2, shuffle=False, num_threads=1)]
found["unsigned"] = {"xla": wide, "grain": [{k: v.tolist() for k, v in b.items() if k != "record_index"}
                                            for b in grain_loader.dataset(sys.argv[3], batch_size=2, shuffle=False,
                                                                          num_epochs=1)]}
found["refused"] = []
for sizes in ({"device_prefetch_size": 0}, {"loader_prefetch_size": 0}):
  try:
    xla.device_loader(sys.argv[2], batch_size=2, **sizes)
  except ValueError as e:
    found["refused"].append(str(e))

import torch_xla.runtime as xr
xr.global_ordinal, xr.world_size = (lambda: 1), (lambda: 2)  # replica 1 of 2, as the runtime says on a pod
mine = [ids(b) for b in xla.device_loader(sys.argv[2], batch_size=2, seed=1, num_threads=1)]
found["runtime_shard"] = [mine, [b["record_index"].tolist() for b in grain_loader.dataset(
    sys.argv[2], batch_size=2, seed=1, shard_index=1, shard_count=2, num_threads=1)]]
print(json.dumps(found))
"""


@pytest.mark.slow  # a subprocess (torch_xla)
def test_xla_close_or_a_signal_meanwhile_a_ctrl_c_or_a_dropped_loader_loses_and_leaks_nothing(outputs, tmp_path):
  """...and unsigned integers arrive whole (XLA holds uint16/uint32 as signed: widened to int32/int64), and a
  torch_xla queue of size 0 (which hangs, or ends every pass at once) is refused."""
  features = Features({"tok": Tensor((3,), "uint16"), "big": Tensor((), "uint32"), "huge": Tensor((), "uint64")})
  records = [features.encode({"tok": np.array([50000 + i, 7, 65535], np.uint16), "big": np.uint32(3_000_000_000 + i),
                              "huge": np.uint64(2**62 + i)}) for i in range(4)]
  wide = make_outputs.write(str(tmp_path / "wide"), features, {"train": records}, kind="tensors")
  env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
  r = subprocess.run([sys.executable, "-c", _XLA_MEANWHILE_SCRIPT, REPO, outputs["raw"], wide], capture_output=True,
                     text=True, env=env, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  every = got["every"]
  assert len(every) == N_IMAGES // 2 >= 5
  assert got["closed_meanwhile"] == every  # close() while the loop waited: it went on, nothing lost or repeated
  assert got["signalled"] == {"got": every, "states": 1}
  first, interrupted, last = got["interrupted"]
  assert first == every[:2] and interrupted == ["interrupted"] and last == every[2:]
  assert got["threads_added"] <= 1  # torch_xla's threads of the dropped loaders went (grain's may linger a beat)
  unsigned = got["unsigned"]
  assert [{k: v for k, (_, v) in b.items()} for b in unsigned["xla"]] == unsigned["grain"]
  assert {k: t for k, (t, _) in unsigned["xla"][0].items()} == {"tok": "torch.int32", "big": "torch.int64",
                                                               "huge": "torch.int64"}
  assert got["refused"] == ["device_prefetch_size must be >= 1, got 0", "loader_prefetch_size must be >= 1, got 0"]
  mine, want = got["runtime_shard"]  # the shard defaults come from torch_xla's runtime
  assert mine == want and len(mine) == len(every) // 2 and mine != every[:len(mine)]


def _global_steps(make, schedule):
  """host_steps with each step's batches concatenated in host order, key by key."""
  return [{k: np.concatenate([b[k] for b in batches]) for k in batches[0]} for batches in host_steps(make, schedule)]


@pytest.mark.parametrize("key,options,global_batch,epochs", [
    ("raw", {}, 8, 3),
    ("ct_array_record", {"patch_size": (8, 40, 40), "hu_window": (-1000.0, 1000.0)}, 8, 8),
])
def test_global_order_resumes_exactly_across_4_then_2_then_8_hosts(outputs, key, options, global_batch, epochs):
  """Images and CT patches: every global step, read by 4 hosts, then 2, then 8 (each part resuming from the
  state the previous one saved), is exactly the step of an uninterrupted single-host run: the same records in
  the same order, and for CT the same random patch of each sample whatever host reads it."""
  def make(h, hosts):
    return grain_loader.dataset(outputs[key], order="global", global_batch_size=global_batch, shard_index=h,
                                shard_count=hosts, num_epochs=epochs, seed=4, num_threads=1, **options)

  single = _all(make(0, 1))
  steps_per_epoch = len(ShardedRecords(outputs[key])) // global_batch
  assert len(single) == epochs * steps_per_epoch >= 6
  total = len(single)
  got = _global_steps(make, [(4, 2), (2, total // 2 - 2), (8, total - total // 2)])
  assert len(got) == total
  for g, want in zip(got, single):
    assert sorted(g) == sorted(want)
    assert all(np.array_equal(g[k], want[k]) for k in want)
  first_epoch = np.concatenate([b["record_index"] for b in single[:steps_per_epoch]])
  assert len(np.unique(first_epoch)) == len(first_epoch) == steps_per_epoch * global_batch
  with pytest.raises(ValueError, match="global_batch_size 8 is not divisible by shard_count 3"):
    grain_loader.dataset(outputs[key], order="global", global_batch_size=8, shard_count=3, **options)
  with pytest.raises(ValueError, match="batch_size 2 and global_batch_size 8 disagree on 2 hosts"):
    grain_loader.dataset(outputs[key], order="global", global_batch_size=8, batch_size=2, shard_count=2, **options)
