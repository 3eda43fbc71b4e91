"""Estimate training memory per GPU for DDP, FSDP2 ZeRO-2/3 and DeepSpeed ZeRO-1/2/3, with checkpointing and offload.

A closed formula for GPT-like models: state bytes per parameter by precision and mode, gathered weights, activations
in units of ``b s h`` per block. docs/doctor.md ("The memory formula") writes it out and says what it leaves out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from lightning_fastdist.parallel.deepspeed.runtime import MAX_AUTO_BUCKET, MAX_LIVE_PARAMETERS
from lightning_fastdist.parallel.plan.activation_checkpointing import LEAST_RECOMPUTE_FIRST

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
FSDP_MODES = ("zero2", "zero3")
DEEPSPEED_MODES = ("ds-zero1", "ds-zero2", "ds-zero3")
MODES = ("ddp", *FSDP_MODES, *DEEPSPEED_MODES)
DEEPSPEED_OPTIMIZER_BYTES = 12  # per parameter: fp32 master copy + two fp32 AdamW moments
CHECKPOINTING = LEAST_RECOMPUTE_FIRST
UNITS_PER_LAYER = 17
SELECTIVE_UNITS_PER_LAYER = 9
HEAD_UNITS = 2
ADAMW_STATES = 2
GiB = 2**30


@dataclass(frozen=True)
class TrainingShape:
    """What the estimate needs to know about a training run.

    Args:
        parameters: trainable parameters, tied weights counted once.
        layers: transformer blocks.
        hidden: width of the residual stream.
        micro_batch: samples per forward pass on each GPU.
        vocab_size: the output vocabulary (logits are ``micro_batch x seq_len x vocab_size``).
        precision: one of :data:`PRECISIONS`.
    """

    parameters: int
    layers: int
    hidden: int
    seq_len: int
    micro_batch: int
    world_size: int = 1
    vocab_size: int = 256
    precision: str = "32-true"

    def __post_init__(self) -> None:
        for name in ("parameters", "layers", "hidden", "seq_len", "micro_batch", "world_size", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainingShape: {name} must be an integer >= 1, got {value!r}.")
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"TrainingShape: precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}."
            )


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes per GPU for one configuration.

    Attributes:
        mode: one of :data:`MODES` (``zero2``/``zero3`` are FSDP2's, ``ds-zero*`` DeepSpeed's).
        activation_checkpointing: ``"none"``, ``"selective"`` or ``"full"``.
        cpu_offload: sharded state in host memory (FSDP), or DeepSpeed's optimizer (and at stage 3 its weights).
        gradients: communication buckets and a kept copy included.
        gathered_weights: weights gathered for compute on top of the shards (and autocast's copy).
        activations: saved for backward, at the peak of one micro-batch.
        host_bytes: kept in host memory instead (offload).
    """

    mode: str
    activation_checkpointing: str
    cpu_offload: bool
    weights: int
    gradients: int
    optimizer: int
    gathered_weights: int
    activations: int
    host_bytes: int

    @property
    def state(self) -> int:
        """Weights + gradients + optimizer state on the GPU: what stays allocated between steps."""
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        """Peak bytes per GPU during a step."""
        return self.state + self.gathered_weights + self.activations


def _compute_bytes(precision: str) -> int:
    return 4 if precision == "32-true" else 2


def activation_bytes(shape: TrainingShape, activation_checkpointing: str = "none") -> int:
    """Bytes a forward pass of one micro-batch saves for backward, at the backward peak (see docs/doctor.md);
    ``activation_checkpointing`` is one of :data:`CHECKPOINTING`."""
    if activation_checkpointing not in CHECKPOINTING:
        raise ValueError(
            f"activation_checkpointing must be one of {', '.join(CHECKPOINTING)}, got {activation_checkpointing!r}."
        )
    tokens_x_hidden = shape.micro_batch * shape.seq_len * shape.hidden
    unit = _compute_bytes(shape.precision)  # of the saved tensors (and the logits)
    # mixed: the two residuals stay fp32, the other units are 2-byte copies saved by the matmuls
    residual_unit = 4 if shape.precision in ("bf16-mixed", "16-mixed") else unit
    per_layer = (2 * residual_unit + (UNITS_PER_LAYER - 2) * unit) * tokens_x_hidden
    selective = SELECTIVE_UNITS_PER_LAYER * unit * tokens_x_hidden
    logits = shape.micro_batch * shape.seq_len * shape.vocab_size * (unit + 4)
    head = HEAD_UNITS * residual_unit * tokens_x_hidden + logits
    if activation_checkpointing == "none":
        return shape.layers * per_layer + head
    block_inputs = shape.layers * residual_unit * tokens_x_hidden
    if activation_checkpointing == "full":
        return block_inputs + per_layer + head  # one block rebuilt at a time in backward
    return block_inputs + shape.layers * selective + (per_layer - selective) + head


