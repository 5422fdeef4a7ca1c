"""Self-check of scripts/make_sample_ct.py against SimpleITK/GDCM and pydicom.

    .venv/bin/python tests/ct_factory_selftest.py

A throwaway script (not collected by pytest). It builds the mixed tree, then:
- determinism: the same seed writes byte-identical files under the same names;
- every valid single-frame series read by SimpleITK's ImageSeriesReader
  (files from GetGDCMSeriesFileNames) samples the same physical points with
  the same HU as the truth;
- Enhanced CT truths equal an independent parse of the functional groups,
  and SimpleITK's reading where it can be compared;
- every compressed file decodes with every installed pydicom plugin;
- each broken series really has its defect; PHI values are in the files.

Where SimpleITK legitimately differs from the truth (checked, not hidden):
1. PixelPaddingValue is ignored: padding -2000 with intercept -1024 reads as
   -3024 HU where the truth has -1024.
2. GetGDCMSeriesFileNames groups by SeriesInstanceUID only: it returns the
   scout with the axial slices, both contrast phases together, and both
   copies of an identical duplicate (then its IPPSorter gives up, the list is
   not position-sorted, and reading it gives spacing 0.125 and a flipped
   direction). Files are filtered to the truth's, deduplicated by
   SOPInstanceUID, and re-sorted by GDCM alone before reading.
3. Enhanced CT (sitk.ReadImage): frames stay in file order; the slice
   direction comes from the first two frames, so frames stored top-down
   give direction z = -normal and origin = first stored frame (same
   physical sampling, flipped index order: eCT_Supplemental reads as
   origin z -159, direction z +1); shuffled frames give spacing
   (1, 1, 1); per-frame rescale is not applied per frame.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
import warnings

import numpy as np
import pydicom
import pydicom.pixels
import SimpleITK as sitk
from pydicom.pixels.decoders.base import get_decoder

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import make_sample_ct as m  # noqa: E402

TOL_MM = 1e-4
sitk.ProcessObject.SetGlobalWarningDisplay(False)
warnings.filterwarnings("ignore")


def check(cond: bool, msg: str) -> None:
  if not cond:
    raise AssertionError(msg)


def tree_digest(root: str) -> dict[str, str]:
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames.sort()
    for f in sorted(filenames):
      p = os.path.join(dirpath, f)
      with open(p, "rb") as fh:
        out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
  return out


def sitk_geometry(img: sitk.Image) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(origin, spacing (x, y, z), direction with one axis per COLUMN)."""
  return np.array(img.GetOrigin()), np.array(img.GetSpacing()), np.array(img.GetDirection()).reshape(3, 3)


def compare_sitk(img: sitk.Image, t: m.SeriesTruth, pad_hu: float | None = None) -> str:
  """Checks SimpleITK's image samples the truth's points with the truth's HU.

  Returns "exact" when origin/spacing/direction also equal the truth's as
  stored, or "flipped" when SimpleITK's slice axis runs the other way.
  """
  arr = sitk.GetArrayFromImage(img).astype(np.float64)
  origin, spacing, d = sitk_geometry(img)
  check(arr.shape == t.hu.shape, f"{t.name}: sitk shape {arr.shape} != {t.hu.shape}")
  check(np.allclose(d[:, 0], t.direction[0]) and np.allclose(d[:, 1], t.direction[1]),
        f"{t.name}: in-plane axes {d[:, :2].T} != {t.direction[:2]}")
  check(np.allclose(spacing[:2], t.spacing[:0:-1], atol=TOL_MM), f"{t.name}: xy spacing {spacing[:2]} vs {t.spacing}")
  normal = t.direction[2]
  # Position of every sitk slice along the truth normal, mapped to truth index.
  pos = [normal @ (origin + k * spacing[2] * d[:, 2]) for k in range(arr.shape[0])]
  idx = (np.array(pos) - normal @ np.array(t.origin)) / t.spacing[0]
  check(np.allclose(idx, np.rint(idx), atol=1e-3), f"{t.name}: sitk slices off the truth grid: {idx}")
  idx = np.rint(idx).astype(int)
  check(sorted(idx.tolist()) == list(range(arr.shape[0])), f"{t.name}: sitk slice indices {idx}")
  # Same in-plane offset of the origin.
  for axis in (0, 1):
    check(abs(t.direction[axis] @ (origin - np.array(t.origin))) < TOL_MM, f"{t.name}: in-plane origin {origin}")
  truth = t.hu.astype(np.float64)[idx]
  diff = arr != truth
  if pad_hu is not None:
    check(np.all((truth[diff] == -1024) & (arr[diff] == pad_hu)), f"{t.name}: non-padding differences")
  else:
    check(not diff.any(), f"{t.name}: {diff.sum()} voxels differ, max {np.abs(arr - truth).max()}")
  exact = np.allclose(origin, t.origin, atol=TOL_MM) and np.allclose(d, t.direction.T) and np.allclose(
    spacing, t.spacing[::-1], atol=TOL_MM)
  return "exact" if exact else ("flipped" if idx[0] == arr.shape[0] - 1 else "permuted")


