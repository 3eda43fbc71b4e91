"""FSDP2 (``torch.distributed.fsdp.fully_shard``) applied per block, then to the root.

Modes: ``"zero3"`` gathers each block's parameters for its forward and again for its backward (least memory);
``"zero2"`` keeps them gathered from forward to backward and across accumulation micro-batches; ``"hsdp"`` shards
within groups of ``hsdp_group_size`` ranks and replicates across groups. FSDP2 gathers a unit's parameters only when
that module itself is called, so the root unit is :class:`RootUnit` around the model (``docs/fsdp.md``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils._pytree import tree_map_only

from lightning_fastdist.parallel.fsdp.fp32_modules import OWN_DTYPE_POLICY, refuse_dtype_changes
from lightning_fastdist.parallel.plan.blocks import block_modules, resolve_blocks
from lightning_fastdist.parallel.plan.idle_experts import IdleExperts
from lightning_fastdist.parallel.plan.parallel_plan import ParallelPlan, PreparedBlocks
from lightning_fastdist.parallel.plan.shared_parameters import blocks_sharing_parameters

ShardingMode = Literal["zero3", "zero2", "hsdp"]
SHARDING_MODES: tuple[str, ...] = get_args(ShardingMode)
# Appended to the blocks line for a model without blocks.
ONE_UNIT = "; FSDP shards the whole model as one unit (name its blocks for one unit each)"

# Lightning precision name -> (dtype FSDP computes in, dtype it reduces gradients in).
# "-true" precisions convert the module itself, so FSDP keeps the parameters' dtype.
_MIXED_PRECISION_DTYPES = {"bf16-mixed": (torch.bfloat16, torch.float32), "16-mixed": (torch.float16, torch.float32)}


def fsdp_dtypes(precision: str) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)`` of the FSDP mixed-precision policy for a Lightning precision name."""
    return _MIXED_PRECISION_DTYPES.get(precision, (None, None))


