"""DICOM CT series → Hounsfield-unit 3D volumes in ArrayRecord or TFRecord shards.

    python -m pipelines.ct_volumes --input=DIR_OR_GS --output=DIR_OR_GS --id_salt=SECRET \
        [--format=array_record|tfrecord] [--num_shards=N] \
        [--splits=train=0.8,validation=0.1,test=0.1] [--name=NAME] \
        [--volume_dtype=auto|int16|float32] [--slice_tolerance=0.01] [any Beam option]

The input is any tree of files: many patients, studies and series mixed,
meaningless names, non-DICOM files. Headers are read first (no pixel data) and
grouped into candidate series; each series is planned (sorted along its slice
normal, checked for missing slices, irregular spacing, tilt and duplicates).
The plans are the work units of a shard plan (`pipelines.core.shards`): one
step per shard reads, assembles, encodes and writes its series, so no volume
crosses a stage boundary (docs/ct_volumes.md, "How the job runs"). One record per
volume: `volume` ([depth, rows, columns] HU), `spacing` (z, y, x mm), `origin`
(LPS mm of voxel [0, 0, 0]), `direction` (3x3, columns = the directions of the
column, row and slice axes), `num_slices`, `series_id`, `patient_id` (salted
hashes), `sorted_by`. Every file that does not end up in a volume is listed in
errors/rejected.jsonl with its reason. Splits are assigned per patient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import collections
import dataclasses
import io
import json
import logging
import os
import posixpath
import re

import apache_beam as beam
from apache_beam.options.pipeline_options import DebugOptions, PipelineOptions
import numpy as np
import pydicom

from formats import naming
from formats.features import Features, Tensor, Text
from formats.storage import files
from pipelines.core import dataflow, flags, inputs
from pipelines.core.converter import (
    Converter, OutputPlan, Sources, UnitConverter, Units, appended_feature, counters)
from pipelines.core.errors import UsageError
from pipelines.core.flags import CommonConfig
from pipelines.core.records import Event, Record, Reject
from pipelines.core.shards import ListedOnWorkers, PlanUnit
from pipelines.ct_volumes.assembly import (
    DEFAULT_TOLERANCE, MAX_VOLUME_VOXELS, SeriesRejected, VolumePlan, frames_per_file, plan_volumes, read_volume,
    stack_count)
from pipelines.ct_volumes.headers import (
    MAX_FILE_BYTES, SliceRejected, quiet_pydicom, read_file_meta, read_slices, salted_hash)
from pipelines.ct_volumes import dicomweb
from pipelines.ct_volumes import labels as labels_lib
from pipelines.ct_volumes.labels import LABEL_SOURCES, LabelConfig, LabelHeader, LabelRejected

NAME = "ct_volumes"
PIPELINE = f"pipelines.{NAME}"
DEFAULT_SPLITS = "train=0.8,validation=0.1,test=0.1"
EMPTY_LABEL = "empty_label"  # the Event of a volume written with a label that has no foreground
_log = logging.getLogger(PIPELINE)


class CtVolumesOptions(PipelineOptions):
  """Flags of `pipelines.ct_volumes` beyond the shared ones (`core.flags.ConverterOptions`)."""

  @classmethod
  def _add_argparse_args(cls, parser):
    parser.add_argument("--id_salt", help="Secret salt for the patient/series hashes (required).")
    parser.add_argument("--splits", default=DEFAULT_SPLITS, help="name=fraction,...; assigned per patient.")
    parser.add_argument("--volume_dtype", default="auto", choices=("auto", "int16", "float32"),
                        help="auto (int16, float32 if a rescale is not integral), int16 or float32.")
    parser.add_argument("--slice_tolerance", type=flags.fraction(0, 0.5), default=DEFAULT_TOLERANCE,
                        help="Largest relative deviation of a slice gap from the mean spacing.")
    parser.add_argument("--max_file_bytes", type=flags.integer(1), default=MAX_FILE_BYTES,
                        help="Largest decoded pixel data of one DICOM file (Rows x Columns x frames x "
                             "BitsAllocated / 8), checked from the header before any pixel is read.")
    parser.add_argument("--max_volume_voxels", type=flags.integer(1), default=MAX_VOLUME_VOXELS,
                        help="Largest volume in voxels; a larger series is rejected before any pixel is read.")
    parser.add_argument("--label_sources", default="",
                        help="Label masks to convert with each volume: a comma list of seg (DICOM SEG), rtstruct "
                             "(RT Structure Set contours), nifti (.nii/.nii.gz label maps), or auto (all three). "
                             "Empty: volumes only. With labels, a series without a label is a reject.")
    parser.add_argument("--label_map", default="",
                        help="JSON file (local or gs://): {segment label or ROI name: class id 1..65535, or 0 to "
                             "leave the name out}; required for seg and rtstruct. A name it does not hold rejects "
                             "its label file.")
    parser.add_argument("--label_layout", default="classes", choices=("classes", "channels"),
                        help="classes: one class id per voxel (overlapping classes are a reject); channels: one 0/1 "
                             "channel per class id, [depth, rows, columns, classes].")
    parser.add_argument("--label_nifti_map", default="",
                        help="JSON file: {NIfTI path relative to --input: its CT's SeriesInstanceUID}; without "
                             "it, a NIfTI label map belongs to the one series in its folder.")
    parser.add_argument("--dicomweb_filter", default="",
                        help="With a DICOMweb --input: QIDO-RS query parameters joined by &, e.g. "
                             "'ModalitiesInStudy=CT&StudyDate=20260101-20260131'; series attributes (Modality, "
                             "SeriesInstanceUID, ...) filter each study's series. Empty: the whole store.")
    parser.add_argument("--dicomweb_auth", default="auto", choices=dicomweb.AUTH_MODES,
                        help="With a DICOMweb --input: auto (google for healthcare.googleapis.com, else none), none, "
                             "google (application default credentials), basic or bearer (--dicomweb_credentials).")
    parser.add_argument("--dicomweb_credentials", default="",
                        help="JSON file (local or gs://) read by the launcher and each worker: {\"username\", "
                             "\"password\"} for basic, {\"token\"} for bearer. Never given on the command line.")
    parser.add_argument("--dicomweb_page_size", type=flags.integer(1), default=dicomweb.DEFAULT_PAGE_SIZE,
                        help="Results asked for per QIDO-RS page (limit); pages are read until one is empty.")
    parser.add_argument("--label_resample", type=flags.boolean, default=False,
                        help="Resample a NIfTI label map whose grid differs from its series' (nearest neighbour); "
                             "without it such a map is a reject.")


def parse_splits(text: str) -> tuple[tuple[str, float], ...]:
  """'train=0.8,test=0.2' → (('train', 0.8), ('test', 0.2)); fractions must sum to 1.

  Args:
    text: the --splits flag.

  Returns:
    (split name, fraction) pairs, in the flag's order.

  Raises:
    UsageError: malformed, a split named twice, a negative fraction, or a sum other than 1.
  """
  out = []
  for part in text.split(","):
    m = re.fullmatch(r"\s*([A-Za-z0-9_]+)\s*=\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*", part)
    if not m:
      raise UsageError(f"--splits must look like train=0.8,validation=0.1,test=0.1, got {text!r}")
    out.append((m[1], float(m[2])))
  names = [n for n, _ in out]
  if len(set(names)) != len(names):
    raise UsageError(f"--splits names a split twice: {text!r}")
  if any(f < 0 for _, f in out) or abs(sum(f for _, f in out) - 1) > 1e-6:
    raise UsageError(f"--splits fractions must be >= 0 and sum to 1, got {text!r}")
  return tuple(out)


def split_of(patient_id: str, splits: Sequence[tuple[str, float]]) -> str:
  """The split of a patient: a pure function of the (already salted) patient hash.

  All of a patient's volumes land in one split, whatever the run or the worker.

  Args:
    patient_id: the salted patient hash (`SliceHeader.patient_id`).
    splits: (name, fraction) pairs from `parse_splits`.

  Returns:
    The split's name (never one whose fraction is 0).
  """
  u = int(salted_hash("split", patient_id)[:15], 16) / float(1 << 60)
  acc = 0.0
  for name, fraction in splits:
    acc += fraction
    if u < acc:
      return name
  return next(name for name, f in reversed(splits) if f > 0)


def volume_features(dtype: str, labels: LabelConfig | None = None) -> Features:
  """The records' schema: the volume, its geometry, the salted ids and the slice order used; with labels,
  the label volume and the sources it came from.

  Args:
    dtype: the volume's dtype, int16 or float32.
    labels: the run's label settings, or None for volumes only.

  Returns:
    The `Features`.
  """
  features = {
      "volume": Tensor(shape=(None, None, None), dtype=dtype),
      "spacing": Tensor(shape=(3,), dtype="float32", encoding="none"),
      "origin": Tensor(shape=(3,), dtype="float32", encoding="none"),
      "direction": Tensor(shape=(3, 3), dtype="float32", encoding="none"),
      "num_slices": Tensor(shape=(), dtype="int64", encoding="none"),
      "series_id": Text(),
      "patient_id": Text(),
      "sorted_by": Text(),
  }
  if labels is not None:
    channels = labels_lib.num_channels(labels)
    shape = (None, None, None) if channels is None else (None, None, None, channels)
    features["label"] = Tensor(shape=shape, dtype=labels_lib.label_dtype(labels))
    features["label_source"] = Text()
  return Features(features)


class _Opener:
  """Opens input files by their printable path (what SliceHeader.path holds) with
  retries on transient errors; `raw` maps the printable paths of non-UTF-8 names
  to their bytes. Remembers the errors it raised, which read_volume turns into a
  series reject: a transient one must fail the job instead."""

  def __init__(self, raw: dict[str, bytes], read_policy: inputs.ReadPolicy):
    self._raw = raw
    self._read_policy = read_policy
    self.errors: dict[str, Exception] = {}

  def __call__(self, path: str) -> io.BytesIO:
    f = inputs.InputFile(path, self._raw.get(path, b""))
    try:
      return io.BytesIO(self._read_policy.read(f.location))
    except (inputs.Unreadable, inputs.TransientInputError) as e:
      self.errors[path] = e
      raise


class _StoreOpener:
  """Opens a store's instances by their instance paths (`dicomweb.instance_path`), as `_Opener` opens files:
  each series is retrieved once (one WADO-RS request) and must still hold exactly the instances the header
  stage's retrieval held (`Series.parts`), or its instances are Unreadable (it changed in the store)."""

  def __init__(self, store: dicomweb.Store, salt: str, series: Mapping[str, dicomweb.Series]):
    self._store, self._salt, self._series = store, salt, series
    self._retrieved: dict[str, dict[str, bytes] | inputs.Unreadable] = {}
    self.errors: dict[str, Exception] = {}

  def __call__(self, path: str) -> io.BytesIO:
    prefix = path.split("/instances/")[0].split("/parts/")[0]
    try:
      if prefix not in self._retrieved:
        try:
          self._retrieved[prefix] = dict(_retrieved(self._store, self._salt, self._series[prefix]))
        except _SeriesUnusable as e:
          self._retrieved[prefix] = inputs.Unreadable(e.reason.removeprefix("series rejected, "))
      got = self._retrieved[prefix]
      if isinstance(got, inputs.Unreadable):
        raise got
      return io.BytesIO(got[path])
    except Exception as e:  # kept: all but Unreadable fail the unit (a 401 is not bad pixel data)
      self.errors[path] = e
      raise


