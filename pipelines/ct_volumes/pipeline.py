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

from collections.abc import Sequence
import dataclasses
import io
import logging
import re

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
import numpy as np

from formats import naming
from formats.features import Features, Tensor, Text
from formats.outputs.output import is_output, load_manifest
from pipelines.core import flags, inputs
from pipelines.core.converter import Converter, OutputPlan, Sources, UnitConverter, Units, counters
from pipelines.core.errors import UsageError
from pipelines.core.flags import CommonConfig
from pipelines.core.records import Record, Reject
from pipelines.core.shards import ListedOnWorkers, PlanUnit
from pipelines.ct_volumes.assembly import (
    DEFAULT_TOLERANCE, MAX_VOLUME_VOXELS, SeriesRejected, VolumePlan, frames_per_file, plan_volumes, read_volume)
from pipelines.ct_volumes.headers import MAX_FILE_BYTES, SliceRejected, read_slices, salted_hash

NAME = "ct_volumes"
PIPELINE = f"pipelines.{NAME}"
DEFAULT_SPLITS = "train=0.8,validation=0.1,test=0.1"
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
    m = re.fullmatch(r"\s*([A-Za-z0-9_]+)\s*=\s*([0-9.]+)\s*", part)
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


def volume_features(dtype: str) -> Features:
  """The records' schema: the volume, its geometry, the salted ids and the slice order used.

  Args:
    dtype: the volume's dtype, int16 or float32.

  Returns:
    The `Features`.
  """
  return Features({
      "volume": Tensor(shape=(None, None, None), dtype=dtype),
      "spacing": Tensor(shape=(3,), dtype="float32", encoding="none"),
      "origin": Tensor(shape=(3,), dtype="float32", encoding="none"),
      "direction": Tensor(shape=(3, 3), dtype="float32", encoding="none"),
      "num_slices": Tensor(shape=(), dtype="int64", encoding="none"),
      "series_id": Text(),
      "patient_id": Text(),
      "sorted_by": Text(),
  })


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


class _ReadHeadersFn(beam.DoFn):
  """InputFile → (series key, SliceHeader) per image frame, or a Reject."""

  REJECTS = "rejects"

  def __init__(self, salt: str, read_policy: inputs.ReadPolicy, max_file_bytes: int = MAX_FILE_BYTES):
    self._salt = salt
    self._read_policy = read_policy
    self._max_file_bytes = max_file_bytes

  def setup(self):
    self._count = counters(PIPELINE, "files_read", "frames_found", "files_rejected")

  def process(self, f: inputs.InputFile):
    self._count.files_read.inc()
    try:
      data = self._read_policy.read(f.location)  # a transient error fails the job
      slices = read_slices(io.BytesIO(data), f.path, self._salt, self._max_file_bytes)
    except (SliceRejected, inputs.Unreadable) as e:
      self._count.files_rejected.inc()
      yield beam.pvalue.TaggedOutput(self.REJECTS, Reject(f.path, str(e)))
      return
    self._count.frames_found.inc(len(slices))
    for s in slices:
      yield s.series_key, s


class _PlanFn(beam.DoFn):
  """(series key, headers) → VolumePlans; files left out → Rejects. No pixels read."""

  REJECTS = "rejects"

  def __init__(self, tolerance: float, max_volume_voxels: int = MAX_VOLUME_VOXELS):
    self._tolerance = tolerance
    self._max_volume_voxels = max_volume_voxels

  def process(self, element):
    _, slices = element
    plans, rejected = plan_volumes(list(slices), self._tolerance, self._max_volume_voxels)
    for path, reason, frames in rejected:
      yield beam.pvalue.TaggedOutput(self.REJECTS, Reject(path, reason, units=frames))
    yield from plans


