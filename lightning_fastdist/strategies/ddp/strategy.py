"""FastDDPStrategy: Lightning's DDP with gradient compression by name on every backend, sized buckets
and measured communication.

Lightning's ``DDPStrategy`` takes a comm hook only as a callable and registers it only on CUDA; this subclass
registers one of ours by name on any backend and checkpoints its state. Other keyword arguments still go to
``DistributedDataParallel``. ``docs/ddp.md`` has the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_fastdist.diagnostics.recompiles import RecompileWatcher
from lightning_fastdist.parallel.across_nodes.outer_sync.settings import OuterSync
from lightning_fastdist.parallel.across_nodes.replica_groups.settings import ReplicaGroups
from lightning_fastdist.parallel.comm.accounting import ALL_REDUCE, CommStats
from lightning_fastdist.parallel.comm.exposed import BackwardTail, ExposedCommClock, watch_ddp
from lightning_fastdist.parallel.ddp.auto_comm_hook import AUTO_LEVELS, AutoCommState, AutoPolicy
from lightning_fastdist.parallel.ddp.buckets import auto_bucket_cap_mb
from lightning_fastdist.parallel.ddp.comm_hook_spec import CommHookName, CommHookSpec
from lightning_fastdist.parallel.ddp.comm_hooks import HookState
from lightning_fastdist.parallel.ddp.powersgd import FactorDtypeName, PowerSGDSettings
from lightning_fastdist.parallel.faults.collective_timeout import collective_timeout
from lightning_fastdist.parallel.gradients.trainable import TrainableSet
from lightning_fastdist.parallel.plan.blocks import outermost_block_modules, resolve_blocks
from lightning_fastdist.parallel.plan.compile import compiled_by_user
from lightning_fastdist.parallel.plan.parallel_plan import (
    BlocksOption,
    CheckpointingOption,
    CompileOption,
    CompileScope,
    ParallelPlan,
    PreparedBlocks,
)
from lightning_fastdist.strategies.across_nodes import across_nodes
from lightning_fastdist.strategies.across_nodes.outer_sync_checkpoint import remove_node_files
from lightning_fastdist.strategies.checkpoint.fault_tolerance import load_or_fall_back
from lightning_fastdist.strategies.common.job import (
    check_names_at_launch,
    check_names_before_joining,
    join_process_group_once,
    names_checkable,
)
from lightning_fastdist.strategies.common.options import (
    blocks_option,
    check_async_checkpointing,
    check_bucket_cap_mb,
    check_ddp_kwargs,
    named_errors,
)
from lightning_fastdist.strategies.common.registry import register_once
from lightning_fastdist.strategies.common.shared_hooks import SharedHooks
from lightning_fastdist.strategies.ddp.comm_hook_checkpoint import (
    CommHookCheckpoint,
    RegisteredHook,
    remove_shards,
)

HOOK_LEVEL_METRIC = "comm/hook_level"  # auto's level: 0 none, 1 bf16, 2 powersgd


class FastDDPStrategy(DDPStrategy):
    """DDP with a named gradient-compression hook, auto-sized buckets and communication accounting.

    Args:
        comm_hook: how gradients are averaged: ``"auto"``, ``"none"``, ``"fp16"``, ``"bf16"`` or ``"powersgd"``.
        comm_hook_window: optimizer steps ``"auto"`` measures per decision.
        powersgd_rank: the ``powersgd_*`` options are described and defaulted once, in ``PowerSGDSettings``.
        bucket_cap_mb: DDP gradient bucket size in MB, or ``"auto"``: gradient MB / 8 clamped to [0.25, 100] MB, so
            communication overlaps the backward without paying per-message latency on tiny buckets.
        gradient_as_bucket_view: let gradients live in DDP's buckets (saves one copy and memory).
        static_graph: promise DDP the set of used parameters never changes (enables optimisations).
        find_unused_parameters: search for parameters without gradients every step; costs a graph traversal.
        log_comm_bytes: log ``comm/allreduce_bytes_per_step`` (host-side, no device sync) and the time the last
            step waited for the all-reduces after its backward, ``comm/exposed_s``.
        activation_checkpointing: with ``blocks``, ``compile`` and ``compile_scope``, the plan's (``ParallelPlan``),
            applied before DDP wraps the model.
        outer_sync: synchronise across nodes every ``every`` steps with DiLoCo instead of every step (``OuterSync``'s
            options, a mapping in a recipe); inside a node every step stays synchronous. ``None``: every step, exact.
        replica_groups: each node a torchft replica group, the gradients averaged across nodes every step: a lost node
            leaves the others training (``ReplicaGroups``' options, ``{min_nodes: 1}``). ``None``: one world.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; ``None`` picks by device.
        timeout: seconds (or a ``timedelta``) a collective may wait for the other ranks; ``None`` keeps torch's.
        async_checkpointing: write checkpoints in the background while the fit trains on (``docs/checkpoints.md``).
        accelerator: with ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``: set
            by the Trainer.
        block_modules: deprecated spelling of ``blocks`` (one more release).
        **kwargs: passed to ``DistributedDataParallel``, as by Lightning's ``DDPStrategy``; checked at construction.
    """

    handles_preemption = True  # read by SyncFreeLogging, which otherwise installs the same handler itself

    def __init__(
        self,
        comm_hook: CommHookName = "auto",
        comm_hook_window: int = AutoPolicy.window,
        powersgd_rank: int = PowerSGDSettings.rank,
        powersgd_start_iter: int = PowerSGDSettings.start_iter,
        powersgd_error_feedback: bool = PowerSGDSettings.error_feedback,
        powersgd_warm_start: bool = PowerSGDSettings.warm_start,
        powersgd_factor_dtype: FactorDtypeName = PowerSGDSettings.factor_dtype,
        bucket_cap_mb: float | Literal["auto"] = "auto",
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        log_comm_bytes: bool = True,
        activation_checkpointing: CheckpointingOption = "none",
        blocks: BlocksOption = "auto",
        compile: CompileOption = False,
        compile_scope: CompileScope = "blocks",
        outer_sync: OuterSync | None = None,
        replica_groups: ReplicaGroups | None = None,
        process_group_backend: str | None = None,
        timeout: float | timedelta | None = None,
        async_checkpointing: bool = False,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        block_modules: str | Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        with named_errors(type(self).__name__):
            check_ddp_kwargs(kwargs)
            check_bucket_cap_mb(bucket_cap_mb)
            check_async_checkpointing(async_checkpointing)
            blocks = blocks_option(type(self).__name__, blocks, "block_modules", block_modules)
            self.plan = ParallelPlan(blocks, activation_checkpointing, compile, compile_scope)
            broadcast_buffers = kwargs.get("broadcast_buffers", True)
            nodes = across_nodes(
                outer_sync, replica_groups, type(self).__name__, self.plan.blocks, False, broadcast_buffers
            )
            powersgd = PowerSGDSettings(
                rank=powersgd_rank,
                start_iter=powersgd_start_iter,
                error_feedback=powersgd_error_feedback,
                warm_start=powersgd_warm_start,
                factor_dtype=powersgd_factor_dtype,
            )
            comm_hook = nodes.comm_hook_inside_node(comm_hook)
            self.comm = CommHookSpec(comm_hook, powersgd, AutoPolicy(window=comm_hook_window))
            if process_group_backend is not None:
                self.comm.check_backend(process_group_backend)
        self.timeout = collective_timeout(timeout, type(self).__name__)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=self.timeout,
            start_method=start_method,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            **({"bucket_cap_mb": float(bucket_cap_mb)} if bucket_cap_mb != "auto" else {}),
            **kwargs,  # to DistributedDataParallel, as in Lightning (and LightningCLI sees them through this call)
        )
        self.bucket_cap_mb = bucket_cap_mb
        self.across_nodes = nodes
        self.shared = SharedHooks(self, nodes, log_comm_bytes, async_checkpointing)
        self.hook_state: HookState | None = None
        self._hook_checkpoint = CommHookCheckpoint()
        self.prepared: PreparedBlocks | None = None
        self.recompiles = RecompileWatcher(report=rank_zero_warn)
        self.exposed_comm: ExposedCommClock | None = None  # set when DDP wraps the model
        self._backward_tail: BackwardTail | None = None
        self._trainable = TrainableSet(nn.Module())  # the parameters DDP averages (set when it wraps the model)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        check_names_at_launch(self._launcher, self, self.check_names, self.num_nodes)
        self.across_nodes.check_launch(self.num_nodes)

    def check_names(self, module: LightningModule | None) -> None:
        """Raise the one-line ``ValueError`` of a block class name that ``module`` lacks, before any process starts
        (a model that builds its layers in ``configure_model`` is checked when the plan is applied)."""
        if names_checkable(module):
            block_classes = resolve_blocks(module, self.plan.blocks)
            self.across_nodes.check_blocks(module, outermost_block_modules(module, block_classes))

    @override
    def setup_environment(self) -> None:
        check_names_before_joining(self._launcher, self, self.check_names)
        super().setup_environment()
        with named_errors(type(self).__name__):
            self.comm.check_backend(self._get_process_group_backend(), self.root_device)

    @override
    def setup_distributed(self) -> None:
        self.set_world_ranks()
        self.across_nodes.join(self, self._get_process_group_backend(), self.timeout)
        join_process_group_once(self, self._get_process_group_backend(), self.timeout)
        super().setup_distributed()  # finds the group initialised and keeps it

    @override
    def configure_ddp(self) -> None:
        """Apply the plan to the model in place with DDP as its wrapper (the order's reasons: ``parallel_plan.py``)."""
        _, self.prepared = self.plan.apply(self.model, self._wrap_in_ddp, log=rank_zero_info)
        self.recompiles.call_sites = self.prepared.compiled_call_sites  # a recompile's report names them

    def _wrap_in_ddp(self, model: torch.nn.Module, prepared: PreparedBlocks) -> DistributedDataParallel:
        """Size the buckets, wrap ``model`` (``self.model``) in DDP as Lightning does, register the comm hook."""
        if self.bucket_cap_mb == "auto":  # compiled by the plan or by the user (Lightning unwraps torch.compile(model))
            by_user = compiled_by_user(model) or getattr(model, "_compiler_ctx", None) is not None
            compiled = self.plan.compile_config is not None or by_user
            self._ddp_kwargs["bucket_cap_mb"] = auto_bucket_cap_mb(model, compiled=compiled)
        super().configure_ddp()
        assert isinstance(self.model, DistributedDataParallel)
        self.hook_state = self.comm.register(self.model)
        if self._backward_tail is not None:  # a second fit wraps the model again
            self._backward_tail.remove()
        self.exposed_comm = ExposedCommClock(self.root_device)  # comm/exposed_s
        self._backward_tail = watch_ddp(self.model, self.exposed_comm)
        self._trainable = TrainableSet(model)
        self._hook_checkpoint.attach(
            RegisteredHook(self.hook_state, self.comm.name, self.world_size, self.global_rank, self.root_device)
        )
        return self.model

    @override
    def setup(self, trainer: Any) -> None:
        self.shared.setup(trainer)
        if self.plan.compile_config is not None:
            self.recompiles.start()
        super().setup(trainer)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.shared.on_train_start()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.across_nodes.evaluate_on_global_weights(self.model)

    @override
    def on_validation_end(self) -> None:
        self.across_nodes.back_to_own_weights(self.model)
        super().on_validation_end()

    @override
    def on_train_end(self) -> None:
        self.across_nodes.finish(self.model)
        super().on_train_end()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self.shared.training_data(super().process_dataloader(dataloader))

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.shared.before_batch()
        changed = self._trainable.changed(self.lightning_module)  # since DDP wrapped the model (BackboneFinetuning)
        if changed is not None:
            self._wrap_again(changed)
        super().on_train_batch_start(batch, batch_idx)

    def _wrap_again(self, changed: str) -> None:
        """DDP's reducer averages the gradients of the parameters trainable when it was built: one unfrozen after would
        train on each rank's own gradients (as under Lightning's DDPStrategy)."""
        rank_zero_info(f"FastDDPStrategy: {changed}; DDP wraps the model again to average their gradients too.")
        self.model = self.model.module
        self._wrap_in_ddp(self.model, self.prepared)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        auto = self.hook_state if isinstance(self.hook_state, AutoCommState) else None
        level = {HOOK_LEVEL_METRIC: float(AUTO_LEVELS.index(auto.level))} if auto is not None else None
        return self.shared.after_training_step(output, level)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        closure = self.across_nodes.averaging_after(closure)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.shared.after_optimizer_step()
        state, clock = self.hook_state, self.exposed_comm
        if isinstance(state, AutoCommState) and clock is not None and state.measuring:
            decision = state.on_optimizer_step(lambda: clock.total_s, clock.synchronize)
            if decision is not None:
                rank_zero_info(decision.line(state.policy))
        return output

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.across_nodes.evaluation_sampler(self) or super().distributed_sampler_kwargs

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Lightning's reduction over the world, then across nodes where they train one model every step."""
        reduced = super().reduce(tensor, group, reduce_op)
        return reduced if group is not None else self.across_nodes.reduce(self.lightning_module, reduced, reduce_op)

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s maximum over every rank training, in place (read by NonFiniteLoss, so that every rank skips a
        step alike): one collective without a host sync, and across nodes where they average gradients together."""
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return self.across_nodes.reduce(self.lightning_module, tensor, "max")

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        in_world = super().reduce_boolean_decision
        return self.across_nodes.reduce_boolean_decision(
            self.lightning_module, decision, all, self.root_device, in_world
        )

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.across_nodes.weights_to_save(self.model, super().lightning_module_state_dict)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        this_world_writes = self.shared.prepare_save(checkpoint, filepath)
        side_files = self._hook_checkpoint.save(checkpoint, filepath)  # each rank's PowerSGD memory, if any
        writer = this_world_writes and self.across_nodes.writes_files(self)
        self.shared.saves.one_file(checkpoint, filepath, writer, side_files, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        load = functools.partial(super().load_checkpoint, weights_only=weights_only)
        note_location = self._hook_checkpoint.note_location
        checkpoint, loaded_from = load_or_fall_back(self, checkpoint_path, lambda p: note_location(load(p), p), False)
        self.shared.take_loaded(checkpoint, loaded_from)
        self._hook_checkpoint.load(checkpoint)
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        # The rank that wrote it, with the ranks' PowerSGD files and the nodes' own states beside it, if any.
        self.shared.saves.remove(filepath, self.across_nodes.writes_files(self), remove_shards, remove_node_files)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.shared.on_exception(exception)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self.recompiles.stop()
        self.shared.teardown()
        super().teardown()

    @property
    def checkpointed_blocks(self) -> tuple[torch.nn.Module, ...]:
        """The blocks under activation checkpointing (empty until the plan is applied)."""
        return self.prepared.checkpointed if self.prepared is not None else ()

    @property
    def compiled_regions(self) -> tuple[torch.nn.Module, ...]:
        """The modules whose ``forward`` is compiled (empty until the plan is applied)."""
        return self.prepared.compiled if self.prepared is not None else ()

    @property
    def comm_stats(self) -> CommStats | None:
        """This rank's all-reduce bytes and rounds (``None`` until DDP wraps the model)."""
        return self.hook_state.stats if self.hook_state is not None else None

    @property
    def comm_collectives(self) -> tuple[str, ...]:
        """The collectives logged as ``comm/<collective>_bytes_per_step``, the one across nodes too where there is."""
        return (ALL_REDUCE, *self.across_nodes.collectives)


register_once(FastDDPStrategy, "fast_ddp", "DDP with named gradient compression (fp16/bf16/PowerSGD) on any backend")
