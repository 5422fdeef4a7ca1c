"""ct_volumes from a DICOM store: a real Orthanc with its DICOMweb plugin, against the same files in a folder."""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import shutil

import pydicom
import pytest
import requests

from formats.manifest import Manifest
from formats.storage import files
from pipelines import ct_volumes
from pipelines.core import UsageError, inputs
from pipelines.ct_volumes import dicomweb
from pipelines.ct_volumes.headers import salted_hash
from pipelines.ct_volumes.pipeline import _retrieved, _SeriesUnusable, _StoreOpener
from scripts import make_sample_ct as ct
from scripts import make_sample_ct_labels as ctl
from scripts import orthanc
from tests.gcs_faults import FaultProxy
from tests.pipelines.test_ct_syntaxes import SYNTAXES, build_series

SALT = "test-salt"
BOUNDARY = "b0undary"
CT = f'multipart/related; type="application/dicom"; boundary={BOUNDARY}'


# ---------------------------------------------------------------- the pure parts

def _body(*parts: bytes, close: bool = True) -> bytes:
  out = b"".join(b"--" + BOUNDARY.encode() + b"\r\nContent-Type: application/dicom\r\n\r\n" + p + b"\r\n"
                 for p in parts)
  return out + (b"--" + BOUNDARY.encode() + b"--\r\n" if close else b"")


def test_a_multipart_body_splits_into_its_parts_bytes_exactly():
  parts = [b"DICM\r\n--b0undar", b"", bytes(range(256)) * 3]  # a near-delimiter inside a part stays in it
  assert [p for _, p in dicomweb.split_multipart(_body(*parts), CT)] == parts
  assert [m for m, _ in dicomweb.split_multipart(_body(b"x"), CT)] == ["application/dicom"]


@pytest.mark.parametrize("lengths", [(15, 0, 768), (3, 99, 1 << 20), ("x", "", "-1")])
def test_a_parts_content_length_is_checked_not_trusted(lengths):
  parts = [b"DICM\r\n--b0undar", b"", bytes(range(256)) * 3]
  body = b"".join(b"--" + BOUNDARY.encode() + f"\r\nContent-Type: application/dicom\r\nContent-Length: {n}\r\n\r\n"
                  .encode() + p + b"\r\n" for p, n in zip(parts, lengths)) + b"--" + BOUNDARY.encode() + b"--"
  assert [p for _, p in dicomweb.split_multipart(body, CT)] == parts  # right (the first case) or wrong, the same


@pytest.mark.parametrize("cut", [1, 10, 60, -3])
def test_a_body_cut_anywhere_before_its_closing_delimiter_is_transient(cut):
  body = _body(b"a" * 20, b"b" * 20)
  with pytest.raises(dicomweb.TruncatedBody):
    dicomweb.split_multipart(body[:cut] if cut > 0 else body[:-len(BOUNDARY) - 6 + cut], CT)


@pytest.mark.parametrize("content_type, body", [
    ("application/dicom+json", b"[]"),  # not multipart
    ('multipart/related; type="application/dicom"', _body(b"x")),  # no boundary
    (CT, b"garbage without any delimiter"),
    (CT, b"--" + BOUNDARY.encode() + b"XX\r\n\r\nabc"),  # a delimiter not followed by a line break
])
def test_a_malformed_body_is_named(content_type, body):
  with pytest.raises(dicomweb.MalformedBody):
    dicomweb.split_multipart(body, content_type)


def test_filters_split_into_study_and_series_searches():
  study, series = dicomweb.parse_filter("ModalitiesInStudy=CT&StudyDate=20260101-20260131&Modality=CT")
  assert study == (("ModalitiesInStudy", "CT"), ("StudyDate", "20260101-20260131"))
  assert series == (("Modality", "CT"),)
  assert dicomweb.parse_filter("") == ((), ())


