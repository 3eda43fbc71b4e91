"""What FastFSDPStrategy does to the LightningModule it shards where Lightning's own helpers assume an unsharded one:
refuse one already wrapped in FSDP1, save and load it under its own names and in Lightning's layout (optimizer groups
as saved), move what FSDP did not place, and switch its BatchNorm layers to SyncBatchNorm and back in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.plugins.layer_sync import _BatchNormXd
from lightning.pytorch.strategies import Strategy
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_fastdist.parallel.checkpoint.problems import SHARDED_METADATA
from lightning_fastdist.strategies.checkpoint.saves import CheckpointSaves

T = TypeVar("T")


def sync_batchnorm_in_place(model: nn.Module, sync: bool) -> None:
    """Turn the sharded ``model``'s BatchNorm layers into ``SyncBatchNorm`` (``sync``) or back into Lightning's
    ``_BatchNormXd``, as Lightning's ``TorchSyncBatchNorm`` does, but keeping each layer object: FSDP sets the
    gathered parameters on the objects it sharded, so a new layer in their place would compute with the shards.

    A BatchNorm that FSDP made a unit of its own (``keep_fp32``) keeps its class, which FSDP derived from it.
    """
    for layer in model.modules():
        if isinstance(layer, FSDPModule):
            continue
        if sync and isinstance(layer, _BatchNorm) and not isinstance(layer, nn.SyncBatchNorm):
            layer.__class__ = nn.SyncBatchNorm
            layer.process_group = None  # the whole world, as SyncBatchNorm.convert_sync_batchnorm sets it
        elif not sync and isinstance(layer, nn.SyncBatchNorm):
            layer.__class__ = _BatchNormXd
            del layer.process_group


def move_to_device(module: nn.Module, device: torch.device, cpu_offload: bool) -> None:
    """``module.to(device)`` after sharding (parameterless modules, ``.device``); under ``cpu_offload`` all but the
    parameter shards, which stay on the CPU."""
    if cpu_offload:
        move_all_but_parameters(module, device)
    else:
        module.to(device)


def move_all_but_parameters(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for every part of ``module`` that holds no parameter, the buffers of the others too;
    device attributes updated."""
    if next(module.parameters(), None) is None:
        module.to(device)
        return
    if isinstance(module, _DeviceDtypeModuleMixin):
        module._device = device  # what LightningModule.device reports
    for name, buffer in module.named_buffers(recurse=False):
        module._buffers[name] = buffer.to(device)  # as Module.to does for each buffer
    for child in module.children():
        move_all_but_parameters(child, device)


def refuse_fsdp1(model: nn.Module, owner: str) -> None:
    """Raise ``TypeError`` where ``model`` holds modules wrapped in FSDP1, which ``owner`` would wrap again."""
    if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        raise TypeError(
            "Found modules that are wrapped with `torch.distributed.fsdp.FullyShardedDataParallel` (FSDP1); "
            f"{owner} shards with FSDP2: leave the model unwrapped."
        )


def under_module_names(strategy: Strategy, function: Callable[..., T]) -> Callable[..., T]:
    """``function`` (one of Lightning's saves or loads) seeing the LightningModule instead of the root unit around it
    as the strategy's model, so that checkpoints hold its own parameter names (no ``module.`` prefix), as with every
    other strategy."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> T:
        root = strategy.model
        strategy.model = strategy.lightning_module
        try:
            return function(*args, **kwargs)
        finally:
            strategy.model = root

    return call


def save_sharded(saves: CheckpointSaves, checkpoint: dict[str, Any], path: Path) -> None:
    """Write ``checkpoint`` as Lightning lays out a sharded one: the weights and each optimizer's state as shards of
    every rank, the rest in Lightning's metadata file (once published, the side files of older saves of ``path``
    go)."""
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    tensors.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
    saves.sharded(tensors, {_METADATA_FILENAME: checkpoint}, path, step=checkpoint.get("global_step"))


def drop_group_keys_not_saved(checkpoint_path: Any, optimizers: list[torch.optim.Optimizer]) -> None:
    """Remove from each optimizer's param groups the keys the sharded checkpoint at ``checkpoint_path`` does not hold
    (a scheduler adds ``initial_lr`` after a save, as ``lr_find`` does between its save and its restore): torch's own
    load replaces the groups with the saved ones, where ``torch.distributed.checkpoint`` loads the keys the live
    groups have, and fails on one the checkpoint lacks."""
    path = Path(checkpoint_path)
    if not (path / SHARDED_METADATA).is_file():
        return
    saved = set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    for index, optimizer in enumerate(optimizers):
        prefix = f"optimizer_{index}.param_groups"
        if not any(key.startswith(prefix) for key in saved):
            continue
        for number, group in enumerate(optimizer.param_groups):
            for key in [key for key in group if key != "params" and f"{prefix}.{number}.{key}" not in saved]:
                del group[key]


def with_saved_group_keys(
    read: Callable[[Any], dict[str, Any]], optimizers: list[torch.optim.Optimizer]
) -> Callable[[Any], dict[str, Any]]:
    """``read`` (a load of one checkpoint path) with each optimizer's param groups first reduced to the keys that
    checkpoint holds (:func:`drop_group_keys_not_saved`), inside the load: a checkpoint whose index does not read is
    then a failed load, which the fall-back to an older checkpoint takes, not an error before it."""

    def load(checkpoint_path: Any) -> dict[str, Any]:
        drop_group_keys_not_saved(checkpoint_path, optimizers)
        return read(checkpoint_path)

    return load