def header(path: str) -> pydicom.Dataset:
  return pydicom.dcmread(path, stop_before_pixels=True)


def padding_hu(t: m.SeriesTruth) -> float | None:
  if t.pixel_padding_value is None:
    return None
  ds = header(t.files[0])
  return t.pixel_padding_value * float(ds.RescaleSlope) + float(ds.RescaleIntercept)


def check_series_with_sitk(root: str, t: m.SeriesTruth) -> str:
  names = sitk.ImageSeriesReader.GetGDCMSeriesFileNames(root, t.series_uid, False, True)
  check(set(t.files) <= set(names), f"{t.name}: GDCM did not list all files")
  seen, selected = set(), []
  for n in names:
    uid = header(n).SOPInstanceUID if n in t.files else None
    if uid is not None and uid not in seen:
      seen.add(uid)
      selected.append(n)
  if len(selected) < len(names):
    # GDCM sorts only when given the one series: re-list the kept files alone
    # (with an identical duplicate its IPPSorter gives up and the order is not
    # by position).
    with tempfile.TemporaryDirectory() as links:
      for i, n in enumerate(selected):
        os.symlink(n, os.path.join(links, f"{i:04d}"))
      order = sitk.ImageSeriesReader.GetGDCMSeriesFileNames(links, t.series_uid)
      selected = [selected[int(os.path.basename(n))] for n in order]
  reader = sitk.ImageSeriesReader()
  reader.SetFileNames(selected)
  how = compare_sitk(reader.Execute(), t, padding_hu(t))
  extra = len(names) - len(t.files)
  return how + (f", gdcm listed {extra} extra file(s) with this series UID" if extra else "") + (
    f", {len(t.files) - len(selected)} duplicate(s) dropped" if len(selected) < len(t.files) else "")


def check_decoders(t: m.SeriesTruth) -> int:
  """Decodes every file with every plugin; compares HU slice by position."""
  count = 0
  for path in t.files:
    ds = pydicom.dcmread(path)
    decoder = get_decoder(ds.file_meta.TransferSyntaxUID)
    ipp = np.array(ds.ImagePositionPatient, dtype=float)
    k = int(round((t.direction[2] @ (ipp - np.array(t.origin))) / t.spacing[0]))
    for plugin in decoder.available_plugins:
      arr = pydicom.pixels.pixel_array(path, decoding_plugin=plugin).astype(np.float64)
      hu = arr * float(ds.RescaleSlope) + float(ds.RescaleIntercept)
      if t.pixel_padding_value is not None:
        hu[arr == t.pixel_padding_value] = -1024
      check(np.array_equal(hu, t.hu[k].astype(np.float64)), f"{t.name}: {plugin} decodes {path} wrongly")
      count += 1
  return count


