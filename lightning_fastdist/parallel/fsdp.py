"""FSDP2 (``torch.distributed.fsdp.fully_shard``) applied per block, then to the root.

Sharding modes:

- ``"zero3"``: parameters, gradients and optimizer state are sharded; each
  block's parameters are gathered for its forward and freed right after
  (gathered again for backward). Least memory.
- ``"zero2"``: as ``zero3``, but a block's gathered parameters stay between its
  forward and its backward: one all-gather per block per step instead of two,
  at the price of holding the full parameters during the step.
- ``"hsdp"``: hybrid sharding on a 2-D mesh ``(replicate, shard)``: shard
  within groups of ``group_size`` ranks (ZeRO-3 style), replicate across groups.

FSDP2 gathers a unit's parameters in a forward pre-hook, which runs only when
that module itself is called. A LightningModule as the root unit would have its
parameters (embeddings, head) gathered only through ``self(...)``, never when a
step calls ``self.model(...)`` or another submodule. :class:`RootUnit` is a
root around the model instead: Lightning runs each step through its forward
(forward redirection, as for DDP), so the root's hooks run around the whole step.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils._pytree import tree_map_only

from lightning_fastdist.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_fastdist.parallel.blocks import block_modules
from lightning_fastdist.parallel.compile import apply_compile

SHARDING_MODES = ("zero3", "zero2", "hsdp")

# Lightning precision name -> (dtype FSDP computes in, dtype it reduces gradients in).
# "-true" precisions convert the module itself, so FSDP keeps the parameters' dtype.
_MIXED_PRECISION_DTYPES = {
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "16-mixed": (torch.float16, torch.float32),
}


def fsdp_dtypes(precision: str) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)`` of the FSDP mixed-precision policy for a Lightning precision name."""
    return _MIXED_PRECISION_DTYPES.get(precision, (None, None))


def validate_sharding(sharding: str, hsdp_group_size: int | None, world_size: int | None = None) -> None:
    """Raise one clear ``ValueError`` for an unknown mode or an HSDP group size that cannot split ``world_size``.

    Args:
        sharding: one of :data:`SHARDING_MODES`.
        hsdp_group_size: ranks per shard group under ``"hsdp"``; ``None`` leaves it to the caller's default.
        world_size: total ranks, when known; ``None`` checks only what does not depend on it.
    """
    if sharding not in SHARDING_MODES:
        raise ValueError(f"sharding: got {sharding!r}; use one of {', '.join(map(repr, SHARDING_MODES))}.")
    if hsdp_group_size is None:
        return
    if sharding != "hsdp":
        raise ValueError(
            f"hsdp_group_size: only used with sharding='hsdp', got sharding={sharding!r}; remove it or use 'hsdp'."
        )
    if isinstance(hsdp_group_size, bool) or not isinstance(hsdp_group_size, int) or hsdp_group_size < 1:
        raise ValueError(
            f"hsdp_group_size: got {hsdp_group_size!r}; use a positive integer that divides the world size."
        )
    if world_size is not None and world_size % hsdp_group_size != 0:
        raise ValueError(
            f"hsdp_group_size: {hsdp_group_size} does not divide the world size {world_size}; "
            f"use one of {', '.join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)}."
        )


