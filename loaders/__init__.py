"""Readers of the toolkit's outputs for training scripts (grain, torch_xla, tf.data).

The feeds themselves are tracked in the loaders issue; this package builds on
`formats` only and never imports `pipelines` or Beam.
"""

__all__: list[str] = []
