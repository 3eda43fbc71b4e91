"""``doctor --simulate``: trace one training step of the recipe's own model as rank 0 of a world of N ranks.

For each setup and checkpointing mode the model is built on the meta device, changed as the strategies change it,
materialised as fake tensors and trained for two steps with its own ``training_step``; the second is measured. What
each row stands for (DDP's buckets, DeepSpeed's formula state, offload, ``outer_sync``, ``replica_groups``):
docs/doctor.md, "--simulate".
"""

from __future__ import annotations

import collections
import functools
import multiprocessing
import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, replace
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
from lightning_fastdist.parallel.plan.activation_checkpointing import ACTIVATION_CHECKPOINTING_MODES
from lightning_fastdist.parallel.plan.blocks import block_modules, outermost_block_modules, resolve_blocks
from lightning_fastdist.parallel.plan.parallel_plan import ParallelPlan
from lightning_fastdist.parallel.semi_sync.fragments import split_into_fragments
from lightning_fastdist.parallel.semi_sync.settings import OUTER_SYNC_FORMS, OuterSync, OuterSyncForm, form_of
from lightning_fastdist.planning.advisor import REPLICA_GROUPS_MODES
from lightning_fastdist.planning.comm_model import CommEstimate, comm_per_step, outer_sync_sent_per_step
from lightning_fastdist.planning.fsdp_shards import shard_numels
from lightning_fastdist.planning.memory_model import (
    DEEPSPEED_MODES,
    FSDP_MODES,
    deepspeed_activation_precision,
    deepspeed_state,
)
from lightning_fastdist.planning.outer_sync_memory import OuterSyncMemory, outer_sync_memory
from lightning_fastdist.planning.setup import Setup
from lightning_fastdist.planning.step_memory import (
    StepMemory,
    fake_world,
    join_fake_world,
    measure_step,
    to_empty_keeping_ties,
    tracing_unavailable,
)
from lightning_fastdist.recipes.recipe import Recipe, RecipeError, build

PARALLEL_FROM_PARAMETERS = 10**9
FSDP_SETUPS = (*FSDP_MODES, "hsdp")
_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
# StepMemory's fields in the order the JSON's per_rank lists them (docs/doctor.md)
PER_RANK_JSON = ("params", "grads", "optimizer", "activations_peak", "peak", "gathered_peak")


class NotTraceable(Exception):
    """The model or its step cannot be traced with fake tensors; the message says why, in one line."""


def _outer_sync_name(setup: str, settings: OuterSync) -> str:
    """Bench's name of ``setup`` (``ddp``, ``zero3``) with ``settings``' form of ``outer_sync``."""
    return replace(Setup.from_plan_key(setup, "none", False), outer_sync=form_of(settings)).name


@dataclass(frozen=True)
class SimulatedSetup:
    """One row of the simulation: a setup, its checkpointing, and one rank's bytes.

    Attributes:
        setup: ``ddp``, ``zero2``, ``zero3``, ``hsdp`` or ``ds-zero1/2/3``.
        activation_checkpointing: ``none``, ``full`` or ``selective``.
        memory: bytes per rank; under ``outer_sync``, of a rank that holds the outer state (on ``ddp`` each node's
            local rank 0; on ``zero3``, sharded over one node's ranks, a node's rank 0, whose shards are the largest).
        comm_bytes_per_step: bytes each rank sends per optimizer step on a ring.
        method: ``traced``, ``formula state, traced activations`` (DeepSpeed), ``derived`` (offload,
            ``outer_sync``) or ``traced + kept gradient copy`` (``replica_groups``).
        outer_sync: DiLoCo's options on top of ``ddp`` or ``zero3``; ``None``: every step is synchronous.
        outer_memory: what ``outer_sync`` adds (its device bytes are in ``memory`` already, its host bytes only here).
    """

    setup: str
    activation_checkpointing: str
    cpu_offload: bool
    memory: StepMemory
    comm_bytes_per_step: int
    method: str = "traced"
    outer_sync: OuterSync | None = None
    outer_memory: OuterSyncMemory | None = None

    @property
    def name(self) -> str:
        """:attr:`setup`, or under ``outer_sync`` bench's name (``ddp-diloco``, ``fsdp-zero3-streaming-diloco``)."""
        return self.setup if self.outer_sync is None else _outer_sync_name(self.setup, self.outer_sync)

    @property
    def plan_key(self) -> tuple[str, str, bool]:
        """``(setup, activation_checkpointing, cpu_offload)``: the ``Setup.plan_key`` of the setup this row measured."""
        return self.setup, self.activation_checkpointing, self.cpu_offload

    def as_json(self, usable_bytes: int) -> dict[str, Any]:
        m = self.memory
        document = {
            "setup": self.name,
            "activation_checkpointing": self.activation_checkpointing,
            "cpu_offload": self.cpu_offload,
            "per_rank": {key: getattr(m, key) for key in PER_RANK_JSON},
            "fits": m.peak <= usable_bytes,
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "method": self.method,
        }
        if self.outer_sync is not None and self.outer_memory is not None:
            document["outer_sync"] = {"options": asdict(self.outer_sync), **asdict(self.outer_memory)}
        return document