@pytest.mark.parametrize("text, message", [
    ("StudyDate", "query parameters joined by &"),
    ("PatientID=MRN12345&StudyDate", "joined by &, .*: piece 2 of 2 is not key=value"),
    ("limit=5", "set by the listing"),
    ("NotAKeyword=1", "neither a DICOM keyword"),
])
def test_a_bad_filter_is_a_usage_error(text, message):
  with pytest.raises(UsageError, match=message) as e:
    dicomweb.parse_filter(text)
  assert "MRN12345" not in str(e.value)  # a filter's values may be PHI: never quoted


def test_a_store_url_with_a_user_or_password_is_refused_without_quoting_them():
  """The URL prefixes every path the output records (rejects, plans, the manifest's input, logs)."""
  for url in ("http://alice:s3cret@pacs:8042/dicom-web", "http://alice@pacs:8042/dicom-web"):
    with pytest.raises(UsageError, match="carries no user or password") as e:
      dicomweb.store_config(url, "none", "", "", 10)
    assert "alice" not in str(e.value) and "s3cret" not in str(e.value)


def test_store_flags_are_checked():
  assert dicomweb.store_config("https://healthcare.googleapis.com/v1/projects/p/locations/l/datasets/d/dicomStores/"
                               "s/dicomWeb", "auto", "", "", 10).auth == "google"
  assert dicomweb.store_config("http://pacs:8042/dicom-web/", "auto", "", "", 10).url == "http://pacs:8042/dicom-web"
  for args, message in [(("http://pacs/dicom-web?x=1", "none", "", ""), "no query"),
                        (("http://pacs/dicom-web", "basic", "", ""), "needs --dicomweb_credentials"),
                        (("http://pacs/dicom-web", "none", "c.json", ""), "only with --dicomweb_auth=basic")]:
    with pytest.raises(UsageError, match=message):
      dicomweb.store_config(*args, 10)
  assert dicomweb.store_name("https://healthcare.googleapis.com/v1/projects/p/locations/l/datasets/d/dicomStores/"
                             "ct-store/dicomWeb") == "ct-store"
  assert dicomweb.store_name("http://pacs:8042/dicom-web") == "dicom-web"


def test_store_urls_lose_their_uids_in_errors():
  text = "503 for url: http://h/dicom-web/studies/1.2.3/series/4.5.6?StudyInstanceUID=7.8&PatientID=MRN42 (x)"
  assert dicomweb.redact(text) == ("503 for url: http://h/dicom-web/studies/{uid}/series/{uid}?StudyInstanceUID={uid}"
                                   "&PatientID={uid} (x)")


def test_a_requests_http_error_is_classified_by_its_status():
  from formats.storage import retry

  def error(status):
    r = requests.Response()
    r.status_code = status
    return requests.HTTPError(response=r)

  assert [retry.is_transient(error(s)) for s in (429, 503, 500, 408, 404, 401, 403)] == [True] * 4 + [False] * 3


# ---------------------------------------------------------------- a real store

def _convert(src: str, out: str, *flags: str) -> Manifest:
  ct_volumes.run([f"--input={src}", f"--output={out}", f"--id_salt={SALT}", "--name=ct",
                  "--splits=train=0.5,validation=0.25,test=0.25", *flags])
  return Manifest.loads(files.read_bytes(files.join(out, "manifest.json")))


def _store_path(url: str, path: str) -> str:
  ds = pydicom.dcmread(path, stop_before_pixels=True)
  return dicomweb.instance_path(url, SALT, ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.SOPInstanceUID)


def _rejects(out: str, m: Manifest, rename=lambda p: p) -> list[tuple]:
  rows = [json.loads(line) for line in files.read_bytes(files.join(out, m.rejected.path)).splitlines()]
  return sorted((rename(r["input"]), r["reason"], r.get("split"), r.get("units")) for r in rows)


def _shards(m: Manifest) -> dict:
  return {s.path.rsplit("/", 1)[-1]: s.sha256 for sp in m.splits.values() for s in sp.shards}


