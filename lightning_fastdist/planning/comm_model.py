"""Estimate each device's communication per optimizer step under DDP, FSDP2 ZeRO-2/3 and DeepSpeed ZeRO-1/2/3.

Counted the way the strategies count it (:mod:`lightning_fastdist.parallel.comm.accounting`):
each collective's full-size tensor, for ``N`` parameters, ``k`` micro-batches per
optimizer step, compute bytes ``c`` (2 under a bf16/fp16 policy or bf16-true,
else 4) and gradient bytes ``g`` (2 under bf16-true, else 4; FSDP reduces in
fp32 under mixed precision, DDP all-reduces the fp32 gradients):

- ``ddp``: one all-reduce of the gradients per step, ``g N``;
- ``zero2``: an all-gather of the weights per optimizer step, ``c N`` (FastFSDPStrategy
  keeps them gathered across accumulation micro-batches), and a reduce-scatter of
  the gradients per step, ``g N``;
- ``zero3``: the blocks' weights are gathered for every micro-batch's forward
  and again for its backward, the root's (embeddings, final norm, head: ``R``
  parameters) once, ``k c (2 N - R)``, plus ``g N``. ``R`` is taken as
  ``(V + s) h + 2 h``: a GPT with learned positions and a tied head.

- ``hsdp`` (``doctor --simulate`` only): ZeRO-3 within shard groups of ``G`` ranks,
  ``k c (2 N - R)`` gathered and ``g N`` reduce-scattered there, then each rank's
  gradient shard, ``g N / G``, all-reduced across the ``W / G`` replicas.

DeepSpeed (``ds-zero*``) communicates in the weights' dtype, ``w`` bytes (4 under
``32-true``, else 2), and reduces gradients with all-reduces of buckets (on NCCL
and gloo alike), also at stage 2:

- ``ds-zero1``: an all-reduce of the gradients per optimizer step, ``w N``, and an
  all-gather of the updated weights, ``w N``;
- ``ds-zero2``: the all-reduce on every micro-batch, ``k w N``, and the all-gather ``w N``;
- ``ds-zero3``: a reduce-scatter of the gradients on every micro-batch, ``k w N``, and
  an all-gather of every weight for each micro-batch's forward, ``k w N``; DeepSpeed
  keeps up to ``stage3_max_live_parameters`` (1e9) gathered for the backward to reuse,
  so only a larger model's backward gathers the rest again: ``k w (N + max(0, N - 1e9))``.
  (FastDeepSpeedStrategy lets ZeRO-3 keep its trace under Lightning, see
  :mod:`~lightning_fastdist.parallel.deepspeed.zero3_trace`; without that it gathers more.)

(Plus a few bytes: the all-reduced gradient norm and overflow flag.)

On a ring each device sends ``2 (W - 1) / W`` of an all-reduce and ``(W - 1) / W``
of an all-gather or reduce-scatter (:attr:`CommEstimate.sent_per_device`), so at
``k = 1`` in fp32 ZeRO-2 sends what DDP sends and ZeRO-3 1.5 times as much.
FSDP pads each tensor's first dimension to a multiple of ``W``; that is left out.
A single device communicates nothing.

Checked exactly against the strategies' counters on 2 CPU ranks
(``tests/fsdp/test_fsdp_sharding.py``, ``tests/ddp/test_fast_ddp.py``; DeepSpeed's stages in
``tests/deepspeed/test_deepspeed.py``, where the model is far below 1e9 parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_fastdist.parallel.deepspeed.runtime import MAX_LIVE_PARAMETERS
from lightning_fastdist.planning.memory_model import DEEPSPEED_MODES, MODES, TrainingShape

COMM_MODES = (*MODES, "hsdp")


@dataclass(frozen=True)
class CommEstimate:
    """Bytes per optimizer step of each collective (full-size tensors) on one device.

    Attributes:
        mode: one of :data:`COMM_MODES`.
        world_size: devices sharing the work.
        allreduce: gradient all-reduce bytes.
        allgather: weight all-gather bytes.
        reduce_scatter: gradient reduce-scatter bytes.
        shard_group: ranks that all-gather and reduce-scatter together under ``hsdp`` (its all-reduce
            runs across the ``world_size / shard_group`` replicas); ``None``: every collective spans the world.
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


def _estimate_deepspeed(world_size: int, n: int, mode: str, accumulation: int, weight_bytes: int) -> CommEstimate:
    w, stage = weight_bytes, int(mode[-1])
    if stage == 3:
        gathered = accumulation * (n + max(0, n - MAX_LIVE_PARAMETERS))
        return CommEstimate(mode, world_size, allgather=w * gathered, reduce_scatter=accumulation * w * n)
    reductions = 1 if stage == 1 else accumulation
    return CommEstimate(mode, world_size, allreduce=reductions * w * n, allgather=w * n)


def estimate_comm(shape: TrainingShape, mode: str, accumulation: int = 1) -> CommEstimate:
    """Estimate one optimizer step's communication for ``shape`` under ``mode`` (see the module docstring).

    Args:
        shape: the run (parameters, world size and precision; for ZeRO-3 also vocabulary, sequence length
            and width, which size the root).
        mode: one of :data:`~lightning_fastdist.planning.memory_model.MODES`.
        accumulation: micro-batches per optimizer step (``accumulate_grad_batches``).
    """
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
    """One optimizer step's communication from counted parameters (see the module docstring).

    Args:
        mode: one of :data:`COMM_MODES`.
        world_size: ranks.
        parameters: ``N``, the model's trainable parameters.
        root_params: ``R``, those outside every block (FSDP's root unit).
        precision: a Lightning precision name.
        accumulation: micro-batches per optimizer step.
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
    if mode in DEEPSPEED_MODES:
        return _estimate_deepspeed(world_size, n, mode, accumulation, weight_bytes=compute_bytes)
    if mode == "ddp":
        return CommEstimate(mode, world_size, allreduce=gradient_bytes * n)
    gathered = n if mode == "zero2" else accumulation * (2 * n - min(n, root_params))
    if mode == "hsdp":
        group = shard_group or world_size
        return CommEstimate(
            mode,
            world_size,
            allreduce=0 if group == world_size else -(-gradient_bytes * n // group),
            allgather=gathered * compute_bytes,
            reduce_scatter=gradient_bytes * n,
            shard_group=group,
        )
    return CommEstimate(mode, world_size, allgather=gathered * compute_bytes, reduce_scatter=gradient_bytes * n)
