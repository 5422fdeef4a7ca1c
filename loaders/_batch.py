"""Split records → one batch, each example written once into preallocated arrays. No framework.

`BatchFiller(source, options, batch_size, with_mask)` is the loaders' record
path: `fill(indices, rngs)` reads records `source.raw(i)` and writes each
straight into its slot of a batch of numpy arrays. It finds the features a
batch needs in the serialized Example with formats.example.FeatureFinder
(the rest of the record is checked, not decoded) and applies the record
kind's transform in place:

| kind | what is written into the slot |
|---|---|
| images, raw | the pixel bytes, copied once from the record |
| images, JPEG | the decoded image (loaders._transforms._decode_into: Pillow's pixels; simplejpeg for a JPEG of the target size) |
| tensors | every batched Tensor's bytes or values, every ClassLabel |
| graphs | edges, features and masks padded to max_nodes / max_edges |
| CT volumes | the transform's patch, cut from the shard where the record lies (`_Patches`) or decoded whole |

The batch is bit for bit what `fill_batch((transform(source.get(i, copy=False),
rng) ...), batch_size, with_mask)` gives (same keys in the same order, dtypes,
shapes and values; tests/loaders/test_batch.py): every feature's value is what
`Features.decode` would give, by the same `decode_from`, with shortcuts only
where the result is provably the same (a raw image of the right length, a
label in an Int64List, an encoded image in a BytesList).

CT patches in place: where `source.record_bytes(i)` gives the record where it
lies (loaders.ShardedRecords over ArrayRecord shards proven by their SHA-256),
the record is located once (formats.record_slices.locate_example: the
volume's and label's byte spans and shapes, every other feature decoded and
checked as Features.decode would; the label's foreground counts when a
positive draw first needs them) and kept; each patch then reads only the
bytes of its box (formats.record_slices.StoredArray) and goes through the same
transform code (loaders._transforms.volume_patcher). A record the walk does
not read (a form other than the writers') is read whole.

Every batch is new memory (nothing is pooled or reused: whoever holds a batch
may keep it as long as it likes, and nothing writes into it once it is
returned), and the arrays the plans and patches fill start on an
ALIGNMENT-byte boundary: on jax's CPU backend a device array then shares the
batch's memory instead of copying it (loaders.jax), which is only safe because
nothing writes into it again. (The generic path's arrays are fill_batch's.)

Errors: a record that does not parse, lacks a feature or holds one that does
not decode (a raw image of the wrong length, an image Pillow cannot read),
or whose features disagree (a CT label of another shape than its volume),
raises CorruptRecordError "<shard>: record <k>: <reason>" (`source.where(i)`),
the reason naming the feature, never its value; a graph over its budgets
raises the transform's ValueError.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
import contextlib
import dataclasses
import json
import math
import threading

import numpy as np

from formats.errors import CorruptRecordError, ExampleDecodeError
from formats.example import BYTES_LIST, FLOAT_LIST, INT64_LIST, FeatureFinder
from formats.features import ClassLabel, Features, Image, Tensor, Text
from formats.record_slices import StoredArray, locate_example
from formats.transforms import foreground_counts
from loaders._transforms import (ExampleOptions, _decode_into, batched_features, example_transform, fill_batch,
                                 graph_size, volume_patcher)

__all__ = ["ALIGNMENT", "BatchFiller", "aligned_empty"]

# Bytes a batch array's data is aligned to: jax's CPU client (PJRT) uses a host buffer aligned so in place and
# copies any other (numpy's allocator aligns to 16; a 64x224x224x3 uint8 copy takes ~2 ms, the 8-way split of an
# aligned one ~0.2 ms).
ALIGNMENT = 64


def aligned_empty(shape: Sequence[int], dtype) -> np.ndarray:
  """A new, uninitialised C-contiguous array whose data starts on an ALIGNMENT-byte boundary.

      image = aligned_empty((64, 224, 224, 3), np.uint8)   # image.ctypes.data % ALIGNMENT == 0
  """
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  buffer = np.empty(nbytes + ALIGNMENT, np.uint8)
  start = -buffer.ctypes.data % ALIGNMENT
  return buffer[start:start + nbytes].view(dtype).reshape(shape)


def _mask(size: int, n: int) -> np.ndarray:
  """`mask` of a batch of `size` slots holding `n` examples: True for the first n (aligned)."""
  return np.less(np.arange(size), n, out=aligned_empty((size,), bool))


class _BadFeature(Exception):
  """A feature whose value does not decode; the message names the feature and why."""


def _why(e: Exception) -> str:
  """Why a value did not decode, without quoting its bytes."""
  if isinstance(e, UnicodeDecodeError):
    return f"not UTF-8 ({e.reason})"
  if isinstance(e, ExampleDecodeError):
    return str(e)
  if isinstance(e, (ValueError, TypeError)):
    return f"{type(e).__name__}: {e}"
  return type(e).__name__


def _as_decoded(data: bytes, found: tuple[int, object]):
  """What decode_example(data, copy=False) holds under the key FeatureFinder found as `found`."""
  kind, values = found
  if kind == BYTES_LIST:
    view = memoryview(data)
    return [view[a:b] for a, b in values]
  if kind == INT64_LIST:
    return np.array(values, dtype=np.int64)
  if kind == FLOAT_LIST:
    return values
  return []


def _value_dtype(spec: Tensor) -> np.dtype:
  """The dtype Tensor.decode_from gives (bytes: little-endian, as stored; values: the spec's dtype)."""
  return np.dtype(spec.dtype) if spec.encoding == "none" else spec._le_dtype


def _static(spec, first: int = 0) -> bool:
  """Whether a Tensor's dimensions from `first` on are all known."""
  return isinstance(spec, Tensor) and None not in spec.shape[first:]


# A reader: (record bytes, the finder's output) → the feature's value, exactly as Features.decode gives it.
Reader = Callable[[bytes, list], object]


def _reader(name: str, spec, slots: dict[str, int], raw: bool = False) -> Reader:
  """The feature's value as `spec.decode_from(name, decode_example(data, copy=False))`, or _BadFeature.

  raw=True: a fixed-shape bytes Tensor stored as the pipelines store it comes
  as a memoryview of its little-endian bytes in the record (what decode_from
  would view as an array), for a plain copy into the batch.
  """
  keys = spec.keys(name)
  where = [(key, slots[key]) for key in keys]

  def generic(data, found):
    try:
      return spec.decode_from(name, {key: _as_decoded(data, found[i]) for key, i in where})
    except Exception as e:  # noqa: BLE001 - whatever decode_from raises, the record is bad
      raise _BadFeature(f"feature {name!r}: {_why(e)}") from None

  # Shortcuts for the forms the pipelines write: the one value of a list of the kind they use, as
  # decode_from would take it; any other form (a label in a FloatList, an empty list, two values, a label
  # out of range, ...) goes through decode_from itself, which refuses it. One closure for all four forms: no
  # call per value beyond the reader's.
  dtype, count, nbytes, num_classes = None, 0, 0, 0
  if isinstance(spec, ClassLabel):
    want, form = INT64_LIST, "int"  # int(np.int64 array[0]), without the array
    num_classes = spec.num_classes
  elif isinstance(spec, Image):
    want, form = BYTES_LIST, "view"  # the encoded image, a view of the record
  elif isinstance(spec, Text):
    want, form = BYTES_LIST, "str"
  elif isinstance(spec, Tensor) and spec.encoding == "bytes" and _static(spec):
    want, form = BYTES_LIST, "fixed"  # the little-endian bytes of a fixed shape
    dtype, count = spec._le_dtype, math.prod(spec.shape)
    nbytes = count * dtype.itemsize
  else:
    return generic
  i = where[0][1]

  def shortcut(data, found):
    kind, values = found[i]
    if kind == want and len(values) == 1:
      if form == "int":
        return values[0] if 0 <= values[0] < num_classes else generic(data, found)  # generic says why
      a, b = values[0]
      if form == "view":
        return memoryview(data)[a:b]
      if form == "str":
        try:
          return str(data[a:b], "utf-8")
        except UnicodeDecodeError:
          return generic(data, found)
      if b - a != nbytes:
        raise _BadFeature(f"feature {name!r}: {b - a} bytes, not the {nbytes} of {dtype} {spec.shape}")
      return memoryview(data)[a:b] if raw else np.frombuffer(data, dtype, count, a).reshape(spec.shape)
    return generic(data, found)
  return shortcut


class _Plan:
  """How one record kind's examples are written into a batch: its arrays, and a writer per slot.

  Attributes:
    finder: locates every key of the schema in a record.
    readers: a Reader per feature of the schema, in its order (all are decoded, as Features.decode does);
      those of `raw` come as bytes when they can.
    layout: batch key → (example shape, dtype), in the order of the transform's keys.
  """

  def __init__(self, features: Features, finder: FeatureFinder, raw: tuple[str, ...] = ()):
    slots = {key: i for i, key in enumerate(finder.keys)}
    self.finder = finder
    self.readers = [_reader(name, spec, slots, name in raw) for name, spec in features.items()]
    self.layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    self._at = {name: k for k, name in enumerate(features)}  # a feature's position in the readers' values

  def views(self, batch: dict) -> object:
    """What `write` writes through, made once per batch."""
    return batch

  @staticmethod
  def bytes_of(array: np.ndarray) -> tuple[memoryview, int]:
    """The batch array's bytes, and the bytes of one slot.

    A record's value is copied in with `view[j * n:(j + 1) * n] = value`: a
    memcpy that keeps the GIL, where numpy's copy would hand it to another
    thread and wait to get it back (with two threads on 224x224 raw images,
    12-16 % more images/s).
    """
    return memoryview(array).cast("B"), array[0].nbytes if len(array) else 0

  def write(self, views, j: int, values: list) -> None:
    """Writes the example of a record (its features' values, in schema order) into slot j."""
    raise NotImplementedError


class _Images(_Plan):
  """Images: raw pixels copied, or encoded images decoded by _decode_into; the label as int64."""

  def __init__(self, features: Features, finder: FeatureFinder, size: tuple[int, int] | None):
    super().__init__(features, finder, raw=("image",) if size is None else ())
    spec = features["image"]
    self._size = size  # None: raw pixels
    self._image = self._at["image"]
    label = isinstance(features.get("label"), ClassLabel)
    self._label = self._at["label"] if label else None
    shape, dtype = (tuple(spec.shape), _value_dtype(spec)) if size is None else ((*size, 3), np.dtype(np.uint8))
    self.layout["image"] = (shape, dtype)
    if label:
      self.layout["label"] = ((), np.dtype(np.int64))

  def views(self, batch):
    return batch["image"], self.bytes_of(batch["image"]), batch.get("label")

  def write(self, views, j, values):
    images, (pixels, n), labels = views
    image = values[self._image]
    if self._size is None:
      if type(image) is memoryview:  # the pixel bytes: the one copy
        pixels[j * n:(j + 1) * n] = image
      else:  # any other form decode_from reads (none for uint8 [H, W, 3]): its array
        images[j] = image
    else:
      try:
        _decode_into(images[j], image, self._size)
      except Exception as e:  # noqa: BLE001 - Pillow's many errors for bytes that are not an image
        raise _BadFeature(f"feature 'image': does not decode as an image ({type(e).__name__})") from None
    if labels is not None:
      labels[j] = values[self._label]


class _Tensors(_Plan):
  """"tensors" records: every batched Tensor as stored, every ClassLabel as int64."""

  def __init__(self, features: Features, finder: FeatureFinder):
    batched = batched_features(features)
    super().__init__(features, finder, raw=tuple(batched))
    for name, spec in batched.items():
      self.layout[name] = (((), np.dtype(np.int64)) if isinstance(spec, ClassLabel)
                           else (tuple(spec.shape), _value_dtype(spec)))

  def views(self, batch):
    return [(batch[name], self.bytes_of(batch[name]), self._at[name]) for name in self.layout]

  def write(self, views, j, values):
    for array, (raw, n), k in views:
      v = values[k]
      if type(v) is memoryview:
        raw[j * n:(j + 1) * n] = v
      else:
        array[j] = v


class _Graphs(_Plan):
  """Graph-property records padded to the node and edge budgets, with masks (as _graph_transform)."""

  def __init__(self, features: Features, finder: FeatureFinder, options: ExampleOptions):
    super().__init__(features, finder)
    self._options = options
    max_nodes, max_edges = options.max_nodes, options.max_edges
    self._node_range, self._edge_range = np.arange(max_nodes), np.arange(max_edges)
    label = features["label"]
    self.layout["num_nodes"] = ((), np.dtype(np.int64))
    self.layout["label"] = (tuple(label.shape), _value_dtype(label))
    self.layout["edge_index"] = ((2, max_edges), np.dtype(np.int64))
    self.layout["edge_mask"] = ((max_edges,), np.dtype(bool))
    self.layout["node_mask"] = ((max_nodes,), np.dtype(bool))
    self._padded = []
    for key, budget in (("node_feat", max_nodes), ("edge_feat", max_edges)):
      if key in features:
        self.layout[key] = ((budget, *features[key].shape[1:]), _value_dtype(features[key]))
        self._padded.append((key, self._at[key], features[key].shape[1:]))

  @staticmethod
  def fits(features: Features) -> bool:
    """Whether every batched feature has the static shape this plan allocates."""
    return (isinstance(features.get("num_nodes"), Tensor) and isinstance(features.get("edge_index"), Tensor)
            and _static(features.get("label"))
            and all(_static(features[key], 1) for key in ("node_feat", "edge_feat") if key in features))

  def write(self, batch, j, values):
    at = self._at
    ei = values[at["edge_index"]]
    n, e = graph_size(values[at["num_nodes"]], ei, self._options)
    batch["num_nodes"][j] = n
    batch["label"][j] = values[at["label"]]
    edges = batch["edge_index"][j]
    edges[:, :e] = ei
    edges[:, e:] = 0
    batch["edge_mask"][j] = self._edge_range < e
    batch["node_mask"][j] = self._node_range < n
    for key, k, rest in self._padded:
      v, slot = values[k], batch[key][j]
      slot[:len(v)] = v
      slot[len(v):] = 0


def _plan(kind: str, features: Features, options: ExampleOptions) -> _Plan | None:
  """The plan of records of `kind`, or None for the generic path (volumes; shapes a plan cannot allocate)."""
  keys = [key for name, spec in features.items() for key in spec.keys(name)]
  if len(set(keys)) != len(keys):
    return None
  finder = FeatureFinder(keys)
  if kind == "image":
    spec = features["image"]
    if isinstance(spec, Tensor):
      return _Images(features, finder, None) if _static(spec) else None
    fixed = None if None in spec.shape[:2] else tuple(spec.shape[:2])
    return _Images(features, finder, tuple(options.image_size or fixed))
  if kind == "tensors":
    return _Tensors(features, finder)
  if kind == "graph" and _Graphs.fits(features):
    return _Graphs(features, finder, options)
  return None


@dataclasses.dataclass
class _Located:
  """Where a CT record's arrays lie in it, and its small features: what a patch needs besides the patch's bytes.

  Attributes:
    arrays: feature name ("volume", "label") → (offset in the record, shape, dtype).
    spacing: the decoded `spacing`.
    counts: the label's foreground_counts, once a positive draw needed them.
  """

  arrays: dict[str, tuple[int, tuple[int, ...], np.dtype]]
  spacing: np.ndarray
  counts: np.ndarray | None = None

  @property
  def nbytes(self) -> int:
    return 256 + (0 if self.counts is None else self.counts.nbytes)


_READ_WHOLE = object()  # a record located in a form the walk does not read: read whole


class _LocatedCache:
  """Located CT records, process-wide: (shard file identity, record, schema) → _Located or _READ_WHOLE.

  Keyed by the file's (device, inode, size, mtime, ctime), so every loader of the process over the same
  shard shares them and a changed file is located anew; the least recently used go past `limit` bytes.
  """

  def __init__(self, limit: int):
    self._limit, self._bytes = limit, 0
    self._items: collections.OrderedDict[tuple, object] = collections.OrderedDict()
    self._lock = threading.Lock()

  @staticmethod
  def _size(found) -> int:
    return 64 if found is _READ_WHOLE else found.nbytes

  def get(self, key: tuple):
    with self._lock:
      found = self._items.get(key)
      if found is not None:
        self._items.move_to_end(key)
      return found

  def put(self, key: tuple, found) -> None:
    with self._lock:
      if key in self._items:
        self._bytes -= self._size(self._items[key])
      self._items[key] = found
      self._bytes += self._size(found)
      while self._bytes > self._limit and len(self._items) > 1:
        self._bytes -= self._size(self._items.popitem(last=False)[1])

  def grew(self, nbytes: int) -> None:
    """A kept record grew by `nbytes` (its label's counts)."""
    with self._lock:
      self._bytes += nbytes


# Located records kept: ~256 bytes each, plus a label's foreground counts (8 bytes a slice) once drawn.
_LOCATED = _LocatedCache(64 << 20)


def _stored_shape(spec: Tensor, name: str, values: dict, nbytes: int) -> tuple[int, ...]:
  """The shape Tensor.decode_from gives a bytes value of `nbytes` (its errors too), without the bytes."""
  if spec.dynamic:
    shape = tuple(int(d) for d in values[f"{name}/shape"])
  else:
    shape = tuple(-1 if d is None else d for d in spec.shape)
  dtype = spec._le_dtype
  if nbytes % dtype.itemsize:
    raise ValueError("buffer size must be a multiple of element size")
  # np.frombuffer(...).reshape(shape)'s shape and errors, on a stride-0 stand-in (nothing allocated)
  return np.broadcast_to(np.zeros((), dtype), (nbytes // dtype.itemsize,)).reshape(shape).shape


class _Patches:
  """CT patches cut from the shard where each record lies (see the module docstring).

  Each record is located once per process (`_LOCATED`, by shard file, record and schema).
  """

  def __init__(self, source, options: ExampleOptions):
    features = source.features
    self._source, self._features = source, features
    self._patch = volume_patcher(features, options)
    self._names = ("volume", "label") if self._patch.layout else ("volume",)
    self._value_keys = {name: features[name].keys(name)[-1] for name in self._names}
    self._schema = json.dumps(features.to_json(), sort_keys=True)

  @staticmethod
  def supports(source, options: ExampleOptions) -> bool:
    """Whether `source` offers records in place and its volumes (and labels) are stored as bytes."""
    if source.kind != "volume" or not callable(getattr(source, "record_bytes", None)):
      return False
    features = source.features
    names = ("volume", "label") if "label" in features else ("volume",)
    return all(isinstance(features[n], Tensor) and features[n].encoding == "bytes" for n in names)

  def fill(self, indices: Sequence[int], rngs: Callable[[int], object], batch_size: int, with_mask: bool,
           whole: Callable[[int, object], dict]) -> dict:
    """The batch of split records `indices`, each example written into its slot (`whole(i, rng)`'s example
    copied in for a record read whole); the keys, dtypes and zero padding of fill_batch's."""
    n = len(indices)
    layout = {**self._patch.shapes(), "record_index": ((), np.dtype(np.int64))}
    batch = {key: aligned_empty((batch_size, *shape), dtype) for key, (shape, dtype) in layout.items()}
    keys = [key for key in layout if key != "record_index"]
    for j, i in enumerate(indices):
      i = int(i)
      rng, slot = rngs(j), {key: batch[key][j] for key in keys}
      if not self.write(i, rng, slot):  # nothing drawn yet: the record read whole draws the same
        for key, value in whole(i, rng).items():
          batch[key][j] = value
      batch["record_index"][j] = i
    for array in batch.values():
      array[n:] = 0
    if with_mask:
      batch["mask"] = _mask(batch_size, n)
    return batch

  def write(self, i: int, rng, slot: dict) -> bool:
    """Writes the example of split record `i` into `slot` (key → array); False for a record read whole."""
    record = self._source.record_bytes(i)
    if record is None:
      return False
    located = self._located(i, record)
    if located is _READ_WHOLE:
      return False
    arrays = {name: StoredArray(record, *where) for name, where in located.arrays.items()}
    label = arrays.get("label")

    def counts() -> np.ndarray:
      if located.counts is None:  # the label streamed plane by plane, once per record
        located.counts = foreground_counts(label)
        _LOCATED.grew(located.counts.nbytes)
      return located.counts
    try:
      self._patch(arrays["volume"], label, located.spacing, rng, counts, slot)
    except CorruptRecordError as e:
      raise CorruptRecordError(f"{self._source.where(i)}: {e}") from None
    return True

  def _located(self, i: int, record):
    key = (record.file.identity, record.record, self._schema)
    found = _LOCATED.get(key)
    if found is None:
      found = self._locate(i, record)
      _LOCATED.put(key, found)
    return found

  def _locate(self, i: int, record):
    """The record's arrays and small features, checked as Features.decode and the transform check them."""
    where = self._source.where(i)
    try:
      layout = locate_example(record, set(self._value_keys.values()))
    except ExampleDecodeError as e:
      raise CorruptRecordError(f"{where}: {e}") from None
    if layout is None:
      return _READ_WHOLE
    missing = {key for name, spec in self._features.items() for key in spec.keys(name)} - layout.keys()
    if missing:
      raise CorruptRecordError(f"{where}: record lacks features {sorted(missing)}")
    decoded, arrays = {}, {}
    for name, spec in self._features.items():
      try:
        if name in self._value_keys:
          key = self._value_keys[name]
          if key not in layout.spans:  # stored in the schema's key, but not as one bytes value: read whole
            return _READ_WHOLE
          a, b = layout.spans[key]
          arrays[name] = (a, _stored_shape(spec, name, layout.values, b - a), spec._le_dtype)
        else:
          decoded[name] = spec.decode_from(name, layout.values)
      except Exception as e:  # noqa: BLE001 - whatever decode_from raises, the record is bad
        raise CorruptRecordError(f"{where}: {_why(e)}") from None
    label_spec = self._features.get("label")
    if len(arrays["volume"][1]) != 3 or ("label" in arrays and (len(arrays["label"][1]) != len(label_spec.shape)
                                                               or arrays["label"][1][3:] != label_spec.shape[3:])):
      return _READ_WHOLE  # a rank or channel count the batch does not hold: the generic path says what happens
    return _Located(arrays, decoded["spacing"])


class BatchFiller:
  """Records of a split → one batch of fixed-shape numpy arrays, each example written once into place.

      fill = BatchFiller(source, ExampleOptions(image_size=(224, 224)), batch_size=256, with_mask=False)
      batch = fill(indices, lambda j: element_rng(seed, position, j))   # {"image": uint8 [256, 224, 224, 3], ...}

  Safe to call from many threads at once (each call fills its own batch; a
  ShardedRecords source reads through each thread's own readers).

  Args:
    source: the records: `kind`, `features`, `raw(i)` (the bytes of split
      record i) and `where(i)` ("<shard>: record <k>"); a loaders.ShardedRecords.
    options: how records become fixed-shape examples.
    batch_size: the batch's first dimension.
    with_mask: add `mask`, True for the real examples (a short batch is zero-padded).

  Attributes:
    needs_rng: whether the transform draws (CT random patches): only then are rngs called.

  Raises:
    ValueError: (on construction) as loaders.example_transform: no transform
      for the kind, or an option the schema needs is missing.
  """

  def __init__(self, source, options: ExampleOptions, batch_size: int, with_mask: bool):
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    self._source = source
    self._batch_size, self._with_mask = batch_size, with_mask
    self._transform = example_transform(source.kind, source.features, options)  # checks the options
    self.needs_rng = bool(self._transform.needs_rng)
    self._plan = _plan(source.kind, source.features, options)
    self._patches = _Patches(source, options) if _Patches.supports(source, options) else None
    self._layout: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None  # of a batch _generic filled

  def __call__(self, indices: Sequence[int], rngs: Callable[[int], np.random.Generator | None]) -> dict:
    """One batch of the split records `indices`.

    Args:
      indices: at most batch_size split-record indices, in slot order.
      rngs: rngs(j) is the generator of slot j (called only when `needs_rng`).

    Returns:
      key → array [batch_size, ...]: the record kind's keys, `record_index`,
      and `mask` when with_mask; slots past len(indices) are zeros.

    Raises:
      CorruptRecordError: a record is damaged, does not parse against the
        schema or holds a feature that does not decode; the message names its
        shard and record (`source.where(i)`) and the feature.
      ValueError: a graph exceeds max_nodes / max_edges, or too many indices.
    """
    n = len(indices)
    if n > self._batch_size:
      raise ValueError(f"{n} indices for a batch of {self._batch_size}")
    if self._patches is not None:  # its layout comes from the patch shapes: an empty batch reads nothing
      return self._patches.fill(indices, rngs if self.needs_rng else lambda j: None, self._batch_size,
                                self._with_mask, self._whole)
    if self._plan is None:
      if not n:
        return self._padding()
      batch = self._generic(indices, rngs)
      if self._layout is None:
        self._layout = {k: (v.shape, v.dtype) for k, v in batch.items()}
      return batch
    plan, source, size = self._plan, self._source, self._batch_size
    finder = plan.finder
    batch = {key: aligned_empty((size, *shape), dtype) for key, (shape, dtype) in plan.layout.items()}
    record_index = batch["record_index"] = aligned_empty((size,), np.int64)
    views, readers, write = plan.views(batch), plan.readers, plan.write
    for j, i in enumerate(indices):
      i = int(i)
      data = source.raw(i)
      try:
        found = finder(data)
        write(views, j, [read(data, found) for read in readers])
      except (ExampleDecodeError, _BadFeature) as e:
        raise CorruptRecordError(f"{source.where(i)}: {e}") from None
      record_index[j] = i
    for array in batch.values():
      array[n:] = 0
    if self._with_mask:
      batch["mask"] = _mask(size, n)
    return batch

  def _padding(self) -> dict:
    """A batch of padding only (a host's share of the last global step can be empty): the keys, shapes and
    dtypes of every other batch, all zeros, `mask` all False.

    The layout is the last batch's; before any, one record's example's (a streamed source pins one for it:
    `pin_one_record`, as no record of an empty share is pinned).
    """
    if self._layout is None:
      if not len(self._source):
        raise ValueError("an empty split has no batch to pad")
      pin = getattr(self._source, "pin_one_record", None)
      with pin() if pin is not None else contextlib.nullcontext(0) as i:
        example = self._whole(i, np.random.default_rng(0) if self.needs_rng else None)
      self._layout = {k: (v.shape, v.dtype)
                      for k, v in fill_batch([example], self._batch_size, self._with_mask).items()}
    return {k: np.zeros(shape, dtype) for k, (shape, dtype) in self._layout.items()}

  def _generic(self, indices: Sequence[int], rngs: Callable[[int], np.random.Generator | None]) -> dict:
    """Decode, transform, copy: fill_batch over the transform's examples."""
    def examples():
      for j, i in enumerate(indices):
        yield self._whole(int(i), rngs(j) if self.needs_rng else None)
    return fill_batch(examples(), self._batch_size, self._with_mask)

  def _whole(self, i: int, rng) -> dict:
    """Decode, transform: the example of split record `i` read whole (as source.get, errors named)."""
    source = self._source
    data = source.raw(i)
    try:
      rec = source.features.decode(data, copy=False)
    except Exception as e:  # noqa: BLE001 - whatever the schema's decoders raise, the record is bad
      raise CorruptRecordError(f"{source.where(i)}: {_why(e)}") from None
    rec["record_index"] = np.int64(i)
    try:
      return self._transform(rec, rng)
    except CorruptRecordError as e:  # a record whose features disagree (a label not of its volume's shape)
      raise CorruptRecordError(f"{source.where(i)}: {e}") from None
