"""Every private Lightning name the package uses is in the registry (``lightning_fastdist/trainer/internals.py``), with
the modules that use it, and exists in the installed Lightning: an upgrade that moves one fails here, in one line.

Read from the source (AST), so a lazy import or a use inside a function counts too. What counts as private:
a ``_name`` imported from ``lightning.*``, a module of Lightning's whose path has a ``_part``, and an attribute
``_x`` read or set on a Lightning object. Which object a name like ``trainer._x`` is on is not in the source;
an attribute counts when Lightning's own source defines a ``_x`` and this package defines none (its own
``self._start`` is not Lightning's). On ``self`` inside a subclass of a Lightning class, the class's
Lightning bases decide.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import lightning

from lightning_fastdist.trainer import internals
from lightning_fastdist.trainer.internals import PRIVATE_ATTRIBUTES, PRIVATE_IMPORTS, PrivateName, missing_private_names

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_fastdist"
LIGHTNING_PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning")
# Calls whose second argument names an attribute of the first (``replace``: the trainer's instance patches).
ACCESSORS = ("getattr", "setattr", "hasattr", "delattr", "replace")


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def is_lightning(module: str) -> bool:
    return module.split(".")[0] in LIGHTNING_PACKAGES


def defined_private_names(tree: ast.AST, on_self_only: bool = False) -> set[str]:
    """The private names a source defines: functions, classes, assigned names and attributes (``on_self_only``:
    attributes set on ``self``, not those it sets on other objects)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if not on_self_only or isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {name for name in names if is_private(name)}


@cache
def lightnings_private_names() -> frozenset[str]:
    names: set[str] = set()
    for path in Path(lightning.__file__).parent.rglob("*.py"):
        names |= defined_private_names(ast.parse(path.read_text()))
    return frozenset(names)


@cache
def defined_by_lightning_bases(module: str, class_name: str) -> frozenset[str]:
    """The private names that Lightning classes among the bases of the package's class ``module.class_name`` define
    (none for a class that is not a Lightning subclass, or not at a module's top level)."""
    owner = getattr(importlib.import_module(f"lightning_fastdist.{module}" if module else "lightning_fastdist"),
                    class_name, None)  # fmt: skip
    if not inspect.isclass(owner):
        return frozenset()
    names: set[str] = set()
    for base in inspect.getmro(owner):
        if is_lightning(base.__module__):
            names |= {name for name in vars(base) if is_private(name)}
            names |= defined_private_names(ast.parse(textwrap.dedent(inspect.getsource(base))))
    return frozenset(names)


@dataclass(frozen=True)
class Mention:
    """A private attribute in the source: ``x._name``, ``getattr(x, "_name")``, or ``def _name`` in a class."""

    name: str
    on_self_of: str | None  # the class whose ``self`` (or ``super()``) it is on, or whose method it defines
    defines: bool  # a definition (``def``, ``self._name = ...``), not a use


def mentions(tree: ast.Module) -> list[Mention]:
    found = []

    def visit(node: ast.AST, class_name: str | None) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and is_private(node.name) and class_name:
            found.append(Mention(node.name, class_name, defines=True))
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            on_super = isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "super"
            owner = class_name if on_self or on_super else None
            found.append(Mention(node.attr, owner, defines=on_self and isinstance(node.ctx, ast.Store)))
        accessor = ast.unparse(node.func).rsplit(".", 1)[-1] if isinstance(node, ast.Call) else ""
        if accessor in ACCESSORS and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and is_private(name.value):
                found.append(Mention(name.value, None, defines=False))
        for child in ast.iter_child_nodes(node):
            visit(child, node.name if isinstance(node, ast.ClassDef) else class_name)

    visit(tree, None)
    return found


