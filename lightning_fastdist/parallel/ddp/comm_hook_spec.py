"""DDP's gradient communication hook, in one place: its names, PowerSGD's and ``auto``'s settings, which
choices send bfloat16 and the backends that can reduce it, the checks, and the registration on a DDP module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_fastdist.parallel.ddp.auto_comm_hook import AutoCommState, AutoPolicy, auto_hook
from lightning_fastdist.parallel.ddp.comm_hooks import (
    HookState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from lightning_fastdist.parallel.ddp.powersgd import PowerSGDSettings, PowerSGDState, powersgd_hook

# The type a strategy's signature uses (LightningCLI offers exactly these), and the names it allows.
CommHookName = Literal["auto", "none", "fp16", "bf16", "powersgd"]
COMM_HOOK_NAMES = get_args(CommHookName)
# Backends known to all-reduce bfloat16 tensors.
BF16_BACKENDS = ("gloo", "nccl")
_AVERAGING_HOOKS = {"none": allreduce_hook, "fp16": fp16_compress_hook, "bf16": bf16_compress_hook}


@dataclass(frozen=True)
class CommHookSpec:
    """How DDP averages gradients; checked when built, so a bad choice fails before any process starts.

    Attributes:
        name: ``"auto"`` (starts exact, switches to bf16, then PowerSGD, only where the network makes it pay),
            ``"none"`` (full precision, still through a hook so bytes are counted alike), ``"fp16"``, ``"bf16"``
            or ``"powersgd"``.
        powersgd: PowerSGD's settings (checked whatever the name, so a typo never waits for a switch).
        auto: when ``"auto"`` switches.
    """

    name: str = "auto"
    powersgd: PowerSGDSettings = field(default_factory=PowerSGDSettings)
    auto: AutoPolicy = field(default_factory=AutoPolicy)

    def __post_init__(self) -> None:
        if self.name not in COMM_HOOK_NAMES:
            raise ValueError(
                f"comm_hook={self.name!r} is not supported; accepted values: {', '.join(map(repr, COMM_HOOK_NAMES))}."
            )

    @property
    def bf16_option(self) -> str | None:
        """The option that makes DDP all-reduce bfloat16 (``"comm_hook='bf16'"`` ...), or ``None``."""
        if self.name == "bf16":
            return "comm_hook='bf16'"
        if self.name == "powersgd" and self.powersgd.factor_dtype == "bf16":
            return "powersgd_factor_dtype='bf16'"
        return None

    def check_backend(self, backend: str, device: torch.device | None = None) -> None:
        """Refuse a choice that sends bfloat16 where ``backend`` (or the GPU ``device``) cannot reduce it."""
        option = self.bf16_option
        if option is None:
            return
        if backend not in BF16_BACKENDS:
            raise ValueError(
                f"{option} needs process_group_backend in {', '.join(map(repr, BF16_BACKENDS))} "
                f"(they reduce bfloat16), got {backend!r}."
            )
        if device is not None and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(
                f"{option} needs a GPU with bfloat16 support ({torch.cuda.get_device_name(device)} has none); "
                "use fp16 instead."
            )

    def register(self, ddp_module: DistributedDataParallel, group: dist.ProcessGroup | None = None) -> HookState:
        """Register the hook on ``ddp_module``, reducing over ``group`` (default: the world); return its state.

        Collective under ``"auto"`` on a backend other than gloo: its decisions get a gloo group of their own.
        """
        if self.name == "auto":
            backend = dist.get_backend(group)
            device = next(ddp_module.module.parameters()).device
            state = AutoCommState(
                process_group=group,
                module=ddp_module.module,
                policy=self.auto,
                powersgd_settings=self.powersgd,
                decision_group=group if backend == "gloo" else dist.new_group(backend="gloo"),
                allow_bf16=backend in BF16_BACKENDS and (device.type != "cuda" or torch.cuda.is_bf16_supported()),
                single_rank=dist.get_world_size(group) == 1,
            )
            ddp_module.register_comm_hook(state, auto_hook)
            return state
        if self.name == "powersgd":
            state = PowerSGDState(process_group=group, settings=self.powersgd)
            state.index_parameters(ddp_module.module)
            ddp_module.register_comm_hook(state, powersgd_hook)
            return state
        state = HookState(process_group=group)
        ddp_module.register_comm_hook(state, _AVERAGING_HOOKS[self.name])
        return state
