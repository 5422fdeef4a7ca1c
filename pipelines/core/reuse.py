"""Reusing shards an earlier run published: resumed conversions.

A shard is a pure function of its plan: the units planned into it and their
inputs as they are now (size and modification time, or the object generation
on gs://), its place (split, index, count), the output's settings (name,
format, features, seed, kind, and the converter's flags in `source`) and the
code that converts (a digest of the toolkit's own sources). `plan_digest`
hashes all of that.

`ConvertShards` writes, beside each shard it publishes, a small record
`<generation>/_toolkit_shards/<shard file>.json`: the plan digest, the shard's
size and SHA-256, and its accounting (records, input units used and rejected,
its rejects and events). A later run of the same plan (a rerun after a failed
or killed run, a retried Dataflow job) collects at launch the records of the
output's other toolkit generations (`find_reusable`). A shard step whose
digest is among them reads the earlier shard back, checks its size and
SHA-256, and copies exactly those bytes into its own generation (a hard link
locally; on gs:// a server-side copy pinned to the object generation it
hashed) instead of converting. Anything that does not match is converted
again: reuse changes how long a run takes, never what it writes.

Records are untrusted input (other teams may write the bucket): a record that
does not parse, names another shard, or whose shard's bytes disagree with it is
ignored, and the shard is converted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import hashlib
import json
import logging
import os
import re
import uuid


from formats import naming
from formats.outputs import commit, leases
from formats.storage import files as fs
from formats.storage import retry
from formats.manifest import Manifest, ShardInfo
from pipelines.core.errors import UsageError

RECORDS_FOLDER = "_toolkit_shards"  # <generation>/_toolkit_shards/<shard file>.json
RECORD_VERSION = 2  # 2: each unit's inputs (`inputs`)
_HEX64 = re.compile(r"[0-9a-f]{64}")
_READ_THREADS = 32  # records read in parallel at launch (one small object each on gs://)
# The largest shard record read (a unit's entry is ~100 bytes: 600,000 units a shard); a larger one is
# ignored (its shard is converted again; an append refuses the output), never read whole.
MAX_RECORD_BYTES = 64 << 20
_STAT_TIMEOUT_S = 30.0  # one attempt at an input's metadata (a failure only means: not reused)
_log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the plan's identity

@functools.lru_cache(maxsize=1)
def code_version() -> str:
  """A digest of the toolkit's own sources (`formats/` and `pipelines/`): part of every plan digest.

  Computed where the job is launched; Dataflow workers run the same staged sources.

  Returns:
    The hex SHA-256 of every `.py` file's relative path and bytes, in path order.
  """
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  h = hashlib.sha256()
  for package in ("formats", "pipelines"):
    paths = []
    for folder, dirs, names in os.walk(os.path.join(root, package)):
      dirs[:] = sorted(d for d in dirs if d != "__pycache__")
      paths += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    for path in sorted(paths):
      with open(path, "rb") as f:
        data = f.read()
      h.update(f"{os.path.relpath(path, root)}\0{len(data)}\0".encode())
      h.update(data)
  return h.hexdigest()


def output_identity(settings: Mapping) -> str:
  """The digest of what shapes every shard of an output besides its units: settings and code.

  Args:
    settings: JSON-able settings (`OutputSpec.reuse_settings()`).

  Returns:
    A hex SHA-256.
  """
  text = json.dumps({"code": code_version(), "settings": settings}, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()


def input_versions(paths: Iterable[str]) -> list[str]:
  """What each input is now: "size:mtime_ns:inode" locally, "size:g<generation>" on gs://, "missing"
  (or, on gs://, "unknown:<random>" while it cannot be asked: it matches nothing); "named" for an
  instance of a DICOM store (an http(s):// path naming it by its salted SOP Instance UID: DICOM gives
  an instance whose content changes a new UID, so the name is its version).

  A changed input gives another version, so the shards it went into are converted again.

  Args:
    paths: the inputs' locations (local or gs://).

  Returns:
    One version string per path, in order.
  """
  paths = list(paths)
  gcs, out = [], ["" for _ in paths]
  for i, p in enumerate(paths):
    if fs.is_gcs(p):
      gcs.append(i)
      continue
    if p.startswith(("http://", "https://")):
      out[i] = "named"
      continue
    try:
      st = os.stat(p)
    except OSError:
      out[i] = "missing"
    else:
      out[i] = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
  if gcs:
    with concurrent.futures.ThreadPoolExecutor(min(16, len(gcs))) as pool:
      for i, v in zip(gcs, pool.map(lambda i: _gcs_version(paths[i]), gcs)):
        out[i] = v
  return out


def _gcs_version(path: str) -> str:
  """The object's size and generation; "missing"; or, when it cannot be known now (a transient
  error), a version no record holds: nothing is reused for it, and its read, later, retries as
  the read policy says (--transient_retry_seconds), which fails the job the usual way if it must."""
  bucket, name = fs.split_gcs(path)
  try:
    blob = fs.gcs_client().bucket(bucket).get_blob(name, retry=None, timeout=_STAT_TIMEOUT_S)
  except Exception:  # pylint: disable=broad-except  # unknown now: converted, never reused
    return f"unknown:{uuid.uuid4().hex}"
  return "missing" if blob is None else f"{blob.size}:g{blob.generation}"


def unit_version(versions: Sequence[str]) -> str:
  """One unit's inputs as they are now (`input_versions`), as one short digest."""
  return hashlib.sha256("\0".join(versions).encode()).hexdigest()[:32]


