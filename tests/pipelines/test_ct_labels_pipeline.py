"""End to end: `pipelines.ct_volumes --label_sources=...` on a tree of CT series with SEG, RTSTRUCT and NIfTI
labels scattered through it, each converted mask compared voxel for voxel with an independent reading.

The label layer itself (every reject, every geometry, the independent rasterizers) is tested in
test_ct_labels.py; this file proves what the pipeline adds: labels found anywhere in the tree are joined to
the right volume (by series, or by folder for an unmapped NIfTI), every file is counted once (a record or a
named reject), no header value reaches an output byte, the volumes are those of a run without labels, and
the output loads with its masks.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pydicom
import pytest
from skimage.draw import polygon as skimage_polygon

from pipelines import ct_volumes
from pipelines.core import UsageError
from pipelines.ct_volumes.headers import salted_hash
from scripts import make_sample_ct as ct, make_sample_ct_labels as cl
from tests.pipelines.test_ct_volumes import SALT, convert, errors, records

pytestmark = pytest.mark.slow
LABEL_MAP = {"liver": 1, "spleen": 2}


def _series(root: str, folder: str, patient: str, seed: int) -> ct.SeriesTruth:
  rng = np.random.default_rng(seed)
  return ct.write_series(os.path.join(root, folder), patient_id=patient, seed=seed, rows=32, cols=32,
                         num_slices=10, phi=ct.make_phi(rng, patient, f"Name^{patient}"))


def _organs(truth: ct.SeriesTruth) -> tuple[np.ndarray, np.ndarray]:
  shape = truth.hu.shape
  return cl.ellipsoid(shape, (4, 12, 11), (3, 6, 7)), cl.ellipsoid(shape, (5, 22, 23), (2, 4, 4))


def _rasterized(truth: ct.SeriesTruth, rois: list[cl.Roi]) -> np.ndarray:
  """The independent reading of RTSTRUCT contours: skimage's polygon fill (vertices off voxel centres)."""
  out = np.zeros(truth.hu.shape, np.uint8)
  for roi in rois:
    for k, ij in roi.contours:
      rr, cc = skimage_polygon(ij[:, 1], ij[:, 0], shape=truth.hu.shape[1:])
      out[k, rr, cc] = LABEL_MAP[roi.name]
  return out


