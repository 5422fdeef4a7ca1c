"""Apache Beam pipelines that convert raw data into TPU-ready shards.

Each pipeline is a module run as `python -m pipelines.<name>` with its own
flags plus every Beam option; `run(argv)` is the programmatic entry point.
"""

from pipelines._cli import UsageError
from pipelines._sink import InputSummary, OutputSpec, Record, Reject, WriteOutput

__all__ = ["InputSummary", "OutputSpec", "Record", "Reject", "UsageError", "WriteOutput"]
