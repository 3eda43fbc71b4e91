"""Each engine's rows from its traced steps: DDP and FSDP2 as traced, with the bytes they send; DeepSpeed's three
stages from one trace of its activations around the formula's state (its engine cannot run on fake tensors); and the
offload setups the advisor may pick, derived from traced rows (what offload moves lives on the host)."""

from __future__ import annotations

from dataclasses import replace

from lightning_fastdist.planning.comm_model import comm_per_step
from lightning_fastdist.planning.memory_model import DEEPSPEED_MODES, deepspeed_activation_precision, deepspeed_state
from lightning_fastdist.planning.setup import Setup
from lightning_fastdist.planning.simulation.recipe_run import RecipeRun
from lightning_fastdist.planning.simulation.result import SimulatedSetup
from lightning_fastdist.planning.simulation.trace import TracedStep
from lightning_fastdist.planning.simulation.workers import TraceTask
from lightning_fastdist.planning.step_memory import StepMemory

TRACED_MODES = ("ddp", "zero2", "zero3", "hsdp")  # traced as their strategies train them (hsdp only across nodes)


def deepspeed_task(run: RecipeRun, checkpointing: str) -> TraceTask:
    """The one trace behind DeepSpeed's rows: its activations, the same at every stage, in DeepSpeed's dtype (traced
    as its first stage)."""
    setup = Setup.from_plan_key(DEEPSPEED_MODES[0], checkpointing, False)
    return TraceTask(setup, precision=deepspeed_activation_precision(run.precision))


def engine_rows(
    run: RecipeRun, setup: Setup, traced: TracedStep, world_size: int, gpus_per_node: int
) -> list[SimulatedSetup]:
    """The rows of ``setup``'s traced step: DeepSpeed's three stages, else the setup itself with what it sends."""
    if setup.engine == "DeepSpeed":
        return _deepspeed_rows(run, traced, setup.activation_checkpointing, world_size)
    comm = comm_per_step(
        setup.mode, world_size, traced.parameters, traced.root_parameters, run.precision, run.accumulation,
        shard_group=gpus_per_node if setup.mode == "hsdp" else None,
    )  # fmt: skip
    return [SimulatedSetup(setup.mode, setup.activation_checkpointing, False, traced.memory, comm.sent_per_device)]


def untraced(setup: Setup, reason: str) -> list[tuple[str, str, str]]:
    """``(setup, checkpointing, reason)`` of each row a failed trace stood for (DeepSpeed's: every stage)."""
    modes = DEEPSPEED_MODES if setup.engine == "DeepSpeed" else (setup.mode,)
    return [(mode, setup.activation_checkpointing, reason) for mode in modes]


def _deepspeed_rows(run: RecipeRun, traced: TracedStep, checkpointing: str, world_size: int) -> list[SimulatedSetup]:
    """DeepSpeed's stages: the formula's state around activations traced in DeepSpeed's dtype."""
    rows = []
    for mode in DEEPSPEED_MODES:
        state = deepspeed_state(traced.parameters, world_size, run.precision, int(mode[-1]), cpu_offload=False)
        parts = (state.weights, state.gradients, state.optimizer, state.gathered_weights)
        activations = traced.memory.activations_peak
        memory = StepMemory(*parts, activations_peak=activations, peak=sum(parts) + activations)
        comm = comm_per_step(
            mode, world_size, traced.parameters, traced.root_parameters, run.precision, run.accumulation
        )
        method = "formula state, traced activations"
        rows.append(SimulatedSetup(mode, checkpointing, False, memory, comm.sent_per_device, method))
    return rows


def offload_rows(rows: list[SimulatedSetup]) -> list[SimulatedSetup]:
    """The advisor's offload setups, derived from traced rows."""
    derived = []
    for row in rows:
        m = row.memory
        if row.setup == "zero3" and row.activation_checkpointing == "full":
            # FSDP's offload keeps the sharded parameters, gradients and optimizer state on the host.
            on_device = replace(m, params=0, grads=0, optimizer=0, peak=m.peak - m.state)
            derived.append(replace(row, cpu_offload=True, memory=on_device, method="derived"))
        if row.setup == "ds-zero2" and row.activation_checkpointing in ("none", "full"):
            # ZeRO-Offload: the optimizer state (and its step) on the host, weights and gradients stay.
            on_device = replace(m, optimizer=0, peak=m.peak - m.optimizer)
            derived.append(replace(row, cpu_offload=True, memory=on_device, method="derived"))
    return derived
