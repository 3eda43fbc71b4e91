"""Count FSDP2's parameter all-gathers and gradient reduce-scatters (and HSDP's all-reduces).

FSDP2 lets each unit take its own all-gather and reduce-scatter objects
(``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``, torch
>= 2.9). The ones here do what FSDP2's defaults do, allocate with
``torch.empty`` and call the ``torch.distributed`` collective (torch 2.13's
``all_gather_single`` / ``reduce_scatter_single``, the older names before it),
and record the tensor's bytes in a
:class:`~lightning_fastdist.parallel.comm_accounting.CommStats` first. Under
HSDP the all-reduce across replica groups is counted from FSDP2's all-reduce
hook, which receives the reduced gradient shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_fastdist.parallel.comm_accounting import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CommStats

# The torch.distributed functions called: torch 2.13 deprecates the "_tensor" names (a FutureWarning per call).
ALL_GATHER_FUNCTION = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER_FUNCTION = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


class _CountingComm:
    """What FSDP2's communication interface needs besides the call: plain ``torch.empty`` buffers.

    Args:
        stats: where each call's bytes are recorded.
    """

    def __init__(self, stats: CommStats) -> None:
        self.stats = stats

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CountingAllGather(_CountingComm):
    """FSDP2's all-gather of a unit's parameter shards (its ``AllGather`` interface), recording the gathered bytes."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        self.stats.record(output_tensor, ALL_GATHER)
        return getattr(dist, ALL_GATHER_FUNCTION)(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(_CountingComm):
    """FSDP2's reduce-scatter of a unit's gradients (its ``ReduceScatter`` interface), counting the full gradient."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        self.stats.record(input_tensor, REDUCE_SCATTER)
        return getattr(dist, REDUCE_SCATTER_FUNCTION)(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


def count_fsdp_communication(units: Sequence[nn.Module], stats: CommStats, replicated: bool) -> bool:
    """Make every FSDP unit in ``units`` record its collectives in ``stats``.

    Args:
        units: modules that ``fully_shard`` was applied to.
        stats: where the bytes go.
        replicated: the mesh has a replicate dimension (HSDP): also count the
            all-reduce of each gradient shard across replica groups.

    Returns:
        ``False`` when this torch has no FSDP2 communication interfaces (nothing is counted).
    """
    if not hasattr(FSDPModule, "set_custom_all_gather"):  # torch before 2.9
        return False
    for unit in units:
        assert isinstance(unit, FSDPModule), f"{type(unit).__name__} is not sharded"
        unit.set_custom_all_gather(CountingAllGather(stats))
        unit.set_custom_reduce_scatter(CountingReduceScatter(stats))
        if replicated:
            unit.set_all_reduce_hook(lambda reduced_shard: stats.record(reduced_shard, ALL_REDUCE))
    return True
