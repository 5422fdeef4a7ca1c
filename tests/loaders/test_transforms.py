"""loaders._transforms: each record kind's transform, and fill_batch, on records built in memory."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image as PILImage, ImageOps
import pytest

from formats.features import ClassLabel, Features, Image, Tensor, Text
from formats.transforms import CT_PADDING_HU
from loaders import ExampleOptions
from loaders._transforms import batched_features, example_transform, fill_batch
from tests.loaders import make_outputs

LABELS = ClassLabel(("cat", "dog", "yak"))


def _png(pixels: np.ndarray) -> bytes:
  data = io.BytesIO()
  PILImage.fromarray(pixels).save(data, format="PNG")
  return data.getvalue()


def test_raw_images_pass_through_with_an_int64_label():
  features = Features({"image": Tensor((6, 5, 3), "uint8"), "label": LABELS, "file_name": Text()})
  pixels = np.arange(90, dtype=np.uint8).reshape(6, 5, 3)
  t = example_transform("image", features, ExampleOptions())
  out = t({"image": pixels, "label": 2, "file_name": "a.png", "record_index": np.int64(7)})
  assert sorted(out) == ["image", "label", "record_index"]  # the file name is not batched
  np.testing.assert_array_equal(out["image"], pixels)
  assert out["label"].dtype == np.int64
  assert out["label"] == 2
  assert out["record_index"] == 7
  assert not t.needs_rng


def test_encoded_images_are_fitted_to_image_size():
  features = Features({"image": Image(), "label": LABELS, "file_name": Text()})
  with pytest.raises(ValueError, match="image_size"):
    example_transform("image", features, ExampleOptions())
  pixels = np.random.default_rng(0).integers(0, 256, (30, 50, 3), dtype=np.uint8)
  out = example_transform("image", features, ExampleOptions(image_size=(12, 16)))({"image": _png(pixels), "label": 0})
  want = ImageOps.fit(PILImage.fromarray(pixels), (16, 12), method=PILImage.Resampling.BILINEAR)
  assert out["image"].dtype == np.uint8
  assert out["image"].shape == (12, 16, 3)
  np.testing.assert_array_equal(out["image"], np.asarray(want))


def _volume_features() -> Features:
  return Features({"volume": Tensor((None, None, None), "int16"), "spacing": Tensor((3,), "float32")})


def test_volumes_are_cut_padded_clipped_and_normalised():
  features = _volume_features()
  with pytest.raises(ValueError, match="patch_size"):
    example_transform("volume", features, ExampleOptions())
  vol = np.full((2, 6, 6), 500, np.int16)
  vol[0, 0, 0] = 3000  # above the window: clipped to its top
  spacing = np.array([1.0, 0.5, 0.5], np.float32)
  o = ExampleOptions(patch_size=(4, 4, 4), patch="center", hu_window=(-1000.0, 1000.0))
  t = example_transform("volume", features, o)
  out = t({"volume": vol, "spacing": spacing, "record_index": np.int64(1)})
  assert not t.needs_rng
  assert out["patch_start"].tolist() == [0, 1, 1]  # max(shape - patch, 0) // 2
  assert out["volume"].dtype == np.float32
  assert out["volume"].shape == (4, 4, 4)
  np.testing.assert_array_equal(out["volume"][:2], np.full((2, 4, 4), 0.75, np.float32))  # (500 + 1000) / 2000
  padding = (max(CT_PADDING_HU, -1000.0) + 1000.0) / 2000.0
  np.testing.assert_array_equal(out["volume"][2:], np.full((2, 4, 4), padding, np.float32))
  np.testing.assert_array_equal(out["spacing"], spacing)
  raw = example_transform("volume", features, ExampleOptions(patch_size=(2, 6, 6), patch="center", normalize=False,
                                                              hu_window=(-1000.0, 1000.0)))({"volume": vol,
                                                                                              "spacing": spacing})
  assert raw["volume"][0, 0, 0] == 1000.0
  assert raw["volume"][1, 0, 0] == 500.0


def test_random_patches_follow_the_rng():
  features = _volume_features()
  t = example_transform("volume", features, ExampleOptions(patch_size=(2, 2, 2)))
  assert t.needs_rng
  rec = {"volume": np.zeros((8, 8, 8), np.int16), "spacing": np.ones(3, np.float32)}
  starts = {tuple(t(rec, np.random.default_rng(s))["patch_start"]) for s in range(20)}
  assert len(starts) > 1
  assert t(rec, np.random.default_rng(3))["patch_start"].tolist() == t(rec, np.random.default_rng(3))[
      "patch_start"].tolist()


def test_graphs_are_padded_to_their_budgets():
  features = Features({"edge_index": Tensor((2, None), "int64"), "num_nodes": Tensor((), "int64"),
                       "label": Tensor((1,), "int64"), "node_feat": Tensor((None, 2), "float32")})
  with pytest.raises(ValueError, match="max_nodes"):
    example_transform("graph", features, ExampleOptions())
  t = example_transform("graph", features, ExampleOptions(max_nodes=5, max_edges=4))
  rec = {"edge_index": np.array([[0, 1, 2], [1, 2, 0]], np.int64), "num_nodes": np.int64(3),
         "label": np.array([1]), "node_feat": np.ones((3, 2), np.float32)}
  out = t(rec)
  assert out["edge_index"].tolist() == [[0, 1, 2, 0], [1, 2, 0, 0]]
  assert out["edge_mask"].tolist() == [True, True, True, False]
  assert out["node_mask"].tolist() == [True, True, True, False, False]
  assert out["node_feat"].shape == (5, 2)
  assert out["node_feat"][3:].sum() == 0
  assert out["num_nodes"] == 3
  with pytest.raises(ValueError, match="exceeds max_nodes=2"):
    example_transform("graph", features, ExampleOptions(max_nodes=2, max_edges=4))(rec)


def test_tensors_keep_their_static_shape_and_dtype_and_leave_text_out():
  t = example_transform("tensors", make_outputs.TENSOR_FEATURES, ExampleOptions())
  rec = make_outputs.TENSOR_FEATURES.decode(make_outputs.TENSOR_FEATURES.encode(make_outputs.tensor_record(4)))
  out = t({**rec, "record_index": np.int64(4)})
  assert sorted(out) == ["count", "flag", "ids", "label", "record_index", "spacing", "x"]
  want = make_outputs.tensor_record(4)
  for name in ("x", "ids", "flag", "spacing", "count"):
    assert out[name].dtype == np.dtype(make_outputs.TENSOR_FEATURES[name].dtype), name
    assert out[name].shape == make_outputs.TENSOR_FEATURES[name].shape, name
    np.testing.assert_array_equal(out[name], want[name])
  assert out["label"].dtype == np.int64
  assert out["label"] == 1


def test_tensors_without_a_static_shape_cannot_be_batched():
  features = Features({"x": Tensor((None, 3), "float32"), "label": LABELS})
  with pytest.raises(ValueError, match=r"feature 'x' has shape \(None, 3\).*cannot be batched with static shapes"):
    example_transform("tensors", features, ExampleOptions())
  assert list(batched_features(Features({"label": LABELS, "name": Text()}))) == ["label"]


def test_kinds_without_a_transform_are_named():
  with pytest.raises(ValueError, match="kind 'graphbin'.*loaders.graph.load"):
    example_transform("graphbin", Features({}), ExampleOptions())


def test_fill_batch_copies_pads_and_masks():
  examples = [{"a": np.full((2, 3), i, np.int16), "b": np.float32(i + 0.5)} for i in range(1, 4)]
  out = fill_batch(iter(examples), 5, with_mask=True)
  assert sorted(out) == ["a", "b", "mask"]
  assert out["a"].shape == (5, 2, 3)
  assert out["a"].dtype == np.int16
  assert out["b"].dtype == np.float32
  assert out["a"][:, 0, 0].tolist() == [1, 2, 3, 0, 0]
  assert out["b"].tolist() == [1.5, 2.5, 3.5, 0.0, 0.0]
  assert out["mask"].tolist() == [True, True, True, False, False]
  examples[0]["a"][0, 0] = 99  # a copy, not a view
  assert out["a"][0, 0, 0] == 1
  full = fill_batch(examples, 3, with_mask=False)
  assert "mask" not in full
  assert full["a"][:, 1, 2].tolist() == [1, 2, 3]


def _jpeg(array, **save) -> bytes:
  import io

  from PIL import Image

  buf = io.BytesIO()
  Image.fromarray(array).save(buf, "JPEG", **save)
  return buf.getvalue()


def test_jpegs_of_the_target_size_decode_to_pillows_pixels_whatever_decoder_runs(monkeypatch):
  """_decode_into (simplejpeg for a YCbCr JPEG already of the size, else Pillow) gives _decode_image's pixels:
  baseline and progressive, 4:2:0 / 4:2:2 / 4:4:4, restart markers, other sizes (drafted and resized), gray,
  CMYK; the fast path is really taken for the converters' own form; a truncated JPEG fails either way."""
  import io

  from PIL import Image

  from loaders import _transforms as t

  rng = np.random.default_rng(3)
  x = np.linspace(0, 255, 64)
  photo = (np.stack(np.meshgrid(x, x), -1).sum(-1)[..., None] / 2 + rng.normal(0, 25, (64, 64, 3))).clip(0, 255)
  photo = photo.astype(np.uint8)
  cases = {
      "baseline 4:2:0 q95": _jpeg(photo, quality=95),
      "progressive": _jpeg(photo, quality=90, progressive=True),
      "4:2:2": _jpeg(photo, quality=85, subsampling=1),
      "4:4:4": _jpeg(photo, quality=75, subsampling=0),
      "restart markers": _jpeg(photo, quality=80, restart_marker_blocks=2),
      "larger: drafted and resized": _jpeg(np.repeat(np.repeat(photo, 3, 0), 3, 1), quality=90),
      "gray": _jpeg(photo[..., 0]),
  }
  cmyk = io.BytesIO()
  Image.fromarray(photo).convert("CMYK").save(cmyk, "JPEG")
  cases["CMYK"] = cmyk.getvalue()
  fast = []
  real = t.simplejpeg.decode_jpeg
  monkeypatch.setattr(t.simplejpeg, "decode_jpeg", lambda *a, **k: fast.append(1) or real(*a, **k))
  for name, data in cases.items():
    for form in (data, memoryview(data)):
      out = np.zeros((64, 64, 3), np.uint8)
      t._decode_into(out, form, (64, 64))
      assert np.array_equal(out, t._decode_image(bytes(data), (64, 64))), name
  assert len(fast) == 2 * 5  # the five YCbCr JPEGs of the size, in both forms; the others went through Pillow
  with pytest.raises(OSError):
    t._decode_into(np.zeros((64, 64, 3), np.uint8), cases["baseline 4:2:0 q95"][:400], (64, 64))
