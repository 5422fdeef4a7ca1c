"""loaders.graph.HeteroNeighborSampler on a MAG-shaped graph with reverse relations, laid out as ogb_graphs
writes it (tests/loaders/make_outputs.py)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from loaders import graph as lg
from tests.conftest import REPO
from tests.loaders import make_outputs

COUNTS = {"author": 900, "field_of_study": 80, "institution": 40, "paper": 1200}
EDGES = dict(zip(make_outputs.MAG_RELATIONS, (700, 3000, 4000, 3500)))


@pytest.fixture(scope="module")
def mag_path(tmp_path_factory) -> str:
  """A MAG-shaped output: the four node types and relations as ogb ships them, plus the reverse relations."""
  return make_outputs.write_mag(str(tmp_path_factory.mktemp("hetero") / "out"), COUNTS, EDGES, seed=7)


@pytest.fixture(scope="module")
def mag(mag_path):
  return lg.load(mag_path)


def _sampler(mag, **kw):
  kw = {"fanouts": [4, 3], "seed": 1, **kw}
  if "global_batch_size" not in kw:
    kw.setdefault("batch_size", 32)
  return lg.HeteroNeighborSampler(mag, **kw)


def _same(a: dict, b: dict) -> bool:
  return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def test_every_relation_including_the_reverse_ones_is_sampled_from_paper_seeds(mag):
  s = _sampler(mag)
  assert s.seed_type == "paper"
  assert "paper___rev_writes___author" in s.relations
  assert "author___writes___paper" in s.relations
  hop0 = {k.split("/")[1] for k in s[0] if k.startswith("edge_index/") and k.endswith("/0")}
  assert hop0 == {r for r in s.relations if r.startswith("paper___")}  # the seeds' out-relations
  b = s[0]
  assert b["node_mask/author"].any()
  assert b["node_mask/institution"].any()  # via rev_writes, then affiliated_with


def test_every_node_a_hop_finds_is_expanded_at_the_next(mag):
  """Per node type, hop h+1's frontier is exactly the nodes of that type hop h found (numbered in order after
  the type's local nodes before them); every relation out of a type draws its k for each frontier node in order,
  drawn (mask true) exactly when the node has neighbours in that relation; nothing past the frontier is drawn."""
  s = _sampler(mag)
  degree = {r: np.diff(np.asarray(mag.relation(r)[0])) for r in s.relations}
  for i in range(len(s)):
    b = s[i]
    num_local = {t: len(b["seeds"]) if t == s.seed_type else 0 for t in s.types}
    frontier = {t: (0, int(b["seed_mask"].sum())) if t == s.seed_type else (0, 0) for t in s.types}
    for hop in range(s.num_hops):
      found = {t: set() for t in s.types}
      for r in s.relations:
        if f"edge_index/{r}/{hop}" not in b:
          continue
        head, _, tail = r.split("___")
        ei, m, k = b[f"edge_index/{r}/{hop}"], b[f"edge_mask/{r}/{hop}"], s.fanouts[r][hop]
        lo, hi = frontier[head]
        n = hi - lo
        np.testing.assert_array_equal(ei[1, :n * k], np.repeat(np.arange(lo, hi), k))
        np.testing.assert_array_equal(m[:n * k], np.repeat(degree[r][b[f"node_ids/{head}"][lo:hi]] > 0, k))
        assert not m[n * k:].any()
        found[tail] |= {int(x) for x in ei[0, m] if x >= num_local[tail]}
      for t in s.types:
        assert sorted(found[t]) == list(range(num_local[t], num_local[t] + len(found[t])))
        frontier[t] = (num_local[t], num_local[t] + len(found[t]))
        num_local[t] += len(found[t])
    for t in s.types:
      assert int(b[f"node_mask/{t}"].sum()) == num_local[t] - (len(b["seeds"]) - int(b["seed_mask"].sum())
                                                               if t == s.seed_type else 0)


def test_sampled_edges_exist_and_ids_and_masks_are_consistent(mag):
  s = _sampler(mag)
  for i in range(len(s)):
    b = s[i]
    for t in s.types:
      live = b[f"node_ids/{t}"][b[f"node_mask/{t}"]]
      assert len(np.unique(live)) == len(live)
      assert (live < s.num_nodes[t]).all()
      assert not b[f"node_ids/{t}"][~b[f"node_mask/{t}"]].any()
    for key in [k for k in b if k.startswith("edge_index/")]:
      _, r, hop = key.split("/")
      head, _, tail = r.split("___")
      indptr, indices = (np.asarray(a) for a in mag.relation(r))
      ei, m = b[key], b[f"edge_mask/{r}/{hop}"]
      assert b[f"node_mask/{tail}"][ei[0, m]].all()
      assert b[f"node_mask/{head}"][ei[1, m]].all()
      assert not ei[:, ~m][0].any()
      src, dst = b[f"node_ids/{tail}"][ei[0, m]], b[f"node_ids/{head}"][ei[1, m]]
      for u, v in zip(dst.tolist(), src.tolist()):
        assert v in indices[indptr[u]:indptr[u + 1]]
      # the frontier node of a masked-out draw has no neighbours in the relation
      heads = b[f"node_ids/{head}"][ei[1, ~m & (np.arange(ei.shape[1]) < np.flatnonzero(m).max(initial=0))]]
      assert (np.diff(indptr)[heads] == 0).all()
    assert np.array_equal(b["seeds"][b["seed_mask"]], b["node_ids/paper"][:s.batch_size][b["seed_mask"]])


def test_features_years_labels_and_seeds_come_from_the_graph(mag):
  s = _sampler(mag)
  feats, years = np.asarray(mag.bin["node/paper/feat"]), np.asarray(mag.bin["node/paper/year"])
  labels = np.asarray(mag.bin["node/paper/label"])
  train = set(np.asarray(mag.split("train")).tolist())
  b = s[1]
  live = b["node_mask/paper"]
  assert np.array_equal(b["x/paper"][live], feats[b["node_ids/paper"][live]])
  assert not b["x/paper"][~live].any()
  assert np.array_equal(b["year/paper"][live], years[b["node_ids/paper"][live]])
  assert np.array_equal(b["y"][b["seed_mask"]], labels[b["seeds"][b["seed_mask"]]])
  assert set(b["seeds"][b["seed_mask"]].tolist()) <= train
  assert "x/author" not in b  # no features: node_ids/author index an embedding table


def test_shapes_are_static_and_batches_are_the_same_on_any_thread(mag):
  s = _sampler(mag)
  shapes = {tuple((k, v.shape, v.dtype.str) for k, v in sorted(s.batch(i, 1).items())) for i in range(len(s))}
  assert len(shapes) == 1
  assert s.per_shard % s.batch_size  # the last batch is short and padded
  alone = [s.batch(i, epoch=1) for i in range(len(s))]
  other = _sampler(mag)
  order = [int(i) for i in np.random.default_rng(3).permutation(len(s))]
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    together = dict(zip(order, pool.map(lambda i: other.batch(i, epoch=1), order)))
  assert all(_same(alone[i], together[i]) for i in range(len(s)))
  assert not _same(alone[0], s.batch(0, epoch=2))


def test_reused_arrays_are_as_if_fresh(mag):
  """Every array of a batch comes from a pool; a reused one (after a larger batch) holds nothing stale."""
  s = _sampler(mag)
  sizes = [sum(int(v.sum()) for k, v in s.batch(i).items() if "mask" in k) for i in range(len(s))]
  reused = _sampler(mag)
  for i in list(np.argsort(sizes)[::-1]) * 2:
    b = reused.batch(int(i))
    assert _same(b, _sampler(mag).batch(int(i)))
    del b


def test_shards_are_disjoint_and_equal(mag):
  for order in ("host", "global"):
    shards = [_sampler(mag, shard_index=k, shard_count=3, order=order) for k in range(3)]
    seeds = [np.concatenate([sh.batch(i)["seeds"][sh.batch(i)["seed_mask"]] for i in range(len(sh))])
             for sh in shards]
    assert len({len(sh) for sh in shards}) == 1  # every host the same number of batches
    assert len(np.unique(np.concatenate(seeds))) == sum(len(x) for x in seeds)  # no seed on two hosts
    if order == "host":  # equal shares; the global order's last step may pad some hosts
      assert len({len(x) for x in seeds}) == 1


def test_per_relation_fanouts_and_their_errors(mag):
  s = _sampler(mag, fanouts={"cites": [5, 2], "rev_writes": [3, 0], "affiliated_with": [0, 2]})
  assert s.relations == ["author___affiliated_with___institution", "paper___cites___paper",
                         "paper___rev_writes___author"]
  b = s[0]
  assert b["edge_index/paper___cites___paper/0"].shape == (2, 32 * 5)
  assert "edge_index/paper___rev_writes___author/1" not in b  # fanout 0 at hop 1
  assert b["edge_index/author___affiliated_with___institution/1"].shape == (2, 32 * 3 * 2)
  assert not b["node_mask/field_of_study"].any()  # has_topic is not sampled
  with pytest.raises(ValueError, match="not in the graph"):
    _sampler(mag, fanouts={"likes": [2]})
  with pytest.raises(ValueError, match="same number of hops"):
    _sampler(mag, fanouts={"cites": [2], "rev_writes": [2, 2]})
  with pytest.raises(ValueError, match="positive"):
    _sampler(mag, fanouts=[2, 0])
  with pytest.raises(ValueError, match="seed_type"):
    _sampler(mag, seed_type="venue")
  with pytest.raises(ValueError, match=r"seed nodes \(paper\): ids outside \[0, 1200\)"):
    _sampler(mag, seed_nodes=np.array([1, 10**7]))


def test_node_budgets_from_observed_batches_and_a_loud_overflow_that_leaves_no_trace(mag):
  s = _sampler(mag)
  observed = s.observed_node_budget(num_batches=len(s), margin=1.0)
  tight = _sampler(mag, node_budget=observed)
  for i in range(len(s)):
    b, full = tight[i], s[i]
    for t in s.types:
      assert b[f"node_ids/{t}"].shape == (observed[t],)
      assert np.array_equal(b[f"node_ids/{t}"][b[f"node_mask/{t}"]], full[f"node_ids/{t}"][full[f"node_mask/{t}"]])
  small = {**observed, "author": observed["author"] // 2}
  shrunk = _sampler(mag, node_budget=small)
  with pytest.raises(RuntimeError, match="node_budget\\['author'\\].*raise it"):
    shrunk[0]
  ok = _sampler(mag, node_budget={**observed, "author": s.budgets.nodes["author"]})
  assert _same(_sampler(mag, node_budget=ok.budgets.nodes)[1], ok[1])
  with pytest.raises(ValueError, match="smaller than batch_size"):
    _sampler(mag, node_budget={"paper": 5})
  with pytest.raises(ValueError, match=r"node_budget\['author'\] must be >= 0, got -1"):
    _sampler(mag, node_budget={"author": -1})


def test_node_budgets_bound_the_later_frontiers_and_their_edges():
  fanouts = {"p___cites___p": [4, 3], "p___rev_writes___a": [2, 2], "a___writes___p": [5, 5]}
  worst = lg.hetero_budgets(10, "p", fanouts, {"p": 10**6, "a": 10**6})
  assert worst.frontier == {"a": (0, 20), "p": (10, 40)}
  assert worst.nodes == {"a": 20 + 80, "p": 10 + 40 + 220}
  assert worst.edges == {"a___writes___p": (0, 100), "p___cites___p": (40, 120), "p___rev_writes___a": (20, 80)}
  tight = lg.hetero_budgets(10, "p", fanouts, {"p": 10**6, "a": 10**6}, node_budget={"p": 10 + 30, "a": 15})
  assert tight.frontier == {"a": (0, 15), "p": (10, 30)}
  assert tight.nodes == {"a": 15, "p": 40}
  assert tight.edges == {"a___writes___p": (0, 75), "p___cites___p": (40, 90), "p___rev_writes___a": (20, 60)}


def test_an_overflow_leaves_no_trace_in_later_batches_of_the_thread(mag):
  s = _sampler(mag)
  authors = sorted(int(s[i]["node_mask/author"].sum()) for i in range(len(s)))
  budget = {**s.budgets.nodes, "author": authors[len(authors) // 2]}

  def fresh(i):  # batch i from a sampler whose tables nothing has touched, or None on overflow
    try:
      return _sampler(mag, node_budget=budget)[i]
    except RuntimeError:
      return None

  results = [fresh(i) for i in range(len(s))]
  fits = next(i for i, r in enumerate(results) if r is not None)
  overflows = next(i for i, r in enumerate(results) if r is None)
  same_thread = _sampler(mag, node_budget=budget)
  with pytest.raises(RuntimeError, match="raise it"):
    same_thread[overflows]
  assert _same(same_thread[fits], results[fits])


def test_grain_feed_resumes_exactly(mag):
  s = _sampler(mag)
  want = [s.batch(i % len(s), i // len(s)) for i in range(2 * len(s))]
  ds = lg.grain_dataset(s, num_epochs=2, num_threads=2)
  it = iter(ds)
  first = [next(it) for _ in range(len(s) + 1)]
  state = it.get_state()
  rest = list(_resumed(ds, state))
  assert all(_same(a, b) for a, b in zip(first + rest, want))
  assert len(first) + len(rest) == len(want)


def _resumed(ds, state):
  it = iter(ds)
  it.set_state(state)
  return it


def test_a_homogeneous_graph_is_refused_with_a_clear_message(tmp_path):
  from formats.graphbin import GraphBinWriter

  path = str(tmp_path / "h.graphbin")
  with GraphBinWriter(path) as w:
    w.add_meta({"num_nodes": {"": 3}})
    w.add("indptr", np.array([0, 1, 2, 3]))
    w.add("indices", np.array([1, 2, 0], np.int32))
  with pytest.raises(ValueError, match="no heterogeneous relations"):
    lg.HeteroNeighborSampler(lg.Graph(path), seed_nodes=np.arange(3), seed_type="")


_XLA_SCRIPT = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from loaders import graph as lg
assert "tensorflow" not in sys.modules
s = lg.HeteroNeighborSampler(lg.load(sys.argv[2]), fanouts=[4, 3], batch_size=32, seed=1, feature_dtype="bfloat16")
EPOCHS = 2
def host(p):
  return s.batch(p % len(s), p // len(s))
def same(batch, want):
  got = {k: v.cpu() for k, v in batch.items()}
  import torch
  ok = sorted(got) == sorted(want)
  for k, w in want.items():
    g = got[k]
    if w.dtype.name == "bfloat16":
      ok &= g.dtype == torch.bfloat16 and np.array_equal(g.float().numpy(), w.astype(np.float32))
    else:
      ok &= np.array_equal(g.numpy(), w)
  return bool(ok)
n, differ, devices = 0, [], set()
for batch in lg.xla_loader(s, num_epochs=EPOCHS, num_threads=2):
  devices.add(str(batch["x/paper"].device))
  differ += [] if same(batch, host(n)) else [n]
  n += 1
k = len(s) + 1
first = lg.xla_loader(s, num_epochs=EPOCHS, num_threads=2)
it = iter(first)
for _ in range(k):
  next(it)
state = json.loads(json.dumps(first.get_state()))
resumed = list(lg.xla_loader(s, num_epochs=EPOCHS, num_threads=2, state=state))
print(json.dumps({"batches": n, "expected": EPOCHS * len(s), "differ": differ, "devices": sorted(devices),
                  "resumed": len(resumed), "k": k,
                  "resumed_differ": [j for j, b in enumerate(resumed) if not same(b, host(k + j))]}))
"""


