"""The simulation of a recipe with ``replica_groups``: each node a torchft replica group, so only the setups whose
strategies take the option (``Setup.takes_replica_groups``), FSDP sharded over one node's ranks.

Each rank keeps a flat copy of its gradients from one step to the next, added to its gradients and its peak; it sends
its setup's traffic inside the node plus its gradients (its shard's under FSDP) all-reduced on a ring of the nodes
(the one mark per parameter left out).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lightning_fastdist.planning.comm_model import CommEstimate, comm_per_step
from lightning_fastdist.planning.setup import Setup
from lightning_fastdist.planning.simulation.engine_rows import TRACED_MODES, offload_rows
from lightning_fastdist.planning.simulation.recipe_run import NotTraceable, RecipeRun
from lightning_fastdist.planning.simulation.result import SimulatedSetup, Simulation, nothing_traced
from lightning_fastdist.planning.simulation.workers import TraceTask, run_tasks


def replica_groups_simulation(
    run: RecipeRun,
    batch: Any,
    world_size: int,
    gpus_per_node: int,
    checkpointing: tuple[str, ...],
    processes: int,
) -> Simulation:
    """Every setup that takes ``replica_groups`` at each checkpointing mode, under the recipe's option."""
    nodes = world_size // gpus_per_node
    if nodes < 2:
        raise NotTraceable(f"replica_groups needs 2 or more nodes; world {world_size} is one node of {gpus_per_node}")
    setups = [Setup.from_plan_key(mode, ac, False) for ac in checkpointing for mode in TRACED_MODES]
    tasks = [
        TraceTask(setup, ranks=None if setup.engine == "DDP" else gpus_per_node)
        for setup in setups
        if setup.takes_replica_groups
    ]
    rows: list[SimulatedSetup] = []
    not_traced: list[tuple[str, str, str]] = []
    parameters = 0
    for task, result in zip(tasks, run_tasks(run, batch, tasks, world_size, gpus_per_node, processes)):
        setup = task.setup
        if isinstance(result, str):
            not_traced.append((setup.mode, setup.activation_checkpointing, result))
            continue
        parameters, traced = result.parameters, result.memory
        memory = replace(traced, grads=2 * traced.grads, peak=traced.peak + traced.grads)
        inside = comm_per_step(
            setup.mode, gpus_per_node, result.parameters, result.root_parameters, run.precision, run.accumulation
        )
        sent = inside.sent_per_device + CommEstimate("ddp", nodes, allreduce=traced.grads).sent_per_device
        method = "traced + kept gradient copy"
        rows.append(SimulatedSetup(setup.mode, setup.activation_checkpointing, False, memory, sent, method))
    if not rows:
        raise nothing_traced(not_traced)
    return Simulation(world_size, gpus_per_node, parameters, rows + offload_rows(rows), not_traced, run.replica_groups)