def _normalised(m: Manifest) -> str:
  """The manifest without what names the run's input and generation folder."""
  d = m.to_json()
  d["source"].pop("input")
  text = json.dumps(d, sort_keys=True)
  for gen in {x.path.split("/", 1)[0] for sp in m.splits.values() for x in sp.shards} | {m.rejected.path.split("/")[0]}:
    text = text.replace(gen, "GEN")
  return text


@pytest.fixture(scope="module")
def store(tmp_path_factory):
  if not orthanc.available():
    pytest.fail("Orthanc and its DICOMweb plugin are needed: scripts/run_tests.sh installs them (apt, as root)")
  base = tmp_path_factory.mktemp("store")
  root = str(base / "dicom")
  truths = ct.make_mixed_tree(root, seed=3)
  for key in SYNTAXES:  # real vendor pixels (693_UNCR, CT_small) in every transfer syntax of the matrix
    build_series(os.path.join(root, "syntaxes", key), key)
  paths = sorted(p for p in glob.glob(f"{root}/**/*", recursive=True) if os.path.isfile(p))
  with orthanc.Orthanc(str(base / "orthanc")) as o:
    stored = o.upload(paths)
    folder = str(base / "stored")  # the same instances as the store holds, as files
    for p in stored:
      dst = os.path.join(folder, os.path.relpath(p, root))
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      shutil.copy(p, dst)
    yield o, folder, {os.path.join(folder, os.path.relpath(p, root)): i for p, i in stored.items()}, truths


@pytest.fixture(scope="module")
def both(store, tmp_path_factory):
  o, folder, _, _ = store
  base = tmp_path_factory.mktemp("both")
  from_folder = _convert(folder, str(base / "folder"))
  from_store = _convert(o.dicomweb, str(base / "store"))
  return (str(base / "folder"), from_folder), (str(base / "store"), from_store)


@pytest.mark.slow
def test_the_store_gives_byte_for_byte_the_folders_output(store, both):
  o, folder, stored, _ = store
  (fout, fm), (sout, sm) = both
  assert len(stored) > 150
  # Orthanc took the series of every transfer syntax of the matrix, supported or not (those are rejects).
  assert {k for k in SYNTAXES if any(f"/syntaxes/{k}/" in p for p in stored)} == set(SYNTAXES)
  assert fm.num_records > 5
  assert _shards(sm) == _shards(fm)
  assert sm.rejected.count == fm.rejected.count > 0
  assert _rejects(sout, sm) == _rejects(fout, fm, lambda p: _store_path(o.dicomweb, p))
  assert _normalised(sm) == _normalised(fm)


@pytest.mark.slow
def test_no_identifier_or_phi_in_any_output_byte_or_log_line(store, both, tmp_path, caplog):
  o, _, stored, truths = store
  secrets = {v for t in truths for v in (t.phi or {}).values() if v and len(str(v)) >= 4}
  for p in stored:
    ds = pydicom.dcmread(p, stop_before_pixels=True)
    secrets |= {ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.SOPInstanceUID}
  with caplog.at_level(logging.DEBUG):
    _convert(o.dicomweb, str(tmp_path / "out"))
  _, (sout, _) = both
  blob = b"".join(open(p, "rb").read() for root in (sout, str(tmp_path / "out"))
                  for p in glob.glob(os.path.join(root, "**", "*"), recursive=True) if os.path.isfile(p))
  logged = "\n".join(r.getMessage() for r in caplog.records)
  assert not [s for s in secrets if str(s).encode() in blob]
  assert not [s for s in secrets if str(s) in logged]


@pytest.mark.slow
def test_small_pages_list_the_same_store(store, both, tmp_path):
  o, _, _, _ = store
  _, (_, sm) = both
  m = _convert(o.dicomweb, str(tmp_path / "out"), "--dicomweb_page_size=2")
  assert _shards(m) == _shards(sm)
  assert m.rejected.count == sm.rejected.count


