"""What a simulation finds: one row per setup and checkpointing mode (one rank's bytes, what it sends per step, how
each number was found), the setups that did not trace and why, and the row's document in ``doctor``'s JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_fastdist.parallel.across_nodes.outer_sync.settings import OuterSync, form_of
from lightning_fastdist.planning.outer_sync_memory import OuterSyncMemory
from lightning_fastdist.planning.setup import Setup
from lightning_fastdist.planning.simulation.recipe_run import NotTraceable
from lightning_fastdist.planning.step_memory import StepMemory

# StepMemory's fields in the order the JSON's per_rank lists them (docs/doctor.md)
PER_RANK_JSON = ("params", "grads", "optimizer", "activations_peak", "peak", "gathered_peak")


def outer_sync_name(mode: str, settings: OuterSync) -> str:
    """Bench's name of the setup of ``mode`` (``ddp``, ``zero3``) with ``settings``' form of ``outer_sync``."""
    return replace(Setup.from_plan_key(mode, "none", False), outer_sync=form_of(settings)).name


@dataclass(frozen=True)
class SimulatedSetup:
    """One row of the simulation: a setup, its checkpointing, and one rank's bytes.

    Attributes:
        setup: the setup's ``Setup.mode``: ``ddp``, ``zero2``, ``zero3``, ``hsdp`` or ``ds-zero1/2/3``.
        activation_checkpointing: ``none``, ``full`` or ``selective``.
        memory: bytes per rank; under ``outer_sync``, of a rank that holds the outer state (on ``ddp`` each node's
            local rank 0; on ``zero3``, sharded over one node's ranks, a node's rank 0, whose shards are the largest).
        comm_bytes_per_step: bytes each rank sends per optimizer step on a ring.
        method: ``traced``, ``formula state, traced activations`` (DeepSpeed), ``derived`` (offload,
            ``outer_sync``) or ``traced + kept gradient copy`` (``replica_groups``).
        outer_sync: DiLoCo's options on top of ``ddp`` or ``zero3``; ``None``: every step is synchronous.
        outer_memory: what ``outer_sync`` adds (its device bytes are in ``memory`` already, its host bytes only here).
    """

    setup: str
    activation_checkpointing: str
    cpu_offload: bool
    memory: StepMemory
    comm_bytes_per_step: int
    method: str = "traced"
    outer_sync: OuterSync | None = None
    outer_memory: OuterSyncMemory | None = None

    @property
    def name(self) -> str:
        """:attr:`setup`, or under ``outer_sync`` bench's name (``ddp-diloco``, ``fsdp-zero3-streaming-diloco``)."""
        return self.setup if self.outer_sync is None else outer_sync_name(self.setup, self.outer_sync)

    @property
    def plan_key(self) -> tuple[str, str, bool]:
        """``(setup, activation_checkpointing, cpu_offload)``: the ``Setup.plan_key`` of the setup this row measured."""
        return self.setup, self.activation_checkpointing, self.cpu_offload

    def as_json(self, usable_bytes: int) -> dict[str, Any]:
        m = self.memory
        document = {
            "setup": self.name,
            "activation_checkpointing": self.activation_checkpointing,
            "cpu_offload": self.cpu_offload,
            "per_rank": {key: getattr(m, key) for key in PER_RANK_JSON},
            "fits": m.peak <= usable_bytes,
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "method": self.method,
        }
        if self.outer_sync is not None and self.outer_memory is not None:
            document["outer_sync"] = {"options": asdict(self.outer_sync), **asdict(self.outer_memory)}
        return document


@dataclass(frozen=True)
class Simulation:
    """What :func:`~lightning_fastdist.planning.simulation.simulate.simulate` found.

    Attributes:
        rows: one per setup and checkpointing mode that traced (and the rows derived from them).
        not_traced: ``(setup, checkpointing, reason)`` for each that failed (it would fail in training too).
        replica_groups: the recipe's option, under which every row was simulated; ``None``: one world.
    """

    world_size: int
    gpus_per_node: int
    parameters: int
    rows: list[SimulatedSetup]
    not_traced: list[tuple[str, str, str]]
    replica_groups: dict | None = None


def nothing_traced(not_traced: list[tuple[str, str, str]]) -> NotTraceable:
    """Why a simulation has no row: the first setup that did not trace, and its reason."""
    setup, checkpointing, reason = not_traced[0]
    return NotTraceable(f"{setup} with activation_checkpointing={checkpointing}: {reason}")
