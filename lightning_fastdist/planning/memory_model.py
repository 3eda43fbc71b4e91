"""Estimate training memory per GPU for DDP, FSDP2 ZeRO-2/3 and DeepSpeed ZeRO-1/2/3, with checkpointing and offload.

The formula (``N`` parameters, ``W`` ranks, ``b`` micro-batch, ``s`` sequence
length, ``h`` hidden width, ``L`` layers, ``V`` vocabulary):

Model state, bytes per parameter (AdamW keeps two moments in the parameters' dtype):

==============  =======  =========  ==========
precision       weights  gradients  AdamW
==============  =======  =========  ==========
32-true         4        4          8
bf16-mixed      4        4          8
16-mixed        4        4          8
bf16-true       2        2          4
==============  =======  =========  ==========

- ``ddp``: every rank holds all of it, ``16 N`` bytes in fp32 (plus ``4 N`` of
  communication buckets when ``gradient_as_bucket_view`` is off; FastDDPStrategy
  turns it on).
- ``zero2`` / ``zero3`` (FSDP2): weights, gradients and AdamW state are split
  across ranks: ``16 N / W``. What they hold *on top*, during a step, differs:
  ``zero2`` keeps every block's gathered weights from its forward to its backward
  (``N`` x compute bytes), ``zero3`` only the two blocks being computed or
  prefetched (``2 N / L`` x compute bytes). Compute bytes are 2 under a bf16/fp16
  policy, else the weights' bytes.
- ``cpu_offload`` (FSDP): the sharded state lives in host memory; the GPU
  keeps only the gathered weights and the activations.

DeepSpeed (``ds-zero1``, ``ds-zero2``, ``ds-zero3``) keeps the weights in ``w``
bytes (4 under ``32-true``; 2 under any 16-bit precision, which DeepSpeed runs by
converting the model itself) and, in its optimizer, an fp32 master copy and the
two AdamW moments: 12 bytes per parameter, whatever the precision, split across
ranks at every stage (the ZeRO paper's accounting, plus the fp32 copy that
DeepSpeed also keeps in fp32 training):

- ``ds-zero1``: weights ``w N`` and gradients ``w N`` on every rank, optimizer ``12 N / W``;
- ``ds-zero2``: weights ``w N``, gradients ``w N / W``, optimizer ``12 N / W``;
- ``ds-zero3``: weights, gradients ``w N / W`` each, optimizer ``12 N / W``, and the
  gathered weights DeepSpeed keeps alive: up to ``stage3_max_live_parameters``
  (1e9) of them, and it keeps those a backward pass reuses, so ``w min(N, 1e9)``;
- stages 1 and 2 reduce through two gradient buckets (``overlap_comm``) of
  ``min(N, 2e8)`` elements (FastDeepSpeedStrategy's ``"auto"`` bucket size), counted
  with the gradients: ``2 w min(N, 2e8)``;
- ``cpu_offload``: the optimizer (and at stage 3 the weight partitions) in host memory;
- activations are those of a model run in ``w``-byte precision throughout (no
  fp32 residual copies: DeepSpeed converts the model rather than autocasting).

Activations, per micro-batch, counted in units of ``b s h`` elements for a
pre-norm GPT block with fused (flash / memory-efficient) attention and no
dropout, which saves for backward: the block input, both LayerNorm outputs,
the QKV projection (3), the attention output and its re-layout (2), the
residual after attention, the MLP up-projection (4) and GELU output (4):
:data:`UNITS_PER_LAYER` = 17 units, each 4 bytes in fp32. Under mixed precision
the two residuals stay fp32 and the other 15 units are 2-byte copies that the
matmuls save (38 bytes per ``b s h``), and autocast keeps a 2-byte copy of the
weights (``2 N``). The head adds the final LayerNorm's input and output
(2 units) plus the logits and cross-entropy's log-softmax (``2 b s V``).

- Full activation checkpointing keeps only each block's input (1 unit per
  layer) and rebuilds one block at a time in backward (one layer's activations
  extra at the peak).
- Selective checkpointing keeps the matmul and attention outputs (qkv 3,
  attention 2, up-projection 4: 9 of the 17 units) and recomputes the rest.

Not modelled: dropout masks, the CUDA context (~0.5-1 GiB), allocator
fragmentation (the advisor keeps :data:`~lightning_fastdist.planning.advisor.HEADROOM`
free for these), and attention implementations that materialise the ``s x s`` scores.

Tested against measured per-rank bytes of TinyGPT under DDP, ZeRO-2 and ZeRO-3
on 2 CPU ranks (``tests/planning/test_memory_model.py``).
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
        parameters: number of trainable parameters (tied weights counted once).
        layers: number of transformer blocks.
        hidden: width of the residual stream.
        seq_len: tokens per sample.
        micro_batch: samples per forward pass on each GPU.
        world_size: number of GPUs (ranks) sharing the model.
        vocab_size: size of the output vocabulary (logits are ``micro_batch x seq_len x vocab_size``).
        precision: a Lightning precision setting, one of :data:`PRECISIONS`.
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
        cpu_offload: sharded state kept in host memory (FSDP), or DeepSpeed's optimizer (and at stage 3
            its weight partitions).
        weights: bytes of (sharded) weights on the GPU.
        gradients: bytes of (sharded) gradients on the GPU, communication buckets included.
        optimizer: bytes of AdamW state on the GPU.
        gathered_weights: bytes of weights gathered for compute on top of the shards (and autocast's copy).
        activations: bytes saved for backward at the peak of one micro-batch.
        host_bytes: bytes kept in host memory instead (offload).
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

    def as_dict(self) -> dict:
        """The fields plus ``state`` and ``total``, for JSON."""
        return {**asdict(self), "state": self.state, "total": self.total}


def _state_bytes_per_parameter(precision: str) -> tuple[int, int, int]:
    """(weight, gradient, AdamW-state) bytes per parameter."""
    weight = 2 if precision == "bf16-true" else 4
    return weight, weight, ADAMW_STATES * weight


def _compute_bytes(precision: str) -> int:
    return 4 if precision == "32-true" else 2


def activation_bytes(shape: TrainingShape, activation_checkpointing: str = "none") -> int:
    """Bytes a forward pass of one micro-batch saves for backward, at the backward peak (see the module docstring).

    Args:
        shape: the run.
        activation_checkpointing: one of :data:`CHECKPOINTING`.
    """
    if activation_checkpointing not in CHECKPOINTING:
        raise ValueError(
            f"activation_checkpointing must be one of {', '.join(CHECKPOINTING)}, got {activation_checkpointing!r}."
        )
    tokens_x_hidden = shape.micro_batch * shape.seq_len * shape.hidden
    if shape.precision in ("32-true", "bf16-true"):
        unit = _compute_bytes(shape.precision) if shape.precision == "bf16-true" else 4
        per_layer = UNITS_PER_LAYER * unit * tokens_x_hidden
        selective = SELECTIVE_UNITS_PER_LAYER * unit * tokens_x_hidden
        residual_unit = unit
    else:  # mixed: two fp32 residuals, the other units are 2-byte copies saved by the matmuls
        per_layer = (2 * 4 + (UNITS_PER_LAYER - 2) * 2) * tokens_x_hidden
        selective = SELECTIVE_UNITS_PER_LAYER * 2 * tokens_x_hidden
        residual_unit = 4
    logits_bytes = 2 if shape.precision in ("bf16-mixed", "16-mixed", "bf16-true") else 4
    head = HEAD_UNITS * residual_unit * tokens_x_hidden + shape.micro_batch * shape.seq_len * shape.vocab_size * (
        logits_bytes + 4
    )
    if activation_checkpointing == "none":
        return shape.layers * per_layer + head
    block_inputs = shape.layers * residual_unit * tokens_x_hidden
    if activation_checkpointing == "full":
        return block_inputs + per_layer + head  # one block rebuilt at a time in backward
    return block_inputs + shape.layers * selective + (per_layer - selective) + head


@dataclass(frozen=True)
class DeepSpeedState:
    """Bytes per GPU of DeepSpeed's model state at one stage (see the module docstring)."""

    weights: int
    gradients: int
    optimizer: int
    gathered_weights: int
    host_bytes: int


