"""The loaders' settings, grouped by what they decide; each is defined here once, with its default.

    ds = loaders.grain.dataset(path, "train", batch_size=256,
                               ordering=loaders.Ordering(seed=3, num_epochs=10),
                               sharding=grain.sharding.ShardByJaxProcess(),   # or loaders.Sharding(i, n)
                               fetching=loaders.Fetching(cache_limit_bytes=20 << 30),
                               example=loaders.ExampleOptions(image_size=(224, 224)))
    ds = loaders.grain.dataset(path, "train", batch_size=256, seed=3, num_epochs=10, image_size=(224, 224))

Every loader (loaders.grain, loaders.xla, loaders.jax, loaders.tfdata) takes
these groups, or any field of a group by its own name (the second call above):
`Ordering` (which records each step holds, in what order, and what a resume
does), `Sharding` (this host's share), `Fetching` (how shards are proven and
fetched from gs://), `ExampleOptions` (record → fixed-shape example) and
`Reading` (host threads). A field given both ways, a name no group has, or a
setting the loader does not read (set to other than its default) is refused, so
nothing is silently ignored. grain's own `grain.sharding.ShardOptions` (and its
subclasses, such as ShardByJaxProcess) is accepted as `sharding`, and
`grain.ReadOptions` as `reading`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args

import numpy as np

from formats.outputs.integrity import Verify, verify_level
from loaders._order import ORDERS
from loaders._pinning import ON_NEW_DATA
from loaders._transforms import ExampleOptions, Patch

__all__ = ["DEFAULT_RUN_RECORDS", "GRAPH_DEFAULTS", "TFDATA_DEFAULTS", "ExampleOptions", "Fetch", "Fetching",
           "OnNewData", "Order", "Ordering", "Patch", "Reading", "Settings", "Sharding", "settings"]

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

  Every field here changes the batches: a saved state resumes only with the same values (the state
  names them, and a mismatch raises StateMismatchError).

  Attributes:
    shuffle: shuffle each epoch (seeded; every epoch differently).
    seed: fixes the order and every random draw (CT patch positions).
    num_epochs: epochs in a row.
    order: "global": global step k takes the next batch_size × shard_count records of the epoch's
      order over the whole split and host h its slice, with random draws keyed by the slot in the
      global batch, so a step's batches do not depend on the host count and a state resumes on any
      number of hosts with the same global batch. "host": each host's strided share of the split,
      shuffled on its own.
    drop_remainder: drop each epoch's last short batch; False pads it and every batch carries
      `mask`.
    window_shards: read the split in windows of this many shards instead of at random: each epoch a
      seeded permutation of the shards is cut into windows and records are shuffled within their
      window; a gs:// split is then streamed through a bounded cache (`Fetching`). None: random
      access over the whole split (a gs:// split is first copied whole to local disk).
    run_records: with window_shards, a window's records are shuffled as runs of this many
      consecutive records of a shard (docs/loaders.md: what runs do to randomness). None: 8 with
      order="global" (a host's batch of B records is B / 8 ranged reads), 1 with order="host".
    on_new_data: what restoring a state saved on other data (another generation, manifest or split)
      does: "error" raises StateMismatchError naming both; "restart_epoch" keeps the state's epoch
      and starts that epoch over, from its first batch, in this data's order.

  Raises:
    ValueError: (on construction) an unknown order or on_new_data, or a count below 1.
  """

  shuffle: bool = True
  seed: int = 0
  num_epochs: int = 1
  order: Order = "global"
  drop_remainder: bool = True
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

  def __post_init__(self) -> None:
    if self.order not in ORDERS:
      raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
    if self.on_new_data not in ON_NEW_DATA:
      raise ValueError(f"on_new_data must be one of {ON_NEW_DATA}, got {self.on_new_data!r}")
    _at_least_one("num_epochs", self.num_epochs, optional=False)
    _at_least_one("window_shards", self.window_shards)
    _at_least_one("run_records", self.run_records)