def carried_plan(plan: str, index: int, num_shards: int) -> str:
  """The plan digest of a shard carried into an appended output under a new place."""
  return hashlib.sha256(f"carried\0{plan}\0{index}\0{num_shards}".encode()).hexdigest()


def plan_digest(identity: str, split: str, index: int, num_shards: int, units_blob: bytes,
                versions: Sequence[str]) -> str:
  """The digest naming one shard's plan.

  Args:
    identity: `output_identity` of the run.
    split: the shard's split.
    index: its index.
    num_shards: the split's shard count.
    units_blob: the task's units, as planned (`ShardTask.units_blob`).
    versions: `input_versions` of the units' inputs, in unit order.

  Returns:
    A hex SHA-256.
  """
  h = hashlib.sha256(f"{identity}\0{split}\0{index}\0{num_shards}\0".encode())
  h.update(hashlib.sha256(units_blob).digest())
  h.update("\0".join(versions).encode())
  return h.hexdigest()


@contextlib.contextmanager
def leased(output: str, generation: str) -> Iterator[None]:
  """Holds a lease on `generation` while a shard or piece is copied from it (formats.outputs.leases).

  A clean-up of another run then leaves the source until the copy is made. Without write
  access to `_leases/` the retention period is the only hold; either way the copy is verified,
  and a source removed meanwhile only means the shard is converted again.
  """
  try:
    lease = leases.acquire(output, generation, purpose="a conversion copying a shard", heartbeat=False)
  except leases.LeaseError as e:
    _log.warning("no lease on %s (%s) while copying from it", generation, type(e).__name__)
    lease = None
  try:
    yield
  finally:
    if lease is not None:
      lease.release()


# ---------------------------------------------------------------- the records

