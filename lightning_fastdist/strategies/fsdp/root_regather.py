"""The root unit's gathered parameters kept as a training step under manual optimization needs them.

FSDP2 gathers the root unit's parameters when the step's forward starts (Lightning runs ``training_step`` as the
root's forward) and reshards them after a backward; a block gathers its own at each of its forwards, taking each
parameter's ``requires_grad`` from its shard. A step that toggles its optimizers and runs a forward after a backward
(Lightning's GAN example: ``toggle_optimizer``, the generator's loss, backward and step, then the discriminator's)
failed under FSDP in two ways that DDP does not: the second forward computed with the root's sharded parameters beside
the batch's plain tensors (``aten.addmm.default got mixed torch.Tensor and DTensor``), and the root's parameters,
gathered before the step toggled them, kept ``requires_grad`` and took the generator's loss's gradient into the
discriminator's step. So at a step's first forward, and at the first forward after each backward, the root's gathered
parameters take ``requires_grad`` from their shards (what ``toggle_optimizer`` set), or, resharded by a backward, are
gathered again from their shards as they are then (after the optimizer's step, if it stepped); at the step's end they
are resharded if they were gathered so, so that the next step gathers the shards its optimizer stepped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from lightning_fastdist.parallel.fsdp.sharding import RootUnit


class RootRegather:
    """Keeps the root unit's gathered parameters as the optimizers' toggles and steps left their shards, before the
    first forward of a manual-optimization step and the first after each of its backwards."""

    def __init__(self) -> None:
        self.root: RootUnit | None = None
        self._shards: dict[str, nn.Parameter] = {}  # the root's own parameters, by name, as sharded
        self._waiting: RemovableHandle | None = None  # a global forward pre-hook, armed until the next forward
        self._gathered = False

    def set_root(self, root: RootUnit) -> None:
        """Call once the model is sharded (the root's parameters registered as their shards)."""
        in_blocks = {
            f"{name}.{parameter}"
            for name, module in root.named_modules()
            if module is not root and isinstance(module, FSDPModule)
            for parameter, _ in module.named_parameters()
        }
        self.root = root
        self._shards = {name: p for name, p in root.named_parameters() if name not in in_blocks}

    def arm(self) -> None:
        """Call as a training step starts and after each backward: under manual optimization, the next forward of a
        module inside the root first brings the root's gathered parameters up to date."""
        manual = self.root is not None and not getattr(self.root.module, "automatic_optimization", True)
        if manual and self._waiting is None:
            self._waiting = register_module_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        assert self.root is not None
        if module is self.root or module is self.root.module:  # the step itself (Lightning's forward redirection)
            return
        self._stop_waiting()
        current = dict(self.root.named_parameters())
        gathered = [(current[name], shard) for name, shard in self._shards.items() if current[name] is not shard]
        if not gathered and self._shards:  # resharded by a backward: gathered again, toggles taken from the shards
            self.root.unshard()
            self._gathered = True
        for parameter, shard in gathered:
            if parameter.requires_grad != shard.requires_grad:
                parameter.requires_grad_(shard.requires_grad)

    @contextmanager
    def during_step(self) -> Iterator[None]:
        """Around a training step: armed as it starts; at its end disarmed, and the root resharded where it was
        gathered here (its shards may have been stepped since)."""
        self.arm()
        try:
            yield
        finally:
            self._stop_waiting()
            if self._gathered and self.root is not None:
                self.root.reshard()
            self._gathered = False

    def _stop_waiting(self) -> None:
        if self._waiting is not None:
            self._waiting.remove()
            self._waiting = None