@dataclass(frozen=True)
class FSDPSharding:
    """How FSDP shards a model (the module docstring describes the modes); it checks itself once, when built.

    Args:
        hsdp_group_size: ranks per shard group under ``"hsdp"``; ``None`` until :meth:`for_world` fixes it.
        cpu_offload: keep the sharded parameters, gradients and optimizer step on the CPU and copy each unit to the
            device for its compute (on a CPU mesh nothing moves, so a GPU recipe runs unchanged on CPU).
        keep_fp32: class names of modules that keep their parameters in their own dtype under mixed precision (a
            router that casts itself to float32): each instance is a unit of its own, gathered and reduced so.
    """

    mode: ShardingMode = "zero3"
    hsdp_group_size: int | None = None
    cpu_offload: bool = False
    keep_fp32: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.keep_fp32, (list, tuple)) or not all(isinstance(n, str) for n in self.keep_fp32):
            raise ValueError(f"keep_fp32: got {self.keep_fp32!r}; use a list of module class names, e.g. ['Router'].")
        object.__setattr__(self, "keep_fp32", tuple(self.keep_fp32))
        if self.mode not in SHARDING_MODES:
            raise ValueError(f"sharding: got {self.mode!r}; use one of {', '.join(map(repr, SHARDING_MODES))}.")
        group = self.hsdp_group_size
        if group is None:
            return
        if self.mode != "hsdp":
            raise ValueError(
                f"hsdp_group_size: only used with sharding='hsdp', got sharding={self.mode!r}; remove it or use 'hsdp'."
            )
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise ValueError(f"hsdp_group_size: got {group!r}; use a positive integer that divides the world size.")

    def for_world(self, world_size: int, devices_per_node: int) -> FSDPSharding:
        """This sharding with HSDP's group size fixed for ``world_size`` ranks (default: one node's devices)."""
        if self.mode != "hsdp":
            return self
        group = self.hsdp_group_size or devices_per_node
        if world_size % group != 0:
            divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
            raise ValueError(
                f"hsdp_group_size: {group} does not divide the world size {world_size}; use one of {divisors}."
            )
        return dataclasses.replace(self, hsdp_group_size=group)

    def mesh(self, device_type: str, world_size: int) -> DeviceMesh:
        """The device mesh to shard over: 1-D ``("shard",)``, or 2-D ``("replicate", "shard")`` for ``"hsdp"``.

        Under ``"hsdp"``, call it on the result of :meth:`for_world`.
        """
        if self.mode != "hsdp":
            return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
        assert self.hsdp_group_size is not None, "FSDPSharding.mesh: fix the HSDP group with for_world() first"
        shape = (world_size // self.hsdp_group_size, self.hsdp_group_size)
        return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))

    def shard(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        block_classes: Sequence[type[nn.Module]],
        precision: str = "32-true",
        selectively_checkpointed: Sequence[nn.Module] = (),
    ) -> list[nn.Module]:
        """Shard ``model`` in place, each block an FSDP unit (inner blocks first); return the units, the root last.

        Args:
            model: its parameters may live on the meta device (materialise them afterwards).
            block_classes: module classes whose instances become FSDP units; parameters outside every block belong
                to the root unit, and so do those of a block that shares a parameter outside it.
            precision: a Lightning precision name; ``"bf16-mixed"``/``"16-mixed"`` set the mixed-precision policy.
            selectively_checkpointed: blocks under selective checkpointing. FSDP casts a unit's inputs in a
                pre-forward hook that runs before checkpointing's in the forward but inside the recomputation in
                the backward, where selective checkpointing meets ops the forward never ran and fails. These
                blocks cast their inputs in a hook of their own, inside the checkpointed region both times.
        """
        param_dtype, reduce_dtype = fsdp_dtypes(precision)
        mixed_precision = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        # The root's inputs are whatever reaches it (a whole batch, targets included): each block casts its own.
        root_mixed_precision = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
        )
        # Pinned host memory makes the copies to a GPU asynchronous; without an accelerator torch cannot pin.
        offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if self.cpu_offload else OffloadPolicy()
        # Children before parents: fully_shard must see a block's own parameters before an enclosing unit claims them.
        units = self.units(model, block_classes)
        own_dtype = {id(module) for module in self._fp32_modules(model)}
        cast_inside = {id(block) for block in selectively_checkpointed} if param_dtype is not None else set()
        for unit in units:
            policy = root_mixed_precision if unit is model else mixed_precision
            if id(unit) in own_dtype:
                policy = OWN_DTYPE_POLICY
            elif param_dtype is not None:
                refuse_dtype_changes(unit, units, param_dtype)
            if id(unit) in cast_inside:
                policy = root_mixed_precision  # no cast in FSDP's hook: the block's own hook casts
                unit.register_forward_pre_hook(functools.partial(_cast_floating_inputs, param_dtype), with_kwargs=True)
            # The root ends the forward and starts the backward: resharding it in between would only gather the
            # same weights again at once, so it stays gathered, as FSDP2 does for a root by default.
            reshard_after_forward = self.mode != "zero2" and unit is not model
            fully_shard(
                unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy, offload_policy=offload
            )
        return units

    def units(self, model: nn.Module, block_classes: Sequence[type[nn.Module]]) -> list[nn.Module]:
        """The modules :meth:`shard` makes FSDP units, in the order it shards them (children before parents):
        the ``keep_fp32`` modules, each block that shares no parameter outside itself, then ``model``."""
        own_dtype = self._fp32_modules(model)
        blocks = [block for block in block_modules(model, block_classes) if block not in own_dtype]
        kept = {id(entry.block) for entry in blocks_sharing_parameters(model, blocks)}
        return [*reversed(own_dtype), *reversed([block for block in blocks if id(block) not in kept]), model]

    def refuse_unreduced_root(
        self, model: nn.Module, block_classes: Sequence[type[nn.Module]], backward_in_step: bool
    ) -> None:
        """Refuse in one line a model trained with a backward inside its step (``backward_in_step``: Lightning's manual
        optimization) that would be one FSDP unit.

        FSDP reduces a unit's gradients from hooks on the outputs of its forward. The root's forward is the whole
        step, so a ``manual_backward`` inside it reaches no hook of a one-unit model: the gradients are never
        reduced and the parameters do not move as DDP's do. Any block called in the step starts FSDP's end-of-
        backward reduction, the root's gradients included, so naming the classes of the model's children as
        blocks fixes it.
        """
        if (
            not backward_in_step
            or len(self.units(model, block_classes)) > 1
            or not any(True for _ in model.parameters())
        ):
            return
        children = sorted({type(child).__name__ for child in model.children() if any(True for _ in child.parameters())})
        fix = (
            f"use blocks: [{', '.join(children)}]"
            if children
            else "move its parameters into a submodule the step calls"
        )
        raise ValueError(
            f"blocks: under manual optimization {type(model).__name__} needs blocks (a backward inside the step "
            f"does not reduce a model sharded as one unit), and none were found; {fix}."
        )

    def _fp32_modules(self, model: nn.Module) -> list[nn.Module]:
        if not self.keep_fp32:
            return []
        return block_modules(model, resolve_blocks(model, list(self.keep_fp32), option="keep_fp32"))

    @contextmanager
    def accumulating(self, root: FSDPModule) -> Generator[None, None, None]:
        """A non-final accumulation micro-batch of ``root``: no gradient reduce-scatter (nor HSDP all-reduce).

        Under ``zero2`` the gathered weights also stay gathered after such a micro-batch's backward: the next
        forward needs them unchanged, so one all-gather per optimizer step replaces one per micro-batch. Memory does
        not grow: ZeRO-2 holds every gathered weight at the end of each forward anyway.
        """
        keep_gathered = self.mode == "zero2"
        root.set_requires_gradient_sync(False)
        if keep_gathered:
            root.set_reshard_after_backward(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)
            if keep_gathered:
                root.set_reshard_after_backward(True)


