"""Pick a strategy, checkpointing, offload, precision and batch split for a model on given devices; write the recipe.

The first row of :data:`PREFERENCE` (fastest first) whose estimated peak fits in ``(1 - HEADROOM)`` of a device wins;
if none fits, the micro-batch is halved (accumulation keeps the global batch) down to 1, where the most frugal row is
recommended with a warning. On GPUs with memory to spare, the micro-batch is then doubled while the same setup still
fits, accumulation lowered to keep the global batch, up to :data:`GPU_TOKENS_PER_MICRO_BATCH`: fewer, larger
micro-batches keep a GPU busier. Why that order, and why FSDP2 unless only DeepSpeed's ZeRO-Offload fits:
docs/doctor.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lightning_fastdist.diagnostics.dataloader_audit import workers_for
from lightning_fastdist.parallel.across_nodes.replica_groups.settings import ReplicaGroups
from lightning_fastdist.planning.memory_model import MemoryEstimate, TrainingShape, estimate_memory
from lightning_fastdist.planning.setup import Setup
from lightning_fastdist.recipes.recipe import set_strategy

HEADROOM = 0.15  # CUDA context, allocator fragmentation, temporary buffers
# Tokens per micro-batch up to which a GPU's micro-batch is raised: llm.c's and the nanoGPT records' 64 x 1024.
GPU_TOKENS_PER_MICRO_BATCH = 64 * 1024
PREFERENCE = (  # (mode, activation checkpointing, cpu offload), fastest first
    ("ddp", "none", False),
    ("zero2", "none", False),
    ("zero3", "none", False),
    ("zero2", "full", False),
    ("zero3", "full", False),
    ("ds-zero2", "none", True),
    ("ds-zero2", "full", True),
    ("zero3", "full", True),
)
SINGLE_DEVICE_PREFERENCE = (  # on one device sharding saves nothing
    ("ddp", "none", False),
    ("ddp", "full", False),
    ("ds-zero2", "full", True),
    ("zero3", "full", True),
)


@dataclass(frozen=True)
class Target:
    """The devices a recipe is for.

    Args:
        accelerator: ``"gpu"`` or ``"cpu"``.
        devices: devices (processes) per node.
        device_memory_bytes: memory of one device; on CPU, the host memory shared by the processes.
        cpu_cores: CPU cores of the node, shared by its processes (sizes the data-loader workers).
    """

    accelerator: str
    devices: int
    device_memory_bytes: int
    bf16: bool
    cpu_cores: int
    nodes: int = 1

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes


@dataclass
class Recommendation:
    """What :func:`recommend` chose and why.

    Attributes:
        estimate: the chosen configuration's, per device.
        shape: what it was estimated for (micro-batch and precision as chosen).
        usable_bytes: device memory minus :data:`HEADROOM`.
        reasons: one line per decision.
        replica_groups: the recipe's, kept in the strategy (``None``: one world).
    """

    estimate: MemoryEstimate
    shape: TrainingShape
    accumulate_grad_batches: int
    fits: bool
    usable_bytes: int
    reasons: list[str] = field(default_factory=list)
    replica_groups: ReplicaGroups | None = None


def choose_precision(target: Target) -> str:
    """``bf16-mixed`` where bf16 is available; ``16-mixed`` on GPUs without it; ``32-true`` on CPUs without it."""
    if target.bf16:
        return "bf16-mixed"
    return "16-mixed" if target.accelerator == "gpu" else "32-true"


def workers_per_rank(cpu_cores: int, processes_per_node: int) -> int:
    """Data-loader workers for one rank, by ``workers_for``'s rule."""
    return workers_for(max(1, cpu_cores // max(1, processes_per_node)))


def recommend(
    shape: TrainingShape,
    target: Target,
    global_batch: int | None = None,
    replica_groups: ReplicaGroups | None = None,
) -> Recommendation:
    """Choose the fastest configuration that fits (see the module docstring).

    Args:
        shape: the model and batch; its ``world_size`` and ``precision`` are replaced by the target's.
        global_batch: samples per optimizer step over all ranks; ``None``: ``micro_batch x world_size``.
        replica_groups: the recipe's (nodes checked by the caller): each node a torchft replica group, so only DDP
            and FSDP sharded over one node's devices, each rank keeping a copy of its gradients.

    Raises:
        ValueError: ``global_batch`` is not a positive multiple of ``micro_batch x world_size``.
    """
    precision = choose_precision(target)
    shape = replace(shape, world_size=target.world_size, precision=precision)
    per_step = shape.micro_batch * target.world_size
    global_batch = per_step if global_batch is None else global_batch
    if global_batch < 1 or global_batch % per_step:
        raise ValueError(
            f"global_batch must be a positive multiple of micro_batch x devices ({per_step}), got {global_batch}."
        )
    usable = int(target.device_memory_bytes * (1 - HEADROOM))
    preference = SINGLE_DEVICE_PREFERENCE if target.world_size == 1 else PREFERENCE
    reasons = [
        f"precision {precision}: " + ("the devices compute in bf16" if target.bf16 else "no bf16 on these devices")
    ]
    sharded_over = target.world_size
    if replica_groups is not None:
        preference = tuple(key for key in PREFERENCE if Setup.from_plan_key(*key).takes_replica_groups)
        sharded_over = target.devices
        reasons.append(
            f"replica_groups (the recipe's, min_nodes {replica_groups.min_nodes}): each node a torchft replica group, "
            f"so FSDP shards over one node's {target.devices} device(s), every rank keeps a copy of its gradients "
            "(counted), and DeepSpeed is not offered"
        )
    kept_copy = replica_groups is not None
    micro_batch = shape.micro_batch
    while True:
        trial = replace(shape, micro_batch=micro_batch)
        sharded = replace(trial, world_size=sharded_over)
        for mode, checkpointing, offload in preference:
            estimate = estimate_memory(sharded, mode, checkpointing, cpu_offload=offload, kept_gradient_copy=kept_copy)
            if estimate.total <= usable:
                reasons.append(
                    f"{describe_setup(mode, checkpointing, offload)}: the fastest option whose estimated peak "
                    f"({estimate.total / 2**30:.2f} GiB) fits in {usable / 2**30:.2f} GiB usable per device"
                )
                if target.accelerator == "gpu" and micro_batch == shape.micro_batch:  # nothing was lowered
                    trial, estimate, raised = _raise_micro_batch(
                        trial, estimate, sharded_over, global_batch, target, usable, kept_copy
                    )
                    reasons.extend([raised] if raised else [])
                return _finish(estimate, trial, global_batch, target, True, usable, reasons, replica_groups)
        if micro_batch == 1:
            break
        micro_batch = max(1, micro_batch // 2)
        while global_batch % (micro_batch * target.world_size):
            micro_batch -= 1
        reasons.append(f"micro-batch lowered to {micro_batch}: nothing fitted with a larger one")
    # the loop's last estimate: the most frugal configuration at micro-batch 1
    reasons.append(
        f"does not fit: even {describe_setup(*preference[-1])} at micro-batch 1 needs an estimated "
        f"{estimate.total / 2**30:.2f} GiB > {usable / 2**30:.2f} GiB; use more or larger devices"
    )
    return _finish(estimate, trial, global_batch, target, False, usable, reasons, replica_groups)


def _raise_micro_batch(
    shape: TrainingShape,
    chosen: MemoryEstimate,
    sharded_over: int,
    global_batch: int,
    target: Target,
    usable: int,
    kept_copy: bool,
) -> tuple[TrainingShape, MemoryEstimate, str | None]:
    """Double ``shape``'s micro-batch while the ``chosen`` setup still fits, the global batch stays a whole number of
    micro-batches per rank and a micro-batch holds at most ``GPU_TOKENS_PER_MICRO_BATCH`` tokens; the shape, its
    estimate and the reason (``None``: not raised)."""
    estimate = chosen
    while True:
        larger = replace(shape, micro_batch=shape.micro_batch * 2)
        tokens = larger.micro_batch * larger.seq_len
        if global_batch % (larger.micro_batch * target.world_size) or tokens > GPU_TOKENS_PER_MICRO_BATCH:
            break
        trial = estimate_memory(
            replace(larger, world_size=sharded_over), chosen.mode, chosen.activation_checkpointing,
            cpu_offload=chosen.cpu_offload, kept_gradient_copy=kept_copy,
        )  # fmt: skip
        if trial.total > usable:
            break
        shape, estimate = larger, trial
    if estimate is chosen:
        return shape, chosen, None
    return (
        shape,
        estimate,
        (
            f"micro-batch raised to {shape.micro_batch}: it still fits ({estimate.total / 2**30:.2f} GiB), and fewer, "
            "larger micro-batches keep a GPU busier"
        ),
    )


def _finish(
    estimate: MemoryEstimate,
    shape: TrainingShape,
    global_batch: int,
    target: Target,
    fits: bool,
    usable: int,
    reasons: list[str],
    replica_groups: ReplicaGroups | None,
) -> Recommendation:
    accumulate = global_batch // (shape.micro_batch * target.world_size)
    if accumulate > 1:
        reasons.append(f"accumulate_grad_batches {accumulate}: keeps the global batch at {global_batch}")
    return Recommendation(estimate, shape, accumulate, fits, usable, reasons, replica_groups)


def describe_setup(mode: str, checkpointing: str, offload: bool) -> str:
    """``"FSDP ZeRO-3 + full activation checkpointing"``: a configuration in words."""
    return Setup.from_plan_key(mode, checkpointing, offload).describe()


def strategy_section(estimate: MemoryEstimate, replica_groups: ReplicaGroups | None = None) -> dict:
    """The ``trainer.strategy`` entry of a recipe for ``estimate``'s configuration, with the recipe's
    ``replica_groups`` where it has them."""
    setup = Setup.from_plan_key(estimate.mode, estimate.activation_checkpointing, estimate.cpu_offload)
    return recipe_strategy(replace(setup, replica_groups=replica_groups))


def recipe_strategy(setup: Setup) -> dict:
    """The ``trainer.strategy`` entry of the recipes doctor writes (DDP's with the bucket rule named, so it shows)."""
    section = setup.strategy_section()
    if setup.engine == "DDP":
        section["init_args"] = {"bucket_cap_mb": "auto", **section["init_args"]}
    return section


def build_recipe(
    recommendation: Recommendation,
    target: Target,
    model_section: dict,
    data_section: dict,
    max_steps: int,
    log_dir: str = "lightning_logs",
) -> dict:
    """A LightningCLI config (as a dict) for ``lightning-fastdist fit``.

    Args:
        data_section: its ``batch_size`` is set to the chosen micro-batch and a ``num_workers``, if present, to
            :func:`workers_per_rank`.
        log_dir: where the CSV logger, checkpoints and the bottleneck report go.
    """
    precision = recommendation.shape.precision
    trainer: dict = {
        "accelerator": target.accelerator,
        "devices": target.devices,
        "num_nodes": target.nodes,
        "strategy": strategy_section(recommendation.estimate, recommendation.replica_groups),
        "max_steps": max_steps,
        "accumulate_grad_batches": recommendation.accumulate_grad_batches,
        "log_every_n_steps": 10,
        "logger": {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": log_dir, "name": "doctor"},
        },
        "callbacks": [
            {"class_path": "lightning_fastdist.SyncFreeLogging"},
            {"class_path": "lightning_fastdist.SpeedMonitor"},
            {"class_path": "lightning_fastdist.DataLoaderTuner", "init_args": {"mode": "audit"}},
            {"class_path": "lightning_fastdist.BottleneckReport"},
        ],
    }
    if precision == "32-true":
        trainer["precision"] = precision
    else:
        plugin_args = {"precision": precision, "device": "cuda" if target.accelerator == "gpu" else "cpu"}
        trainer["plugins"] = [{"class_path": "lightning_fastdist.FastMixedPrecision", "init_args": plugin_args}]
    set_strategy(trainer, trainer["strategy"])  # a DeepSpeed strategy takes the precision as trainer.precision
    data = {"class_path": data_section["class_path"], "init_args": dict(data_section.get("init_args") or {})}
    data["init_args"]["batch_size"] = recommendation.shape.micro_batch
    if "num_workers" in data["init_args"] or data["class_path"] == "lightning_fastdist.demo.TextDataModule":
        data["init_args"]["num_workers"] = workers_per_rank(target.cpu_cores, target.devices)
    return {"seed_everything": 1234, "trainer": trainer, "model": model_section, "data": data}
