"""Time one optimizer step's communication by sending the same bytes, in the same number of calls, again.

DDP and FSDP overlap their collectives with compute, so their cost cannot be read off the step time. Every rank of
the group must call :func:`time_collectives` at the same point.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from lightning_fastdist.parallel.comm.accounting import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Traffic
from lightning_fastdist.parallel.comm.collective_names import all_gather_single, reduce_scatter_single

FLOAT_BYTES = 4


def _buffers(size: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-size float32 buffer of about ``size`` elements (a multiple of ``world``) and one shard of it."""
    size = -(-size // world) * world
    return torch.zeros(size, device=device), torch.zeros(size // world, device=device)


def _launch(collective: str, full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None) -> dist.Work:
    """Start one asynchronous ``collective`` on ``full`` (and ``shard``)."""
    if collective == ALL_REDUCE:
        return dist.all_reduce(full, group=group, async_op=True)
    if collective == ALL_GATHER:
        return all_gather_single(full, shard, group=group, async_op=True)
    if collective == REDUCE_SCATTER:
        return reduce_scatter_single(shard, full, group=group, async_op=True)
    raise ValueError(f"collective: got {collective!r}; use one of {ALL_REDUCE!r}, {ALL_GATHER!r}, {REDUCE_SCATTER!r}.")


def time_collectives(
    step_traffic: Mapping[str, Traffic],
    device: torch.device,
    repeats: int = 3,
    group: dist.ProcessGroup | None = None,
) -> float:
    """Seconds to run one step's ``step_traffic`` on ``device`` without overlap (fastest of ``repeats``).

    Each collective's calls are launched together and all use one buffer of their mean size, so the probe needs the
    memory of one call per collective, not of the whole step (the contents are not used).

    Args:
        step_traffic: calls and bytes per collective name in one optimizer step (``CommStats``).
        device: the training device (NCCL needs CUDA tensors).
        group: ``None``: the default group. HSDP runs its collectives in smaller groups, so timing them on the whole
            world gives an upper bound.
    """
    world = dist.get_world_size(group)
    plan = [
        (collective, traffic.calls, _buffers(max(1, traffic.bytes // traffic.calls // FLOAT_BYTES), world, device))
        for collective, traffic in step_traffic.items()
        if traffic.calls > 0 and traffic.bytes > 0
    ]
    if not plan:
        return 0.0
    best = float("inf")
    for _ in range(repeats):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        works = [_launch(name, *buffers, group) for name, calls, buffers in plan for _ in range(calls)]
        for work in works:
            work.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best
