"""``doctor --simulate``'s entry point: which steps to trace for a world of N ranks, and the rows made of them.

One world: every setup at each checkpointing mode (``hsdp`` where the world spans nodes), DeepSpeed traced once per
mode for its three stages, then the offload rows and, across nodes, the ``outer_sync`` rows on top of ``ddp`` and of
``zero3`` traced again over one node's ranks. A recipe with ``replica_groups`` is simulated under that option alone
(:mod:`.replica_groups_rows`). What each row stands for: docs/doctor.md, "--simulate".
"""

from __future__ import annotations

import os

from lightning_fastdist.parallel.plan.activation_checkpointing import ACTIVATION_CHECKPOINTING_MODES
from lightning_fastdist.planning.setup import Setup
from lightning_fastdist.planning.simulation.engine_rows import (
    TRACED_MODES,
    deepspeed_task,
    engine_rows,
    offload_rows,
    untraced,
)
from lightning_fastdist.planning.simulation.outer_sync_rows import OUTER_SYNC_MODES, outer_sync_rows
from lightning_fastdist.planning.simulation.recipe_run import NotTraceable, RecipeRun, build_model, first_batch
from lightning_fastdist.planning.simulation.replica_groups_rows import replica_groups_simulation
from lightning_fastdist.planning.simulation.result import SimulatedSetup, Simulation, nothing_traced
from lightning_fastdist.planning.simulation.workers import TraceTask, run_tasks
from lightning_fastdist.planning.step_memory import StepMemory, tracing_unavailable

PARALLEL_FROM_PARAMETERS = 10**9


def simulate(
    run: RecipeRun,
    world_size: int,
    gpus_per_node: int,
    checkpointing: tuple[str, ...] = ACTIVATION_CHECKPOINTING_MODES,
    processes: int | None = None,
) -> Simulation:
    """Trace every setup at ``world_size`` ranks (``gpus_per_node`` per node), one row per setup and mode.

    Args:
        gpus_per_node: ``hsdp`` and the ``outer_sync`` rows are simulated when the world spans more than one node
            (``zero3`` traced again, sharded over one node's ranks as under ``outer_sync``). A recipe with
            ``replica_groups`` is simulated under that option alone.
        processes: this one and spawned workers (each a fake world of its own); ``None``: two (where the machine has
            two cores) from :data:`PARALLEL_FROM_PARAMETERS` on, where a trace takes seconds, else this one alone (a
            worker's start-up costs more than a small model's traces).

    Raises:
        NotTraceable: torch lacks the tools, the recipe's model or data cannot be built, or no setup traced.
    """
    missing = tracing_unavailable()
    if missing is not None:
        raise NotTraceable(missing)
    batch = first_batch(run.data)
    if processes is None:
        large = sum(p.numel() for p in build_model(run, fake=True).parameters()) >= PARALLEL_FROM_PARAMETERS
        processes = min(2, os.cpu_count() or 1) if large else 1
    if run.replica_groups is not None:
        return replica_groups_simulation(run, batch, world_size, gpus_per_node, checkpointing, processes)
    spans_nodes = world_size > gpus_per_node  # outer_sync synchronises across nodes, and refuses one
    modes = TRACED_MODES if spans_nodes else tuple(mode for mode in TRACED_MODES if mode != "hsdp")
    tasks = [TraceTask(Setup.from_plan_key(mode, ac, False)) for ac in checkpointing for mode in modes]
    tasks += [deepspeed_task(run, ac) for ac in checkpointing]
    if spans_nodes:  # FSDP under outer_sync: each node a world of its own, sharded over its ranks
        tasks += [TraceTask(Setup.from_plan_key("zero3", ac, False), ranks=gpus_per_node) for ac in checkpointing]
    results = run_tasks(run, batch, tasks, world_size, gpus_per_node, processes)
    rows: list[SimulatedSetup] = []
    not_traced: list[tuple[str, str, str]] = []
    outer_bases: dict[str, dict[str, StepMemory | str]] = {mode: {} for mode in OUTER_SYNC_MODES}  # by checkpointing
    parameters = root_parameters = 0
    for task, result in zip(tasks, results):
        setup = task.setup
        step = result if isinstance(result, str) else result.memory  # or why it did not trace
        if setup.engine == "DDP" or task.ranks is not None:  # a DDP rank holds the same in a world of any size
            outer_bases[setup.mode][setup.activation_checkpointing] = step
        if task.ranks is not None:  # only the base of the outer_sync rows
            continue
        if isinstance(result, str):
            not_traced += untraced(setup, result)
            continue
        parameters, root_parameters = result.parameters, result.root_parameters
        rows += engine_rows(run, setup, result, world_size, gpus_per_node)
    if not rows:
        raise nothing_traced(not_traced)
    outer_rows: list[SimulatedSetup] = []
    if spans_nodes:
        nodes = world_size // gpus_per_node
        outer_rows, refused = outer_sync_rows(run, outer_bases, parameters, root_parameters, gpus_per_node, nodes)
        not_traced += refused
    return Simulation(world_size, gpus_per_node, parameters, rows + offload_rows(rows) + outer_rows, not_traced)
