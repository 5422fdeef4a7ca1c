"""A torch_xla training loop fed by loaders.xla (runs on CPU with PJRT_DEVICE=CPU).

    PJRT_DEVICE=CPU python scripts/examples/train_xla.py OUTPUT [--steps=20]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch_xla  # noqa: E402

from formats import load_manifest  # noqa: E402
from loaders import xla  # noqa: E402


def main(argv=None) -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("output")
  ap.add_argument("--steps", type=int, default=20)
  a = ap.parse_args(argv)
  num_classes = load_manifest(a.output).features["label"].num_classes
  device = torch_xla.device()
  model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(32 * 32 * 3, num_classes)).to(device)
  opt = torch.optim.SGD(model.parameters(), lr=0.1)
  loader = xla.device_loader(a.output, "train", batch_size=8, image_size=(32, 32), num_epochs=100, seed=0,
                             num_threads=4, device=device)
  for step, batch in zip(range(a.steps), loader):
    x = batch["image"].float() / 255.0
    loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
    opt.zero_grad()
    loss.backward()
    opt.step()
    torch_xla.sync()
  print(f"xla: {step + 1} steps on {device}, last loss {loss.item():.3f}")


if __name__ == "__main__":
  main()
