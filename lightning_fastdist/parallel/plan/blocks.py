"""Find the blocks of a model: the units that FSDP shards, activation checkpointing wraps and compile compiles.

A block is a module class whose instances form the model's layers (a transformer layer). Every strategy resolves its
``blocks`` option here, from class names (strings, so a YAML file can name them) or ``"auto"``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

# Containers whose children are the layers of a model; never blocks themselves (the class says nothing).
LAYER_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# Root modules named in the description before it is cut short with "...".
ROOT_NAMES_SHOWN = 6


def _holds_layers(module: nn.Module) -> bool:
    """Whether ``module`` owns parameters through children of its own (a leaf such as ``Linear`` does not)."""
    return any(next(child.parameters(), None) is not None for child in module.children())


def _strict_ancestors(model: nn.Module) -> dict[int, list[nn.Module]]:
    """For every submodule (by ``id``), the modules that enclose it, ``model`` excluded."""
    ancestors: dict[int, list[nn.Module]] = {}
    for parent in model.modules():
        enclosing = [] if parent is model else [*ancestors.get(id(parent), []), parent]
        for child in parent.children():
            ancestors.setdefault(id(child), enclosing)
    return ancestors


def find_blocks(model: nn.Module) -> list[type[nn.Module]]:
    """The classes ``"auto"`` picks: the outermost repeated modules that hold layers, in the order first met.

    A candidate owns parameters through children of its own (never a leaf layer) and is repeated (two or more
    instances, or the only class of a ``ModuleList``/``Sequential``); a candidate nested in another is left to the
    outer one, except inside a *stack* (a repeated module holding the model's layers in a list, as T5's ``T5Stack``),
    whose list's layers are the blocks. A model without candidates gives ``[]``: it is one unit. The rules with
    examples: ``docs/models.md``.
    """
    instances: dict[type[nn.Module], list[nn.Module]] = {}
    only_class_of_a_list: set[type[nn.Module]] = set()
    for module in model.modules():
        if isinstance(module, LAYER_CONTAINERS):
            classes = {type(child) for child in module.children()}
            if len(classes) == 1 and not isinstance(module, nn.ModuleDict):
                only_class_of_a_list |= classes
        elif module is not model:
            instances.setdefault(type(module), []).append(module)
    candidates = {
        cls
        for cls, found in instances.items()
        if (len(found) >= 2 or cls in only_class_of_a_list) and all(_holds_layers(m) for m in found)
    }
    ancestors = _strict_ancestors(model)
    candidates -= _stacks(model, candidates, ancestors)

    def nested_in_another(cls: type[nn.Module]) -> bool:
        enclosing = {type(outer) for m in instances[cls] for outer in ancestors[id(m)]}
        return bool(enclosing & (candidates - {cls}))

    return [cls for cls in instances if cls in candidates and not nested_in_another(cls)]


def _stacks(
    model: nn.Module, candidates: set[type[nn.Module]], ancestors: dict[int, list[nn.Module]]
) -> set[type[nn.Module]]:
    """The candidate classes that enclose one of the model's outermost layer lists (the stacks of ``find_blocks``)."""

    def is_layer_list(module: nn.Module) -> bool:
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            return False
        classes = {type(child) for child in module.children()}
        return len(classes) == 1 and classes <= candidates

    if is_layer_list(model):  # the model is the list of its layers: every other list is inside a layer
        return set()
    layer_lists = [module for module in model.modules() if module is not model and is_layer_list(module)]
    outermost = [layers for layers in layer_lists if not any(is_layer_list(outer) for outer in ancestors[id(layers)])]
    return {type(outer) for layers in outermost for outer in ancestors[id(layers)]} & candidates


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def check_blocks_value(blocks: object, option: str = "blocks") -> None:
    """Raise one clear ``ValueError`` unless ``blocks`` is ``"auto"`` or a list of class names."""
    names_list = isinstance(blocks, (list, tuple)) and all(isinstance(name, str) for name in blocks)
    if blocks != "auto" and not names_list:
        raise ValueError(f"{option}: got {blocks!r}; use 'auto' or a list of module class names, e.g. ['Block'].")


def resolve_blocks(model: nn.Module, blocks: str | Sequence[str], option: str = "blocks") -> list[type[nn.Module]]:
    """Turn ``"auto"`` or class names into the module classes of ``model`` they denote.

    Args:
        blocks: ``"auto"``, or class names, bare (``"Block"``) or qualified (``"my_pkg.model.Block"``); a leaf class
            such as ``"Linear"`` is allowed.
        option: the user-facing option that ``blocks`` came from, named in the error.
    """
    check_blocks_value(blocks, option)
    if blocks == "auto":
        return find_blocks(model)
    classes_in_model: dict[type[nn.Module], None] = dict.fromkeys(type(m) for m in model.modules())
    resolved: list[type[nn.Module]] = []
    for name in blocks:
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
    """Like ``block_modules``, leaving out blocks nested inside another block."""
    blocks = block_modules(model, block_classes)
    nested = {id(inner) for block in blocks for inner in block.modules() if inner is not block}
    return [block for block in blocks if id(block) not in nested]


def call_sites(model: nn.Module, modules: Sequence[nn.Module]) -> dict[str, tuple[str, ...]]:
    """For each class of ``modules`` (submodules of ``model``) found at two or more places, those places.

    A place is where an instance sits, its list index left out: T5's ``T5Block`` runs at
    ``model.encoder.block`` and at ``model.decoder.block``, with inputs of each place's own shapes.
    """
    names = {id(module): name for name, module in model.named_modules()}
    places: dict[str, dict[str, None]] = {}
    for module in modules:
        parts = names[id(module)].split(".")
        place = ".".join(parts[:-1] if parts[-1].isdigit() else parts)
        places.setdefault(type(module).__name__, {})[place] = None
    return {cls: tuple(found) for cls, found in places.items() if len(found) >= 2}


def root_module_names(model: nn.Module, block_classes: Sequence[type[nn.Module]]) -> list[str]:
    """Short names of the modules outside every block that own parameters (what the root unit holds).

    A module held both inside a block and outside (a tied embedding) counts where it is first registered.
    """
    prefixes = tuple(
        f"{name}." for name, m in model.named_modules() if m is not model and isinstance(m, tuple(block_classes))
    )
    names: list[str] = []
    for name, module in model.named_modules():
        owns = any(p is not None for p in module._parameters.values())
        parts = name.split(".")
        short = ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1] or type(module).__name__  # "head.0", "wte"
        if owns and not f"{name}.".startswith(prefixes) and short not in names:
            names.append(short)
    return names


def describe_blocks(model: nn.Module, block_classes: Sequence[type[nn.Module]]) -> str:
    """The line a strategy logs at setup: each block class and its count, then the root's modules."""
    roots = root_module_names(model, block_classes)
    shown = ", ".join(roots[:ROOT_NAMES_SHOWN]) + (", ..." if len(roots) > ROOT_NAMES_SHOWN else "")
    instances = block_modules(model, block_classes)
    if not instances:
        return f"blocks: none in {type(model).__name__} (root: {shown or 'no parameters'})"
    counts = ", ".join(f"{cls.__name__} x {sum(isinstance(m, cls) for m in instances)}" for cls in block_classes)
    return f"blocks: {counts}" + (f" (+ root: {shown})" if roots else "")
