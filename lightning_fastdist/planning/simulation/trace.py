"""Trace one setup's training step on this rank: the recipe's model changed as the strategy changes it, trained for
two steps with its own ``training_step`` and first optimizer, the second measured.

Inside :func:`~lightning_fastdist.planning.step_memory.fake_world` the model lives on the meta device and runs on
fake tensors (rank 0 of a world of N, no memory); outside it the same code trains for real in the current process
group, the reference a simulation is checked against.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import _configure_optimizers
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves, tree_map_only

from lightning_fastdist.parallel.ddp.buckets import auto_bucket_cap_mb
from lightning_fastdist.parallel.fsdp.sharding import FSDPSharding, fsdp_dtypes, shard_model
from lightning_fastdist.parallel.plan.blocks import block_modules, resolve_blocks
from lightning_fastdist.parallel.plan.parallel_plan import ParallelPlan
from lightning_fastdist.planning.setup import Setup
from lightning_fastdist.planning.simulation.recipe_run import NotTraceable, RecipeRun, build_model
from lightning_fastdist.planning.step_memory import StepMemory, measure_step, to_empty_keeping_ties

TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}  # precisions that cast the model itself


@dataclass(frozen=True)
class TracedStep:
    """One setup's measured step, and the model's parameter counts (``N``; ``R``, those outside the blocks)."""

    memory: StepMemory
    parameters: int
    root_parameters: int


def measure_setup(
    run: RecipeRun,
    batch: Any,
    setup: Setup,
    gpus_per_node: int,
    precision: str | None = None,
    fake: bool = True,
    ranks: int | None = None,
) -> TracedStep:
    """Build the model, apply ``setup``'s plan, and measure its second training step on this rank.

    Args:
        batch: one batch of the recipe's data (real tensors).
        setup: its engine, sharding and activation checkpointing are applied. DeepSpeed's engine cannot run on fake
            tensors: its setups trace the model in ``precision`` alone, without an optimizer (its state is the
            formula's, the same at every stage).
        gpus_per_node: the shard group of ``hsdp``.
        precision: overrides the recipe's (DeepSpeed's activations run in its own dtype).
        fake: on the meta device and fake tensors (inside ``fake_world``); without, trained for real.
        ranks: FSDP shards over the world's first ``ranks`` (one node's, as under ``outer_sync``); ``None``: all.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415 - private torch API

    precision = precision or run.precision
    world_size = ranks or dist.get_world_size()
    module = build_model(run, fake)
    parameters = sum(p.numel() for p in module.parameters() if p.requires_grad)
    block_classes = resolve_blocks(module, run.blocks)
    in_blocks = {id(p) for block in block_modules(module, block_classes) for p in block.parameters()}
    root_parameters = sum(p.numel() for p in module.parameters() if p.requires_grad and id(p) not in in_blocks)
    if precision in TRUE_DTYPES:
        module = module.to(TRUE_DTYPES[precision])
    plan = ParallelPlan(run.blocks, setup.activation_checkpointing)
    if setup.engine == "FSDP2":
        sharding = FSDPSharding(setup.sharding).for_world(world_size, devices_per_node=gpus_per_node)
        trained = shard_model(module, sharding.mesh("cpu", world_size), plan, sharding, precision).root
    else:
        trained, _ = plan.apply(module)
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext() as fake_mode:
        if not fake:
            if setup.engine == "DDP":  # as FastDDPStrategy wraps it
                trained = DistributedDataParallel(
                    module, gradient_as_bucket_view=True, bucket_cap_mb=auto_bucket_cap_mb(module)
                )
        elif trained is module:
            to_empty_keeping_ties(module, "cpu")
        else:
            trained.to_empty(device="cpu")  # FSDP2's own, which keeps ties
        optimizer = None if setup.engine == "DeepSpeed" else _first_optimizer(module)
        if fake:
            batch = tree_map_only(torch.Tensor, fake_mode.from_tensor, batch)
        if precision in TRUE_DTYPES:
            dtype = TRUE_DTYPES[precision]
            batch = tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, batch)
        step = _forward_backward(trained, module, batch, _autocast(precision))
        inputs = tuple(t for t in tree_leaves(batch) if isinstance(t, torch.Tensor))
        memory = measure_step(
            trained, optimizer, step, inputs, keep_gradients=setup.engine == "DDP", warm_up_on_zero_gradients=fake
        )
    return TracedStep(memory, parameters, root_parameters)


def _first_optimizer(model: LightningModule) -> torch.optim.Optimizer:
    optimizers, _, _ = _configure_optimizers(model.configure_optimizers())
    if not optimizers:
        raise NotTraceable("configure_optimizers returned no optimizer")
    return optimizers[0]


def _autocast(precision: str) -> Callable[[], AbstractContextManager]:
    dtype, _ = fsdp_dtypes(precision)  # what a mixed precision computes in (None: no autocast)
    if dtype is None:
        return nullcontext
    return lambda: torch.autocast("cpu", dtype=dtype, cache_enabled=False)


def _forward_backward(
    trained: nn.Module, module: LightningModule, batch: Any, autocast: Callable[[], AbstractContextManager]
) -> Callable[[], None]:
    """One ``training_step`` and its backward, run the way the strategy runs it (through the root unit under FSDP)."""
    redirect = _ForwardRedirection()

    def forward_backward() -> None:
        with autocast():
            if trained is module:
                output = module.training_step(batch, 0)
            else:
                output = redirect(trained, module, "training_step", batch, 0)
        loss = output["loss"] if isinstance(output, dict) else output
        if not isinstance(loss, torch.Tensor):
            raise NotTraceable("training_step returned no loss tensor (manual optimization is not simulated)")
        loss.backward()

    return forward_backward
