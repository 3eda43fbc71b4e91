"""The old spellings of the ``blocks`` option (``shard_modules`` of FastFSDPStrategy, ``block_modules`` of
FastDDPStrategy), kept for one release with a one-line deprecation message."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation

from lightning_fastdist.parallel.plan.blocks import check_blocks_value


def blocks_option(strategy: str, blocks: Any, old_name: str, old_value: Any) -> Any:
    """The ``blocks`` value a strategy plans with: ``blocks`` itself, or what its deprecated spelling gave.

    Args:
        strategy: the strategy's class name, for the messages.
        blocks: the ``blocks`` argument (``"auto"`` when not given); the plan checks it.
        old_value: the deprecated argument ``old_name``'s value, ``None`` when not given.

    Raises:
        ValueError: both spellings given, or an old spelling's value that is neither ``"auto"`` nor class names.
    """
    if old_value is None:
        return blocks
    if blocks != "auto":
        raise ValueError(f"{strategy}: {old_name} is the old name of blocks; give blocks only.")
    value = [old_value] if isinstance(old_value, str) and old_value != "auto" else old_value
    check_blocks_value(value, old_name)
    rank_zero_deprecation(
        f"{strategy}: {old_name} is renamed blocks; write blocks={value!r} "
        f"({old_name} stops working in the next release)."
    )
    return value
