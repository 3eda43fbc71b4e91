"""Measure activation memory on any device, CPU included: the bytes a forward pass leaves alive for backward.

Storages created under the mode are tracked by weak reference; those alive after the forward are what autograd (or a
checkpoint cache) holds, plus the outputs. Needing no allocator statistics, it works on CPU, where torch keeps none.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class ActivationMemory(TorchDispatchMode):
    """Dispatch mode that tracks the storages created while it is active.

    Use it around a forward pass, then read :meth:`live_bytes` before running backward::

        with ActivationMemory() as memory:
            loss = model(inputs).sum()
        held = memory.live_bytes()
        loss.backward()
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._storages.append(weakref.ref(leaf.untyped_storage()))
        return out

    def live_bytes(self) -> int:
        """Bytes of the distinct storages created under this mode that are still alive."""
        alive = {s.data_ptr(): s.nbytes() for s in (ref() for ref in self._storages) if s is not None}
        return sum(alive.values())
