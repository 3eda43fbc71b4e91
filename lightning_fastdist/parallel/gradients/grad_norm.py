"""Gradient norms as Lightning's ``grad_norm`` reports them under DDP, whatever holds the gradients.

Lightning's ``grad_norm`` reads each ``p.grad`` as one tensor: under FSDP2 a gradient is a DTensor sharded over the
ranks, under DeepSpeed's ZeRO it lives in the engine (``p.grad`` is ``None``). This one takes each gradient whole (a
DTensor's norm reduced over its shards, a ZeRO gradient assembled by DeepSpeed): the same names and values as under
DDP, on every rank, in the same call (a collective under FSDP and ZeRO: call it on every rank).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, torch.Tensor]:
    """Each parameter's gradient norm and their total, named as Lightning's ``grad_norm`` names them
    (``grad_2.0_norm/layer.weight``, ``grad_2.0_norm_total``); parameters without a gradient are left out.

    Raises:
        ValueError: ``norm_type`` is not a positive number (``"inf"`` is one).
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"grad_norm: norm_type must be a positive number or 'inf', got {norm_type}.")
    norms = {}
    for name, parameter in module.named_parameters():
        gradient = _whole_gradient(parameter)
        if gradient is not None:
            norm = torch.linalg.vector_norm(gradient, norm_type)
            norms[f"grad_{norm_type}_norm{group_separator}{name}"] = (
                norm.full_tensor() if isinstance(norm, DTensor) else norm
            )
    if norms:
        total = torch.linalg.vector_norm(torch.stack([norm.float() for norm in norms.values()]), norm_type)
        norms[f"grad_{norm_type}_norm_total"] = total
    return norms


def _whole_gradient(parameter: torch.Tensor) -> torch.Tensor | None:
    """The parameter's gradient, or DeepSpeed's assembly of it where ZeRO keeps it (``None`` for a parameter neither
    holds a gradient for: frozen, or unused this step)."""
    if parameter.grad is not None or "deepspeed" not in sys.modules:  # DeepSpeed's engine imported it, if any
        return parameter.grad
    from deepspeed.utils import safe_get_full_grad  # noqa: PLC0415 - DeepSpeed is optional

    return safe_get_full_grad(parameter)