@pytest.mark.slow
def test_a_filter_lists_only_its_patient_and_writes_or_logs_no_value_of_it(store, tmp_path, caplog):
  o, _, stored, _ = store
  patient = "SYN0001"
  n = sum(pydicom.dcmread(p, stop_before_pixels=True).PatientID == patient for p in stored)
  with caplog.at_level(logging.DEBUG):
    m = _convert(o.dicomweb, str(tmp_path / "out"), f"--dicomweb_filter=PatientID={patient}&ModalitiesInStudy=CT")
  assert m.source["dicomweb_filter"] == {"PatientID": salted_hash(SALT, "dicomweb filter", patient),
                                         "ModalitiesInStudy": salted_hash(SALT, "dicomweb filter", "CT")}
  assert 0 < m.rejected.count + m.num_records <= n < len(stored)
  blob = b"".join(open(p, "rb").read() for p in glob.glob(str(tmp_path / "out" / "**" / "*"), recursive=True)
                  if os.path.isfile(p))
  assert patient.encode() not in blob
  assert patient not in "\n".join(r.getMessage() for r in caplog.records)


class _ExactFaults(FaultProxy):
  """The fault proxy, where a fault whose path starts with "=" matches only that exact path (a series'
  retrieval, not its instance search, which shares its prefix); `pass_first` requests of that path pass."""

  pass_first = 0

  def _take_fault(self, method, path):
    with self._lock:
      if any(f.path_contains == "=" + path for f in self._faults) and self.pass_first > 0:
        self.pass_first -= 1
        return None
      for f in self._faults:
        if f.path_contains.startswith("=") and path == f.path_contains[1:]:
          if f.times is not None:
            f.times -= 1
            if f.times <= 0:
              self._faults.remove(f)
          return f
    return super()._take_fault(method, path)


@pytest.fixture
def proxy(store):
  """An `_ExactFaults` proxy in front of the module's Orthanc, closed after the test."""
  p = _ExactFaults(store[0].url)
  yield p
  p.close()


def _a_series(stored) -> tuple[str, str]:
  ds = pydicom.dcmread(sorted(stored)[0], stop_before_pixels=True)
  return ds.StudyInstanceUID, ds.SeriesInstanceUID


@pytest.mark.slow
def test_503s_429s_drops_and_cut_bodies_are_retried_to_the_same_output(store, both, tmp_path, proxy):
  o, _, stored, _ = store
  _, (sout, sm) = both
  study, series = _a_series(stored)
  retrieval = f"=/dicom-web/studies/{study}/series/{series}"
  proxy.add_fault("/dicom-web/studies?", status=429, times=2)
  proxy.add_fault("/series?", status=503, times=1)
  proxy.add_fault("/series?", mode="drop", times=1)
  proxy.add_fault(retrieval, status=503, times=1)
  proxy.add_fault(retrieval, mode="cut", times=2)
  m = _convert(f"{proxy.host}/dicom-web", str(tmp_path / "out"))
  assert proxy.requests_seen(f"/dicom-web/studies/{study}/series/{series}", "GET") >= 3
  assert _shards(m) == _shards(sm)
  assert _rejects(str(tmp_path / "out"), m, lambda p: p.replace(proxy.host, o.url)) == _rejects(sout, sm)


@pytest.mark.slow
def test_a_storm_past_the_deadline_fails_the_run_and_writes_no_manifest(store, tmp_path, proxy):
  o, _, stored, _ = store
  study, series = _a_series(stored)
  proxy.add_fault(f"=/dicom-web/studies/{study}/series/{series}", status=503)
  with pytest.raises(Exception, match="retrieving a series") as e:
    _convert(f"{proxy.host}/dicom-web", str(tmp_path / "out"), "--transient_retry_seconds=2")
  shown = "".join(str(x) for x in (e.value, e.value.__cause__, e.value.__context__))
  assert study not in shown and series not in shown
  assert not glob.glob(str(tmp_path / "out" / "**" / "manifest.json"), recursive=True)