@dataclass(frozen=True)
class RecipeRun:
    """What the simulation takes from a recipe: its ``model:`` and ``data:`` sections, its precision (``trainer``'s or
    a precision plugin's), ``accumulate_grad_batches`` and its strategy's ``blocks``, ``outer_sync`` and
    ``replica_groups`` options."""

    model: dict
    data: dict
    precision: str = "32-true"
    accumulation: int = 1
    blocks: str | list[str] = "auto"
    outer_sync: dict | None = None
    replica_groups: dict | None = None

    @classmethod
    def of(cls, recipe: Recipe, micro_batch: int | None = None) -> RecipeRun:
        """What ``recipe`` trains, at ``micro_batch`` samples per batch (``None``: the recipe's)."""
        data = recipe.section("data")
        if micro_batch is not None:
            data["init_args"]["batch_size"] = micro_batch
        options = recipe.strategy_options
        return cls(
            recipe.section("model"), data, recipe.precision, recipe.accumulation, recipe.blocks,
            options.get("outer_sync"), options.get("replica_groups"),
        )  # fmt: skip


def _instantiate(kind: str, section: dict) -> Any:
    try:
        return build(kind, section)
    except RecipeError as error:
        raise NotTraceable(str(error)) from None


def first_batch(data_section: dict) -> Any:
    """One training batch of the recipe's data module, as its ``train_dataloader`` gives it (real tensors, small)."""
    data = _instantiate("data", data_section)
    data.prepare_data()
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def _build(run: RecipeRun, fake: bool) -> LightningModule:
    with torch.device("meta") if fake else nullcontext():
        return _instantiate("model", run.model)


def _first_optimizer(model: LightningModule) -> torch.optim.Optimizer:
    optimizers, _, _ = _configure_optimizers(model.configure_optimizers())
    if not optimizers:
        raise NotTraceable("configure_optimizers returned no optimizer")
    return optimizers[0]


@dataclass(frozen=True)
class TracedStep:
    """One setup's measured step, and the model's parameter counts (``N``; ``R``, those outside the blocks)."""

    memory: StepMemory
    parameters: int
    root_parameters: int


