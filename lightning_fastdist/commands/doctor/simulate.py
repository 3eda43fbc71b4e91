"""The ``--simulate`` part of ``lightning-fastdist doctor``: the table, the JSON, the choice and the tailored recipe.

The tracing is :mod:`lightning_fastdist.planning.simulation`; the choice is the advisor's order (fastest first) applied
to the simulated peaks; the recipe written is the user's own with its strategy, devices and nodes replaced.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_fastdist.parallel.across_nodes.replica_groups.settings import ReplicaGroups
from lightning_fastdist.planning.advisor import PREFERENCE, SINGLE_DEVICE_PREFERENCE, describe_setup, recipe_strategy
from lightning_fastdist.planning.memory_model import GiB
from lightning_fastdist.planning.setup import Setup
from lightning_fastdist.planning.simulation.result import SimulatedSetup, Simulation
from lightning_fastdist.recipes.recipe import Recipe

JSON_MARKER = {"written_by": "lightning-fastdist doctor --simulate"}
# What the outer_sync rows on top of each setup stand for, printed under the table when it lists them.
OUTER_SYNC_NOTES = {
    "ddp": (
        "  ddp-diloco, ddp-streaming-diloco (outer_sync, never recommended: it changes what is computed): each node's "
        "local rank 0, the ddp row plus torchft's state: the outer momentum in optimizer, a fragment's pseudo-gradient "
        'in peak, the global copy on the host; the node\'s other ranks are the ddp row (docs/outer-sync.md, "Memory")'
    ),
    "zero3": (
        "  fsdp-zero3-diloco, fsdp-zero3-streaming-diloco (outer_sync, never recommended): every rank, zero3 sharded "
        "over one node's ranks (not the world's) plus torchft's state of its shard (rank 0's, the largest): the outer "
        "momentum in optimizer, a fragment's pseudo-gradient in peak, the global copy on the host"
    ),
}


def choose(simulation: Simulation, usable_bytes: int) -> tuple[SimulatedSetup, bool]:
    """The fastest simulated setup whose peak fits (the advisor's order), else the most frugal; and whether it fits.

    Never an ``outer_sync`` row: it changes what is computed, so a user names it (docs/outer-sync.md)."""
    exact = [row for row in simulation.rows if row.outer_sync is None]
    rows = {row.plan_key: row for row in exact}
    preference = SINGLE_DEVICE_PREFERENCE if simulation.world_size == 1 else PREFERENCE
    candidates = [rows[key] for key in preference if key in rows]
    for row in candidates:
        if row.memory.peak <= usable_bytes:
            return row, True
    return (candidates[-1] if candidates else min(exact, key=lambda r: r.memory.peak)), False


def format_simulation(simulation: Simulation, precision: str, usable_bytes: int, memory_bytes: int) -> str:
    """The terminal table: per rank, in GiB, the same numbers as the JSON."""
    width = max(9, *(len(row.name) for row in simulation.rows), *(len(setup) for setup, _, _ in simulation.not_traced))
    lines = [
        f"Simulated per rank: world {simulation.world_size} ({simulation.gpus_per_node} per node), "
        f"{simulation.parameters:,} parameters, {precision}, one training step of the recipe's own model and batch; "
        f"fits = peak <= {usable_bytes / GiB:.2f} GiB usable of {memory_bytes / GiB:.2f} GiB",
        f"  {'setup':{width}} {'checkpoint':10} {'offload':7} {'params':>9} {'grads':>9} {'optimizer':>9} "
        f"{'gathered':>9} {'activations':>11} {'peak':>9}  fits {'sent/step':>9}  method",
    ]
    for row in simulation.rows:
        m = row.memory
        cells = (m.params, m.grads, m.optimizer, m.gathered_peak)
        host = f", {row.outer_memory.global_copy / GiB:.3f}G on the host" if row.outer_memory is not None else ""
        lines.append(
            f"  {row.name:{width}} {row.activation_checkpointing:10} {'yes' if row.cpu_offload else 'no':7} "
            + " ".join(f"{value / GiB:8.3f}G" for value in cells)
            + f" {m.activations_peak / GiB:10.3f}G {m.peak / GiB:8.3f}G  {'yes' if m.peak <= usable_bytes else 'NO':4} "
            f"{row.comm_bytes_per_step / GiB:8.3f}G  {row.method}{host}"
        )
    for setup, checkpointing, reason in simulation.not_traced:
        lines.append(f"  {setup:{width}} {checkpointing:10} not traced, and would fail in training too: {reason}")
    if simulation.replica_groups is not None:
        lines.append(
            f"  replica_groups (the recipe's): each of the {simulation.world_size // simulation.gpus_per_node} nodes a "
            f"torchft replica group; FSDP shards over one node's {simulation.gpus_per_node} ranks; grads and peak hold "
            "each rank's kept copy of its gradients; sent/step adds its gradients all-reduced across the nodes"
        )
    outer_setups = {row.setup for row in simulation.rows if row.outer_sync is not None}
    lines += [note for setup, note in OUTER_SYNC_NOTES.items() if setup in outer_setups]
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
        "replica_groups": simulation.replica_groups,
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


def tailored_recipe(recipe: Recipe, chosen: SimulatedSetup, gpus_per_node: int, nodes: int) -> dict:
    """The user's recipe with the chosen strategy, devices and nodes; the recipe's ``replica_groups`` kept."""
    replica_groups = ReplicaGroups.of(recipe.strategy_options.get("replica_groups"))
    setup = replace(Setup.from_plan_key(*chosen.plan_key), replica_groups=replica_groups)
    tailored = recipe.with_strategy(recipe_strategy(setup))
    tailored["trainer"].update(devices=gpus_per_node, num_nodes=nodes)
    return tailored


def recipe_comments(chosen: SimulatedSetup, fits: bool, usable_bytes: int, world_size: int) -> list[str]:
    """The comment lines under the recipe's first line: what was chosen, and why."""
    reason = "the fastest setup whose simulated peak fits" if fits else "nothing fits; the most frugal setup"
    verdict = "" if fits else " -- DOES NOT FIT"
    return [
        f"# Simulated at world {world_size}: {describe_setup_of(chosen)}, {reason}: "
        f"peak {chosen.memory.peak / GiB:.3f} GiB per rank (usable {usable_bytes / GiB:.2f} GiB){verdict}."
    ]


def describe_setup_of(row: SimulatedSetup) -> str:
    """The row's configuration in words, e.g. ``FSDP ZeRO-3 + full activation checkpointing``."""
    return describe_setup(*row.plan_key)
