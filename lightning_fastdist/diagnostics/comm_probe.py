"""Time one optimizer step's gradient all-reduce by sending the same bytes, in the same buckets, again.

DDP overlaps its all-reduces with the backward pass, so their cost cannot be
read off the step time. :func:`time_gradient_all_reduce` measures what the
communication alone costs: it all-reduces ``step_bytes`` split into buckets of
``bucket_bytes`` (launched together, as DDP does, then waited for), and keeps the
fastest of ``repeats`` runs. Every rank of the group must call it at the same point.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

FLOAT_BYTES = 4


def time_gradient_all_reduce(
    step_bytes: int, bucket_bytes: int, device: torch.device, repeats: int = 3, group: dist.ProcessGroup | None = None
) -> float:
    """Seconds to all-reduce ``step_bytes`` in buckets of ``bucket_bytes`` on ``device`` (fastest of ``repeats``).

    Args:
        step_bytes: payload of one optimizer step's gradient communication.
        bucket_bytes: bytes per all-reduce (DDP's bucket cap).
        device: where the buffers live (the training device: NCCL needs CUDA tensors).
        repeats: runs to take the fastest of.
        group: the process group; ``None`` is the default group.
    """
    if step_bytes <= 0:
        return 0.0
    bucket_elements = max(1, bucket_bytes // FLOAT_BYTES)
    total_elements = max(1, step_bytes // FLOAT_BYTES)
    sizes = [bucket_elements] * (total_elements // bucket_elements)
    if total_elements % bucket_elements:
        sizes.append(total_elements % bucket_elements)
    buffers = [torch.zeros(size, device=device) for size in sizes]
    best = float("inf")
    for _ in range(repeats):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        works = [dist.all_reduce(buffer, group=group, async_op=True) for buffer in buffers]
        for work in works:
            work.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best
