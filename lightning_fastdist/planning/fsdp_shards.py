"""The elements of a model's parameters one rank holds under FSDP2, by the arithmetic ``fully_shard`` uses.

FSDP2 shards dim 0 of each parameter over the ``R`` ranks of its mesh as ``torch.chunk`` splits it: rank ``r`` holds
rows ``[r c, (r + 1) c)`` of the ``d`` there are, ``c = ceil(d / R)``: ``c`` rows on the first ranks, fewer on the
one where the rows run out, none after it (FSDP pads those for its collectives; the padding is no parameter's).
``tests/planning/test_fsdp_shards.py`` compares it with the local shards ``fully_shard`` makes.
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
    """Elements of each module's parameters that ``rank`` of ``ranks`` holds: of each ``outer_sync`` fragment
    (:func:`~lightning_fastdist.parallel.semi_sync.fragments.split_into_fragments`), the whole of it under DDP
    (``ranks=1``), one rank's shard of it under FSDP."""
    return [sum(shard_numel(p.shape, ranks, rank) for p in module.parameters()) for module in modules]
