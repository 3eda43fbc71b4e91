"""The package's import graph is the layering DESIGN.md and docs describe: parallel/ (torch only) <- strategies/,
callbacks/, diagnostics/, precision <- cli and commands/. Read from the source, so a lazy import inside a function
counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_fastdist"
ABOVE_STRATEGIES = ("lightning_fastdist.commands", "lightning_fastdist.cli")
# What each layer may not import: the layers above it (and, for parallel/, Lightning and everything of ours outside it).
FORBIDDEN = {
    "parallel": ("lightning", "pytorch_lightning", "lightning_fastdist"),
    "strategies": ABOVE_STRATEGIES,
    "callbacks": (*ABOVE_STRATEGIES, "lightning_fastdist.strategies"),
    "diagnostics": (*ABOVE_STRATEGIES, "lightning_fastdist.strategies"),
}
OWN = {"parallel": "lightning_fastdist.parallel"}


def is_forbidden(layer: str, module: str) -> bool:
    """Whether ``module`` (a dotted name) is, or is inside, a package ``layer`` may not import."""

    def inside(package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return any(inside(package) for package in FORBIDDEN[layer]) and not (layer in OWN and inside(OWN[layer]))


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", FORBIDDEN)
def test_a_layer_imports_nothing_above_it(layer):
    offending = {}
    for path in sorted((PACKAGE / layer).glob("*.py")):
        bad = {name for name in imported_modules(path) if is_forbidden(layer, name)}
        if bad:
            offending[path.name] = sorted(bad)
    assert offending == {}


def test_the_rule_tells_lightning_from_our_own_packages():
    assert is_forbidden("parallel", "lightning.pytorch") and is_forbidden("parallel", "lightning_fastdist.precision")
    assert not is_forbidden("parallel", "lightning_fastdist.parallel.blocks") and not is_forbidden("parallel", "torch")
    assert is_forbidden("callbacks", "lightning_fastdist.strategies.fsdp")
    assert not is_forbidden("strategies", "lightning_fastdist.diagnostics.recompiles")