def _save_seg(ds, path: str, **tags) -> str:
  for keyword, value in tags.items():
    setattr(ds, keyword, value)
  return cl.save(ds, path)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
  """Series a..h under odd folder names, their labels elsewhere; `expect` says what each should become."""
  base = tmp_path_factory.mktemp("ct_labels")
  root = str(base / "in")
  expect, label_files, secrets = {}, {}, set()

  a = _series(root, "p1/study/ct", "P1", 1)  # SEG in another folder, two segments
  liver, spleen = _organs(a)
  seg_a = cl.seg_dataset(a, [liver, spleen], ["liver", "spleen"], seed=11)
  label_files["a"] = _save_seg(seg_a, os.path.join(root, "annotations", "0001"))
  expect["a"] = ("seg", (liver * 1 + spleen * 2).astype(np.uint8))
  secrets |= {seg_a.SeriesInstanceUID, seg_a.SOPInstanceUID}

  b = _series(root, "p2/x", "P2", 2)  # RTSTRUCT, files named by number, in the series' folder
  rois = [cl.Roi("liver", [(k, cl.polygon_circle((11.3, 12.2), 6.1, 40)) for k in range(2, 7)]),
          cl.Roi("spleen", [(k, cl.polygon_circle((23.2, 22.3), 3.7, 24)) for k in range(4, 7)])]
  label_files["b"] = cl.write_rtstruct(b, os.path.join(root, "p2/x/RS.1"), rois, seed=12)
  expect["b"] = ("rtstruct", _rasterized(b, rois))

  c = _series(root, "p3", "P3", 3)  # NIfTI beside its series (dcm2niix's flipped rows)
  liver_c, _ = _organs(c)
  label_files["c"] = cl.write_nifti(c, os.path.join(root, "p3", "labels.nii.gz"), liver_c * 1, flips="j")
  expect["c"] = ("nifti", liver_c.astype(np.uint8))

  d = _series(root, "p4/imagesTr/case_004", "P4", 4)  # NIfTI in a labelsTr folder, named by the mapping file
  _, spleen_d = _organs(d)
  label_files["d"] = cl.write_nifti(d, os.path.join(root, "labelsTr", "case_004.nii"), spleen_d * 2, axes="ijk")
  expect["d"] = ("nifti", (spleen_d * 2).astype(np.uint8))

  e = _series(root, "p5", "P5", 5)  # no label at all
  expect["e"] = "no label source found"

  f = _series(root, "p6", "P6", 6)  # a SEG of this series naming another patient
  label_files["f"] = _save_seg(cl.seg_dataset(f, [_organs(f)[0]], ["liver"], seed=16),
                               os.path.join(root, "annotations", "0002"), PatientID="SOMEONE-ELSE")
  expect["f"] = "its label was rejected"

  g = _series(root, "p7", "P7", 7)  # a SEG and an RTSTRUCT of one organ that disagree
  label_files["g"] = cl.write_seg(g, os.path.join(root, "p7", "seg.dcm"), [_organs(g)[0]], ["liver"], seed=17)
  label_files["g2"] = cl.write_rtstruct(g, os.path.join(root, "p7", "rs.dcm"), [rois[0]], seed=27)
  expect["g"] = "label sources disagree"

  h = _series(root, "p8", "P8", 8)  # its only SEG holds a segment the label map does not name
  label_files["h"] = cl.write_seg(h, os.path.join(root, "p8", "seg.dcm"), [_organs(h)[0]], ["kidney"], seed=18)
  expect["h"] = "no label source found"

  gone = _series(str(base / "elsewhere"), "p9", "P9", 9)  # a SEG whose series is not in the input
  label_files["orphan"] = cl.write_seg(gone, os.path.join(root, "annotations", "0003"), [_organs(gone)[0]],
                                       ["liver"], seed=19)

  truths = {"a": a, "b": b, "c": c, "d": d, "e": e, "f": f, "g": g, "h": h}
  for t in truths.values():
    secrets |= {v for v in (t.phi or {}).values() if v and len(str(v)) >= 4} | {t.study_uid, t.series_uid}
  maps = {"label_map": str(base / "label_map.json"), "nifti_map": str(base / "nifti_map.json")}
  with open(maps["label_map"], "w") as out:
    json.dump(LABEL_MAP, out)
  with open(maps["nifti_map"], "w") as out:
    json.dump({"labelsTr/case_004.nii": d.series_uid}, out)
  return root, truths, expect, label_files, secrets, maps


def _flags(maps, *extra):
  return ("--splits=train=1.0", "--label_sources=auto", f"--label_map={maps['label_map']}",
          f"--label_nifti_map={maps['nifti_map']}", *extra)


@pytest.fixture(scope="module")
def converted(tree, tmp_path_factory):
  root, *_, maps = tree
  out = str(tmp_path_factory.mktemp("ct_labels_out") / "out")
  m = convert(root, out, *_flags(maps))
  return out, m, {r["series_id"]: r for _, r in records(out, m)}


def _sid(truth: ct.SeriesTruth) -> str:
  return salted_hash(SALT, "series", truth.study_uid, truth.series_uid)


def test_each_labelled_series_gets_exactly_its_mask(tree, converted):
  _, truths, expect, *_ = tree
  _, m, rows = converted
  assert m.features["label"].dtype == "uint8"
  assert m.source["label_map"] == LABEL_MAP
  labelled = {k: v for k, v in expect.items() if isinstance(v, tuple)}
  assert set(rows) == {_sid(truths[k]) for k in labelled}
  for key, (source, mask) in labelled.items():
    r = rows[_sid(truths[key])]
    assert r["label_source"] == source, key
    assert r["label"].shape == r["volume"].shape == truths[key].hu.shape, key
    np.testing.assert_array_equal(r["label"], mask, err_msg=key)
    assert np.count_nonzero(r["label"]), key  # a mask that is all background would prove nothing