def measure_setup(
    run: RecipeRun,
    batch: Any,
    setup: str,
    checkpointing: str,
    gpus_per_node: int,
    precision: str | None = None,
    fake: bool = True,
    ranks: int | None = None,
) -> TracedStep:
    """Build the model, apply ``setup``'s plan, and measure its second training step on this rank.

    With ``fake`` (inside :func:`fake_world`) the model is built on the meta device and runs on fake tensors; without,
    it trains for real in the current process group: the reference a simulation is checked against.

    Args:
        batch: one batch of the recipe's data (real tensors).
        setup: ``ddp``, ``zero2``, ``zero3``, ``hsdp``, or ``ds`` (the model in ``precision`` alone).
        checkpointing: ``none``, ``full`` or ``selective``.
        gpus_per_node: the shard group of ``hsdp``.
        precision: overrides the recipe's (DeepSpeed's activations run in its own dtype).
        ranks: FSDP shards over the world's first ``ranks`` (one node's, as under ``outer_sync``); ``None``: all.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415 - private torch API

    precision = precision or run.precision
    world_size = ranks or dist.get_world_size()
    module = _build(run, fake)
    parameters = sum(p.numel() for p in module.parameters() if p.requires_grad)
    block_classes = resolve_blocks(module, run.blocks)
    in_blocks = {id(p) for block in block_modules(module, block_classes) for p in block.parameters()}
    root_parameters = sum(p.numel() for p in module.parameters() if p.requires_grad and id(p) not in in_blocks)
    if precision in _TRUE_DTYPES:
        module = module.to(_TRUE_DTYPES[precision])
    plan = ParallelPlan(run.blocks, checkpointing)
    if setup in FSDP_SETUPS:
        sharding = FSDPSharding(setup).for_world(world_size, devices_per_node=gpus_per_node)
        trained = shard_model(module, sharding.mesh("cpu", world_size), plan, sharding, precision).root
    else:
        trained, _ = plan.apply(module)
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext() as fake_mode:
        if not fake:
            if setup == "ddp":  # as FastDDPStrategy wraps it
                trained = DistributedDataParallel(
                    module, gradient_as_bucket_view=True, bucket_cap_mb=auto_bucket_cap_mb(module)
                )
        elif trained is module:
            to_empty_keeping_ties(module, "cpu")
        else:
            trained.to_empty(device="cpu")  # FSDP2's own, which keeps ties
        optimizer = None if setup == "ds" else _first_optimizer(module)  # DeepSpeed's state is the formula's
        if fake:
            batch = tree_map_only(torch.Tensor, fake_mode.from_tensor, batch)
        if precision in _TRUE_DTYPES:
            dtype = _TRUE_DTYPES[precision]
            batch = tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, batch)
        step = _forward_backward(trained, module, batch, _autocast(precision))
        inputs = tuple(t for t in tree_leaves(batch) if isinstance(t, torch.Tensor))
        memory = measure_step(
            trained, optimizer, step, inputs, keep_gradients=setup == "ddp", warm_up_on_zero_gradients=fake
        )
    return TracedStep(memory, parameters, root_parameters)


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


def _offload_rows(rows: list[SimulatedSetup]) -> list[SimulatedSetup]:
    """The advisor's offload setups, derived from traced rows."""
    derived = []
    for row in rows:
        m = row.memory
        if row.setup == "zero3" and row.activation_checkpointing == "full":
            # FSDP's offload keeps the sharded parameters, gradients and optimizer state on the host.
            on_device = replace(m, params=0, grads=0, optimizer=0, peak=m.peak - m.state)
            derived.append(replace(row, cpu_offload=True, memory=on_device, method="derived"))
        if row.setup == "ds-zero2" and row.activation_checkpointing in ("none", "full"):
            # ZeRO-Offload: the optimizer state (and its step) on the host, weights and gradients stay.
            on_device = replace(m, optimizer=0, peak=m.peak - m.optimizer)
            derived.append(replace(row, cpu_offload=True, memory=on_device, method="derived"))
    return derived


@dataclass(frozen=True)
class Simulation:
    """What :func:`simulate` found.

    Attributes:
        rows: one per setup and checkpointing mode that traced (and the rows derived from them).
        not_traced: ``(setup, checkpointing, reason)`` for each that failed (it would fail in training too).
        replica_groups: the recipe's option, under which every row was simulated; ``None``: one world.
    """

    world_size: int
    gpus_per_node: int
    parameters: int
    rows: list[SimulatedSetup]
    not_traced: list[tuple[str, str, str]]
    replica_groups: dict | None = None


# (setup or "ds", checkpointing, precision override, FSDP's ranks if not the world's)
_Task = tuple[str, str, "str | None", "int | None"]


