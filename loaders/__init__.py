"""Readers of the toolkit's outputs for training scripts: threads only, static shapes.

- `loaders.grain.dataset(path, split, batch_size=...)`: a grain IterDataset of batches.
- `loaders.xla.device_loader(path, split, batch_size=...)`: torch_xla MpDeviceLoader (no TensorFlow).
- `loaders.tfdata.dataset(path, split, batch_size=...)`: a tf.data.Dataset (TFRecord shards).
- `loaders.graph`: memory-mapped .graphbin graphs and a static-shape neighbour sampler.

Import the submodule you need: each pulls in only its own framework. This
package builds on `formats` only and never imports `pipelines` or Beam.
"""

__all__: list[str] = []
