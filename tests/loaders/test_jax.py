"""loaders.jax on the CPU backend: one process with 8 devices, and a pod in miniature (2 processes x 4 devices
joined by jax.distributed.initialize) that must build the same global arrays, resume each other's states and
compile its step once. Every test that imports jax runs it in processes of its own (XLA_FLAGS and
jax.distributed.initialize must come before jax starts its backend; TensorFlow and torch_xla bundle their own
XLA), and so does the check of which frameworks share a process with jax."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from formats.graphbin import GraphBinWriter
from tests.conftest import REPO
from tests.loaders import make_outputs

DEVICES = 8
GLOBAL_BATCH = 8
N_RECORDS = 36  # 4 global steps per epoch, 4 records left over
SAVE_AT = 3  # a state is saved after this many global batches (inside the first epoch)

# One program for every process: the run's global batches (gathered onto every process), the states after
# SAVE_AT of them, and what the jitted step compiled; process 0 writes them to `out`.
_POD = r"""
import json, sys
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["repo"])
import jax
import numpy as np
if cfg["processes"] > 1:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{cfg['port']}", num_processes=cfg["processes"],
                             process_id=cfg["process_id"])
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from loaders import graph as lg, jax as lj

assert jax.process_count() == cfg["processes"] and len(jax.devices()) == 8
mesh = Mesh(np.array(jax.devices()), ("data",))
found, arrays = {}, {}

def run(name, it, step):
  if cfg["states"].get(name) is not None:
    it.set_state(cfg["states"][name])
  layouts, n = set(), 0
  for batch in it:
    step(batch)
    layouts.add(tuple((k, v.shape, str(v.dtype), str(v.sharding.spec), len(v.addressable_shards))
                      for k, v in sorted(batch.items())))
    for k, v in multihost_utils.process_allgather(batch, tiled=True).items():
      arrays[f"{name}/{n}/{k}"] = v
    n += 1
    if n == cfg["save_at"]:
      found[f"{name}_state"] = it.get_state()
  found[name] = {"batches": n, "layouts": [list(map(list, l)) for l in layouts], "compiled": step._cache_size()}
  it.close()

run("records", lj.dataset(cfg["output"], mesh=mesh, global_batch_size=8, num_epochs=2, seed=5, num_threads=1),
    jax.jit(lambda b: (b["image"].astype("float32") / 255).mean() + b["label"].sum()))
graph = lg.load(cfg["graph"])
make = lambda i, n: lg.NeighborSampler(graph, fanouts=[3, 2], global_batch_size=16, seed=2, shard_index=i,
                                       shard_count=n)
run("graph", lj.graph_dataset(make, mesh=mesh, num_epochs=2, num_threads=1),
    jax.jit(lambda b: jax.vmap(lambda g: (g["x"].sum(-1) * g["node_mask"]).sum() + g["edge_index_1"].sum())(b).sum()))