class _VolumeUnits(UnitConverter):
  """VolumePlan → one Record with the HU volume, or Rejects for all its files.

  Runs inside its shard's step (`ConvertShards`): the volume is read, assembled
  and encoded here, and only its encoded record is kept, until the shard is written.
  """

  def __init__(self, splits, features_by_dtype: dict[str, Features], read_policy: inputs.ReadPolicy,
               max_volume_voxels: int = MAX_VOLUME_VOXELS):
    self._splits = splits
    self._features = features_by_dtype
    self._read_policy = read_policy
    self._max_volume_voxels = max_volume_voxels

  def setup(self):
    self._count = counters(PIPELINE, "volumes_written", "slices_used", "volumes_rejected")

  def input_paths(self, plan: VolumePlan, dtype: str = "", raw_paths: dict[str, bytes] | None = None):
    del dtype
    return [inputs.InputFile(p, (raw_paths or {}).get(p, b"")).location for p in plan.files]

  def listed_units(self, plan: VolumePlan) -> int:
    return len(plan.slices) + len(plan.duplicates)  # frames, as the summary counts them

  def convert(self, plan: VolumePlan, dtype: str, raw_paths: dict[str, bytes]):
    split = split_of(plan.patient_id, self._splits)
    opener = _Opener(raw_paths, self._read_policy)
    try:
      volume, dropped = read_volume(plan, opener, dtype, self._max_volume_voxels)
    except SeriesRejected as e:
      transient = [x for x in opener.errors.values() if isinstance(x, inputs.TransientInputError)]
      if transient:
        raise transient[0]
      self._count.volumes_rejected.inc()
      for path, n in frames_per_file([*plan.slices, *(d for _, d in plan.duplicates)]).items():
        reason = e.culprit_reason if path == e.culprit else f"series rejected, {e}"
        if path in opener.errors:  # listed and read once, then gone or forbidden
          reason = str(opener.errors[path])
        yield Reject(path, reason, split, n)
      return
    for path, reason in dropped:
      yield Reject(path, reason, split)
    direction = np.asarray(plan.direction, np.float32).reshape(3, 3)
    payload = self._features[dtype].encode({
        "volume": volume, "spacing": np.asarray(plan.spacing, np.float32),
        "origin": np.asarray(plan.origin, np.float32), "direction": direction,
        "num_slices": len(plan.slices), "series_id": plan.series_id, "patient_id": plan.patient_id,
        "sorted_by": plan.sorted_by,
    })
    del volume  # the shard keeps the encoded record only
    self._count.volumes_written.inc()
    self._count.slices_used.inc(len(plan.slices))
    yield Record(split, plan.key, payload, num_inputs=len(plan.slices))


def plan_unit(plan: VolumePlan, splits: Sequence[tuple[str, float]], policy: str) -> PlanUnit:
  """A series' unit in the shard plan: its split (by patient), its record key, the plan, its volume's bytes.

  Args:
    plan: the series' volume plan (headers only).
    splits: (name, fraction) pairs from `parse_splits`.
    policy: --volume_dtype (auto counts 4 bytes a voxel for a non-integral rescale, else 2).

  Returns:
    The `PlanUnit`; its `nbytes` is voxels × the dtype's size: the record's size within a few hundred
    bytes (with `auto`, twice that when another series makes the whole output float32).
  """
  first = plan.slices[0]
  itemsize = 4 if policy == "float32" or (policy == "auto" and not plan.integral_rescale) else 2
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


