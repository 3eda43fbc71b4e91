"""Find NaN or infinite values in a state about to be saved (weights, optimizer moments), with one host read.

A checkpoint with a NaN weight is worse than none: a restart resumes it and trains garbage. The answers are folded
into one flag per device, read once; only when one is set is the state walked again to name the first bad entry.
Each tensor is read once by ``torch.aminmax`` (a NaN makes both NaN, an infinity one of them): ``isfinite(t).all()``
writes a mask as large as the tensor first, 40 times slower on a CPU (1.15 s against 0.03 s for 600 MB), and this
check is part of every save's stall.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _tensors(state: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(state, DTensor):
        yield path, state.to_local()
    elif isinstance(state, torch.Tensor):
        yield path, state
    elif isinstance(state, Mapping):
        for key, value in state.items():
            yield from _tensors(value, f"{path}.{key}" if path else str(key))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from _tensors(value, f"{path}[{index}]")


def _floating(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    return ((path, t) for path, t in tensors if t.is_floating_point() and t.numel() > 0 and t.device.type != "meta")


def non_finite_entry(state: Any) -> str | None:
    """The path (``state_dict.blocks.0.attn.weight``) of the first tensor in ``state`` holding NaN/inf, or ``None``.

    ``state``: nested mappings, lists and tensors; of a sharded tensor only this rank's shard is tested.
    """
    flags: dict[torch.device, torch.Tensor] = {}
    for _, tensor in _floating(_tensors(state, "")):
        bad = _holds_non_finite(tensor)
        flags[tensor.device] = bad if tensor.device not in flags else torch.logical_or(flags[tensor.device], bad)
    if not any(bool(flag) for flag in flags.values()):  # the one host read per device
        return None
    return next(path for path, tensor in _floating(_tensors(state, "")) if bool(_holds_non_finite(tensor)))


def _holds_non_finite(tensor: torch.Tensor) -> torch.Tensor:
    """Whether ``tensor`` holds NaN or inf, as a tensor on its device (no host read)."""
    low, high = torch.aminmax(tensor)
    return torch.logical_not(torch.logical_and(torch.isfinite(low), torch.isfinite(high)))
