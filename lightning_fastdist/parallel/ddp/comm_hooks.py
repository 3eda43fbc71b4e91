"""DDP gradient communication hooks, chosen by name, that run on every backend.

torch's bf16 hook refuses any backend but NCCL although gloo all-reduces bf16 correctly; these use only
``torch.distributed.all_reduce``, so they work on gloo and NCCL alike, and record their payload in a
:class:`CommStats` (bytes per step counted, not estimated). A hook receives one gradient bucket and returns a future
that resolves to it holding the average over ranks.
"""

# No "from __future__ import annotations": DDP compares the hooks' annotations
# with dist.GradBucket and Future[Tensor] at registration, so they must be real objects.

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
    """What every hook needs: the group to reduce over and where to count bytes.

    Args:
        process_group: the group to all-reduce over; ``None`` is the default group.
        stats: byte and round counters updated by the hook.
    """

    process_group: dist.ProcessGroup | None = None
    stats: CommStats = field(default_factory=CommStats)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)


def launch_mean_all_reduce(state: HookState, tensor: Tensor) -> Future:
    """Divide ``tensor`` by the world size, start an async all-reduce of it in place, count its bytes.

    Dividing first (rather than after the sum) keeps low-precision sums from overflowing.
    Returns a future resolving to ``tensor``.
    """
    tensor.div_(state.world_size)
    state.stats.record(tensor)
    work = dist.all_reduce(tensor, group=state.process_group, async_op=True)
    return work.get_future().then(lambda _: tensor)


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
        compressed = buffer.to(dtype)

        def decompress(future: Future) -> Tensor:
            buffer.copy_(future.value())
            return buffer

        return launch_mean_all_reduce(state, compressed).then(decompress)

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    hook.__doc__ = f"Average gradients in {dtype} (half the bytes of fp32), then write them back in full precision."
    return hook


fp16_compress_hook = _compressing_hook(torch.float16)
bf16_compress_hook = _compressing_hook(torch.bfloat16)
