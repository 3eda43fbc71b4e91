"""Switch an existing torch optimizer to its fused implementation, in place (torch only).

A fused Adam, AdamW or SGD step runs as one kernel per parameter group and takes the loss scaler's ``found_inf`` on
the device, so ``16-mixed`` training needs no host sync to skip a step.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

# Optimizers whose torch implementation has a fused variant that accepts ``found_inf`` on the device.
FUSABLE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
# Device types with fused optimizer kernels in torch >= 2.4.
FUSED_DEVICE_TYPES = ("cuda", "cpu", "mps", "xpu")


def fuse_optimizer(optimizer: Optimizer) -> str | None:
    """Switch ``optimizer`` in place to torch's fused implementation; ``None``, or the reason it cannot be fused.

    In place, so LR schedulers keep their reference. Existing ``step`` counters move to the parameters' device,
    as fused kernels need.
    """
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    if type(optimizer) not in FUSABLE_OPTIMIZERS:
        names = ", ".join(cls.__name__ for cls in FUSABLE_OPTIMIZERS)
        return f"{type(optimizer).__name__} has no fused implementation in torch (only {names})"
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return "it was created with differentiable=True, which fused kernels do not support"
        for param in group["params"]:
            if param.device.type not in FUSED_DEVICE_TYPES or not torch.is_floating_point(param):
                return (
                    f"a parameter is {param.dtype} on {param.device}; "
                    f"fused kernels need floating point on {FUSED_DEVICE_TYPES}"
                )
    _set_fused_flags(optimizer)
    optimizer.register_load_state_dict_post_hook(_set_fused_flags)  # a checkpoint's groups would reset the flags
    return None


def _set_fused_flags(optimizer: Optimizer) -> None:
    for settings in (optimizer.defaults, *optimizer.param_groups):
        settings["fused"] = True
        settings["foreach"] = False
    for group in optimizer.param_groups:
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if isinstance(step, Tensor):
                optimizer.state[param]["step"] = step.to(device=param.device, dtype=torch.float32)
    optimizer._step_supports_amp_scaling = True  # what torch sets when constructed with fused=True
