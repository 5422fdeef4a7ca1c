"""Open Graph Benchmark data sets → `.graphbin` CSR blobs or graph shards: `python -m pipelines.ogb_graphs`.

`run(argv)` is the programmatic entry point (the same flags); `CONVERTER` is
the converter object the registry, Airflow and the tests use. docs/ogb_graphs.md.
"""

from collections.abc import Sequence

from apache_beam.runners.runner import PipelineResult

from pipelines.core import launch
from pipelines.ogb_graphs.pipeline import OgbGraphs, OgbGraphsConfig, OgbGraphsOptions
from pipelines.ogb_graphs.plan import GraphPlan, plan_graph
from pipelines.ogb_graphs.read import OgbFormatError, OgbMissingFileError

CONVERTER = OgbGraphs()


def run(argv: Sequence[str] | None = None) -> PipelineResult:
  """Runs the conversion with command-line flags and waits for it.

  Raises:
    UsageError: a bad flag (nothing was written).
    OgbFormatError: a malformed input file (nothing was committed).
  """
  return launch.run(CONVERTER, argv)


__all__ = ["CONVERTER", "GraphPlan", "OgbFormatError", "OgbGraphs", "OgbGraphsConfig", "OgbGraphsOptions",
           "OgbMissingFileError", "plan_graph", "run"]
