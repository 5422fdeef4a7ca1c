"""The global window order in runs of records, and a host's own records fetched as few ranged reads.

What must hold: the runs order is a pure function of (seed, epoch) whatever the host count; run_records=1 is
the order as it was (states saved before resume the same); hosts reading gs:// by coalesced ranged reads get
exactly the batches of the local output, across 4 -> 2 -> 8 hosts resuming from each other's states, while the
network answers 503, drops connections, cuts answers half-way and stalls.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from formats import load_manifest
from formats.storage import gcs_media
from loaders import grain as grain_loader
from loaders._stream import WindowOrder
from tests.conftest import upload_tree
from tests.loaders import make_outputs
from tests.loaders.elastic import host_steps

COUNTS = [10, 7, 10, 10, 3, 10, 10, 9, 10, 10, 0, 10]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
  """120 raw 16x16 images in 12 ArrayRecord shards (10 records each)."""
  features, payloads = make_outputs.raw_images(np.random.default_rng(5), 120, size=(16, 16))
  return make_outputs.write(str(tmp_path_factory.mktemp("runs") / "raw"), features, {"train": payloads},
                            kind="image", num_shards=12)


def _old_order(counts, window, seed, epoch) -> np.ndarray:
  """The window order before runs (every record shuffled within its window), written out independently."""
  starts = np.concatenate([[0], np.cumsum(counts)])
  shards = np.random.default_rng([seed, epoch, 0x5748]).permutation(len(counts))
  parts = []
  for w, at in enumerate(range(0, len(shards), window)):
    recs = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in shards[at:at + window]])
    parts.append(recs[np.random.default_rng([seed, epoch, w, 0x5749]).permutation(len(recs))])
  return np.concatenate(parts)


def _stream(order: WindowOrder, epoch: int) -> np.ndarray:
  return order._epoch(epoch)[2]


def test_one_record_per_run_is_the_order_states_were_saved_in():
  for global_order in (False, True):
    order = WindowOrder(COUNTS, 3, 4, seed=9, order="global" if global_order else "host", run_records=1)
    for epoch in range(3):
      assert np.array_equal(_stream(order, epoch), _old_order(COUNTS, 3, 9, epoch))


def test_runs_are_consecutive_records_of_one_shard_and_every_record_comes_once_per_epoch():
  order = WindowOrder(COUNTS, 3, 8, seed=2, order="global", run_records=4)
  starts = order.starts
  epochs = [_stream(order, e) for e in range(4)]
  for stream in epochs:
    assert sorted(stream.tolist()) == list(range(sum(COUNTS)))
    shard = np.searchsorted(starts, stream, side="right") - 1
    # cut the stream where it is not the next record of the same shard: pieces are at most 4 long, and most
    # are exactly 4 (a shard's first and last runs may be shorter; neighbouring runs may happen to join)
    breaks = np.flatnonzero((np.diff(stream) != 1) | (np.diff(shard) != 0)) + 1
    lengths = np.diff(np.concatenate([[0], breaks, [len(stream)]]))
    assert lengths.max() <= 8
    assert np.median(lengths) >= 3
  assert not np.array_equal(epochs[0], epochs[1])  # reshuffled every epoch
  # the cuts move from epoch to epoch: the same pairs of neighbours are not always together
  together = [{(int(a), int(b)) for a, b in zip(s[:-1], s[1:]) if b == a + 1} for s in epochs]
  assert together[0] != together[1]
  again = WindowOrder(COUNTS, 3, 8, seed=2, order="global", run_records=4)
  assert all(np.array_equal(_stream(again, e), epochs[e]) for e in range(4))  # a pure function of (seed, epoch)


def test_every_host_count_slices_the_same_global_stream():
  single = WindowOrder(COUNTS, 3, 16, seed=4, order="global", run_records=4)
  want = [single.indices(p) for p in range(2 * single.batches_per_epoch)]
  for hosts in (2, 4, 8):
    parts = [WindowOrder(COUNTS, 3, 16 // hosts, seed=4, order="global", run_records=4, shard_index=h,
                         shard_count=hosts) for h in range(hosts)]
    got = [np.concatenate([o.indices(p) for o in parts]) for p in range(len(want))]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_run_records_must_be_a_positive_integer():
  for bad in (0, -1, 2.5, "4"):
    with pytest.raises(ValueError, match="run_records must be an integer >= 1"):
      WindowOrder(COUNTS, 3, 4, run_records=bad)


def _same(a: dict, b: dict) -> bool:
  return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.gcs
def test_coalesced_record_reads_equal_local_across_4_2_8_hosts_through_faults(shards, gcs_faults, tmp_path,
                                                                             monkeypatch):
  gs = f"gs://{gcs_faults.bucket}/runs/raw"
  upload_tree(shards, gs)
  monkeypatch.setattr(gcs_media, "DEFAULT_TIMEOUT_S", 0.5)  # a stalled answer fails fast and is retried
  global_batch, epochs = 16, 2
  per_epoch = 120 // global_batch

  def make(root, cache):
    def one(h, hosts):
      return grain_loader.dataset(root, order="global", global_batch_size=global_batch, shard_index=h,
                                  shard_count=hosts, window_shards=3, run_records=4, num_epochs=epochs, seed=8,
                                  num_threads=2, cache_dir=str(tmp_path / cache))
    return one

  schedule = [(4, 3), (2, 5), (8, epochs * per_epoch - 8)]
  local = host_steps(make(shards, "local"), schedule)

  def faults():  # on the shards, not the manifest; in the last part, whose hosts read all they prefetch
    for mode, times in [("status", 3), ("drop", 2), ("cut", 2), ("stall_body", 2)]:
      gcs_faults.add_fault("runs/raw/gen-", mode=mode, times=times, stall_seconds=2.0)
  remote = host_steps(make(gs, "remote"), schedule, before_last=faults)
  assert not gcs_faults._faults, "the faults were never hit"
  assert len(remote) == len(local) == epochs * per_epoch
  for r, l in zip(remote, local):
    assert len(r) == len(l)
    assert all(_same(a, b) for a, b in zip(r, l))
  # and each step, whatever the host count, is the single-host step of the same global order
  single = list(make(shards, "single")(0, 1))
  for step, want in zip(local, single):
    got = {k: np.concatenate([b[k] for b in step]) for k in want}
    assert _same(got, want)
  seen = np.concatenate([b["record_index"] for b in single[:per_epoch]])
  assert len(np.unique(seen)) == len(seen) == per_epoch * global_batch


@pytest.mark.slow
@pytest.mark.gcs
def test_a_host_fetches_each_run_with_one_ranged_read(shards, gcs_emulator, tmp_path):
  from formats.outputs.output import open_output
  from loaders._stream import RecordStream
  from tests.loaders.test_stream import _runs_of

  gs = f"gs://{gcs_emulator}/runs/requests"
  upload_tree(shards, gs)
  info = load_manifest(shards).splits["train"].shards
  counts = [s.num_records for s in info]
  for run_records in (1, 4):
    order = WindowOrder(counts, 3, 8, seed=3, order="global", shard_index=0, shard_count=2,
                        run_records=run_records)
    stream = RecordStream(open_output(gs), "train", order, order.batches_per_epoch, cache_dir=str(tmp_path))
    want = [order.indices(p) for p in range(order.batches_per_epoch)]
    for p, indices in enumerate(want):
      with stream.batch(p) as got:
        assert np.array_equal(got, indices)
        assert all(len(stream.raw(int(i))) > 0 for i in got)
    touched = {int(np.searchsorted(order.starts, i, side="right")) - 1 for i in np.concatenate(want)}
    pieces = sum(_runs_of(order, b) for b in want)
    assert stream.requests == pieces + len(touched)  # one read per piece, one per shard's tail
    records = sum(len(b) for b in want)
    if run_records == 4:  # 8 records a batch in about 2 or 3 pieces, not 8
      assert pieces <= records / 2.5
    else:
      assert pieces >= records * 0.6
    stream.close()


def test_a_state_saved_with_other_order_settings_is_refused(shards):
  from loaders._pinning import StateMismatchError, UnverifiedStateWarning

  def make(**kw):
    return grain_loader.dataset(shards, batch_size=4, num_epochs=2, num_threads=1, **{"window_shards": 3, **kw})

  it = iter(make())
  next(it)
  state = json.loads(json.dumps(it.get_state()))
  assert state["order"] == {"order": "global", "shuffle": True, "seed": 0, "window_shards": 3, "run_records": 8,
                            "batch": 4, "drop_remainder": True}
  again = iter(make())
  again.set_state(state)  # the same settings: resumes
  assert _same(next(again), next(it))
  for other in ({"run_records": 1}, {"order": "host"}, {"window_shards": 2}, {"seed": 1}, {"window_shards": None}):
    with pytest.raises(StateMismatchError, match="saved with other order settings"):
      iter(make(**other)).set_state(state)
  old = {k: v for k, v in state.items() if k != "order"}  # saved before the settings were recorded
  with pytest.warns(UnverifiedStateWarning, match="without its order settings"):
    iter(make()).set_state(old)