class ShardedModel(NamedTuple):
    """What :func:`shard_model` built: the root unit, every FSDP unit (the root last), the plan's blocks and the
    experts that may sit idle."""

    root: RootUnit
    units: list[nn.Module]
    prepared: PreparedBlocks
    idle_experts: IdleExperts


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: ParallelPlan,
    sharding: FSDPSharding,
    precision: str = "32-true",
    log: Callable[[str], object] = lambda line: None,
) -> ShardedModel:
    """Apply ``plan`` to ``model`` in place with FSDP as its wrapper; return the root, the units and the blocks.

    Every block is sharded first, the root (a :class:`RootUnit` around ``model``, holding what is left) last; the order
    of the plan's steps is ``docs/plan.md``'s. Meta-device parameters stay there: materialise each rank's shard
    afterwards. ``FastFSDPStrategy`` and ``doctor --simulate`` both run this function, so what is simulated trains.
    """

    def wrap(model: nn.Module, prepared: PreparedBlocks) -> tuple[RootUnit, list[nn.Module], IdleExperts]:
        root = RootUnit(model)
        # Hooked before fully_shard: see IdleExperts.
        idle_experts = IdleExperts(root, sharding.units(root, prepared.block_classes))
        selective = prepared.checkpointed if prepared.selective else ()
        return root, sharding.shard(root, mesh, prepared.block_classes, precision, selective), idle_experts

    (root, units, idle), prepared = plan.apply(model, wrap, wrapper_uses_blocks=True, without_blocks=ONE_UNIT, log=log)
    return ShardedModel(root, units, prepared, idle)


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


def reshard_everywhere(model: nn.Module) -> None:
    """Free every gathered parameter of ``model``'s FSDP units, so that its parameters are the sharded ones again
    (the root keeps its gathered after an evaluation forward, which no backward follows)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
