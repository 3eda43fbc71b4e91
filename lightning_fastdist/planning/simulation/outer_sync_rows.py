"""The ``outer_sync`` rows: the ``ddp`` and one-node ``zero3`` steps again with DiLoCo across the nodes, for each form
bench compares (the recipe's own options in place of the form they take), on a rank that holds torchft's state.

Nothing more is traced: torchft's state is derived from the fragments the strategy would split the model into
(:mod:`~lightning_fastdist.planning.outer_sync_memory`), and its traffic from what crosses the link per step.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lightning_fastdist.parallel.across_nodes.outer_sync.fragments import split_into_fragments
from lightning_fastdist.parallel.across_nodes.outer_sync.settings import (
    OUTER_SYNC_FORMS,
    OuterSync,
    OuterSyncForm,
    form_of,
)
from lightning_fastdist.parallel.plan.blocks import outermost_block_modules, resolve_blocks
from lightning_fastdist.planning.comm_model import comm_per_step, outer_sync_sent_per_step
from lightning_fastdist.planning.fsdp_shards import shard_numels
from lightning_fastdist.planning.outer_sync_memory import outer_sync_memory
from lightning_fastdist.planning.simulation.recipe_run import NotTraceable, RecipeRun, build_model
from lightning_fastdist.planning.simulation.result import SimulatedSetup, outer_sync_name
from lightning_fastdist.planning.simulation.trace import TRUE_DTYPES
from lightning_fastdist.planning.step_memory import StepMemory

OUTER_SYNC_MODES = ("ddp", "zero3")  # the setups bench compares outer_sync on (zero3 sharded inside each node)


def outer_sync_rows(
    run: RecipeRun,
    bases: dict[str, dict[str, StepMemory | str]],
    parameters: int,
    root_parameters: int,
    gpus_per_node: int,
    nodes: int,
) -> tuple[list[SimulatedSetup], list[tuple[str, str, str]]]:
    """The ``ddp`` and one-node ``zero3`` steps of ``bases`` (by mode, then checkpointing: the step, or why it did not
    trace) again with DiLoCo across the nodes, for each ``outer_sync`` form, on a rank that holds torchft's state
    (FSDP's rank 0, whose shards are the largest). ``not_traced`` entries: each form whose ``fragments`` the model's
    blocks cannot take, and each step that did not trace."""
    module = build_model(run, fake=True)  # on the meta device: its fragments, as the strategy splits them
    blocks = outermost_block_modules(module, resolve_blocks(module, run.blocks))
    dtype = TRUE_DTYPES.get(run.precision, torch.float32)
    derived: list[SimulatedSetup] = []
    refused: list[tuple[str, str, str]] = []
    for mode, steps in bases.items():
        ranks = gpus_per_node if mode == "zero3" else 1  # the ranks a fragment is split over
        inner = comm_per_step(mode, gpus_per_node, parameters, root_parameters, run.precision, run.accumulation)
        for settings in _outer_sync_settings(run):
            name = outer_sync_name(mode, settings)
            try:
                fragments = split_into_fragments(module, blocks, settings.fragments)
            except ValueError as error:
                refused += [(name, checkpointing, str(error)) for checkpointing in steps]
                continue
            held = shard_numels(fragments, ranks, 0)
            memory = outer_sync_memory(settings, held, dtype)
            sent = inner.sent_per_device + outer_sync_sent_per_step(settings, sum(held), nodes)
            for checkpointing, step in steps.items():
                if isinstance(step, str):
                    refused.append((name, checkpointing, step))
                    continue
                on_rank = replace(step, optimizer=step.optimizer + memory.outer_momentum, peak=memory.device_peak(step))
                derived.append(SimulatedSetup(mode, checkpointing, False, on_rank, sent, "derived", settings, memory))
    return derived, refused


def _outer_sync_settings(run: RecipeRun) -> list[OuterSync]:
    """The ``outer_sync`` forms bench compares, the recipe's own options in place of the form they take."""
    forms: dict[OuterSyncForm, OuterSync] = {form: OuterSync(**options) for form, options in OUTER_SYNC_FORMS.items()}
    if run.outer_sync is not None:
        try:
            own = OuterSync.of(run.outer_sync)
        except ValueError as error:
            raise NotTraceable(f"the recipe's outer_sync: {error}") from None
        forms[form_of(own)] = own
    return list(forms.values())
