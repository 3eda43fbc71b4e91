"""How the three strategies check their options: each is described once (a settings class under ``parallel/`` where
one owns it, a check here otherwise), checked at construction, before any process starts, and a bad value is refused
in one line that names the strategy, the option and what it takes (:func:`named_errors`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation
from torch.nn.parallel import DistributedDataParallel

from lightning_fastdist.parallel.plan.blocks import check_blocks_value

CHECKPOINT_FORMATS = ("sharded", "full")
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


@contextmanager
def named_errors(strategy: str) -> Iterator[None]:
    """Prefix the ``ValueError`` of an option check inside with the strategy's class name, as a recipe names it."""
    try:
        yield
    except ValueError as error:
        raise ValueError(f"{strategy}: {error}") from None


def blocks_option(strategy: str, blocks: Any, old_name: str, old_value: Any) -> Any:
    """The ``blocks`` value a strategy plans with: ``blocks`` itself, or what its deprecated spelling ``old_name``
    (FSDP's ``shard_modules``, DDP's ``block_modules``; ``old_value`` ``None`` when not given) gave, with a one-line
    deprecation message; both spellings at once are refused."""
    if old_value is None:
        return blocks
    if blocks != "auto":
        raise ValueError(f"{old_name} is the old name of blocks; give blocks only.")
    value = [old_value] if isinstance(old_value, str) and old_value != "auto" else old_value
    check_blocks_value(value, old_name)
    rank_zero_deprecation(
        f"{strategy}: {old_name} is renamed blocks; write blocks={value!r} "
        f"({old_name} stops working in the next release)."
    )
    return value


def check_ddp_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse extra arguments that DistributedDataParallel would not take (they go to it, as in Lightning's
    ``DDPStrategy``); a replaced comm-hook argument of Lightning's says what to write instead."""
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    accepted = [name for name in parameters if name not in _SET_BY_THE_STRATEGY]
    for name, value in kwargs.items():
        if name in REPLACED_LIGHTNING_OPTIONS:
            if value is not None:  # LightningCLI passes every argument it knows, unset ones as None
                raise ValueError(f"{name} is not taken; {REPLACED_LIGHTNING_OPTIONS[name]}.")
            continue
        if name not in accepted:
            raise ValueError(
                f"{name!r} is an option of neither FastDDPStrategy nor DistributedDataParallel; "
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
        raise ValueError(f"bucket_cap_mb must be a finite number > 0 or 'auto', got {bucket_cap_mb!r}.")


def check_checkpoint_format(checkpoint_format: str) -> None:
    """Refuse an FSDP checkpoint format we do not write."""
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(
            f"checkpoint_format: got {checkpoint_format!r}; use one of {', '.join(map(repr, CHECKPOINT_FORMATS))}."
        )


def check_async_checkpointing(async_checkpointing: Any) -> None:
    """Refuse an ``async_checkpointing`` that is not a bool (a string from a script would read as on)."""
    if not isinstance(async_checkpointing, bool):
        raise ValueError(f"async_checkpointing: got {async_checkpointing!r}; use True or False.")
