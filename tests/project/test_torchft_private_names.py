"""Every private torchft name the package reads is in the list (``parallel/across_nodes/torchft_names.py``) with the
modules that read it, and exists in the installed torchft: an upgrade that moves one fails here, and before any
process starts, in one line.

Read from the source (AST). torchft's objects live in ``parallel/across_nodes/`` only (the first test holds that), so
the scan reads those modules: an attribute ``x._name`` on another object than ``self`` counts where torchft's source
defines a ``_name`` (its Rust client's by having it).
"""

from __future__ import annotations

import ast
import importlib
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest
import torchft

from lightning_fastdist.parallel.across_nodes import torchft_names
from lightning_fastdist.parallel.across_nodes.torchft_names import (
    PRIVATE_ATTRIBUTES,
    TESTED_TORCHFT,
    PrivateName,
    installed_torchft,
    missing_torchft_names,
    require_torchft_names,
    torchft_version,
)

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_fastdist"
ACROSS_NODES = PACKAGE / "parallel" / "across_nodes"


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@cache
def torchfts_private_names() -> frozenset[str]:
    """The private names torchft's Python source defines, and those its compiled classes have."""
    names: set[str] = set()
    for path in Path(torchft.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    compiled = importlib.import_module("torchft._torchft")
    for value in vars(compiled).values():
        if isinstance(value, type):
            names |= set(dir(value))
    return frozenset(name for name in names if is_private(name))


def private_attributes_read(tree: ast.Module) -> set[str]:
    """The private attributes a source reads, sets or calls on objects other than ``self``/``cls``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.add(node.attr)
    return found


def torchft_uses() -> dict[str, set[str]]:
    """Each private torchft name the package reads, and the modules (relative to the package) that read it."""
    used: dict[str, set[str]] = defaultdict(set)
    for path in sorted(ACROSS_NODES.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for name in private_attributes_read(ast.parse(path.read_text())) & torchfts_private_names():
            used[name].add(module)
    return used


def test_torchft_is_imported_in_parallel_across_nodes_only():
    importers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if any(name.split(".")[0] == "torchft" for name in names):
                importers.add(path.relative_to(PACKAGE).parts[:2])
    assert importers == {("parallel", "across_nodes")}


def test_every_private_torchft_name_the_package_reads_is_listed_with_where_it_is_read():
    found = torchft_uses()
    listed: dict[str, set[str]] = defaultdict(set)
    for dotted, use in PRIVATE_ATTRIBUTES.items():
        listed[dotted.rsplit(".", 1)[1]].update(use.used_in)
    assert {name: sorted(modules) for name, modules in found.items() if name not in listed} == {}, (
        "add these to lightning_fastdist/parallel/across_nodes/torchft_names.py"
    )
    moved = {name: (sorted(found.get(name, ())), sorted(modules)) for name, modules in listed.items()}
    assert {name: uses for name, uses in moved.items() if uses[0] != uses[1]} == {}, "(read in, listed as read in)"


def test_every_listed_name_exists_in_the_installed_torchft_and_a_moved_one_is_refused_in_one_line(monkeypatch):
    assert missing_torchft_names() == []
    low, high = TESTED_TORCHFT
    assert low <= torchft_version() < high  # the version the names were read from
    moved = {"torchft.manager.Manager._gone": PrivateName(("parallel.across_nodes.group",), "show the check works")}
    monkeypatch.setattr(torchft_names, "PRIVATE_ATTRIBUTES", {**PRIVATE_ATTRIBUTES, **moved})
    line = (
        f"torchft.manager.Manager._gone (used in parallel.across_nodes.group to show the check works) is not in "
        f"torchft {torchft_version()}"
    )
    assert missing_torchft_names() == [line]
    installed_torchft.cache_clear()
    with pytest.raises(RuntimeError, match=r"^outer_sync needs torchft internals that this torchft .* does not have"):
        require_torchft_names("outer_sync")
    installed_torchft.cache_clear()


def test_the_scan_reads_names_on_other_objects_only():
    tree = ast.parse("self._fragments = []\nself.diloco._fragments[0]\nmanager._client = wrap(manager._client)\n")
    assert private_attributes_read(tree) == {"_fragments", "_client"}
