"""DeepSpeed as an optional dependency that runs on CPU (gloo) and CUDA (NCCL) without compiling anything.

``docs/deepspeed.md`` lists the ops DeepSpeed would compile just in time and what the strategy does instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import ModuleType

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_fastdist.parallel.comm.collective_names import ALL_GATHER_FUNCTION, REDUCE_SCATTER_FUNCTION

INSTALL_HINT = "pip install lightning-fastdist[deepspeed]"
SHM_COMM_OP = "deepspeed_shm_comm"
MAX_AUTO_BUCKET = 200_000_000  # elements: Lightning's default bucket size, the cap of "auto"
MAX_LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters: gathered parameters kept at once


def deepspeed_available() -> bool:
    """Whether ``deepspeed`` can be imported (without importing it)."""
    return importlib.util.find_spec("deepspeed") is not None


def import_deepspeed(owner: str) -> ModuleType:
    """``import deepspeed``, or an ``ImportError`` naming ``owner`` and the install command."""
    if not deepspeed_available():
        raise ImportError(f"{owner} needs DeepSpeed, which is not installed: {INSTALL_HINT}")
    import deepspeed  # noqa: PLC0415 - optional

    return deepspeed


def auto_bucket_size(model: torch.nn.Module) -> int:
    """The ``"auto"`` bucket size: the trainable parameters, at most :data:`MAX_AUTO_BUCKET` elements.

    DeepSpeed allocates its buckets at full size on every micro-batch, so a bucket larger than the model only
    costs memory (and, under ``deterministic=True``, the time to fill it). A parameter ZeRO-3 partitioned holds
    an empty tensor on every rank: its size is ``ds_numel`` (``numel()`` would give 0, which DeepSpeed refuses).
    Rounded up to an even count: ZeRO-1 and 2 refuse an all-gather bucket of an odd number of elements (its 4-byte
    alignment of fp16 values), which a model of an odd parameter count gave.
    """
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    return min(MAX_AUTO_BUCKET, trainable + trainable % 2)


@contextmanager
def engines_placed_on(device_rank: int) -> Iterator[None]:
    """Make ``deepspeed.initialize`` place the engines built inside the block on ``device_rank`` where its caller
    passes ``device_rank=None``: Lightning passes the device's index, which a CPU device does not have, and
    DeepSpeed's engine compares it with 0."""
    import deepspeed  # noqa: PLC0415 - optional; the strategy imported it already

    initialize = deepspeed.initialize

    def initialize_on_device_rank(*args, **kwargs):
        given = kwargs.get("args")
        if given is not None and getattr(given, "device_rank", 0) is None:
            kwargs["args"] = argparse.Namespace(**{**vars(given), "device_rank": device_rank})
        return initialize(*args, **kwargs)

    deepspeed.initialize = initialize_on_device_rank
    try:
        yield
    finally:
        deepspeed.initialize = initialize


def skip_jit_built_comm_ops() -> None:
    """Keep DeepSpeed's communication backend from compiling its shared-memory op; call before ``init_distributed``.

    On the CPU accelerator it would compile it (an error without a compiler), although gloo carries every collective.
    """
    import deepspeed.ops  # noqa: PLC0415 - optional

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def call_current_collective_names() -> None:
    """Point DeepSpeed's communication backend at the flat-tensor all-gather and reduce-scatter under the names the
    installed torch offers (the same collectives): DeepSpeed calls ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor``, which torch 2.13 deprecates with a ``FutureWarning`` on every call. Call after
    ``init_distributed``, which builds the backend."""
    from deepspeed.comm import comm  # noqa: PLC0415 - optional

    comm.cdb.all_gather_function = getattr(dist, ALL_GATHER_FUNCTION)
    comm.cdb.reduce_scatter_function = getattr(dist, REDUCE_SCATTER_FUNCTION)


def groups_wait_as_long_as(timeout: timedelta) -> None:
    """Make the process groups DeepSpeed creates (its copy of the world, ZeRO's data-parallel group) wait ``timeout``
    in a collective, as the job's own do. Its backend creates them with torch's default (30 minutes), so a peer that
    hung held every other rank for half an hour, silent, instead of ending at the strategy's ``timeout`` in one line
    (found by the fault campaign). Call after ``init_distributed``, which builds the backend, before the engine."""
    from deepspeed.comm import comm  # noqa: PLC0415 - optional

    comm.cdb.new_group = lambda ranks: dist.new_group(ranks, timeout=timeout)


