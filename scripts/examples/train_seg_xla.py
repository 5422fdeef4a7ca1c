"""A tiny 3D segmentation net trained on CT patches and their masks by torch_xla, fed by loaders.xla.

    PJRT_DEVICE=CPU python scripts/examples/train_seg_xla.py OUTPUT [--steps=20] [--num_classes=N]
        [--patch_size=8,16,16] [--batch_size=2] [--pos_fraction=0.5] [--checkpoint=DIR]

OUTPUT is a CT output whose records carry a `label` (ct_volumes with labels,
or tests/loaders/make_outputs.labelled_volumes). Each batch holds `volume`
(float32 [B, D, H, W], the HU window mapped to [0, 1]) and `label`, cut at the
same start: class ids [B, D, H, W] (uint8; int32 when stored as uint16;
--num_classes foreground classes, 0 background) trained with a per-voxel
cross-entropy over num_classes + 1 logits, or uint8 channels [B, D, H, W, C] trained with a per-voxel, per-channel
binary cross-entropy. Random patches are centred on foreground with
probability --pos_fraction (loaders.ExampleOptions.pos_fraction), so the small
structures are seen. Every shape is static, so the step compiles once.

--checkpoint=DIR resumes: when DIR holds a checkpoint, the model's weights and
the loader's state (DeviceLoader.get_state(): after the last batch the loop
received) are restored and training continues at the saved step with the
batch that step would have read; at the end both are written back. The run
prints a line per step and, last:
    seg: steps 3..5 (3 steps) on xla:0, resumed at step 3, last loss 0.612, foreground fraction 0.034
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
import torch_xla  # noqa: E402

from formats import load_manifest  # noqa: E402
from loaders import xla  # noqa: E402

STATE_FILE = "state.json"  # in --checkpoint: {"step": next step, "loader": the loader's state}
WEIGHTS_FILE = "model.pt"


def segmenter(outputs: int, width: int = 8) -> nn.Module:
  """Two 3x3x3 convolutions and a 1x1x1 classifier: `outputs` logits per voxel of a [B, 1, D, H, W] input."""
  return nn.Sequential(nn.Conv3d(1, width, 3, padding=1), nn.ReLU(), nn.Conv3d(width, width, 3, padding=1),
                       nn.ReLU(), nn.Conv3d(width, outputs, 1))


def voxel_loss(logits: torch.Tensor, label: torch.Tensor, channels: bool) -> torch.Tensor:
  """Per-voxel cross-entropy: over the classes of int class ids [B, D, H, W], or per channel of 0/1 [B, D, H, W, C]."""
  if channels:
    return nn.functional.binary_cross_entropy_with_logits(logits, label.permute(0, 4, 1, 2, 3).float())
  return nn.functional.cross_entropy(logits, label.long())


def load_checkpoint(folder: str | None, model: nn.Module) -> tuple[int, dict | None]:
  """(the step to start at, the loader state) from `folder`, the model's weights restored; (0, None) without one."""
  if not folder or not os.path.exists(os.path.join(folder, STATE_FILE)):
    return 0, None
  with open(os.path.join(folder, STATE_FILE)) as f:
    saved = json.load(f)
  model.load_state_dict(torch.load(os.path.join(folder, WEIGHTS_FILE)))
  return saved["step"], saved["loader"]


def save_checkpoint(folder: str, model: nn.Module, step: int, loader_state: dict) -> None:
  """Writes the weights (on the CPU), then {"step", "loader"}: a checkpoint is whole once its state file exists."""
  os.makedirs(folder, exist_ok=True)
  torch.save({k: v.cpu() for k, v in model.state_dict().items()}, os.path.join(folder, WEIGHTS_FILE))
  tmp = os.path.join(folder, STATE_FILE + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"step": step, "loader": loader_state}, f)
  os.replace(tmp, os.path.join(folder, STATE_FILE))


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("output")
  ap.add_argument("--steps", type=int, default=20, help="steps in this run")
  ap.add_argument("--num_classes", type=int, default=None,
                  help="foreground classes of a class-id label (a channels label says it: C)")
  ap.add_argument("--patch_size", default="8,16,16")
  ap.add_argument("--batch_size", type=int, default=2)
  ap.add_argument("--pos_fraction", type=float, default=0.5)
  ap.add_argument("--lr", type=float, default=0.05)
  ap.add_argument("--checkpoint", default=None, help="a folder to resume from and save to")
  a = ap.parse_args(argv)
  label = load_manifest(a.output).features.get("label")
  if label is None:
    ap.error(f"{a.output} holds volumes without a 'label' feature")
  channels = len(label.shape) == 4
  if not channels and a.num_classes is None:
    ap.error("--num_classes is needed for a label of class ids")
  outputs = label.shape[3] if channels else a.num_classes + 1
  patch_size = tuple(int(v) for v in a.patch_size.split(","))

  torch.manual_seed(0)
  device = torch_xla.device()
  model = segmenter(outputs)
  start, state = load_checkpoint(a.checkpoint, model)
  model = model.to(device)
  opt = torch.optim.SGD(model.parameters(), lr=a.lr)
  loader = xla.device_loader(a.output, "train", batch_size=a.batch_size, patch_size=patch_size, patch="random",
                             pos_fraction=a.pos_fraction, num_epochs=1000, seed=0, num_threads=2, device=device,
                             state=state)
  foreground = torch.zeros((), device=device)
  step = start
  for step, batch in zip(range(start, start + a.steps), loader):
    x = batch["volume"].unsqueeze(1)
    loss = voxel_loss(model(x), batch["label"], channels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    seen = batch["label"].any(dim=-1) if channels else batch["label"] != 0
    foreground = foreground + seen.float().mean()
    torch_xla.sync()
    print(f"step {step}: loss {loss.item():.4f} records {batch['record_index'].cpu().tolist()}")
  if a.checkpoint:
    save_checkpoint(a.checkpoint, model, step + 1, loader.get_state())
  loader.close()
  resumed = f"resumed at step {start}" if state is not None else "fresh start"
  print(f"seg: steps {start}..{step} ({step + 1 - start} steps) on {device}, {resumed}, last loss {loss.item():.4f}, "
        f"foreground fraction {foreground.item() / (step + 1 - start):.4f}")


if __name__ == "__main__":
  main()