@dataclasses.dataclass(frozen=True)
class ShardRecord:
  """What a run published for one shard: enough for a later run to reuse it without converting.

  `shard.path` is the shard's file name (no folder); `rejects` are
  (input, reason, split, units) and `events` event names, as the shard's step made them.
  """

  plan: str
  split: str
  index: int
  num_shards: int
  shard: ShardInfo
  num_units: int
  inputs_used: int
  inputs_rejected: int
  rejects: tuple[tuple[str, str, str, int], ...] = ()
  events: tuple[str, ...] = ()
  inputs: tuple[tuple[str, str, int], ...] = ()  # per unit: (plan key, unit_version, input files)
  fingerprint: str = ""  # the run's OutputPlan.fingerprint (a keyed digest of what decides the keys)

  def to_json(self) -> dict:
    """The record as written (JSON-able)."""
    return {"toolkit": commit.TOOLKIT, "record_version": RECORD_VERSION, "plan": self.plan, "split": self.split,
            "index": self.index, "num_shards": self.num_shards, "shard": self.shard.to_json(),
            "num_units": self.num_units, "inputs_used": self.inputs_used, "inputs_rejected": self.inputs_rejected,
            "rejects": [list(r) for r in self.rejects], "events": list(self.events),
            "inputs": [list(i) for i in self.inputs], "fingerprint": self.fingerprint}

  @classmethod
  def from_json(cls, d) -> ShardRecord:
    """A record read back, checked field by field (it is untrusted input).

    Raises:
      ValueError: a field is missing, of the wrong type, or inconsistent.
    """
    if not isinstance(d, dict) or d.get("toolkit") != commit.TOOLKIT or d.get("record_version") != RECORD_VERSION:
      raise ValueError("not a shard record of this toolkit version")
    s = d.get("shard")
    if not isinstance(s, dict):
      raise ValueError("shard: not an object")
    ints = {k: d.get(k) for k in ("index", "num_shards", "num_units", "inputs_used", "inputs_rejected")}
    ints.update(num_records=s.get("num_records"), num_bytes=s.get("num_bytes"))
    for k, v in ints.items():
      if type(v) is not int or v < 0:
        raise ValueError(f"{k}: not a non-negative integer")
    if not ints["index"] < ints["num_shards"]:
      raise ValueError(f"index {ints['index']} not below num_shards {ints['num_shards']}")
    if ints["inputs_used"] + ints["inputs_rejected"] < ints["num_units"]:
      raise ValueError("fewer inputs accounted for than units planned")
    plan, sha, path, split = d.get("plan"), s.get("sha256"), s.get("path"), d.get("split")
    if not (isinstance(plan, str) and _HEX64.fullmatch(plan) and isinstance(sha, str) and _HEX64.fullmatch(sha)):
      raise ValueError("plan or sha256: not a hex SHA-256")
    try:
      shard_name = naming.ShardName.parse(path) if isinstance(path, str) and "/" not in path else None
    except ValueError:
      shard_name = None
    if shard_name is None or (shard_name.split, shard_name.index, shard_name.num_shards) != (
        split, ints["index"], ints["num_shards"]):
      raise ValueError("shard path: not the file name of the shard the record names")
    rejects, events = d.get("rejects"), d.get("events")
    if not isinstance(rejects, list) or not all(
        isinstance(r, list) and len(r) == 4 and all(isinstance(x, str) for x in r[:3]) and type(r[3]) is int
        and r[3] >= 0 for r in rejects):
      raise ValueError("rejects: not a list of [input, reason, split, units]")
    if not isinstance(events, list) or not all(isinstance(e, str) for e in events):
      raise ValueError("events: not a list of names")
    if sum(r[3] for r in rejects) != ints["inputs_rejected"]:
      raise ValueError("rejects: their units differ from inputs_rejected")
    units = d.get("inputs")
    if not isinstance(units, list) or len(units) != ints["num_units"] or not all(
        isinstance(u, list) and len(u) == 3 and isinstance(u[0], str) and u[0] and isinstance(u[1], str)
        and type(u[2]) is int and u[2] >= 0 for u in units) or len({u[0] for u in units}) != len(units):
      raise ValueError("inputs: not one distinct [key, version, files] per unit")
    fingerprint = d.get("fingerprint")
    if not isinstance(fingerprint, str) or len(fingerprint) > 128:
      raise ValueError("fingerprint: not a short string")
    return cls(plan, split, ints["index"], ints["num_shards"],
               ShardInfo(path, ints["num_records"], ints["num_bytes"], sha), ints["num_units"],
               ints["inputs_used"], ints["inputs_rejected"], tuple(tuple(r) for r in rejects), tuple(events),
               tuple(tuple(u) for u in units), fingerprint)


def record_path(output: str, generation: str, shard_file: str) -> str:
  """Where the record of shard `shard_file` of `generation` lives."""
  return fs.join(output, generation, RECORDS_FOLDER, shard_file + ".json")


def write_record(output: str, generation: str, record: ShardRecord) -> None:
  """Writes a shard's record (after the shard itself was published: a record implies its shard is whole).

  Args:
    output: the output folder.
    generation: the run's generation folder.
    record: the record; `record.shard.path` is the shard's file name.
  """
  fs.write_bytes(record_path(output, generation, record.shard.path),
                 json.dumps(record.to_json(), sort_keys=True).encode() + b"\n")