def test_every_other_series_and_label_is_a_named_reject(tree, converted):
  _, truths, expect, label_files, *_ = tree
  out, m, _ = converted
  errs = errors(out)
  for key, want in expect.items():
    if isinstance(want, str):
      for f in truths[key].files:
        assert any(want in r for r in errs[f]), (key, errs.get(f))
  assert any("another patient" in r or "PatientID" in r for r in errs[label_files["f"]]), errs[label_files["f"]]
  assert any("not in --label_map" in r or "label map" in r for r in errs[label_files["h"]]), errs[label_files["h"]]
  assert any("no CT volume of the input" in r for r in errs[label_files["orphan"]]), errs[label_files["orphan"]]
  for key in ("g", "g2"):
    assert label_files[key] in errs, key
  assert m.rejected.count == sum(len(v) for v in errs.values())


def test_every_file_is_counted_once(tree, converted):
  root, truths, expect, label_files, *_ = tree
  out, m, rows = converted
  errs = errors(out)
  used = {f for k, v in expect.items() if isinstance(v, tuple) for f in truths[k].files}
  used |= {label_files[k] for k, v in expect.items() if isinstance(v, tuple)}
  everything = {p for p in glob.glob(os.path.join(root, "**", "*"), recursive=True) if os.path.isfile(p)}
  assert everything == used | set(errs)
  assert not used & set(errs)
  # The commit checks this too (records + rejects == inputs), or there would be no manifest.
  assert m.num_records == len(rows) == 4


def test_no_header_value_in_any_output_byte(tree, converted):
  *_, secrets, _ = tree
  out, _, _ = converted
  blob = b"".join(open(p, "rb").read() for p in glob.glob(os.path.join(out, "**", "*"), recursive=True)
                  if os.path.isfile(p))
  assert secrets
  assert not [s for s in secrets if str(s).encode() in blob]


def test_volumes_are_those_of_a_run_without_labels(tree, converted, tmp_path):
  root, truths, _, label_files, *_ = tree
  _, _, rows = converted
  out = str(tmp_path / "plain")
  m = convert(root, out, "--splits=train=1.0")
  plain = {r["series_id"]: r for _, r in records(out, m)}
  assert "label" not in m.features
  for sid, r in rows.items():
    np.testing.assert_array_equal(plain[sid]["volume"], r["volume"])
  errs = errors(out)
  for path in label_files.values():  # without --label_sources, label files are non-CT files as before
    assert path in errs


def test_the_output_loads_with_its_masks(converted):
  from loaders import grain as grain_loaders
  out, _, rows = converted
  batches = list(grain_loaders.dataset(out, "train", batch_size=2, patch_size=(4, 16, 16), pos_fraction=1.0,
                                       shuffle=False, num_threads=1))
  assert batches
  masks = [r["label"] for r in rows.values()]
  for batch in batches:
    assert batch["label"].shape == (2, 4, 16, 16)
    for label, start in zip(batch["label"], batch["patch_start"]):
      cut = [m[tuple(slice(s, s + p) for s, p in zip(start, (4, 16, 16)))] for m in masks]
      assert any(np.array_equal(label, c) for c in cut)
      assert np.count_nonzero(label)  # pos_fraction=1: centred on a foreground voxel


@pytest.fixture(scope="module")
def overlapping(tmp_path_factory):
  base = tmp_path_factory.mktemp("ct_overlap")
  root = str(base / "in")
  t = _series(root, "s", "P1", 21)
  big = cl.ellipsoid(t.hu.shape, (5, 16, 16), (4, 10, 10))
  small = cl.ellipsoid(t.hu.shape, (5, 16, 16), (2, 4, 4))  # inside `big`: the segments overlap
  cl.write_seg(t, os.path.join(root, "seg.dcm"), [big, small], ["liver", "spleen"], seed=22)
  path = str(base / "map.json")
  with open(path, "w") as out:
    json.dump(LABEL_MAP, out)
  return root, t, big, small, path


def test_overlapping_segments_reject_as_classes_and_load_as_channels(overlapping, tmp_path):
  root, t, big, small, label_map = overlapping
  flags = ("--splits=train=1.0", "--label_sources=seg", f"--label_map={label_map}")
  m = convert(root, str(tmp_path / "classes"), *flags)
  assert m.num_records == 0
  assert any("--label_layout=channels" in r for r in errors(str(tmp_path / "classes"))[t.files[0]])
  out = str(tmp_path / "channels")
  m = convert(root, out, *flags, "--label_layout=channels")
  assert m.features["label"].shape == (None, None, None, 2)
  (_, r), = records(out, m)
  np.testing.assert_array_equal(r["label"], np.stack([big, small], axis=-1).astype(np.uint8))