class _ReadHeadersFn(beam.DoFn):
  """InputFile → (series key, SliceHeader) per image frame, a LabelHeader (tagged), or a Reject."""

  REJECTS = "rejects"
  LABELS = "labels"

  def __init__(self, salt: str, read_policy: inputs.ReadPolicy, max_file_bytes: int = MAX_FILE_BYTES,
               labels: LabelConfig | None = None):
    self._salt = salt
    self._read_policy = read_policy
    self._max_file_bytes = max_file_bytes
    self._labels = labels

  def setup(self):
    self._count = counters(PIPELINE, "files_read", "frames_found", "files_rejected", "label_files_found")

  def process(self, f: inputs.InputFile):
    try:
      data = self._read_policy.read(f.location)  # a transient error fails the job
    except inputs.Unreadable as e:
      self._count.files_read.inc()
      self._count.files_rejected.inc()
      yield beam.pvalue.TaggedOutput(self.REJECTS, Reject(f.path, str(e)))
      return
    yield from self._headers(data, f.path)

  def _headers(self, data: bytes, path: str):
    """One file's bytes → its frames' (series key, SliceHeader)s, its LabelHeader (tagged) or a Reject (tagged)."""
    self._count.files_read.inc()
    try:
      slices = read_slices(io.BytesIO(data), path, self._salt, self._max_file_bytes)
    except SliceRejected as e:  # not a CT image: a label source, when the run converts them
      source = labels_lib.sniff(data, path) if self._labels is not None else None
      if source is None or source not in self._labels.sources:
        self._count.files_rejected.inc()
        yield beam.pvalue.TaggedOutput(self.REJECTS, Reject(path, str(e)))
        return
      try:
        header = labels_lib.read_label_header(data, path, self._salt, self._labels)
      except LabelRejected as e:
        self._count.files_rejected.inc()
        yield beam.pvalue.TaggedOutput(self.REJECTS, Reject(path, f"{source} label rejected: {e}"))
        return
      self._count.label_files_found.inc()
      yield beam.pvalue.TaggedOutput(self.LABELS, header)
      return
    self._count.frames_found.inc(len(slices))
    for s in slices:
      yield s.series_id, s  # every geometry of a series in one group: plan_volumes keeps their keys apart


