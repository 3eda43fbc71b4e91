"""The elements of a model's parameters one rank holds under FSDP2, by the arithmetic ``fully_shard`` uses.

Dim 0 (``d`` rows) is split over the ``R`` ranks of the mesh as ``torch.chunk`` splits it: ``ceil(d / R)`` rows on the
first ranks, fewer where the rows run out, none after (FSDP's padding for its collectives is no parameter's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn


def shard_numel(shape: Sequence[int], ranks: int, rank: int) -> int:
    """Elements of a parameter of ``shape`` that ``rank`` of ``ranks`` holds (all of them with one rank)."""
    rows = -(-shape[0] // ranks)
    held_rows = max(0, min(rows, shape[0] - rank * rows))
    return held_rows * math.prod(shape[1:])


def shard_numels(modules: Sequence[nn.Module], ranks: int, rank: int) -> list[int]:
    """Elements of each module's (``outer_sync`` fragment's) parameters that ``rank`` of ``ranks`` holds: all of them
    under DDP (``ranks=1``), one rank's shard under FSDP."""
    return [sum(shard_numel(p.shape, ranks, rank) for p in module.parameters()) for module in modules]
