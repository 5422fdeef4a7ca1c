"""Every converter's output, byte for byte, against fingerprints recorded before the redesign.

Each case converts small generated input with a fixed seed and reduces the
output to {file: sha256}. Data files (shards, .graphbin, rejected.jsonl, TFDS
metadata) are compared as bytes; manifest.json as its JSON with the
run-specific parts normalised (the generation folder's random name, the input
folder's temporary path). Markers of the commit protocol (`_toolkit_run.json`,
the lock file) are left out: they record times; so are the shard records that
resumed runs reuse shards by (`_toolkit_shards/`): they name the code's digest;
and leases (`_leases/`: a killed run's stays until it expires).
Generations the manifest does not name (replaced or failed runs', kept for the
retention period) are not part of the output.

The fingerprints live in tests/golden_outputs.json. A change that is meant to
change an output regenerates them with TOOLKIT_REGEN_GOLDEN=1 and says why in
its commit message.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import pytest

from pipelines import ct_volumes, image_folder, ogb_graphs
from scripts import make_sample_ct as ct, make_sample_images, make_sample_ogb as mo

pytestmark = pytest.mark.slow

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden_outputs.json")
_GENERATION = re.compile(r"gen-\d{8}T\d{6}-[0-9a-f]{8}")
_VOLATILE = {"_toolkit_run.json", ".manifest.lock"}
# pipelines/core/reuse.py's records (they carry the code's digest) and reader or run leases (hosts, times).
_BOOKKEEPING = {"_toolkit_shards", "_leases"}
# Keys a later change may add to manifest.json without changing what the output holds.
_ADDED_MANIFEST_KEYS = {"kind"}


def _normalise_text(text: str, input_root: str, output: str) -> str:
  text = _GENERATION.sub("GEN", text)
  return text.replace(input_root, "<INPUT>").replace(output, "<OUTPUT>")


def fingerprint(output: str, input_root: str) -> dict[str, str]:
  """{path relative to the output (generation normalised): sha256 of its normalised bytes}."""
  out = {}
  with open(os.path.join(output, "manifest.json")) as f:
    current = {p.split("/", 1)[0] for p in re.findall(r'"path": "([^"]+)"', f.read()) if "/" in p}
  for folder, dirs, names in os.walk(output):
    # Only the committed generation: replaced and failed runs' generations are kept for a while (retention).
    dirs[:] = [d for d in dirs if d not in _BOOKKEEPING and (folder != output or not _GENERATION.fullmatch(d)
                                                             or d in current)]
    for name in names:
      if name in _VOLATILE:
        continue
      path = os.path.join(folder, name)
      rel = _GENERATION.sub("GEN", os.path.relpath(path, output))
      with open(path, "rb") as f:
        data = f.read()
      if name == "manifest.json":
        manifest = json.loads(data)
        for key in _ADDED_MANIFEST_KEYS:
          manifest.pop(key, None)
        data = json.dumps(manifest, sort_keys=True).encode()
      if name in ("manifest.json", "rejected.jsonl", "dataset_info.json"):
        data = _normalise_text(data.decode("utf-8"), input_root, output).encode("utf-8")
      out[rel] = hashlib.sha256(data).hexdigest()
  return dict(sorted(out.items()))


def _image_input(base: str) -> str:
  root = os.path.join(base, "pets")
  make_sample_images.make_folder(root, ["cat", "dog", "zebra"], 5, ["train", "validation"], (64, 48), 2, seed=7)
  return root


def _ct_input(base: str) -> str:
  root = os.path.join(base, "dicom")
  ct.make_mixed_tree(root, seed=11)
  return root


def _ogb(writer, name: str, **kwargs):
  def make(base: str) -> str:
    return str(writer(os.path.join(base, name), 3, **kwargs).folder)
  return make


CASES = {
    "image_folder-jpeg-array_record": (image_folder, _image_input, ["--num_shards=2", "--seed=5"]),
    "image_folder-raw-tfrecord": (image_folder, _image_input,
                                  ["--format=tfrecord", "--image_size=24,32", "--encoding=raw"]),
    "ct_volumes": (ct_volumes, _ct_input, ["--id_salt=golden", "--num_shards=2"]),
    "ogb_graphs-node": (ogb_graphs, _ogb(mo.write_homogeneous_node, "ogbn_arxiv", num_nodes=300, num_edges=1500),
                        ["--csc=true", "--edges_per_partition=400"]),
    "ogb_graphs-hetero": (ogb_graphs, _ogb(mo.write_heterogeneous_node, "ogbn_mag"), []),
    "ogb_graphs-binary": (ogb_graphs, _ogb(mo.write_binary_node, "ogbn_papers100M", num_nodes=300, num_edges=1200),
                          []),
    "ogb_graphs-link": (ogb_graphs, _ogb(mo.write_link, "ogbl_collab", num_nodes=200, num_edges=900), []),
    "ogb_graphs-property": (ogb_graphs, _ogb(mo.write_graph_property, "ogbg_molhiv", num_graphs=60),
                            ["--format=tfrecord"]),
}


def _golden() -> dict:
  if not os.path.exists(GOLDEN):
    return {}
  with open(GOLDEN) as f:
    return json.load(f)


@pytest.mark.parametrize("case", sorted(CASES))
def test_output_is_byte_identical(case, tmp_path):
  module, make_input, flags = CASES[case]
  root = make_input(str(tmp_path))
  output = str(tmp_path / "out")
  module.run([f"--input={root}", f"--output={output}", *flags])
  got = fingerprint(output, root)
  if os.environ.get("TOOLKIT_REGEN_GOLDEN") == "1":
    golden = _golden()
    golden[case] = got
    with open(GOLDEN, "w") as f:
      json.dump(dict(sorted(golden.items())), f, indent=1, sort_keys=True)
      f.write("\n")
    return
  expected = _golden().get(case)
  assert expected is not None, f"no fingerprint recorded for {case}: run with TOOLKIT_REGEN_GOLDEN=1"
  assert got == expected