@pytest.mark.parametrize("args,message", [
    (["--label_sources=seg"], "--label_map is required"),
    (["--label_sources=seg,dicom"], "unknown source 'dicom'"),
    (["--label_layout=channels"], "--label_layout needs --label_sources"),
    (["--label_sources=seg", "--label_map={bad}"], "is not JSON"),
    (["--label_sources=seg", "--label_map={ids}"], "class id 1..65535"),
    (["--label_sources=seg", "--label_map={missing}"], "--label_map: cannot read"),
    (["--label_sources=nifti", "--label_nifti_map={ids}"], "--label_nifti_map must hold"),
    (["--label_sources=seg", "--label_map={good}", "--label_resample=true"], "needs nifti"),
])
def test_label_flag_errors_write_nothing(tmp_path, args, message):
  src = tmp_path / "in"
  src.mkdir()
  files = {"bad": "{not json", "ids": json.dumps({"liver": 0}), "good": json.dumps(LABEL_MAP)}
  for name, text in files.items():
    (tmp_path / f"{name}.json").write_text(text)
  paths = {name: str(tmp_path / f"{name}.json") for name in [*files, "missing"]}
  out = tmp_path / "out"
  with pytest.raises(UsageError, match=message):
    ct_volumes.run([f"--input={src}", f"--output={out}", f"--id_salt={SALT}",
                    *[a.format(**paths) for a in args]])
  assert not out.exists()


def test_a_seg_file_is_dicom_the_store_would_accept(tree):
  """The generated SEG is a real Segmentation Storage instance (what the tree above tests with)."""
  *_, label_files, _, _ = tree
  ds = pydicom.dcmread(label_files["a"])
  assert ds.SOPClassUID == "1.2.840.10008.5.1.4.1.1.66.4"
  assert ds.NumberOfFrames > 0


def test_append_converts_new_series_with_their_labels(tmp_path):
  root, out = str(tmp_path / "in"), str(tmp_path / "out")
  label_map = str(tmp_path / "map.json")
  with open(label_map, "w") as f:
    json.dump(LABEL_MAP, f)
  flags = ("--splits=train=1.0", "--label_sources=seg", f"--label_map={label_map}")
  first = _series(root, "day1", "P1", 31)
  cl.write_seg(first, os.path.join(root, "day1", "seg.dcm"), [_organs(first)[0]], ["liver"], seed=32)
  assert convert(root, out, *flags).num_records == 1
  second = _series(root, "day2", "P2", 33)
  spleen = _organs(second)[1]
  cl.write_seg(second, os.path.join(root, "day2", "seg.dcm"), [spleen], ["spleen"], seed=34)
  with pytest.raises(UsageError, match="other settings"):  # the label settings are the output's
    convert(root, out, "--splits=train=1.0", "--label_sources=seg,rtstruct", f"--label_map={label_map}",
            "--mode=append")
  m = convert(root, out, *flags, "--mode=append")
  rows = {r["series_id"]: r for _, r in records(out, m)}
  assert len(rows) == 2
  np.testing.assert_array_equal(rows[_sid(second)]["label"], spleen * 2)
  np.testing.assert_array_equal(rows[_sid(first)]["label"], _organs(first)[0] * 1)


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
  """Series in two contrast phases (one stack each, positions repeated), labels that name one, both or none."""
  base = tmp_path_factory.mktemp("ct_phases")
  root = str(base / "in")
  rng = np.random.default_rng(41)
  plain, arterial = ct.write_contrast_phases(os.path.join(root, "ph1"), rng=rng, patient_id="P1", num_slices=8,
                                             rows=24, cols=24)
  mask = cl.ellipsoid(plain.hu.shape, (4, 12, 12), (2, 5, 5))
  files = {"plain_seg": cl.write_seg(plain, os.path.join(root, "ph1", "seg_plain.dcm"), [mask], ["liver"], seed=42)}
  both = cl.seg_dataset(plain, [mask], ["liver"], seed=43)
  refs = both.ReferencedSeriesSequence[0].ReferencedInstanceSequence
  for path in arterial.files:  # a SEG made from both phases' images names instances of both
    item = pydicom.Dataset()
    source = pydicom.dcmread(path, stop_before_pixels=True)
    item.ReferencedSOPClassUID, item.ReferencedSOPInstanceUID = source.SOPClassUID, source.SOPInstanceUID
    refs.append(item)
  files["both_seg"] = cl.save(both, os.path.join(root, "ph1", "seg_both.dcm"))
  files["ph1_nifti"] = cl.write_nifti(plain, os.path.join(root, "ph1", "labels.nii.gz"), mask * 1)
  plain2, arterial2 = ct.write_contrast_phases(os.path.join(root, "ph2"), rng=rng, patient_id="P2", num_slices=8,
                                               rows=24, cols=24)
  ct.drop_middle_slice(arterial2)  # that phase is rejected: a NIfTI beside the other may not go to it unasked
  files["ph2_nifti"] = cl.write_nifti(plain2, os.path.join(root, "ph2", "labels.nii"), mask * 1)
  lone = _series(root, "nn", "P3", 44)
  unnamed = cl.seg_dataset(lone, [_organs(lone)[0]], ["liver"], seed=45)
  del unnamed.ReferencedSeriesSequence
  files["unnamed_seg"] = cl.save(unnamed, os.path.join(root, "nn", "seg.dcm"))
  empty = _series(root, "zz", "P4", 46)
  files["empty_nifti"] = cl.write_nifti(empty, os.path.join(root, "zz", "labels.nii"), np.zeros(empty.hu.shape, int))
  label_map = str(base / "map.json")
  with open(label_map, "w") as f:
    json.dump(LABEL_MAP, f)
  out = str(base / "out")
  m = convert(root, out, "--splits=train=1.0", "--label_sources=auto", f"--label_map={label_map}")
  truths = {"plain": plain, "arterial": arterial, "plain2": plain2, "arterial2": arterial2, "lone": lone,
            "empty": empty}
  return out, m, truths, files, mask


