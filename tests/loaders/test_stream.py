"""Reading a split in windows of shards (loaders._stream): the order, and gs:// streaming through a bounded cache."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time

import grain
import numpy as np
import pytest

from formats import load_manifest
from loaders import CorruptRecordError
from loaders import grain as grain_loader
from loaders._stream import WindowOrder, _remove_stale
from tests.conftest import upload_tree
from tests.loaders import make_outputs

COUNTS = [5, 7, 3, 9, 4, 6, 8, 2, 7]


def _stream_shards(order: WindowOrder, epoch: int) -> list[int]:
  """The shard of each record of the epoch's stream, in stream order."""
  _, _, stream = order._epoch(epoch)
  return [int(np.searchsorted(order.starts, i, side="right")) - 1 for i in stream]


@pytest.mark.parametrize("shuffle", [True, False])
def test_window_order_reads_windows_one_after_the_other(shuffle):
  order = WindowOrder(COUNTS, 3, 4, seed=7, shuffle=shuffle)
  n = sum(COUNTS)
  assert order.batches_per_epoch == n // 4
  for epoch in (0, 1):
    shards = [int(s) for s in order.shards_of_epoch(epoch)]
    assert sorted(shards) == list(range(len(COUNTS)))
    of = _stream_shards(order, epoch)
    windows = [set(shards[w:w + 3]) for w in range(0, len(shards), 3)]
    bounds = np.cumsum([0] + [sum(COUNTS[s] for s in w) for w in windows])
    for w, window in enumerate(windows):  # window w's records, all of them, then window w+1's
      assert set(of[bounds[w]:bounds[w + 1]]) == window
    got = np.concatenate([order.indices(epoch * order.batches_per_epoch + k) for k in range(order.batches_per_epoch)])
    assert len(np.unique(got)) == len(got) == order.batches_per_epoch * 4
    for k in range(order.batches_per_epoch):  # each batch's records lie in the shards it reports
      p = epoch * order.batches_per_epoch + k
      recs = order.indices(p)
      assert {int(np.searchsorted(order.starts, i, side="right")) - 1 for i in recs} <= set(order.shards(p))
  e0, e1 = order.indices(0), order.indices(order.batches_per_epoch)
  assert (not np.array_equal(e0, e1)) == shuffle  # reshuffled each epoch
  again = WindowOrder(COUNTS, 3, 4, seed=7, shuffle=shuffle)
  assert all(np.array_equal(order.indices(p), again.indices(p)) for p in range(2 * order.batches_per_epoch))
  other = WindowOrder(COUNTS, 3, 4, seed=8, shuffle=shuffle)
  assert shuffle == any(not np.array_equal(order.indices(p), other.indices(p)) for p in range(order.batches_per_epoch))


def test_window_order_hosts():
  """order="host": host h reads only shards s with s % n == h, every host the same number of batches;
  order="global": the hosts' slices of a step are the single host's batch of that step."""
  n = 3
  hosts = [WindowOrder(COUNTS, 2, 2, seed=1, shard_index=h, shard_count=n) for h in range(n)]
  smallest = min(sum(COUNTS[h::n]) for h in range(n))
  assert {o.batches_per_epoch for o in hosts} == {smallest // 2}
  seen = []
  for h, o in enumerate(hosts):
    recs = np.concatenate([o.indices(k) for k in range(o.batches_per_epoch)])
    assert {int(np.searchsorted(o.starts, i, side="right")) - 1 for i in recs} <= set(range(h, len(COUNTS), n))
    seen.append(set(recs.tolist()))
  assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])
  single = WindowOrder(COUNTS, 2, 8, seed=1, order="global")
  for count in (2, 4, 8):
    parts = [WindowOrder(COUNTS, 2, 8 // count, seed=1, order="global", shard_index=h, shard_count=count)
             for h in range(count)]
    assert {p.batches_per_epoch for p in parts} == {single.batches_per_epoch}
    for step in range(2 * single.batches_per_epoch):
      assert np.array_equal(np.concatenate([p.indices(step) for p in parts]), single.indices(step))
  with pytest.raises(ValueError, match="window_shards must be >= 1"):
    WindowOrder(COUNTS, 0, 2)


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
  """120 raw 16x16 images in 12 shards (10 records, 128 KiB each), as image_folder --encoding=raw writes them
  (tests/loaders/make_outputs: no Beam)."""
  features, payloads = make_outputs.raw_images(np.random.default_rng(3), 120, (16, 16))
  return make_outputs.write(str(tmp_path_factory.mktemp("stream") / "raw"), features, {"train": payloads},
                            kind="image", num_shards=12)


def _batches(ds) -> list[dict]:
  return list(iter(ds))


def _equal(a: list[dict], b: list[dict]) -> bool:
  return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
                                  for x, y in zip(a, b))


