"""FastDDPStrategy's option checks: every bad value is refused at construction with one clear message."""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_fastdist.parallel.comm_hook_registry import BF16_BACKENDS, COMM_HOOK_NAMES, POWERSGD_FACTOR_DTYPES


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
        raise ValueError(f"FastDDPStrategy: bucket_cap_mb must be a finite number > 0 or 'auto', got {bucket_cap_mb!r}.")
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
