"""FastDDPStrategy's checks of DDP's own options: each bad value is refused at construction in one line."""

from __future__ import annotations

import inspect
import math
from typing import Any

from torch.nn.parallel import DistributedDataParallel

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
    """Refuse, before any process starts, extra arguments that DistributedDataParallel would not take (they go to
    it, as in Lightning's ``DDPStrategy``); a replaced comm-hook argument of Lightning's says what to write instead."""
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


def check_bucket_cap_mb(bucket_cap_mb: Any) -> None:
    """Refuse a bucket size that is neither ``"auto"`` nor a finite number > 0."""
    if bucket_cap_mb != "auto" and (
        isinstance(bucket_cap_mb, bool)
        or not isinstance(bucket_cap_mb, (int, float))
        or not math.isfinite(bucket_cap_mb)
        or bucket_cap_mb <= 0
    ):
        raise ValueError(
            f"FastDDPStrategy: bucket_cap_mb must be a finite number > 0 or 'auto', got {bucket_cap_mb!r}."
        )
