"""DDP gradient communication hooks that run on every backend and count the bytes they send.

torch's bf16 hook refuses any backend but NCCL although gloo all-reduces bf16 correctly; these use only
``torch.distributed.all_reduce``, so they work on gloo and NCCL alike.
"""

# No "from __future__ import annotations": DDP compares the hooks' annotations
# with dist.GradBucket and Future[Tensor] at registration, so they must be real objects.

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_fastdist.parallel.comm.accounting import CommStats

CommHook = Callable[["HookState", dist.GradBucket], Future]


@dataclass
class HookState:
    """What every hook needs: the group to reduce over (``None``: the default group) and where to count bytes."""

    process_group: dist.ProcessGroup | None = None
    stats: CommStats = field(default_factory=CommStats)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)


def launch_mean_all_reduce(state: HookState, tensor: Tensor) -> Future:
    """Divide ``tensor`` by the world size, start an async all-reduce of it in place, count its bytes; a future of it.

    Dividing first (rather than after the sum) keeps low-precision sums from overflowing.
    """
    tensor.div_(state.world_size)
    state.stats.record(tensor)
    work = dist.all_reduce(tensor, group=state.process_group, async_op=True)
    return work.get_future().then(functools.partial(_reduced, tensor))


def _reduced(tensor: Tensor, done: Future) -> Tensor:
    """``tensor`` once its all-reduce is done; the all-reduce's error (a peer lost) if it failed, which DDP then raises
    in the backward (ignored, the step went on with this rank's own gradients and failed only at the next
    collective)."""
    done.value()
    return tensor


def _finish_round_if_last(state: HookState, bucket: dist.GradBucket) -> None:
    if bucket.is_last():
        state.stats.finish_round()


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> Future[Tensor]:
    """Full-precision average: what DDP does without a hook, plus byte counting."""
    _finish_round_if_last(state, bucket)
    return launch_mean_all_reduce(state, bucket.buffer())


def _compressing_hook(dtype: torch.dtype) -> CommHook:
    def hook(state: HookState, bucket: dist.GradBucket) -> Future[Tensor]:
        _finish_round_if_last(state, bucket)
        buffer = bucket.buffer()

        def decompress(future: Future) -> Tensor:
            buffer.copy_(future.value())
            return buffer

        return launch_mean_all_reduce(state, buffer.to(dtype)).then(decompress)

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    hook.__doc__ = f"Average gradients in {dtype} (half the bytes of fp32), then write them back in full precision."
    return hook


fp16_compress_hook = _compressing_hook(torch.float16)
bf16_compress_hook = _compressing_hook(torch.bfloat16)
