"""A node's gradients (and buffers) as the few flat tensors that cross the link, and back.

One flat tensor per dtype, kept from step to step (a fresh one costs its memory pages every step: 4-5 ms of the
6 ms a 3.2M-parameter model took to flatten on one CPU thread, against 1 ms into a kept one). A gradient's flat
tensor ends with one more element per parameter: 1 where this node has a gradient for it, 0 where not. Averaged over
the nodes, a parameter none of them has a gradient for keeps none (as DDP leaves one that no rank used), and one some
nodes lack counts as zero there (as DDP's buckets hold it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class FlatTensors:
    """``tensors`` (a model's buffers) copied into one flat tensor per dtype by :meth:`gather`, and back by
    :meth:`scatter`."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.groups = _by_dtype(tensors)
        self.flats = _empty_flats(self.groups, extra=0)

    def gather(self) -> list[torch.Tensor]:
        """The flat tensors, holding the tensors' values now."""
        for (_, members), flat in zip(self.groups, self.flats, strict=True):
            torch.cat([tensor.detach().reshape(-1) for tensor in members], out=flat)
        return self.flats

    def scatter(self) -> None:
        """Copy the flat tensors' values back into the tensors."""
        with torch.no_grad():
            for (_, members), flat in zip(self.groups, self.flats, strict=True):
                offset = 0
                for tensor in members:
                    tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()


class FlatGradients:
    """The gradients of ``parameters`` (one flat tensor per dtype, each followed by the parameters' has-a-gradient
    marks), gathered after the backward by :meth:`gather` and set back once averaged by :meth:`scatter`."""

    def __init__(self, parameters: Sequence[torch.Tensor]) -> None:
        self.groups = _by_dtype(parameters)
        self.flats = _empty_flats(self.groups, extra=1)

    def gather(self) -> list[torch.Tensor]:
        """The flat tensors, holding this node's gradients now."""
        for (dtype, members), flat in zip(self.groups, self.flats, strict=True):
            parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype, device=p.device)
                     for p in members]  # fmt: skip
            marks = torch.tensor([float(p.grad is not None) for p in members], dtype=dtype, device=flat.device)
            torch.cat([*parts, marks], out=flat)
        return self.flats

    def scatter(self, apply: bool) -> None:
        """Set the gradients from the (averaged) flat tensors: a parameter no node had a gradient for keeps none.
        Without ``apply`` every gradient becomes ``None``: the optimizer step leaves the weights and the optimizer's
        state as they are."""
        for (_, members), flat in zip(self.groups, self.flats, strict=True):
            marks = flat[-len(members) :].tolist() if apply else [0.0] * len(members)
            offset = 0
            for parameter, mark in zip(members, marks, strict=True):
                numel = parameter.numel()
                if mark == 0:
                    parameter.grad = None
                elif parameter.grad is None:
                    parameter.grad = flat[offset : offset + numel].view_as(parameter).clone()
                else:
                    parameter.grad.copy_(flat[offset : offset + numel].view_as(parameter))
                offset += numel


def _empty_flats(groups: list[tuple[torch.dtype, list[torch.Tensor]]], extra: int) -> list[torch.Tensor]:
    """One flat tensor per group, for its tensors' elements and ``extra`` more per tensor."""
    return [
        torch.empty(sum(t.numel() for t in members) + extra * len(members), dtype=dtype, device=members[0].device)
        for dtype, members in groups
    ]


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, list[torch.Tensor]]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.items())
