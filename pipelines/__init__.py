"""Apache Beam converters that turn raw data into TPU-ready shards.

Each converter is a subpackage run as `python -m pipelines.<name>` with its
own flags plus every Beam option; `pipelines.<name>.run(argv)` is the
programmatic entry point. The converters are listed in `pipelines.registry`
(read by the CLIs, Airflow, Dataflow packaging and the tests); the machinery
they share (the converter protocol, flags, inputs, sink, launch) is
`pipelines.core`. docs/architecture.md shows how they fit together.

Importing this package is cheap (no Beam): schedulers read the registry
without loading the converters.
"""

from pipelines.registry import CONVERTERS, converter, names

__all__ = ["CONVERTERS", "converter", "names"]
