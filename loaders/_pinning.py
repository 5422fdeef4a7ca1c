"""What a reader opened: one generation pinned for its life, named in every state it saves, held by a lease.

    pin = pin_output("gs://b/flowers", purpose="loaders.grain train")  # manifest.json read once, lease taken
    pin.output.shards("train")       # that manifest's shards, whatever is committed later
    guard = StateGuard(pin.identity("train"), batches_per_epoch=40, on_new_data="error")
    state = guard.stamp({"next_index": 3})   # {"next_index": 3, "epoch": 0, "data": {"generation": ...}}
    guard.check(state)                       # {"next_index": 3}; StateMismatchError on other data
    pin.release()                            # the lease goes (also when the pin is collected)

A loader opens an output once (`pin_output`) and reads only what that
manifest names, every epoch, so a rerun that commits a new generation under
it changes nothing in its batches. A lease (formats.outputs.leases: a small object
under `<output>/_leases/`, refreshed by a heartbeat thread) tells clean-up
not to remove the pinned generation while the reader lives. Where the output
is read-only the loader logs one warning and reads without a lease: the
retention period of replaced generations is then all that keeps them.

A saved state names the data it was saved on (`DataIdentity`: the manifest's
generation and SHA-256, the split, a graph's file); `StateGuard.check`
refuses a state of other data (`StateMismatchError`), or with
`on_new_data="restart_epoch"` starts the saved epoch over on the new data.
No framework: loaders._pinned puts this on grain's iterators.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import json
import logging
import threading
import warnings

from formats.outputs import leases
from formats.outputs.output import Output, data_generations, open_output

__all__ = ["ON_NEW_DATA", "DataIdentity", "Pin", "StateGuard", "StateMismatchError", "UnverifiedStateWarning",
           "check_on_new_data", "pin_output"]

logger = logging.getLogger(__name__)

ON_NEW_DATA = ("error", "restart_epoch")  # what set_state does with a state saved on other data
STATE_KEY = "data"  # the key of a state's DataIdentity
_EPOCH_KEY = "epoch"  # the epoch the state's position lies in (what "restart_epoch" restarts)
_ORDER_KEY = "order"  # the settings that fix which records a position holds (order, seed, windows, runs)
_ADDED_ORDER_KEYS = frozenset({"batch", "hosts", "drop_remainder"})  # order settings stamped since states had them
PIN_ATTEMPTS = 5  # manifest reads before a pin gives up waiting for commits to settle


class StateMismatchError(ValueError):
  """A saved state names other data (another generation, manifest or split) than the loader reads."""


class UnverifiedStateWarning(UserWarning):
  """A state that does not name its data (or its order settings) was restored unchecked."""


def check_on_new_data(on_new_data: str) -> str:
  """Returns `on_new_data`; ValueError unless it is one of ON_NEW_DATA."""
  if on_new_data not in ON_NEW_DATA:
    raise ValueError(f"on_new_data must be one of {ON_NEW_DATA}, got {on_new_data!r}")
  return on_new_data


@dataclasses.dataclass(frozen=True)
class DataIdentity:
  """Which data a loader reads: an output's manifest (generation and SHA-256), the split, a graph's file.

  Two identities name the same data when their manifest digest, split and
  file digest agree (`output`, the path, is for messages: a copy of an
  output at another path is the same data).

  Attributes:
    output: the output's path as the loader was given it.
    generation: the generation folder its manifest names (None: an output without generations, or a bare
      .graphbin).
    manifest_sha256: the SHA-256 of manifest.json as read (None: a bare .graphbin).
    split: the split read (graph samplers: the seed split, "<type>/<split>" for heterogeneous graphs, or
      "seed_nodes:<sha256 prefix>" for explicit seeds).
    file: a graph's .graphbin path inside the output.
    file_sha256: that file's SHA-256 as the manifest lists it.
  """

  output: str
  generation: str | None
  manifest_sha256: str | None
  split: str | None
  file: str | None = None
  file_sha256: str | None = None

  @classmethod
  def of(cls, output: Output, split: str | None, file=None) -> DataIdentity:
    """The identity of `split` (and of a graph's FileInfo `file`) of an opened output."""
    return cls(output.path, output.generation, output.manifest_sha256, split,
               file.path if file is not None else None, file.sha256 if file is not None else None)

  def to_state(self) -> dict:
    """The identity as a JSON-able dict (every field, None included: states keep one shape)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_state(cls, d: Mapping) -> DataIdentity:
    """The identity a state saved (`to_state`); StateMismatchError when it is not one."""
    if not isinstance(d, Mapping):
      raise StateMismatchError(f"the state's {STATE_KEY!r} entry is not a data identity: {d!r}")
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: d.get(k) for k in fields})

  def same_data(self, other: DataIdentity) -> bool:
    """Whether `other` names the same data (manifest digest, split and file digest)."""
    return (self.manifest_sha256, self.split, self.file_sha256) == (other.manifest_sha256, other.split,
                                                                     other.file_sha256)

  def __str__(self) -> str:
    where = self.generation or "no generation"
    digest = f", manifest sha256 {self.manifest_sha256[:12]}" if self.manifest_sha256 else ""
    file = f", {self.file} sha256 {self.file_sha256[:12]}" if self.file and self.file_sha256 else ""
    return f"{self.output} {where}{digest}{file}, split {self.split!r}"


class Pin:
  """An output opened once, and the leases that keep its generation(s) from clean-up while the pin lives.

  Attributes:
    output: the opened output (formats.outputs.output.Output); its manifest is the one read at open.
    leases: the leases held (empty with lease=False, on read-only storage, or for an output without
      generations).
  """

  def __init__(self, output: Output, held: list):
    self.output = output
    self.leases = held
    self._lock = threading.Lock()

  @property
  def generation(self) -> str | None:
    """The generation the output's manifest names."""
    return self.output.generation

  def identity(self, split: str | None, file=None) -> DataIdentity:
    """The DataIdentity of `split` (and of a graph's FileInfo `file`) of the pinned output."""
    return DataIdentity.of(self.output, split, file)

  def release(self) -> None:
    """Releases the leases (idempotent); the pinned output stays readable to this process until clean-up."""
    with self._lock:
      held, self.leases = self.leases, []
    for lease in held:
      lease.release()

  def __repr__(self) -> str:
    return f"Pin({self.output.path!r}, {self.output.generation}, leases={len(self.leases)})"


def pin_output(path: str, *, lease: bool = True, purpose: str = "loaders") -> Pin:
  """Opens the output at `path` once and, with `lease`, leases every generation its manifest names.

  A lease only protects a generation that clean-up has not yet judged: after
  writing it the manifest is read again, and if a commit replaced it
  meanwhile (its generation may be gone already) the new manifest is pinned
  instead. Nothing has been read from the data yet, so "the generation named
  at open" is the one named when the lease holds.

  Args:
    path: the output folder, local or gs://.
    lease: take leases (formats.outputs.leases); False reads without one.
    purpose: written into the lease, e.g. "loaders.grain train".

  Returns:
    The Pin. On storage that cannot be written (formats.outputs.leases.LeaseError)
    one warning is logged and the pin holds no lease.

  Raises:
    NotAnOutputError, ValueError, KeyError: as formats.outputs.output.open_output.
  """
  output = open_output(path)
  if not lease:
    return Pin(output, [])
  for _ in range(PIN_ATTEMPTS):
    held = _lease(output, purpose)
    if not held:
      return Pin(output, [])
    now = open_output(path)
    if now.manifest_sha256 == output.manifest_sha256:
      return Pin(output, held)
    for h in held:
      h.release()
    output = now
  return Pin(output, _lease(output, purpose))  # commits keep landing: the newest one, leased


def _lease(output: Output, purpose: str) -> list:
  """Leases on every generation of `output` ([] without generations; one warning and [] when not writable)."""
  held = []
  try:
    for generation in data_generations(output.manifest):
      held.append(leases.acquire(output.path, generation, purpose=purpose))
  except leases.LeaseError as e:
    for h in held:
      h.release()
    logger.warning("%s: reading %s without a lease (%s): clean-up may remove it once it is replaced and its "
                   "retention period (--keep_replaced) has passed; a loader that outlives that fails on its next "
                   "read (docs/loaders.md, Pinning and leases)", output.path, output.generation, e)
    return []
  return held


class StateGuard:
  """Stamps grain position states with the data's identity and checks the states restored against it.

  A state is grain's MapDataset iterator state (`{"next_index": n}`, n the
  batches read over all epochs) plus `"epoch"` (n // batches_per_epoch) and
  `"data"` (`DataIdentity.to_state()`).
  """

  def __init__(self, identity: DataIdentity, batches_per_epoch: int, on_new_data: str = "error",
               num_positions: int | None = None, order: Mapping | None = None):
    """Args:
      identity: the data the loader reads.
      batches_per_epoch: its batches per epoch.
      on_new_data: "error" or "restart_epoch" (ON_NEW_DATA).
      num_positions: the loader's batches over all its epochs (a restarted epoch past them is the end).
      order: the settings that fix which records each position holds (JSON-able), stamped into states and
        required to match on restore; None: not recorded.

    Raises:
      ValueError: `on_new_data` is not one of ON_NEW_DATA.
    """
    self.identity = identity
    self.batches_per_epoch = batches_per_epoch
    self.on_new_data = check_on_new_data(on_new_data)
    self.num_positions = num_positions
    self.order = None if order is None else json.loads(json.dumps(dict(order)))

  def stamp(self, state: Mapping) -> dict:
    """`state` with the epoch of its position and the data's identity."""
    out = dict(state)
    index = out.get("next_index")
    if isinstance(index, int) and self.batches_per_epoch:
      out[_EPOCH_KEY] = index // self.batches_per_epoch
    out[STATE_KEY] = self.identity.to_state()
    if self.order is not None:
      out[_ORDER_KEY] = dict(self.order)
    return out

  def _check_order(self, saved, stamped: bool) -> None:
    """Refuses a state saved with other order settings: its position would name other records."""
    if self.order is None:
      return
    if saved is None:
      if stamped:  # saved by a release that did not record them (before runs and the global default)
        hint = ("a state saved with order='host' (the default then) or with windows and one record per run "
                "(run_records=1) names other records" if "window_shards" in self.order else
                "a state saved with other settings names other records")
        warnings.warn(f"a state without its order settings (saved by an earlier release): resuming assumes it was "
                      f"saved with {self.order}; {hint}", UnverifiedStateWarning, stacklevel=4)
      return
    if saved != self.order:
      # keys stamped since a release: a state saved without one is compared without it
      now = {k: v for k, v in self.order.items() if k in saved or k not in _ADDED_ORDER_KEYS}
      if saved == now:
        return
      diff = ", ".join(f"{k}={saved.get(k)!r} (now {self.order.get(k)!r})" for k in sorted(set(saved) | set(self.order))
                       if saved.get(k) != self.order.get(k))
      raise StateMismatchError(f"the state was saved with other order settings: {diff}; its position names other "
                               f"records in this loader's order: pass the settings it was saved with")

  def check(self, state: Mapping) -> dict:
    """The position state to restore from `state` (a `stamp`ed state, or a bare position that names no data).

    Args:
      state: a saved state.

    Returns:
      The state without the identity: `state`'s own position on the same data;
      with on_new_data="restart_epoch" on other data, the first batch of the
      saved epoch.

    Raises:
      StateMismatchError: `state` names other data and on_new_data="error".
    """
    inner = {k: v for k, v in state.items() if k not in (STATE_KEY, _EPOCH_KEY, _ORDER_KEY)}
    self._check_order(state.get(_ORDER_KEY), state.get(STATE_KEY) is not None)
    saved = state.get(STATE_KEY)
    if saved is None:
      warnings.warn(f"a state without the data's identity (saved by an earlier release): resuming at "
                    f"{inner} of {self.identity} without checking that it is the data it was saved on; a state "
                    f"saved from now on is checked", UnverifiedStateWarning, stacklevel=3)
      return inner
    saved = DataIdentity.from_state(saved)
    if self.identity.same_data(saved):
      return inner
    if (saved.manifest_sha256 is None and saved.file_sha256 is None and self.identity.manifest_sha256 is None
        and saved.split == self.identity.split):
      warnings.warn(f"a state saved on a bare .graphbin by an earlier release names no digest of it: resuming at "
                    f"{inner} of {self.identity} without checking that it is the graph it was saved on; a state "
                    f"saved from now on is checked", UnverifiedStateWarning, stacklevel=3)
      return inner
    if self.on_new_data == "error":
      raise StateMismatchError(
          f"the state was saved on {saved.generation or 'no generation'} ({saved}) but this loader reads "
          f"{self.identity.generation or 'no generation'} ({self.identity}): its position names other records; "
          f"pass on_new_data='restart_epoch' to start its epoch over on the new data")
    epoch = state.get(_EPOCH_KEY)
    if not isinstance(epoch, int):
      raise StateMismatchError(f"the state names other data ({saved}) and no epoch to restart: {dict(state)}")
    logger.warning("on_new_data='restart_epoch': the state was saved on %s; starting its epoch %d over on %s",
                   saved, epoch, self.identity)
    index = epoch * self.batches_per_epoch
    return {**inner, "next_index": index if self.num_positions is None else min(index, self.num_positions)}