@pytest.mark.slow
def test_credentials_refused_in_the_shard_step_fail_the_run_not_the_series(store, tmp_path, proxy):
  o, _, stored, _ = store
  study, series = _a_series(stored)
  proxy.pass_first = 1  # the header stage's retrieval passes; the shard step's is refused
  proxy.add_fault(f"=/dicom-web/studies/{study}/series/{series}", status=401)
  with pytest.raises(Exception, match="401"):
    _convert(f"{proxy.host}/dicom-web", str(tmp_path / "out"))
  assert not glob.glob(str(tmp_path / "out" / "**" / "manifest.json"), recursive=True)


def test_a_listing_that_repeats_results_lists_each_once_and_one_that_ignores_offset_fails():
  s = dicomweb.Store(dicomweb.StoreConfig(url="http://store/dicom-web", page_size=2), inputs.ReadPolicy())
  results = [{"0020000D": {"Value": [f"1.2.{i}"]}} for i in range(5)]
  shifted = lambda limit, offset: (results[:1] + results)[offset:offset + limit]  # a study inserted at the front
  assert [r["0020000D"]["Value"][0] for r in s._search(shifted, "studies", "0020000D")] == [
      f"1.2.{i}" for i in range(5)]
  stuck = lambda limit, offset: results[:limit]  # offset ignored
  with pytest.raises(RuntimeError, match="does not page with offset"):
    list(s._search(stuck, "studies", "0020000D"))


@pytest.mark.slow
def test_an_append_from_the_store_adds_only_new_series(store, both, tmp_path):
  o, _, stored, _ = store
  _, (sout, sm) = both
  patients = sorted({pydicom.dcmread(p, stop_before_pixels=True).PatientID for p in stored})
  out = str(tmp_path / "out")
  first = _convert(o.dicomweb, out, f"--dicomweb_filter=PatientID={patients[0]}")
  for p in patients[1:]:
    _convert(o.dicomweb, out, "--mode=append", f"--dicomweb_filter=PatientID={p}")
  again = _convert(o.dicomweb, out, "--mode=append")  # the whole store: every series is held already
  assert 0 < first.num_records < again.num_records == sm.num_records
  assert again.rejected.count == sm.rejected.count


@pytest.mark.slow
def test_a_series_the_store_lists_but_does_not_serve_is_rejected_whole(store, both, tmp_path, proxy):
  o, _, stored, _ = store
  _, (sout, sm) = both
  study, series = _a_series(stored)
  n = sum(_a_series([p]) == (study, series) for p in stored)
  prefix = dicomweb.series_path(o.dicomweb, SALT, study, series)
  n_rejected = sum(r[0].startswith(prefix) for r in _rejects(sout, sm))
  proxy.add_fault(f"=/dicom-web/studies/{study}/series/{series}", status=404)
  m = _convert(f"{proxy.host}/dicom-web", str(tmp_path / "out"))
  rows = [r for r in _rejects(str(tmp_path / "out"), m) if "does not serve it (HTTP 404)" in r[1]]
  assert [r[0] for r in rows] == [dicomweb.series_path(f"{proxy.host}/dicom-web", SALT, study, series)]
  # Its instances are neither records nor rejects of their own: the series counts as one input, rejected.
  assert m.rejected.count == sm.rejected.count - n_rejected + 1
  assert m.num_records == sm.num_records - (n - n_rejected > 0)