class _ReadSeriesHeadersFn(_ReadHeadersFn):
  """A store's `dicomweb.Series` → what `_ReadHeadersFn` makes of each of its instances, retrieved in one
  WADO-RS request, and (tagged) the series with the digest of what its retrieval held; when the retrieval
  does not hold the listed instances (the series changed in the store, or the store lists what it does not
  serve), every part of it is a Reject instead."""

  SERIES = "series"

  def __init__(self, store: dicomweb.Store, salt: str, max_file_bytes: int = MAX_FILE_BYTES,
               labels: LabelConfig | None = None):
    super().__init__(salt, store.read_policy, max_file_bytes, labels)
    self._store = store

  def process(self, s: dicomweb.Series):
    try:
      parts = _retrieved(self._store, self._salt, s)
    except _SeriesUnusable as e:
      self._count.files_read.inc(len(e.paths))
      self._count.files_rejected.inc(len(e.paths))
      for path in e.paths:
        yield beam.pvalue.TaggedOutput(self.REJECTS, Reject(path, e.reason))
      return
    used = False
    for path, data in parts:
      for out in self._headers(bytes(data), path):  # one instance's copy at a time
        used = used or not (isinstance(out, beam.pvalue.TaggedOutput) and out.tag == self.REJECTS)
        yield out
    if used:  # a series the shard step may read again (CT, or a label): its digest travels there
      prefix = dicomweb.series_path(self._store.config.url, self._salt, s.study, s.series)
      yield beam.pvalue.TaggedOutput(self.SERIES, (prefix, dataclasses.replace(
          s, parts=dicomweb.parts_digest(p for p, _ in parts))))


class _SeriesUnusable(Exception):
  """A store's series cannot be converted as listed: `paths` (every listed instance and every part
  retrieved) are rejects with `reason`."""

  def __init__(self, paths: list[str], reason: str):
    super().__init__(reason)
    self.paths, self.reason = paths, reason


def _part_sop(data: bytes) -> str | None:
  """The SOP Instance UID a retrieved part names (its file meta's, else its data set's), or None."""
  fileobj = io.BytesIO(data)
  try:
    with quiet_pydicom():
      if data[128:132] == b"DICM":  # a Part 10 file, as stores send: its file meta names it (fast)
        fileobj.seek(132)
        uid = read_file_meta(fileobj).get("MediaStorageSOPInstanceUID")
      else:
        uid = pydicom.dcmread(fileobj, stop_before_pixels=True, specific_tags=["SOPInstanceUID"],
                              force=True).get("SOPInstanceUID")
  except Exception:  # not DICOM: its own reject, from the header path
    return None
  return str(uid) if uid else None


def _retrieved(store: dicomweb.Store, salt: str, s: dicomweb.Series) -> list[tuple[str, memoryview]]:
  """A listed series, retrieved: (instance path, a view of its bytes) per part, which must be as many instances as the
  listing counted, each named once by its SOP Instance UID, and, when `s.parts` is set (the shard step), the
  very instances the header stage's retrieval held.

  Raises:
    _SeriesUnusable: the store does not serve the series or sent a malformed answer, or the parts are not
      the listed instances (missing, added, repeated, unnamed, or other than before): nothing of it is used.
    TransientInputError: transient errors until the deadline (the job fails).
  """
  url = store.config.url
  prefix = dicomweb.series_path(url, salt, s.study, s.series)
  try:
    parts = store.retrieve(s)
  except dicomweb.NotServed as e:
    raise _SeriesUnusable([prefix], f"series rejected, the store lists it but does not serve it ({e})") from None
  except dicomweb.MalformedBody as e:
    raise _SeriesUnusable([prefix], f"series rejected, the store's WADO-RS answer is malformed: {e}") from None
  named, unnamed = {}, []
  for i, (media, data) in enumerate(parts):
    sop = _part_sop(data) if media == "application/dicom" else None
    path = None if sop is None else dicomweb.instance_path(url, salt, s.study, s.series, sop)
    if path is None or path in named:  # unreadable, or the same instance twice
      unnamed.append((dicomweb.part_path(prefix, i), data))
    else:
      named[path] = data
  paths = sorted([*named, *(p for p, _ in unnamed)])
  if unnamed or len(parts) != s.num_instances:
    raise _SeriesUnusable(paths or [prefix], (
        f"series rejected, the store's retrieval of it does not hold the instances its search counted "
        f"({s.num_instances} listed, {len(parts)} parts retrieved, {len(unnamed)} unnamed or repeated): it "
        "changed in the store during the run, or the store is inconsistent"))
  if s.parts and dicomweb.parts_digest(named) != s.parts:
    raise _SeriesUnusable(paths, "series rejected, its instances in the store changed during the run (the "
                                 "shard step's retrieval holds other instances than the header stage's)")
  return sorted(named.items())


def _listing_reject(folder: str, index: int, level: str) -> beam.pvalue.TaggedOutput:
  """The Reject of a search result (study or series) without a valid UID, named by its place in the listing."""
  tag = {"study": "StudyInstanceUID (0020,000D)", "series": "SeriesInstanceUID (0020,000E)"}[level]
  return beam.pvalue.TaggedOutput("rejects", Reject(
      f"{folder}/listing/{index}", f"the store's {level} search listed a {level} without a valid {tag}"))


class _SearchStudiesFn(beam.DoFn):
  """The store → the Study Instance UIDs its study search lists (paged); a result without a valid one → a
  Reject (tagged)."""

  def __init__(self, store: dicomweb.Store):
    self._store = store

  def process(self, _):
    for i, study in enumerate(self._store.studies()):
      yield _listing_reject(f"{self._store.config.url}/studies", i, "study") if study is None else study


