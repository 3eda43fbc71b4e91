"""FastDDPStrategy: Lightning's DDP with gradient compression by name on every backend, sized buckets
and measured communication.

Lightning's ``DDPStrategy`` takes a comm hook only as a callable and registers it only on CUDA; this subclass
registers one of ours by name on any backend and checkpoints its state. Other keyword arguments still go to
``DistributedDataParallel``. ``docs/ddp.md`` has the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_fastdist.diagnostics.recompiles import RecompileWatcher
from lightning_fastdist.parallel.checkpoint.atomic import is_local_path
from lightning_fastdist.parallel.comm.accounting import ALL_REDUCE, CommStats
from lightning_fastdist.parallel.comm.exposed import BackwardTail, ExposedCommClock, watch_ddp
from lightning_fastdist.parallel.ddp.auto_comm_hook import AUTO_LEVELS, AutoCommState, AutoPolicy
from lightning_fastdist.parallel.ddp.buckets import auto_bucket_cap_mb
from lightning_fastdist.parallel.ddp.comm_hook_spec import CommHookName, CommHookSpec
from lightning_fastdist.parallel.ddp.comm_hooks import HookState
from lightning_fastdist.parallel.ddp.powersgd import FactorDtypeName, PowerSGDSettings, PowerSGDState
from lightning_fastdist.parallel.faults.collective_timeout import collective_timeout
from lightning_fastdist.parallel.plan.blocks import outermost_block_modules, resolve_blocks
from lightning_fastdist.parallel.plan.parallel_plan import (
    BlocksOption,
    CheckpointingOption,
    CompileOption,
    CompileScope,
    ParallelPlan,
    PreparedBlocks,
)
from lightning_fastdist.parallel.replica_groups.every_step import ACROSS_NODES
from lightning_fastdist.parallel.replica_groups.settings import ReplicaGroups
from lightning_fastdist.parallel.semi_sync.settings import OuterSync
from lightning_fastdist.parallel.semi_sync.torchft_run import OUTER_ALL_REDUCE
from lightning_fastdist.strategies.across_nodes import (
    across_nodes_job,
    resume_ranks,
    start_across_nodes,
    training_ranks_of,
)
from lightning_fastdist.strategies.blocks_option import blocks_option
from lightning_fastdist.strategies.comm_hook_checkpoint import (
    remember_location,
    remove_shards,
    restore_hook_state,
    save_hook_state,
)
from lightning_fastdist.strategies.comm_metrics import CommMetricsLog, end_comm_step
from lightning_fastdist.strategies.ddp_options import check_bucket_cap_mb, check_ddp_kwargs
from lightning_fastdist.strategies.exact_resume import ResumeState
from lightning_fastdist.strategies.fault_tolerance import load_or_fall_back, refuse_non_finite, save_one_file
from lightning_fastdist.strategies.job import (
    check_names_at_launch,
    check_names_before_joining,
    explain_lost_peer_of_job,
    join_process_group_once,
    names_checkable,
)
from lightning_fastdist.strategies.outer_sync import OuterSyncJob
from lightning_fastdist.strategies.outer_sync_checkpoint import remove_node_files
from lightning_fastdist.strategies.registry import register_once
from lightning_fastdist.strategies.replica_groups import ReplicaGroupsJob, decide_across_nodes, on_across_nodes
from lightning_fastdist.trainer.preemption import PreemptionHandler

CHECKPOINT_KEY = "fast_ddp_comm_hook"
AUTO_CHECKPOINT_KEY = "fast_ddp_comm_hook_auto"  # the level auto chose, and its decisions
HOOK_LEVEL_METRIC = "comm/hook_level"  # auto's level: 0 none, 1 bf16, 2 powersgd


class FastDDPStrategy(DDPStrategy):
    """DDP with a named gradient-compression hook, auto-sized buckets and communication accounting.

    Args:
        comm_hook: how gradients are averaged: ``"auto"``, ``"none"``, ``"fp16"``, ``"bf16"`` or ``"powersgd"``.
        comm_hook_window: optimizer steps ``"auto"`` measures per decision.
        powersgd_rank: the ``powersgd_*`` options are described and defaulted once, in
            :class:`~lightning_fastdist.parallel.ddp.powersgd.PowerSGDSettings`.
        bucket_cap_mb: DDP gradient bucket size in MB, or ``"auto"``: gradient MB / 8 clamped to [0.25, 100] MB, so
            communication overlaps the backward without paying per-message latency on tiny buckets.
        gradient_as_bucket_view: let gradients live in DDP's buckets (saves one copy and memory).
        static_graph: promise DDP the set of used parameters never changes (enables optimisations).
        find_unused_parameters: search for parameters without gradients every step; costs a graph traversal.
        log_comm_bytes: log ``comm/allreduce_bytes_per_step`` (host-side, no device sync) and the time the last
            step waited for the all-reduces after its backward, ``comm/exposed_s``.
        activation_checkpointing: with ``blocks``, ``compile`` and ``compile_scope``, the plan's
            (:class:`~lightning_fastdist.parallel.plan.parallel_plan.ParallelPlan`), applied before DDP wraps the model.
        outer_sync: synchronise across nodes every ``every`` steps with DiLoCo instead of every step (``OuterSync``'s
            options, a mapping in a recipe); inside a node every step stays synchronous. ``None``: every step, exact.
        replica_groups: train each node as a torchft replica group, the gradients averaged across the nodes every
            step, so that a lost node leaves the others training on and a restarted one joins them
            (``ReplicaGroups``' options: ``{min_nodes: 1}`` in a recipe). ``None``: one world, a lost node ends the job.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; ``None`` picks by device.
        timeout: seconds (or a ``timedelta``) a collective may wait for the other ranks; ``None`` keeps torch's.
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
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        block_modules: str | Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        check_ddp_kwargs(kwargs)
        with _named_errors():
            powersgd = PowerSGDSettings(
                rank=powersgd_rank,
                start_iter=powersgd_start_iter,
                error_feedback=powersgd_error_feedback,
                warm_start=powersgd_warm_start,
                factor_dtype=powersgd_factor_dtype,
            )
            outer = OuterSync.of(outer_sync)
            replicas = ReplicaGroups.of(replica_groups)
            if outer is not None and replicas is not None:
                raise ValueError(
                    "outer_sync and replica_groups are two forms of training across nodes: give one (a lost node is "
                    "left out under outer_sync with its own min_nodes)."
                )
            if outer is not None or replicas is not None:
                comm_hook = _intra_node_hook(comm_hook, "outer_sync" if outer is not None else "replica_groups")
            self.comm = CommHookSpec(comm_hook, powersgd, AutoPolicy(window=comm_hook_window))
            if process_group_backend is not None:
                self.comm.check_backend(process_group_backend)
        self.outer_sync = OuterSyncJob(outer, "FastDDPStrategy") if outer is not None else None
        self.replica_groups = (
            ReplicaGroupsJob(replicas, "FastDDPStrategy", kwargs.get("broadcast_buffers", True))
            if replicas is not None
            else None
        )
        check_bucket_cap_mb(bucket_cap_mb)
        blocks = blocks_option("FastDDPStrategy", blocks, "block_modules", block_modules)
        self.timeout = collective_timeout(timeout, type(self).__name__)
        self.plan = ParallelPlan(blocks, activation_checkpointing, compile, compile_scope)
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
        self.log_comm_bytes = log_comm_bytes
        self.hook_state: HookState | None = None
        self._pending_hook_checkpoint: dict | None = None
        self.prepared: PreparedBlocks | None = None
        self.recompiles = RecompileWatcher(report=rank_zero_warn)
        self.exposed_comm: ExposedCommClock | None = None  # set when DDP wraps the model
        self._backward_tail: BackwardTail | None = None
        self._comm_log = CommMetricsLog()
        self._resume = ResumeState()
        self._preemption: PreemptionHandler | None = None

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        check_names_at_launch(self._launcher, self, self.check_names, self.num_nodes)
        if across_nodes_job(self) is not None:
            across_nodes_job(self).check_launch(self.num_nodes)

    def check_names(self, module: LightningModule | None) -> None:
        """Raise the one-line ``ValueError`` of a block class name that ``module`` lacks, before any process starts
        (a model that builds its layers in ``configure_model`` is checked when the plan is applied)."""
        if names_checkable(module):
            block_classes = resolve_blocks(module, self.plan.blocks)
            if self.outer_sync is not None:
                self.outer_sync.check_fragments(module, outermost_block_modules(module, block_classes))

    @override
    def setup_environment(self) -> None:
        check_names_before_joining(self._launcher, self, self.check_names)
        super().setup_environment()
        with _named_errors():
            self.comm.check_backend(self._get_process_group_backend(), self.root_device)

    @override
    def setup_distributed(self) -> None:
        self.set_world_ranks()
        if across_nodes_job(self) is not None:
            across_nodes_job(self).nodes.join(self, self._get_process_group_backend(), self.timeout)
        join_process_group_once(self, self._get_process_group_backend(), self.timeout)
        super().setup_distributed()  # finds the group initialised and keeps it

    @override
    def configure_ddp(self) -> None:
        """Apply the plan to the model in place with DDP as its wrapper (the order's reasons: ``parallel_plan.py``)."""
        _, self.prepared = self.plan.apply(self.model, self._wrap_in_ddp, log=rank_zero_info)
        self.recompiles.call_sites = self.prepared.compiled_call_sites  # a recompile's report names them

    def _wrap_in_ddp(self, model: torch.nn.Module, prepared: PreparedBlocks) -> DistributedDataParallel:
        """Size the buckets, wrap ``model`` (``self.model``) in DDP as Lightning does, register the comm hook."""
        if self.bucket_cap_mb == "auto":
            self._ddp_kwargs["bucket_cap_mb"] = auto_bucket_cap_mb(model, compiled=self.plan.compile_config is not None)
        super().configure_ddp()
        assert isinstance(self.model, DistributedDataParallel)
        self.hook_state = self.comm.register(self.model)
        if self._backward_tail is not None:  # a second fit wraps the model again
            self._backward_tail.remove()
        self.exposed_comm = ExposedCommClock(self.root_device)  # comm/exposed_s
        self._backward_tail = watch_ddp(self.model, self.exposed_comm)
        if self._pending_hook_checkpoint is not None:
            self._restore_hook_state(self._pending_hook_checkpoint)
            self._pending_hook_checkpoint = None
        return self.model

    @override
    def setup(self, trainer: Any) -> None:
        self._preemption = PreemptionHandler(trainer, self.timeout)  # first: collective when fitting
        self._preemption.install()
        if self.plan.compile_config is not None:
            self.recompiles.start()
        super().setup(trainer)

    @property
    def training_ranks(self) -> int:
        """The ranks training now (what SpeedMonitor counts): under a world per node those of the nodes still in."""
        return training_ranks_of(self)

    @override
    def on_train_start(self) -> None:
        self._comm_log.new_fit()
        super().on_train_start()
        start_across_nodes(self)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.outer_sync is not None:
            self.outer_sync.evaluate_on_global_weights(self.model)

    @override
    def on_validation_end(self) -> None:
        if self.outer_sync is not None:
            self.outer_sync.back_to_own_weights(self.model)
        super().on_validation_end()

    @override
    def on_train_end(self) -> None:
        if self.outer_sync is not None:
            self.outer_sync.finish(self.model)
        super().on_train_end()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._resume.before_batch()
        if self.replica_groups is not None:
            self.replica_groups.before_batch()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self.log_comm_bytes:
            extra: dict[str, float] = {}
            if isinstance(self.hook_state, AutoCommState):
                extra[HOOK_LEVEL_METRIC] = float(AUTO_LEVELS.index(self.hook_state.level))
            self._comm_log.log(self.lightning_module, self.comm_stats, self.comm_collectives, self.exposed_comm, extra)
        return output

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.replica_groups is not None:
            closure = self.replica_groups.averaging_after(closure)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.replica_groups is not None:
            self.replica_groups.after_step(self.lightning_module.trainer)
        end_comm_step(self.comm_stats, self.exposed_comm)
        state, clock = self.hook_state, self.exposed_comm
        if isinstance(state, AutoCommState) and clock is not None and state.measuring:
            decision = state.on_optimizer_step(lambda: clock.total_s, self._synchronize_device)
            if decision is not None:
                rank_zero_info(decision.line(state.policy))
        return output

    def _synchronize_device(self) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.synchronize(self.root_device)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Training data is shared out over every rank of every node; with a world per node evaluation data over the
        node's ranks only, so that every node evaluates all of it and gets the same metrics (Lightning's reductions
        and EarlyStopping's decision are within a node)."""
        if across_nodes_job(self) is not None and self.lightning_module is not None:
            if not self.lightning_module.trainer.training:
                return {"num_replicas": self.num_processes, "rank": self.local_rank}
        return super().distributed_sampler_kwargs

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Lightning's reduction over the job's ranks (``self.log(sync_dist=True)``): with a world per node over the
        node's ranks, and while training under replica_groups on across the nodes too (under outer_sync each node
        trains its own weights between syncs, and evaluates all of the data: its reductions stay in the node)."""
        reduced = super().reduce(tensor, group, reduce_op)
        if group is not None:  # a group the caller chose
            return reduced
        return on_across_nodes(self.replica_groups, self.lightning_module, reduced, reduce_op)

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s maximum over every rank training, in place (read by NonFiniteLoss, so that every rank skips a
        step alike): one collective without a host sync, and under replica_groups across the nodes too (whose
        gradients are averaged together: a NaN on one node is a NaN on all)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return on_across_nodes(self.replica_groups, self.lightning_module, tensor, "max")

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        if across_nodes_job(self) is None:
            return super().reduce_boolean_decision(decision, all)
        return decide_across_nodes(self.replica_groups, self.lightning_module, decision, all, self.root_device)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's weights; under outer_sync the global ones (the same on every node), so that a checkpoint
        loads into a plain model as what the nodes agreed on."""
        if self.outer_sync is None:
            return super().lightning_module_state_dict()
        with self.outer_sync.global_weights(self.model):
            return {name: value.clone() for name, value in super().lightning_module_state_dict().items()}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        refuse_non_finite(self, checkpoint, filepath)
        self._resume.add_to(checkpoint, *resume_ranks(self))
        if self.outer_sync is not None:  # each node writes its own state
            trainer = self.lightning_module.trainer
            stopping = trainer.received_sigterm  # set by our preemption handler before it saves
            self.outer_sync.save(self.model, self.optimizers, checkpoint, filepath, trainer.global_step, stopping)
        powersgd = self.hook_state
        if isinstance(powersgd, AutoCommState):
            checkpoint[AUTO_CHECKPOINT_KEY] = powersgd.state_dict()
            powersgd = powersgd.powersgd
        if isinstance(powersgd, PowerSGDState):  # each rank's error feedback in its own file beside it
            checkpoint[CHECKPOINT_KEY] = save_hook_state(
                powersgd, "powersgd", filepath, self.world_size, self.global_rank
            )
            self.barrier("powersgd_state_written")  # every rank's file is complete before rank 0 publishes
        writer = self._writes_checkpoint_file()
        if not (isinstance(self.checkpoint_io, TorchCheckpointIO) and is_local_path(filepath)):
            if writer:  # e.g. a remote or asynchronous writer, as Lightning's save_checkpoint calls it
                self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        save_one_file(self, checkpoint, filepath, storage_options, writer)

    def _writes_checkpoint_file(self) -> bool:
        """Global rank 0, or under ``replica_groups`` local rank 0 of the node that writes (call on every rank)."""
        if self.replica_groups is None:
            return self.is_global_zero
        return self.replica_groups.writes_checkpoints(self.node_rank) and self.local_rank == 0

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        load = functools.partial(self._load_noting_location, weights_only=weights_only)
        checkpoint = load_or_fall_back(self, checkpoint_path, load, expects_folder=False)
        self._resume.take_from(checkpoint, *resume_ranks(self))  # under outer_sync node 0's; this node's at start
        if self.outer_sync is not None and self.lightning_module.trainer.training:
            self.outer_sync.load(checkpoint, checkpoint_path)
        saved = {key: checkpoint[key] for key in (CHECKPOINT_KEY, AUTO_CHECKPOINT_KEY) if key in checkpoint}
        if saved and self.hook_state is None:
            self._pending_hook_checkpoint = saved  # applied once the hook is registered
        elif saved:
            self._restore_hook_state(saved)
        return checkpoint

    def _load_noting_location(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if CHECKPOINT_KEY in checkpoint:  # the ranks' PowerSGD files are found beside the file actually loaded
            checkpoint[CHECKPOINT_KEY] = remember_location(checkpoint[CHECKPOINT_KEY], checkpoint_path)
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.replica_groups is not None:  # the node that wrote the latest checkpoint prunes the folder
            if self.replica_groups.wrote_last_checkpoint and self.local_rank == 0:
                self.checkpoint_io.remove_checkpoint(filepath)
            return
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            remove_shards(filepath)  # the ranks' PowerSGD files of that checkpoint, if any
            remove_node_files(filepath)  # the nodes' files of an outer_sync checkpoint, if any

    @override
    def on_exception(self, exception: BaseException) -> None:
        explain_lost_peer_of_job(exception, self.timeout, self.global_rank)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self.recompiles.stop()
        if across_nodes_job(self) is not None:
            across_nodes_job(self).teardown()
        if self._preemption is not None:
            self._preemption.uninstall()
            self._preemption = None
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
        """The collectives logged as ``comm/<collective>_bytes_per_step`` (under outer_sync or replica_groups, the one
        across nodes too)."""
        if self.outer_sync is not None:
            return (ALL_REDUCE, OUTER_ALL_REDUCE)
        return (ALL_REDUCE, ACROSS_NODES) if self.replica_groups is not None else (ALL_REDUCE,)

    def _restore_hook_state(self, saved: dict) -> None:
        """Put back what a checkpoint holds of the hook: auto's level and decisions, PowerSGD's memories."""
        powersgd = self.hook_state
        if isinstance(powersgd, AutoCommState) and AUTO_CHECKPOINT_KEY in saved:
            powersgd.load_state_dict(saved[AUTO_CHECKPOINT_KEY])
            if powersgd.decisions:
                rank_zero_info(
                    f"comm_hook auto: resumed at {powersgd.level} (decided at step {powersgd.decisions[-1].step})."
                )
            powersgd = powersgd.powersgd
        if CHECKPOINT_KEY in saved:
            name = "powersgd" if isinstance(self.hook_state, AutoCommState) else self.comm.name
            restore_hook_state(
                powersgd, name, saved[CHECKPOINT_KEY], self.world_size, self.global_rank, self.root_device
            )


def _intra_node_hook(comm_hook: str, option: str) -> str:
    """The hook inside a node under ``option`` (outer_sync or replica_groups): ``auto`` is ``none`` (inside a node
    gradients travel on fast links); PowerSGD is refused (its per-rank state files assume one world across nodes)."""
    if comm_hook == "powersgd":
        why = {
            "outer_sync": "outer_sync crosses the slow link only every `every` steps, and inside a node",
            "replica_groups": "under replica_groups each node is a world of its own, and inside it",
        }[option]
        raise ValueError(
            f"{why} gradients travel on fast links: comm_hook='powersgd' is not taken with it; use comm_hook='none' "
            "(or 'bf16')."
        )
    return "none" if comm_hook == "auto" else comm_hook


@contextmanager
def _named_errors() -> Generator[None, None, None]:
    """Prefix the option checks' errors with the class a user named in their recipe."""
    try:
        yield
    except ValueError as error:
        raise ValueError(f"FastDDPStrategy: {error}") from None


register_once(FastDDPStrategy, "fast_ddp", "DDP with named gradient compression (fp16/bf16/PowerSGD) on any backend")