def gaps(files: list[str], normal: np.ndarray) -> np.ndarray:
  pos = sorted(normal @ np.array(header(f).ImagePositionPatient, dtype=float) for f in files)
  return np.diff(pos)


def check_broken(t: m.SeriesTruth, by_name: dict[str, m.SeriesTruth]) -> None:
  normal = np.array([0.0, 0.0, 1.0])
  if t.expected == m.LOCALIZER:
    ds = header(t.files[0])
    check("LOCALIZER" in ds.ImageType and ds.SeriesInstanceUID == by_name[t.name[: -len("_scout")]].series_uid, t.name)
  elif t.expected == m.MISSING_SLICE:
    g = gaps(t.files, normal)
    check(np.isclose(g.max(), 2 * g.min()) and (~np.isclose(g, g.min())).sum() == 1, f"{t.name}: gaps {g}")
  elif t.expected == m.IRREGULAR_SPACING:
    g = gaps(t.files, normal)
    check(np.isclose(g.max(), 1.5 * g.min()) and (~np.isclose(g, g.min())).sum() == 1, f"{t.name}: gaps {g}")
  elif t.expected == m.GANTRY_TILT:
    ipps = np.array(sorted((header(f).ImagePositionPatient for f in t.files), key=lambda p: float(p[2])), dtype=float)
    step = np.diff(ipps, axis=0)
    check(np.all(np.abs(step[:, 1]) > 0.1) and np.allclose(step, step[0], atol=1e-3), f"{t.name}: steps {step}")
    check(float(header(t.files[0]).GantryDetectorTilt) == 15.0, t.name)
  elif t.expected == m.CONFLICTING_DUPLICATE:
    by_pos: dict[tuple, list[bytes]] = {}
    for f in t.files:
      ds = pydicom.dcmread(f)
      by_pos.setdefault(tuple(float(x) for x in ds.ImagePositionPatient), []).append(ds.pixel_array.tobytes())
    dups = [v for v in by_pos.values() if len(v) > 1]
    check(len(dups) == 1 and dups[0][0] != dups[0][1], f"{t.name}: {len(dups)} duplicate positions")
  elif t.expected == m.TRUNCATED:
    bad = 0
    for f in t.files:
      try:
        pydicom.dcmread(f).pixel_array
      except Exception:
        bad += 1
        header(f)  # the header still reads
    check(bad == 1, f"{t.name}: {bad} undecodable files")
  elif t.expected == m.MISSING_TAG:
    check(sum("ImagePositionPatient" not in header(f) for f in t.files) == 1, t.name)
  elif t.expected == m.NO_PIXEL_DATA:
    ds = pydicom.dcmread(t.files[0])
    check("PixelData" not in ds and ds.Modality == "SR", t.name)
  elif t.expected == m.SECONDARY_CAPTURE:
    ds = pydicom.dcmread(t.files[0])
    check(ds.SOPClassUID == pydicom.uid.SecondaryCaptureImageStorage and "ImagePositionPatient" not in ds, t.name)
  elif t.expected == m.NOT_DICOM:
    for f in t.files:
      try:
        ds = pydicom.dcmread(f)
        check("PixelData" not in ds and "SOPClassUID" not in ds, f"{f} parses as DICOM")
      except Exception:
        pass
  else:
    raise AssertionError(f"unknown expectation {t.expected!r}")


def check_phi(t: m.SeriesTruth) -> None:
  blobs = []
  for f in t.files:
    with open(f, "rb") as fh:
      blobs.append(fh.read())
  for key, value in t.phi.items():
    token = value.encode()
    check(all(token in b for b in blobs), f"{t.name}: PHI {key}={value!r} missing from some file")


