"""Record kinds: required features, inference for a manifest that records no kind, the manifest field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from formats import kinds, transforms
from formats.features import ClassLabel, Features, Image, Tensor, Text
from formats.manifest import Manifest, ShardInfo, SplitInfo

IMAGES = Features({"image": Image(), "label": ClassLabel(("cat", "dog")), "file_name": Text()})
RAW_IMAGES = Features({"image": Tensor(shape=(8, 8, 3)), "label": ClassLabel(("a",)), "file_name": Text()})
VOLUMES = Features({
    "volume": Tensor(shape=(None, None, None), dtype="int16"),
    "spacing": Tensor(shape=(3,), dtype="float32", encoding="none"),
    "origin": Tensor(shape=(3,), dtype="float32", encoding="none"),
    "direction": Tensor(shape=(3, 3), dtype="float32", encoding="none"),
    "num_slices": Tensor(shape=(), dtype="int64", encoding="none"),
    "series_id": Text(), "patient_id": Text(), "sorted_by": Text(),
})
GRAPHS = Features({
    "edge_index": Tensor(shape=(2, None), dtype="int64"),
    "num_nodes": Tensor(shape=(), dtype="int64", encoding="none"),
    "label": Tensor(shape=(1,), dtype="int64", encoding="none"),
})
ARRAYS = Features({"x": Tensor(shape=(4,), dtype="float32"), "name": Text()})


@pytest.mark.parametrize("kind, features", [
    ("image", IMAGES), ("image", RAW_IMAGES), ("volume", VOLUMES), ("graph", GRAPHS), ("tensors", ARRAYS),
    ("tensors", IMAGES), ("graphbin", Features({})),
])
def test_check_accepts_the_features_of_each_kind(kind, features):
  kinds.check(kind, features)


def test_check_names_a_missing_key():
  no_spacing = Features({k: v for k, v in VOLUMES.items() if k != "spacing"})
  with pytest.raises(ValueError, match="record kind 'volume' needs feature 'spacing' \\(Tensor\\)"):
    kinds.check("volume", no_spacing)


@pytest.mark.parametrize("kind, features, match", [
    ("image", Features({**IMAGES, "label": Text()}), "'label' must be ClassLabel, not Text"),
    ("image", Features({**IMAGES, "image": Tensor(shape=(8, 8, 1))}), "'image' must be a Tensor of uint8"),
    ("graph", Features({**GRAPHS, "edge_index": Tensor(shape=(3, None), dtype="int64")}), "'edge_index'"),
    ("graphbin", IMAGES, "has no records"),
    ("audio", IMAGES, "unknown record kind 'audio'"),
])
def test_check_refuses_wrong_features(kind, features, match):
  with pytest.raises(ValueError, match=match):
    kinds.check(kind, features)


@pytest.mark.parametrize("features, kind", [
    (IMAGES, "image"), (RAW_IMAGES, "image"), (VOLUMES, "volume"), (GRAPHS, "graph"), (ARRAYS, "tensors"),
    (Features({}), "tensors"),
])
def test_infer_by_feature_names(features, kind):
  assert kinds.infer(features) == kind


def test_infer_refuses_what_no_kind_fits():
  with pytest.raises(ValueError, match="no record kind fits"):
    kinds.infer(Features({"picture": Image()}))


def test_constants_of_the_volume_kind():
  assert kinds.KINDS["volume"].constants["padding_hu"] == transforms.CT_PADDING_HU == kinds.CT_PADDING_HU
  assert kinds.KINDS["volume"].constants["display_window_hu"] == (-1000.0, 1000.0)
  assert not kinds.KINDS["graphbin"].records and kinds.KINDS["tensors"].required == {}


def test_record_kind_is_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    kinds.KINDS["image"].name = "x"
  with pytest.raises(TypeError):
    kinds.KINDS["image"].required["x"] = None


def _manifest(kind: str = "", features: Features = IMAGES, file_format: str = "tfrecord") -> Manifest:
  shard = ShardInfo("d-train.tfrecord-00000-of-00001", 2, 10, "ab" * 32)
  splits = {"train": SplitInfo((shard,))} if file_format != "graphbin" else {}
  return Manifest("d", file_format, features, splits, kind=kind)


def test_manifest_kind_round_trip():
  m = _manifest("image")
  d = json.loads(m.dumps())
  assert d["kind"] == "image" and list(d)[:4] == ["manifest_version", "name", "format", "kind"]
  assert Manifest.loads(m.dumps()) == m and kinds.kind_of(m) == "image"


def test_a_manifest_without_a_kind_has_it_inferred():
  m = _manifest()
  assert "kind" not in json.loads(m.dumps())
  assert Manifest.loads(m.dumps()).kind == "" and kinds.kind_of(m) == "image"
  assert kinds.kind_of(_manifest(features=Features({}), file_format="graphbin")) == "graphbin"
  assert kinds.kind_of(_manifest("tensors")) == "tensors"  # the recorded kind wins over the names


def test_kind_of_reads_any_object_described_as_a_manifest_is():
  """kinds does not import the manifest module: kind_of takes what has kind, file_format and features."""

  @dataclasses.dataclass(frozen=True)
  class Described:
    kind: str
    file_format: str
    features: Features

  assert kinds.kind_of(Described("", "array_record", VOLUMES)) == "volume"
  assert kinds.kind_of(Described("tensors", "tfrecord", IMAGES)) == "tensors"
  assert kinds.kind_of(Described("", "graphbin", Features({}))) == "graphbin"


def test_a_manifest_whose_features_do_not_fit_its_kind_is_refused():
  with pytest.raises(ValueError, match="needs feature 'volume'"):
    _manifest("volume")
  d = json.loads(_manifest().dumps())
  d["kind"] = "graph"
  with pytest.raises(ValueError, match="needs feature 'edge_index'"):
    Manifest.from_json(d)


def test_an_inferred_kind_is_checked_as_a_recorded_one():
  """A manifest without `kind` whose features only look like a volume's (a `volume` tensor without the spacing
  and the rest) was inferred "volume" unchecked, then a KeyError deep in the volume transform: all generic
  features are read as plain tensors; names of a kind that do not fit it and are not all generic are refused."""
  looks_like = Features({"volume": Tensor((4,), "float64")})
  assert kinds.kind_of(_manifest(features=looks_like)) == "tensors"
  assert kinds.kind_of(_manifest(features=VOLUMES)) == "volume"
  with pytest.raises(ValueError, match="record kind 'volume'"):
    kinds.kind_of(_manifest(features=Features({"volume": Image((4, 4, 3))})))