@dataclass(frozen=True)
class DeepSpeedState:
    """Bytes per GPU of DeepSpeed's model state at one stage (see docs/doctor.md)."""

    weights: int
    gradients: int
    optimizer: int
    gathered_weights: int
    host_bytes: int


def deepspeed_state(parameters: int, world_size: int, precision: str, stage: int, cpu_offload: bool) -> DeepSpeedState:
    """DeepSpeed's weights, gradients (buckets included), optimizer state and gathered weights per GPU at ``stage`` 1,
    2 or 3; any 16-bit ``precision`` keeps 2-byte weights; ``cpu_offload`` moves the optimizer (and at stage 3 the
    weight partitions) to host memory."""
    n, ranks = parameters, world_size
    w = 4 if precision == "32-true" else 2
    weights = w * n if stage < 3 else -(-w * n // ranks)
    gradients = w * n if stage == 1 else -(-w * n // ranks)
    if stage < 3:
        gradients += 2 * w * min(n, MAX_AUTO_BUCKET)  # two reduction buckets (overlap_comm)
    optimizer = -(-DEEPSPEED_OPTIMIZER_BYTES * n // ranks)
    gathered = w * min(n, MAX_LIVE_PARAMETERS) if stage == 3 else 0
    host = 0
    if cpu_offload:
        host, optimizer = optimizer, 0
        if stage == 3:
            host, weights = host + weights, 0
    return DeepSpeedState(weights, gradients, optimizer, gathered, host)


def deepspeed_activation_precision(precision: str) -> str:
    """The precision DeepSpeed's model runs in: it converts the model to 16 bits itself rather than autocasting."""
    return "32-true" if precision == "32-true" else "bf16-true"


def estimate_memory(
    shape: TrainingShape,
    mode: str,
    activation_checkpointing: str = "none",
    cpu_offload: bool = False,
    gradient_as_bucket_view: bool = True,
    kept_gradient_copy: bool = False,
) -> MemoryEstimate:
    """Estimate bytes per GPU for ``shape`` trained with ``mode`` (the formula: docs/doctor.md).

    Args:
        mode: one of :data:`MODES`.
        activation_checkpointing: one of :data:`CHECKPOINTING`.
        cpu_offload: keep sharded state in host memory (FSDP), or DeepSpeed's optimizer (and at stage 3 its weight
            partitions); not with ``ddp``.
        gradient_as_bucket_view: DDP's gradients live in its communication buckets (no extra copy).
        kept_gradient_copy: every rank keeps a flat copy of its (sharded) gradients between steps (``replica_groups``).

    Raises:
        ValueError: an unknown ``mode``/``activation_checkpointing``, or ``cpu_offload`` with ``ddp``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}.")
    if cpu_offload and mode == "ddp":
        raise ValueError("cpu_offload needs a sharded mode (DDP keeps a full replica on every GPU).")
    if mode in DEEPSPEED_MODES:  # see docs/doctor.md; its activations run in DeepSpeed's own dtype
        state = deepspeed_state(shape.parameters, shape.world_size, shape.precision, int(mode[-1]), cpu_offload)
        activations = activation_bytes(
            replace(shape, precision=deepspeed_activation_precision(shape.precision)), activation_checkpointing
        )
        return MemoryEstimate(mode, activation_checkpointing, cpu_offload, activations=activations, **asdict(state))
    weight_b = grad_b = 2 if shape.precision == "bf16-true" else 4  # per parameter; AdamW keeps two states of each
    optim_b = ADAMW_STATES * weight_b
    n = shape.parameters
    shards = 1 if mode == "ddp" else shape.world_size
    weights, gradients, optimizer = (-(-n * per // shards) for per in (weight_b, grad_b, optim_b))
    if mode == "ddp" and not gradient_as_bucket_view:
        gradients += n * grad_b
    if kept_gradient_copy:
        gradients += -(-n * grad_b // shards)
    compute_b = _compute_bytes(shape.precision)
    if mode == "ddp":
        # Autocast caches a low-precision copy of every weight for the forward pass.
        gathered = 0 if compute_b == weight_b else n * compute_b
    elif mode == "zero2":
        gathered = n * compute_b
    else:
        gathered = -(-2 * n * compute_b // shape.layers)
    host = 0
    if cpu_offload:
        host = weights + gradients + optimizer
        weights = gradients = optimizer = 0
    activations = activation_bytes(shape, activation_checkpointing)
    return MemoryEstimate(
        mode, activation_checkpointing, cpu_offload, weights, gradients, optimizer, gathered, activations, host
    )


def estimate_table(shape: TrainingShape) -> list[MemoryEstimate]:
    """Estimates for every mode x {no, full} checkpointing, plus offload for the sharded modes (all of DeepSpeed's)."""
    table = []
    for mode in MODES:
        for checkpointing in ("none", "full"):
            table.append(estimate_memory(shape, mode, checkpointing))
            if mode != "ddp":
                table.append(estimate_memory(shape, mode, checkpointing, cpu_offload=True))
    return table
