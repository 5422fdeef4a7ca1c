"""`inputs.ListFiles` on gs://: one level at first, sub-folders fanned out to the workers; the
result equals the recursive listing, exactly (odd names, a folder marker, a doubled slash)."""

from __future__ import annotations

import apache_beam as beam
from apache_beam.testing.util import assert_that, equal_to
import pytest

from formats.storage import files
from pipelines.core import inputs

pytestmark = [pytest.mark.gcs]


def test_the_fanned_out_listing_equals_the_recursive_one(gcs_emulator):
  root = f"gs://{gcs_emulator}/listing/tree"
  names = ["top.dcm", "p1/s1/a.dcm", "p1/s1/b.dcm", "p1/s2/c.dcm", "p2/d.dcm", "p2//doubled.dcm",
           "p3/[odd] name.dcm", "p3/sub/deeper/e.dcm", "/rooted.dcm"]
  for i, n in enumerate(names):
    files.write_bytes(f"{root}/{n}", b"x" * (i + 1))
  files.write_bytes(f"{root}/p4/", b"")  # a folder marker, not a file
  files.write_bytes(f"gs://{gcs_emulator}/listing/tree2/z.dcm", b"not below tree/")
  whole = inputs.list_tree(root, 30)
  assert sorted(f.path for f in whole.files) == sorted(f"{root}/{n}" for n in names)
  level, below = inputs.list_gcs_level(root, 30)
  assert [f.path for f in level.files] == [f"{root}/top.dcm"] and level.sizes == [1]
  assert below == [f"{root}/{p}/" for p in ("", "p1", "p2", "p3", "p4")]  # "tree//rooted.dcm": prefix "tree//"
  want = sorted(("k", f.path, size) for f, size in zip(whole.files, whole.sizes))
  with beam.Pipeline() as p:
    listed = p | beam.Create([("k", inputs.InputFile(root))]) | inputs.ListFiles(30, with_sizes=True)
    assert_that(listed.files | beam.MapTuple(lambda k, f, size: (k, f.path, size)), equal_to(want), label="files")
    assert_that(listed.rejects, equal_to([]), label="rejects")


def test_image_folder_on_gs_plans_the_same_shards_on_the_workers_as_at_launch(class_folder, gcs_emulator, tmp_path):
  from formats.outputs.output import open_output
  from pipelines import image_folder
  from tests.conftest import upload_tree

  src = f"gs://{gcs_emulator}/listing/pets"
  upload_tree(class_folder, src)
  digests = {}
  for plan in ("launcher", "workers"):
    out = f"gs://{gcs_emulator}/listing/out-{plan}"
    image_folder.run([f"--input={src}", f"--output={out}", "--num_shards=3", "--image_size=16,16", f"--plan={plan}"])
    m = open_output(out).manifest
    digests[plan] = [(s.num_records, s.sha256) for s in m.splits["train"].shards]
  assert digests["launcher"] == digests["workers"] and len(digests["workers"]) == 3
