"""Blocks that share a parameter with the rest of the model, and so cannot be FSDP units of their own.

A parameter registered inside a block and outside it (a tied embedding) would belong to two units, which
``fully_shard`` refuses, so such a block stays in its enclosing unit and the plan's blocks line names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class SharedParameter:
    """A block that shares a parameter with a module outside it.

    Attributes:
        inside: the parameter's name under the block, as the model names it (``"blocks.0.embed.weight"``).
        outside: another name of the same parameter, outside the block (``"wte.weight"``).
    """

    block: nn.Module
    inside: str
    outside: str


def blocks_sharing_parameters(model: nn.Module, blocks: Sequence[nn.Module]) -> list[SharedParameter]:
    """For each of ``blocks`` (submodules of ``model``) that shares a parameter with a module outside it, one example.

    Registrations count, not calls: a parameter that a block's forward reads from another module is not seen.
    """
    names_of: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(parameter), []).append(name)
    prefix_of = {id(module): name for name, module in model.named_modules()}
    shared: list[SharedParameter] = []
    for block in blocks:
        prefix = prefix_of[id(block)] + "."
        for name, parameter in block.named_parameters(prefix=prefix[:-1], remove_duplicate=False):
            outside = next((other for other in names_of[id(parameter)] if not other.startswith(prefix)), None)
            if outside is not None:
                shared.append(SharedParameter(block, name, outside))
                break
    return shared


def describe_kept_blocks(shared: Sequence[SharedParameter]) -> str:
    """The blocks line's note on blocks kept in their enclosing unit (one example parameter per class)."""
    if not shared:
        return ""
    first_of_class: dict[type[nn.Module], SharedParameter] = {}
    counts: dict[type[nn.Module], int] = {}
    for entry in shared:
        first_of_class.setdefault(type(entry.block), entry)
        counts[type(entry.block)] = counts.get(type(entry.block), 0) + 1
    kept = ", ".join(
        f"{cls.__name__} x {counts[cls]} ('{entry.inside}' is also '{entry.outside}')"
        for cls, entry in first_of_class.items()
    )
    return f"; kept in the enclosing unit (a parameter shared outside them): {kept}"
