"""What ``doctor`` prints: the machine it runs on, and the memory table of the formula (one row per configuration,
with what each device sends per optimizer step)."""

from __future__ import annotations

from lightning_fastdist.diagnostics.environment import Environment
from lightning_fastdist.planning.comm_model import estimate_comm
from lightning_fastdist.planning.memory_model import GiB, TrainingShape, estimate_table


def _gib(value: int | None) -> str:
    return "unknown" if value is None else f"{value / GiB:.2f} GiB"


def format_environment(env: Environment) -> str:
    lines = [
        "Environment",
        f"  torch {env.torch_version}, Lightning {env.lightning_version or 'not installed'}",
        f"  CUDA {env.cuda_version or 'none (CPU build)'}, NCCL {env.nccl_version or 'none'}",
        f"  GPUs: {len(env.gpus) or 'none'}",
    ]
    lines += [f"    {g.index}: {g.name}, {_gib(g.memory_bytes)}, bf16 {'yes' if g.bf16 else 'no'}" for g in env.gpus]
    nvlink = {True: "yes", False: "no", None: "unknown (no nvidia-smi)"}[env.nvlink]
    infiniband = "unknown" if env.infiniband_devices is None else (", ".join(env.infiniband_devices) or "none")
    lines += [
        f"  NVLink: {nvlink}; InfiniBand: {infiniband}",
        f"  CPU cores: {env.cpu_cores}; host memory: {_gib(env.host_memory_bytes)}; "
        f"CPU bf16 autocast: {'yes' if env.cpu_bf16_autocast else 'no'}",
        f"  torch.distributed backends: {', '.join(env.backends) or 'none'}",
    ]
    return "\n".join(lines)


def format_estimates(shape: TrainingShape, usable: int, accumulation: int) -> str:
    """The memory table, one row per configuration, with what each device sends per optimizer step."""
    lines = [
        f"Memory per device (N={shape.parameters:,} parameters, {shape.layers} layers x {shape.hidden} wide, "
        f"seq {shape.seq_len}, micro-batch {shape.micro_batch}, {shape.world_size} ranks, {shape.precision}; "
        f"usable {usable / GiB:.2f} GiB) and bytes each device sends per optimizer step "
        f"({accumulation} micro-batch(es), ring collectives); formulas in docs/doctor.md",
        f"  {'mode':8} {'checkpoint':10} {'offload':7} {'state':>10} {'gathered':>10} {'activations':>11} "
        f"{'total':>10}  fits {'sent/step':>10}",
    ]
    for e in estimate_table(shape):
        sent = estimate_comm(shape, e.mode, accumulation).sent_per_device
        lines.append(
            f"  {e.mode:8} {e.activation_checkpointing:10} {'yes' if e.cpu_offload else 'no':7} {e.state / GiB:9.3f}G "
            f"{e.gathered_weights / GiB:9.3f}G {e.activations / GiB:10.3f}G {e.total / GiB:9.3f}G  "
            f"{'yes' if e.total <= usable else 'NO':4} {sent / GiB:9.3f}G"
        )
    return "\n".join(lines)
