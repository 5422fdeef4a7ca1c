"""Facts about this host that the loaders size themselves by (no framework)."""

from __future__ import annotations

import os

__all__ = ["local_processes"]


def local_processes() -> int:
  """The loader processes sharing this host: torch_xla's PJRT_LOCAL_PROCESS_COUNT, torchrun's LOCAL_WORLD_SIZE, else 1.

  Each may keep its own copy of a graph in memory or its own shard cache on disk,
  so host-wide budgets are divided by this.
  """
  for name in ("PJRT_LOCAL_PROCESS_COUNT", "LOCAL_WORLD_SIZE"):
    try:
      return max(1, int(os.environ[name]))
    except (KeyError, ValueError):
      continue
  return 1