def _start_worker(world_size: int) -> None:
    """A worker process is rank 0 of its own fake world for its whole life."""
    warnings.simplefilter("ignore")
    join_fake_world(world_size)


def _run_task(run: RecipeRun, batch: Any, task: _Task, *, gpus_per_node: int) -> TracedStep | str:
    """One trace, or the one-line reason it failed."""
    setup, checkpointing, precision, ranks = task
    try:
        return measure_setup(run, batch, setup, checkpointing, gpus_per_node, precision, ranks=ranks)
    except NotTraceable as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 - whatever fake tensors met (data-dependent shapes, custom kernels)
        lines = str(error).strip().splitlines()
        return f"{type(error).__name__}: {lines[0] if lines else 'no message'}"


def _run_tasks(run: RecipeRun, batch: Any, tasks: list[_Task], world_size: int, gpus_per_node: int, processes: int):
    """Run the traces in this process and ``processes - 1`` spawned workers, each taking the next one when free; this
    process traces from the start while the workers boot (a worker imports for seconds)."""
    trace = functools.partial(_run_task, run, batch, gpus_per_node=gpus_per_node)
    waiting = collections.deque(sorted(enumerate(tasks), key=lambda item: item[1][1] == "none"))  # recomputing first
    results: list[TracedStep | str | None] = [None] * len(tasks)
    failures: list[BaseException] = []

    def take_in_turn(run_one: Callable[[_Task], TracedStep | str]) -> None:
        while not failures:
            try:
                index, task = waiting.popleft()
            except IndexError:  # none left
                return
            try:
                results[index] = run_one(task)
            except BaseException as error:  # a worker died (or Ctrl-C): everyone stops, it is raised below
                failures.append(error)

    workers = processes - 1
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no process group, no threads inherited
    pool = ProcessPoolExecutor(workers, context, initializer=_start_worker, initargs=(world_size,)) if workers else None
    with pool or nullcontext():
        feeders = [
            threading.Thread(target=take_in_turn, args=(lambda task: pool.submit(trace, task).result(),))
            for _ in range(workers)
        ]
        for feeder in feeders:
            feeder.start()
        with warnings.catch_warnings(), fake_world(world_size):
            warnings.simplefilter("ignore")  # self.log without a Trainer, FSDP's notes on fake tensors
            take_in_turn(trace)
        for feeder in feeders:
            feeder.join()
    if failures:
        raise failures[0]
    return results