def test_a_label_goes_to_its_one_phase_and_never_to_another(phases):
  out, m, truths, files, mask = phases
  errs = errors(out)
  rows = {r["series_id"]: r for _, r in records(out, m)}
  got = [r for r in rows.values() if r["label_source"] == "seg"]
  assert len(got) == 1
  np.testing.assert_array_equal(got[0]["label"], mask * 1)
  np.testing.assert_array_equal(got[0]["volume"], truths["plain"].hu)
  assert any("instances of 2 volumes of its series" in r for r in errs[files["both_seg"]]), errs[files["both_seg"]]
  assert any("2 CT volumes in its folder" in r for r in errs[files["ph1_nifti"]]), errs[files["ph1_nifti"]]
  assert any("2 CT volumes in its folder (counting rejected ones)" in r for r in errs[files["ph2_nifti"]])
  for f in truths["arterial"].files + truths["plain2"].files:  # phases without a label of their own
    assert any("no label source found" in r for r in errs[f]), errs[f]


def test_a_seg_that_names_no_series_is_rejected(phases):
  out, _, truths, files, _ = phases
  errs = errors(out)
  assert any("it names no series" in r for r in errs[files["unnamed_seg"]]), errs[files["unnamed_seg"]]
  assert all(f in errs for f in truths["lone"].files)


def test_a_label_without_foreground_is_kept_and_counted_in_the_warnings(phases):
  out, m, truths, _, _ = phases
  empty = [r for _, r in records(out, m) if r["label_source"] == "nifti"]
  assert len(empty) == 1
  assert not empty[0]["label"].any()
  assert any("1 volumes have a label without foreground" in w for w in m.warnings), m.warnings


def test_a_nifti_mapping_that_names_a_missing_file_is_a_usage_error(tmp_path):
  src = tmp_path / "in"
  src.mkdir()
  (tmp_path / "map.json").write_text(json.dumps({"labelsTr/case_9.nii.gz": "1.2.3"}))
  with pytest.raises(UsageError, match="names 1 files that are not under --input"):
    ct_volumes.run([f"--input={src}", f"--output={tmp_path / 'out'}", f"--id_salt={SALT}", "--label_sources=nifti",
                    f"--label_nifti_map={tmp_path / 'map.json'}"])
  assert not (tmp_path / "out").exists()
