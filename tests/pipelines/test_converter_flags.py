"""Each converter's own flag errors, in-process: a `UsageError` naming the flag, raised before
anything is written. (The shared flags are tested for every converter in test_registry.py; what
only a process shows, the exit status 2 and its one line, by one `python -m` per converter there.)"""

from __future__ import annotations

import os

import pytest

from scripts import make_sample_ogb as mo
from pipelines import ct_volumes, image_folder, ogb_graphs
from pipelines.core import UsageError


def _refused(run, args: list[str], message: str, src: str, out: str) -> None:
  before = sorted(os.listdir(src))
  with pytest.raises(UsageError, match=message):
    run([a.format(src=src, out=out) for a in args])
  assert not os.path.exists(out) and sorted(os.listdir(src)) == before


@pytest.fixture
def folder(tmp_path) -> str:
  """An input folder with one class folder in it (its content is never read: flags fail first)."""
  os.makedirs(tmp_path / "in" / "cat")
  return str(tmp_path / "in")


@pytest.mark.parametrize("args,message", [
    (["--encoding=raw"], "--encoding=raw needs --image_size"),
    (["--image_size=224"], "--image_size must be H,W"),
    (["--image_size=0,4"], "--image_size must be H,W with positive integers"),
    (["--image_size=100000,100000"], "--image_size sides must be <= "),
    (["--max_image_pixels=0"], "--max_image_pixels must be >= 1"),
    (["--id_salt=x"], "unrecognized arguments: --id_salt=x"),  # a flag of another converter
])
def test_image_folder_flags(folder, tmp_path, args, message):
  _refused(image_folder.run, ["--input={src}", "--output={out}", *args], message, folder, str(tmp_path / "out"))


@pytest.mark.parametrize("args,message", [  # whole messages, as the CLI has always printed them
    (["--image_size=0,5"], "--image_size must be H,W with positive integers, got '0,5'"),
    (["--image_size=20000,10"], "--image_size sides must be <= 16384, got '20000,10'"),
    (["--image_size=224"], "--image_size must be H,W with positive integers, got '224'"),
    (["--jpeg_quality=101"], "--jpeg_quality must be in [1, 100], got 101"),
    (["--jpeg_quality=0"], "--jpeg_quality must be in [1, 100], got 0"),
    (["--max_image_pixels=x"], "--max_image_pixels must be an integer, got 'x'"),
    (["--encoding=bad"], "--encoding must be jpeg or raw, got 'bad'"),
    # with two bad flags, the first on the command line (argparse's order)
    (["--layout=bad", "--encoding=bad"], "--layout must be auto, classes or splits, got 'bad'"),
    (["--jpeg_quality=x", "--encoding=bad"], "--jpeg_quality must be an integer, got 'x'"),
    (["--encoding=bad", "--jpeg_quality=x"], "--encoding must be jpeg or raw, got 'bad'"),
    (["--image_size=0,5", "--max_image_pixels=x"], "--image_size must be H,W with positive integers, got '0,5'"),
])
def test_image_folder_flag_messages_are_unchanged(folder, tmp_path, args, message):
  with pytest.raises(UsageError) as e:
    image_folder.run([f"--input={folder}", f"--output={tmp_path / 'out'}", *args])
  assert str(e.value) == message


@pytest.mark.parametrize("args,message", [
    ([], "--id_salt is required"),
    (["--id_salt=x", "--splits=train=0.5"], "sum to 1"),
    (["--id_salt=x", "--splits=bogus"], "--splits must look like"),
    (["--id_salt=x", "--splits=train=1..0"], "--splits must look like"),  # no traceback from float()
    (["--id_salt=x", "--splits=train=."], "--splits must look like"),
    (["--id_salt=x", "--splits=train=0.5,train=0.5"], "--splits names a split twice"),
    (["--id_salt=x", "--volume_dtype=uint8"], "--volume_dtype must be auto, int16 or float32"),
    (["--id_salt=x", "--slice_tolerance=0.7"], "--slice_tolerance must be a fraction in"),
    (["--id_salt=x", "--max_file_bytes=0"], "--max_file_bytes"),
    (["--id_salt=x", "--max_file_bytes=lots"], "--max_file_bytes"),
    (["--id_salt=x", "--max_volume_voxels=-1"], "--max_volume_voxels"),
    (["--id_salt=x", "--image_size=4,4"], "unrecognized arguments: --image_size=4,4"),
    (["--id_salt=x", "--plan=launcher"], "--plan=launcher: ct_volumes plans its series on the workers"),
])
def test_ct_volumes_flags(folder, tmp_path, args, message):
  _refused(ct_volumes.run, ["--input={src}", "--output={out}", *args], message, folder, str(tmp_path / "out"))


@pytest.fixture(scope="module")
def ogb_folder(tmp_path_factory) -> str:
  base = tmp_path_factory.mktemp("ogb")
  return str(mo.write_homogeneous_node(os.path.join(base, "ogbn_arxiv"), 0, num_nodes=50, num_edges=100).folder)


@pytest.mark.parametrize("args,message", [
    (["--add_inverse_edges=maybe"], "--add_inverse_edges must be auto, true or false"),
    (["--feature_dtype=int8"], "--feature_dtype must be float32 or float16"),
    (["--csc=maybe"], "--csc must be true or false, got 'maybe'"),
    (["--edges_per_partition=0"], "--edges_per_partition must be >= 1, got 0"),
    (["--name=ogbn-unknown"], "pass --add_inverse_edges"),  # not in ogb's master.csv: found at launch
    (["--plan=launcher"], "--plan=launcher: ogb_graphs makes no shard plan"),
    (["--plan=workers"], "--plan=workers: ogb_graphs makes no shard plan"),
])
def test_ogb_graphs_flags(ogb_folder, tmp_path, args, message):
  _refused(ogb_graphs.run, ["--input={src}", "--output={out}", *args], message, ogb_folder, str(tmp_path / "out"))


def test_ogb_graphs_input_without_raw_folder(folder, tmp_path):
  _refused(ogb_graphs.run, ["--input={src}", "--output={out}"], "has no raw/ folder: not an OGB data set folder",
           folder, str(tmp_path / "out"))


def test_ogb_graphs_missing_file_is_a_usage_error(ogb_folder, tmp_path):
  """A file the layout needs is missing: found at launch (exit status 2), unlike a malformed one."""
  copy = str(tmp_path / "ogbn_arxiv")
  mo.remove_file(ogb_folder, "raw/num-edge-list.csv.gz", dst=copy)
  _refused(ogb_graphs.run, ["--input={src}", "--output={out}"], "num-edge-list.csv.gz: missing file", copy,
           str(tmp_path / "out"))
