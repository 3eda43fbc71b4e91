"""The fragments Streaming DiLoCo synchronises at staggered steps: consecutive blocks, plus the rest.

A fragment is an ``nn.Module`` holding some of the model's parameters (the same tensors, not copies), as torchft's
``DiLoCo`` takes fragments as modules.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def split_into_fragments(model: nn.Module, blocks: Sequence[nn.Module], count: int) -> list[nn.Module]:
    """``count`` fragments of ``model``'s trainable parameters: ``blocks`` split into ``count`` runs of consecutive
    blocks, the parameters outside every block (embeddings, the head, final norms) joining the first fragment."""
    if count == 1:
        return [_holder(list(_trainable(model)))]
    if not blocks or len(blocks) % count:
        raise ValueError(
            f"outer_sync.fragments={count} does not divide the model's {len(blocks)} blocks: give a divisor of "
            f"{len(blocks)} (or name the blocks with `blocks`)."
            if blocks
            else f"outer_sync.fragments={count} needs the model's blocks, and none were found: name them with "
            "`blocks`, or give fragments: 1."
        )
    per_fragment = len(blocks) // count
    in_blocks: set[int] = set()
    groups: list[list[nn.Parameter]] = []
    for index in range(count):
        group = [p for block in blocks[index * per_fragment : (index + 1) * per_fragment] for p in _trainable(block)]
        groups.append([p for p in group if id(p) not in in_blocks])  # a parameter shared by two blocks goes once
        in_blocks.update(id(p) for p in group)
    groups[0] = [p for p in _trainable(model) if id(p) not in in_blocks] + groups[0]
    return [_holder(group) for group in groups]


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _holder(parameters: list[nn.Parameter]) -> nn.Module:
    holder = nn.Module()
    for index, parameter in enumerate(parameters):
        holder.register_parameter(f"p{index}", parameter)
    return holder
