"""Open Graph Benchmark data sets → a memory-mappable CSR blob (`.graphbin`), or shards.

    python -m pipelines.ogb_graphs --input=DIR_OR_GS --output=DIR_OR_GS [--name=ogbn-arxiv] \
        [--add_inverse_edges=auto|true|false] [--feature_dtype=float32|float16] [--csc=false] \
        [--add_reverse_relations=false] [--allow_nonfinite=false] [--format=array_record|tfrecord] \
        [any Beam option]

`--input` is the data set folder as OGB lays it out (holding `raw/` and
`split/`); nothing is downloaded. Node- and link-property data sets
(homogeneous CSV, heterogeneous mag-style, binary npz) become one `.graphbin`
(docs/graphbin.md); graph-property data sets (ogbg-*) become ArrayRecord or
TFRecord shards with one record per graph.

The CSR build never holds the whole edge list in one worker: edges are read
in chunks, keyed by source-node range (partition); each partition is sorted by
one worker, which writes its share of the file's sections as pieces, node
files are written as pieces by the workers that read them, and one step joins
the pieces with the splits and the section table (concatenated locally,
composed on gs://: no worker holds the whole file; pipelines/ogb_graphs/pieces.py). A bad row or cell, NaN/inf in a feature (unless
--allow_nonfinite=true), a row count that disagrees with OGB's count files or a
node id out of range fails the job with `file: line N: reason` (exit 1); no
manifest is written, so the output never looks complete (docs/ogb_graphs.md).
"""
from __future__ import annotations

import dataclasses
import os

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from formats.storage import files as fs
from formats.features import Features
from pipelines.core import flags
from pipelines.core.converter import Converter, Files, OutputPlan, Sources, UnitConverter
from pipelines.core.errors import UsageError
from pipelines.core.flags import CommonConfig, ConverterOptions, common_config, dataset_name
from pipelines.ogb_graphs.assemble import (
    PARTS_DIR, _AssembleFn, _BuildPartFn, _NodeArrayFn, _ReadEdgesFn, all_partitions, node_piece_identity,
    node_units, reusable_node_pieces)
from pipelines.ogb_graphs.plan import PIPELINE, GraphPlan, plan_graph
from pipelines.ogb_graphs.property import GraphUnits, graph_features_from_plan, graph_units
from pipelines.ogb_graphs.read import OgbMissingFileError
from pipelines.ogb_graphs.reverse import add_reverse_relations, reverse_relations

NAME = "ogb_graphs"
DEFAULT_EDGES_PER_PARTITION = 1 << 24


class OgbGraphsOptions(PipelineOptions):
  """Flags of `pipelines.ogb_graphs` beyond the shared ones (`core.flags.ConverterOptions`)."""

  @classmethod
  def _add_argparse_args(cls, parser):
    parser.add_argument("--add_inverse_edges", default="auto", choices=("auto", "true", "false"),
                        help="auto (as OGB's master.csv says for --name), true or false.")
    parser.add_argument("--feature_dtype", default="float32", choices=("float32", "float16"),
                        help="Dtype of float node and edge features.")
    parser.add_argument("--csc", type=flags.boolean, nargs="?", const=True, default=False,
                        help="true: also store the reverse (in-neighbour) CSC.")
    parser.add_argument("--add_reverse_relations", type=flags.boolean, nargs="?", const=True, default=False,
                        help="true: heterogeneous sets also store dst___rev_<rel>___src for each src___<rel>___dst.")
    parser.add_argument("--edges_per_partition", type=flags.integer(1), default=DEFAULT_EDGES_PER_PARTITION,
                        help="Edges per sort partition: bounds a worker's memory (~40 bytes/edge).")
    parser.add_argument("--allow_nonfinite", type=flags.boolean, nargs="?", const=True, default=False,
                        help="true: keep NaN/inf feature cells (false: a NaN/inf cell fails the job; "
                             "an empty label cell is always a missing label).")


@dataclasses.dataclass(frozen=True)
class OgbGraphsConfig:
  """The OGB converter's own flags, checked."""

  ogb_name: str  # OGB's name of the data set (ogbn-arxiv): master.csv's key
  add_inverse: str = "auto"  # auto, true or false
  feature_dtype: str = "float32"
  csc: bool = False
  edges_per_partition: int = DEFAULT_EDGES_PER_PARTITION
  allow_nonfinite: bool = False
  add_reverse_relations: bool = False  # heterogeneous: also store each relation's reverse (rev_<relation>)


