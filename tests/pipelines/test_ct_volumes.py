"""End to end: `pipelines.ct_volumes` on a generated mixed DICOM tree with known truth."""

from __future__ import annotations

import collections
import glob
import json
import os
import pickle

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.pipeline import PipelineVisitor
import numpy as np
import pydicom
import pytest
import SimpleITK as sitk

from formats import arrayrecord, tfrecord
from formats.storage import files
from formats.manifest import Manifest
from formats.outputs.output import verify as verify_output
from pipelines import ct_volumes
from pipelines.ct_volumes.assembly import plan_volumes
from pipelines.ct_volumes.headers import read_slices, salted_hash
from pipelines.ct_volumes.pipeline import plan_unit
from scripts import make_sample_ct as ct
from tests.conftest import upload_tree

pytestmark = pytest.mark.slow
SALT = "test-salt"

# What the errors/ reason says for each kind of broken input the generator makes: one of these.
REASONS = {
    ct.LOCALIZER: ("localizer",),
    ct.MISSING_SLICE: ("missing slice",),
    ct.IRREGULAR_SPACING: ("irregular slice spacing",),
    ct.GANTRY_TILT: ("gantry tilt",),
    ct.CONFLICTING_DUPLICATE: ("conflicting duplicate",),
    ct.NO_PIXEL_DATA: ("non-image object",),
    ct.SECONDARY_CAPTURE: ("secondary capture",),
    ct.NOT_DICOM: ("not DICOM", "missing mandatory tag SOPClassUID"),  # no DICOM, or DICOM that is no image
    ct.TRUNCATED: ("pixel data",),
    ct.MISSING_TAG: ("missing mandatory tag", "missing slice"),  # the file itself; the rest of its series
}


def convert(src: str, out: str, *flags: str) -> Manifest:
  ct_volumes.run([f"--input={src}", f"--output={out}", f"--id_salt={SALT}", *flags])
  return Manifest.loads(files.read_bytes(files.join(out, "manifest.json")))


def records(out: str, m: Manifest) -> list[tuple[str, dict]]:
  rows = []
  for split_name, split in m.splits.items():
    for shard in split.shards:
      with files.LocalCopy(files.join(out, shard.path)) as local:
        it = arrayrecord.read_file(local) if m.file_format == "array_record" else tfrecord.read_file(local)
        rows += [(split_name, m.features.decode(r)) for r in it]
  return rows


def errors(out: str) -> dict[str, list[str]]:
  by_path = collections.defaultdict(list)
  m = Manifest.loads(files.read_bytes(files.join(out, "manifest.json")))
  for line in files.read_bytes(files.join(out, m.rejected.path)).splitlines():
    e = json.loads(line)
    by_path[e["input"]].append(e["reason"])
  return by_path


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("ct") / "dicom")
  return root, ct.make_mixed_tree(root, seed=3)


@pytest.fixture(scope="module")
def converted(tree, tmp_path_factory):
  root, truths = tree
  out = str(tmp_path_factory.mktemp("ct_out") / "out")
  m = convert(root, out, "--splits=train=0.5,validation=0.25,test=0.25")
  return out, m, records(out, m)


def _match(truth, rows):
  sid = salted_hash(SALT, "series", truth.study_uid, truth.series_uid)
  candidates = [r for _, r in rows if r["series_id"] == sid and r["volume"].shape == truth.hu.shape]
  return [r for r in candidates if np.array_equal(r["volume"].astype(np.float64), truth.hu.astype(np.float64))]


def test_every_good_series_becomes_exactly_its_true_volume(tree, converted):
  _, truths = tree
  out, m, rows = converted
  good = [t for t in truths if t.expected == ct.VOLUME]
  assert len(rows) == len(good) == m.num_records
  for t in good:
    found = _match(t, rows)
    assert len(found) == 1, t.name
    r = found[0]
    np.testing.assert_allclose(r["spacing"], t.spacing, rtol=1e-5, err_msg=t.name)
    np.testing.assert_allclose(r["origin"], t.origin, atol=1e-3, err_msg=t.name)
    # truth.direction has one axis per row; the record stores axes as columns (ITK's layout)
    np.testing.assert_allclose(r["direction"], np.asarray(t.direction).T, atol=1e-6, err_msg=t.name)
    assert int(r["num_slices"]) == t.hu.shape[0]
    assert r["sorted_by"] == "position"