@dataclasses.dataclass(frozen=True)
class Reusable:
  """A shard an earlier run published: its generation and its record."""

  generation: str
  record: ShardRecord


def find_reusable(output: str, exclude: str = "") -> dict[str, list[Reusable]]:
  """The records of the output's toolkit generations (except `exclude`), by plan digest.

  A generation counts when its marker says the toolkit wrote it (any state:
  committed, replaced, abandoned, or a killed run's). Every candidate of a plan
  is kept, the newest first: the shard step takes the first whose record and
  bytes check out (a forged record does not hide a genuine one).

  Args:
    output: the output folder, local or gs://.
    exclude: a generation to leave out (the run's own).

  Returns:
    {plan digest: [Reusable, newest first]}; empty when the output does not exist yet.
  """
  try:
    dirs, _ = fs.list_dir(output)
  except (FileNotFoundError, NotADirectoryError):
    return {}
  generations = [d for d in sorted(dirs) if naming.is_generation(d) and d != exclude and _is_toolkits(output, d)]
  paths = []
  for g in generations:
    try:
      _, names = fs.list_dir(fs.join(output, g, RECORDS_FOLDER))
    except (FileNotFoundError, NotADirectoryError):
      continue
    paths += [(g, n) for n in sorted(names) if n.endswith(".json")]
  if not paths:
    return {}
  found: dict[str, list[Reusable]] = {}
  with concurrent.futures.ThreadPoolExecutor(min(_READ_THREADS, len(paths))) as pool:
    for (g, name), record in zip(paths, pool.map(lambda gn: _read_record(output, *gn), paths)):
      if record is not None and record.shard.path + ".json" == name:
        found.setdefault(record.plan, []).insert(0, Reusable(g, record))  # generations oldest first: newest first
  return found


def records_in(output: str, folder: str, exclude: str = "") -> list[tuple[str, str, dict]]:
  """(generation, file name, parsed JSON object) of every `*.json` in `<generation>/<folder>/` of the
  output's toolkit generations but `exclude` (read in parallel; unreadable or non-object files skipped).

  Args:
    output: the output folder.
    folder: the folder inside each generation (e.g. a graph conversion's `_parts`).
    exclude: a generation to leave out (the run's own).

  Returns:
    The records, by generation (oldest first) and name.
  """
  try:
    dirs, _ = fs.list_dir(output)
  except (FileNotFoundError, NotADirectoryError):
    return []
  paths = []
  for g in sorted(dirs):
    if not naming.is_generation(g) or g == exclude or not _is_toolkits(output, g):
      continue
    try:
      _, names = fs.list_dir(fs.join(output, g, folder))
    except (FileNotFoundError, NotADirectoryError):
      continue
    paths += [(g, n) for n in sorted(names) if n.endswith(".json")]

  def read(gn):
    d = _read_json(fs.join(output, gn[0], folder, gn[1]), MAX_RECORD_BYTES)
    return d if isinstance(d, dict) and d.get("toolkit") == commit.TOOLKIT else None

  if not paths:
    return []
  with concurrent.futures.ThreadPoolExecutor(min(_READ_THREADS, len(paths))) as pool:
    return [(g, n, d) for (g, n), d in zip(paths, pool.map(read, paths)) if d is not None]


def _read_json(path: str, limit: int):
  """The JSON value of a small regular file, or None: missing, larger than `limit`, not a regular
  file (a FIFO would block), not JSON, or nested deeper than the parser goes. Files of an output
  are untrusted input."""
  try:
    data, _ = fs.read_small(path, limit)
    return None if data is None else json.loads(data)
  except (FileNotFoundError, ValueError, RecursionError):
    return None


def _is_toolkits(output: str, generation: str) -> bool:
  return commit.generation_state(output, generation) is not None


def read_record(output: str, generation: str, shard_file: str) -> ShardRecord | None:
  """The record of shard `shard_file` of `generation`, checked; None when missing or malformed (logged)."""
  return _read_record(output, generation, shard_file + ".json")


