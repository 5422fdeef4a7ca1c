"""Readers of the toolkit's outputs for training scripts: threads only, static shapes.

The framework loaders are submodules, imported by name so that each pulls in
only its own framework:

- `loaders.grain.dataset(path, split, batch_size=...)`: a grain IterDataset of batches.
- `loaders.xla.device_loader(path, split, batch_size=...)`: torch_xla batches on the device (no TensorFlow).
- `loaders.tfdata.dataset(path, split, batch_size=...)`: a tf.data.Dataset (TFRecord shards).
- `loaders.jax.dataset(path, split, mesh=..., batch_size=...)`: global jax.Arrays on a mesh, every process its
  rows (`loaders.jax.graph_dataset`: the neighbour samplers' batches, one subgraph per slice of the mesh).
- `loaders.graph`: memory-mapped .graphbin graphs, static-shape neighbour samplers (homogeneous
  and heterogeneous, one compiled kernel), and their grain and torch_xla feeders.

This package itself names the framework-free pieces (importing it imports no
grain, torch, torch_xla or TensorFlow): random access to the records of a
split, the error a damaged record raises, the record → example transform and
its options, the loaders' grouped settings (loaders.options), the graph file and
sampler, and the errors of resuming on other data. It builds on `formats` only and never imports `pipelines` or Beam.

Every loader reads the generation its output's manifest named when it was
opened, for its whole life, holds a lease on it, and names it in every saved
state (docs/loaders.md, "Pinning, state identity and leases").
"""

from __future__ import annotations

from formats.errors import CorruptRecordError
from formats.outputs.integrity import VERIFY_LEVELS, Verify
from loaders._graph_file import Graph
from loaders._hetero import HeteroBudgets, HeteroNeighborSampler, hetero_budgets
from loaders._pinning import DataIdentity, StateMismatchError, UnverifiedStateWarning
from loaders._sampler import Budgets, NeighborSampler, budgets
from loaders._shards import ShardedRecords
from loaders._transforms import ExampleOptions, example_transform
from loaders.options import Fetching, Ordering, Reading, Settings, Sharding, settings
from loaders.graph import load as load_graph

__all__ = [
    "VERIFY_LEVELS",
    "Budgets",
    "CorruptRecordError",
    "DataIdentity",
    "ExampleOptions",
    "Fetching",
    "Graph",
    "HeteroBudgets",
    "HeteroNeighborSampler",
    "NeighborSampler",
    "Ordering",
    "Reading",
    "Settings",
    "ShardedRecords",
    "Sharding",
    "StateMismatchError",
    "UnverifiedStateWarning",
    "Verify",
    "budgets",
    "example_transform",
    "hetero_budgets",
    "load_graph",
    "settings",
]