if jax.process_index() == 0:
  np.savez(cfg["out"] + ".npz", **arrays)
  with open(cfg["out"] + ".json", "w") as f:
    json.dump(found, f)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
  return {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu",
          "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def _found(script: str, *args: str) -> dict:
  """What `script` prints last (JSON), run in a process of its own with 8 CPU devices."""
  r = subprocess.run([sys.executable, "-c", script, REPO, *args], capture_output=True, text=True, env=_env(8),
                     timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def _pod(inputs, tmp_path, name: str, processes: int, states: dict | None = None) -> tuple[dict, dict]:
  """Runs _POD on `processes` processes of DEVICES // processes devices each: (process 0's findings, its arrays)."""
  out = str(tmp_path / name)
  cfg = {"repo": REPO, "output": inputs["records"], "graph": inputs["graph"], "processes": processes,
         "port": _free_port(), "save_at": SAVE_AT, "states": states or {}, "out": out}
  procs = [subprocess.Popen([sys.executable, "-c", _POD, json.dumps({**cfg, "process_id": i})], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(DEVICES // processes))
           for i in range(processes)]
  try:
    logs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  with open(out + ".json") as f, np.load(out + ".npz") as arrays:
    return json.load(f), dict(arrays)


def _steps(arrays: dict, name: str) -> list[dict]:
  """The run's global batches, in order, from _POD's arrays."""
  steps: dict[int, dict] = {}
  for key, value in arrays.items():
    run, n, k = key.split("/")
    if run == name:
      steps.setdefault(int(n), {})[k] = value
  return [steps[n] for n in sorted(steps)]


def _same(a: list[dict], b: list[dict]) -> bool:
  return len(a) == len(b) and all(
      sorted(x) == sorted(y) and all(x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]) for k in x)
      for x, y in zip(a, b))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
  """A raw-image output (8x8 pixels, 2 shards) and a small graph output (120 nodes, 60 train seeds)."""
  base = tmp_path_factory.mktemp("jax_inputs")
  features, payloads = make_outputs.raw_images(np.random.default_rng(0), N_RECORDS, size=(8, 8))
  records = make_outputs.write(str(base / "raw"), features, {"train": payloads}, kind="image", num_shards=2)
  rng = np.random.default_rng(1)
  n = 120
  src, dst = rng.integers(0, n, 600), rng.integers(0, n, 600)

  def build(w: GraphBinWriter) -> None:
    indptr, indices = make_outputs.csr(src, dst, n)
    w.add_meta({"num_nodes": {"": n}})
    w.add("indptr", indptr)
    w.add("indices", indices)
    w.add("node/feat", rng.normal(size=(n, 4)).astype(np.float32))
    w.add("node/label", (np.arange(n) % 5)[:, None].astype(np.int64))
    w.add("split/random/train", np.arange(0, n, 2, dtype=np.int64))

  return {"records": records, "graph": make_outputs.write_graph(str(base / "graph"), build)}


@pytest.fixture(scope="module")
def runs(inputs, tmp_path_factory) -> dict[str, tuple[dict, dict]]:
  """The pod from the start, one process from the start and from the pod's states, the pod from that one's."""
  tmp = tmp_path_factory.mktemp("jax_runs")
  out = {"pod": _pod(inputs, tmp, "pod", 2)}
  pod_states = {k: out["pod"][0][f"{k}_state"] for k in ("records", "graph")}
  out["single"] = _pod(inputs, tmp, "single", 1)
  out["single_from_pod"] = _pod(inputs, tmp, "single_from_pod", 1, pod_states)
  single_states = {k: out["single"][0][f"{k}_state"] for k in ("records", "graph")}
  out["pod_from_single"] = _pod(inputs, tmp, "pod_from_single", 2, single_states)
  return out


SPEC = "P('data',)"  # str(PartitionSpec("data"))


@pytest.mark.slow  # processes of their own (jax)
@pytest.mark.parametrize("name", ["records", "graph"])
def test_a_pod_of_two_processes_builds_the_global_arrays_of_one_process(runs, name):
  """Records: [8, ...] global batches; graph: [8, ...], one subgraph per device. Every batch of the run has one
  layout, each process holding 4 of the 8 devices' shards; the pod's arrays are bit for bit one process's."""
  (pod, pod_arrays), (single, single_arrays) = runs["pod"], runs["single"]
  steps = _steps(single_arrays, name)
  assert pod[name]["batches"] == single[name]["batches"] == len(steps) > SAVE_AT
  assert _same(_steps(pod_arrays, name), steps)
  for found, shards in ((pod, DEVICES // 2), (single, DEVICES)):
    [layout] = found[name]["layouts"]  # (key, shape, dtype, partition spec, addressable shards) of every array
    leading = GLOBAL_BATCH if name == "records" else DEVICES  # a subgraph per device
    assert {(shape[0], spec, n) for _, shape, _, spec, n in layout} == {(leading, SPEC, shards)}
  assert pod[f"{name}_state"] == single[f"{name}_state"]  # the global order: a state names the global step


@pytest.mark.slow
@pytest.mark.parametrize("name", ["records", "graph"])
def test_a_state_saved_by_the_pod_resumes_in_one_process_and_the_other_way(runs, name):
  want = _steps(runs["single"][1], name)[SAVE_AT:]
  assert want
  assert _same(_steps(runs["single_from_pod"][1], name), want)
  assert _same(_steps(runs["pod_from_single"][1], name), want)


@pytest.mark.slow
def test_the_jitted_step_compiles_once_for_the_whole_run(runs):
  for found, _ in runs.values():
    assert found["records"]["compiled"] == found["graph"]["compiled"] == 1


@pytest.mark.slow
def test_the_global_batches_are_the_grain_loaders_of_one_host_reading_the_global_batch(runs, inputs):
  from loaders import grain as grain_loader

  want = list(grain_loader.dataset(inputs["records"], batch_size=GLOBAL_BATCH, num_epochs=2, seed=5, num_threads=1))
  got = _steps(runs["pod"][1], "records")
  assert len(got) == len(want) == 2 * (N_RECORDS // GLOBAL_BATCH)
  for g, w in zip(got, want):
    assert sorted(g) == sorted(w)
    assert all(np.array_equal(g[k], w[k]) for k in w)
  assert {str(v.dtype) for v in got[0].values()} == {"uint8", "int32"}  # jax's 32 bits without jax_enable_x64


# One process, 8 devices: what a batch holds, the prefetch, set_state on a running iterator, a dropped iterator's
# thread, refused meshes.
_HOST = r"""
import gc, json, sys, threading, time
sys.path.insert(0, sys.argv[1])
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from loaders import grain as grain_loader, graph as lg, jax as lj

mesh = Mesh(np.array(jax.devices()), ("data",))
found, pulled = {}, []

def named(batch):  # a text feature, and a count of the host batches the device iterator took
  pulled.append(len(pulled))
  return {**batch, "name": np.array([f"record {i}" for i in batch["record_index"]])}

host = grain_loader.dataset(sys.argv[2], batch_size=8, seed=5, num_epochs=2, num_threads=1).map(named)
it = lj.DeviceIterator(host, NamedSharding(mesh, P("data")))
first = next(it)
deadline = time.monotonic() + 60
while len(pulled) < 4 and time.monotonic() < deadline:  # the loop holds batch 0: the thread makes 1, 2 and 3
  time.sleep(0.01)
time.sleep(0.5)  # and then waits (it would have read on by now)
found["pulled"] = len(pulled)
found["types"] = {k: type(v).__name__ for k, v in first.items()}
found["first"] = [first["name"].tolist(), np.asarray(first["record_index"]).tolist()]
next(it)
state = it.get_state()
rest = [[b["name"].tolist(), np.asarray(b["record_index"]).tolist()] for b in it]
it.set_state(state)  # the same iterator, after its end: the rest again
found["rest"], found["again"] = rest, [[b["name"].tolist(), np.asarray(b["record_index"]).tolist()] for b in it]
dropped = lj.DeviceIterator(host, NamedSharding(mesh, P("data")))
next(dropped)
del dropped  # its thread, waiting to hand over more, stops
gc.collect()
found["threads_left"] = [t.name for t in threading.enumerate() if t.name == "loaders.jax prefetch"]

def refused(make):
  try:
    make()
  except ValueError as e:
    return str(e)

found["other_rows"] = refused(lambda: lj.dataset(sys.argv[2], mesh=mesh, global_batch_size=8, shard_index=0,
                                                  shard_count=2))
found["uneven"] = refused(lambda: lj.dataset(sys.argv[2], mesh=mesh, global_batch_size=12))
graph = lg.load(sys.argv[3])
found["not_its_slot"] = refused(lambda: lj.graph_dataset(
    lambda i, n: lg.NeighborSampler(graph, [2], batch_size=2, shard_index=0, shard_count=n), mesh=mesh))
found["unequal_slots"] = refused(lambda: lj.graph_dataset(
    lambda i, n: lg.NeighborSampler(graph, [2], batch_size=2 if i else 1, shard_index=i, shard_count=n), mesh=mesh))
rows = lj._rows
lj._rows = lambda *args: []  # a process none of whose devices is on the mesh (one process cannot make that mesh)
found["no_rows"] = refused(lambda: lj.dataset(sys.argv[2], mesh=mesh, global_batch_size=8, shard_index=1,
                                               shard_count=2))
found["no_slots"] = refused(lambda: lj.graph_dataset(
    lambda i, n: lg.NeighborSampler(graph, [2], batch_size=2, shard_index=i, shard_count=n), mesh=mesh))
lj._rows = rows
print(json.dumps(found))
"""


@pytest.mark.slow  # a process of its own (jax)
def test_prefetch_text_on_the_host_set_state_a_dropped_iterator_and_refused_meshes(inputs):
  found = _found(_HOST, inputs["records"], inputs["graph"])
  assert found["pulled"] == 4  # while the loop held batch 0: 1 and 2 waiting on the devices, 3 made, then a wait
  assert found["types"] == {"image": "ArrayImpl", "label": "ArrayImpl", "record_index": "ArrayImpl",
                            "name": "ndarray"}
  names, ids = found["first"]
  assert names == [f"record {i}" for i in ids]
  assert found["rest"] == found["again"]
  assert len(found["rest"]) == 2 * (N_RECORDS // GLOBAL_BATCH) - 2
  assert found["threads_left"] == []
  assert "holds rows [0, 8) (8 rows) of each global batch of 8, but shard 0 of 2 reads rows [0, 4): pass " \
         "shard_index=0, shard_count=1" in found["other_rows"]
  assert "a global batch of 12 (1 x 12) does not split into the 8 slices" in found["uneven"]
  assert "make_sampler(1, 8) made a sampler of shard 0 of 8" in found["not_its_slot"]
  assert "the slots' samplers have different numbers of batches" in found["unequal_slots"]
  assert "holds no rows of the global batch (none of its devices is on the mesh), but shard 1 of 2 reads rows " \
         "[4, 8)" in found["no_rows"]
  assert "holds none of the 8 subgraph slots" in found["no_slots"]


# One process, 8 devices: the device arrays share the loader's aligned host batches (jax's CPU backend uses an
# aligned numpy buffer in place), so nothing may ever write into a host batch again; and a pool that reuses a
# buffer only once nothing refers to it (loaders._features.BufferPool) is safe, because jax refers to it.
_SHARED = r"""
import gc, json, sys
sys.path.insert(0, sys.argv[1])
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from loaders import grain as grain_loader, jax as lj
from loaders._batch import aligned_empty

sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
found, hosts = {}, []

def note(batch):  # where each host batch's pixels lie (no reference kept)
  hosts.append(batch["image"].ctypes.data)
  return batch

want = next(iter(grain_loader.dataset(sys.argv[2], batch_size=8, seed=5, num_threads=1)))  # loaders.grain's batch 0
host = grain_loader.dataset(sys.argv[2], batch_size=8, seed=5, num_epochs=6, num_threads=2).map(note)
it = lj.DeviceIterator(host, sharding)
first = next(it)
same = lambda: [k for k in want if np.array_equal(np.asarray(first[k]), want[k])]
found["at_once"] = same()
row = first["image"][0].nbytes
found["shared"] = [s.data.unsafe_buffer_pointer() - hosts[0] for s in first["image"].addressable_shards] == \
    [s.index[0].start * row for s in first["image"].addressable_shards]
for _ in range(20):  # later batches, dropped at once: a reused buffer would be written over
  next(it)
gc.collect()
found["later"] = len(hosts) - 1
found["after"] = same()
it.close()

a = aligned_empty((8, 256), np.float32)
a[...] = 1
owner = a.base
before = sys.getrefcount(owner)
held = jax.device_put(a, sharding)
found["put_shared"] = held.addressable_shards[0].data.unsafe_buffer_pointer() == a.ctypes.data
del a
found["jax_refers"] = sys.getrefcount(owner) > before - 1  # `a` gone, jax's references remain
del held
gc.collect()
found["released"] = sys.getrefcount(owner) == before - 1
print(json.dumps(found))
"""


@pytest.mark.slow  # a process of its own (jax)
def test_device_arrays_share_the_host_batches_which_nothing_writes_again(inputs):
  """Batch 0's device arrays equal loaders.grain's batch 0, and still do once 20 more batches are made while
  they are held; the pixels are the host batch's own memory, not a copy (so the check is not vacuous); a device array
  sharing a numpy buffer holds a reference to it (what a reference-counting pool relies on)."""
  found = _found(_SHARED, inputs["records"])
  assert found["shared"]
  assert found["later"] >= 20
  assert found["at_once"] == found["after"] == ["image", "label", "record_index"]
  assert found["put_shared"] and found["jax_refers"] and found["released"]


# One process, 8 devices: without jax_enable_x64 jax stores int64 and uint64 in 32 bits and wraps what does not
# fit (2**40 + 5 arrives as 5); DeviceIterator refuses such a batch, lets one that fits through, and with
# jax_enable_x64 the values arrive whole.
_WIDE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from loaders import grain as grain_loader, jax as lj

sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))

def first(extra):  # batch 0 with an array "id" added from its record indices: its dtype and values, or the error
  host = grain_loader.dataset(sys.argv[2], batch_size=8, seed=5, num_threads=1)
  it = lj.DeviceIterator(host.map(lambda b: {**b, "id": extra(b["record_index"])}), sharding)
  try:
    batch = next(it)
    return {k: [str(batch[k].dtype), np.asarray(batch[k]).tolist()] for k in ("id", "record_index")}
  except ValueError as e:
    return str(e)
  finally:
    it.close()
    host.close()

found = {"above": first(lambda r: r + 2**40), "below": first(lambda r: -r - 2**31 - 1),
         "unsigned": first(lambda r: r.astype(np.uint64) + 2**32), "fits": first(lambda r: r + 2**31 - 100)}
with jax.enable_x64(True):  # a setting of this thread only: the prefetch thread must make the batch under it
  found["x64_context"] = first(lambda r: r + 2**40)
jax.config.update("jax_enable_x64", True)
found["x64"] = first(lambda r: r + 2**40)
print(json.dumps(found))
"""


@pytest.mark.slow  # a process of its own (jax)
def test_integers_jax_would_wrap_are_refused_never_wrapped(inputs):
  found = _found(_WIDE, inputs["records"])
  for case, dtype in [("above", "int64"), ("below", "int64"), ("unsigned", "uint64")]:
    assert found[case] == (f"'id' holds {dtype} values outside {dtype[:-2]}32, the type jax stores them as without "
                           "jax_enable_x64, so they would wrap: jax.config.update('jax_enable_x64', True) keeps them")
  (id_type, ids), (index_type, indices) = found["fits"]["id"], found["fits"]["record_index"]
  assert (id_type, index_type) == ("int32", "int32") and ids == [i + 2**31 - 100 for i in indices]
  for case in ("x64", "x64_context"):
    (id_type, ids), (_, indices) = found[case]["id"], found[case]["record_index"]
    assert id_type == "int64" and ids == [i + 2**40 for i in indices]


# One process, 8 devices: what the thread made ahead is never lost when the loop sees an error, a refused
# set_state or a close; the batch that failed is read again by the next call.
_NOTHING_LOST = r"""
import copy, json, sys
sys.path.insert(0, sys.argv[1])
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from loaders import grain as grain_loader, jax as lj
from loaders._pinning import StateMismatchError

sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
ids = lambda batch: np.asarray(batch["record_index"]).tolist()
make = lambda: grain_loader.dataset(sys.argv[2], batch_size=8, seed=5, num_epochs=2, num_threads=1)
every = [ids(b) for b in lj.DeviceIterator(make(), sharding)]

calls = []
def fail_once(batch):  # the 4th host batch fails to read, once
  calls.append(1)
  if len(calls) == 4:
    raise OSError("a 503 past the retry budget")
  return batch

it, got, errors = lj.DeviceIterator(make().map(fail_once), sharding), [], []
while True:
  try:
    got.append(ids(next(it)))
  except OSError as e:
    errors.append(str(e))
  except StopIteration:
    break

it, refused = lj.DeviceIterator(make(), sharding), []
head = [ids(next(it)) for _ in range(3)]
other = copy.deepcopy(it.get_state())
other["data"]["manifest_sha256"] = "0" * 64  # a state of other data
try:
  it.set_state(other)
except StateMismatchError:
  refused.append(1)
after_refusal = [ids(b) for b in it]

it = lj.DeviceIterator(make(), sharding)
head_closed = [ids(next(it)) for _ in range(2)]
it.close()
after_close = [ids(next(it))]
print(json.dumps({"every": every, "got": got, "errors": errors, "refused": refused, "head": head,
                  "after_refusal": after_refusal, "head_closed": head_closed, "after_close": after_close}))
"""


@pytest.mark.slow  # a process of its own (jax)
def test_an_error_a_refused_state_or_a_close_loses_no_batch_made_ahead(inputs):
  found = _found(_NOTHING_LOST, inputs["records"])
  every = found["every"]
  assert len(every) == 2 * (N_RECORDS // GLOBAL_BATCH)
  assert found["errors"] == ["a 503 past the retry budget"] and found["got"] == every  # raised, then read again
  assert found["refused"] == [1] and found["head"] + found["after_refusal"] == every
  assert found["head_closed"] + found["after_close"] == every[:3]


# One process, 8 devices: close() from another thread, set_state() from a signal handler (a preemption handler
# going back to a saved state), each while next() waits for a batch the worker is still making, and a Ctrl-C
# inside set_state(). next() must go on from the position they left, losing and repeating nothing. The worker's
# batches are held at a gate so that next() surely waits; a hang ends the process (faulthandler).
_MEANWHILE = r"""
import _thread, faulthandler, json, signal, sys, threading, time
faulthandler.dump_traceback_later(120, exit=True)
sys.path.insert(0, sys.argv[1])
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from loaders import grain as grain_loader, jax as lj

sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
ids = lambda batch: np.asarray(batch["record_index"]).tolist()
make = lambda: grain_loader.dataset(sys.argv[2], batch_size=8, seed=5, num_epochs=2, num_threads=1)
every = [ids(b) for b in lj.DeviceIterator(make(), sharding)]
found = {"every": every}

def gated(after):  # host batches from the `after`-th on wait for the gate
  gate, calls = threading.Event(), []
  def hold(batch):
    calls.append(1)
    if len(calls) > after:
      gate.wait()
    return batch
  return gate, hold

gate, hold = gated(1)
it = lj.DeviceIterator(make().map(hold), sharding, prefetch=1)
got = [ids(next(it))]
def close_meanwhile():
  time.sleep(0.3)  # next() below waits for batch 1
  gate.set()
  it.close()
threading.Thread(target=close_meanwhile).start()
got += [ids(b) for b in it]
found["closed_meanwhile"] = got

gate, hold = gated(3)
it = lj.DeviceIterator(make().map(hold), sharding, prefetch=1)
got = [ids(next(it)) for _ in range(2)]
saved = it.get_state()  # after batch 1
got.append(ids(next(it)))
def back_to_saved(signum, frame):
  gate.set()
  it.set_state(saved)
signal.signal(signal.SIGALRM, back_to_saved)
signal.setitimer(signal.ITIMER_REAL, 0.3)  # while next() waits for batch 3
got += [ids(b) for b in it]
found["signalled"] = got

gate, hold = gated(2)
it = lj.DeviceIterator(make().map(hold), sharding, prefetch=1)
got = [ids(next(it))]
saved = it.get_state()  # after batch 0
got.append(ids(next(it)))
def interrupt():
  time.sleep(0.3)  # set_state() below waits for the worker, held at the gate
  _thread.interrupt_main()
  time.sleep(0.3)
  gate.set()
threading.Thread(target=interrupt).start()
try:
  it.set_state(saved)
  found["interrupted"] = False
except KeyboardInterrupt:
  found["interrupted"] = True
got.append(ids(next(it)))  # the position is still after batch 1
it.set_state(saved)
got += [ids(b) for b in it]
found["after_interrupt"] = got
print(json.dumps(found))
"""


@pytest.mark.slow  # a process of its own (jax)
def test_close_or_set_state_while_next_waits_and_a_ctrl_c_inside_them_lose_nothing(inputs):
  found = _found(_MEANWHILE, inputs["records"])
  every = found["every"]
  assert len(every) == 2 * (N_RECORDS // GLOBAL_BATCH)
  assert found["closed_meanwhile"] == every
  assert found["signalled"] == every[:3] + every[2:]
  assert found["interrupted"]
  assert found["after_interrupt"] == every[:3] + every[1:]


_PAIR = r"""
import json, sys
frameworks = sys.argv[1:]
for name in frameworks:  # both imported first, in this order; then each computes
  if name == "jax":
    import jax, jax.numpy as jnp
  elif name == "tensorflow":
    import tensorflow as tf
  else:
    import torch, torch_xla
out = {}
for name in frameworks:
  if name == "jax":
    out[name] = int(jax.jit(lambda x: x.sum())(jnp.arange(4)))
  elif name == "tensorflow":
    out[name] = int(tf.reduce_sum(tf.range(4)))
  else:
    out[name] = int(torch.arange(4, device=torch_xla.device()).sum().item())
print(json.dumps(out))
"""


@pytest.mark.slow  # a process per pair
@pytest.mark.parametrize("frameworks,shares", [
    (("jax", "tensorflow"), True), (("tensorflow", "jax"), True), (("jax", "torch_xla"), True),
    (("torch_xla", "jax"), True),
    (("tensorflow", "torch_xla"), False),  # the pair docs/loaders.md keeps apart: both register LLVM's options
], ids=lambda v: "+".join(v) if isinstance(v, tuple) else ("shares" if v else "clash"))
def test_which_frameworks_share_a_process_with_jax(frameworks, shares):
  """Found here (jax 0.10.2, TensorFlow 2.21, torch_xla 2.9): jax shares a process with either, in either import
  order; the probe does see a clash (TensorFlow, then torch_xla: "LLVM ERROR: inconsistency in registered
  CommandLine options")."""
  r = subprocess.run([sys.executable, "-c", _PAIR, *frameworks], capture_output=True, text=True, timeout=300,
                     env={**_env(1), "PJRT_DEVICE": "CPU"})
  if shares:
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {f: 6 for f in frameworks}
  else:
    assert r.returncode != 0
    assert "LLVM ERROR" in r.stderr