def _read_record(output: str, generation: str, name: str) -> ShardRecord | None:
  d = _read_json(fs.join(output, generation, RECORDS_FOLDER, name), MAX_RECORD_BYTES)
  if d is None:
    return None
  try:
    return ShardRecord.from_json(d)
  except ValueError as e:
    _log.warning("ignored shard record %s/%s/%s: %s", generation, RECORDS_FOLDER, name, e)
    return None


# ---------------------------------------------------------------- reusing one shard

def adopt(output: str, generation: str, found: Reusable, dest_name: str | None = None) -> ShardInfo | None:
  """Copies an earlier shard into `generation` once its bytes match its record; None when they do not.

  Locally the copy is a hard link (a plain copy across file systems), made
  under a temporary name and renamed; on gs:// a server-side copy of exactly
  the object generation that was hashed. The source is read once, to check its
  size and SHA-256.

  Args:
    output: the output folder.
    generation: the run's generation (the destination folder).
    found: the earlier shard.
    dest_name: the shard's file name in `generation` (default: the same as before).

  Returns:
    The shard's manifest entry in `generation`, or None (missing, or not the bytes its record names).
  """
  rec = found.record.shard
  name = dest_name or rec.path
  with leased(output, found.generation):
    copied = copy_verified(fs.join(output, found.generation, rec.path), fs.join(output, generation, name),
                           rec.num_bytes, rec.sha256)
  if not copied:
    _log.warning("shard %s/%s does not match its record: converted again", found.generation, rec.path)
    return None
  return ShardInfo(f"{generation}/{name}", rec.num_records, rec.num_bytes, rec.sha256)


def copy_verified(src: str, dest: str, num_bytes: int, sha256: str) -> bool:
  """Copies `src` to `dest` (same file system or bucket) if its bytes are `num_bytes` with `sha256`.

  Locally a hard link of the inode that was hashed (a checked copy where links cannot be made);
  on gs:// a server-side copy of the object generation that was hashed.

  Args:
    src: the earlier file.
    dest: where the copy goes (replaced if there).
    num_bytes: its size, as recorded.
    sha256: its hex SHA-256, as recorded.

  Returns:
    Whether `dest` now holds exactly those bytes (False: missing, or other bytes; nothing written).
  """
  rec = ShardInfo("", 0, num_bytes, sha256)
  try:
    return _adopt_gcs(src, dest, rec) if fs.is_gcs(src) else _adopt_local(src, dest, rec)
  except (FileNotFoundError, fs.gcs_not_found(), fs.gcs_precondition_failed()):
    return False  # removed (a clean-up of another run) or replaced since it was listed: converted again


def _sha256_of(f, size_limit: int) -> tuple[str, int]:
  h, n = hashlib.sha256(), 0
  while block := f.read(1 << 22):
    n += len(block)
    if n > size_limit:
      return "", n
    h.update(block)
  return h.hexdigest(), n


def _adopt_local(src: str, dest: str, rec: ShardInfo) -> bool:
  with open(src, "rb") as f:
    st = os.fstat(f.fileno())
    digest, n = _sha256_of(f, rec.num_bytes) if st.st_size == rec.num_bytes else ("", 0)
    if digest != rec.sha256 or n != rec.num_bytes:
      return False
    tmp = fs.temp_beside(dest)
    try:
      os.link(src, tmp)
      linked = os.stat(tmp)
      if (linked.st_dev, linked.st_ino) == (st.st_dev, st.st_ino):  # exactly the inode just hashed
        os.replace(tmp, dest)
        return True
      os.remove(tmp)  # the source was replaced since it was hashed: copy the bytes that were
    except OSError as e:
      if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
        raise
    f.seek(0)
    with open(tmp, "wb") as out:
      copied, _ = _copy_checked(f, out)
    if copied != rec.sha256:
      os.remove(tmp)
      return False
  os.replace(tmp, dest)
  return True


def _copy_checked(src, out) -> tuple[str, int]:
  h, n = hashlib.sha256(), 0
  while block := src.read(1 << 22):
    out.write(block)
    h.update(block)
    n += len(block)
  return h.hexdigest(), n


