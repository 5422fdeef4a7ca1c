"""Record kinds: what sort of record an output holds, recorded in its manifest.

A kind names the features every record of it must have (each with the
feature class it must be), and the constants that are part of its on-disk
contract. Readers choose a transform by kind, not by guessing from feature
names; the manifest records the kind (`"kind": "volume"`) and `kind_of`
infers it for a manifest that records none. A function's `kind` is a name in
`KINDS`, its `features` the schema of the records.

    image     an encoded image (or uint8 [H, W, 3] pixels), its class and file name
    volume    a CT series: HU voxels [depth, rows, columns] and its geometry
    graph     one graph of a graph-property data set: edge list, node count, label
    graphbin  a whole graph in one .graphbin file (docs/graphbin.md); no records
    tensors   any named Tensor / Text / ClassLabel features; nothing required.
              The kind a new converter uses without changing `formats`.

>>> check("image", Features({"image": Image(), "label": ClassLabel(("a",))}))
Traceback (most recent call last):
...
ValueError: record kind 'image' needs feature 'file_name' (Text); the features are ['image', 'label']
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import types
from typing import Any, Protocol

from formats.features import ClassLabel, Features, Tensor, Text

__all__ = [
    "CT_DISPLAY_WINDOW_HU", "CT_PADDING_HU", "GENERIC", "KINDS", "Described", "RecordKind", "check", "get", "infer",
    "kind_of",
]

# Hounsfield units written for padding and used to fill patches outside a volume (air is -1000).
CT_PADDING_HU = -1024
# The HU range drawn as black..white when a volume is shown to a person (formats.outputs.inspect --grid).
CT_DISPLAY_WINDOW_HU = (-1000.0, 1000.0)


@dataclasses.dataclass(frozen=True)
class RecordKind:
  """One kind of record: the features it requires and the constants of its layout.

  Attributes:
    name: the kind as written in manifest.json ("image", "volume", ...).
    required: feature name -> the feature class names it may have ("Tensor",
      "Image", ...), or None for any class.
    constants: values that are part of the kind's on-disk contract.
    tensors: for a required feature stored as a Tensor, the (dtype, shape) it
      must have; None in a shape matches any size.
    records: False for a kind whose output is a file, not record shards.
  """

  name: str
  required: Mapping[str, tuple[str, ...] | None] = dataclasses.field(default_factory=dict)
  constants: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  tensors: Mapping[str, tuple[str, tuple[int | None, ...]]] = dataclasses.field(default_factory=dict)
  records: bool = True

  def __post_init__(self):
    if not self.name.isidentifier():
      raise ValueError(f"record kind name {self.name!r} must be an identifier")
    for key in self.tensors:
      if key not in self.required:
        raise ValueError(f"record kind {self.name!r}: tensor constraint on {key!r}, which it does not require")
    object.__setattr__(self, "required", types.MappingProxyType(dict(self.required)))
    object.__setattr__(self, "constants", types.MappingProxyType(dict(self.constants)))
    object.__setattr__(self, "tensors", types.MappingProxyType(dict(self.tensors)))


_KIND_LIST = (
    RecordKind("image",
               required={"image": ("Image", "Tensor"), "label": ("ClassLabel",), "file_name": ("Text",)},
               tensors={"image": ("uint8", (None, None, 3))}),
    RecordKind("volume",
               required={"volume": ("Tensor",), "spacing": ("Tensor",), "origin": ("Tensor",),
                         "direction": ("Tensor",), "num_slices": ("Tensor",), "series_id": ("Text",),
                         "patient_id": ("Text",), "sorted_by": ("Text",)},
               constants={"padding_hu": CT_PADDING_HU, "display_window_hu": CT_DISPLAY_WINDOW_HU},
               tensors={"volume": ("", (None, None, None)), "spacing": ("float32", (3,)),
                        "origin": ("float32", (3,)), "direction": ("float32", (3, 3)),
                        "num_slices": ("int64", ())}),
    RecordKind("graph",
               required={"edge_index": ("Tensor",), "num_nodes": ("Tensor",), "label": ("Tensor",)},
               tensors={"edge_index": ("int64", (2, None)), "num_nodes": ("int64", ())}),
    RecordKind("graphbin", records=False),
    RecordKind("tensors"),
)

# Every record kind by name.
KINDS: Mapping[str, RecordKind] = types.MappingProxyType({k.name: k for k in _KIND_LIST})
# The kind of records that are named features and nothing more.
GENERIC = "tensors"
_GENERIC_CLASSES = (Tensor, Text, ClassLabel)


def get(kind: str) -> RecordKind:
  """The `RecordKind` named `kind`.

  Returns:
    Its `RecordKind`.

  Raises:
    ValueError: `kind` is not a known kind.
  """
  try:
    return KINDS[kind]
  except KeyError:
    raise ValueError(f"unknown record kind {kind!r}; the kinds are {sorted(KINDS)}") from None


def check(kind: str, features: Features) -> None:
  """Checks that `features` hold what records of `kind` require.

  Raises:
    ValueError: `kind` is unknown, a required feature is missing or of the wrong
      class, a required Tensor has the wrong dtype or shape, or a kind without
      records ("graphbin") has features. The message names the feature.
  """
  spec = get(kind)
  if not spec.records and len(features):
    raise ValueError(f"record kind {kind!r} has no records, yet features {sorted(features)} are given")
  for key, classes in spec.required.items():
    if key not in features:
      wanted = f" ({' or '.join(classes)})" if classes else ""
      raise ValueError(f"record kind {kind!r} needs feature {key!r}{wanted}; the features are {sorted(features)}")
    feature = features[key]
    if classes and type(feature).__name__ not in classes:
      raise ValueError(f"record kind {kind!r}: feature {key!r} must be {' or '.join(classes)}, "
                       f"not {type(feature).__name__}")
    if key in spec.tensors and isinstance(feature, Tensor):
      dtype, shape = spec.tensors[key]
      fits = len(feature.shape) == len(shape) and all(
          want is None or want == got for want, got in zip(shape, feature.shape))
      if (dtype and feature.dtype != dtype) or not fits:
        raise ValueError(f"record kind {kind!r}: feature {key!r} must be a Tensor of "
                         f"{dtype or 'any dtype'} with shape {shape}, not {feature.dtype} {feature.shape}")


def infer(features: Features) -> str:
  """The kind of records with these features, judged by their names (for a manifest that records no kind).

  Returns:
    "image" when there is an `image` feature, "volume" for a `volume`, "graph"
    for `edge_index` with `num_nodes`, else "tensors".

  Raises:
    ValueError: no kind fits: the features are not of a known kind and not all
      Tensor, Text or ClassLabel.
  """
  if "image" in features:
    return "image"
  if "volume" in features:
    return "volume"
  if "edge_index" in features and "num_nodes" in features:
    return "graph"
  if all(isinstance(f, _GENERIC_CLASSES) for f in features.values()):
    return GENERIC
  raise ValueError(f"no record kind fits features {sorted(features)}")


class Described(Protocol):
  """What `kind_of` reads of an output's manifest (a formats.manifest.Manifest, which imports this module)."""

  @property
  def kind(self) -> str: ...  # "" when the manifest records no kind

  @property
  def file_format(self) -> str: ...

  @property
  def features(self) -> Features: ...


def kind_of(manifest: Described) -> str:
  """The record kind of an output: the one its manifest records, else inferred.

  Args:
    manifest: an output's manifest (`Manifest`).

  Returns:
    A name in `KINDS`: `manifest.kind` when set; "graphbin" for a graph file
    output; otherwise `infer(manifest.features)`.

  Raises:
    ValueError: the manifest records no kind and none fits its features: the kind its names suggest lacks
      what it needs (`check`, as for a recorded kind) and not every feature is generic.
  """
  if manifest.kind:
    return manifest.kind
  if manifest.file_format == "graphbin":
    return "graphbin"
  kind = infer(manifest.features)
  try:
    check(kind, manifest.features)
  except ValueError:
    if all(isinstance(f, _GENERIC_CLASSES) for f in manifest.features.values()):
      return GENERIC  # a `volume` that is only named like one (a Tensor (4,)): plain tensors, as it was read
    raise
  return kind
