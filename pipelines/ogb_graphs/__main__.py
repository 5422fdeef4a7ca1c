"""`python -m pipelines.ogb_graphs --input=... --output=...`: see pipelines/ogb_graphs/pipeline.py."""

from pipelines.core import launch
from pipelines.ogb_graphs import CONVERTER

launch.main(CONVERTER)
