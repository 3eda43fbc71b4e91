"""The package's import graph is the layering ``docs/architecture.md`` draws: cli -> commands -> strategies, callbacks,
precision -> trainer -> planning -> diagnostics -> parallel -> torch; nothing but the CLI imports the CLI; and no module
imports itself through others (no import circle). Read from the source, so a lazy import inside a function counts too,
and so does one under ``if TYPE_CHECKING:`` (a circle of type names is still a circle a reader has to hold)."""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_fastdist"
CLI = "lightning_fastdist.cli"  # a package: every module of the command is inside it
ABOVE_STRATEGIES = ("lightning_fastdist.commands", CLI)
ABOVE_TRAINER = (*ABOVE_STRATEGIES, "lightning_fastdist.strategies", "lightning_fastdist.callbacks")
ABOVE_PLANNING = (*ABOVE_TRAINER, "lightning_fastdist.trainer", "lightning_fastdist.precision")
# What each layer may not import: the layers above it (and, for parallel/, Lightning and everything of ours outside it).
FORBIDDEN = {
    "parallel": ("lightning", "pytorch_lightning", "lightning_fastdist"),
    "diagnostics": (*ABOVE_PLANNING, "lightning_fastdist.planning"),
    "planning": ABOVE_PLANNING,
    "recipes": (*ABOVE_PLANNING, "lightning_fastdist.planning"),  # the reader under planning/simulation/
    "trainer": ABOVE_TRAINER,
    "strategies": ABOVE_STRATEGIES,
    "callbacks": (*ABOVE_STRATEGIES, "lightning_fastdist.strategies"),
    "commands": (CLI,),
}
OWN = {"parallel": "lightning_fastdist.parallel"}


def is_forbidden(layer: str, module: str) -> bool:
    """Whether ``module`` (a dotted name) is, or is inside, a package ``layer`` may not import."""

    def inside(package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return any(inside(package) for package in FORBIDDEN[layer]) and not (layer in OWN and inside(OWN[layer]))


def module_name(path: Path) -> str:
    """The dotted name of the package's file ``path`` (a package's ``__init__.py`` is the package)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(source: str, importer: str, known: frozenset[str], is_package: bool = False) -> set[str]:
    """The modules ``source`` (the text of module ``importer``) imports, anywhere in it: relative imports resolved,
    and ``from package import name`` giving ``package.name`` too when that is one of the ``known`` modules."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = importer.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in known)
    return names


def imports_of(path: Path, known: frozenset[str]) -> set[str]:
    return imported_modules(path.read_text(), module_name(path), known, is_package=path.name == "__init__.py")


def files_of(layer: str) -> list[Path]:
    """The files of a layer: a folder's, or one module's (``precision.py``)."""
    folder = PACKAGE / layer
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [folder.with_suffix(".py")]


@pytest.mark.parametrize("layer", FORBIDDEN)
def test_a_layer_imports_nothing_above_it(layer):
    known = frozenset(package_modules())
    offending = {}
    for path in files_of(layer):
        bad = {name for name in imports_of(path, known) if is_forbidden(layer, name)}
        if bad:
            offending[str(path.relative_to(PACKAGE))] = sorted(bad)
    assert offending == {}


def test_the_rule_tells_lightning_from_our_own_packages():
    assert is_forbidden("parallel", "lightning.pytorch") and is_forbidden("parallel", "lightning_fastdist.precision")
    assert not is_forbidden("parallel", "lightning_fastdist.parallel.plan.blocks") and not is_forbidden(
        "parallel", "torch"
    )
    assert is_forbidden("diagnostics", "lightning_fastdist.planning.advisor")
    assert not is_forbidden("planning", "lightning_fastdist.diagnostics.dataloader_audit")
    assert is_forbidden("callbacks", "lightning_fastdist.strategies.fsdp")
    assert not is_forbidden("strategies", "lightning_fastdist.diagnostics.recompiles")


def is_cli_module(module: str) -> bool:
    return module == CLI or module.startswith(CLI + ".")


def test_the_cli_is_one_package():
    """Every module of the command lives in ``cli/``, so the rule on ``lightning_fastdist.cli`` covers each one (the
    loose ``cli_*.py`` modules beside ``cli.py`` were outside it: ``recipes/recipe.py`` imported ``cli_errors``)."""
    assert (PACKAGE / "cli" / "__init__.py").is_file() and (PACKAGE / "cli" / "__main__.py").is_file()
    loose = sorted(path.name for path in PACKAGE.glob("cli*.py"))
    assert loose == []


def test_nothing_outside_the_cli_imports_it():
    known = frozenset(package_modules())
    offending = {}
    for module, path in package_modules().items():
        if not is_cli_module(module):
            bad = sorted(name for name in imports_of(path, known) if is_cli_module(name))
            if bad:
                offending[str(path.relative_to(PACKAGE))] = bad
    assert offending == {}


@pytest.mark.parametrize(
    "source",
    [
        "from lightning_fastdist.cli.errors import UsageError",  # what recipes/recipe.py imported, were it in cli/ then
        "import lightning_fastdist.cli.args",
        "from lightning_fastdist.cli import main",
        "from lightning_fastdist import cli",
        "from ..cli import report",
        "def f():\n    from lightning_fastdist.cli.config import MARKER",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_fastdist.cli.app import FastDistCLI",
    ],
)
def test_the_rule_catches_a_lower_layer_reaching_into_the_cli(source):
    found = imported_modules(source, "lightning_fastdist.recipes.recipe", frozenset(package_modules()))
    for layer in ("recipes", "planning", "commands", "strategies", "parallel"):
        assert any(is_forbidden(layer, name) for name in found), (layer, source, found)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (the module itself left out)."""
    modules = package_modules()
    known = frozenset(modules)
    return {
        module: {name for name in imports_of(path, known) if name in known and name != module}
        for module, path in modules.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of imports (``[a, b, ..., a]``, starting at the circle's first module by name): in each group of
    modules that import each other (Tarjan's strongly connected components of two or more modules), the shortest
    circle through each member, so that every module in a circle is named."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(module: str) -> None:  # recursion at most as deep as the package has modules (a few hundred)
        index[module] = lowest[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                lowest[module] = min(lowest[module], lowest[imported])
            elif imported in on_stack:
                lowest[module] = min(lowest[module], index[imported])
        if lowest[module] == index[module]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    found: list[list[str]] = []
    for group in groups:
        for member in sorted(group):
            circle = _circle_through(graph, group, member)[:-1]
            first = circle.index(min(circle))
            circle = [*circle[first:], *circle[:first], min(circle)]
            if circle not in found:
                found.append(circle)
    return sorted(found)


def _circle_through(graph: dict[str, set[str]], group: set[str], start: str) -> list[str]:
    """The shortest circle from ``start`` back to it, inside its group (breadth first)."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for imported in sorted(graph[module] & group):
            if imported == start:
                path = [module]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if imported not in came_from:
                came_from[imported] = module
                queue.append(imported)
    raise AssertionError(f"no circle through {sorted(group)}")


def test_no_import_circle():
    found = circles(import_graph())
    assert found == [], "import circles:\n" + "\n".join(" -> ".join(circle) for circle in found)


def test_the_circle_check_finds_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert circles(graph) == [["a", "b", "c", "a"], ["e", "e2", "e"]]
    two_ways = {"shared": {"ddp", "fsdp"}, "ddp": {"shared"}, "fsdp": {"shared"}}  # the circle the house issue names
    assert circles(two_ways) == [["ddp", "shared", "ddp"], ["fsdp", "shared", "fsdp"]]
    assert circles({"a": {"b"}, "b": set()}) == []
