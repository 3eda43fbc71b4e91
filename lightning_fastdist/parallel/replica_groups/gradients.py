"""A node's gradients (and buffers) as the few flat tensors that cross the link, and back.

One flat tensor per gradient dtype, with one more element per parameter at its end: 1 where this node has a
gradient for it, 0 where not. Averaged over the nodes, a parameter none of them has a gradient for keeps none (as
DDP leaves one that no rank used), and one some nodes lack counts as zero there (as DDP's buckets hold it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def flatten_gradients(parameters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``parameters``' gradients in one flat tensor per dtype (in the order of first appearance), each followed by
    the parameters' has-a-gradient marks."""
    flats = []
    for dtype, members in _by_dtype(parameters):
        parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype, device=p.device)
                 for p in members]  # fmt: skip
        marks = torch.tensor([float(p.grad is not None) for p in members], dtype=dtype, device=members[0].device)
        flats.append(torch.cat([*parts, marks]))
    return flats


def unflatten_gradients(parameters: Sequence[torch.Tensor], flats: Sequence[torch.Tensor], apply: bool) -> None:
    """Set ``parameters``' gradients from :func:`flatten_gradients`'s tensors (averaged): a parameter no node had a
    gradient for keeps none. Without ``apply`` every gradient becomes ``None``: the optimizer step leaves the
    weights and the optimizer's state as they are."""
    for (_, members), flat in zip(_by_dtype(parameters), flats, strict=True):
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


def flatten_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` (a model's buffers) copied into one flat tensor per dtype."""
    return [torch.cat([tensor.reshape(-1) for tensor in members]) for _, members in _by_dtype(tensors)]


def unflatten_tensors(tensors: Sequence[torch.Tensor], flats: Sequence[torch.Tensor]) -> None:
    """Copy :func:`flatten_tensors`'s ``flats`` back into ``tensors``."""
    with torch.no_grad():
        for (_, members), flat in zip(_by_dtype(tensors), flats, strict=True):
            offset = 0
            for tensor in members:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


def _by_dtype(parameters: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, list[torch.Tensor]]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for parameter in parameters:
        groups.setdefault(parameter.dtype, []).append(parameter)
    return list(groups.items())
