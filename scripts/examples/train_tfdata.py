"""A Keras training loop fed by loaders.tfdata (TFRecord shards).

    python scripts/examples/train_tfdata.py OUTPUT [--steps=20]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import tensorflow as tf  # noqa: E402

from formats import load_manifest  # noqa: E402
from loaders import tfdata  # noqa: E402


def main(argv=None) -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("output")
  ap.add_argument("--steps", type=int, default=20)
  a = ap.parse_args(argv)
  num_classes = load_manifest(a.output).features["label"].num_classes
  ds = tfdata.dataset(a.output, "train", batch_size=8, image_size=(32, 32), num_epochs=100, seed=0)
  ds = ds.map(lambda b: (tf.cast(b["image"], tf.float32) / 255.0, b["label"]))
  model = tf.keras.Sequential([tf.keras.Input((32, 32, 3)), tf.keras.layers.Flatten(),
                               tf.keras.layers.Dense(num_classes)])
  model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  history = model.fit(ds, steps_per_epoch=a.steps, epochs=1, verbose=0)
  print(f"tfdata: {a.steps} steps, last loss {history.history['loss'][-1]:.3f}")


if __name__ == "__main__":
  main()
