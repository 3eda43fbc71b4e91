"""A node's gradients (and buffers) as the few flat tensors that cross the link, and back (this process's shards).

One flat tensor per dtype, kept from step to step: a fresh one costs its memory pages every step. A gradient's flat
tensor ends with a has-a-gradient mark per parameter, so that, as in DDP, a parameter no node has a gradient for
keeps none and one some nodes lack counts as zero there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_fastdist.parallel.fsdp.local_shards import local_part


class FlatTensors:
    """``tensors`` (a model's buffers) copied into one flat tensor per dtype by ``gather``, and back by ``scatter``."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.groups = _by_dtype(tensors)
        self.flats = _empty_flats(self.groups, extra=0)

    def gather(self) -> list[torch.Tensor]:
        for (_, members), flat in zip(self.groups, self.flats, strict=True):
            torch.cat([local_part(tensor.detach()).reshape(-1) for tensor in members], out=flat)
        return self.flats

    def scatter(self) -> None:
        with torch.no_grad():
            for (_, members), flat in zip(self.groups, self.flats, strict=True):
                offset = 0
                for tensor in map(local_part, members):
                    tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()


class FlatGradients:
    """The gradients of ``parameters``, gathered after the backward by ``gather`` and set back once averaged by
    ``scatter``."""

    def __init__(self, parameters: Sequence[torch.Tensor]) -> None:
        self.groups = _by_dtype(parameters)
        self.flats = _empty_flats(self.groups, extra=1)

    def gather(self) -> list[torch.Tensor]:
        for (dtype, members), flat in zip(self.groups, self.flats, strict=True):
            parts = [local_part(p.grad).reshape(-1) if p.grad is not None else _zeros_of(p) for p in members]
            marks = torch.tensor([float(p.grad is not None) for p in members], dtype=dtype, device=flat.device)
            torch.cat([*parts, marks], out=flat)
        return self.flats

    def scatter(self, apply: bool) -> None:
        """Set the gradients from the (averaged) flat tensors. Without ``apply`` every gradient becomes ``None``, so
        the optimizer step leaves the weights and the optimizer's state as they are."""
        for (_, members), flat in zip(self.groups, self.flats, strict=True):
            marks = flat[-len(members) :].tolist() if apply else [0.0] * len(members)
            offset = 0
            for parameter, mark in zip(members, marks, strict=True):
                held = local_part(parameter)
                if mark == 0:
                    parameter.grad = None
                else:
                    if parameter.grad is None:
                        parameter.grad = torch.zeros_like(parameter)  # a DTensor placed as its parameter, if sharded
                    local_part(parameter.grad).copy_(flat[offset : offset + held.numel()].view_as(held))
                offset += held.numel()


def _zeros_of(parameter: torch.Tensor) -> torch.Tensor:
    held = local_part(parameter)
    return torch.zeros(held.numel(), dtype=held.dtype, device=held.device)


def _empty_flats(groups: list[tuple[torch.dtype, list[torch.Tensor]]], extra: int) -> list[torch.Tensor]:
    """One flat tensor per group, for the elements this process holds of its tensors and ``extra`` more per tensor."""
    return [
        torch.empty(
            sum(local_part(t).numel() for t in members) + extra * len(members),
            dtype=dtype,
            device=local_part(members[0]).device,
        )
        for dtype, members in groups
    ]


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, list[torch.Tensor]]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.items())