class _DiskWatch:
  """Polls a folder's disk use (allocated blocks, and apparent sizes) in a thread; keeps the peaks."""

  def __init__(self, folder: str):
    self.folder, self.peak_blocks, self.peak_apparent, self.samples = folder, 0, 0, 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      blocks = apparent = 0
      for d, dirs, names in os.walk(self.folder):
        for name in names + dirs:
          try:
            st = os.stat(os.path.join(d, name))
          except FileNotFoundError:
            continue
          blocks += st.st_blocks * 512
          apparent += st.st_size
      self.peak_blocks, self.peak_apparent = max(self.peak_blocks, blocks), max(self.peak_apparent, apparent)
      self.samples += 1
      time.sleep(0.002)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


def test_local_window_order_is_complete_and_resumes(many_shards):
  ds = grain_loader.dataset(many_shards, batch_size=8, window_shards=3, num_epochs=2, seed=1)
  full = _batches(ds)
  assert len(full) == 2 * (120 // 8)
  for epoch in (full[:15], full[15:]):
    ids = np.concatenate([b["record_index"] for b in epoch])
    assert sorted(ids.tolist()) == list(range(120))
  it = iter(ds)
  head = [next(it) for _ in range(11)]
  state = json.loads(json.dumps(it.get_state()))
  it2 = iter(grain_loader.dataset(many_shards, batch_size=8, window_shards=3, num_epochs=2, seed=1))
  it2.set_state(state)
  assert _equal(head + list(it2), full)


@pytest.mark.gcs
def test_streamed_gcs_equals_local_and_never_exceeds_the_limit(many_shards, gcs_emulator, tmp_path):
  """A split of 12 shards (1.6 MB) streamed through a cache of 5 shards: the batches of the local output in
  the same window order, the disk never above the limit, every shard fetched again each epoch, and the
  private folder gone once the loader is."""
  gs = f"gs://{gcs_emulator}/stream/raw"
  upload_tree(many_shards, gs)
  shard_bytes = load_manifest(many_shards).splits["train"].shards[0].num_bytes
  limit = 4096 + 5 * (shard_bytes + 3 * 4096)
  kw = {"batch_size": 8, "window_shards": 2, "num_epochs": 2, "seed": 3, "num_threads": 4, "prefetch_buffer_size": 4}
  local = _batches(grain_loader.dataset(many_shards, **kw))
  cache = tmp_path / "cache"
  ds = grain_loader.map_dataset(gs, cache_dir=str(cache), cache_limit_bytes=limit, **{
      k: v for k, v in kw.items() if k not in ("num_threads", "prefetch_buffer_size")})
  with _DiskWatch(str(cache)) as watch:
    remote = _batches(ds.to_iter_dataset(grain.ReadOptions(num_threads=4, prefetch_buffer_size=4)))
  assert _equal(remote, local)
  assert watch.samples > 10 and 0 < watch.peak_apparent <= limit and watch.peak_blocks <= limit
  del ds, remote
  gc.collect()
  time.sleep(1.5)  # the fetcher thread notices the stream is gone
  assert not [f for _, _, fs in os.walk(cache) for f in fs], "the private folder outlived the loader"


@pytest.mark.gcs
def test_streamed_stats_and_limits(many_shards, gcs_emulator, tmp_path):
  from formats.outputs.output import open_output
  from loaders._stream import ShardStream

  gs = f"gs://{gcs_emulator}/stream/raw_stats"
  upload_tree(many_shards, gs)
  output = open_output(gs)
  info = output.shards("train")
  order = WindowOrder([s.num_records for s in info], 2, 8, seed=0)
  limit = 4096 + 5 * (info[0].num_bytes + 3 * 4096)
  stream = ShardStream(output, "train", order, 2 * order.batches_per_epoch, cache_dir=str(tmp_path / "c"),
                       cache_limit_bytes=limit)
  for p in range(2 * order.batches_per_epoch):
    with stream.batch(p) as indices:
      assert len({stream.raw(int(i)) for i in indices}) == len(indices)
  assert stream.peak_bytes <= limit
  total = sum(s.num_bytes for s in info)
  assert stream.bytes_fetched >= 2 * total - limit  # a cache smaller than the split: every epoch fetches again
  stream.close()
  assert not [f for _, _, fs in os.walk(tmp_path / "c") for f in fs]
  with pytest.raises(ValueError, match=r"cannot hold 2 windows of 3 shard\(s\).*raise cache_limit_bytes, or "
                                       r"lower window_shards or batch_size"):
    grain_loader.dataset(gs, batch_size=8, window_shards=3, cache_limit_bytes=limit, cache_dir=str(tmp_path / "c"))
  with pytest.raises(ValueError, match="random access needs all of it on local disk; pass window_shards=N"):
    grain_loader.dataset(gs, batch_size=8, cache_limit_bytes=limit, cache_dir=str(tmp_path / "c"))
  with pytest.raises(ValueError, match="cache_limit_bytes must be >= 1"):
    grain_loader.dataset(gs, batch_size=8, window_shards=1, cache_limit_bytes=0)


@pytest.mark.gcs
def test_faults_change_nothing_in_the_batches(many_shards, gcs_faults, tmp_path):
  """503s and dropped connections on the shards' reads: retried, and the batches are those of a clean run."""
  gs = f"gs://{gcs_faults.bucket}/stream/raw_faults"
  upload_tree(many_shards, gs)
  kw = {"batch_size": 8, "window_shards": 2, "num_epochs": 1, "seed": 5, "num_threads": 2,
        "cache_limit_bytes": 4096 + 6 * (load_manifest(many_shards).splits["train"].shards[0].num_bytes + 3 * 4096)}
  clean = _batches(grain_loader.dataset(gs, cache_dir=str(tmp_path / "clean"), **kw))
  for shard in [s.path for s in load_manifest(many_shards).splits["train"].shards[2::3]]:
    gcs_faults.add_fault(f"raw_faults/{shard}", status=503, times=2)
    gcs_faults.add_fault(f"raw_faults/{shard}", mode="drop", times=1)
  before = gcs_faults.requests_seen("raw_faults")
  faulty = _batches(grain_loader.dataset(gs, cache_dir=str(tmp_path / "faulty"), **kw))
  assert _equal(faulty, clean)
  assert not gcs_faults._faults, "a fault was never hit: the test did not exercise the retries"
  assert gcs_faults.requests_seen("raw_faults") > before


def _uploaded_with_a_flipped_byte(output: str, gs: str, k: int, offset: int, mask: int) -> str:
  """`output` uploaded to `gs`, shard k's byte at `offset` xor `mask` there (same size); returns the shard's path."""
  from formats.storage import files

  upload_tree(output, gs)
  shard = load_manifest(output).splits["train"].shards[k].path
  data = bytearray(files.read_bytes(f"{gs}/{shard}"))
  data[offset] ^= mask
  files.write_bytes(f"{gs}/{shard}", bytes(data))
  return shard


@pytest.mark.gcs
def test_a_changed_shard_is_named(many_shards, gcs_emulator, tmp_path):
  """A shard whose bytes differ from the manifest (same size) is refused while it streams, naming it."""
  gs = f"gs://{gcs_emulator}/stream/raw_changed"
  shard = _uploaded_with_a_flipped_byte(many_shards, gs, 4, 200, 0xFF)
  ds = grain_loader.dataset(gs, batch_size=8, window_shards=2, seed=0, cache_dir=str(tmp_path / "c"),
                            cache_limit_bytes=1 << 22, num_threads=1)
  with pytest.raises(CorruptRecordError, match=rf"{shard}: sha256 .* differs from the manifest"):
    _batches(ds)


_HOLD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from loaders._stream import _private_folder
class Owner: pass
owner = Owner()
folder, _ = _private_folder(owner, sys.argv[2])
open(folder + "/000001-train.array_record", "wb").write(b"x" * 10)
print(folder, flush=True)
if sys.argv[3] == "hold":
  time.sleep(60)
else:
  import os; os._exit(0)  # killed: no finalizer runs
"""


@pytest.mark.slow  # subprocesses (a killed stream, a live one)
def test_stale_private_folders_are_removed_and_live_ones_kept(tmp_path):
  """A folder whose stream died (process killed: no clean-up ran) is removed by the next stream; one whose owner
  still holds its lock is kept, whatever its pid says; names this module did not make are never touched."""
  from tests.conftest import REPO

  root = str(tmp_path / "stream")
  dead = subprocess.run([sys.executable, "-c", _HOLD, REPO, root, "die"], capture_output=True, text=True,
                        check=True).stdout.strip()
  assert os.path.isdir(dead) and os.listdir(dead)
  holder = subprocess.Popen([sys.executable, "-c", _HOLD, REPO, root, "hold"], stdout=subprocess.PIPE, text=True)
  try:
    live = holder.stdout.readline().strip()
    others = [tmp_path / "stream" / n for n in ("1234567890123456", "4242", "stream-12-notours")]
    for o in others:
      o.mkdir()
    _remove_stale(root)  # (the holder's own stream already ran it when it started)
    assert not os.path.exists(dead), "a dead stream's folder stayed"
    assert os.path.isdir(live) and os.listdir(live), "a live stream's folder was removed"
    assert all(o.is_dir() for o in others)
  finally:
    holder.kill()
    holder.wait()
  _remove_stale(root)
  assert not os.path.exists(live)  # its owner is gone now


def test_a_dead_folder_with_this_process_pid_is_removed_and_this_process_live_ones_kept(tmp_path):
  """A restarted container's process often has the killed one's pid: its folders were skipped as this process's
  own, and every restart after a kill left up to cache_limit_bytes behind. Folders of this process's live streams
  are kept by their locks; one being made is not under the name that is cleaned."""
  import uuid

  from loaders._stream import _private_folder

  root = str(tmp_path / "stream")
  os.makedirs(root)
  dead = os.path.join(root, f"stream-{os.getpid()}-{uuid.uuid4().hex[:12]}")
  os.makedirs(dead)
  open(os.path.join(dead, ".owner.lock"), "w").close()
  open(os.path.join(dead, "000001-train.array_record"), "wb").write(b"x" * 10)
  half_made = os.path.join(root, f"stream-{os.getpid()}-{uuid.uuid4().hex[:12]}.new")
  os.makedirs(half_made)

  class Owner:
    pass
  owner = Owner()
  live, _ = _private_folder(owner, root)  # runs _remove_stale first
  assert not os.path.exists(dead), "a dead folder with this pid stayed"
  assert os.path.isdir(half_made)
  _remove_stale(root)
  assert os.path.isdir(live), "this process's live stream's folder was removed"
  del owner
  assert not os.path.exists(live)


@pytest.mark.parametrize("where", ["local", pytest.param("gcs", marks=pytest.mark.gcs)])
def test_global_window_order_resumes_across_4_then_2_then_8_hosts(many_shards, where, request, tmp_path):
  """Every global step of a run on 4, then 2, then 8 hosts (each resuming from the state the last saved) is the
  step of one uninterrupted host reading the local output; on gs:// each host fetches its own records."""
  from tests.loaders.test_loaders import _global_steps

  path = many_shards
  if where == "gcs":
    path = f"gs://{request.getfixturevalue('gcs_emulator')}/stream/raw_elastic"
    upload_tree(many_shards, path)

  def make(h, hosts, path=path):
    return grain_loader.dataset(path, order="global", global_batch_size=8, shard_index=h, shard_count=hosts,
                                num_epochs=2, seed=4, num_threads=1, window_shards=3, cache_dir=str(tmp_path))

  single = _batches(make(0, 1, many_shards))
  total = len(single)
  got = _global_steps(make, [(4, 3), (2, total // 2 - 3), (8, total - total // 2)])
  assert _equal(got, single)


_XLA_STREAM = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from loaders import xla
assert "tensorflow" not in sys.modules
kw = dict(batch_size=8, seed=2, num_threads=2, window_shards=2, cache_limit_bytes=int(sys.argv[3]),
          cache_dir=sys.argv[4], num_epochs=2)
ids, devices = [], set()
for batch in xla.device_loader(sys.argv[2], **kw):
  devices.add(str(batch["image"].device))
  ids.append(batch["record_index"].cpu().tolist())
first = xla.device_loader(sys.argv[2], **kw)
it = iter(first)
head = [next(it)["record_index"].cpu().tolist() for _ in range(5)]
resumed = [b["record_index"].cpu().tolist() for b in xla.device_loader(sys.argv[2], state=first.get_state(), **kw)]
print(json.dumps({"ids": ids, "devices": sorted(devices), "head": head, "resumed": resumed}))
"""


@pytest.mark.gcs
def test_xla_device_loader_streams_from_gcs(many_shards, gcs_emulator, tmp_path):
  """torch_xla on an XLA CPU device, streaming a gs:// split through a cache of 5 shards: the batches of the
  local window order, and a state saved mid-epoch resumes exactly."""
  from tests.conftest import REPO

  gs = f"gs://{gcs_emulator}/stream/raw_xla"
  upload_tree(many_shards, gs)
  limit = 4096 + 5 * (load_manifest(many_shards).splits["train"].shards[0].num_bytes + 3 * 4096)
  want = [b["record_index"].tolist() for b in _batches(grain_loader.dataset(
      many_shards, batch_size=8, seed=2, window_shards=2, num_epochs=2))]
  env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
  r = subprocess.run([sys.executable, "-c", _XLA_STREAM, REPO, gs, str(limit), str(tmp_path / "cache")],
                     capture_output=True, text=True, env=env, timeout=600, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert got["ids"] == want and all(d.startswith("xla") for d in got["devices"])
  assert got["head"] + got["resumed"] == want


@pytest.mark.gcs
def test_a_fetcher_failure_reaches_the_reader_instead_of_a_hang(many_shards, gcs_emulator, tmp_path, monkeypatch):
  from loaders._stream import ShardStream

  gs = f"gs://{gcs_emulator}/stream/raw_fatal"
  upload_tree(many_shards, gs)

  def broken(self):
    raise KeyError("a bug in the plan")
  monkeypatch.setattr(ShardStream, "_next_fetch", broken)
  ds = grain_loader.dataset(gs, batch_size=8, window_shards=2, cache_dir=str(tmp_path / "c"),
                            cache_limit_bytes=1 << 22, num_threads=1)
  with pytest.raises(RuntimeError, match="the shard fetcher stopped: KeyError: 'a bug in the plan'"):
    _batches(ds)


def test_open_files_stay_bounded_whatever_the_shard_count(tmp_path, monkeypatch):
  """A local output is never evicted: readers stay open only for the shards of the batches being read and the
  most recently read ones, at most one per reading thread on each.

  Every reader the stream opens is counted, exactly, as it opens and closes (at the adapter, for this test's own
  output): a sample of /proc/self/fd taken between batches misses the readers of the batches in flight, and
  may count a descriptor number another file took over."""
  from formats import adapters
  from loaders import _stream

  monkeypatch.setattr(_stream, "_OPEN_SHARDS", 2)  # 4 windows' worth stay open: 4 shards of windows of 1
  features, payloads = make_outputs.raw_images(np.random.default_rng(3), 120, (16, 16))
  out = make_outputs.write(str(tmp_path / "raw"), features, {"train": payloads}, kind="image", num_shards=12)
  lock = threading.Lock()
  open_readers: dict[str, int] = {}  # shard -> its readers open now
  peak = {"shards": 0, "per_shard": 0}
  cls = type(adapters.get("array_record"))
  real_open = cls.open_random

  class Counted:
    def __init__(self, reader, path: str):
      self._reader, self._path, self._open = reader, path, True
      with lock:
        open_readers[path] = open_readers.get(path, 0) + 1
        peak["shards"] = max(peak["shards"], sum(1 for n in open_readers.values() if n))
        peak["per_shard"] = max(peak["per_shard"], open_readers[path])

    def __len__(self) -> int:
      return len(self._reader)

    def read(self, i: int) -> bytes:
      return self._reader.read(i)

    def close(self) -> None:
      with lock:
        if self._open:
          open_readers[self._path] -= 1
        self._open = False
      self._reader.close()

  monkeypatch.setattr(cls, "open_random", lambda self, path: Counted(real_open(self, path), path))
  for batch in grain_loader.dataset(out, batch_size=8, window_shards=1, num_epochs=2, seed=0,
                                    num_threads=2, prefetch_buffer_size=2):
    assert batch["image"].shape == (8, 16, 16, 3)
  # 12 shards read twice; open at once: the 4 most recently read, and those of the 2 threads' batches (a batch
  # of 8 records reads windows of 1 shard of 10 records: 2 at most)
  assert 1 <= peak["shards"] <= 4 + 2 * 2
  assert peak["per_shard"] <= 2  # a reader per thread reading the shard


@pytest.mark.gcs
def test_records_fetch_reads_each_hosts_share_only(many_shards, gcs_faults, tmp_path):
  """order="global" on 3 hosts fetches each host's own records by ranged reads (fetch="auto"): the batches of
  the local output, all hosts together about one pass over the split (not three), every chunk verified;
  503s and dropped connections change nothing."""
  from formats.outputs.output import open_output
  from loaders._stream import RecordStream

  gs = f"gs://{gcs_faults.bucket}/stream/raw_records"
  upload_tree(many_shards, gs)
  kw = {"batch_size": 4, "window_shards": 3, "num_epochs": 2, "seed": 6, "order": "global", "shard_count": 3,
        "num_threads": 2}
  for h in range(3):
    local = _batches(grain_loader.dataset(many_shards, shard_index=h, **kw))
    remote = _batches(grain_loader.dataset(gs, shard_index=h, cache_dir=str(tmp_path / "c"), **kw))
    assert _equal(remote, local) and len(local) == 2 * (120 // 12)
  info = load_manifest(many_shards).splits["train"].shards
  fetched = 0
  gcs_faults.add_fault("raw_records/gen-", status=503, times=4)  # the shards' objects, not the manifest
  gcs_faults.add_fault("raw_records/gen-", mode="drop", times=2)
  for h in range(3):
    order = WindowOrder([s.num_records for s in info], 3, 4, seed=6, order="global", shard_index=h, shard_count=3)
    stream = RecordStream(open_output(gs), "train", order, order.batches_per_epoch, cache_dir=str(tmp_path / "r"))
    want = [order.indices(p) for p in range(order.batches_per_epoch)]
    for p, indices in enumerate(want):
      with stream.batch(p) as got:
        assert np.array_equal(got, indices)
        for i in got:
          assert stream.raw(int(i)) == _local_record(many_shards, int(i))
    fetched += stream.bytes_fetched
    touched = {int(np.searchsorted(order.starts, i, side="right")) - 1 for i in np.concatenate(want)}
    # a read per run of neighbours in one shard (a piece), a tail per shard
    assert stream.requests == sum(_runs_of(order, b) for b in want) + len(touched)
    stream.close()
  assert not gcs_faults._faults, "the faults were never hit"
  records_bytes = sum(s.num_bytes for s in info)
  assert fetched < 0.2 * records_bytes  # 120 records of ~800 B in 1.6 MB of shards: only the chunks asked for


@pytest.mark.gcs
def test_records_fetch_holds_no_more_than_its_limit_with_threads_asking_ahead(many_shards, gcs_emulator, tmp_path):
  """Each thread's batch started whatever was held: 4 threads asking for 4 batches held 4 batches' records
  against a limit of one. A batch now waits for room unless it is the lowest being read."""
  from formats.outputs.output import open_output
  from loaders._stream import RecordStream

  gs = f"gs://{gcs_emulator}/stream/records_limit"
  upload_tree(many_shards, gs)
  info = load_manifest(many_shards).splits["train"].shards
  order = WindowOrder([s.num_records for s in info], 3, 4, seed=6, order="global", shard_index=0, shard_count=2)
  stream = RecordStream(open_output(gs), "train", order, order.batches_per_epoch, cache_dir=str(tmp_path), ahead=4)
  one_batch = max(stream._estimate(order.indices(p)) for p in range(order.batches_per_epoch))
  stream.limit = one_batch  # room for one batch: every other waits its turn
  positions, lock, got = iter(range(order.batches_per_epoch)), threading.Lock(), {}

  def read():
    while True:
      with lock:
        p = next(positions, None)
      if p is None:
        return
      with stream.batch(p) as indices:
        got[p] = [stream.raw(int(i)) for i in indices]
        time.sleep(0.01)  # the others ask meanwhile

  threads = [threading.Thread(target=read) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert sorted(got) == list(range(order.batches_per_epoch))
  assert all(got[p] == [_local_record(many_shards, int(i)) for i in order.indices(p)] for p in got)
  assert stream.peak_bytes <= stream.limit + one_batch  # the lowest batch may start beside one held
  stream.close()


def _runs_of(order: WindowOrder, indices) -> int:
  """How many runs of consecutive records of one shard a batch's records make."""
  runs, last = 0, None
  for i in sorted(int(i) for i in indices):
    shard = int(np.searchsorted(order.starts, i, side="right")) - 1
    if last is None or i != last[0] + 1 or shard != last[1]:
      runs += 1
    last = (i, shard)
  return runs


def _local_record(output: str, index: int) -> bytes:
  from loaders import ShardedRecords

  return ShardedRecords(output).raw(index)


@pytest.mark.gcs
def test_records_fetch_names_a_damaged_chunk(many_shards, gcs_emulator, tmp_path):
  gs = f"gs://{gcs_emulator}/stream/raw_records_bad"
  shard = _uploaded_with_a_flipped_byte(many_shards, gs, 7, 3000, 0x01)  # inside a record's chunk, far from the tail
  ds = grain_loader.dataset(gs, batch_size=4, window_shards=2, seed=0, cache_dir=str(tmp_path / "c"),
                            order="global", shard_count=2, num_threads=1)
  with pytest.raises(CorruptRecordError, match=rf"{shard}: record \d+ \(chunk bytes \[\d+, \d+\)\)"):
    _batches(ds)
  with pytest.raises(ValueError, match="fetch must be one of"):
    grain_loader.dataset(gs, batch_size=4, window_shards=2, fetch="ranges")


@pytest.mark.gcs
def test_a_second_pass_and_a_jump_back_fetch_each_shard_once_more(many_shards, gcs_emulator, tmp_path):
  """Between batches nothing is being read (the loader waits for the training step); the plan starts from the
  batch after the one last asked for, so a second pass over the same stream, or a set_state backwards, fetches
  each shard once more, not once per batch."""
  from formats.outputs.output import open_output
  from loaders._stream import ShardStream

  gs = f"gs://{gcs_emulator}/stream/raw_again"
  upload_tree(many_shards, gs)
  output = open_output(gs)
  info = output.shards("train")
  order = WindowOrder([s.num_records for s in info], 2, 8, seed=0)
  n = order.batches_per_epoch
  stream = ShardStream(output, "train", order, n, cache_dir=str(tmp_path), cache_limit_bytes=4096 + 5 * (
      info[0].num_bytes + 3 * 4096))
  total = sum(s.num_bytes for s in info)

  def read(positions):
    before = stream.bytes_fetched
    for p in positions:
      with stream.batch(p) as indices:
        for i in indices:
          stream.raw(int(i))
      time.sleep(0.05)  # the training step: nothing in flight
    return stream.bytes_fetched - before

  assert read(range(n)) == total
  assert read(range(n)) <= total  # was 6x: every batch fetched its window again
  assert read(range(5, n)) + read(range(2, n)) <= 2 * total
  stream.close()


@pytest.mark.gcs
def test_a_record_stream_nobody_uses_is_collected(many_shards, gcs_emulator, tmp_path):
  """Its prefetcher and reader threads end and its private folder goes when the loader is dropped."""
  gs = f"gs://{gcs_emulator}/stream/raw_gc"
  upload_tree(many_shards, gs)
  threads = {t.name for t in threading.enumerate()}
  ds = grain_loader.dataset(gs, batch_size=4, window_shards=2, order="global", shard_count=2, num_threads=2,
                            cache_dir=str(tmp_path))
  it = iter(ds)
  next(it)
  assert any(t.name.startswith("record-stream") for t in threading.enumerate())
  del ds, it
  for _ in range(40):
    gc.collect()
    time.sleep(0.1)
    alive = [t.name for t in threading.enumerate() if t.name not in threads and t.name.startswith("record-stream")]
    if not alive and not [f for _, _, fs in os.walk(tmp_path) for f in fs]:
      break
  assert not alive, f"threads outlived the loader: {alive}"
  assert not [f for _, _, fs in os.walk(tmp_path) for f in fs], "the private folder outlived the loader"


def _wait_for(condition, seconds: float = 20.0) -> None:
  deadline = time.monotonic() + seconds
  while not condition():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.02)


@pytest.mark.gcs
def test_a_record_read_ahead_that_gave_up_is_read_again_for_its_batch(many_shards, gcs_emulator, tmp_path,
                                                                      monkeypatch):
  """One level of retries: a piece read ahead whose retry policy gave up (an outage while it was prefetched)
  is read once more when its batch is asked for; a read that gives up while its batch waits is raised, and
  the next ask of that batch reads it again."""
  from formats.outputs.output import open_output
  from formats.storage import retry
  from loaders._stream import RecordStream

  gs = f"gs://{gcs_emulator}/stream/raw_retry"
  upload_tree(many_shards, gs)
  info = load_manifest(many_shards).splits["train"].shards
  order = WindowOrder([s.num_records for s in info], 2, 4, seed=1, order="global", shard_count=2)
  real, outage = RecordStream._fetch_piece, threading.Event()

  def flaky(self, piece):
    if outage.is_set():
      raise retry.RetryExhausted(f"shard {piece.k}: an outage")
    return real(self, piece)
  monkeypatch.setattr(RecordStream, "_fetch_piece", flaky)
  stream = RecordStream(open_output(gs), "train", order, order.batches_per_epoch, cache_dir=str(tmp_path), ahead=2)
  outage.set()
  with stream.batch(0) as indices:
    with pytest.raises(retry.RetryExhausted, match="an outage"):
      stream.raw(int(indices[0]))
  _wait_for(lambda: 1 in stream._started and all(f.done() for f in stream._started[1].values()))
  outage.clear()
  for p in (1, 0):  # read ahead and gave up: read again; asked again after its error: read again
    with stream.batch(p) as indices:
      assert [stream.raw(int(i)) for i in indices] == [_local_record(many_shards, int(i)) for i in indices]
  stream.close()


@pytest.mark.gcs
def test_a_shard_fetched_ahead_that_gave_up_is_fetched_again_for_its_batch(many_shards, gcs_emulator, tmp_path,
                                                                          monkeypatch):
  """As for record reads: a shard download that gave up before its batch was asked for is fetched once more
  for it; one that gives up while a batch waits is raised to that batch."""
  from formats.outputs.output import open_output
  from formats.storage import retry
  from loaders import _stream

  gs = f"gs://{gcs_emulator}/stream/raw_shard_retry"
  upload_tree(many_shards, gs)
  info = load_manifest(many_shards).splits["train"].shards
  order = WindowOrder([s.num_records for s in info], 2, 4, seed=2)
  real, outage, calls = _stream.download, threading.Event(), []

  def flaky(obj, dest, *a, **k):
    calls.append(obj.path)
    if outage.is_set():
      raise retry.RetryExhausted(f"{obj.path}: an outage")
    return real(obj, dest, *a, **k)
  monkeypatch.setattr(_stream, "download", flaky)
  stream = _stream.ShardStream(open_output(gs), "train", order, order.batches_per_epoch, cache_dir=str(tmp_path))
  outage.set()
  with pytest.raises(retry.RetryExhausted, match="an outage"):
    with stream.batch(0):
      pass
  later = next(p for p in range(order.batches_per_epoch) if not set(order.shards(p)) & set(order.shards(0)))
  wanted = set(order.shards(later))
  _wait_for(lambda: all(stream._entries.get(k) is not None and stream._entries[k].error is not None
                        for k in wanted))
  outage.clear()
  with stream.batch(later) as indices:
    assert [stream.raw(int(i)) for i in indices] == [_local_record(many_shards, int(i)) for i in indices]
  assert all(calls.count(stream.where_shard(k)) >= 2 for k in wanted)  # failed ahead, then fetched for the batch
  stream.close()


def test_a_batch_that_spans_more_than_two_windows_is_refused_up_front(many_shards, tmp_path):
  from formats.outputs.output import open_output
  from loaders._stream import ShardStream

  output = open_output(many_shards)
  object.__setattr__(output, "path", "gs://bucket/raw")  # only the limit check runs; nothing is fetched
  info = output.shards("train")
  order = WindowOrder([s.num_records for s in info], 1, 32, seed=0)  # 10 records per window, 32 per batch
  with pytest.raises(ValueError, match=r"cannot hold 5 windows of 1 shard\(s\).*one batch of 32 records.*"
                                       r"or lower window_shards or batch_size"):
    ShardStream(output, "train", order, order.batches_per_epoch, cache_dir=str(tmp_path),
                cache_limit_bytes=3 * (info[0].num_bytes + 4 * 4096))


def test_the_global_order_is_drawn_once_per_epoch(many_shards, monkeypatch):
  """Random access with order="global" permutes the whole split once per epoch, not once per batch (at
  ImageNet size a permutation of 1.28 M records per batch)."""
  from loaders import grain as g

  calls = []
  real = np.random.default_rng

  def counting(seed=None):
    if isinstance(seed, list) and len(seed) == 3 and seed[2] == 0x610BA1:
      calls.append(seed[1])
    return real(seed)
  monkeypatch.setattr(g.np.random, "default_rng", counting)
  batches = _batches(grain_loader.dataset(many_shards, batch_size=4, order="global", shard_count=2, num_epochs=2,
                                          num_threads=1))
  assert len(batches) == 2 * (120 // 8) and sorted(set(calls)) == [0, 1] and len(calls) == 2