@dataclasses.dataclass(frozen=True)
class Sharding:
  """This host's share of every epoch: shard `shard_index` of `shard_count`.

  None takes the framework's own value: jax.process_index() / process_count() in loaders.jax,
  torch_xla's global_ordinal() / world_size() in loaders.xla, 0 and 1 elsewhere.

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
      if isinstance(self.shard_index, bool) or not isinstance(self.shard_index, int) or self.shard_index < 0:
        raise ValueError(f"shard_index must be an integer >= 0 or None, got {self.shard_index!r}")
      if self.shard_count is not None and self.shard_index >= self.shard_count:
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
    prefetch_buffer_size: batches read ahead.

  Raises:
    ValueError: (on construction) a count below 1.
  """

  num_threads: int = 16
  prefetch_buffer_size: int = 64

  def __post_init__(self) -> None:
    _at_least_one("num_threads", self.num_threads, optional=False)
    _at_least_one("prefetch_buffer_size", self.prefetch_buffer_size, optional=False)

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
  """The groups one loader call reads."""

  ordering: Ordering = Ordering()
  sharding: Sharding = Sharding()
  fetching: Fetching = Fetching()
  example: ExampleOptions = ExampleOptions()
  reading: Reading = Reading()

  def groups(self) -> dict[str, Any]:
    """The groups as keyword arguments of another loader (`loaders.xla` hands them to `loaders.grain`)."""
    return {name: getattr(self, name) for name in _GROUPS}

  def only(self, loader: str, *read: str) -> Settings:
    """Itself; ValueError naming the first setting other than its default that `loader` does not read.

    Args:
      loader: the loader's name, for the message.
      *read: the fields it reads, and the groups it reads whole ("sharding", "example").
    """
    for name, cls in _GROUPS.items():
      group, default = getattr(self, name), cls()
      for f in dataclasses.fields(cls):
        if name not in read and f.name not in read and getattr(group, f.name) != getattr(default, f.name):
          raise ValueError(f"{loader} does not read {f.name} (set to {getattr(group, f.name)!r})")
    return self


def settings(*, ordering: Ordering | None = None, sharding: Sharding | Any | None = None,
             fetching: Fetching | None = None, example: ExampleOptions | None = None,
             reading: Reading | Any | None = None, defaults: Settings | None = None, **fields) -> Settings:
  """The settings of one loader call: the groups given, each field given by name set in its group.

  Args:
    ordering, sharding, fetching, example, reading: the groups (None: the defaults); `sharding` may be
      grain's ShardOptions and `reading` grain's ReadOptions.
    defaults: the groups a field by name is set in (None: each group's own defaults; the graph feeders
      pass GRAPH_DEFAULTS, loaders.tfdata TFDATA_DEFAULTS).
    **fields: any field of the groups by its own name.

  Returns:
    The Settings.

  Raises:
    TypeError: a name that is no group's field, a field given both by name and in its group, or a
      group of the wrong type.
    ValueError: a field's value is refused by its group.
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
      raise TypeError(f"unexpected keyword argument {field!r} (the settings are the fields of Ordering, Sharding, "
                      f"Fetching, ExampleOptions and Reading: {', '.join(sorted(_FIELD_GROUP))})")
    if given[group] is not None:
      raise TypeError(f"{field} is given both by name and in {group}=: give it once")
    by_group[group][field] = value
  defaults = defaults or Settings()
  return Settings(**{name: given[name] if given[name] is not None
                     else dataclasses.replace(getattr(defaults, name), **by_group[name]) for name in _GROUPS})


# The graph feeders' defaults: a sampled batch with its features can take tens of MB, and sampling
# saturates few threads.
GRAPH_DEFAULTS = Settings(reading=Reading(num_threads=4, prefetch_buffer_size=8))
# loaders.tfdata's defaults: each host's own share through tf.data's own pipeline (TFRecordDataset, a shuffle
# buffer), as before it had the global order; order="global" gives loaders.grain's batches.
TFDATA_DEFAULTS = Settings(ordering=Ordering(order="host"))
