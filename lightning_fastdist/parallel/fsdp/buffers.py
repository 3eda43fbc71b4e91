"""Buffers made equal on every rank, as DDP's ``broadcast_buffers`` makes them.

FSDP shards parameters, not buffers, and DeepSpeed's ZeRO partitions none either: each rank's BatchNorm running
statistics follow its own batches, so without this ``validate`` and ``predict`` would give a different answer on each
rank, and a sharded checkpoint would hold some rank's statistics. DDP broadcasts rank 0's buffers before a forward;
rank 0's statistics evolve the same way under all three, so broadcasting them before evaluation (FastFSDPStrategy and
FastDeepSpeedStrategy) and before a checkpoint collects them (FastFSDPStrategy) gives DDP's results.
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
