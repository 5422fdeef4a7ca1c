"""CT volumes with masks: every loader cuts the label patch at the image patch's start, and label-aware sampling.

The specification (formats.transforms: sampled_patch_start, centred_patch_start, foreground_voxel) is checked
on its own; then grain and tf.data on committed outputs of make_outputs.labelled_volumes, whose volumes encode
their labels (LABEL_HU_STEP * code), so a batch's label patch can be checked against its image patch pixel for
pixel as well as against the record's label cut at `patch_start`. torch_xla's host batches equal grain's
(test_parity.py); resume and 4 -> 2 -> 8 hosts are grain's (torch_xla's loader reads through it).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from formats.errors import CorruptRecordError
from formats.features import Features, Tensor
from formats.transforms import (label_patch_dtype, centred_patch_start, element_rng, foreground_counts,
                                foreground_voxel, label_layout, random_patch_start, sampled_patch_start)
from loaders import ExampleOptions, ShardedRecords, grain as grain_loader, tfdata
from tests.loaders import make_outputs
from tests.loaders.elastic import host_steps

PATCH = (6, 16, 16)
N = 12


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[tuple[str, str], str]:
  """(layout, file format) → an output of N labelled volumes, some smaller than PATCH along an axis (padding),
  every fourth without foreground; and ("plain", fmt): volumes without labels."""
  base = tmp_path_factory.mktemp("labels")
  out = {}
  for layout in ("classes", "channels"):
    features, payloads = make_outputs.labelled_volumes(np.random.default_rng(7), N, layout, depth=(4, 12),
                                                       side=(10, 30))
    for fmt in ("array_record", "tfrecord"):
      out[layout, fmt] = make_outputs.write(str(base / f"{layout}_{fmt}"), features, {"train": payloads},
                                            kind="volume", file_format=fmt, num_shards=2)
  features, payloads = make_outputs.volumes(np.random.default_rng(8), 8, depth=(4, 12), side=(10, 30))
  out["plain", "array_record"] = make_outputs.write(str(base / "plain"), features, {"train": payloads},
                                                    kind="volume", num_shards=1)
  return out


# --------------------------------------------------------------------------- the specification


def _labels(rng: np.random.Generator, shape, layout: str, density: float) -> np.ndarray:
  """A random label: each voxel (or channel) foreground with probability `density`, classes 1..3."""
  if layout == "channels":
    return (rng.random((*shape, 3)) < density).astype(np.uint8)
  return np.where(rng.random(shape) < density, rng.integers(1, 4, shape), 0).astype(np.uint8)


@pytest.mark.parametrize("layout", ["classes", "channels"])
def test_foreground_voxel_is_the_kth_foreground_voxel_in_c_order(layout):
  rng = np.random.default_rng(0)
  for _ in range(5):
    shape = tuple(int(v) for v in rng.integers(1, 9, 3))
    label = _labels(rng, shape, layout, 0.2)
    fg = label if layout == "classes" else label.any(axis=-1)
    want = np.argwhere(fg)
    counts = foreground_counts(label)
    assert counts.tolist() == [int(np.count_nonzero(fg[z])) for z in range(shape[0])]
    got = [foreground_voxel(label, counts, k).tolist() for k in range(len(want))]
    assert got == want.tolist()


def test_centred_patch_start_holds_its_centre_inside_the_volume():
  rng = np.random.default_rng(1)
  for _ in range(300):
    shape = rng.integers(1, 20, 3)
    patch = rng.integers(1, 20, 3)
    centre = np.array([rng.integers(0, s) for s in shape])
    start = centred_patch_start(centre, shape, patch)
    assert start.dtype == np.int64
    assert np.all(start >= 0)
    assert np.all(start <= np.maximum(shape - patch, 0))
    assert np.all((start <= centre) & (centre < start + patch))
    inside = (centre - patch // 2 >= 0) & (centre - patch // 2 <= shape - patch)
    assert np.array_equal(start[inside], (centre - patch // 2)[inside])  # unclipped: patch // 2 before the centre


def test_no_pos_fraction_and_pos_fraction_zero_are_the_plain_uniform_draw():
  label = _labels(np.random.default_rng(2), (9, 12, 14), "classes", 0.05)
  for position in range(40):
    want = random_patch_start(label.shape, PATCH, element_rng(5, position, 1))
    for p in (None, 0.0):
      got = sampled_patch_start(label.shape, PATCH, element_rng(5, position, 1), p, label)
      assert got.tolist() == want.tolist()


@pytest.mark.parametrize("layout", ["classes", "channels"])
def test_pos_fraction_one_always_centres_on_foreground(layout):
  shape = (10, 30, 30)
  label = np.zeros((*shape, 3) if layout == "channels" else shape, np.uint8)
  label[(7, 25, 2, 1) if layout == "channels" else (7, 25, 2)] = 1  # one foreground voxel, near an edge
  for position in range(30):
    start = sampled_patch_start(shape, PATCH, element_rng(0, position, 0), 1.0, label)
    assert all(s <= c < s + p for s, c, p in zip(start, (7, 25, 2), PATCH)), start
  empty = np.zeros_like(label)  # no foreground: the uniform start
  for position in range(10):
    got = sampled_patch_start(shape, PATCH, element_rng(0, position, 0), 1.0, empty)
    assert got.tolist() == random_patch_start(shape, PATCH, element_rng(0, position, 0)).tolist()


def test_the_foreground_rate_rises_with_pos_fraction():
  """Seeded draws on a label with one small blob: the share of patches holding foreground is the uniform
  share r0 at p=0 and p + (1 - p) * r0 (within sampling error of 2000 draws) above it."""
  shape = (24, 48, 48)
  label = np.zeros(shape, np.uint8)
  label[3:5, 40:43, 6:8] = 2

  def rate(p):
    hits = 0
    for position in range(2000):
      s = sampled_patch_start(shape, PATCH, element_rng(11, position, 0), p, label)
      hits += bool(label[s[0]:s[0] + PATCH[0], s[1]:s[1] + PATCH[1], s[2]:s[2] + PATCH[2]].any())
    return hits / 2000

  rates = {p: rate(p) for p in (0.0, 0.25, 0.5, 0.75, 1.0)}
  r0 = rates[0.0]
  assert 0.0 < r0 < 0.1  # a small blob: a uniform patch rarely holds it
  assert rates[1.0] == 1.0
  for p, r in rates.items():
    assert abs(r - (p + (1 - p) * r0)) < 0.04, rates
  assert list(rates.values()) == sorted(rates.values())


def test_options_refuse_a_bad_pos_fraction():
  for bad in (-0.1, 1.5, float("nan"), True):
    with pytest.raises(ValueError, match="pos_fraction must be a probability"):
      ExampleOptions(patch_size=PATCH, pos_fraction=bad)
  with pytest.raises(ValueError, match="needs patch='random'"):
    ExampleOptions(patch_size=PATCH, patch="center", pos_fraction=0.5)
  assert ExampleOptions(patch_size=PATCH, pos_fraction=1).pos_fraction == 1


def test_label_layouts_are_checked():
  assert label_layout("label", Tensor((None, None, None), "uint16")) == "classes"
  assert label_layout("label", Tensor((None, None, None, 4), "uint8")) == "channels"
  for spec, why in ((Tensor((None, None), "uint8"), "must be a Tensor"), (Tensor((None,) * 3, "float32"), "uint8 or"),
                    (Tensor((None,) * 4, "uint8"), "channel count"), (Tensor((None,) * 3 + (2,), "uint16"), "uint8")):
    with pytest.raises(ValueError, match=why):
      label_layout("label", spec)


# --------------------------------------------------------------------------- the loaders


def _grain(path, **opts) -> list[dict]:
  return list(grain_loader.dataset(path, shuffle=False, num_threads=2, patch_size=PATCH, normalize=False, **opts))


def _tfdata(path, **opts) -> list[dict]:
  return list(tfdata.dataset(path, shuffle=False, patch_size=PATCH, normalize=False, **opts).as_numpy_iterator())


def _cut(array: np.ndarray, start, fill) -> np.ndarray:
  """The reference: the patch of `array` at `start`, `fill` past the far end."""
  part = array[tuple(slice(int(s), int(s) + p) for s, p in zip(start, PATCH))]
  out = np.full((*PATCH, *array.shape[3:]), fill, array.dtype)
  out[tuple(slice(0, n) for n in part.shape)] = part
  return out


def _check_batches(batches: list[dict], records: ShardedRecords, layout: str) -> dict[str, int]:
  """Every example's label patch is its record's label at patch_start and the label its image patch encodes.
  Returns how many examples were padded and how many held foreground."""
  seen = {"padded": 0, "foreground": 0, "examples": 0}
  channels = (3,) if layout == "channels" else ()
  for b in batches:
    assert b["label"].dtype == np.dtype(label_patch_dtype(layout, records.features["label"].dtype))
    assert b["label"].shape == (len(b["volume"]), *PATCH, *channels)
    for vol, label, start, idx in zip(b["volume"], b["label"], b["patch_start"], b["record_index"]):
      rec = records[int(idx)]
      assert np.array_equal(label, _cut(rec["label"], start, 0)), int(idx)
      assert np.array_equal(vol, _cut(rec["volume"].astype(np.float32), start, -1024.0)), int(idx)
      assert np.array_equal(make_outputs.code_of_hu(vol), make_outputs.label_code(label, layout)), int(idx)
      seen["padded"] += bool(np.any(np.asarray(start) + PATCH > rec["volume"].shape))
      seen["foreground"] += bool(label.any())
      seen["examples"] += 1
  return seen


LOADER_CASES = {
    "center": dict(batch_size=3, patch="center"),
    "random": dict(batch_size=3, patch="random", seed=4, num_epochs=2),
    "positive": dict(batch_size=3, patch="random", seed=4, num_epochs=2, pos_fraction=0.7),
}


@pytest.mark.parametrize("layout", ["classes", "channels"])
@pytest.mark.parametrize("case", sorted(LOADER_CASES))
@pytest.mark.parametrize("loader", ["grain", "tfdata"])
def test_the_label_patch_is_the_label_of_the_image_patch(outputs, layout, case, loader):
  fmt = "tfrecord" if loader == "tfdata" else "array_record"
  path = outputs[layout, fmt]
  batches = (_tfdata if loader == "tfdata" else _grain)(path, **LOADER_CASES[case])
  seen = _check_batches(batches, ShardedRecords(path), layout)
  assert seen["examples"] == N // 3 * 3 * LOADER_CASES[case].get("num_epochs", 1)
  assert seen["padded"] and seen["foreground"], seen  # edges and foreground were both met


def test_streamed_windows_cut_the_label_with_the_volume(outputs):
  """grain's streamed form (window_shards: the split read in windows of shards) fills batches by the same path."""
  path = outputs["channels", "array_record"]
  batches = _grain(path, batch_size=3, seed=2, window_shards=1, num_epochs=2, pos_fraction=0.5)
  seen = _check_batches(batches, ShardedRecords(path), "channels")
  assert seen["examples"] == 2 * (N // 3 * 3) and seen["foreground"], seen


@pytest.mark.parametrize("layout", ["classes", "channels"])
def test_pos_fraction_one_gives_foreground_whenever_the_record_has_some(outputs, layout):
  path = outputs[layout, "array_record"]
  records = ShardedRecords(path)
  has = {i: bool(records[i]["label"].any()) for i in range(len(records))}
  assert set(has.values()) == {True, False}
  for batches in (_grain(path, batch_size=3, seed=2, num_epochs=3, pos_fraction=1.0),
                  _tfdata(outputs[layout, "tfrecord"], batch_size=3, seed=2, num_epochs=3, pos_fraction=1.0)):
    for b in batches:
      for label, idx in zip(b["label"], b["record_index"]):
        assert bool(label.any()) == has[int(idx)], int(idx)


def test_pos_fraction_zero_gives_the_plain_random_batches(outputs):
  path = outputs["classes", "array_record"]
  plain = _grain(path, batch_size=3, seed=6, num_epochs=2)
  zero = _grain(path, batch_size=3, seed=6, num_epochs=2, pos_fraction=0.0)
  assert len(plain) == len(zero)
  for a, b in zip(plain, zero):
    assert all(np.array_equal(a[k], b[k]) for k in a)
  assert sorted(plain[0]) == ["label", "patch_start", "record_index", "spacing", "volume"]


def test_volumes_without_labels_load_as_before(outputs):
  """No label feature: the keys, and each patch the plain uniform draw cut, clipped and normalised as the
  specification says (nothing of the label path reached them)."""
  path = outputs["plain", "array_record"]
  records = ShardedRecords(path)
  batches = list(grain_loader.dataset(path, shuffle=False, num_threads=2, patch_size=PATCH, batch_size=2, seed=3))
  assert batches
  for position, b in enumerate(batches):
    assert sorted(b) == ["patch_start", "record_index", "spacing", "volume"]
    for slot, (vol, start, idx) in enumerate(zip(b["volume"], b["patch_start"], b["record_index"])):
      rec = records[int(idx)]["volume"]
      want_start = random_patch_start(rec.shape, PATCH, element_rng(3, position, slot))
      assert start.tolist() == want_start.tolist()
      want = (np.clip(_cut(rec.astype(np.float32), want_start, -1024.0), -1024.0, 3071.0) + np.float32(1024.0)) \
          / np.float32(4095.0)
      assert np.array_equal(vol, want.astype(np.float32))
  with pytest.raises(ValueError, match="pos_fraction=0.5 .* no 'label' feature"):
    grain_loader.dataset(path, patch_size=PATCH, batch_size=2, pos_fraction=0.5)


def test_pos_fraction_without_a_label_is_refused_by_tfdata(tmp_path):
  features, payloads = make_outputs.volumes(np.random.default_rng(0), 2)
  path = make_outputs.write(str(tmp_path / "plain"), features, {"train": payloads}, kind="volume",
                            file_format="tfrecord")
  with pytest.raises(ValueError, match="pos_fraction=0.5 .* no 'label' feature"):
    tfdata.dataset(path, patch_size=PATCH, batch_size=2, pos_fraction=0.5)


@pytest.mark.parametrize("layout", ["classes", "channels"])
def test_resume_mid_epoch_gives_the_same_labelled_batches(outputs, layout):
  ds = grain_loader.dataset(outputs[layout, "array_record"], batch_size=3, seed=5, num_epochs=2, num_threads=2,
                            patch_size=PATCH, pos_fraction=0.6)
  full = list(ds)
  it = iter(ds)
  for _ in range(3):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  it2 = iter(ds)
  it2.set_state(state)
  rest = list(it2)
  assert len(rest) == len(full) - 3
  for a, b in zip(rest, full[3:]):
    assert sorted(a) == sorted(b)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_labelled_patches_resume_exactly_across_4_then_2_then_8_hosts(outputs):
  """With pos_fraction, every global step read by 4 hosts, then 2, then 8 is the step of one uninterrupted
  host: the same records, patches and label patches, whatever host draws them."""
  path = outputs["channels", "array_record"]

  def make(h, hosts):
    return grain_loader.dataset(path, order="global", global_batch_size=8, shard_index=h, shard_count=hosts,
                                num_epochs=8, seed=4, num_threads=1, patch_size=PATCH, pos_fraction=0.5)

  single = list(make(0, 1))
  total = len(single)
  assert total == 8 * (N // 8)
  got = [{k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
         for batches in host_steps(make, [(4, 2), (2, total // 2 - 2), (8, total - total // 2)])]
  assert len(got) == total
  for g, want in zip(got, single):
    assert sorted(g) == sorted(want)
    assert all(np.array_equal(g[k], want[k]) for k in want)
  starts = np.concatenate([s["patch_start"] for s in single])
  assert len({tuple(s) for s in starts}) > 1


def test_class_ids_past_255_are_uint16_and_kept(tmp_path):
  features, payloads = make_outputs.labelled_volumes(np.random.default_rng(1), 6, num_classes=300, empty_every=None,
                                                     blobs=(3, 5))
  assert features["label"].dtype == "uint16"
  outs = {fmt: make_outputs.write(str(tmp_path / fmt), features, {"train": payloads}, kind="volume", file_format=fmt)
          for fmt in ("array_record", "tfrecord")}
  records = ShardedRecords(outs["array_record"])
  assert max(int(records[i]["label"].max()) for i in range(len(records))) > 255
  opts = dict(batch_size=2, seed=1, pos_fraction=1.0)
  got, want = _tfdata(outs["tfrecord"], **opts), _grain(outs["array_record"], **opts)
  big = 0
  for g, w in zip(got, want):
    assert g["label"].dtype == w["label"].dtype == np.int32
    assert np.array_equal(g["label"], w["label"])
    for label, start, idx in zip(w["label"], w["patch_start"], w["record_index"]):
      assert np.array_equal(label, _cut(records[int(idx)]["label"], start, 0))
      big += int((label > 255).sum())
  assert big


def _mismatched(tmp_path, fmt: str) -> str:
  features = make_outputs.labelled_volume_features()
  good = make_outputs.labelled_volumes(np.random.default_rng(2), 2)[1]
  bad = features.decode(good[1])
  bad["label"] = np.zeros((bad["volume"].shape[0], bad["volume"].shape[1] + 1, bad["volume"].shape[2]), np.uint8)
  bad = {k: v for k, v in bad.items() if k in features}
  return make_outputs.write(str(tmp_path / fmt), features, {"train": [good[0], features.encode(bad)]},
                            kind="volume", file_format=fmt)


def test_a_label_of_another_shape_is_a_named_bad_record(tmp_path):
  path = _mismatched(tmp_path, "array_record")
  with pytest.raises(CorruptRecordError, match=r"record 1: feature 'label' has shape \(\d+, \d+, \d+\), its volume"):
    list(grain_loader.dataset(path, shuffle=False, batch_size=1, patch_size=PATCH, num_threads=1))
  import tensorflow as tf
  path = _mismatched(tmp_path, "tfrecord")
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature label \(classes\) must have the \[D, H, W\]"):
    _tfdata(path, batch_size=1)


def test_a_label_that_is_not_a_ct_label_is_refused(tmp_path):
  features = Features({**dict(make_outputs.VOLUME_FEATURES.items()), "label": Tensor((None, None), "uint8")})
  path = make_outputs.write(str(tmp_path / "flat"), features, {"train": []}, kind="volume")
  with pytest.raises(ValueError, match="feature 'label' of a volume record must be"):
    grain_loader.dataset(path, batch_size=1, patch_size=PATCH)
