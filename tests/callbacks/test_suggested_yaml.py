"""Every piece of recipe YAML that ``doctor`` and ``BottleneckReport`` can suggest is accepted by the real CLI.

The suggestions name options as strings; a renamed or removed option would break them silently. Each one
is merged into the CPU smoke recipe, parsed by ``lightning-fastdist``'s own LightningCLI parser (unknown
keys and values outside a ``Literal`` fail there), its classes are built (our constructors check the rest)
and a Trainer is built from them (strategies check themselves against the devices there).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import yaml
from lightning.pytorch import Trainer

from lightning_fastdist.cli import FastDistCLI
from lightning_fastdist.diagnostics import bottleneck_checks as checks
from lightning_fastdist.planning.advisor import strategy_section
from lightning_fastdist.planning.memory_model import MODES, MemoryEstimate
from lightning_fastdist.recipes import recipes_dir

SIMULATED_ONLY_MODES = ("hsdp",)  # doctor --simulate's extra setup


class ParseOnlyCLI(FastDistCLI):
    """The CLI's parser, built as ``lightning-fastdist`` builds it, without building anything at start."""

    def instantiate_classes(self) -> None:
        pass


def strategy_suggestions() -> dict[str, dict]:
    """``trainer.strategy`` as the advisor writes it (doctor's recipes, and --simulate's), for every setup."""
    suggestions = {}
    for mode, checkpointing, offload in itertools.product(
        (*MODES, *SIMULATED_ONLY_MODES), ("none", "selective"), (False, True)
    ):
        estimate = MemoryEstimate(mode, checkpointing, offload, 0, 0, 0, 0, 0, 0)
        suggestions[f"{mode}/{checkpointing}/offload={offload}"] = {"trainer": {"strategy": strategy_section(estimate)}}
    return suggestions


def bottleneck_fixes() -> dict[str, dict]:
    """Each check's fix, from measurements that make it warn."""
    rows = [
        checks.check_data_wait(0.5, 0.1, suggested_workers=4),
        checks.check_buckets(2**10, 2**24),
        checks.check_comm_rounds(8, optimizer_steps=2),
        checks.check_comm_time(1.0, 1.0, sharded=True),
        checks.check_comm_time(1.0, 1.0, sharded=False),
        checks.check_optimizer_time(0.5, 1.0),
        checks.check_memory(99, 100, "cuda"),
        checks.check_recompiles(3),
        checks.check_precision("32-true", bf16_available=True, device_type="cpu"),
    ]
    assert all(row.status == "WARN" and row.fix for row in rows)
    return {f"{row.check} #{i}": yaml.safe_load(row.fix) for i, row in enumerate(rows)}


SUGGESTIONS = {**strategy_suggestions(), **bottleneck_fixes()}


def merged(base: dict, change: dict) -> dict:
    """``base`` with ``change`` written over it, as a user pastes a snippet into a recipe.

    Mappings merge key by key; a strategy of another class replaces the recipe's one whole.
    """
    result = copy.deepcopy(base)
    for key, value in change.items():
        old = result.get(key)
        other_class = (
            key == "strategy"
            and isinstance(old, dict)
            and value.get("class_path", old["class_path"]) != old["class_path"]
        )
        if isinstance(value, dict) and isinstance(old, dict) and not other_class:
            result[key] = merged(old, value)
        else:
            result[key] = copy.deepcopy(value)
    return result


@pytest.fixture(scope="module")
def parser():
    base = str(recipes_dir() / "cpu_smoke.yaml")
    return ParseOnlyCLI(args=["--config", base], run=False).parser


@pytest.mark.parametrize("name", SUGGESTIONS)
def test_the_suggestion_is_accepted_by_the_cli_and_builds_a_trainer(name, parser, tmp_path):
    recipe = merged(yaml.safe_load((recipes_dir() / "cpu_smoke.yaml").read_text()), SUGGESTIONS[name])
    path = tmp_path / "suggested.yaml"
    path.write_text(yaml.safe_dump(recipe))
    config = parser.parse_args(["--config", str(path)])
    built = parser.instantiate_classes(config)
    trainer = Trainer(**vars(built.trainer))
    strategy = SUGGESTIONS[name]["trainer"].get("strategy", {})
    assert (
        type(trainer.strategy).__name__
        == strategy.get("class_path", "lightning_fastdist.FastDDPStrategy").split(".")[-1]
    )