@pytest.mark.slow
def test_a_series_that_changes_after_its_listing_is_never_a_shorter_volume(store, tmp_path):
  o, _, stored, _ = store
  by_series = {}
  for p in sorted(stored):
    by_series.setdefault(_a_series([p]), []).append(p)
  (study, series), paths = max(by_series.items(), key=lambda kv: len(kv[1]))
  s = dicomweb.Store(dicomweb.store_config(o.dicomweb, "none", "", "", 100), inputs.ReadPolicy(retry_seconds=5))
  listed = next(x for x in s.series_of(study) if x.series == series)
  assert listed.num_instances == len(paths)
  held = _retrieved(s, SALT, listed)  # the header stage's retrieval
  assert [p for p, _ in held] == sorted(_store_path(o.dicomweb, p) for p in paths)
  headers_seen = dataclasses.replace(listed, parts=dicomweb.parts_digest(p for p, _ in held))
  opener = _StoreOpener(s, SALT, {dicomweb.series_path(o.dicomweb, SALT, study, series): headers_seen})
  extra = pydicom.dcmread(paths[0])  # an instance that was not there when the series was listed
  extra.SOPInstanceUID = extra.file_meta.MediaStorageSOPInstanceUID = pydicom.uid.generate_uid()
  extra.save_as(str(tmp_path / "extra.dcm"))
  try:
    o.delete_instance(stored[paths[-1]])  # one gone
    with pytest.raises(_SeriesUnusable, match=f"{len(paths)} listed, {len(paths) - 1} parts retrieved"):
      _retrieved(s, SALT, listed)
    with pytest.raises(inputs.Unreadable, match="does not hold the instances its search counted"):
      opener(_store_path(o.dicomweb, paths[0]))
    extra_id = o.upload([str(tmp_path / "extra.dcm")])[str(tmp_path / "extra.dcm")]  # and one other in its place
    with pytest.raises(_SeriesUnusable, match="instances in the store changed during the run") as e:
      _retrieved(s, SALT, headers_seen)  # as many as listed, but not the ones the header stage read
    assert len(e.value.paths) == len(paths)
    o.upload([paths[-1]])  # one more than listed
    with pytest.raises(_SeriesUnusable, match=f"{len(paths)} listed, {len(paths) + 1} parts retrieved"):
      _retrieved(s, SALT, listed)
    o.delete_instance(extra_id)
    assert [p for p, _ in _retrieved(s, SALT, headers_seen)] == [p for p, _ in held]  # as it was: usable again
  finally:
    o.upload([paths[-1]])


@pytest.mark.slow
def test_segmentations_in_the_store_label_its_volumes_as_in_a_folder(tmp_path):
  if not orthanc.available():
    pytest.fail("Orthanc and its DICOMweb plugin are needed: scripts/run_tests.sh installs them (apt, as root)")
  folder = str(tmp_path / "labelled")
  truth = ct.write_series(os.path.join(folder, "series"), patient_id="SYNLAB01", seed=5, rows=32, cols=32,
                          num_slices=10)
  shape = truth.hu.shape
  ctl.write_seg(truth, os.path.join(folder, "seg.dcm"), [ctl.ellipsoid(shape, (5, 14, 12), (3, 6, 8))], ["liver"],
                seed=5)
  label_map = tmp_path / "map.json"
  label_map.write_text(json.dumps({"liver": 1}))
  flags = ["--label_sources=seg", f"--label_map={label_map}"]
  with orthanc.Orthanc(str(tmp_path / "orthanc")) as o:
    assert len(o.upload(sorted(p for p in glob.glob(f"{folder}/**/*", recursive=True) if os.path.isfile(p)))) == (
        len(truth.files) + 1)
    sm = _convert(o.dicomweb, str(tmp_path / "store"), *flags)
    with pytest.raises(UsageError, match="nifti labels need a folder input"):
      _convert(o.dicomweb, str(tmp_path / "nifti"), "--label_sources=nifti")
  fm = _convert(folder, str(tmp_path / "folder"), *flags)
  assert sm.rejected.count == fm.rejected.count == 0
  assert _shards(sm) == _shards(fm)


