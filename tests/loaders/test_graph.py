"""loaders.graph: sampler properties, grain feeding, and torch_xla's MpDeviceLoader on an XLA CPU device."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from formats.storage import files
from formats.errors import NotAnOutputError
from formats.features import Features
from formats.graphbin import GraphBin, GraphBinWriter
from formats.manifest import MANIFEST_FILENAME, FileInfo, Manifest, sha256_file
from loaders import graph as lg
from tests.conftest import REPO, upload_tree

N = 300


@pytest.fixture(scope="module")
def graph_path(tmp_path_factory) -> str:
  """A random graph with a few nodes that have no neighbours, as a .graphbin."""
  rng = np.random.default_rng(0)
  src = rng.integers(0, N, 3000)
  dst = rng.integers(0, N, 3000)
  keep = src % 17 != 0  # nodes 0, 17, 34, ... have no out-neighbours
  src, dst = src[keep], dst[keep]
  order = np.argsort(src, kind="stable")
  path = str(tmp_path_factory.mktemp("g") / "g.graphbin")
  with GraphBinWriter(path) as w:
    w.add_meta({"num_nodes": {"": N}})
    w.add("indptr", np.concatenate([[0], np.cumsum(np.bincount(src, minlength=N))]).astype(np.int64))
    w.add("indices", dst[order].astype(np.int32))
    w.add("node/feat", rng.normal(size=(N, 4)).astype(np.float32))
    w.add("node/label", (np.arange(N) % 7)[:, None].astype(np.int64))
    w.add("split/random/train", np.arange(0, N, 2, dtype=np.int64))
  return path


@pytest.fixture(scope="module")
def graph(graph_path):
  return lg.Graph(graph_path)


@pytest.fixture(scope="module")
def graph_output(graph_path, tmp_path_factory) -> str:
  """The graph as an output: the .graphbin and a manifest.json listing it."""
  out = tmp_path_factory.mktemp("graph_output")
  shutil.copy(graph_path, out / "g.graphbin")
  info = FileInfo("g.graphbin", os.path.getsize(out / "g.graphbin"), sha256_file(str(out / "g.graphbin")), "graphbin")
  manifest = Manifest(name="g", file_format="graphbin", features=Features({}), splits={}, files=(info,))
  (out / MANIFEST_FILENAME).write_bytes(manifest.dumps())
  return str(out)


def test_load_opens_the_graph_an_output_lists(graph_output, graph):
  for path in (graph_output, os.path.join(graph_output, "g.graphbin")):
    np.testing.assert_array_equal(lg.load(path).indices, graph.indices)
  with pytest.raises(FileNotFoundError, match="lists no graph other.graphbin"):
    lg.load(os.path.join(graph_output, "other.graphbin"))
  with pytest.raises(NotAnOutputError, match="is not a complete output"):
    lg.load(os.path.dirname(graph_output))


@pytest.mark.gcs
@pytest.mark.slow
def test_load_over_gcs_downloads_and_checks_sections_once(graph_output, graph, gcs_emulator, tmp_path, monkeypatch):
  gs = f"gs://{gcs_emulator}/graphs/{tmp_path.name}"
  upload_tree(graph_output, gs)
  cache = str(tmp_path / "cache")
  np.testing.assert_array_equal(lg.load(gs, cache_dir=cache).indices, graph.indices)
  assert [f for _, _, fs in os.walk(cache) for f in fs if f.endswith(".sections-verified")] == [
      "g.graphbin.sections-verified"]
  downloads, section_checks = [], []
  monkeypatch.setattr(files, "download", lambda *a: downloads.append(a))
  real = GraphBin.verify
  monkeypatch.setattr(GraphBin, "verify", lambda self, *a, **k: section_checks.append(self.path) or real(self, *a, **k))
  np.testing.assert_array_equal(lg.load(gs, cache_dir=cache).indices, graph.indices)
  assert downloads == []
  assert section_checks == []


def _sampler(graph, **kw):
  kw = {"fanouts": [4, 3], "seed": 3, **kw}
  if "global_batch_size" not in kw:
    kw.setdefault("batch_size", 16)
  return lg.NeighborSampler(graph, **kw)


def test_every_sampled_edge_exists_and_features_match(graph):
  s = _sampler(graph)
  for i in range(len(s)):
    b = s[i]
    for h in range(2):
      ei, m = b[f"edge_index_{h}"], b[f"edge_mask_{h}"]
      assert b["node_mask"][ei[:, m]].all()  # masked-in edges join live nodes
      nbr, node = b["node_ids"][ei[0, m]], b["node_ids"][ei[1, m]]
      for a, v in zip(nbr, node):
        assert a in graph.indices[graph.indptr[v]:graph.indptr[v + 1]]
    live = b["node_mask"]
    np.testing.assert_array_equal(b["x"][live], graph.node_features[b["node_ids"][live]])
    np.testing.assert_array_equal(b["y"][b["seed_mask"]], graph.labels[b["seeds"][b["seed_mask"]]])


def test_every_node_a_hop_finds_is_expanded_at_the_next(graph):
  """The frontier of hop h+1 is exactly the nodes hop h found, numbered in order after the local nodes before
  them; each frontier node has its k draws in order, drawn (mask true) exactly when it has neighbours; nothing
  past the frontier is drawn. (Checking only that drawn edges exist would pass a frontier cut short.)"""
  s = _sampler(graph)
  degree = np.diff(np.asarray(graph.indptr))
  for i in range(len(s)):
    b = s[i]
    live = b["seed_mask"]
    lo, hi = 0, int(live.sum())  # padded seeds (the last batch) are never drawn for
    num_local = len(b["seeds"])
    for h, k in enumerate(s.fanouts):
      ei, m = b[f"edge_index_{h}"], b[f"edge_mask_{h}"]
      n = hi - lo
      np.testing.assert_array_equal(ei[1, :n * k], np.repeat(np.arange(lo, hi), k))
      np.testing.assert_array_equal(m[:n * k], np.repeat(degree[b["node_ids"][lo:hi]] > 0, k))
      assert not m[n * k:].any()
      new = sorted({int(x) for x in ei[0, m] if x >= num_local})
      assert new == list(range(num_local, num_local + len(new)))
      lo, hi, num_local = num_local, num_local + len(new), num_local + len(new)
    assert b["node_mask"][len(b["seeds"]):].sum() == num_local - len(b["seeds"])


def test_shapes_are_static_including_the_last_partial_batch(graph):
  s = _sampler(graph)
  assert len(graph.split("train")) % 16 != 0  # the last batch is partial
  shapes = {tuple((k, v.shape, v.dtype.str) for k, v in sorted(s[i].items())) for i in range(len(s))}
  assert len(shapes) == 1
  last = s[len(s) - 1]
  assert not last["seed_mask"].all()
  assert last["seed_mask"].any()


def test_nodes_without_neighbours_give_masked_edges(graph):
  s = lg.NeighborSampler(graph, fanouts=[3], batch_size=4, seed=0, seed_nodes=np.array([0, 17, 1, 2]))
  b = s[0]
  order = list(b["seeds"])
  for node in (0, 17):
    local = order.index(node)
    assert not b["edge_mask_0"][local * 3:(local + 1) * 3].any()


def test_deterministic_and_reshuffled_each_epoch(graph):
  a, b = _sampler(graph), _sampler(graph)
  for k, v in a.batch(2, epoch=0).items():
    np.testing.assert_array_equal(v, b.batch(2, epoch=0)[k])
  assert not np.array_equal(a.batch(0, epoch=0)["seeds"], a.batch(0, epoch=1)["seeds"])
  assert not np.array_equal(a.batch(0)["seeds"], _sampler(graph, seed=4).batch(0)["seeds"])


@pytest.mark.parametrize("order", ["global", "host"])
def test_shards_are_disjoint_equal_and_cover_the_split(graph, order):
  """148 seeds on 3 hosts: the global order covers every seed (the last global batch padded, masked); the host
  order gives each host an equal share and leaves out the 148 % 3 left over."""
  seeds = graph.split("train")[:148]
  shards = [_sampler(graph, seed_nodes=seeds, shard_index=i, shard_count=3, order=order) for i in range(3)]
  assert len({len(s) for s in shards}) == 1
  seen = [np.concatenate([s[i]["seeds"][s[i]["seed_mask"]] for i in range(len(s))]) for s in shards]
  assert len({len(x) for x in seen}) == (2 if order == "global" else 1)  # the host order: equal shares
  allseeds = np.concatenate(seen)
  assert len(allseeds) == len(set(allseeds.tolist()))  # disjoint
  assert len(allseeds) == (148 if order == "global" else 147)
  assert set(allseeds.tolist()) <= set(seeds.tolist())


def test_the_host_order_refuses_fewer_seeds_than_hosts(graph):
  with pytest.raises(ValueError, match="the 3 seed nodes give each of 4 hosts 0 .* every epoch would be empty"):
    _sampler(graph, seed_nodes=graph.split("train")[:3], shard_count=4, order="host")
  assert len(_sampler(graph, seed_nodes=graph.split("train")[:3], shard_count=4)) == 1  # the global order pads


@pytest.mark.parametrize("in_memory", [False, None, True])
def test_a_graph_without_edges_samples_every_draw_masked(tmp_path, in_memory):
  path = str(tmp_path / "empty.graphbin")
  with GraphBinWriter(path) as w:
    w.add_meta({"num_nodes": {"": 4}})
    w.add("indptr", np.zeros(5, np.int64))
    w.add("indices", np.zeros(0, np.int32))
    w.add("node/feat", np.arange(8, dtype=np.float32).reshape(4, 2))
    w.add("split/random/train", np.arange(4, dtype=np.int64))
  b = lg.NeighborSampler(lg.Graph(path), fanouts=[2], batch_size=4, in_memory=in_memory).batch(0)
  assert not b["edge_mask_0"].any() and b["seed_mask"].all() and sorted(b["seeds"].tolist()) == [0, 1, 2, 3]
  np.testing.assert_array_equal(b["x"][b["node_mask"]], 2 * b["node_ids"][b["node_mask"]][:, None] + [0, 1])


def test_grain_dataset_threads_and_resume(graph):
  s = _sampler(graph)
  ds = lg.grain_dataset(s, num_epochs=2, num_threads=2)
  it = iter(ds)
  first = [next(it) for _ in range(3)]
  state = it.get_state()
  rest = [b["seeds"] for b in it]
  assert len(first) + len(rest) == 2 * len(s)
  np.testing.assert_array_equal(first[1]["seeds"], s.batch(1)["seeds"])
  it2 = iter(ds)
  it2.set_state(state)
  resumed = [b["seeds"] for b in it2]
  assert all(np.array_equal(a, b) for a, b in zip(rest, resumed))
  assert len(rest) == len(resumed)


def test_a_state_resumes_only_with_the_order_seed_and_step_it_was_saved_with(graph):
  """Another global batch, seed, order or host count puts other seeds at the saved position: a resume with
  them would skip some seeds and repeat others, so it is refused; the same settings on another host count of
  the global order resume; a state saved before the settings were recorded resumes with a warning."""
  from loaders._pinning import UnverifiedStateWarning
  from loaders import StateMismatchError

  def state_after_two(**kw):
    it = iter(lg.grain_dataset(_sampler(graph, **kw), num_threads=1))
    next(it), next(it)
    return json.loads(json.dumps(it.get_state()))

  saved = state_after_two(order="global", global_batch_size=8, seed=0)
  for other in (dict(order="global", global_batch_size=16, seed=0), dict(order="global", global_batch_size=8, seed=1),
                dict(order="host", batch_size=8, seed=0)):
    it = iter(lg.grain_dataset(_sampler(graph, **other), num_threads=1))
    with pytest.raises(StateMismatchError, match="saved with other order settings"):
      it.set_state(saved)
  host = state_after_two(order="host", batch_size=4, shard_count=2, seed=0)
  with pytest.raises(StateMismatchError, match=r"hosts=2 \(now 4\)"):
    iter(lg.grain_dataset(_sampler(graph, order="host", batch_size=4, shard_count=4), num_threads=1)).set_state(host)

  def after(state, **kw):
    it = iter(lg.grain_dataset(_sampler(graph, order="global", seed=0, **kw), num_threads=1))
    it.set_state(state)
    return np.concatenate([b["seeds"][b["seed_mask"]] for b in it])

  whole = iter(lg.grain_dataset(_sampler(graph, order="global", global_batch_size=8, seed=0), num_threads=1))
  want = np.concatenate([b["seeds"][b["seed_mask"]] for b in list(whole)[2:]])
  halves = [after(saved, global_batch_size=8, shard_index=h, shard_count=2) for h in (0, 1)]
  assert sorted(np.concatenate(halves).tolist()) == sorted(want.tolist())
  old = {k: v for k, v in saved.items() if k != "order"}
  with pytest.warns(UnverifiedStateWarning, match="a state saved with other settings names other records"):
    np.testing.assert_array_equal(after(old, global_batch_size=8), want)


def test_each_live_node_has_one_local_id_and_ids_can_stay_on_device(graph):
  s = _sampler(graph)
  b = s[1]
  live = b["node_ids"][b["node_mask"]]
  assert len(np.unique(live)) == len(live)
  lean = _sampler(graph, gather_features=False)[1]
  assert "x" not in lean
  assert all(np.array_equal(lean[k], b[k]) for k in lean)


def test_node_budget_shrinks_batches_and_overflow_is_loud(graph):
  full = _sampler(graph)
  b, (k0, k1) = 16, (4, 3)  # _sampler's batch size and fanouts
  worst = b + b * k0 + b * k0 * k1  # seeds, hop 0's new nodes, hop 1's new nodes: all distinct at worst
  assert worst < N + b  # the graph is large enough that the worst case is not capped by its size
  small = _sampler(graph, node_budget=200)
  assert 200 < worst
  assert full.budgets.nodes == worst
  assert small[0]["x"].shape[0] == 200
  assert small[0]["node_mask"].sum() == full[0]["node_mask"].sum() < 200
  tiny = _sampler(graph, node_budget=16)
  with pytest.raises(RuntimeError, match="raise it"):
    tiny[0]


def test_an_overflow_leaves_no_trace_in_later_batches(graph):
  """The sampler's global->local table is reused across batches of a thread: a batch that
  overflows its node budget must not leave entries behind that relabel the next batch wrongly."""
  full = _sampler(graph)
  budget = sorted(int(full[i]["node_mask"].sum()) for i in range(len(full)))[len(full) // 2]

  def fresh(i):  # batch i from a sampler whose table nothing has touched, or None on overflow
    try:
      return _sampler(graph, node_budget=budget)[i]
    except RuntimeError:
      return None

  results = [fresh(i) for i in range(len(full))]
  fits = next(i for i, r in enumerate(results) if r is not None)
  overflows = next(i for i, r in enumerate(results) if r is None)
  expected = results[fits]
  s = _sampler(graph, node_budget=budget)
  with pytest.raises(RuntimeError, match="raise it"):
    s[overflows]
  after = s[fits]
  assert all(np.array_equal(after[k], expected[k]) for k in expected)


def test_rejects_bad_arguments(graph):
  with pytest.raises(ValueError, match="fanouts"):
    lg.NeighborSampler(graph, fanouts=[0])
  with pytest.raises(ValueError, match="shard_index"):
    lg.NeighborSampler(graph, shard_index=2, shard_count=2)


_XLA_SCRIPT = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from loaders import graph as lg
assert "tensorflow" not in sys.modules
g = lg.Graph(sys.argv[2])
s = lg.NeighborSampler(g, fanouts=[4, 3], batch_size=16, seed=3)
EPOCHS = 2

def host(position):
  return s.batch(position % len(s), position // len(s))

def same(batch, want):
  got = {k: v.cpu().numpy() for k, v in batch.items()}
  return sorted(got) == sorted(want) and all(got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k])
                                             for k in want)

shapes, devices, n, differ, edges = set(), set(), 0, [], 0
for batch in lg.xla_loader(s, num_epochs=EPOCHS, num_threads=2):
  shapes.add(tuple((k, tuple(v.shape)) for k, v in sorted(batch.items())))
  devices.add(str(batch["x"].device))
  if not same(batch, host(n)):
    differ.append(n)
  edges += int(sum(batch[f"edge_mask_{h}"].sum().item() for h in range(2)))
  n += 1
host_edges = sum(int(host(p)[f"edge_mask_{h}"].sum()) for p in range(EPOCHS * len(s)) for h in range(2))
# resume: stop inside the second epoch, restore in a new loader, get exactly the rest
k = len(s) + 2
first = lg.xla_loader(s, num_epochs=EPOCHS, num_threads=2)
it = iter(first)
for _ in range(k):
  next(it)
state = json.loads(json.dumps(first.get_state()))
resumed = list(lg.xla_loader(s, num_epochs=EPOCHS, num_threads=2, state=state))
print(json.dumps({"batches": n, "expected": EPOCHS * len(s), "shapes": len(shapes), "devices": sorted(devices),
                  "differ": differ, "edges": edges, "host_edges": host_edges, "k": k,
                  "resumed": len(resumed), "resumed_differ": [j for j, b in enumerate(resumed) if not same(b, host(k + j))],
                  "tf": "tensorflow" in sys.modules}))
"""


