"""The loaders' settings, grouped by what they decide; each is defined here once, with its default.

    ds = loaders.grain.dataset(path, "train", batch_size=256,
                               ordering=loaders.Ordering(seed=3, num_epochs=10),
                               sharding=grain.sharding.ShardByJaxProcess(),   # or loaders.Sharding(i, n)
                               fetching=loaders.Fetching(cache_limit_bytes=20 << 30),
                               example=loaders.ExampleOptions(image_size=(224, 224)))
    ds = loaders.grain.dataset(path, "train", batch_size=256, seed=3, num_epochs=10, image_size=(224, 224))

Every loader (loaders.grain, loaders.xla, loaders.jax, loaders.tfdata, and the
graph feeders of loaders.graph for the fields they read) takes these groups, or
any field of a group by its own name (the second call above):
`Ordering` (which records each step holds, in what order, and what a resume
does), `Sharding` (this host's share), `Fetching` (how shards are proven and
fetched from gs://), `ExampleOptions` (record → fixed-shape example) and
`Reading` (host threads). A field given both ways, a name no group has, or a
setting the loader does not read (set to other than its default) is refused, so
nothing is silently ignored. A field whose default is None is the loader's own
(DEFAULTS, TFDATA_DEFAULTS, GRAPH_DEFAULTS), however it is given. grain's own
`grain.sharding.ShardOptions` (and its subclasses, such as ShardByJaxProcess) is
accepted as `sharding`, and `grain.ReadOptions` as `reading`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args

import numpy as np

from formats.outputs.integrity import Verify, verify_level
from loaders._order import ORDERS
from loaders._pinning import ON_NEW_DATA
from loaders._transforms import ExampleOptions, Patch

__all__ = ["DEFAULTS", "DEFAULT_RUN_RECORDS", "GRAPH_DEFAULTS", "TFDATA_DEFAULTS", "ExampleOptions", "Fetch",
           "Fetching", "OnNewData", "Order", "Ordering", "Patch", "Reading", "Settings", "Sharding", "settings"]

DEFAULT_RUN_RECORDS = 8  # Ordering.run_records with order="global": a host's batch of B records is B / 8 ranged reads

Order = Literal["global", "host"]
Fetch = Literal["auto", "shards", "records"]
OnNewData = Literal["error", "restart_epoch"]
assert set(get_args(Order)) == set(ORDERS) and set(get_args(OnNewData)) == set(ON_NEW_DATA)


def _at_least_one(name: str, value, optional: bool = True) -> None:
  """ValueError unless `value` is an integer >= 1 (or None, when optional)."""
  if value is None and optional:
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be >= 1 (an integer), got {value!r}")


@dataclasses.dataclass(frozen=True)
class Ordering:
  """Which records each step holds, in what order, and what restoring a state on other data does.

  Every field but num_epochs and on_new_data changes which records a position holds: a saved state
  names them (with the batch size) and resumes only with the same values (StateMismatchError).

  Attributes:
    shuffle: shuffle each epoch (seeded; every epoch differently).
    seed: fixes the order and every random draw (CT patch positions).
    num_epochs: epochs in a row.
    order: "global": global step k takes the next batch_size × shard_count records of the epoch's
      order over the whole split and host h its slice, with random draws keyed by the slot in the
      global batch, so a step's batches do not depend on the host count and a state resumes on any
      number of hosts with the same global batch. "host": each host's strided share of the split,
      shuffled on its own. None: the loader's default (DEFAULTS: "global"; TFDATA_DEFAULTS: "host").
    drop_remainder: drop each epoch's last short batch; False pads it and every batch carries
      `mask` (loaders.grain.records: trim the split to a multiple of shard_count). None: True.
    window_shards: read the split in windows of this many shards instead of at random: each epoch a
      seeded permutation of the shards is cut into windows and records are shuffled within their
      window; a gs:// split is then streamed through a bounded cache (`Fetching`). None: random
      access over the whole split (a gs:// split is first copied whole to local disk).
    run_records: with window_shards (only), a window's records are shuffled as runs of this many
      consecutive records of a shard (docs/loaders.md: what runs do to randomness). None: 8 with
      order="global" (a host's batch of B records is B / 8 ranged reads), 1 with order="host".
    on_new_data: what restoring a state saved on other data (another generation, manifest or split)
      does: "error" raises StateMismatchError naming both; "restart_epoch" keeps the state's epoch
      and starts that epoch over, from its first batch, in this data's order.

  Raises:
    ValueError: (on construction) an unknown order or on_new_data, a count below 1, a seed that is not
      an integer, a flag that is not a bool, or run_records without window_shards.
  """

  shuffle: bool = True
  seed: int = 0
  num_epochs: int = 1
  order: Order | None = None
  drop_remainder: bool | None = None
  window_shards: int | None = None
  run_records: int | None = None
  on_new_data: OnNewData = "error"

  @property
  def runs(self) -> int:
    """run_records, or its default for the order: DEFAULT_RUN_RECORDS with "global", 1 (every record on its
    own) with "host"."""
    if self.run_records is not None:
      return self.run_records
    return DEFAULT_RUN_RECORDS if self.order == "global" else 1

  def stamp(self, batch_size: int, shard_count: int) -> dict:
    """What fixes the records of each position, as a saved state records it (loaders._pinning.StateGuard).

    Args:
      batch_size: the batch on this host.
      shard_count: the number of hosts.
    """
    out = {"order": self.order, "shuffle": bool(self.shuffle), "seed": int(self.seed),
           "window_shards": self.window_shards, "run_records": self.runs if self.window_shards is not None else None}
    if self.order == "global":
      out["batch"] = batch_size * shard_count  # the global step: the same on any number of hosts
    else:
      out["batch"], out["hosts"] = batch_size, shard_count
    out["drop_remainder"] = self.drop_remainder
    return out

  def __post_init__(self) -> None:
    if self.order is not None and self.order not in ORDERS:
      raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
    if self.on_new_data not in ON_NEW_DATA:
      raise ValueError(f"on_new_data must be one of {ON_NEW_DATA}, got {self.on_new_data!r}")
    for name, value in (("shuffle", self.shuffle), ("drop_remainder", True if self.drop_remainder is None
                                                      else self.drop_remainder)):
      if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
      raise ValueError(f"seed must be an integer, got {self.seed!r}")
    _at_least_one("num_epochs", self.num_epochs, optional=False)
    _at_least_one("window_shards", self.window_shards)
    _at_least_one("run_records", self.run_records)
    if self.run_records is not None and self.window_shards is None:
      raise ValueError(f"run_records={self.run_records} shapes windows: it needs window_shards")


@dataclasses.dataclass(frozen=True)
class Sharding:
  """This host's share of every epoch: shard `shard_index` of `shard_count`.

  None takes the framework's own value: jax.process_index() / process_count() in loaders.jax,
  torch_xla's global_ordinal() / world_size() in loaders.xla, 0 and 1 elsewhere. The batch loaders
  always give every host the same number of records (collective steps would hang otherwise): the
  split is trimmed to a multiple of shard_count, so grain's ShardOptions(drop_remainder=False), as
  ShardByJaxProcess() has it, still trims there; `records` keeps every record with it.

  Attributes:
    shard_index: this host's shard.
    shard_count: the number of hosts reading.

  Raises:
    ValueError: (on construction) a count below 1 or an index outside [0, shard_count).
  """

  shard_index: int | None = None
  shard_count: int | None = None

  def __post_init__(self) -> None:
    _at_least_one("shard_count", self.shard_count)
    if self.shard_index is not None:
      if (isinstance(self.shard_index, bool) or not isinstance(self.shard_index, (int, np.integer))
          or self.shard_index < 0):
        raise ValueError(f"shard_index must be an integer >= 0 or None, got {self.shard_index!r}")
    for name in ("shard_index", "shard_count"):  # numpy integers become ints (they are JSON-able in states)
      if getattr(self, name) is not None:
        object.__setattr__(self, name, int(getattr(self, name)))
    if None not in (self.shard_index, self.shard_count) and self.shard_index >= self.shard_count:
      raise ValueError(f"shard_index {self.shard_index} is outside [0, {self.shard_count})")

  @classmethod
  def of(cls, sharding: Sharding | Any) -> Sharding:
    """`sharding` as a Sharding: itself, or the index and count of grain's ShardOptions (or any object with them)."""
    if isinstance(sharding, cls):
      return sharding
    try:
      return cls(int(sharding.shard_index), int(sharding.shard_count))
    except AttributeError:
      raise TypeError(f"sharding must be a loaders.Sharding or a grain ShardOptions, got {sharding!r}") from None

  def resolve(self, index: int, count: int) -> tuple[int, int]:
    """(shard_index, shard_count), each None taken from `index` and `count` (the framework's values)."""
    resolved = Sharding(index if self.shard_index is None else self.shard_index,
                        count if self.shard_count is None else self.shard_count)
    return resolved.shard_index, resolved.shard_count


@dataclasses.dataclass(frozen=True)
class Fetching:
  """How shards are proven against the manifest, cached, and fetched from gs://.

  Attributes:
    cache_dir: where gs:// shards are cached (default ~/.cache/tpu_shards/shards).
    verify: how shards are proven: "sha256" (once per shard per process), "size" or "none"
      (docs/loaders.md).
    cache_limit_bytes: the most local disk streamed shards may take (default: half the free space of
      the cache's disk, divided among the host's loader processes); for random access, a gs:// split
      larger than this is refused with advice instead of filling the disk.
    fetch: how a streamed gs:// split (Ordering.window_shards) is fetched: "shards" (whole shards of
      the windows), "records" (ArrayRecord only: this host's records, one ranged read per run of
      neighbouring records, verified by their chunk hashes, at most cache_limit_bytes in memory),
      or "auto": "records" with order="global" on several hosts, else "shards".
    lease: hold a lease (formats.outputs.leases) on the generation read while the loader lives, so a
      rerun's clean-up does not remove it; on read-only storage one warning is logged and the loader
      reads without one.

  Raises:
    ValueError: (on construction) an unknown verify level or fetch mode, or a cache limit below 1.
  """

  cache_dir: str | None = None
  verify: Verify = "sha256"
  cache_limit_bytes: int | None = None
  fetch: Fetch = "auto"
  lease: bool = True

  def __post_init__(self) -> None:
    verify_level(self.verify)
    if self.fetch not in get_args(Fetch):
      raise ValueError(f"fetch must be one of {get_args(Fetch)}, got {self.fetch!r}")
    _at_least_one("cache_limit_bytes", self.cache_limit_bytes)


@dataclasses.dataclass(frozen=True)
class Reading:
  """How many threads read and decode on the host, and how far ahead (grain's ReadOptions, which is accepted).

  Attributes:
    num_threads: reading threads (capped at the CPUs this process may use: more only adds GIL contention).
      None: the loader's default (DEFAULTS: 16; GRAPH_DEFAULTS: 4).
    prefetch_buffer_size: batches read ahead. None: the loader's default (DEFAULTS: 64; GRAPH_DEFAULTS: 8).

  Raises:
    ValueError: (on construction) a count below 1.
  """

  num_threads: int | None = None
  prefetch_buffer_size: int | None = None

  def __post_init__(self) -> None:
    _at_least_one("num_threads", self.num_threads)
    _at_least_one("prefetch_buffer_size", self.prefetch_buffer_size)

  @classmethod
  def of(cls, reading: Reading | Any) -> Reading:
    """`reading` as a Reading: itself, or grain's ReadOptions' thread count and buffer."""
    if isinstance(reading, cls):
      return reading
    try:
      return cls(int(reading.num_threads), int(reading.prefetch_buffer_size))
    except AttributeError:
      raise TypeError(f"reading must be a loaders.Reading or a grain ReadOptions, got {reading!r}") from None


_GROUPS = {"ordering": Ordering, "sharding": Sharding, "fetching": Fetching, "example": ExampleOptions,
           "reading": Reading}
_FIELD_GROUP = {f.name: group for group, cls in _GROUPS.items() for f in dataclasses.fields(cls)}
assert len(_FIELD_GROUP) == sum(len(dataclasses.fields(c)) for c in _GROUPS.values()), "a field name in two groups"


@dataclasses.dataclass(frozen=True)
class Settings:
  """The groups one loader call reads, every None a group leaves to the loader filled in (`settings`)."""

  ordering: Ordering = Ordering()
  sharding: Sharding = Sharding()
  fetching: Fetching = Fetching()
  example: ExampleOptions = ExampleOptions()
  reading: Reading = Reading()

  def groups(self) -> dict[str, Any]:
    """The groups as keyword arguments of another loader (`loaders.xla` hands them to `loaders.grain`)."""
    return {name: getattr(self, name) for name in _GROUPS}


# What every loader fills into the Nones a call leaves: the global order, the remainder dropped, 16 threads, 64
# batches ahead.
DEFAULTS = Settings(ordering=Ordering(order="global", drop_remainder=True),
                    reading=Reading(num_threads=16, prefetch_buffer_size=64))
# The graph feeders': a sampled batch with its features can take tens of MB, and sampling saturates few threads.
GRAPH_DEFAULTS = dataclasses.replace(DEFAULTS, reading=Reading(num_threads=4, prefetch_buffer_size=8))
# loaders.tfdata's: each host's own share through tf.data's own pipeline (TFRecordDataset, a shuffle buffer);
# order="global" gives loaders.grain's batches.
TFDATA_DEFAULTS = dataclasses.replace(DEFAULTS, ordering=Ordering(order="host", drop_remainder=True))


def settings(loader: str, *, read: tuple[str, ...] | None = None, defaults: Settings = DEFAULTS,
             ordering: Ordering | None = None, sharding: Sharding | Any | None = None,
             fetching: Fetching | None = None, example: ExampleOptions | None = None,
             reading: Reading | Any | None = None, **fields) -> Settings:
  """The settings of one loader call: the groups given, each field given by name set in its group, and the
  Nones left filled from `defaults`.

  Args:
    loader: the loader's name, for messages.
    read: the fields the loader reads, and the groups it reads whole ("sharding", "example"); any other
      setting given (other than its group's default) is a ValueError. None: it reads everything.
    defaults: what fills the fields given as None (or not at all): DEFAULTS, GRAPH_DEFAULTS or
      TFDATA_DEFAULTS.
    ordering, sharding, fetching, example, reading: the groups (None: the defaults); `sharding` may be
      grain's ShardOptions and `reading` grain's ReadOptions.
    **fields: any field of the groups by its own name.

  Returns:
    The Settings.

  Raises:
    TypeError: a name that is no group's field, a field given both by name and in its group, or a
      group of the wrong type.
    ValueError: a field's value is refused by its group, or the loader does not read it.
  """
  given = {"ordering": ordering, "sharding": None if sharding is None else Sharding.of(sharding),
           "fetching": fetching, "example": example, "reading": None if reading is None else Reading.of(reading)}
  for name, group in given.items():
    if group is not None and not isinstance(group, _GROUPS[name]):
      raise TypeError(f"{name} must be a loaders.{_GROUPS[name].__name__}, got {group!r}")
  by_group: dict[str, dict[str, Any]] = {name: {} for name in _GROUPS}
  for field, value in fields.items():
    group = _FIELD_GROUP.get(field)
    if group is None:
      raise TypeError(f"{loader}: unexpected keyword argument {field!r} (the settings are the fields of Ordering, "
                      f"Sharding, Fetching, ExampleOptions and Reading: {', '.join(sorted(_FIELD_GROUP))})")
    if given[group] is not None:
      raise TypeError(f"{field} is given both by name and in {group}=: give it once")
    by_group[group][field] = value
  out = {}
  for name, cls in _GROUPS.items():
    group = given[name] if given[name] is not None else cls(**by_group[name])
    unset = cls()
    for f in dataclasses.fields(cls):
      value = getattr(group, f.name)
      if read is not None and name not in read and f.name not in read and value != getattr(unset, f.name):
        raise ValueError(f"{loader} does not read {f.name} (set to {value!r})")
    fill = {f.name: getattr(getattr(defaults, name), f.name) for f in dataclasses.fields(cls)
            if getattr(group, f.name) is None}
    out[name] = dataclasses.replace(group, **fill) if fill else group
  return Settings(**out)
