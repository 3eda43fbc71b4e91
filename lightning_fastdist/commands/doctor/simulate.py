"""The ``--simulate`` part of ``lightning-fastdist doctor``: the table, the JSON, the choice and the tailored recipe.

The tracing itself is :mod:`lightning_fastdist.planning.simulate`. The choice is the
advisor's rule (:data:`~lightning_fastdist.planning.advisor.PREFERENCE`, fastest first)
applied to the simulated peaks; the recipe written is the user's own with its strategy,
devices and nodes replaced.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

from lightning_fastdist.commands.bench.setups import FAST_DEEPSPEED
from lightning_fastdist.commands.written_marks import json_written_by
from lightning_fastdist.planning.advisor import (
    PREFERENCE,
    SINGLE_DEVICE_PREFERENCE,
    describe_setup,
    strategy_section,
)
from lightning_fastdist.planning.memory_model import GiB, MemoryEstimate
from lightning_fastdist.planning.simulate import SimulatedSetup, Simulation, import_class

JSON_MARKER = {"written_by": "lightning-fastdist doctor --simulate"}
_PRECISION_PLUGIN = "lightning_fastdist.FastMixedPrecision"


class JsonNotOurs(Exception):
    """``--json`` names a folder or a file doctor did not write; the message says what to do."""


def check_json_is_ours(path: Path) -> None:
    """Refuse a ``--json`` path that is a folder, or a file without doctor's ``written_by`` key (it is kept)."""
    if path.is_dir():
        raise JsonNotOurs(f"--json: {path} is a folder; give a file path such as {path / 'simulation.json'}.")
    if path.exists() and json_written_by(path) != JSON_MARKER["written_by"]:
        raise JsonNotOurs(
            f"--json: {path} exists and was not written by doctor --simulate, so it is kept; give another --json path."
        )


def choose(simulation: Simulation, usable_bytes: int) -> tuple[SimulatedSetup, bool]:
    """The fastest simulated setup whose peak fits (the advisor's order), else the most frugal; and whether it fits."""
    rows = {(row.setup, row.activation_checkpointing, row.cpu_offload): row for row in simulation.rows}
    preference = SINGLE_DEVICE_PREFERENCE if simulation.world_size == 1 else PREFERENCE
    candidates = [rows[key] for key in preference if key in rows]
    for row in candidates:
        if row.memory.peak <= usable_bytes:
            return row, True
    return (candidates[-1] if candidates else min(simulation.rows, key=lambda r: r.memory.peak)), False


def format_simulation(simulation: Simulation, precision: str, usable_bytes: int, memory_bytes: int) -> str:
    """The terminal table: per rank, in GiB, the same numbers as the JSON."""
    lines = [
        f"Simulated per rank: world {simulation.world_size} ({simulation.gpus_per_node} per node), "
        f"{simulation.parameters:,} parameters, {precision}, one training step of the recipe's own model and batch; "
        f"fits = peak <= {usable_bytes / GiB:.2f} GiB usable of {memory_bytes / GiB:.2f} GiB",
        f"  {'setup':9} {'checkpoint':10} {'offload':7} {'params':>9} {'grads':>9} {'optimizer':>9} {'gathered':>9} "
        f"{'activations':>11} {'peak':>9}  fits {'sent/step':>9}  method",
    ]
    for row in simulation.rows:
        m = row.memory
        cells = (m.params, m.grads, m.optimizer, m.gathered_peak)
        lines.append(
            f"  {row.setup:9} {row.activation_checkpointing:10} {'yes' if row.cpu_offload else 'no':7} "
            + " ".join(f"{value / GiB:8.3f}G" for value in cells)
            + f" {m.activations_peak / GiB:10.3f}G {m.peak / GiB:8.3f}G  {'yes' if m.peak <= usable_bytes else 'NO':4} "
            f"{row.comm_bytes_per_step / GiB:8.3f}G  {row.method}"
        )
    for setup, checkpointing, reason in simulation.not_traced:
        lines.append(f"  {setup:9} {checkpointing:10} not traced, and would fail in training too: {reason}")
    return "\n".join(lines)


