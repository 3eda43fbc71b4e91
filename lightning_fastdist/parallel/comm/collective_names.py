"""The torch.distributed functions that all-gather into, and reduce-scatter from, one flat tensor, by the name each
supported torch offers: torch 2.13 renamed ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` to ``*_single``
and the old names warn on every call (a ``FutureWarning``); a torch before the rename has only the old names."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

ALL_GATHER_FUNCTION = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER_FUNCTION = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def all_gather_single(output: Any, shard: Any, **kwargs: Any) -> Any:
    """``output`` filled with every rank's ``shard`` (``group``, ``async_op``: torch's)."""
    return getattr(dist, ALL_GATHER_FUNCTION)(output, shard, **kwargs)


def reduce_scatter_single(shard: Any, full: Any, **kwargs: Any) -> Any:
    """``shard`` set to this rank's part of ``full`` summed over the ranks (``group``, ``async_op``: torch's)."""
    return getattr(dist, REDUCE_SCATTER_FUNCTION)(shard, full, **kwargs)