def _ogb_name(options: PipelineOptions, root: str) -> str:
  """--name, or OGB's name derived from the folder's (ogbn_arxiv → ogbn-arxiv)."""
  return options.view_as(ConverterOptions).name or os.path.basename(root.rstrip("/")).replace("_", "-")


class OgbGraphs(Converter, name=NAME, kind="graphbin", options=OgbGraphsOptions,
                input_kind="an OGB data set folder holding raw/ and split/"):
  """OGB data sets → one `.graphbin` (node and link tasks) or record shards (graph-property sets)."""

  def common_config(self, options: PipelineOptions) -> CommonConfig:
    """See Converter.common_config. The name is --name or the folder's, dashes as underscores (ogbn-arxiv → ogbn_arxiv).

    Args:
      options: the parsed options.

    Raises:
      UsageError: a shared flag is bad, or the derived name is not a valid data set name.
    """
    return common_config(options, self.input_kind, name_rule=lambda _, root: dataset_name(
        _ogb_name(options, root).replace("-", "_"), root))

  def configure(self, o: OgbGraphsOptions, common: CommonConfig) -> OgbGraphsConfig:
    """See Converter.configure.

    Args:
      o: --add_inverse_edges, --feature_dtype, --csc, --edges_per_partition, --allow_nonfinite,
        --add_reverse_relations (parsed and typed), and --name.
      common: its input folder names the data set when --name is not given; its --plan must
        be auto (a graph has no shard plan: its edges are partitioned on the workers).

    Raises:
      UsageError: --plan is not auto, or --mode=append (a data set is converted whole).
    """
    if common.mode == "append":
      raise UsageError("--mode=append: ogb_graphs converts a data set whole (its files name no single graph or "
                       "node); run --mode=rebuild")
    if common.plan != "auto":
      raise UsageError(f"--plan={common.plan}: ogb_graphs makes no shard plan (edges are partitioned "
                       "on the workers); leave --plan at auto")
    return OgbGraphsConfig(
        ogb_name=_ogb_name(o, common.input), add_inverse=o.add_inverse_edges, feature_dtype=o.feature_dtype,
        csc=o.csc, edges_per_partition=o.edges_per_partition, allow_nonfinite=o.allow_nonfinite,
        add_reverse_relations=o.add_reverse_relations)

  def plan(self, common: CommonConfig, config: OgbGraphsConfig) -> OutputPlan:
    """See Converter.plan. Its `state` is the `GraphPlan`; graph-property sets get kind "graph".

    Args:
      common: the input folder.
      config: the OGB name and the flags `plan_graph` takes.

    Raises:
      UsageError: not an OGB folder, an unknown name with --add_inverse_edges=auto, a missing file, or
        --add_reverse_relations=true on a set that is not heterogeneous, already has a `rev_*` relation
        or has a relation whose reverse's section names would not fit (reverse.add_reverse_relations).
      OgbFormatError: a malformed file read at launch, or (graph-property sets) a missing
        graph-label file: exit status 1, not 2.
    """
    try:
      plan = plan_graph(common.input, config.ogb_name, config.add_inverse, config.edges_per_partition,
                        config.allow_nonfinite)
    except OgbMissingFileError as e:  # a malformed file stays an OgbFormatError: exit status 1
      raise UsageError(str(e)) from None
    if config.add_reverse_relations:
      plan = add_reverse_relations(plan, config.edges_per_partition, config.csc)
    source = {"pipeline": PIPELINE, "input": common.input, "ogb_name": config.ogb_name, "layout": plan.layout,
              "add_inverse_edges": plan.add_inverse, "feature_dtype": config.feature_dtype}
    if plan.allow_nonfinite:
      source["allow_nonfinite"] = True
    if config.add_reverse_relations:
      source["add_reverse_relations"] = True
    if plan.layout == "graphs":
      return OutputPlan(
          features=graph_features_from_plan(plan, config.feature_dtype),
          splits=tuple(sorted({pfx.rsplit("/", 1)[1] for pfx, _ in plan.split_files})) or ("train",),
          description=f"OGB graph-property data set {config.ogb_name}, one record per graph ({PIPELINE}).",
          source=source, kind="graph", state=plan)
    return OutputPlan(features=Features({}), splits=(), description="", source=source, state=plan)

  def sources(self, common: CommonConfig, config: OgbGraphsConfig, plan: OutputPlan) -> Sources:
    """See Converter.sources (graph-property sets): one unit per graph, planned here from the count files."""
    units = graph_units(plan.state, plan.features)
    return Sources(units=units, num_inputs=len(units))

  def unit_converter(self, common: CommonConfig, config: OgbGraphsConfig, plan: OutputPlan) -> UnitConverter:
    """See Converter.unit_converter (graph-property sets): a graph index → its record."""
    return GraphUnits(plan.state, config.feature_dtype, plan.features)

  def expand_files(self, p: beam.Pipeline, common: CommonConfig, config: OgbGraphsConfig,
                   plan: OutputPlan) -> Files | None:
    """See Converter.expand_files: node- and link-property sets become one `.graphbin` (graph-property
    sets take the record path: None).

    Edges are read in chunks keyed by partition, each partition sorted by one worker into its
    pieces; node arrays are written as pieces by the workers that read them; one step joins the
    pieces into the file (pipelines/ogb_graphs/assemble.py, pieces.py).

    Args:
      p: the pipeline the steps are added to.
      common: the output, its generation and --reuse_shards (node pieces of an earlier run are reused).
      config: the feature dtype, --csc.
      plan: its `state` is the `GraphPlan`.

    Returns:
      The `.graphbin`'s `FileInfo` and the manifest's graph section, or None for graph-property sets.
    """
    graph: GraphPlan = plan.state
    if graph.layout == "graphs":
      return None
    sources = list(graph.edge_files)
    if config.csc:
      sources += [dataclasses.replace(s, reverse=True, extras=()) for s in graph.edge_files]
    parts_dir = fs.join(common.output, common.generation, PARTS_DIR)
    chunks = (
        p
        | "EdgeSources" >> beam.Create(sources)
        | "SpreadSources" >> beam.Reshuffle()
        | "ReadEdges" >> beam.ParDo(_ReadEdgesFn(graph, config.feature_dtype))
    )
    counts = (chunks
              | "ChunkSizes" >> beam.Map(lambda kv: (kv[0], len(kv[1][1])))
              | "EdgesPerPartition" >> beam.CombinePerKey(sum))
    every = p | "EveryPartition" >> beam.Create([(key, None) for key in all_partitions(graph, config.csc)])
    edge_pieces = (
        (chunks, every)
        | "WithEmptyPartitions" >> beam.Flatten()
        | "GroupByPartition" >> beam.GroupByKey()
        | "SortPartitions" >> beam.ParDo(_BuildPartFn(graph, parts_dir), counts=beam.pvalue.AsDict(counts))
    )
    node_pieces = (
        p
        | "NodeFiles" >> beam.Create(node_units(graph))
        | "SpreadNodeFiles" >> beam.Reshuffle()
        | "ReadNodeArrays" >> beam.ParDo(_NodeArrayFn(
            graph, config.feature_dtype, parts_dir,
            node_piece_identity(graph, config.feature_dtype) if common.reuse_shards else "",
            reusable_node_pieces(common.output, common.generation) if common.reuse_shards else {}))
    )
    pieces = (edge_pieces, node_pieces) | "AllPieces" >> beam.Flatten()
    files = (
        p
        | "AssembleTrigger" >> beam.Create([None])
        | "Assemble" >> beam.ParDo(
            _AssembleFn(graph, common.output, common.name + ".graphbin", config.feature_dtype, config.csc,
                        common.generation),
            pieces=beam.pvalue.AsList(pieces))
    )
    summary = {
        "layout": graph.layout, "task": graph.task, "num_nodes": graph.num_nodes,
        "num_edges": {k: v * (2 if graph.add_inverse else 1) for k, v in graph.num_edges.items()},
        "add_inverse_edges": graph.add_inverse, "csc": config.csc}
    added = reverse_relations(graph)
    if added:  # only with --add_reverse_relations: every other manifest stays as it was
      summary["reverse_relations"] = added
    return Files(files, graph=summary)
