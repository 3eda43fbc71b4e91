"""The ``blocks`` option every strategy shares: its old spellings, and the line rank 0 logs at setup.

``blocks`` names a model's repeated blocks (``"auto"`` or class names), the units of
FSDP, activation checkpointing and per-block compile; the resolution itself is
:func:`lightning_fastdist.parallel.blocks.resolve_blocks`. ``FastFSDPStrategy`` called
it ``shard_modules`` and ``FastDDPStrategy`` ``block_modules``: those spellings keep
working for one release, with a one-line deprecation message. Before blocks are
checkpointed or compiled one by one, a HuggingFace model's KV cache is turned off
(:func:`without_kv_cache`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation, rank_zero_info
from torch import nn

from lightning_fastdist.parallel.blocks import check_blocks_value, describe_blocks, resolve_blocks
from lightning_fastdist.parallel.kv_cache import turn_off_kv_cache


def blocks_option(strategy: str, blocks: Any, old_name: str, old_value: Any) -> str | list[str]:
    """The ``blocks`` value a strategy keeps: ``blocks`` itself, or what its deprecated spelling gave.

    Args:
        strategy: the strategy's class name, for the messages.
        blocks: the ``blocks`` argument (``"auto"`` when not given).
        old_name: the deprecated argument's name (``"shard_modules"``, ``"block_modules"``).
        old_value: its value, ``None`` when not given.

    Raises:
        ValueError: a value that is neither ``"auto"`` nor a list of class names, or both spellings given.
    """
    if old_value is None:
        check_blocks_value(blocks)
        return blocks if blocks == "auto" else list(blocks)
    if blocks != "auto":
        raise ValueError(f"{strategy}: {old_name} is the old name of blocks; give blocks only.")
    value = [old_value] if isinstance(old_value, str) and old_value != "auto" else old_value
    check_blocks_value(value, old_name)
    rank_zero_deprecation(
        f"{strategy}: {old_name} is renamed blocks; write blocks={value!r} "
        f"({old_name} stops working in the next release)."
    )
    return value if value == "auto" else list(value)


def resolve_and_log_blocks(
    model: nn.Module, blocks: str | Sequence[str], without_blocks: str = ""
) -> list[type[nn.Module]]:
    """Resolve ``blocks`` on ``model`` and log one line on rank 0 saying what was chosen.

    Args:
        model: the model the strategy is about to change.
        blocks: the strategy's ``blocks`` option.
        without_blocks: appended to the line when ``model`` has no block (what the strategy does instead).
    """
    classes = resolve_blocks(model, blocks)
    line = describe_blocks(model, classes)
    rank_zero_info(line if classes else line + without_blocks)
    return classes


def without_kv_cache(model: nn.Module, activation_checkpointing: str | int, compiles_blocks: bool) -> None:
    """Turn off HuggingFace's KV cache in ``model`` if its blocks are checkpointed or compiled; log one line.

    See :mod:`lightning_fastdist.parallel.kv_cache` for why.

    Args:
        model: the model whose blocks are about to change.
        activation_checkpointing: the strategy's option (``"none"`` leaves the blocks alone).
        compiles_blocks: whether each block's forward is compiled.
    """
    reasons = ["activation checkpointing"] if activation_checkpointing != "none" else []
    reasons += ["per-block compile"] if compiles_blocks else []
    changed = turn_off_kv_cache(model) if reasons else []
    if changed:
        rank_zero_info(
            f"use_cache: off for training in {', '.join(changed)}: {' and '.join(reasons)} would meet HuggingFace's KV "
            "cache in a new state in every layer (generate() keeps its generation_config)."
        )
