"""Register a communication hook on a DDP module by name."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_fastdist.parallel.comm_hooks import (
    HookState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from lightning_fastdist.parallel.powersgd import PowerSGDState, powersgd_hook

COMM_HOOK_NAMES = ("none", "fp16", "bf16", "powersgd")
# What PowerSGD's P and Q factors may travel in.
POWERSGD_FACTOR_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Backends known to all-reduce bfloat16 tensors.
BF16_BACKENDS = ("gloo", "nccl")


def register_comm_hook(
    ddp_module: DistributedDataParallel,
    name: str,
    process_group: dist.ProcessGroup | None = None,
    powersgd_rank: int = 2,
    powersgd_start_iter: int = 1000,
    powersgd_error_feedback: bool = True,
    powersgd_warm_start: bool = True,
    powersgd_factor_dtype: str = "fp32",
) -> HookState:
    """Register the hook called ``name`` on ``ddp_module`` and return its state (with byte counters).

    Args:
        ddp_module: the wrapped model.
        name: one of :data:`COMM_HOOK_NAMES`. ``"none"`` still registers a
            full-precision averaging hook, so bytes are counted the same way for every choice.
        process_group: group to reduce over (``None``: the default group).
        powersgd_rank: PowerSGD factor rank (>= 1).
        powersgd_start_iter: exact synchronisations before PowerSGD compresses (>= 2).
        powersgd_error_feedback: PowerSGD error feedback on/off.
        powersgd_warm_start: PowerSGD warm start on/off.
        powersgd_factor_dtype: a key of :data:`POWERSGD_FACTOR_DTYPES`: what P and Q are all-reduced in.
    """
    if name not in COMM_HOOK_NAMES:
        raise ValueError(
            f"comm_hook={name!r} is not supported; accepted values: {', '.join(map(repr, COMM_HOOK_NAMES))}."
        )
    if name == "powersgd":
        state = PowerSGDState(
            process_group=process_group,
            rank=powersgd_rank,
            start_iter=powersgd_start_iter,
            error_feedback=powersgd_error_feedback,
            warm_start=powersgd_warm_start,
            factor_dtype=POWERSGD_FACTOR_DTYPES[powersgd_factor_dtype],
        )
        state.index_parameters(ddp_module.module)
        ddp_module.register_comm_hook(state, powersgd_hook)
        return state
    hooks = {"none": allreduce_hook, "fp16": fp16_compress_hook, "bf16": bf16_compress_hook}
    state = HookState(process_group=process_group)
    ddp_module.register_comm_hook(state, hooks[name])
    return state
