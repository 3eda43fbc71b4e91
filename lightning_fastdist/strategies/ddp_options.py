"""FastDDPStrategy's option checks: every bad value is refused at construction with one clear message."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_fastdist.parallel.comm_hook_registry import BF16_BACKENDS, COMM_HOOK_NAMES, POWERSGD_FACTOR_DTYPES

# Lightning's DDPStrategy arguments that FastDDPStrategy replaces on purpose, and what to write instead.
REPLACED_LIGHTNING_OPTIONS = {
    "ddp_comm_hook": "name the hook instead: comm_hook='fp16', 'bf16', 'powersgd' or 'none' (on every backend)",
    "ddp_comm_state": "use comm_hook='powersgd' with powersgd_rank and powersgd_start_iter instead (its state is "
    "built and checkpointed for you)",
    "ddp_comm_wrapper": "use comm_hook='fp16' or 'bf16' instead (compression by name)",
    "model_averaging_period": "post-local SGD is not offered; use Lightning's DDPStrategy for it",
}
# DistributedDataParallel's arguments that the strategy itself sets.
_SET_BY_THE_STRATEGY = ("self", "module", "device_ids")


def check_ddp_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse, before any process starts, extra arguments that DistributedDataParallel would not take.

    Lightning's ``DDPStrategy(**kwargs)`` passes them to ``DistributedDataParallel``; so does
    FastDDPStrategy. Its own replacements of Lightning's comm-hook arguments say what to write instead.
    """
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    accepted = [name for name in parameters if name not in _SET_BY_THE_STRATEGY]
    for name, value in kwargs.items():
        if name in REPLACED_LIGHTNING_OPTIONS:
            if value is not None:  # LightningCLI passes every argument it knows, unset ones as None
                raise ValueError(f"FastDDPStrategy: {name} is not taken; {REPLACED_LIGHTNING_OPTIONS[name]}.")
            continue
        if name not in accepted:
            raise ValueError(
                f"FastDDPStrategy: {name!r} is an option of neither FastDDPStrategy nor DistributedDataParallel; "
                f"DistributedDataParallel takes: {', '.join(accepted)}."
            )


def sends_bf16(comm_hook: str, powersgd_factor_dtype: str) -> str | None:
    """The option that makes DDP all-reduce bfloat16 (``"comm_hook='bf16'"`` ...), or ``None``."""
    if comm_hook == "bf16":
        return "comm_hook='bf16'"
    if comm_hook == "powersgd" and powersgd_factor_dtype == "bf16":
        return "powersgd_factor_dtype='bf16'"
    return None


def check_ddp_options(
    comm_hook: str,
    powersgd_rank: int,
    powersgd_start_iter: int,
    bucket_cap_mb: Any,
    backend: str | None,
    powersgd_factor_dtype: str = "fp32",
) -> None:
    """Reject bad options at construction, before any process is started."""
    if comm_hook not in COMM_HOOK_NAMES:
        raise ValueError(
            f"FastDDPStrategy: comm_hook={comm_hook!r} is not supported; accepted values: "
            f"{', '.join(map(repr, COMM_HOOK_NAMES))}."
        )
    if isinstance(powersgd_rank, bool) or not isinstance(powersgd_rank, int) or powersgd_rank < 1:
        raise ValueError(f"FastDDPStrategy: powersgd_rank must be an integer >= 1, got {powersgd_rank!r}.")
    if isinstance(powersgd_start_iter, bool) or not isinstance(powersgd_start_iter, int) or powersgd_start_iter < 2:
        raise ValueError(
            f"FastDDPStrategy: powersgd_start_iter must be an integer >= 2, got {powersgd_start_iter!r} "
            "(the first synchronisations are exact while DDP settles its buckets)."
        )
    if bucket_cap_mb != "auto" and (
        isinstance(bucket_cap_mb, bool)
        or not isinstance(bucket_cap_mb, (int, float))
        or not math.isfinite(bucket_cap_mb)
        or bucket_cap_mb <= 0
    ):
        raise ValueError(
            f"FastDDPStrategy: bucket_cap_mb must be a finite number > 0 or 'auto', got {bucket_cap_mb!r}."
        )
    if powersgd_factor_dtype not in POWERSGD_FACTOR_DTYPES:
        raise ValueError(
            f"FastDDPStrategy: powersgd_factor_dtype={powersgd_factor_dtype!r} is not supported; accepted values: "
            f"{', '.join(map(repr, POWERSGD_FACTOR_DTYPES))}."
        )
    option = sends_bf16(comm_hook, powersgd_factor_dtype)
    if option is not None and backend is not None:
        check_bf16_backend(backend, option=option)


def check_bf16_backend(backend: str, device: torch.device | None = None, option: str = "comm_hook='bf16'") -> None:
    """Refuse ``option`` (an option that sends bfloat16) where bfloat16 cannot be all-reduced."""
    if backend not in BF16_BACKENDS:
        raise ValueError(
            f"FastDDPStrategy: {option} needs process_group_backend in "
            f"{', '.join(map(repr, BF16_BACKENDS))} (they reduce bfloat16), got {backend!r}."
        )
    if device is not None and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"FastDDPStrategy: {option} needs a GPU with bfloat16 support "
            f"({torch.cuda.get_device_name(device)} has none); use fp16 instead."
        )