def build_fsdp_mesh(device_type: str, world_size: int, sharding: str, hsdp_group_size: int) -> DeviceMesh:
    """The device mesh FSDP shards over: 1-D ``("shard",)``, or 2-D ``("replicate", "shard")`` for ``"hsdp"``.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ...
        world_size: total number of ranks.
        sharding: one of :data:`SHARDING_MODES`.
        hsdp_group_size: ranks per shard group (used by ``"hsdp"`` only).
    """
    validate_sharding(sharding, hsdp_group_size if sharding == "hsdp" else None, world_size)
    if sharding == "hsdp":
        return init_device_mesh(
            device_type, (world_size // hsdp_group_size, hsdp_group_size), mesh_dim_names=("replicate", "shard")
        )
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    block_classes: Sequence[type[nn.Module]],
    sharding: str = "zero3",
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    selectively_checkpointed: Sequence[nn.Module] = (),
) -> list[nn.Module]:
    """Shard ``model`` in place: each block becomes an FSDP unit (inner blocks first), the root last.

    Args:
        model: the model; its parameters may live on the meta device (materialise them afterwards).
        mesh: from :func:`build_fsdp_mesh`.
        block_classes: module classes whose instances become FSDP units; the
            parameters outside every block (embeddings, head) belong to the root unit.
        sharding: one of :data:`SHARDING_MODES`.
        param_dtype: dtype that forward and backward compute in (``None``: the parameters' own dtype).
        reduce_dtype: dtype of the gradient reduce-scatter (``None``: ``param_dtype``).
        cpu_offload: keep the sharded parameters, gradients and optimizer step on
            the CPU and copy each unit to the device for its compute (on a CPU mesh
            nothing moves, which lets a GPU recipe run unchanged on CPU).
        selectively_checkpointed: blocks under selective checkpointing. FSDP casts a unit's inputs to
            ``param_dtype`` in a pre-forward hook that runs before checkpointing's in the forward but
            inside the recomputation in the backward, where selective checkpointing meets ops the
            forward never ran and fails. These blocks cast their inputs in a hook of their own, inside
            the checkpointed region both times.

    Returns:
        The modules that were sharded, the root last.
    """
    validate_sharding(sharding, None)
    mixed_precision = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # The root's inputs are whatever reaches it (a whole batch, targets included, when a step runs
    # through it): it leaves them as they are, and each block casts its own inputs.
    root_mixed_precision = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    # Pinned host memory makes the copies to a GPU asynchronous; without an accelerator
    # torch cannot pin, and the "offloaded" state is where it already was.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else OffloadPolicy()
    # Children before parents: fully_shard must see a block's own parameters
    # before an enclosing unit claims them.
    units = [*reversed(block_modules(model, block_classes)), model]
    cast_inside = {id(block) for block in selectively_checkpointed} if param_dtype is not None else set()
    for unit in units:
        policy = root_mixed_precision if unit is model else mixed_precision
        if id(unit) in cast_inside:
            policy = root_mixed_precision  # no cast in FSDP's hook: the block's own hook casts
            unit.register_forward_pre_hook(functools.partial(_cast_floating_inputs, param_dtype), with_kwargs=True)
        # The root (embeddings, final norm, head) ends the forward and starts the backward:
        # resharding it in between would only gather the same weights again at once, so it
        # stays gathered, as FSDP2 does for a root by default.
        reshard_after_forward = sharding != "zero2" and unit is not model
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=policy,
            offload_policy=offload,
        )
    return units


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    block_classes: Sequence[type[nn.Module]],
    sharding: str = "zero3",
    activation_checkpointing: str | int = "none",
    precision: str = "32-true",
    cpu_offload: bool = False,
    compile_config: Mapping[str, Any] | None = None,
    compile_scope: str = "blocks",
) -> tuple[RootUnit, list[nn.Module], list[nn.Module]]:
    """Checkpoint, compile and shard ``model`` in place, in this fixed order; return the root, units, compiled regions.

    1. Activation checkpointing, per block: its hooks must sit inside the FSDP
       unit so that a recomputed block finds its parameters gathered.
    2. ``torch.compile`` of each block's (or the model's) ``forward``: after
       checkpointing, whose hooks then run around the compiled forward, and
       before FSDP, whose all-gather hooks stay outside the compiled graph.
    3. FSDP: every block first, the root last: a :class:`RootUnit` around
       ``model`` that takes what is left (embeddings, final norm, head).
       Parameters on the meta device stay there; materialise each rank's shard afterwards.

    ``FastFSDPStrategy`` and ``doctor --simulate`` both run this function, so what is
    simulated is what trains.

    Args:
        model: the model (a LightningModule or any ``nn.Module``).
        mesh: from :func:`build_fsdp_mesh`.
        block_classes: the resolved blocks (:func:`~lightning_fastdist.parallel.blocks.resolve_blocks`).
        sharding: one of :data:`SHARDING_MODES`.
        activation_checkpointing: ``"none"``, ``"full"``, ``"selective"`` or ``n`` (see
            :func:`~lightning_fastdist.parallel.activation_checkpointing.apply_activation_checkpointing`).
        precision: a Lightning precision name; ``"bf16-mixed"``/``"16-mixed"`` set FSDP's mixed-precision policy.
        cpu_offload: see :func:`apply_fsdp`.
        compile_config: ``torch.compile`` arguments, or ``None`` for no compile.
        compile_scope: ``"blocks"`` or ``"model"``.
    """
    checkpointed = apply_activation_checkpointing(model, activation_checkpointing, block_classes)
    compiled = apply_compile(model, compile_config, compile_scope, block_classes) if compile_config is not None else []
    param_dtype, reduce_dtype = fsdp_dtypes(precision)
    root = RootUnit(model)
    units = apply_fsdp(
        root,
        mesh,
        block_classes,
        sharding=sharding,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        cpu_offload=cpu_offload,
        selectively_checkpointed=checkpointed if activation_checkpointing == "selective" else (),
    )
    return root, units, compiled


def _cast_floating_inputs(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook: floating-point tensors among the inputs cast to ``dtype``, as FSDP's policy would."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor

    return tree_map_only(torch.Tensor, cast, args), tree_map_only(torch.Tensor, cast, kwargs)


class RootUnit(nn.Module):
    """The root FSDP unit around a model: calling it calls the model, so a step redirected through it runs inside
    the root's hooks (its parameters gathered before, their gradients reduced after the backward).

    The model called directly, outside such a call (a callback's ``pl_module(x)``), gathers the root's
    parameters for that forward and frees them after it: forward only, for generating or logging; its
    gradients would not be reduced. Its ``module`` keeps the model's own names: save and load the
    model's state, not this wrapper's (whose keys carry a ``module.`` prefix).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._running = False
        module.register_forward_pre_hook(self._gather_for_a_direct_call)
        module.register_forward_hook(self._free_after_a_direct_call)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._running = True
        try:
            return self.module(*args, **kwargs)
        finally:
            self._running = False

    def _gather_for_a_direct_call(self, module: nn.Module, args: Any) -> None:
        if not self._running and isinstance(self, FSDPModule):
            self.unshard()

    def _free_after_a_direct_call(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._running and isinstance(self, FSDPModule):
            self.reshard()
