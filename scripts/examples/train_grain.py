"""A training loop fed by loaders.grain (numpy softmax regression on tiny images).

    python scripts/examples/train_grain.py OUTPUT [--steps=20]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from formats import load_manifest  # noqa: E402
from loaders import grain as grain_loader  # noqa: E402


def main(argv=None) -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("output")
  ap.add_argument("--steps", type=int, default=20)
  a = ap.parse_args(argv)
  num_classes = load_manifest(a.output).features["label"].num_classes
  ds = grain_loader.dataset(a.output, "train", batch_size=8, image_size=(32, 32), num_epochs=100,
                            seed=0, num_threads=4)
  w = np.zeros((32 * 32 * 3, num_classes), np.float32)
  for step, batch in zip(range(a.steps), ds):
    x = batch["image"].reshape(len(batch["image"]), -1).astype(np.float32) / 255.0
    logits = x @ w
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    loss = -np.log(p[np.arange(len(x)), batch["label"]] + 1e-9).mean()
    p[np.arange(len(x)), batch["label"]] -= 1
    w -= 0.1 * x.T @ p / len(x)
  print(f"grain: {step + 1} steps, last loss {loss:.3f}")


if __name__ == "__main__":
  main()
