"""A model built on the meta device (``Trainer.init_module(empty_init=True)``) made real: at setup, and before a load.

Under FastFSDPStrategy, as under Lightning's ``ModelParallelStrategy``, ``empty_init`` builds the model on the meta
device, and setup materialises it with each module's ``reset_parameters``. A ``load_state_dict`` before that
(``model.load_state_dict(...)`` after the block, or ``M.load_from_checkpoint(...)`` inside it) copied into meta
tensors: nothing was loaded (torch warned once per parameter), training started from ``reset_parameters``' weights,
and ``load_from_checkpoint`` failed moving the meta model (``Cannot copy out of meta tensor``). Under DDP the same
code loads the weights. Here a module made on the meta device inside the block is materialised on the CPU as a load
reaches it (``reset_parameters`` only where the load leaves some of its tensors unset), then loaded: materialise, then
load. A module no load reaches stays on the meta device, materialised at setup by :func:`materialize`, which leaves
the loaded modules as they are.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)


@contextmanager
def materialised_before_loads(empty_init: bool | None) -> Iterator[None]:
    """Inside the block (of ``init_module(empty_init=True)``), each module that registers a parameter or buffer on the
    meta device is materialised on the CPU before a ``load_state_dict`` (of it or of a module holding it) loads it."""
    if not empty_init:
        yield
        return
    prepared: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def on_registration(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        if tensor is not None and tensor.is_meta and module not in prepared:
            prepared.add(module)
            module.register_load_state_dict_pre_hook(_materialise_on_the_cpu)

    handles = [
        register_module_parameter_registration_hook(on_registration),
        register_module_buffer_registration_hook(on_registration),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _materialise_on_the_cpu(module: nn.Module, state_dict: dict[str, Any], prefix: str, *unused: Any) -> None:
    """A load pre-hook: ``module``'s own meta tensors made real on the CPU, initialised by ``reset_parameters`` only
    where the loaded state does not hold all of them (as under DDP, whose ``empty_init`` leaves them uninitialised)."""
    own = dict(itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)))
    if not any(tensor.is_meta for tensor in own.values()):
        return
    module.to_empty(device="cpu", recurse=False)
    reset = getattr(module, "reset_parameters", None)
    if callable(reset) and any(prefix + name not in state_dict for name in own):
        reset()


def materialize(module: nn.Module, device: torch.device, cpu_offload: bool) -> None:
    """Lightning's meta-device materialisation (every module with a meta tensor made real, then its
    ``reset_parameters``), for those modules only: one a load already materialised under
    ``Trainer.init_module(empty_init=True)`` keeps the weights loaded (``empty_init.py``). Under ``cpu_offload`` the
    parameter shards are made on the CPU, where FSDP2 expects them at the first forward (the buffers go to ``device``
    in ``model_to_device``)."""
    on_meta = [
        submodule
        for submodule in module.modules()
        if any(t.is_meta for t in itertools.chain(submodule.parameters(False), submodule.buffers(False)))
    ]
    for submodule in on_meta:  # all first: a module's reset_parameters may set its children's tensors
        submodule.to_empty(device=torch.device("cpu") if cpu_offload else device, recurse=False)
    resets = [getattr(submodule, "reset_parameters", None) for submodule in on_meta]
    for reset in resets:
        if callable(reset):
            reset()
    uninitialized = sorted({type(m).__name__ for m, reset in zip(on_meta, resets) if not callable(reset)})
    if uninitialized:  # Lightning's warning
        rank_zero_warn(
            "Parameter initialization incomplete. The following modules have parameters or buffers with uninitialized"
            " memory because they don't define a `reset_parameters()` method for re-initialization:"
            f" {', '.join(uninitialized)}"
        )
