"""Estimate each device's communication per optimizer step under DDP, FSDP2 ZeRO-2/3 and DeepSpeed ZeRO-1/2/3.

Counted as the strategies' counters count it (each collective's full-size tensor); the table per mode is in
docs/doctor.md ("The communication formula"). ``hsdp`` (``doctor --simulate`` only) is ZeRO-3 within shard groups of
``G`` ranks plus each rank's gradient shard, ``g N / G``, all-reduced across the ``W / G`` replicas. FSDP's padding to
a multiple of ``W`` is left out; a single device communicates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_fastdist.parallel.across_nodes.outer_sync.settings import PSEUDO_GRADIENT_DTYPES, OuterSync
from lightning_fastdist.parallel.deepspeed.runtime import MAX_LIVE_PARAMETERS
from lightning_fastdist.planning.memory_model import DEEPSPEED_MODES, MODES, TrainingShape

COMM_MODES = (*MODES, "hsdp")


@dataclass(frozen=True)
class CommEstimate:
    """Bytes per optimizer step of each collective (full-size tensors) on one device.

    Attributes:
        mode: one of :data:`COMM_MODES`.
        shard_group: ranks that all-gather and reduce-scatter together under ``hsdp`` (its all-reduce runs across the
            ``world_size / shard_group`` replicas); ``None``: every collective spans the world.
    """

    mode: str
    world_size: int
    allreduce: int = 0
    allgather: int = 0
    reduce_scatter: int = 0
    shard_group: int | None = None

    def by_collective(self) -> dict[str, int]:
        """The collectives this mode runs and their bytes, named as the strategies log them."""
        named = {"allreduce": self.allreduce, "allgather": self.allgather, "reduce_scatter": self.reduce_scatter}
        return {name: value for name, value in named.items() if value}

    @property
    def sent_per_device(self) -> int:
        """Bytes each device sends per optimizer step with ring collectives."""
        group = self.shard_group or self.world_size
        replicas = self.world_size // group if self.shard_group else self.world_size
        sent = (
            2 * (replicas - 1) * self.allreduce * group
            + (group - 1) * (self.allgather + self.reduce_scatter) * replicas
        )
        return sent // (replicas * group)


def root_parameters(shape: TrainingShape) -> int:
    """Parameters outside the blocks of a GPT with learned positions and a tied head: embeddings and final norm."""
    return (shape.vocab_size + shape.seq_len) * shape.hidden + 2 * shape.hidden


def estimate_comm(shape: TrainingShape, mode: str, accumulation: int = 1) -> CommEstimate:
    """Estimate one optimizer step's communication for ``shape`` under ``mode`` (one of ``MODES``), with
    ``accumulation`` micro-batches per step; ZeRO-3 also reads the vocabulary, sequence length and width, which size
    the root."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}.")
    return comm_per_step(
        mode, shape.world_size, shape.parameters, root_parameters(shape), shape.precision, accumulation
    )


def comm_per_step(
    mode: str,
    world_size: int,
    parameters: int,
    root_params: int,
    precision: str,
    accumulation: int = 1,
    shard_group: int | None = None,
) -> CommEstimate:
    """One optimizer step's communication from counted parameters (see docs/doctor.md).

    Args:
        mode: one of :data:`COMM_MODES`.
        root_params: those outside every block (FSDP's root unit).
        shard_group: ranks per shard group, for ``hsdp`` only.
    """
    if mode not in COMM_MODES:
        raise ValueError(f"mode must be one of {', '.join(COMM_MODES)}, got {mode!r}.")
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"accumulation must be an integer >= 1, got {accumulation!r}.")
    if world_size == 1:
        return CommEstimate(mode, 1)
    n = parameters
    compute_bytes = 4 if precision == "32-true" else 2
    gradient_bytes = 2 if precision == "bf16-true" else 4
    if mode in DEEPSPEED_MODES:  # its model runs in 16 bits (or 32): its gradients are in that dtype too
        w, stage = compute_bytes, int(mode[-1])
        if stage == 3:
            gathered = accumulation * (n + max(0, n - MAX_LIVE_PARAMETERS))
            return CommEstimate(mode, world_size, allgather=w * gathered, reduce_scatter=accumulation * w * n)
        reductions = 1 if stage == 1 else accumulation
        return CommEstimate(mode, world_size, allreduce=reductions * w * n, allgather=w * n)
    if mode == "ddp":
        return CommEstimate(mode, world_size, allreduce=gradient_bytes * n)
    gathered = n if mode == "zero2" else accumulation * (2 * n - min(n, root_params))
    group = (shard_group or world_size) if mode == "hsdp" else None  # FSDP's replicas all-reduce the shards
    return CommEstimate(
        mode,
        world_size,
        allreduce=0 if group in (None, world_size) else -(-gradient_bytes * n // group),
        allgather=gathered * compute_bytes,
        reduce_scatter=gradient_bytes * n,
        shard_group=group,
    )


def outer_sync_sent_per_step(settings: OuterSync, parameters: int, nodes: int) -> int:
    """Bytes a process that talks across nodes sends there per optimizer step under ``outer_sync``, on average: the
    pseudo-gradient of the ``parameters`` it holds (all of them on DDP's local rank 0, its shard on an FSDP rank) once
    per ``every`` steps, in ``settings.dtype``, all-reduced on a ring of the ``nodes`` (torchft's replica groups)."""
    pseudo_gradients = parameters * PSEUDO_GRADIENT_DTYPES[settings.dtype].itemsize
    return CommEstimate("ddp", nodes, allreduce=pseudo_gradients).sent_per_device // settings.every