def simulate(
    run: RecipeRun,
    world_size: int,
    gpus_per_node: int,
    checkpointing: tuple[str, ...] = ACTIVATION_CHECKPOINTING_MODES,
    processes: int | None = None,
) -> Simulation:
    """Trace every setup at ``world_size`` ranks (``gpus_per_node`` per node), one row per setup and mode.

    Args:
        gpus_per_node: ``hsdp`` and the ``outer_sync`` rows are simulated when the world spans more than one node
            (``zero3`` traced again, sharded over one node's ranks as under ``outer_sync``). A recipe with
            ``replica_groups`` is simulated under that option alone.
        processes: this one and spawned workers (each a fake world of its own); ``None``: two (where the machine has
            two cores) from :data:`PARALLEL_FROM_PARAMETERS` on, where a trace takes seconds, else this one alone (a
            worker's start-up costs more than a small model's traces).

    Raises:
        NotTraceable: torch lacks the tools, the recipe's model or data cannot be built, or no setup traced.
    """
    missing = tracing_unavailable()
    if missing is not None:
        raise NotTraceable(missing)
    batch = first_batch(run.data)
    if processes is None:
        large = sum(p.numel() for p in _build(run, fake=True).parameters()) >= PARALLEL_FROM_PARAMETERS
        processes = min(2, os.cpu_count() or 1) if large else 1
    if run.replica_groups is not None:
        return _replica_groups_simulation(run, batch, world_size, gpus_per_node, checkpointing, processes)
    spans_nodes = world_size > gpus_per_node  # outer_sync synchronises across nodes, and refuses one
    setups = ["ddp", "zero2", "zero3", *(["hsdp"] if spans_nodes else [])]
    ds_precision = deepspeed_activation_precision(run.precision)
    tasks: list[_Task] = [(s, mode, None, None) for mode in checkpointing for s in setups]
    tasks += [("ds", mode, ds_precision, None) for mode in checkpointing]
    if spans_nodes:  # FSDP under outer_sync: each node a world of its own, sharded over its ranks
        tasks += [("zero3", mode, None, gpus_per_node) for mode in checkpointing]
    results = _run_tasks(run, batch, tasks, world_size, gpus_per_node, processes)
    rows: list[SimulatedSetup] = []
    not_traced: list[tuple[str, str, str]] = []
    outer_bases: dict[str, dict[str, StepMemory | str]] = {"ddp": {}, "zero3": {}}  # by checkpointing
    parameters = root_parameters = 0
    for (setup, mode, _, ranks), result in zip(tasks, results):
        if setup == "ddp" or ranks is not None:  # a DDP rank holds the same in a world of any size
            outer_bases[setup][mode] = result if isinstance(result, str) else result.memory
        if ranks is not None:  # only the base of the outer_sync rows
            continue
        if isinstance(result, str):
            not_traced += [(name, mode, result) for name in (DEEPSPEED_MODES if setup == "ds" else (setup,))]
            continue
        parameters, root_parameters = result.parameters, result.root_parameters
        if setup == "ds":
            rows += _deepspeed_rows(run, result, mode, world_size)
            continue
        comm = comm_per_step(
            setup, world_size, result.parameters, result.root_parameters, run.precision, run.accumulation,
            shard_group=gpus_per_node if setup == "hsdp" else None,
        )  # fmt: skip
        rows.append(SimulatedSetup(setup, mode, False, result.memory, comm.sent_per_device))
    if not rows:
        setup, mode, reason = not_traced[0]
        raise NotTraceable(f"{setup} with activation_checkpointing={mode}: {reason}")
    outer_rows: list[SimulatedSetup] = []
    if spans_nodes:
        nodes = world_size // gpus_per_node
        outer_rows, refused = _outer_sync_rows(run, outer_bases, parameters, root_parameters, gpus_per_node, nodes)
        not_traced += refused
    return Simulation(world_size, gpus_per_node, parameters, rows + _offload_rows(rows) + outer_rows, not_traced)


def _replica_groups_simulation(
    run: RecipeRun,
    batch: Any,
    world_size: int,
    gpus_per_node: int,
    checkpointing: tuple[str, ...],
    processes: int,
) -> Simulation:
    """Each node a torchft replica group: DDP, and FSDP ZeRO-2/3 sharded over one node's ranks. Each rank keeps a flat
    copy of its gradients from one step to the next, added to the gradients and the peak; it sends its setup's traffic
    inside the node plus its gradients (its shard's under FSDP) all-reduced on a ring of the nodes (the one mark per
    parameter left out)."""
    nodes = world_size // gpus_per_node
    if nodes < 2:
        raise NotTraceable(f"replica_groups needs 2 or more nodes; world {world_size} is one node of {gpus_per_node}")
    tasks: list[_Task] = [
        (setup, mode, None, None if setup == "ddp" else gpus_per_node)
        for mode in checkpointing
        for setup in REPLICA_GROUPS_MODES
    ]
    rows: list[SimulatedSetup] = []
    not_traced: list[tuple[str, str, str]] = []
    parameters = 0
    for (setup, mode, _, _), result in zip(tasks, _run_tasks(run, batch, tasks, world_size, gpus_per_node, processes)):
        if isinstance(result, str):
            not_traced.append((setup, mode, result))
            continue
        parameters, traced = result.parameters, result.memory
        memory = replace(traced, grads=2 * traced.grads, peak=traced.peak + traced.grads)
        inside = comm_per_step(
            setup, gpus_per_node, result.parameters, result.root_parameters, run.precision, run.accumulation
        )
        across = CommEstimate("ddp", nodes, allreduce=traced.grads).sent_per_device
        rows.append(
            SimulatedSetup(setup, mode, False, memory, inside.sent_per_device + across, "traced + kept gradient copy")
        )
    if not rows:
        setup, mode, reason = not_traced[0]
        raise NotTraceable(f"{setup} with activation_checkpointing={mode}: {reason}")
    return Simulation(world_size, gpus_per_node, parameters, rows + _offload_rows(rows), not_traced, run.replica_groups)