@pytest.mark.slow  # a torch_xla process
def test_xla_feed_on_an_xla_cpu_device_gives_the_host_batches_and_resumes(mag_path):
  env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
  r = subprocess.run([sys.executable, "-c", _XLA_SCRIPT, REPO, mag_path], capture_output=True, text=True,
                     env=env, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert got["batches"] == got["expected"] > 0
  assert got["differ"] == []
  assert got["devices"]
  assert all(d.startswith("xla") for d in got["devices"])
  assert got["resumed"] == got["expected"] - got["k"]
  assert got["resumed_differ"] == []


def test_global_order_resumes_exactly_across_4_then_2_then_8_hosts(mag):
  from tests.loaders.test_graph import _elastic_run

  G = 40

  def make(h, hosts):
    return _sampler(mag, order="global", global_batch_size=G, shard_index=h, shard_count=hosts)

  single = _sampler(mag, order="global", batch_size=G)
  n = len(single)
  assert all(len(make(h, k)) == n for k in (2, 4, 8) for h in range(k))
  want = []
  for i in range(2 * n):
    b = single.batch(i % n, i // n)
    want.append(b["seeds"][b["seed_mask"]])
  got = _elastic_run(make, [(4, 3), (2, n - 1), (8, n - 2)])
  assert len(got) == 2 * n
  assert all(np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("in_memory", [False, None, True])
def test_a_relation_without_edges_samples_every_draw_of_it_masked(tmp_path, in_memory):
  """ogbn-mag with no author -> institution edges (and so none back): every draw over them is masked."""
  empty = ("author", "affiliated_with", "institution")
  out = make_outputs.write_mag(str(tmp_path / "out"), COUNTS, {**EDGES, empty: 0}, seed=7)
  s = _sampler(lg.load(out), in_memory=in_memory)
  b = s.batch(0)
  keys = [k for k in b if k.startswith("edge_mask") and "affiliated_with" in k]
  assert keys and not any(b[k].any() for k in keys)
  assert any(b[k].any() for k in b if k.startswith("edge_mask") and "writes" in k)  # the others are sampled