class CtVolumes(Converter, name=NAME, kind="volume", options=CtVolumesOptions,
                input_kind="a tree of DICOM files"):
  """DICOM CT series → one record per volume in Hounsfield units; splits per patient."""

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
    if common.mode == "append" and volume_dtype == "auto" and is_output(common.output):  # the output's dtype
      held_features = load_manifest(common.output).features
      if "volume" not in list(held_features) or not isinstance(held_features["volume"], Tensor):
        raise UsageError(f"--mode=append: {common.output} holds no CT volume output (no volume feature)")
      volume_dtype = held_features["volume"].dtype
    return CtVolumesConfig(
        salt=o.id_salt, splits=splits, volume_dtype=volume_dtype, tolerance=o.slice_tolerance,
        max_file_bytes=o.max_file_bytes, max_volume_voxels=o.max_volume_voxels)

  def plan(self, common: CommonConfig, config: CtVolumesConfig) -> OutputPlan:
    """See Converter.plan. Lists nothing: the splits come from --splits, and with
    --volume_dtype=auto the schema is settled at run time (`Records.features`).

    Args:
      common: the input (for the source) and the shard flags.
      config: the splits, the dtype policy and the limits.
    """
    policy = config.volume_dtype
    return OutputPlan(
        features=volume_features("float32" if policy == "float32" else "int16"),
        splits=tuple(s for s, _ in config.splits),
        description=f"CT volumes in Hounsfield units, converted by {PIPELINE}.",
        fingerprint=salted_hash(config.salt, "tpu-shards append check"),
        source={"pipeline": PIPELINE, "input": inputs.printable(common.input), "splits": dict(config.splits),
                "volume_dtype": policy, "slice_tolerance": config.tolerance, "seed": common.seed,
                "num_shards": common.num_shards, "max_file_bytes": config.max_file_bytes,
                "max_volume_voxels": config.max_volume_voxels})

  def sources(self, common: CommonConfig, config: CtVolumesConfig, plan: OutputPlan) -> Sources:
    """See Converter.sources: the whole input tree, listed on the workers (a series is known only after
    its files' headers are read: `expand_units`)."""
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
    files = listed.files | "InputFiles" >> beam.Map(lambda f: f.file) | "SpreadFiles" >> beam.Reshuffle()
    names = ((files, listed.rejects | "RejectNames" >> beam.MapTuple(lambda _, f, reason: f))
             | "AllNames" >> beam.Flatten())
    raw_paths = (
        names
        | "Undecodable" >> beam.Filter(lambda f: f.undecodable)
        | "RawPaths" >> beam.Map(lambda f: (f.path, f.raw))
    )
    headers = files | "ReadHeaders" >> beam.ParDo(
        _ReadHeadersFn(config.salt, common.read_policy, config.max_file_bytes)).with_outputs(
            _ReadHeadersFn.REJECTS, main="slices")
    planned = (
        headers.slices
        | "GroupBySeries" >> beam.GroupByKey()
        | "PlanVolumes" >> beam.ParDo(_PlanFn(config.tolerance, config.max_volume_voxels)).with_outputs(
            _PlanFn.REJECTS, main="plans")
    )
    dtype = (
        planned.plans
        | "NeedsFloat" >> beam.Map(lambda plan: not plan.integral_rescale)
        | "AnyNeedsFloat" >> beam.CombineGlobally(any)
        | "VolumeDtype" >> beam.Map(_volume_dtype, config.volume_dtype)
    )
    num_inputs = (  # frames, and the files whose header was rejected
        (headers.slices | "Frames" >> beam.Map(lambda kv: 1),
         headers[_ReadHeadersFn.REJECTS] | "RejectedFiles" >> beam.Map(lambda r: 1))
        | "Units" >> beam.Flatten()
        | "CountUnits" >> beam.CombineGlobally(sum)
    )
    features_by_dtype = _features_by_dtype()
    return Units(
        units=planned.plans | "SeriesUnits" >> beam.Map(plan_unit, config.splits, config.volume_dtype),
        rejects=(headers[_ReadHeadersFn.REJECTS], planned[_PlanFn.REJECTS]) | "UnitRejects" >> beam.Flatten(),
        num_inputs=num_inputs,
        warnings=planned.plans | "FallbackWarnings" >> beam.FlatMap(
            lambda plan: [f"series {plan.series_id} sorted by InstanceNumber: no ImagePositionPatient"]
            if plan.sorted_by != "position" else []),
        side_inputs={"dtype": beam.pvalue.AsSingleton(dtype), "raw_paths": beam.pvalue.AsDict(raw_paths)},
        features=dtype | "Features" >> beam.Map(lambda d: features_by_dtype[d]))

  def unit_converter(self, common: CommonConfig, config: CtVolumesConfig, plan: OutputPlan) -> UnitConverter:
    """See Converter.unit_converter: a series' plan → its volume's record, or rejects for its files."""
    return _VolumeUnits(config.splits, _features_by_dtype(), common.read_policy, config.max_volume_voxels)


def _features_by_dtype() -> dict[str, Features]:
  return {d: volume_features(d) for d in ("int16", "float32")}