def _outer_sync_settings(run: RecipeRun) -> list[OuterSync]:
    """The ``outer_sync`` forms bench compares, the recipe's own options in place of the form they take."""
    forms: dict[OuterSyncForm, OuterSync] = {form: OuterSync(**options) for form, options in OUTER_SYNC_FORMS.items()}
    if run.outer_sync is not None:
        try:
            own = OuterSync.of(run.outer_sync)
        except ValueError as error:
            raise NotTraceable(f"the recipe's outer_sync: {error}") from None
        forms[form_of(own)] = own
    return list(forms.values())


def _outer_sync_rows(
    run: RecipeRun,
    bases: dict[str, dict[str, StepMemory | str]],
    parameters: int,
    root_parameters: int,
    gpus_per_node: int,
    nodes: int,
) -> tuple[list[SimulatedSetup], list[tuple[str, str, str]]]:
    """The ``ddp`` and one-node ``zero3`` steps of ``bases`` (by checkpointing, or why one did not trace) again with
    DiLoCo across the nodes, for each ``outer_sync`` form, on a rank that holds torchft's state (FSDP's rank 0, whose
    shards are the largest). ``not_traced`` entries: each form whose ``fragments`` the model's blocks cannot take,
    and each step that did not trace."""
    module = _build(run, fake=True)  # on the meta device: its fragments, as the strategy splits them
    blocks = outermost_block_modules(module, resolve_blocks(module, run.blocks))
    dtype = _TRUE_DTYPES.get(run.precision, torch.float32)
    derived: list[SimulatedSetup] = []
    refused: list[tuple[str, str, str]] = []
    for setup, steps in bases.items():
        ranks = gpus_per_node if setup == "zero3" else 1  # the ranks a fragment is split over
        inner = comm_per_step(setup, gpus_per_node, parameters, root_parameters, run.precision, run.accumulation)
        for settings in _outer_sync_settings(run):
            name = _outer_sync_name(setup, settings)
            try:
                fragments = split_into_fragments(module, blocks, settings.fragments)
            except ValueError as error:
                refused += [(name, mode, str(error)) for mode in steps]
                continue
            held = shard_numels(fragments, ranks, 0)
            memory = outer_sync_memory(settings, held, dtype)
            sent = inner.sent_per_device + outer_sync_sent_per_step(settings, sum(held), nodes)
            for mode, step in steps.items():
                if isinstance(step, str):
                    refused.append((name, mode, step))
                    continue
                on_rank = replace(step, optimizer=step.optimizer + memory.outer_momentum, peak=memory.device_peak(step))
                derived.append(SimulatedSetup(setup, mode, False, on_rank, sent, "derived", settings, memory))
    return derived, refused


def _deepspeed_rows(run: RecipeRun, traced: TracedStep, checkpointing: str, world_size: int) -> list[SimulatedSetup]:
    """DeepSpeed's stages: the formula's state around activations traced in DeepSpeed's dtype."""
    rows = []
    for setup in DEEPSPEED_MODES:
        state = deepspeed_state(traced.parameters, world_size, run.precision, int(setup[-1]), cpu_offload=False)
        parts = (state.weights, state.gradients, state.optimizer, state.gathered_weights)
        activations = traced.memory.activations_peak
        memory = StepMemory(*parts, activations_peak=activations, peak=sum(parts) + activations)
        comm = comm_per_step(
            setup, world_size, traced.parameters, traced.root_parameters, run.precision, run.accumulation
        )
        method = "formula state, traced activations"
        rows.append(SimulatedSetup(setup, checkpointing, False, memory, comm.sent_per_device, method))
    return rows
