"""What one process holds of a tensor FSDP2 shards (a ``DTensor``): read by the memory plan, torchft's outer sync
and a node that rejoins it."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """What this process holds of ``tensor``: its shard of a DTensor (sharing its storage), else ``tensor``."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