def deepspeed_state(parameters: int, world_size: int, precision: str, stage: int, cpu_offload: bool) -> DeepSpeedState:
    """DeepSpeed's weights, gradients (buckets included), optimizer state and gathered weights per GPU.

    Args:
        parameters: ``N``.
        world_size: ``W``.
        precision: a Lightning precision name (any 16-bit one keeps 2-byte weights).
        stage: 1, 2 or 3.
        cpu_offload: the optimizer (and at stage 3 the weight partitions) in host memory.
    """
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


def _estimate_deepspeed(shape: TrainingShape, mode: str, checkpointing: str, cpu_offload: bool) -> MemoryEstimate:
    """DeepSpeed's stages (see the module docstring)."""
    state = deepspeed_state(shape.parameters, shape.world_size, shape.precision, int(mode[-1]), cpu_offload)
    activation_precision = deepspeed_activation_precision(shape.precision)
    return MemoryEstimate(
        mode=mode,
        activation_checkpointing=checkpointing,
        cpu_offload=cpu_offload,
        weights=state.weights,
        gradients=state.gradients,
        optimizer=state.optimizer,
        gathered_weights=state.gathered_weights,
        activations=activation_bytes(replace(shape, precision=activation_precision), checkpointing),
        host_bytes=state.host_bytes,
    )


def estimate_memory(
    shape: TrainingShape,
    mode: str,
    activation_checkpointing: str = "none",
    cpu_offload: bool = False,
    gradient_as_bucket_view: bool = True,
) -> MemoryEstimate:
    """Estimate bytes per GPU for ``shape`` trained with ``mode`` (see the module docstring for the formula).

    Args:
        shape: the run.
        mode: one of :data:`MODES`.
        activation_checkpointing: one of :data:`CHECKPOINTING`.
        cpu_offload: keep sharded state in host memory (FSDP), or DeepSpeed's optimizer (and at
            stage 3 its weight partitions); not with ``ddp``.
        gradient_as_bucket_view: DDP's gradients live in its communication buckets (no extra copy).

    Raises:
        ValueError: an unknown ``mode``/``activation_checkpointing``, or ``cpu_offload`` with ``ddp``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}.")
    if cpu_offload and mode == "ddp":
        raise ValueError("cpu_offload needs a sharded mode (DDP keeps a full replica on every GPU).")
    if mode in DEEPSPEED_MODES:
        return _estimate_deepspeed(shape, mode, activation_checkpointing, cpu_offload)
    weight_b, grad_b, optim_b = _state_bytes_per_parameter(shape.precision)
    n = shape.parameters
    shards = 1 if mode == "ddp" else shape.world_size
    weights, gradients, optimizer = (-(-n * per // shards) for per in (weight_b, grad_b, optim_b))
    if mode == "ddp" and not gradient_as_bucket_view:
        gradients += n * grad_b
    compute_b = weight_b if shape.precision in ("32-true", "bf16-true") else _compute_bytes(shape.precision)
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
    return MemoryEstimate(
        mode=mode,
        activation_checkpointing=activation_checkpointing,
        cpu_offload=cpu_offload,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        gathered_weights=gathered,
        activations=activation_bytes(shape, activation_checkpointing),
        host_bytes=host,
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
