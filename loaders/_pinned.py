"""grain datasets of batches whose iterators name the data they read in every state (loaders._pinning).

    ds = PinnedMapDataset(batches, StateGuard(identity, batches_per_epoch), keep=(pin, stream))
    it = iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=8)))
    state = it.get_state()   # {"next_index": 3, "epoch": 0, "data": {"generation": "gen-...", ...}}
    it.set_state(state)      # StateMismatchError when `state` was saved on other data
    ds.close()               # the lease goes, the stream stops

The wrapper sits under whatever the user stacks on the dataset (`.map`,
`.batch`, ...): their iterators' states are built from this one's, so the
identity travels with them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import grain

from loaders._pinning import DataIdentity, StateGuard

__all__ = ["PinnedIterDataset", "PinnedMapDataset"]


class _Pinned:
  """What both pinned datasets show: the data's identity, from the guard that stamps their iterators."""

  _guard: StateGuard

  @property
  def identity(self) -> DataIdentity:
    """The data this dataset reads."""
    return self._guard.identity

  def __str__(self) -> str:
    return f"{type(self).__name__}({self.identity})"


class PinnedMapDataset(_Pinned, grain.MapDataset):
  """A MapDataset of batches that keeps what its reader opened alive and stamps its iterators' states.

  Element i is element i of `parent`. Its iterators (`to_iter_dataset()`, or
  `iter(ds)`) stamp every `get_state()` with the data's identity and check
  every `set_state()` against it (`StateGuard`). A MapDataset derived from
  this one (`.map`, `.slice`, ...) reads the same pinned data but its
  iterators carry grain's plain state.
  """

  def __init__(self, parent: grain.MapDataset, guard: StateGuard, keep: Iterable = (),
               close: Iterable[Callable[[], None]] = ()):
    """Args:
      parent: the batches.
      guard: the data's identity and what a state of other data does.
      keep: objects that live as long as this dataset (the Pin and its leases, a stream).
      close: called, in order, by `close()`.
    """
    super().__init__(parent)
    self._guard, self._keep, self._close = guard, tuple(keep), tuple(close)

  def __len__(self) -> int:
    return len(self._parent)

  def __getitem__(self, index):
    return self._parent[index]

  def to_iter_dataset(self, read_options: grain.ReadOptions | None = None, *,
                      allow_nones: bool = False) -> PinnedIterDataset:
    """grain's `to_iter_dataset`, whose iterators carry the data's identity in their states."""
    return PinnedIterDataset(super().to_iter_dataset(read_options, allow_nones=allow_nones), self)

  def __iter__(self):
    return self.to_iter_dataset().__iter__()

  def close(self) -> None:
    """Releases the lease and stops the reading behind this dataset (idempotent); later reads fail or reopen."""
    for f in self._close:
      f()


class PinnedIterDataset(_Pinned, grain.IterDataset):
  """An IterDataset over a PinnedMapDataset: its iterators stamp and check states; `close()` releases the lease."""

  def __init__(self, parent: grain.IterDataset, owner: PinnedMapDataset):
    super().__init__(parent)
    self._owner, self._guard = owner, owner._guard

  def close(self) -> None:
    """As PinnedMapDataset.close."""
    self._owner.close()

  def __iter__(self) -> _PinnedIterator:
    return _PinnedIterator(self._parent.__iter__(), self._guard)


class _PinnedIterator(grain.DatasetIterator):
  """The parent iterator, its states stamped with the data's identity and checked on restore."""

  _MUTATES_ELEMENT_SPEC = False

  def __init__(self, parent: grain.DatasetIterator, guard: StateGuard):
    super().__init__(parent)
    self._guard = guard

  def __next__(self):
    return next(self._parent)

  def get_state(self) -> dict:
    return self._guard.stamp(self._parent.get_state())

  def set_state(self, state: dict) -> None:
    self._parent.set_state(self._guard.check(state))

  def __str__(self) -> str:
    return f"PinnedIterator({self._guard.identity})"