def test_volume_dtype_is_float32_when_a_rescale_is_not_integral(converted):
  _, m, rows = converted
  assert m.features["volume"].dtype == "float32"  # the tree holds a series with slope 0.5
  assert {r["volume"].dtype for _, r in rows} == {np.dtype(np.float32)}


def test_every_other_file_is_in_errors_with_its_reason(tree, converted):
  _, truths = tree
  out, m, _ = converted
  errs = errors(out)
  assert m.rejected.count == sum(len(v) for v in errs.values())
  used = {f for t in truths if t.expected == ct.VOLUME for f in t.files}
  for t in truths:
    if t.expected == ct.VOLUME:
      continue
    for f in t.files:
      if f in used:
        continue  # e.g. the good slices of a series whose localizer was left out
      assert f in errs, (t.name, f)
      assert any(reason in r for reason in REASONS[t.expected] for r in errs[f]), (t.name, errs[f])
    if t.expected == ct.MISSING_TAG:  # the file that lacks the tag is named for it
      assert any("missing mandatory tag" in r for f in t.files for r in errs.get(f, ())), t.name
  # nothing is both used and rejected, apart from the identical duplicate dropped from a volume
  both = [f for f in used if f in errs]
  assert all(any("identical duplicate" in r for r in errs[f]) for f in both)
  all_files = {os.path.abspath(p) for p in glob.glob(os.path.join(tree[0], "**", "*"), recursive=True)
               if os.path.isfile(p)}
  assert all_files == used | set(errs)


def test_no_phi_in_any_output_file(tree, converted):
  _, truths = tree
  out, _, _ = converted
  secrets = {v for t in truths for v in (t.phi or {}).values() if v and len(str(v)) >= 4}
  secrets |= {t.study_uid for t in truths if t.study_uid} | {t.series_uid for t in truths if t.series_uid}
  assert secrets
  blob = b"".join(open(p, "rb").read() for p in glob.glob(os.path.join(out, "**", "*"), recursive=True)
                  if os.path.isfile(p))
  leaked = [s for s in secrets if str(s).encode() in blob]
  assert not leaked


def test_splits_are_per_patient(tree, converted):
  _, m, rows = converted
  by_patient = collections.defaultdict(set)
  for split, r in rows:
    by_patient[r["patient_id"]].add(split)
  # every patient with a good series, by its salted id (the hard-coded 3 held for any 3 patients)
  patients = {salted_hash(SALT, "patient", t.patient_id) for t in tree[1] if t.expected == ct.VOLUME}
  assert set(by_patient) == patients
  assert len(patients) > 1
  assert all(len(s) == 1 for s in by_patient.values())
  # Splits no patient landed in are left out (TFDS cannot describe an empty split) and named in a warning.
  filled = {split for split, _ in rows}
  assert set(m.splits) == filled
  assert filled <= {"train", "validation", "test"}
  empty = sorted({"train", "validation", "test"} - filled)
  assert not empty or f"empty splits left out: {', '.join(empty)} (no records)" in m.warnings


def test_split_assignment_follows_the_fractions():
  splits = ct_volumes.parse_splits("train=0.8,validation=0.1,test=0.1")
  counts = collections.Counter(ct_volumes.split_of(salted_hash("s", str(i)), splits) for i in range(5000))
  assert abs(counts["train"] / 5000 - 0.8) < 0.03
  assert abs(counts["test"] / 5000 - 0.1) < 0.02


def test_equal_to_simpleitk_on_regular_series(tree, converted):
  """SimpleITK's ImageSeriesReader as an independent reference, where it is right: plain
  single-frame series without padding, with the series' own files (it groups by series UID
  only and would mix in scouts and phases; it ignores PixelPaddingValue)."""
  _, truths = tree
  _, _, rows = converted
  regular = [t for t in truths if t.expected == ct.VOLUME and t.pixel_padding_value is None
             and len(t.files) == t.hu.shape[0] and t.hu.shape[0] > 1]
  assert len(regular) >= 6  # ascending/descending, oblique, phases, J2K, JPEG-LS, JPEG Lossless, slopes
  for t in regular:
    reader = sitk.ImageSeriesReader()
    # GDCM's own IPP sorting of exactly this series' files
    names = [n for n in sitk.ImageSeriesReader.GetGDCMSeriesFileNames(os.path.dirname(t.files[0]), t.series_uid)
             if os.path.abspath(n) in set(t.files)]
    if len(names) != len(t.files):  # the series spans several folders of the tree
      names = sorted(t.files, key=lambda f: float(
          np.cross(*np.reshape(pydicom.dcmread(f, stop_before_pixels=True).ImageOrientationPatient, (2, 3)))
          @ np.asarray(pydicom.dcmread(f, stop_before_pixels=True).ImagePositionPatient, float)))
    reader.SetFileNames(names)
    image = reader.Execute()
    ref = sitk.GetArrayFromImage(image)
    (r,) = _match(t, rows)
    np.testing.assert_array_equal(r["volume"].astype(np.float64), ref.astype(np.float64), err_msg=t.name)
    np.testing.assert_allclose(r["spacing"][::-1], image.GetSpacing(), rtol=1e-5)
    np.testing.assert_allclose(r["origin"], image.GetOrigin(), atol=1e-3)
    np.testing.assert_allclose(r["direction"].ravel(), image.GetDirection(), atol=1e-6)