class _SearchSeriesFn(beam.DoFn):
  """A study → a `dicomweb.Series` per series its series search lists, with its instance count; a result
  without a valid Series Instance UID → a Reject (tagged)."""

  def __init__(self, store: dicomweb.Store, salt: str):
    self._store, self._salt = store, salt

  def process(self, study: str):
    study_path = f"{self._store.config.url}/studies/{salted_hash(self._salt, 'study', study)}"
    for i, series in enumerate(self._store.series_of(study)):
      yield _listing_reject(f"{study_path}/series", i, "series") if series is None else series


class _PlanFn(beam.DoFn):
  """(series id, headers) → VolumePlans; files left out → Rejects; and (tagged) the candidate series'
  salted SeriesInstanceUID, folders and stack count, which label matching needs. No pixels read."""

  REJECTS = "rejects"
  CANDIDATES = "candidates"

  def __init__(self, tolerance: float, max_volume_voxels: int = MAX_VOLUME_VOXELS, candidates: bool = False):
    self._tolerance = tolerance
    self._max_volume_voxels = max_volume_voxels
    self._candidates = candidates  # only a run that matches labels needs them

  def process(self, element):
    _, slices = element
    slices = list(slices)
    if self._candidates:
      yield beam.pvalue.TaggedOutput(self.CANDIDATES, (
          slices[0].series_uid_key, tuple(sorted({posixpath.dirname(s.path) for s in slices})), stack_count(slices)))
    plans, rejected = plan_volumes(slices, self._tolerance, self._max_volume_voxels)
    for path, reason, frames in rejected:
      yield beam.pvalue.TaggedOutput(self.REJECTS, Reject(path, reason, units=frames))
    yield from plans


def _volume_directory(plan: VolumePlan) -> str | None:
  """The one folder all of a volume's files are in (NIfTI labels beside a series), or None."""
  folders = {posixpath.dirname(p) for p in plan.files}
  return folders.pop() if len(folders) == 1 else None


def _label_reject(h: LabelHeader, reason: str) -> beam.pvalue.TaggedOutput:
  return beam.pvalue.TaggedOutput("rejects", Reject(h.path, f"{h.source} label rejected: {reason}"))


def _match_by_series(element):
  """(series key, {"plans", "labels", "stacks"}) → plans with their labels attached; a label that does not
  name exactly one volume → a Reject (tagged). A label goes to the one volume (stack) holding the instances
  it references; one that references none, only when its series made one stack (counting rejected ones:
  a mask of one contrast phase may not land on another)."""
  _, grouped = element
  plans, labels = list(grouped["plans"]), sorted(grouped["labels"], key=lambda h: h.path)
  stacks = sum(grouped["stacks"])
  attached: dict[int, list[LabelHeader]] = collections.defaultdict(list)
  for h in labels:
    if not plans:
      yield _label_reject(h, "no CT volume of the input for the series it labels (that series is missing from "
                             "the input or was rejected)")
      continue
    if h.referenced_sop_keys:
      hits = [i for i, plan in enumerate(plans) if h.referenced_sop_keys & {s.sop_key for s in plan.slices}]
      if not hits:
        yield _label_reject(h, "it references no instance of the series' volumes")
        continue
      if len(hits) > 1:
        yield _label_reject(h, f"it references instances of {len(hits)} volumes of its series (stacks, e.g. "
                               "contrast phases): one label file must label one volume")
        continue
    elif stacks != 1 or len(plans) != 1:
      yield _label_reject(h, f"it references no instances and its series holds {max(stacks, len(plans))} "
                             "volumes (stacks, counting rejected ones)")
      continue
    else:
      hits = [0]
    attached[hits[0]].append(h)
  for i, plan in enumerate(plans):
    yield dataclasses.replace(plan, labels=plan.labels + tuple(attached.get(i, ())))


def _match_by_folder(element):
  """(folder, {"plans", "labels", "stacks"}) → plans with the NIfTI labels of their folder attached; a
  folder's labels need exactly one volume in it and no other series or stack (rejected ones counted),
  else they are Rejects (tagged)."""
  folder, grouped = element
  plans, labels = list(grouped["plans"]), sorted(grouped["labels"], key=lambda h: h.path)
  stacks = sum(grouped["stacks"])
  if labels and (len(plans) != 1 or stacks != 1):
    reason = ("no CT volume in its folder" if not plans else
              f"{max(stacks, len(plans))} CT volumes in its folder (counting rejected ones): name its series "
              "in --label_nifti_map")
    for h in labels:
      yield _label_reject(h, reason)
    labels = []
  for plan in plans:
    yield dataclasses.replace(plan, labels=plan.labels + tuple(labels)) if labels else plan


class AttachLabels(beam.PTransform):
  """(plans, label headers) → (plans carrying their labels, label rejects): labels that name their series
  (SEG, RTSTRUCT, a mapped NIfTI) are joined by its salted SeriesInstanceUID, NIfTI maps without a mapping
  by their folder. Only headers cross this join, never pixels."""

  def __init__(self, by_folder: bool):
    super().__init__()
    self._by_folder = by_folder

  def expand(self, pcolls):
    plans, labels, candidates = pcolls
    named = labels | "NamedSeries" >> beam.Filter(lambda h: bool(h.series_uid_key))
    by_series = (
        {"plans": plans | "PlanSeries" >> beam.Map(lambda p: (p.slices[0].series_uid_key, p)),
         "labels": named | "LabelSeries" >> beam.Map(lambda h: (h.series_uid_key, h)),
         "stacks": candidates | "SeriesStacks" >> beam.Map(lambda c: (c[0], c[2]))}
        | "JoinBySeries" >> beam.CoGroupByKey()
        | "MatchBySeries" >> beam.FlatMap(_match_by_series).with_outputs("rejects", main="plans"))
    plans, rejects = by_series.plans, [by_series.rejects]
    unnamed = labels | "UnnamedSeries" >> beam.Filter(lambda h: not h.series_uid_key)
    # A SEG or RTSTRUCT names its series; one that does not is refused (by instances alone, a label could
    # not be told from one of another series).
    rejects.append(unnamed | "NoSeries" >> beam.Filter(lambda h: h.source != "nifti") | "NoSeriesRejects" >> beam.Map(
        lambda h: Reject(h.path, f"{h.source} label rejected: it names no series (ReferencedSeriesSequence or "
                                 "RTReferencedSeriesSequence)")))
    if self._by_folder:
      by_folder = (
          {"plans": plans | "PlanFolder" >> beam.Map(lambda p: (_volume_directory(p), p)),
           "labels": (unnamed | "UnnamedNifti" >> beam.Filter(lambda h: h.source == "nifti")
                      | "LabelFolder" >> beam.Map(lambda h: (h.directory, h))),
           "stacks": candidates | "FolderStacks" >> beam.FlatMap(lambda c: [(folder, c[2]) for folder in c[1]])}
          | "JoinByFolder" >> beam.CoGroupByKey()
          | "MatchByFolder" >> beam.FlatMap(_match_by_folder).with_outputs("rejects", main="plans"))
      plans = by_folder.plans
      rejects.append(by_folder.rejects)
    return plans, tuple(rejects) | "LabelRejects" >> beam.Flatten()


