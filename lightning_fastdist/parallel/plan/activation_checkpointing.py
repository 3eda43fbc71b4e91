"""Activation checkpointing per block, for every strategy, applied before sharding or wrapping.

torch's hook-based ``checkpoint(module)`` keeps parameter names and ``state_dict`` keys, so checkpoints move freely
between runs with and without it. The modes are described in ``ParallelPlan``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal, get_args

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_fastdist.parallel.plan.blocks import outermost_block_modules

CheckpointingMode = Literal["none", "full", "selective"]
ACTIVATION_CHECKPOINTING_MODES: tuple[str, ...] = get_args(CheckpointingMode)
# The modes by the recomputation they add to backward, least first: full recomputes whole blocks.
LEAST_RECOMPUTE_FIRST = tuple(sorted(ACTIVATION_CHECKPOINTING_MODES, key=lambda mode: mode == "full"))

# Ops whose outputs selective checkpointing keeps: costly to redo, while the rest (norms, GELU, adds, dropout) are
# memory-bound and cheap.
_EXPENSIVE_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
EXPENSIVE_OPS = frozenset(
    getattr(torch.ops.aten, name).default for name in _EXPENSIVE_OP_NAMES if hasattr(torch.ops.aten, name)
)


def validate_activation_checkpointing(mode: str | int) -> str | int:
    """Return ``mode`` if it is a valid activation-checkpointing mode, else raise one clear ``ValueError``."""
    if mode in ACTIVATION_CHECKPOINTING_MODES or (isinstance(mode, int) and not isinstance(mode, bool) and mode >= 1):
        return mode
    raise ValueError(
        f"activation_checkpointing: got {mode!r}; use one of {', '.join(map(repr, ACTIVATION_CHECKPOINTING_MODES))} "
        "or an integer n >= 1 (checkpoint every n-th block)."
    )


def _keep_expensive_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in EXPENSIVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(
    model: nn.Module, mode: str | int, block_classes: Sequence[type[nn.Module]]
) -> list[nn.Module]:
    """Checkpoint the outermost blocks of ``model`` in place, before sharding, compiling or DDP-wrapping.

    Returns the checkpointed blocks in module order. Raises ``ValueError`` for an unknown ``mode``, for a mode other
    than ``"none"`` with no block in ``model``, and for an integer ``mode`` above the number of blocks.
    """
    validate_activation_checkpointing(mode)
    if mode == "none":
        return []
    blocks = outermost_block_modules(model, block_classes)
    if not blocks:
        names = ", ".join(cls.__name__ for cls in block_classes) or "none found"
        raise ValueError(
            f"activation_checkpointing={mode!r} found no block to checkpoint in {type(model).__name__} "
            f"(block classes: {names}); name its repeated layers with blocks=[...]."
        )
    if isinstance(mode, int):
        if mode > len(blocks):
            raise ValueError(
                f"activation_checkpointing={mode}: {type(model).__name__} has {len(blocks)} block(s), so no block "
                f"would be checkpointed; use an integer from 1 to {len(blocks)}, 'full' or 'selective'."
            )
        blocks = blocks[mode - 1 :: mode]
    context_fn = functools.partial(create_selective_checkpoint_contexts, _keep_expensive_outputs)
    for block in blocks:
        if mode == "selective":
            checkpoint(block, use_reentrant=False, context_fn=context_fn)
        else:
            checkpoint(block, use_reentrant=False)
    return blocks