def test_int16_forced_rounds_and_tfds_loads_it(tree, tmp_path):
  import tensorflow_datasets as tfds  # TensorFlow: loaded by this test only

  root, truths = tree
  out = str(tmp_path / "out")
  m = convert(root, out, "--volume_dtype=int16", "--format=tfrecord", "--splits=train=1.0")
  assert m.features["volume"].dtype == "int16"
  builder = tfds.builder_from_directory(out)
  rows = list(tfds.as_numpy(builder.as_dataset(split="train")))
  assert len(rows) == m.num_records == sum(t.expected == ct.VOLUME for t in truths)
  for r in rows:
    assert r["volume"].dtype == np.int16
    assert r["volume"].shape[0] == r["num_slices"]
    assert r["spacing"].shape == (3,)
    assert r["direction"].shape == (3, 3)


def test_reruns_are_byte_identical(tree, converted, tmp_path):
  out, m, _ = converted
  again = str(tmp_path / "again")
  m2 = convert(tree[0], again, "--splits=train=0.5,validation=0.25,test=0.25")
  assert [s.sha256 for sp in m.splits.values() for s in sp.shards] == [
      s.sha256 for sp in m2.splits.values() for s in sp.shards]
  assert verify_output(again, m2) == 0


def test_a_series_unit_carries_its_split_key_and_size(tree):
  root, truths = tree
  t = next(t for t in truths if t.expected == ct.VOLUME and len(t.files) == t.hu.shape[0])
  slices = [s for f in t.files for s in read_slices(open(f, "rb"), f, SALT)]
  (plan,), _ = plan_volumes(slices)
  splits = ct_volumes.parse_splits("train=0.5,validation=0.25,test=0.25")
  unit = plan_unit(plan, splits, "int16")
  assert (unit.split, unit.key, unit.unit) == (ct_volumes.split_of(plan.patient_id, splits), plan.key, plan)
  assert unit.nbytes == t.hu.size * 2
  assert plan_unit(plan, splits, "float32").nbytes == t.hu.size * 4


class _Pcollections(PipelineVisitor):
  """Every PCollection of a pipeline, with the label of the step that makes it, except those inside a
  CombinePerKey (the runner replaces that step's inside by its lifted combine: a probe there breaks it)."""

  def __init__(self):
    self.found: list[tuple[str, beam.PCollection]] = []

  def visit_value(self, value, producer_node):
    node = producer_node
    while node is not None:
      if isinstance(node.transform, beam.CombinePerKey):
        return
      node = node.parent
    if isinstance(value, beam.PCollection):
      self.found.append((producer_node.full_label, value))


class _ElementBytes(beam.DoFn):
  """Records the pickled size of each element of one PCollection in a distribution named after it."""

  def __init__(self, label: str):
    self._label = label

  def process(self, element):
    if isinstance(element, tuple) and len(element) == 2 and not isinstance(element[1], (bytes, str)) and hasattr(
        element[1], "__iter__") and not hasattr(element[1], "_fields"):
      element = (element[0], list(element[1]))  # a GroupByKey's values: materialized to be pickled
    Metrics.distribution("element_bytes", self._label).update(len(pickle.dumps(element, pickle.HIGHEST_PROTOCOL)))