class _VolumeUnits(UnitConverter):
  """VolumePlan → one Record with the HU volume, or Rejects for all its files.

  Runs inside its shard's step (`ConvertShards`): the volume is read, assembled
  and encoded here, and only its encoded record is kept, until the shard is written.
  """

  def __init__(self, splits, features_by_dtype: dict[str, Features], read_policy: inputs.ReadPolicy,
               max_volume_voxels: int = MAX_VOLUME_VOXELS, labels: LabelConfig | None = None,
               store: dicomweb.Store | None = None, salt: str = ""):
    self._splits = splits
    self._features = features_by_dtype
    self._read_policy = read_policy
    self._max_volume_voxels = max_volume_voxels
    self._labels = labels
    self._store, self._salt = store, salt  # a DICOMweb input: instances are opened from the store

  def setup(self):
    self._count = counters(PIPELINE, "volumes_written", "slices_used", "volumes_rejected", "labels_written")

  def input_paths(self, plan: VolumePlan, dtype: str = "", raw_paths: dict[str, bytes] | None = None,
                  store_series=None):
    del dtype, store_series
    paths = [*plan.files, *sorted(h.path for h in plan.labels)]
    if self._store is not None:
      return paths  # a store's instance paths, versioned by their names (reuse.input_versions)
    return [inputs.InputFile(p, (raw_paths or {}).get(p, b"")).location for p in paths]

  def listed_units(self, plan: VolumePlan) -> int:
    return len(plan.slices) + len(plan.duplicates) + len(plan.labels)  # frames and label files, as counted

  def _reject_all(self, plan: VolumePlan, split: str, reason: str, own: Mapping[str, str] = {}):
    """Rejects for every file of a volume (frames counted per file) and its label files: `own` gives
    a file its own reason, the rest get `reason`."""
    self._count.volumes_rejected.inc()
    for path, n in frames_per_file([*plan.slices, *(d for _, d in plan.duplicates)]).items():
      yield Reject(path, own.get(path, reason), split, n)
    for h in plan.labels:
      yield Reject(h.path, own.get(h.path, reason), split)

  def convert(self, plan: VolumePlan, dtype: str, raw_paths: dict[str, bytes],
              store_series: Mapping[str, dicomweb.Series] | None = None):
    split = split_of(plan.patient_id, self._splits)
    if self._labels is not None and not plan.labels:
      yield from self._reject_all(plan, split, "series rejected, no label source found for it "
                                               f"(--label_sources={','.join(self._labels.sources)})")
      return
    opener = (_Opener(raw_paths, self._read_policy) if self._store is None
              else _StoreOpener(self._store, self._salt, store_series))
    try:
      volume, dropped = read_volume(plan, opener, dtype, self._max_volume_voxels)
    except SeriesRejected as e:
      failed = [x for x in opener.errors.values() if not isinstance(x, inputs.Unreadable)]
      if failed:  # a transient error, or the store refusing the run (401, 403, ...): the job's, not the data's
        raise failed[0]
      own = {path: str(err) for path, err in opener.errors.items()}  # listed and read once, then gone or forbidden
      if e.culprit is not None and e.culprit not in own:
        own[e.culprit] = e.culprit_reason
      yield from self._reject_all(plan, split, f"series rejected, {e}", own)
      return
    label = sources = None
    if self._labels is not None:
      try:
        label, sources = self._read_labels(plan, opener)
      except _LabelFailed as e:
        del volume
        yield from self._reject_all(plan, split, f"series rejected, its label was rejected: {e.reason}",
                                    {e.path: e.reason} if e.path else {})
        return
      if not label.any():  # an annotated volume without foreground: kept, and counted in the warnings
        yield Event(EMPTY_LABEL)
    for path, reason in dropped:
      yield Reject(path, reason, split)
    direction = np.asarray(plan.direction, np.float32).reshape(3, 3)
    example = {
        "volume": volume, "spacing": np.asarray(plan.spacing, np.float32),
        "origin": np.asarray(plan.origin, np.float32), "direction": direction,
        "num_slices": len(plan.slices), "series_id": plan.series_id, "patient_id": plan.patient_id,
        "sorted_by": plan.sorted_by,
    }
    if label is not None:
      example.update(label=label, label_source=sources)
      self._count.labels_written.inc()
    payload = self._features[dtype].encode(example)
    del volume, label, example  # the shard keeps the encoded record only
    self._count.volumes_written.inc()
    self._count.slices_used.inc(len(plan.slices))
    yield Record(split, plan.key, payload, num_inputs=len(plan.slices) + len(plan.labels))

  def _read_labels(self, plan: VolumePlan, opener: _Opener | _StoreOpener) -> tuple[np.ndarray, str]:
    """The volume's label from all its label files, and their sources (comma-separated, in --label_sources
    order). Label files may add classes; where two give one class, they must agree voxel for voxel.

    Raises:
      _LabelFailed: a label file is unreadable or rejected, or two disagree or overlap.
      TransientInputError: a label file could not be read for now (fails the bundle, which is retried).
    """
    out, classes = None, set()
    for h in sorted(plan.labels, key=lambda h: (LABEL_SOURCES.index(h.source), h.path)):
      try:
        label = labels_lib.rasterize(plan, h, opener(h.path).getvalue(), self._labels)
      except (inputs.Unreadable, LabelRejected) as e:
        raise _LabelFailed(h.path, f"{h.source} label rejected: {e}") from None
      if out is None:
        out = label
      else:
        out = _merge_labels(out, label, classes & set(h.classes), self._labels.layout, h)
      classes |= set(h.classes)
    used = sorted({h.source for h in plan.labels}, key=LABEL_SOURCES.index)
    return out, ",".join(used)


class _LabelFailed(Exception):
  """A volume's label cannot be made: `path` is the label file at fault ("" when the files disagree)."""

  def __init__(self, path: str, reason: str):
    super().__init__(reason)
    self.path, self.reason = path, reason


