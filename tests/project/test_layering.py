"""The package's import graph is the layering ``docs/architecture.md`` draws: cli -> commands -> strategies, callbacks,
precision -> trainer -> planning -> diagnostics -> parallel -> torch. Read from the source, so a lazy import inside a
function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_fastdist"
ABOVE_STRATEGIES = ("lightning_fastdist.commands", "lightning_fastdist.cli")
ABOVE_TRAINER = (*ABOVE_STRATEGIES, "lightning_fastdist.strategies", "lightning_fastdist.callbacks")
ABOVE_PLANNING = (*ABOVE_TRAINER, "lightning_fastdist.trainer", "lightning_fastdist.precision")
# What each layer may not import: the layers above it (and, for parallel/, Lightning and everything of ours outside it).
FORBIDDEN = {
    "parallel": ("lightning", "pytorch_lightning", "lightning_fastdist"),
    "diagnostics": (*ABOVE_PLANNING, "lightning_fastdist.planning"),
    "planning": ABOVE_PLANNING,
    "recipes": (*ABOVE_PLANNING, "lightning_fastdist.planning"),  # the recipe reader under planning/simulate.py
    "trainer": ABOVE_TRAINER,
    "strategies": ABOVE_STRATEGIES,
    "callbacks": (*ABOVE_STRATEGIES, "lightning_fastdist.strategies"),
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
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        bad = {name for name in imported_modules(path) if is_forbidden(layer, name)}
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
