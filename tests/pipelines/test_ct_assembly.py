"""Series planning and HU conversion as pure functions, on synthetic headers (no files)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from formats.transforms import CT_PADDING_HU
from pipelines.ct_volumes.assembly import (
    SPLIT_STACK, SeriesRejected, VolumePlan, plan_volumes, read_volume, slice_hu, stored_values)
from pipelines.ct_volumes.headers import SliceHeader, salted_hash

AXIAL = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)


def _slices(zs, orientation=AXIAL, shift=(0.0, 0.0), **kw) -> list[SliceHeader]:
  row, col = np.array(orientation[:3]), np.array(orientation[3:])
  normal = np.cross(row, col)
  out = []
  for i, z in enumerate(zs):
    p = np.array([-100.0, -120.0, 0.0]) + z * normal + i * np.array([shift[0], shift[1], 0.0])
    base = dict(
        path=f"f{i:03d}", frame=None, series_key="k", series_id="s", patient_id="p", acquisition="",
        position=tuple(p), orientation=orientation, pixel_spacing=(0.7, 0.8), rows=4, columns=5,
        slope=1.0, intercept=-1024.0, padding=None, bits_stored=16, pixel_representation=1,
        instance_number=i + 1, spacing_between_slices=None)
    base.update(kw)
    out.append(SliceHeader(**base))
  return out


def _plan(slices, **kw) -> VolumePlan:
  plans, rejected = plan_volumes(slices, **kw)
  assert not rejected, rejected
  (plan,) = plans
  return plan


def test_sorted_by_position_not_instance_number():
  zs = [5.0, 1.25, 3.75, 2.5, 0.0, 6.25]
  slices = _slices(zs)
  slices = [dataclasses.replace(s, instance_number=7 - i) for i, s in enumerate(slices)]
  plan = _plan(slices)
  assert [s.position[2] for s in plan.slices] == sorted(zs)
  assert plan.spacing == pytest.approx((1.25, 0.7, 0.8))
  assert plan.origin == pytest.approx((-100, -120, 0))
  np.testing.assert_allclose(np.reshape(plan.direction, (3, 3)), np.eye(3))


def test_spacing_comes_from_positions_not_slice_thickness():
  plan = _plan(_slices([0, 2, 4, 6]))
  assert plan.spacing[0] == pytest.approx(2.0)


def test_oblique_geometry():
  ob = (0.8, 0.6, 0.0, -0.576, 0.768, 0.28)
  plan = _plan(_slices([10, 11.5, 13, 14.5], orientation=ob))
  d = np.reshape(plan.direction, (3, 3))
  np.testing.assert_allclose(d[:, 2], np.cross(ob[:3], ob[3:]))
  assert plan.spacing[0] == pytest.approx(1.5)


@pytest.mark.parametrize("zs,reason", [
    ([0, 1, 2, 4, 5], "missing slice"),
    ([0, 1, 2, 3.5, 4.5], "irregular slice spacing"),
    ([0], "single slice"),
])
def test_bad_stacks_are_rejected_with_reasons(zs, reason):
  plans, rejected = plan_volumes(_slices(zs))
  assert not plans
  assert {p for p, _, _ in rejected} == {f"f{i:03d}" for i in range(len(zs))}
  assert all(reason in r and n == 1 for _, r, n in rejected)


def test_gantry_tilt_is_rejected():
  plans, rejected = plan_volumes(_slices([0, 1, 2, 3], shift=(0, math.tan(math.radians(10)))))
  assert not plans
  assert "gantry tilt: the stack runs 10.00 degrees" in rejected[0][1]


def test_small_jitter_within_tolerance_is_accepted():
  plan = _plan(_slices([0, 1.004, 2.0, 2.997, 4.0]))
  assert plan.spacing[0] == pytest.approx(1.0)


def test_contrast_phases_split_by_acquisition():
  a = [dataclasses.replace(s, acquisition="acq=1") for s in _slices([0, 1, 2])]
  b = [dataclasses.replace(s, acquisition="acq=2", path=s.path + "b") for s in _slices([0, 1, 2])]
  plans, rejected = plan_volumes(a + b)
  assert not rejected
  assert sorted(p.stack for p in plans) == ["acq=1", "acq=2"]
  assert len({p.key for p in plans}) == 2


def test_repeated_positions_without_labels_become_duplicates():
  s = _slices([0, 1, 2])
  copy = dataclasses.replace(s[1], path="copy")
  plan = _plan(s + [copy])
  assert len(plan.slices) == 3
  assert len(plan.duplicates) == 1
  assert {plan.slices[1].path, plan.duplicates[0][1].path} == {"f001", "copy"}  # ties broken by path


def test_missing_positions_reject_those_files_only():
  s = _slices([0, 1, 2, 3])
  s.append(dataclasses.replace(_slices([4])[0], path="nopos", position=None))
  plans, rejected = plan_volumes(s)
  assert rejected == [("nopos", "missing mandatory tag ImagePositionPatient", 1)]
  assert len(plans[0].slices) == 4


def test_instance_number_fallback_says_so():
  s = [dataclasses.replace(x, position=None, spacing_between_slices=-2.5) for x in _slices([0, 1, 2])]
  s = list(reversed(s))
  plan = _plan(s)
  assert plan.sorted_by == "instance_number"
  assert plan.spacing[0] == 2.5
  assert [x.instance_number for x in plan.slices] == [1, 2, 3]
  assert all(math.isnan(v) for v in plan.origin)
  direction = np.reshape(plan.direction, (3, 3))
  np.testing.assert_array_equal(direction[:, :2], np.eye(3)[:, :2])
  assert np.isnan(direction[:, 2]).all()  # which way the stack runs is unknown: not a guessed +normal
  plans, rejected = plan_volumes([dataclasses.replace(x, spacing_between_slices=None) for x in s])
  assert not plans
  assert "SpacingBetweenSlices" in rejected[0][1]


def test_instance_number_fallback_rejects_a_gap_in_the_numbers():
  s = [dataclasses.replace(x, position=None, spacing_between_slices=2.5, instance_number=n)
       for x, n in zip(_slices([0, 1, 2, 3, 4]), [1, 2, 4, 5, 6])]
  plans, rejected = plan_volumes(s)
  assert not plans
  assert len(rejected) == 5
  assert all(r.startswith("series rejected, missing slice(s): 1 missing, the InstanceNumber") for _, r, _ in rejected)
  plans, rejected = plan_volumes(s[:1])
  assert not plans and "single slice" in rejected[0][1]


def test_a_slice_shifted_in_plane_is_rejected():
  s = _slices([0, 1, 2, 3, 4])
  p = np.asarray(s[2].position)
  s[2] = dataclasses.replace(s[2], position=tuple(p + [0.5, 0, 0]))  # 0.5 mm: most of a 0.7 mm pixel
  plans, rejected = plan_volumes(s)
  assert not plans
  assert all("in-plane shift: the slice at position 2.000 mm lies 0.500 mm off" in r for _, r, _ in rejected)
  s[2] = dataclasses.replace(s[2], position=tuple(p + [0.1, 0, 0]))  # under a quarter of a pixel: kept
  assert len(_plan(s).slices) == 5


def test_geometries_of_one_series_become_volumes_with_their_own_keys():
  axial = _slices([0, 1, 2])
  coronal = [dataclasses.replace(x, series_key="k2", path="c" + x.path)
             for x in _slices([0, 1, 2], orientation=(1.0, 0.0, 0.0, 0.0, 0.0, -1.0))]
  plans, rejected = plan_volumes(coronal + axial)
  assert not rejected
  assert [(p.key, p.slices[0].path) for p in plans] == [("s/geometry=1", "f000"), ("s/geometry=2", "cf000")]
  phases = [dataclasses.replace(x, acquisition=f"acq={1 + i // 3}", path=f"p{i}")
            for i, x in enumerate(_slices([0, 1, 2]) * 2)]
  plans, _ = plan_volumes(coronal + phases)
  assert sorted(p.key for p in plans) == ["s/geometry=1/acq=1", "s/geometry=1/acq=2", "s/geometry=2"]
  # one geometry that makes no volume leaves the other its plain key (as a series of one geometry)
  plans, rejected = plan_volumes(coronal[:1] + axial)
  assert [p.key for p in plans] == ["s"]
  assert [(p, r.split(":")[0]) for p, r, _ in rejected] == [("cf000", "series rejected, single slice")]


def _jittered(zs, which, delta: float, key: str = "k2") -> list[SliceHeader]:
  """Axial slices at `zs`; those `which` picks get orientation cosines off by `delta` and their own series key
  (as rounding the orientation to 4 decimals gives them when the jitter crosses a rounding boundary)."""
  tilted = (1.0, delta, 0.0, -delta, 1.0, 0.0)
  return [dataclasses.replace(x, series_key=key, orientation=tilted) if which(i) else x
          for i, x in enumerate(_slices(zs))]


@pytest.mark.parametrize("which", [lambda i: i % 2, lambda i: i >= 10], ids=["interleaved", "upper half"])
def test_header_jitter_never_splits_one_stack_into_partial_volumes(which):
  """One stack of 20 slices whose orientation jitters: within the key's precision (6e-5) it is one volume;
  past it (3e-4) it is rejected whole, never written as two evenly spaced partial volumes."""
  plan = _plan(_jittered(range(20), which, 6e-5))
  assert len(plan.slices) == 20 and plan.spacing[0] == pytest.approx(1.0)
  plans, rejected = plan_volumes(_jittered(range(20), which, 3e-4))
  assert plans == []
  assert len(rejected) == 20 and {r for _, r, _ in rejected} == {f"series rejected, {SPLIT_STACK}"}


def test_parallel_geometries_apart_along_the_normal_stay_two_volumes():
  """Two slabs of one series, parallel but far apart (a gap of 10 slices), of different pixel spacing."""
  slabs = _slices(range(5)) + [dataclasses.replace(x, series_key="k2", pixel_spacing=(0.9, 0.9), path="b" + x.path)
                               for x in _slices(range(15, 20))]
  plans, rejected = plan_volumes(slabs)
  assert not rejected and [len(p.slices) for p in plans] == [5, 5]


def test_several_patients_in_one_series_are_rejected():
  s = _slices([0, 1, 2])
  s[1] = dataclasses.replace(s[1], patient_id="other")
  plans, rejected = plan_volumes(s)
  assert not plans
  assert "several patients" in rejected[0][1]


def test_stored_values_respect_bits_stored_and_sign():
  raw = np.array([0x0FFF, 0xF800, 0x0800, 0x07FF], dtype=np.uint16)
  np.testing.assert_array_equal(stored_values(raw, 12, 0), [4095, 2048, 2048, 2047])
  np.testing.assert_array_equal(stored_values(raw, 12, 1), [-1, -2048, -2048, 2047])
  np.testing.assert_array_equal(stored_values(raw.view(np.int16), 16, 1), raw.view(np.int16))
  np.testing.assert_array_equal(stored_values(raw, 16, 0), raw)



@pytest.mark.parametrize("kind", ["i", "u"])
def test_big_endian_stored_values_keep_their_values(kind):
  """pydicom gives '>i2'/'>u2' arrays for Explicit VR Big Endian: values, not bytes, count."""
  values = np.array([-2000, -1, 0, 1, 2047, 4095] if kind == "i" else [0, 1, 255, 256, 4095, 65535])
  big = values.astype(f">{kind}2")
  for bits in (12, 16):
    expected = stored_values(values.astype(f"<{kind}2"), bits, int(kind == "i"))
    got = stored_values(big, bits, int(kind == "i"))
    np.testing.assert_array_equal(got, expected)
    assert got.dtype.isnative

def test_padding_is_masked_on_stored_values_before_rescale():
  s = _slices([0])[0]
  s = dataclasses.replace(s, padding=(-2000, -2000), intercept=-1024.0, slope=1.0)
  stored = np.array([[-2000, 0, 1024]], np.int32)
  np.testing.assert_array_equal(slice_hu(stored, s, np.empty((1, 3), np.int16)), [[CT_PADDING_HU, -1024, 0]])
  half = dataclasses.replace(s, slope=0.5, intercept=-1000.0, padding=None)
  np.testing.assert_array_equal(slice_hu(np.array([[3, 2000]]), half, np.empty((1, 2), np.float32)), [[-998.5, 0.0]])
  rounded = slice_hu(np.array([[3, 2000]]), half, np.empty((1, 2), np.int16))
  np.testing.assert_array_equal(rounded, [[-998, 0]])  # forced int16 rounds half to even
  big = dataclasses.replace(s, slope=10.0, intercept=0.0, padding=None)
  np.testing.assert_array_equal(slice_hu(np.array([[5000, -5000]]), big, np.empty((1, 2), np.int16)),
                                [[32767, -32768]])  # clipped, not wrapped


def test_read_volume_drops_identical_and_rejects_conflicting_duplicates(monkeypatch):
  s = _slices([0, 1, 2])
  pixels = {f"f{i:03d}": np.full((4, 5), 1000 + i, np.int16) for i in range(3)}
  pixels["copy"] = pixels["f001"].copy()
  pixels["bad"] = pixels["f001"] + 1

  class _Opened:
    def __init__(self, path): self.path = path
    def __enter__(self): return self
    def __exit__(self, *a): pass

  import pipelines.ct_volumes.assembly as asm

  def fake_read_dataset(f, max_inflated):
    class DS: pixel_array = pixels[f.path]
    return DS(), f

  monkeypatch.setattr(asm, "read_dataset", fake_read_dataset)
  plan = _plan(s + [dataclasses.replace(s[1], path="copy")])
  vol, dropped = read_volume(plan, _Opened, "int16")
  assert vol.shape == (3, 4, 5)
  assert vol[1, 0, 0] == 1001 - 1024
  assert dropped == [("f001", "identical duplicate of another slice (dropped)")]  # "copy" sorts first
  plan = _plan(s + [dataclasses.replace(s[1], path="bad")])
  with pytest.raises(SeriesRejected, match="conflicting duplicate"):
    read_volume(plan, _Opened, "int16")
  # the same stored values under another rescale or padding are other HU: a conflict, not a copy to drop
  for other in (dict(intercept=-24.0), dict(slope=2.0), dict(padding=(1001, 1001))):
    plan = _plan(s + [dataclasses.replace(s[1], path="copy", **other)])
    with pytest.raises(SeriesRejected, match="conflicting duplicate"):
      read_volume(plan, _Opened, "int16")
  # other stored values that give the same HU are the same slice
  plan = _plan(s + [dataclasses.replace(s[1], path="bad", intercept=-1025.0)])
  vol, dropped = read_volume(plan, _Opened, "int16")
  assert vol[1, 0, 0] == 1001 - 1024 and dropped == [("f001", "identical duplicate of another slice (dropped)")]


def test_salted_hash_depends_on_salt():
  assert salted_hash("a", "patient", "123") != salted_hash("b", "patient", "123")
  assert len(salted_hash("a", "x")) == 32