def _adopt_gcs(src: str, dest: str, rec: ShardInfo) -> bool:
  bucket_name, name = fs.split_gcs(src)
  dest_bucket, dest_name = fs.split_gcs(dest)
  bucket = fs.gcs_client().bucket(bucket_name)
  blob = bucket.get_blob(name)
  if blob is None or blob.size != rec.num_bytes:
    return False
  generation = blob.generation

  class _Hasher:
    def __init__(self):
      self.h, self.n = hashlib.sha256(), 0

    def write(self, b):
      self.n += len(b)
      self.h.update(b)

  hasher = _Hasher()
  blob.download_to_file(hasher, if_generation_match=generation)
  if hasher.n != rec.num_bytes or hasher.h.hexdigest() != rec.sha256:
    return False
  # Server-side: no byte passes through here, and the copy is of the generation just hashed. Copying it
  # again gives the same object under a name only this run writes, so the one retry policy resends it
  # (the client's own would not: no destination precondition).
  bucket.copy_blob(blob, fs.gcs_client().bucket(dest_bucket), dest_name, if_source_generation_match=generation,
                   retry=retry.named(f"gs://{dest_bucket}/{dest_name}"))
  return True


# ---------------------------------------------------------------- appending to an output

@dataclasses.dataclass(frozen=True)
class AppendBase:
  """The output `--mode=append` adds to: its manifest, and per split its shards with their records.

  `held` maps (split, plan key) → its `unit_version` for every unit the
  output's shards were planned from (converted or rejected).
  """

  manifest: Manifest
  generation: str
  shards: Mapping[str, tuple[Reusable, ...]]
  held: Mapping[tuple[str, str], str]

  @property
  def carried_inputs(self) -> int:
    """Input units the carried shards account for (records made from them + rejected)."""
    return sum(r.record.inputs_used + r.record.inputs_rejected for rs in self.shards.values() for r in rs)


def append_base(output: str, fingerprint: str = "") -> AppendBase:
  """Reads the output an append adds to, checking that every shard has a record that agrees with it.

  Args:
    output: the output folder, holding a complete output.
    fingerprint: the run's `OutputPlan.fingerprint`; every record must carry the same.

  Returns:
    The `AppendBase`.

  Raises:
    UsageError: no output, a file output, or a shard without a matching record (an output written
      before appends existed, or by another tool): `--mode=rebuild` makes one that can be appended to.
  """
  data, _ = commit.read_manifest_versioned(output)
  if data is None:
    raise UsageError(f"--mode=append needs a complete output at {output}; there is none")
  manifest = Manifest.loads(data)
  if manifest.files or not manifest.splits:
    raise UsageError(f"{output} holds files, not record shards: --mode=append adds records only")
  generations = {s.path.split("/", 1)[0] for split in manifest.splits.values() for s in split.shards}
  if len(generations) != 1 or not naming.is_generation(next(iter(generations))):
    raise UsageError(f"{output}: its shards are not in one generation folder; run --mode=rebuild once")
  (generation,) = generations
  shards: dict[str, tuple[Reusable, ...]] = {}
  held: dict[tuple[str, str], str] = {}
  for split, info in sorted(manifest.splits.items()):
    found = []
    with concurrent.futures.ThreadPoolExecutor(max(1, min(_READ_THREADS, len(info.shards)))) as pool:
      records = list(pool.map(lambda s: _read_record(output, generation, s.path.split("/", 1)[1] + ".json"),
                              info.shards))
    for i, (shard, record) in enumerate(zip(info.shards, records)):
      name = shard.path.split("/", 1)[1]
      if (record is None or record.shard != dataclasses.replace(shard, path=name) or record.index != i
          or record.split != split or not record.inputs):
        raise UsageError(f"{output}: shard {shard.path} has no record of its inputs that agrees with the manifest "
                         "(written before appends existed, or changed since): run --mode=rebuild once")
      if record.fingerprint != fingerprint:
        raise UsageError(f"{output}: the output's record keys were made with other settings that no manifest "
                         "shows (for ct_volumes, another --id_salt): an append would convert every input again "
                         "beside its old copy; give the same ones, or run --mode=rebuild")
      found.append(Reusable(generation, record))
      for key, version, _ in record.inputs:
        if (split, key) in held:
          raise UsageError(f"{output}: two shards of split {split!r} hold the same input; run --mode=rebuild")
        held[(split, key)] = version
    shards[split] = tuple(found)
  return AppendBase(manifest, generation, shards, held)