def simulation_json(simulation: Simulation, usable_bytes: int, memory_bytes: int, chosen: SimulatedSetup) -> dict:
    """The ``--json`` document (bytes as integers)."""
    return {
        **JSON_MARKER,
        "world_size": simulation.world_size,
        "gpus_per_node": simulation.gpus_per_node,
        "parameters": simulation.parameters,
        "gpu_memory_bytes": memory_bytes,
        "usable_bytes": usable_bytes,
        "setups": [row.as_json(usable_bytes) for row in simulation.rows],
        "not_traced": [
            {"setup": setup, "activation_checkpointing": checkpointing, "reason": reason}
            for setup, checkpointing, reason in simulation.not_traced
        ],
        "recommendation": {
            "setup": chosen.setup,
            "activation_checkpointing": chosen.activation_checkpointing,
            "cpu_offload": chosen.cpu_offload,
        },
    }


def _as_estimate(row: SimulatedSetup) -> MemoryEstimate:
    m = row.memory
    return MemoryEstimate(
        mode=row.setup,
        activation_checkpointing=row.activation_checkpointing,
        cpu_offload=row.cpu_offload,
        weights=m.params,
        gradients=m.grads,
        optimizer=m.optimizer,
        gathered_weights=m.gathered_peak,
        activations=m.activations_peak,
        host_bytes=0,
    )


def _accepted_options(class_path: str) -> set[str]:
    return set(inspect.signature(import_class(class_path)).parameters)


def replace_strategy(config: dict, strategy: dict, precision: str) -> dict:
    """A copy of the recipe ``config`` training with ``strategy`` (a ``class_path``/``init_args`` entry): the user's
    other strategy options kept where the new class takes them (``blocks``, ``timeout``, ...), and a DeepSpeed
    strategy given ``trainer.precision`` in place of the precision plugin (DeepSpeed runs 16-bit itself)."""
    recipe = copy.deepcopy(config)
    trainer = recipe.setdefault("trainer", {})
    strategy = copy.deepcopy(strategy)
    previous = trainer.get("strategy")
    previous_options = (previous.get("init_args") or {}) if isinstance(previous, dict) else {}
    accepted = _accepted_options(strategy["class_path"])
    init_args = strategy.setdefault("init_args", {})
    for option, value in previous_options.items():
        if option in accepted and option not in init_args:
            init_args[option] = value
    trainer["strategy"] = strategy
    if strategy["class_path"] == FAST_DEEPSPEED:
        plugins = trainer.get("plugins") or []
        kept = [p for p in plugins if not (isinstance(p, dict) and p.get("class_path") == _PRECISION_PLUGIN)]
        trainer.pop("plugins", None)
        if kept:
            trainer["plugins"] = kept
        trainer["precision"] = precision
    return recipe


def tailored_recipe(config: dict, chosen: SimulatedSetup, gpus_per_node: int, nodes: int, precision: str) -> dict:
    """The user's recipe with the chosen strategy (see :func:`replace_strategy`), its devices and nodes."""
    recipe = replace_strategy(config, strategy_section(_as_estimate(chosen)), precision)
    recipe["trainer"].update(devices=gpus_per_node, num_nodes=nodes)
    return recipe


def recipe_comments(chosen: SimulatedSetup, fits: bool, usable_bytes: int, world_size: int) -> list[str]:
    """The comment lines under the recipe's first line: what was chosen, and why."""
    reason = "the fastest setup whose simulated peak fits" if fits else "nothing fits; the most frugal setup"
    verdict = "" if fits else " -- DOES NOT FIT"
    return [
        f"# Simulated at world {world_size}: {describe_setup_of(chosen)}, {reason}: "
        f"peak {chosen.memory.peak / GiB:.3f} GiB per rank (usable {usable_bytes / GiB:.2f} GiB){verdict}.",
        "# Run: lightning-fastdist fit --config THIS_FILE",
    ]


def describe_setup_of(row: SimulatedSetup) -> str:
    """The row's configuration in words, e.g. ``FSDP ZeRO-3 + full activation checkpointing``."""
    return describe_setup(row.setup, row.activation_checkpointing, row.cpu_offload)
