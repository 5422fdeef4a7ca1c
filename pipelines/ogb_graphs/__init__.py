"""Open Graph Benchmark data sets → `.graphbin` CSR blobs or graph shards: `python -m pipelines.ogb_graphs` (docs/ogb_graphs.md)."""

from pipelines.core import launch
from pipelines.ogb_graphs.pipeline import OgbGraphs, OgbGraphsConfig, OgbGraphsOptions
from pipelines.ogb_graphs.plan import GraphPlan, plan_graph
from pipelines.ogb_graphs.read import OgbFormatError, OgbMissingFileError

CONVERTER = OgbGraphs()
run = launch.entry_point(CONVERTER)

__all__ = ["CONVERTER", "GraphPlan", "OgbFormatError", "OgbGraphs", "OgbGraphsConfig", "OgbGraphsOptions",
           "OgbMissingFileError", "plan_graph", "run"]
