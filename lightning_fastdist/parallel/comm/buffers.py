"""Buffers made equal on every rank, as DDP's ``broadcast_buffers`` makes them.

FSDP and ZeRO shard no buffers: each rank's BatchNorm statistics follow its own batches, so ``validate`` would differ
per rank. Rank 0's statistics evolve as under DDP, so broadcasting them before evaluation and checkpoints gives DDP's
results.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn


def broadcast_buffers(module: nn.Module | None) -> None:
    """Overwrite every buffer of ``module`` with rank 0's; nothing without a module or a process group (a strategy
    asked before it was set up)."""
    if module is None or not dist.is_initialized():
        return
    for buffer in module.buffers():
        dist.broadcast(buffer, src=0)