def _merge_labels(out: np.ndarray, label: np.ndarray, shared: set[int], layout: str, h: LabelHeader) -> np.ndarray:
  """Two label files of one volume, merged: the classes both give must agree voxel for voxel; in the
  classes layout, a voxel may not get two different classes."""
  for c in sorted(shared):
    a, b = (out == c, label == c) if layout == "classes" else (out[..., c - 1], label[..., c - 1])
    if not np.array_equal(a, b):
      raise _LabelFailed("", f"label sources disagree on class {c} (a {h.source} label and another)")
  if layout != "classes":
    return np.maximum(out, label)
  if np.any((out != 0) & (label != 0) & (out != label)):
    raise _LabelFailed("", f"label sources overlap with different classes (a {h.source} label and another): "
                           "use --label_layout=channels")
  return np.where(out == 0, label, out)


def plan_unit(plan: VolumePlan, splits: Sequence[tuple[str, float]], policy: str,
              labels: LabelConfig | None = None) -> PlanUnit:
  """A series' unit in the shard plan: its split (by patient), its record key, the plan, its volume's bytes.

  Args:
    plan: the series' volume plan (headers only).
    splits: (name, fraction) pairs from `parse_splits`.
    policy: --volume_dtype (auto counts 4 bytes a voxel for a non-integral rescale, else 2).
    labels: the run's label settings (the label's bytes a voxel are added), or None.

  Returns:
    The `PlanUnit`; its `nbytes` is voxels × the bytes a voxel takes: the record's size within a few hundred
    bytes (with `auto`, more when another series makes the whole output float32).
  """
  first = plan.slices[0]
  itemsize = 4 if policy == "float32" or (policy == "auto" and not plan.integral_rescale) else 2
  if labels is not None:
    itemsize += np.dtype(labels_lib.label_dtype(labels)).itemsize * (labels_lib.num_channels(labels) or 1)
  return PlanUnit(split_of(plan.patient_id, splits), plan.key, plan,
                  len(plan.slices) * first.rows * first.columns * itemsize)


def _volume_dtype(needs_float: bool, policy: str) -> str:
  if policy == "auto":
    return "float32" if needs_float else "int16"
  return policy


@dataclasses.dataclass(frozen=True)
class CtVolumesConfig:
  """The CT converter's own flags, checked."""

  salt: str
  splits: tuple[tuple[str, float], ...]
  volume_dtype: str = "auto"  # auto, int16 or float32
  tolerance: float = DEFAULT_TOLERANCE
  max_file_bytes: int = MAX_FILE_BYTES
  max_volume_voxels: int = MAX_VOLUME_VOXELS
  labels: LabelConfig | None = None  # None: volumes only
  label_nifti_digest: str = ""  # salted digest of --label_nifti_map's content (the manifest's record of it)
  store: dicomweb.StoreConfig | None = None  # a DICOMweb input; None: a tree of files


def _read_json_flag(flag: str, location: str):
  """A small JSON file named by a flag (local or gs://), read at launch; UsageError if it cannot be."""
  try:
    return json.loads(inputs.read_input(location, max_bytes=16 << 20))
  except (inputs.Unreadable, OSError) as e:
    raise UsageError(f"{flag}: cannot read {inputs.printable(location)}: {e}") from None
  except (UnicodeDecodeError, ValueError) as e:
    raise UsageError(f"{flag}: {inputs.printable(location)} is not JSON ({type(e).__name__})") from None


def label_config(o: CtVolumesOptions, common: CommonConfig, salt: str,
                 max_voxels: int = MAX_VOLUME_VOXELS) -> tuple[LabelConfig | None, str]:
  """The label flags, checked, and a salted digest of --label_nifti_map's content ("" without one).

  Args:
    o: --label_sources, --label_map, --label_layout, --label_nifti_map, --label_resample.
    common: the input, which --label_nifti_map's paths are relative to.
    salt: --id_salt (the mapped SeriesInstanceUIDs are kept only as salted hashes).
    max_voxels: --max_volume_voxels, which bounds a NIfTI label map too.

  Returns:
    (the label settings, or None when --label_sources is empty; the digest).

  Raises:
    UsageError: an unknown source, a label flag without --label_sources, seg or rtstruct without
      --label_map, or a map file that cannot be read or is not {name: class id 1..65535}
      ({relative path: SeriesInstanceUID} for --label_nifti_map).
  """
  text = o.label_sources.strip()
  if not text:
    given = [f for f, v in (("--label_map", o.label_map), ("--label_nifti_map", o.label_nifti_map),
                            ("--label_resample", o.label_resample),
                            ("--label_layout", o.label_layout != "classes")) if v]
    if given:
      raise UsageError(f"{given[0]} needs --label_sources (seg, rtstruct, nifti or auto)")
    return None, ""
  sources = LABEL_SOURCES if text == "auto" else tuple(dict.fromkeys(x.strip() for x in text.split(",")))
  unknown = [x for x in sources if x not in LABEL_SOURCES]
  if unknown:
    raise UsageError(f"--label_sources: unknown source {unknown[0]!r}; give a comma list of "
                     f"{', '.join(LABEL_SOURCES)}, or auto")
  label_map = None
  if o.label_map:
    label_map = _read_json_flag("--label_map", o.label_map)
    if (not isinstance(label_map, dict) or not label_map
        or not all(isinstance(k, str) and k and type(v) is int and 0 <= v <= 65535 for k, v in label_map.items())
        or not any(label_map.values())):
      raise UsageError("--label_map must hold a JSON object {segment label or ROI name: class id 1..65535, or 0 "
                       "to leave the name out}, with at least one class")
  elif {"seg", "rtstruct"} & set(sources):
    raise UsageError("--label_map is required for seg and rtstruct labels: {segment label or ROI name: class id}")
  nifti_series, digest = {}, ""
  if o.label_nifti_map:
    mapping = _read_json_flag("--label_nifti_map", o.label_nifti_map)
    if not isinstance(mapping, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                                for k, v in mapping.items()):
      raise UsageError("--label_nifti_map must hold a JSON object {NIfTI path relative to --input: "
                       "SeriesInstanceUID}")
    # Each path as the listing prints it (formats.storage.files.join, as the listing joins).
    located = {rel: files.join(common.input, *rel.split("/")) for rel in mapping}
    nifti_series = {inputs.printable(located[rel]): salted_hash(salt, "series-uid", uid)
                    for rel, uid in mapping.items()}
    digest = salted_hash(salt, "nifti map", json.dumps(sorted(mapping.items())))
    missing = sorted(rel for rel, path in located.items() if not files.is_gcs(path) and not os.path.isfile(path))
    if missing:  # a key that names no file would leave its NIfTI to be matched by folder, silently
      raise UsageError(f"--label_nifti_map names {len(missing)} files that are not under --input, e.g. "
                       f"{missing[0]!r} (paths relative to --input, with / separators)")
  if (o.label_nifti_map or o.label_resample) and "nifti" not in sources:
    raise UsageError(f"{'--label_nifti_map' if o.label_nifti_map else '--label_resample'} needs nifti in "
                     "--label_sources")
  try:
    return LabelConfig(sources=sources, label_map=label_map, layout=o.label_layout, nifti_series=nifti_series,
                       resample=o.label_resample, max_voxels=max_voxels), digest
  except ValueError as e:  # the combinations LabelConfig refuses (channels without a label map, ...)
    raise UsageError(f"label flags: {e}") from None