def package_modules() -> dict[str, ast.Module]:
    """Each module of the package by dotted name relative to the package ("strategies.ddp"), parsed."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        dotted = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        modules[dotted.removesuffix("__init__").rstrip(".")] = ast.parse(path.read_text())
    return modules


def private_imports(tree: ast.Module) -> set[str]:
    """Lightning's private names (``module._name``) and private modules that a source imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and is_lightning(node.module or ""):
            if any(is_private(part) for part in node.module.split(".")):
                names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names if is_private(alias.name)}
        elif isinstance(node, ast.Import):
            private = (a.name for a in node.names if any(is_private(part) for part in a.name.split(".")))
            names |= {name for name in private if is_lightning(name)}
    return names


def private_lightning_uses() -> dict[str, set[str]]:
    """Each private Lightning name the package uses (an import's dotted path, or an attribute) and its modules."""
    modules = package_modules()
    in_module = {module: mentions(tree) for module, tree in modules.items()}

    def lightnings(module: str, mention: Mention) -> bool:
        return mention.on_self_of is not None and mention.name in defined_by_lightning_bases(module, mention.on_self_of)

    ours = {name for tree in modules.values() for name in defined_private_names(tree, on_self_only=True)} - {
        m.name for module, found in in_module.items() for m in found if m.defines and lightnings(module, m)
    }  # a name the package defines, less those it defines on Lightning's behalf (an override, Lightning's attribute)
    used: dict[str, set[str]] = defaultdict(set)
    for module, tree in modules.items():
        for name in private_imports(tree):
            used[name].add(module)
        for mention in in_module[module]:
            # Not the package's own: on another object, or on self in a class (a mixin) that inherits it
            foreign = mention.name not in ours and mention.name in lightnings_private_names()
            if lightnings(module, mention) or foreign:
                used[mention.name].add(module)
    return used


def registered() -> dict[str, set[str]]:
    """The registry as the scan names things: imports by dotted path, attributes by their name alone."""
    names = {name: set(use.used_in) for name, use in PRIVATE_IMPORTS.items()}
    for name, use in PRIVATE_ATTRIBUTES.items():
        names.setdefault(name.rsplit(".", 1)[1], set()).update(use.used_in)
    return names


def test_every_private_lightning_name_the_package_uses_is_registered_with_where_it_is_used():
    found, listed = private_lightning_uses(), registered()
    unlisted = {name: sorted(modules) for name, modules in found.items() if name not in listed}
    assert unlisted == {}, "add these to lightning_fastdist/trainer/internals.py"
    moved = {name: (sorted(found.get(name, ())), sorted(modules)) for name, modules in listed.items()}
    assert {name: uses for name, uses in moved.items() if uses[0] != uses[1]} == {}, "(used in, listed as used in)"


def test_every_registered_name_exists_in_the_installed_lightning(monkeypatch):
    assert missing_private_names() == []
    moved = {"lightning.pytorch.trainer.trainer.Trainer._gone": PrivateName(("cli",), "show the check works")}
    monkeypatch.setattr(internals, "PRIVATE_ATTRIBUTES", {**PRIVATE_ATTRIBUTES, **moved})
    assert missing_private_names() == [
        f"lightning.pytorch.trainer.trainer.Trainer._gone (used in cli to show the check works) is not in Lightning "
        f"{lightning.__version__}"
    ]


def test_the_scan_tells_lightnings_names_from_the_packages_own():
    tree = ast.parse(
        "class Monitor:\n"
        "    def _read(self, trainer):\n"
        "        self._start = trainer._checkpoint_connector._ckpt_path\n"
        "        getattr(trainer, '_accelerator_connector')\n"
    )
    assert [(m.name, m.on_self_of, m.defines) for m in mentions(tree)] == [
        ("_read", "Monitor", True),
        ("_start", "Monitor", True),
        ("_ckpt_path", None, False),
        ("_checkpoint_connector", None, False),
        ("_accelerator_connector", None, False),
    ]
    assert {"_ckpt_path", "_checkpoint_connector", "_accelerator_connector"} <= lightnings_private_names()
    assert "_after_closure" in defined_by_lightning_bases("precision", "FastMixedPrecision")  # Lightning's Precision
    assert defined_by_lightning_bases("parallel.comm.exposed", "ExposedCommClock") == frozenset()
