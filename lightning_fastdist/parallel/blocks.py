"""Find the repeated blocks of a model (the units that FSDP shards and activation checkpointing wraps).

A "block" is a module class whose instances form the layers of a model, such
as a transformer layer. Both FSDP and activation checkpointing act per block,
so both resolve the same user input here: either class names (strings, so
that a YAML file can name them) or ``"auto"``, which picks the classes of the
modules that a ``ModuleList`` / ``Sequential`` / ``ModuleDict`` repeats.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

# Containers whose children are the layers of a model.
LAYER_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def find_repeated_blocks(model: nn.Module) -> list[type[nn.Module]]:
    """Classes of the model's layers, in the order first met.

    A class counts when a layer container holds it at least twice, or when a
    ``ModuleList`` holds only instances of it (so a one-layer model built like
    a deep one still has its block found). A model with
    ``self.blocks = nn.ModuleList(Block(...) for _ in range(n))`` gives
    ``[Block]`` for any ``n >= 1``. A model without such a container gives ``[]``.
    """
    found: list[type[nn.Module]] = []
    for module in model.modules():
        if not isinstance(module, LAYER_CONTAINERS):
            continue
        child_classes = [type(child) for child in module.children()]
        homogeneous_list = isinstance(module, nn.ModuleList) and len(set(child_classes)) == 1
        for cls in child_classes:
            repeated = homogeneous_list or child_classes.count(cls) >= 2
            if repeated and cls not in found and cls not in LAYER_CONTAINERS:
                found.append(cls)
    return found


def qualified_name(cls: type) -> str:
    """``package.module.ClassName`` of a class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def resolve_block_classes(
    model: nn.Module, names: str | Sequence[str], option: str = "block_classes"
) -> list[type[nn.Module]]:
    """Turn ``"auto"`` or class names into the module classes of ``model`` they denote.

    Args:
        model: the model to search.
        names: ``"auto"`` (see :func:`find_repeated_blocks`), or class names,
            each either bare (``"Block"``) or qualified (``"my_pkg.model.Block"``).
        option: the user-facing option that ``names`` came from, named in the error.

    Raises:
        ValueError: a name matches no module class in ``model``; the message
            lists the classes the model does contain.
    """
    if isinstance(names, str):
        if names == "auto":
            return find_repeated_blocks(model)
        names = [names]
    classes_in_model: dict[type[nn.Module], None] = dict.fromkeys(type(m) for m in model.modules())
    resolved: list[type[nn.Module]] = []
    for name in names:
        matches = [cls for cls in classes_in_model if name in (cls.__name__, qualified_name(cls))]
        if not matches:
            candidates = ", ".join(sorted({cls.__name__ for cls in classes_in_model}))
            raise ValueError(
                f"{option}: {name!r} matches no module class in {type(model).__name__}; "
                f"the classes found are: {candidates} (or use 'auto')."
            )
        resolved.extend(cls for cls in matches if cls not in resolved)
    return resolved


def block_modules(model: nn.Module, block_classes: Sequence[type[nn.Module]]) -> list[nn.Module]:
    """Every submodule of ``model`` (not ``model`` itself) that is an instance of ``block_classes``, in module order."""
    classes = tuple(block_classes)
    return [module for module in model.modules() if module is not model and isinstance(module, classes)]


def outermost_block_modules(model: nn.Module, block_classes: Sequence[type[nn.Module]]) -> list[nn.Module]:
    """Like :func:`block_modules`, leaving out blocks nested inside another block."""
    blocks = block_modules(model, block_classes)
    nested = {id(inner) for block in blocks for inner in block.modules() if inner is not block}
    return [block for block in blocks if id(block) not in nested]