@pytest.mark.slow
@pytest.mark.parametrize("flag, message", [
    ("--dicomweb_filter=limit=3", "set by the listing"),
    ("--dicomweb_auth=basic", "needs --dicomweb_credentials"),
])
def test_bad_store_flags_write_nothing(store, tmp_path, flag, message):
  o, _, _, _ = store
  with pytest.raises(UsageError, match=message):
    _convert(o.dicomweb, str(tmp_path / "out"), flag)
  assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_a_url_that_is_no_dicomweb_service_is_a_usage_error(store, tmp_path):
  o, _, _, _ = store
  with pytest.raises(UsageError, match="HTTP 404"):
    _convert(f"{o.url}/not-dicom-web", str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_basic_credentials_from_a_file(tmp_path):
  if not orthanc.available():
    pytest.fail("Orthanc and its DICOMweb plugin are needed: scripts/run_tests.sh installs them (apt, as root)")
  folder = str(tmp_path / "series")
  ct.write_series(folder, patient_id="SYNAUTH1", seed=7, rows=16, cols=16, num_slices=4)
  good, bad = tmp_path / "good.json", tmp_path / "bad.json"
  good.write_text(json.dumps({"username": "reader", "password": "s3cret"}))
  bad.write_text(json.dumps({"username": "reader", "password": "wrong"}))
  with orthanc.Orthanc(str(tmp_path / "orthanc"), users={"reader": "s3cret"}) as o:
    assert len(o.upload(sorted(glob.glob(f"{folder}/*")))) == 4
    m = _convert(o.dicomweb, str(tmp_path / "out"), "--dicomweb_auth=basic", f"--dicomweb_credentials={good}")
    assert m.rejected.count == 0 and _shards(m)
    with pytest.raises(UsageError, match="HTTP 401"):
      _convert(o.dicomweb, str(tmp_path / "out2"), "--dicomweb_auth=basic", f"--dicomweb_credentials={bad}")
    with pytest.raises(UsageError, match="HTTP 401"):
      _convert(o.dicomweb, str(tmp_path / "out3"))
  log = b"".join(open(p, "rb").read() for p in glob.glob(str(tmp_path / "out" / "**" / "*"), recursive=True)
                 if os.path.isfile(p))
  assert b"s3cret" not in log


@pytest.mark.slow
def test_the_dataflow_job_of_a_store_input_stages_the_client_and_keeps_credentials_out(tmp_path, gcs_emulator,
                                                                                       dataflow_staging):
  from pipelines import registry
  from pipelines.core import launch
  from tests.pipelines.test_dataflow import _staged, dataflow_flags

  folder = str(tmp_path / "series")
  ct.write_series(folder, patient_id="SYNDF001", seed=9, rows=16, cols=16, num_slices=4)
  local_creds = tmp_path / "creds.json"
  local_creds.write_text(json.dumps({"username": "reader", "password": "df-s3cret"}))
  creds = f"gs://{gcs_emulator}/secrets/pacs.json"
  files.write_bytes(creds, local_creds.read_bytes())
  with orthanc.Orthanc(str(tmp_path / "orthanc"), users={"reader": "df-s3cret"}) as o:
    o.upload(sorted(glob.glob(f"{folder}/*")))
    flags = [f"--input={o.dicomweb}", f"--output=gs://{gcs_emulator}/df/out_dicomweb", f"--id_salt={SALT}",
             "--dicomweb_auth=basic", "--dicomweb_filter=ModalitiesInStudy=CT", *dataflow_flags(gcs_emulator)]
    with pytest.raises(UsageError, match="must be on gs:// on Dataflow"):
      launch.run(registry.converter("ct_volumes"), [*flags, f"--dicomweb_credentials={local_creds}"])
    result = launch.run(registry.converter("ct_volumes"), [*flags, f"--dicomweb_credentials={creds}"])
  job = result.job
  requirements = dataflow_staging["requirements"].split()
  assert not os.path.exists(dataflow_staging["folder"])
  assert {"dicomweb-client", "pydicom"} <= {r.split("==")[0] for r in requirements}
  assert any(n.startswith("tpu_shards-") and n.endswith(".whl") for n in _staged(job))
  steps = {t.unique_name for t in job.proto_pipeline.components.transforms.values()}
  assert {"SearchStudies", "SearchSeries", "ReadSeriesHeaders", "PlanVolumes", "Convert", "Finalize"} <= steps
  from apache_beam.options.pipeline_options import DebugOptions
  assert "disable_always_on_exception_sampling" in job.options.view_as(DebugOptions).experiments
  graph = job.proto_pipeline.SerializeToString()
  assert b"df-s3cret" not in graph  # the credentials file is read by each worker: its content is not in the job