class CtVolumes(Converter, name=NAME, kind="volume", options=CtVolumesOptions,
                input_kind="a tree of DICOM files, or a DICOMweb store's base URL (http:// or https://)"):
  """DICOM CT series → one record per volume in Hounsfield units; splits per patient."""

  def common_config(self, options: PipelineOptions) -> CommonConfig:
    """See Converter.common_config: a DICOMweb URL is taken as given (`configure` checks it), and names the
    data set by its store."""
    if dataflow.is_dataflow(options):  # Dataflow samples failing elements, which hold paths and UIDs here
      options.view_as(DebugOptions).add_experiment("disable_always_on_exception_sampling")
    url = options.view_as(flags.ConverterOptions).input or ""
    if not dicomweb.is_store_url(url):
      return super().common_config(options)
    credentials = options.view_as(CtVolumesOptions).dicomweb_credentials
    if dataflow.is_dataflow(options) and credentials:
      if not files.is_gcs(credentials):
        raise UsageError("--dicomweb_credentials must be on gs:// on Dataflow (each worker reads it)")
      if url.startswith("http://"):
        _log.warning("--dicomweb_credentials over plain http:// on Dataflow: the credentials cross the network "
                     "in clear; use the store's https:// URL")
    return flags.common_config(options, self.input_kind, service_input=True,
                               name_rule=lambda name, root: flags.dataset_name(name, dicomweb.store_name(root)))

  def configure(self, o: CtVolumesOptions, common: CommonConfig) -> CtVolumesConfig:
    """See Converter.configure.

    Args:
      o: --id_salt, --splits, --volume_dtype, --slice_tolerance and the size limits (typed).
      common: its --plan, which must leave the plan to the workers; with --mode=append and
        --volume_dtype=auto, the output whose volume dtype the run keeps.

    Raises:
      UsageError: --id_salt is missing, --splits is malformed, --plan=launcher (a series is known
        only after its headers are read, on the workers), or an append to an output that holds
        no CT volumes.
    """
    if common.plan == "launcher":
      raise UsageError("--plan=launcher: ct_volumes plans its series on the workers, after reading their "
                       "headers; use --plan=auto or --plan=workers")
    if not o.id_salt:
      raise UsageError("--id_salt is required: the secret that makes patient and series hashes unlinkable")
    splits = parse_splits(o.splits)
    for split, _ in splits:
      naming.check_split_name(split)
    volume_dtype = o.volume_dtype
    held = appended_feature(common, "volume", Tensor, "CT volume output (no volume feature)")
    if held is not None and volume_dtype == "auto":  # the output's dtype
      volume_dtype = held.dtype
    labels, nifti_digest = label_config(o, common, o.id_salt, o.max_volume_voxels)
    store = None
    if dicomweb.is_store_url(common.input):
      if labels is not None and "nifti" in labels.sources:
        raise UsageError("--label_sources: nifti labels need a folder input (a DICOMweb store holds DICOM only); "
                         "use seg and rtstruct")
      store = dicomweb.store_config(common.input, o.dicomweb_auth, o.dicomweb_credentials, o.dicomweb_filter,
                                    o.dicomweb_page_size)
      dicomweb.Store(store, common.read_policy).probe()  # a store that is not there fails here, nothing written
    elif o.dicomweb_filter or o.dicomweb_credentials:
      raise UsageError(f"{'--dicomweb_filter' if o.dicomweb_filter else '--dicomweb_credentials'} needs a "
                       "DICOMweb --input (an http:// or https:// base URL)")
    return CtVolumesConfig(
        salt=o.id_salt, splits=splits, volume_dtype=volume_dtype, tolerance=o.slice_tolerance,
        max_file_bytes=o.max_file_bytes, max_volume_voxels=o.max_volume_voxels,
        labels=labels, label_nifti_digest=nifti_digest, store=store)

  def plan(self, common: CommonConfig, config: CtVolumesConfig) -> OutputPlan:
    """See Converter.plan. Lists nothing: the splits come from --splits, and with
    --volume_dtype=auto the schema is settled at run time (`Records.features`).

    Args:
      common: the input (for the source) and the shard flags.
      config: the splits, the dtype policy and the limits.
    """
    policy = config.volume_dtype
    source = {"pipeline": PIPELINE, "input": inputs.printable(common.input), "splits": dict(config.splits),
              "volume_dtype": policy, "slice_tolerance": config.tolerance, "seed": common.seed,
              "num_shards": common.num_shards, "max_file_bytes": config.max_file_bytes,
              "max_volume_voxels": config.max_volume_voxels}
    labels = config.labels
    if config.store is not None and (config.store.study_filter or config.store.series_filter):
      # What was listed: the attributes, and salted hashes of their values (a PatientID, a date: PHI).
      source.update(dicomweb_filter={k: salted_hash(config.salt, "dicomweb filter", v)
                                     for k, v in config.store.study_filter + config.store.series_filter})
    if labels is not None:  # the class ids are the user's own vocabulary, kept so a reader can name them
      source.update(label_sources=list(labels.sources), label_layout=labels.layout,
                    label_map=dict(sorted((labels.label_map or {}).items())), label_resample=labels.resample,
                    label_nifti_map=config.label_nifti_digest)
    return OutputPlan(
        features=volume_features("float32" if policy == "float32" else "int16", labels),
        splits=tuple(s for s, _ in config.splits),
        description=f"CT volumes in Hounsfield units{' with label masks' if labels else ''}, converted by "
                    f"{PIPELINE}.",
        fingerprint=salted_hash(config.salt, "tpu-shards append check"),
        source=source)

  def sources(self, common: CommonConfig, config: CtVolumesConfig, plan: OutputPlan) -> Sources:
    """See Converter.sources: the whole input tree, listed on the workers (a series is known only after
    its files' headers are read: `expand_units`); for a DICOMweb store, nothing core lists (`expand_units`
    searches the store)."""
    if config.store is not None:
      return Sources(folders=(), on_workers=True)
    return Sources(folders=[("", common.input)], on_workers=True)

  def expand_units(self, p: beam.Pipeline, listed: ListedOnWorkers, common: CommonConfig, config: CtVolumesConfig,
                   plan: OutputPlan) -> Units:
    """See Converter.expand_units: headers per file (no pixel data), grouped into series and planned; each
    series' `VolumePlan` is a unit. Only headers and plans (paths, geometry) cross a stage: no volume is shuffled.

    Args:
      p: the pipeline the steps are added to.
      listed: every file of the tree, and the listing's rejects (their names may be undecodable too).
      common: the read policy.
      config: the salt, splits, dtype policy, tolerance and size limits.
      plan: not read (the features are settled here, at run time).

    Returns:
      The series' units, the files rejected on the way, the frames counted, the slice-order warnings,
      the volume dtype and the raw bytes of undecodable names (side inputs of `_VolumeUnits`), and the schema.
    """
    del plan
    side_inputs, listing_rejects = {}, []
    if config.store is None:
      files = listed.files | "InputFiles" >> beam.Map(lambda f: f.file) | "SpreadFiles" >> beam.Reshuffle()
      names = ((files, listed.rejects | "RejectNames" >> beam.MapTuple(lambda _, f, reason: f))
               | "AllNames" >> beam.Flatten())
      raw_paths = (
          names
          | "Undecodable" >> beam.Filter(lambda f: f.undecodable)
          | "RawPaths" >> beam.Map(lambda f: (f.path, f.raw))
      )
      headers = files | "ReadHeaders" >> beam.ParDo(
          _ReadHeadersFn(config.salt, common.read_policy, config.max_file_bytes, config.labels)).with_outputs(
              _ReadHeadersFn.REJECTS, _ReadHeadersFn.LABELS, main="slices")
    else:  # the store's studies → series (with their instances) → headers, one WADO-RS retrieval a series
      store = dicomweb.Store(config.store, common.read_policy)
      studies = (p | "StoreRoot" >> beam.Create([None])
                 | "SearchStudies" >> beam.ParDo(_SearchStudiesFn(store)).with_outputs("rejects", main="studies"))
      series = (studies.studies | "SpreadStudies" >> beam.Reshuffle()
                | "SearchSeries" >> beam.ParDo(_SearchSeriesFn(store, config.salt)).with_outputs(
                    "rejects", main="series"))
      listing_rejects = [studies.rejects, series.rejects]
      spread = series.series | "SpreadSeries" >> beam.Reshuffle()
      headers = spread | "ReadSeriesHeaders" >> beam.ParDo(
          _ReadSeriesHeadersFn(store, config.salt, config.max_file_bytes, config.labels)).with_outputs(
              _ReadHeadersFn.REJECTS, _ReadHeadersFn.LABELS, _ReadSeriesHeadersFn.SERIES, main="slices")
      raw_paths = p | "NoRawPaths" >> beam.Create([])
      side_inputs["store_series"] = beam.pvalue.AsDict(headers[_ReadSeriesHeadersFn.SERIES])
    planned = (
        headers.slices
        | "GroupBySeries" >> beam.GroupByKey()
        | "PlanVolumes" >> beam.ParDo(_PlanFn(config.tolerance, config.max_volume_voxels,
                                              candidates=config.labels is not None)).with_outputs(
            _PlanFn.REJECTS, _PlanFn.CANDIDATES, main="plans")
    )
    plans = planned.plans
    unit_rejects = [headers[_ReadHeadersFn.REJECTS], planned[_PlanFn.REJECTS], *listing_rejects]
    counted = [headers.slices | "Frames" >> beam.Map(lambda kv: 1),
               headers[_ReadHeadersFn.REJECTS] | "RejectedFiles" >> beam.Map(lambda r: 1),
               *[r | f"ListingRejected{i}" >> beam.Map(lambda r: 1) for i, r in enumerate(listing_rejects)]]
    if config.labels is not None:
      label_headers = headers[_ReadHeadersFn.LABELS]
      plans, label_rejects = (plans, label_headers, planned[_PlanFn.CANDIDATES]) | "AttachLabels" >> AttachLabels(
          by_folder="nifti" in config.labels.sources)
      unit_rejects.append(label_rejects)
      counted.append(label_headers | "LabelFiles" >> beam.Map(lambda h: 1))
    dtype = (
        plans
        | "NeedsFloat" >> beam.Map(lambda plan: not plan.integral_rescale)
        | "AnyNeedsFloat" >> beam.CombineGlobally(any)
        | "VolumeDtype" >> beam.Map(_volume_dtype, config.volume_dtype)
    )
    num_inputs = (  # frames, the files whose header was rejected, and the label files
        counted
        | "Units" >> beam.Flatten()
        | "CountUnits" >> beam.CombineGlobally(sum)
    )
    features_by_dtype = _features_by_dtype(config.labels)
    return Units(
        units=plans | "SeriesUnits" >> beam.Map(plan_unit, config.splits, config.volume_dtype, config.labels),
        rejects=tuple(unit_rejects) | "UnitRejects" >> beam.Flatten(),
        num_inputs=num_inputs,
        warnings=plans | "FallbackWarnings" >> beam.FlatMap(
            lambda plan: [f"series {plan.series_id} sorted by InstanceNumber: no ImagePositionPatient"]
            if plan.sorted_by != "position" else []),
        side_inputs={"dtype": beam.pvalue.AsSingleton(dtype), "raw_paths": beam.pvalue.AsDict(raw_paths),
                     **side_inputs},
        features=dtype | "Features" >> beam.Map(lambda d: features_by_dtype[d]))

  def warnings(self, config: CtVolumesConfig, plan: OutputPlan, found) -> list[str]:
    """See Converter.warnings: also the volumes written with a label that has no foreground."""
    out = super().warnings(config, plan, found)
    if found.events.get(EMPTY_LABEL):
      out.append(f"{found.events[EMPTY_LABEL]} volumes have a label without foreground (every voxel background)")
    return out

  def unit_converter(self, common: CommonConfig, config: CtVolumesConfig, plan: OutputPlan) -> UnitConverter:
    """See Converter.unit_converter: a series' plan → its volume's record, or rejects for its files."""
    return _VolumeUnits(config.splits, _features_by_dtype(config.labels), common.read_policy,
                        config.max_volume_voxels, config.labels,
                        None if config.store is None else dicomweb.Store(config.store, common.read_policy),
                        config.salt)


def _features_by_dtype(labels: LabelConfig | None = None) -> dict[str, Features]:
  return {d: volume_features(d, labels) for d in ("int16", "float32")}