def main() -> int:
  with tempfile.TemporaryDirectory() as tmp:
    root, root2, root3 = (os.path.join(tmp, n) for n in ("tree", "tree2", "tree3"))
    start = time.perf_counter()
    truths = m.make_mixed_tree(root, seed=0)
    elapsed = time.perf_counter() - start
    n_files = sum(len(t.files) for t in truths)
    print(f"make_mixed_tree: {len(truths)} truths, {n_files} files, {elapsed:.2f}s")

    m.make_mixed_tree(root2, seed=0)
    check(tree_digest(root) == tree_digest(root2), "same seed, different tree")
    m.make_mixed_tree(root3, seed=1)
    check(tree_digest(root) != tree_digest(root3), "different seeds, same tree")
    all_files = [f for t in truths for f in t.files]
    check(len(all_files) == len(set(all_files)) == len(tree_digest(root)), "files shared or unlisted")
    print("determinism, file lists: ok")

    by_name = {t.name: t for t in truths}
    decoded = 0
    for t in truths:
      if t.phi:
        check_phi(t)
      if t.expected != m.VOLUME:
        check_broken(t, by_name)
        print(f"  {t.name:26s} {t.expected}: defect present")
        continue
      check(t.hu.dtype in (np.int16, np.float32), t.name)
      check(np.allclose(np.linalg.norm(t.direction, axis=1), 1) and np.allclose(
        np.cross(t.direction[0], t.direction[1]), t.direction[2]), t.name)
      ts = pydicom.uid.UID(t.transfer_syntax)
      if "Enhanced" in t.note:
        parsed = m.truth_from_enhanced(t.files[0])
        check(np.array_equal(parsed.hu, t.hu) and parsed.hu.dtype == t.hu.dtype, f"{t.name}: fg parse differs")
        check(np.allclose(parsed.origin, t.origin) and np.allclose(parsed.spacing, t.spacing)
              and np.allclose(parsed.direction, t.direction), f"{t.name}: fg geometry differs")
        how = "functional groups ok"
        if t.name.endswith("eCT_Supplemental"):
          check(t.origin == (99.5, -301.5, -149.0) and t.spacing[0] == 10.0
                and np.allclose(t.direction[2], [0, 0, -1]), f"{t.name}: {t.origin} {t.spacing}")
          how += "; sitk " + compare_sitk(sitk.ReadImage(t.files[0]), t)
        print(f"  {t.name:26s} volume {t.hu.shape} {t.hu.dtype}: {how}")
        continue
      how = check_series_with_sitk(root, t)
      if ts.is_compressed:
        decoded += check_decoders(t)
      print(f"  {t.name:26s} volume {t.hu.shape} {t.hu.dtype} [{ts.name}]: sitk {how}")
    print(f"compressed decodes checked: {decoded} (file x plugin)")

    # Enhanced CT with ascending frames and one rescale: SimpleITK matches exactly.
    rng = np.random.default_rng(5)
    for order, expect in (("ascending", "exact"), ("descending", "flipped")):
      t = m.write_enhanced_series(os.path.join(tmp, "enh"), rng=rng, patient_id="E1", frame_order=order,
                                  orientation=m.OBLIQUE)
      got = compare_sitk(sitk.ReadImage(t.files[0]), t)
      check(got == expect, f"enhanced {order}: sitk {got}")
      print(f"enhanced {order}: sitk {got}")
    t = m.write_enhanced_series(os.path.join(tmp, "enh"), rng=rng, patient_id="E1", frame_order="shuffled")
    check(np.allclose(sitk.ReadImage(t.files[0]).GetSpacing(), 1.0), "sitk on shuffled frames")

    # Benchmark writer.
    start = time.perf_counter()
    big = m.write_big_series(os.path.join(tmp, "big"), 40)
    big_s = time.perf_counter() - start
    how = check_series_with_sitk(os.path.join(tmp, "big"), big)
    print(f"write_big_series(40 x 512 x 512): {big_s:.2f}s; sitk {how}")
  print("ALL OK")
  return 0


if __name__ == "__main__":
  sys.exit(main())