def deepspeed_device_type() -> str:
    """The device type DeepSpeed's accelerator puts tensors on (``"cuda"``, ``"cpu"``, ...)."""
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415 - optional

    return torch.device(get_accelerator().device_name()).type


def check_deepspeed_device(device: torch.device, owner: str) -> None:
    """Raise ``RuntimeError`` in one line if DeepSpeed's accelerator is not ``device``'s type.

    DeepSpeed picks its accelerator once per process; on another device it would put tensors where the model is not.
    """
    chosen = deepspeed_device_type()
    if chosen != device.type:
        raise RuntimeError(
            f"{owner}: the Trainer runs on {device.type} but DeepSpeed chose its {chosen} accelerator; "
            f"set the environment variable DS_ACCELERATOR={device.type} before starting the run."
        )


# torch optimizers DeepSpeedCPUAdam computes the same step as, and their options it has no counterpart for.
CPU_ADAM_REPLACES = (torch.optim.Adam, torch.optim.AdamW)
_NO_CPU_ADAM_OPTION = ("amsgrad", "maximize", "differentiable")


def cpu_adam_obstacle(optimizer: Optimizer, device_type: str) -> str | None:
    """Why DeepSpeed's CPU Adam cannot take over ``optimizer``'s offloaded step, or ``None`` (it may still not build).

    ``device_type``: the Trainer's; only CUDA runs compile anything.
    """
    if device_type != "cuda":
        return f"a {device_type} run compiles nothing"
    if type(optimizer) not in CPU_ADAM_REPLACES:
        return f"DeepSpeed's CPU Adam replaces torch's Adam and AdamW only, not {type(optimizer).__name__}"
    for option in _NO_CPU_ADAM_OPTION:
        if any(group.get(option) for group in optimizer.param_groups):
            return f"{option}=True has no counterpart in DeepSpeed's CPU Adam"
    if any(isinstance(group["lr"], torch.Tensor) for group in optimizer.param_groups):
        return "a tensor learning rate has no counterpart in DeepSpeed's CPU Adam"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler to build it ({compiler!r} not found; set CXX)"
    from torch.utils.cpp_extension import is_ninja_available  # noqa: PLC0415 - only on this path

    if not is_ninja_available():
        return "ninja, which builds it, is not installed"
    return None


def cpu_adam_arguments(optimizer: Optimizer) -> dict:
    """``DeepSpeedCPUAdam``'s keyword arguments for the step ``optimizer`` (torch's Adam or AdamW) takes.

    The per-group values (``lr``, ``betas``, ``eps``, ``weight_decay``) are read from each group at every
    step; ``adamw_mode`` (decoupled weight decay, as AdamW) holds for the whole optimizer.
    """
    first = optimizer.param_groups[0]
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(optimizer.defaults.get("decoupled_weight_decay"))
    return dict(
        lr=first["lr"], betas=first["betas"], eps=first["eps"], weight_decay=first["weight_decay"], adamw_mode=decoupled
    )


def to_deepspeed_cpu_adam(optimizer: Optimizer) -> Optimizer:
    """A ``DeepSpeedCPUAdam`` over ``optimizer``'s own parameter groups (builds the op: a minute the first time).

    The groups are the same dictionaries, so an LR scheduler bound to ``optimizer`` keeps steering the step.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415 - optional

    return DeepSpeedCPUAdam(optimizer.param_groups, **cpu_adam_arguments(optimizer))


def choose_offload_optimizer(
    optimizer: Optimizer, device_type: str, build: Callable[[Optimizer], Optimizer] = to_deepspeed_cpu_adam
) -> tuple[Optimizer, str]:
    """The optimizer ZeRO-Offload steps on the CPU, and one line saying which and why.

    DeepSpeed's CPU Adam replaces torch's Adam or AdamW where it can be built; ``build`` makes it, and a failure
    keeps ``optimizer``.
    """
    obstacle = cpu_adam_obstacle(optimizer, device_type)
    if obstacle is None:
        try:
            return build(optimizer), (
                f"ZeRO-Offload: the CPU step runs DeepSpeed's CPU Adam in place of torch's {type(optimizer).__name__} "
                "(vectorised C++, several times faster on the CPU)."
            )
        except Exception as error:  # a compiler or header problem: the run goes on with torch's
            reasons = [_first_line(seen) for seen in (error, error.__cause__) if seen is not None]
            obstacle = f"DeepSpeed's CPU Adam did not build ({': '.join(reasons)})"
    return optimizer, f"ZeRO-Offload: the CPU step runs torch's {type(optimizer).__name__}: {obstacle}."


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
