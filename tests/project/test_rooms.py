"""The rest of the house's numbers, read from the tree: folders by concern in ``parallel/`` (at most 2 modules loose
beside them), no command module above 300 lines (a command split by job, as ``doctor`` and ``bench`` are), and no more
``type: ignore`` than the 4 the house issue counted (each a deliberate one, with its reason)."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_fastdist"


def test_parallel_keeps_its_modules_in_folders_by_concern():
    loose = sorted(path.name for path in (PACKAGE / "parallel").glob("*.py") if path.name != "__init__.py")
    assert len(loose) <= 2, loose


def test_no_command_module_is_above_300_lines():
    lines = {
        str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.glob("commands/**/*.py")
    }
    assert {name: count for name, count in lines.items() if count > 300} == {}


def test_no_more_type_ignores_than_the_four_counted():
    found = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in PACKAGE.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if "type: ignore" in line
    ]
    assert len(found) <= 4, found


def test_the_paths_docs_named_before_the_rooms_still_import():
    from lightning_fastdist.parallel.fp8 import layer_verdicts as old_verdicts
    from lightning_fastdist.strategies.deepspeed_checkpoint import consolidate_checkpoint as old_consolidate

    from lightning_fastdist.parallel.precision.fp8 import layer_verdicts
    from lightning_fastdist.strategies.deepspeed import consolidate_checkpoint

    assert old_verdicts is layer_verdicts and old_consolidate is consolidate_checkpoint