_xla_results: dict[str, dict] = {}


def _run_xla(graph_path: str) -> dict:
  """The script's findings, from one torch_xla process per graph (TensorFlow, imported by other tests, cannot
  share a process with torch_xla)."""
  if graph_path not in _xla_results:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
    r = subprocess.run([sys.executable, "-c", _XLA_SCRIPT, REPO, graph_path], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    _xla_results[graph_path] = json.loads(r.stdout.strip().splitlines()[-1])
  return _xla_results[graph_path]


@pytest.mark.slow  # a torch_xla process (6-8 s)
def test_xla_loader_on_an_xla_cpu_device_gives_the_host_batches(graph_path):
  got = _run_xla(graph_path)
  assert got["batches"] == got["expected"] > 0
  assert got["shapes"] == 1
  assert got["devices"]
  assert all(d.startswith("xla") for d in got["devices"])
  assert got["differ"] == []  # every device batch is the host sampler's batch, bit for bit
  assert got["edges"] == got["host_edges"] > 0
  assert not got["tf"]


@pytest.mark.slow  # the same torch_xla process
def test_xla_loader_resumes_exactly(graph_path):
  """The state after k batches (inside the second epoch) gives a new loader exactly the batches that follow."""
  got = _run_xla(graph_path)
  assert got["k"] < got["expected"]
  assert got["resumed"] == got["expected"] - got["k"]
  assert got["resumed_differ"] == []


def _same(a: dict, b: dict) -> bool:
  return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def test_batches_are_the_same_whatever_thread_samples_them_and_in_what_order(graph):
  """The draws come from a stream keyed by (seed, epoch, batch, shard, hop): threads and order do not matter."""
  import concurrent.futures

  s = _sampler(graph)
  alone = [s.batch(i, epoch=1) for i in range(len(s))]
  other = _sampler(graph)
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    shuffled = list(np.random.default_rng(5).permutation(len(s)))
    together = dict(zip(shuffled, pool.map(lambda i: other.batch(int(i), epoch=1), shuffled)))
  assert all(_same(alone[i], together[i]) for i in range(len(s)))
  assert not _same(alone[0], s.batch(0, epoch=2))


def test_draws_are_uniform_over_a_nodes_neighbours(graph):
  """Every neighbour of a frontier node is drawn about equally often (a fixed seed: the check cannot flake)."""
  node = int(np.argmax(np.diff(np.asarray(graph.indptr))))
  nbrs = np.asarray(graph.indices)[graph.indptr[node]:graph.indptr[node + 1]]
  s = lg.NeighborSampler(graph, fanouts=[50], batch_size=1, seed_nodes=np.array([node]), gather_features=False)
  batches = [s.batch(0, epoch) for epoch in range(200)]
  drawn = np.concatenate([b["node_ids"][b["edge_index_0"][0][b["edge_mask_0"]]] for b in batches])
  values, counts = np.unique(nbrs, return_counts=True)
  expected = counts / counts.sum() * len(drawn)
  observed = np.array([(drawn == v).sum() for v in values])
  chi2 = float(((observed - expected) ** 2 / expected).sum())
  assert set(np.unique(drawn)) <= set(values.tolist())
  assert chi2 < 3 * len(values), (chi2, len(values))  # mean len(values) - 1 under uniform draws


def test_x_is_never_overwritten_while_held_and_its_buffer_is_reused_once_dropped(graph):
  s = _sampler(graph)
  feats = np.asarray(graph.node_features)
  held = [s.batch(i) for i in range(len(s))]  # every x still referenced: no buffer may be reused
  for b in held:
    live = b["node_mask"]
    assert np.array_equal(b["x"][live], feats[b["node_ids"][live]])
    assert not b["x"][~live].any()
  assert len({id(b["x"]) for b in held}) == len(held)  # all alive at once: all distinct
  pool = s._gather._buffers._buffers  # the pool's own list (another list would hold the buffers too)
  assert all(any(b["x"] is p for p in pool) for b in held)
  assert len(pool) == len(held)
  del held, b
  for i in range(3 * len(s)):  # each batch dropped at once: one of the pooled buffers again, no new one
    x = s.batch(i % len(s))["x"]
    assert any(x is p for p in pool)
    del x
  assert len(pool) == len(s)
  sizes = [int(s.batch(i)["node_mask"].sum()) for i in range(len(s))]
  fresh = _sampler(graph)  # its first buffer serves the largest batch, then ever smaller ones
  for i in list(np.argsort(sizes)[::-1]) * 2:
    b = fresh.batch(int(i))
    assert np.array_equal(b["x"][b["node_mask"]], feats[b["node_ids"][b["node_mask"]]])
    assert not b["x"][~b["node_mask"]].any()  # the padding rows are zero again
    assert _same(b, _sampler(graph).batch(int(i)))  # every reused array (edges, ids, masks) as if fresh
    del b


def test_gather_options_change_only_the_speed_or_the_dtype(graph):
  import ml_dtypes

  base = _sampler(graph, in_memory=False)
  ram = _sampler(graph, in_memory=True, gather_threads=3)
  for i in range(len(base)):
    assert _same(base[i], ram[i])
  bf16 = _sampler(graph, feature_dtype="bfloat16", in_memory=False, gather_threads=2)[2]
  want = base[2]
  assert bf16["x"].dtype == ml_dtypes.bfloat16
  assert np.array_equal(bf16["x"], want["x"].astype(ml_dtypes.bfloat16))
  assert np.array_equal(_sampler(graph, feature_dtype="bfloat16", in_memory=True)[2]["x"], bf16["x"])
  with pytest.raises(ValueError, match="threads"):
    _sampler(graph, gather_threads=0)


def test_observed_node_budget_fits_the_batches_it_saw(graph):
  s = _sampler(graph)
  budget = s.observed_node_budget(num_batches=len(s), margin=1.0)
  assert budget == max(int(s[i]["node_mask"].sum()) + s.batch_size - int(s[i]["seed_mask"].sum())
                       for i in range(len(s)))
  small = _sampler(graph, node_budget=budget)
  assert all(small[i]["x"].shape[0] == budget for i in range(len(small)))


@pytest.mark.slow  # a subprocess: a process without numba
def test_without_numba_the_sampler_names_the_extra_to_install(graph_path):
  script = ("import sys; sys.modules['numba'] = None\n"
            "from loaders import graph as lg\n"
            f"lg.NeighborSampler(lg.Graph({graph_path!r}), fanouts=[2], batch_size=4)\n")
  r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
  assert r.returncode == 1
  assert "need numba" in r.stderr
  assert ".[graph]" in r.stderr


def test_a_node_budget_bounds_the_later_frontiers_and_their_edges():
  worst = lg.budgets(16, [4, 3, 2], 10**6)
  assert worst == lg.Budgets((16, 64, 192), (64, 192, 384), 16 + 64 + 192 + 384)
  tight = lg.budgets(16, [4, 3, 2], 10**6, node_budget=16 + 100)
  # at most 100 nodes besides the seeds: no later hop's frontier can hold more
  assert tight == lg.Budgets((16, 64, 100), (64, 192, 200), 116)
  assert lg.budgets(16, [4, 3, 2], 50) == lg.Budgets((16, 50, 50), (64, 150, 100), 66)


def test_seeds_outside_the_graph_and_a_malformed_csr_are_refused_before_the_kernel_runs(graph, tmp_path):
  with pytest.raises(ValueError, match=r"seed nodes: ids outside \[0, 300\)"):
    lg.NeighborSampler(graph, seed_nodes=np.array([3, 5_000_000]))
  with pytest.raises(ValueError, match="ids outside"):
    lg.NeighborSampler(graph, seed_nodes=np.array([-1]))
  path = str(tmp_path / "bad.graphbin")
  with GraphBinWriter(path) as w:  # CRCs are right: the file says what its writer meant, which is wrong
    w.add_meta({"num_nodes": {"": 3}})
    w.add("indptr", np.array([0, 1, 2, 3]))
    w.add("indices", np.array([1, 7, 0], np.int32))
  with pytest.raises(ValueError, match=r"indices outside \[0, 3\)"):
    lg.NeighborSampler(lg.Graph(path), seed_nodes=np.arange(3))


def test_the_in_memory_default_shares_the_memory_among_the_hosts_processes(monkeypatch):
  from loaders import _features

  monkeypatch.setattr(_features, "available_memory", lambda: 1000)
  monkeypatch.delenv("PJRT_LOCAL_PROCESS_COUNT", raising=False)
  monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
  assert _features.keep_in_memory(400, None)
  assert not _features.keep_in_memory(600, None)
  monkeypatch.setenv("PJRT_LOCAL_PROCESS_COUNT", "4")  # four processes, four copies
  assert not _features.keep_in_memory(400, None)
  assert _features.keep_in_memory(125, None)
  assert _features.keep_in_memory(400, True)
  assert not _features.keep_in_memory(1, False)


def _elastic_run(make, schedule, epochs=2):
  """Global steps of a run that changes host count: [(hosts, steps)], each resuming from the state the previous
  part's host 0 saved. Returns each global step's seeds: the hosts' masked seeds concatenated in host order."""
  steps, state = [], None
  for hosts, count in schedule:
    its = []
    for h in range(hosts):
      it = iter(lg.grain_dataset(make(h, hosts), num_epochs=epochs, num_threads=1, prefetch_buffer_size=1))
      if state is not None:
        it.set_state(state)
      its.append(it)
    for _ in range(count):
      batches = [next(it) for it in its]
      steps.append(np.concatenate([b["seeds"][b["seed_mask"]] for b in batches]))
    state = json.loads(json.dumps(its[0].get_state()))
  return steps


def test_global_order_resumes_exactly_across_4_then_2_then_8_hosts(graph):
  G = 24  # the global batch; 150 seeds: 7 global steps per epoch, the last one short (6 seeds)

  def make(h, hosts):
    return _sampler(graph, order="global", global_batch_size=G, shard_index=h, shard_count=hosts)

  single = _sampler(graph, order="global", batch_size=G)
  assert len(single) == 7
  assert all(len(make(h, n)) == 7 for n in (2, 4, 8) for h in range(n))
  want = [single.batch(i % 7, i // 7)["seeds"][single.batch(i % 7, i // 7)["seed_mask"]] for i in range(14)]
  got = _elastic_run(make, [(4, 3), (2, 5), (8, 6)])  # into the second epoch, 14 steps in all
  assert len(got) == 14
  assert all(np.array_equal(g, w) for g, w in zip(got, want))
  assert sum(len(w) for w in want[:7]) == 150
  assert len(np.unique(np.concatenate(want[:7]))) == 150
  last = make(7, 8).batch(6)  # the short last step: hosts past its end get padding only
  assert not last["seed_mask"].any()
  assert not last["node_mask"].any()
  assert not last["edge_mask_0"].any()


def test_global_batch_errors_and_the_global_order_is_the_default(graph):
  with pytest.raises(ValueError, match="global_batch_size 24 is not divisible by shard_count 5"):
    _sampler(graph, order="global", global_batch_size=24, shard_count=5)
  with pytest.raises(ValueError, match="needs order='global'"):
    _sampler(graph, order="host", global_batch_size=24)
  with pytest.raises(ValueError, match="order must be one of"):
    _sampler(graph, order="elastic")
  assert _sampler(graph, shard_index=1, shard_count=3).order == "global"
  host = _sampler(graph, shard_index=1, shard_count=3, order="host")
  assert host.per_shard == 50
  assert len(host) == 4  # every 3rd seed from 1 on


def test_a_batch_size_that_disagrees_with_the_global_batch_is_refused(graph):
  with pytest.raises(ValueError, match="batch_size 8 and global_batch_size 24 disagree on 2 hosts"):
    _sampler(graph, order="global", global_batch_size=24, shard_count=2, batch_size=8)
  assert _sampler(graph, order="global", global_batch_size=24, shard_count=2, batch_size=12).batch_size == 12
  assert lg.NeighborSampler(graph).batch_size == 1024
