"""scripts/bench_storage.py: every variant it times returns the reference's bytes, and refuses what GCS refuses.

Run small against a bench bucket without latency: the toolkit worker always
(formats.storage, google-cloud-storage's Blob and transfer_manager); the
gcsfs and epath workers too where gcsfs is importable (it is not in
constraints.txt, so usually they are reported skipped).
"""

from __future__ import annotations

import importlib.util

import pytest

from scripts import bench_storage

MiB = 1 << 20


def test_relative_names_whatever_form_a_library_gives():
  names = ["gs://b/p/list/c1/x", "b/p/list/c0/y"]
  assert bench_storage._relative(names, "gs://b/p/list") == ["c0/y", "c1/x"]
  with pytest.raises(ValueError, match="not below"):
    bench_storage._relative(["b/q/z"], "gs://b/p")


def test_sizes_scale_counts_not_bytes_and_refuse_nonsense():
  s = bench_storage.Sizes().scaled(0.01)
  assert (s.list_objects, s.small_objects, s.ranged_reads, s.writes) == (50, 20, 10, 1)
  assert s.small_bytes == bench_storage.Sizes().small_bytes and s.list_folders <= s.list_objects
  with pytest.raises(ValueError, match="ranged_bytes"):
    bench_storage.Sizes(big_bytes=10, ranged_bytes=11)
  with pytest.raises(ValueError, match="writes"):
    bench_storage.Sizes(writes=0)


@pytest.mark.slow
def test_every_variant_returns_the_same_bytes(tmp_path):
  sizes = bench_storage.Sizes(list_objects=30, list_folders=3, small_objects=12, small_bytes=5000,
                              ranged_reads=10, ranged_bytes=70_000, big_bytes=3 * MiB + 17, writes=3,
                              chunk_bytes=MiB, streams=3)
  report = bench_storage.run(str(tmp_path), sizes, rounds=1, threads=4, latency_ms=0.0, mbps=0.0,
                             log=lambda line: None)
  results = report["results"]
  assert set(results) == set(bench_storage.OPS)
  with_gcsfs = importlib.util.find_spec("gcsfs") is not None
  expected = {v.name for v in bench_storage.VARIANTS if v.worker == "toolkit" or with_gcsfs}
  assert {name for variants in results.values() for name in variants} == expected
  for op, variants in results.items():
    for name, v in variants.items():
      assert v["same_as_reference"], (op, name, v)
      assert v["requests_per_item"] > 0 and v["wall_per_item_s"] > 0, (op, name)
  assert results["create"]["toolkit Blob.upload_from_string(if_generation_match=0)"]["checks"] == {
      "tried": 3, "refused": 3}
  cas = results["cas"]["toolkit Blob.upload_from_string(if_generation_match=N)"]["checks"]
  assert cas == {"tried": 3, "refused": 3, "new_generations": 3}
  download = results["download"]["toolkit gcs_download.download (durable=False)"]
  assert download["reference"] and download["cpu_ratio"] == 1.0 and download["bytes_sent_per_item"] == 3 * MiB + 17
  assert not with_gcsfs or not report["skipped"]