def test_no_volume_crosses_a_stage(tmp_path, monkeypatch):
  """Each series is read, assembled, encoded and written in its shard's one step: no element of any
  PCollection of the job (headers, plans, shard tasks, results, side inputs) comes near one volume's
  bytes. Every PCollection the converter builds gets a probe that pickles each element."""
  src = str(tmp_path / "in")
  for k in range(3):
    ct.write_big_series(os.path.join(src, f"s{k}"), 48, rows=256, cols=256, seed=k)
  volume_bytes = 48 * 256 * 256 * 2  # int16: 6 MiB
  build = ct_volumes.CtVolumes.build
  probed: list[str] = []

  def probed_build(self, p, common, config):
    out = build(self, p, common, config)
    visitor = _Pcollections()
    p.visit(visitor)
    for i, (label, pcoll) in enumerate(visitor.found):
      probed.append(label)
      _ = pcoll | f"ElementBytes{i}" >> beam.ParDo(_ElementBytes(label))
    return out

  monkeypatch.setattr(ct_volumes.CtVolumes, "build", probed_build)
  out = str(tmp_path / "out")
  result = ct_volumes.run([f"--input={src}", f"--output={out}", f"--id_salt={SALT}", "--splits=train=1.0",
                           "--num_shards=1"])
  m = Manifest.loads(files.read_bytes(files.join(out, "manifest.json")))
  assert m.num_records == 3
  assert m.splits["train"].shards[0].num_bytes > 3 * volume_bytes
  sizes = {r.key.metric.name: r.committed.max
           for r in result.metrics().query(MetricsFilter().with_namespace("element_bytes"))["distributions"]}
  assert {"ReadHeaders/ParDo(_ReadHeadersFn)", "PlanVolumes/ParDo(_PlanFn)"} <= set(sizes) <= set(probed)
  assert any(name.startswith("Convert/") for name in sizes)  # the shards step (ConvertShards) was probed
  largest = max(sizes, key=sizes.get)
  assert sizes[largest] < volume_bytes // 8, (largest, sizes[largest])


def test_the_shard_count_moves_only_shard_boundaries(tree, converted, tmp_path):
  """Series are planned into shards before their pixels are read: more shards change where a split's
  records are cut, never the records or their order (series rejected while reading pixels included)."""
  out, m, _ = converted
  again = str(tmp_path / "three")
  m3 = convert(tree[0], again, "--splits=train=0.5,validation=0.25,test=0.25", "--num_shards=3")

  def concatenated(folder, manifest):
    by_split = collections.defaultdict(list)
    for split_name, split in manifest.splits.items():
      for shard in split.shards:
        by_split[split_name] += list(arrayrecord.read_file(files.join(folder, shard.path)))
    return dict(by_split)

  assert {n: len(s.shards) for n, s in m3.splits.items()} != {n: len(s.shards) for n, s in m.splits.items()}
  assert concatenated(again, m3) == concatenated(out, m)
  assert errors(again) == errors(out)


@pytest.mark.gcs
def test_on_the_gcs_emulator(tree, converted, gcs_emulator):
  root, _ = tree
  out, m, _ = converted
  src = f"gs://{gcs_emulator}/ct/dicom"  # the same folder name: the same dataset name
  upload_tree(root, src)
  gout = f"gs://{gcs_emulator}/ct/out"
  gm = convert(src, gout, "--splits=train=0.5,validation=0.25,test=0.25")
  assert {os.path.basename(s.path): s.sha256 for sp in gm.splits.values() for s in sp.shards} == {
      os.path.basename(s.path): s.sha256 for sp in m.splits.values() for s in sp.shards}
  assert gm.rejected.count == m.rejected.count
  assert verify_output(gout, gm) == 0


def sample_input(base: str) -> tuple[str, list[str]]:
  """A small input for registry-driven tests (tests/pipelines/test_registry.py): (folder, own flags)."""
  root = os.path.join(base, "dicom")
  ct.make_mixed_tree(root, seed=1)
  return root, [f"--id_salt={SALT}"]


def test_a_series_of_two_geometries_gives_two_volumes(tmp_path):
  """One SeriesInstanceUID holding an axial and a coronal stack (one frame of reference): two volumes with
  keys of their own, each its true volume, not a job that stops on a repeated record key."""
  src, out = str(tmp_path / "in"), str(tmp_path / "out")
  rng = np.random.default_rng(5)
  study, series, frame = (pydicom.uid.generate_uid() for _ in range(3))
  truths = [ct.write_series(src, patient_id="P1", rng=rng, study_uid=study, series_uid=series, frame_uid=frame,
                            orientation=orientation, subdir=name, num_slices=6, rows=16, cols=16)
            for name, orientation in (("axial", ct.AXIAL), ("coronal", ct.CORONAL))]
  m = convert(src, out, "--splits=train=1.0")
  rows = records(out, m)
  assert m.num_records == 2 and m.rejected.count == 0
  for t in truths:
    assert len(_match(t, rows)) == 1, t.name
