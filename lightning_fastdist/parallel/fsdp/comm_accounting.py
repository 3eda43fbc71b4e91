"""Count FSDP2's parameter all-gathers and gradient reduce-scatters (and HSDP's all-reduces), and time their waits.

FSDP2 (torch >= 2.9) lets each unit take its own all-gather and reduce-scatter objects: the ones here do what its
defaults do and record the bytes first; HSDP's all-reduce is counted from FSDP2's all-reduce hook, and timed as the
gap before it. Where in FSDP2's code each wait happens: ``docs/exposed-comm.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_fastdist.parallel.comm.accounting import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CommStats
from lightning_fastdist.parallel.comm.collective_names import ALL_GATHER_FUNCTION, REDUCE_SCATTER_FUNCTION
from lightning_fastdist.parallel.comm.exposed import ExposedCommClock, Mark, timed_collective


class _CountingComm:
    """What FSDP2's communication interface needs besides the call: plain ``torch.empty`` buffers."""

    def __init__(self, stats: CommStats, clock: ExposedCommClock | None = None) -> None:
        self.stats = stats
        self.clock = clock

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CountingAllGather(_CountingComm):
    """FSDP2's all-gather of a unit's parameter shards (its ``AllGather`` interface), recording the gathered bytes."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        self.stats.record(output_tensor, ALL_GATHER)
        gather = getattr(dist, ALL_GATHER_FUNCTION)
        return timed_collective(
            self.clock, lambda: gather(output_tensor, input_tensor, group=group, async_op=async_op), async_op
        )


class CountingReduceScatter(_CountingComm):
    """FSDP2's reduce-scatter of a unit's gradients (its ``ReduceScatter`` interface), counting the full gradient.

    With a clock, :attr:`done` marks when it last returned or allocated: where HSDP's all-reduce starts.
    """

    done: Mark | None = None

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = super().allocate(size, dtype=dtype, device=device)
        self._mark_done()
        return buffer

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        self.stats.record(input_tensor, REDUCE_SCATTER)
        scatter = getattr(dist, REDUCE_SCATTER_FUNCTION)
        work = timed_collective(
            self.clock, lambda: scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op), async_op
        )
        self._mark_done()
        return work

    def _mark_done(self) -> None:
        if self.clock is not None:
            self.done = self.clock.mark()


def _all_reduce_hook(stats: CommStats, reduce_scatter: CountingReduceScatter) -> Callable[[torch.Tensor], None]:
    """HSDP's all-reduce hook: count the reduced shard's bytes and time the all-reduce that just returned."""
    clock = reduce_scatter.clock

    def hook(reduced_shard: torch.Tensor) -> None:
        stats.record(reduced_shard, ALL_REDUCE)
        if clock is not None and reduce_scatter.done is not None and clock.on_compute_stream():
            clock.add(reduce_scatter.done)

    return hook


def count_fsdp_communication(
    units: Sequence[nn.Module], stats: CommStats, replicated: bool, clock: ExposedCommClock | None = None
) -> bool:
    """Make every FSDP unit in ``units`` record its collectives in ``stats`` (and, with ``clock``, time their waits).

    ``replicated``: the mesh has a replicate dimension (HSDP): also count the all-reduce across replica groups.
    Returns ``False`` when this torch has no FSDP2 communication interfaces (nothing is counted).
    """
    if not hasattr(FSDPModule, "set_custom_all_gather"):  # torch before 2.9
        return False
    for unit in units:
        assert isinstance(unit, FSDPModule), f"{type(unit).__name__} is not sharded"
        reduce_scatter = CountingReduceScatter(stats, clock)
        unit.set_custom_all_gather(CountingAllGather(stats, clock))
        unit.set_custom_reduce_scatter(reduce_scatter)
        if replicated:
            unit.set_all_reduce_hook(_all_reduce_hook(stats, reduce_scatter))
    return True


def counted_fsdp_communication(
    units: Sequence[nn.Module], stats: CommStats | None, replicated: bool, device: torch.device
) -> tuple[CommStats, ExposedCommClock] | tuple[None, None]:
    """:func:`count_fsdp_communication` into ``stats`` (new ones where ``None``: a second fit counts on) with a clock
    of ``device``'s: both, or neither where this torch cannot count."""
    stats = stats if stats is not None else CommStats()
    clock = ExposedCommClock(device)
    return (stats, clock) if count_fsdp_communication(units, stats, replicated, clock) else (None, None)
