"""FastFSDPStrategy: FSDP2 applied automatically, with the parts Lightning leaves to the user.

Lightning's ``ModelParallelStrategy`` asks the user to call ``fully_shard`` in ``configure_model`` and
reduce-scatters gradients on every accumulation micro-batch. This strategy shards the unchanged model itself inside
a root unit, so a step may call ``self(...)`` or any submodule, and skips gradient communication on non-final
micro-batches.
"""

from __future__ import annotations

import functools
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.layer_sync import _BatchNormXd
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from lightning_fastdist.diagnostics.recompiles import RecompileWatcher
from lightning_fastdist.parallel.checkpoint.atomic import ShardedCheckpointWriter
from lightning_fastdist.parallel.comm.accounting import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CommStats
from lightning_fastdist.parallel.comm.exposed import ExposedCommClock
from lightning_fastdist.parallel.faults.collective_timeout import collective_timeout
from lightning_fastdist.parallel.fsdp.buffers import broadcast_buffers
from lightning_fastdist.parallel.fsdp.comm_accounting import count_fsdp_communication
from lightning_fastdist.parallel.fsdp.sharding import (
    FSDPSharding,
    RootUnit,
    ShardingMode,
    reshard_everywhere,
    shard_model,
)
from lightning_fastdist.parallel.plan.blocks import outermost_block_modules, resolve_blocks
from lightning_fastdist.parallel.plan.idle_experts import IdleExperts
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
from lightning_fastdist.strategies.comm_metrics import CommMetricsLog, end_comm_step, one_gradient_round
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

CHECKPOINT_FORMATS = ("sharded", "full")


class FastFSDPStrategy(ModelParallelStrategy):
    """FSDP2 sharding of an unchanged LightningModule: ZeRO-3, ZeRO-2 or HSDP, per block.

    Args:
        blocks: with ``activation_checkpointing``, ``compile`` and ``compile_scope``, the plan's
            (:class:`~lightning_fastdist.parallel.plan.parallel_plan.ParallelPlan`): each block is an FSDP unit;
            parameters outside every block belong to the root, sharded last.
        sharding: ``"zero3"``, ``"zero2"`` or ``"hsdp"``; with ``hsdp_group_size``, ``cpu_offload`` and ``keep_fp32``
            described in :class:`~lightning_fastdist.parallel.fsdp.sharding.FSDPSharding`.
        checkpoint_format: ``"sharded"`` (a folder of per-rank shards, loadable at any world size) or ``"full"`` (one
            file gathered on rank 0).
        async_checkpointing: write sharded checkpoints in a background thread (training continues once the state is
            copied to host memory).
        outer_sync: shard inside each node and synchronise across nodes every ``every`` steps with DiLoCo, each rank
            with the ranks holding the same shard on the other nodes (``OuterSync``'s options, a mapping in a recipe).
            Not with ``sharding="hsdp"``. ``None``: one sharded world, every step.
        replica_groups: shard inside each node and train each node as a torchft replica group, each rank's shard of
            the gradients averaged every step with the same shard's ranks on the other nodes, so that a lost node leaves
            the others training on (``ReplicaGroups``' options: ``{min_nodes: 1}`` in a recipe). Not with
            ``outer_sync`` or ``sharding="hsdp"``. ``None``: one world, a lost node ends the job.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; ``None`` picks the device's default.
        timeout: seconds (or a ``timedelta``) a collective may wait for the other ranks; ``None`` keeps torch's.
        log_comm_bytes: log the bytes of the last optimizer step's collectives as ``comm/<collective>_bytes_per_step``
            (host-side, no device sync) and the time the step waited for them as ``comm/exposed_s``. Needs
            torch >= 2.9 (FSDP2's custom collectives).
        shard_modules: deprecated spelling of ``blocks`` (one more release).
    """

    handles_preemption = True  # read by SyncFreeLogging, which otherwise installs the same handler itself

    def __init__(
        self,
        blocks: BlocksOption = "auto",
        sharding: ShardingMode = "zero3",
        hsdp_group_size: int | None = None,
        cpu_offload: bool = False,
        keep_fp32: list[str] | None = None,
        activation_checkpointing: CheckpointingOption = "none",
        compile: CompileOption = False,
        compile_scope: CompileScope = "blocks",
        checkpoint_format: Literal["sharded", "full"] = "sharded",
        async_checkpointing: bool = False,
        outer_sync: OuterSync | Mapping[str, Any] | None = None,
        replica_groups: ReplicaGroups | Mapping[str, Any] | None = None,
        process_group_backend: str | None = None,
        timeout: float | timedelta | None = None,
        log_comm_bytes: bool = True,
        shard_modules: str | list[str] | None = None,
    ) -> None:
        self.fsdp = FSDPSharding(sharding, hsdp_group_size, cpu_offload, tuple(keep_fp32 or ()))
        blocks = blocks_option("FastFSDPStrategy", blocks, "shard_modules", shard_modules)
        self.timeout = collective_timeout(timeout, type(self).__name__)
        self.plan = ParallelPlan(blocks, activation_checkpointing, compile, compile_scope)
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"checkpoint_format: got {checkpoint_format!r}; use one of {', '.join(map(repr, CHECKPOINT_FORMATS))}."
            )
        if async_checkpointing and checkpoint_format != "sharded":
            raise ValueError(
                "async_checkpointing: needs checkpoint_format='sharded' (a full file is written by rank 0 alone)."
            )
        try:
            outer = OuterSync.of(outer_sync)
            replicas = ReplicaGroups.of(replica_groups)
        except ValueError as error:
            raise ValueError(f"FastFSDPStrategy: {error}") from None
        if outer is not None and replicas is not None:
            raise ValueError(
                "FastFSDPStrategy: outer_sync and replica_groups are two forms of training across nodes: give one (a "
                "lost node is left out under outer_sync with its own min_nodes)."
            )
        if outer is not None and sharding == "hsdp":
            raise ValueError(
                "FastFSDPStrategy: outer_sync synchronises across nodes every `every` steps and sharding='hsdp' every "
                "step: give sharding='zero3' or 'zero2' (sharded inside each node) with outer_sync."
            )
        if replicas is not None and sharding == "hsdp":
            raise ValueError(
                "FastFSDPStrategy: replica_groups replicates across nodes through torchft, as sharding='hsdp' does "
                "through one world: give sharding='zero3' or 'zero2' (sharded inside each node) with replica_groups."
            )
        self.outer_sync = OuterSyncJob(outer, "FastFSDPStrategy", sharded=True) if outer is not None else None
        self.replica_groups = (
            ReplicaGroupsJob(replicas, "FastFSDPStrategy", sharded=True) if replicas is not None else None
        )
        super().__init__(
            save_distributed_checkpoint=checkpoint_format == "sharded",
            process_group_backend=process_group_backend,
            timeout=self.timeout,
        )
        self.checkpoint_format = checkpoint_format
        self.async_checkpointing = async_checkpointing
        self._checkpoint_writer = ShardedCheckpointWriter()
        self.log_comm_bytes = log_comm_bytes
        self.comm_stats: CommStats | None = None  # this rank's FSDP collective bytes and gradient rounds, once counted
        self._root: RootUnit | None = None
        self._idle_experts: IdleExperts | None = None
        self._experts_group: dist.ProcessGroup | None = None
        self._accumulating = False
        self._synced_batchnorm = False  # BatchNorm layers are SyncBatchNorm for this fit (Trainer(sync_batchnorm=True))
        self.prepared: PreparedBlocks | None = None
        self.recompiles = RecompileWatcher(report=rank_zero_warn)
        self.exposed_comm: ExposedCommClock | None = None  # set when the model is sharded
        self._comm_log = CommMetricsLog()
        self._resume = ResumeState()
        self._preemption: PreemptionHandler | None = None

    @override
    def _configure_launcher(self) -> None:
        # The world size is known here, before any process starts: fix and check HSDP's split now.
        self.fsdp = self.fsdp.for_world(self.num_nodes * self.num_processes, devices_per_node=self.num_processes)
        super()._configure_launcher()
        check_names_at_launch(self._launcher, self, self.check_names, self.num_nodes)
        if across_nodes_job(self) is not None:
            across_nodes_job(self).check_launch(self.num_nodes)

    def check_names(self, module: pl.LightningModule | None) -> None:
        """Raise the one-line ``ValueError`` of a block or ``keep_fp32`` class name that ``module`` lacks, before any
        process starts (a model built in ``configure_model`` is checked when it is sharded)."""
        if names_checkable(module):
            block_classes = resolve_blocks(module, self.plan.blocks)
            self._refuse_a_root_a_step_cannot_reduce(module, block_classes)
            self.fsdp.units(module, [])  # resolves keep_fp32
            if self.outer_sync is not None:
                self.outer_sync.check_fragments(module, outermost_block_modules(module, block_classes))

    def _refuse_a_root_a_step_cannot_reduce(self, module: nn.Module, block_classes: list[type[nn.Module]]) -> None:
        if not getattr(module, "automatic_optimization", True):
            problem = self.fsdp.unreduced_by_a_step_backward(module, block_classes)
            if problem is not None:
                raise ValueError(problem)

    @override
    def setup_environment(self) -> None:
        check_names_before_joining(self._launcher, self, self.check_names)
        self.set_world_ranks()
        if across_nodes_job(self) is not None:  # torch.distributed's world is the node: FSDP shards inside it
            across_nodes_job(self).nodes.join(self, self._get_process_group_backend(), self.timeout)
        join_process_group_once(self, self._get_process_group_backend(), self.timeout)
        self._setup_distributed()  # Lightning's: finds the group initialised and keeps it
        self._device_mesh = self.fsdp.mesh(self.root_device.type, dist.get_world_size())
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        if self.async_checkpointing:
            # Background writes coordinate over their own group, never the one training uses.
            self._checkpoint_writer = ShardedCheckpointWriter(
                asynchronous=True, process_group=dist.new_group(backend="gloo")
            )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank is a data-parallel replica, whatever the sharding; with a world per node evaluation data is
        shared out over the node's ranks only, as FastDDPStrategy does."""
        if across_nodes_job(self) is not None and self.lightning_module is not None:
            if not self.lightning_module.trainer.training:
                return {"num_replicas": self.num_processes, "rank": self.local_rank}
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        if any(isinstance(module, FullyShardedDataParallel) for module in self.model.modules()):
            raise TypeError(  # as Lightning's ModelParallelStrategy, whose setup this one replaces
                "Found modules that are wrapped with `torch.distributed.fsdp.FullyShardedDataParallel` (FSDP1); "
                f"{type(self).__name__} shards with FSDP2: leave the model unwrapped."
            )
        self._preemption = PreemptionHandler(trainer, self.timeout)  # first: collective when fitting
        self._preemption.install()
        if self.plan.compile_config is not None:
            self.recompiles.start()
        self.accelerator.setup(trainer)
        # Trainer(sync_batchnorm=True): BatchNorm is SyncBatchNorm while fitting, as under Lightning's strategies.
        self._synced_batchnorm = trainer.state.fn == TrainerFn.FITTING and self._layer_sync is not None
        if self._root is None or self._root.module is not self.lightning_module:  # a second fit reuses the root
            module = self.precision_plugin.convert_module(self.lightning_module)
            if self._synced_batchnorm:
                module = self._layer_sync.apply(module)  # before sharding, as Lightning's FSDPStrategy does
            self._root = self.parallelize(module)  # where ModelParallelStrategy expects configure_model to have sharded
            _materialize(self._root, self.root_device, self.fsdp.cpu_offload)
        elif self._synced_batchnorm:
            _sync_batchnorm_in_place(self._root, sync=True)  # the previous fit's teardown reverted it
        # Lightning runs each step through ``self.model`` (its forward redirection), so the root's hooks run around it.
        self.model = self._root
        self.model_to_device()  # as in Lightning: move all that is left (parameterless modules, .device)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def model_to_device(self) -> None:
        """Move what FSDP did not place: parameterless modules (torchmetrics metrics), ``LightningModule.device``;
        under ``cpu_offload`` the parameter shards stay on the CPU."""
        assert self.model is not None
        if self.fsdp.cpu_offload:
            _move_all_but_parameters(self.model, self.root_device)
        else:
            self.model.to(self.root_device)

    def parallelize(self, model: nn.Module) -> RootUnit:
        """Apply the plan to ``model`` in place with FSDP as its wrapper; return the root unit (the order's reasons:
        ``parallel_plan.py``)."""
        self._refuse_a_root_a_step_cannot_reduce(model, resolve_blocks(model, self.plan.blocks))  # configure_model
        root, units, self.prepared, self._idle_experts = shard_model(
            model, self.device_mesh, self.plan, self.fsdp, self.precision_plugin.precision, rank_zero_info
        )
        self.recompiles.call_sites = self.prepared.compiled_call_sites  # a recompile's report names them
        if self._idle_experts.trackers and self._experts_group is None:
            self._experts_group = dist.new_group(backend="gloo")  # host-side flags: no device sync
        clock = ExposedCommClock(self.root_device)
        stats = self.comm_stats if self.comm_stats is not None else CommStats()  # a second fit counts on
        counted = count_fsdp_communication(units, stats, self.fsdp.mode == "hsdp", clock)  # not where torch cannot
        self.comm_stats, self.exposed_comm = (stats, clock) if counted else (None, None)
        return root

    @property
    def comm_collectives(self) -> tuple[str, ...]:
        """All-gather and reduce-scatter, plus HSDP's all-reduce or the one across nodes."""
        if self.fsdp.mode == "hsdp":
            return (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)
        if self.replica_groups is not None:
            return (ALL_GATHER, REDUCE_SCATTER, ACROSS_NODES)
        return (ALL_GATHER, REDUCE_SCATTER, OUTER_ALL_REDUCE) if self.outer_sync else (ALL_GATHER, REDUCE_SCATTER)

    @property
    def checkpointed_blocks(self) -> tuple[nn.Module, ...]:
        """The blocks under activation checkpointing (empty until the plan is applied)."""
        return self.prepared.checkpointed if self.prepared is not None else ()

    @property
    def compiled_regions(self) -> tuple[nn.Module, ...]:
        """The modules whose ``forward`` is compiled (empty until the plan is applied)."""
        return self.prepared.compiled if self.prepared is not None else ()

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
        broadcast_buffers(self.model)
        if self.outer_sync is not None:
            reshard_everywhere(self.model)  # outer_sync swaps the shards
            self.outer_sync.evaluate_on_global_weights(self.model)

    @override
    def on_validation_end(self) -> None:
        if self.outer_sync is not None:
            reshard_everywhere(self.model)
            self.outer_sync.back_to_own_weights(self.model)
        super().on_validation_end()

    @override
    def on_train_end(self) -> None:
        if self.outer_sync is not None:
            reshard_everywhere(self.model)
            self.outer_sync.finish(self.model)
        super().on_train_end()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        broadcast_buffers(self.model)

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        broadcast_buffers(self.model)

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
            self._comm_log.log(self.lightning_module, self.comm_stats, self.comm_collectives, self.exposed_comm)
        return output

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """A non-final accumulation micro-batch: ``FSDPSharding.accumulating``."""
        if not isinstance(self.model, FSDPModule):
            yield
            return
        self._accumulating = True
        try:
            with self.fsdp.accumulating(self.model):
                yield
        finally:
            self._accumulating = False

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        with one_gradient_round(self.comm_stats):
            output = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._idle_experts is not None and self._idle_experts.trackers and not self._accumulating:
            # An optimizer step's last backward: experts no rank called keep no gradient, as under DDP.
            self._idle_experts.drop_gradients_of_experts_idle_everywhere(self._experts_group)
        return output

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.replica_groups is not None:
            closure = self.replica_groups.averaging_after(closure)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.replica_groups is not None:
            self.replica_groups.after_step(self.lightning_module.trainer)
        end_comm_step(self.comm_stats, self.exposed_comm)
        return output

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint: storage_options is not supported.")
        refuse_non_finite(self, checkpoint, filepath)
        path = Path(self.broadcast(filepath))
        self._resume.add_to(checkpoint, *resume_ranks(self))
        if self.outer_sync is not None:  # each node writes its own state; node 0 the checkpoint the nodes share
            reshard_everywhere(self.model)
            trainer = self.lightning_module.trainer
            stopping = trainer.received_sigterm  # set by our preemption handler before it saves
            self.outer_sync.save(self.model, self.optimizers, checkpoint, path, trainer.global_step, stopping)
            if self.node_rank != 0:
                return
        elif self.replica_groups is not None and not self.replica_groups.writes_checkpoints(self.node_rank):
            return  # the nodes hold the same state: one node's ranks write it
        if self.checkpoint_format == "full":  # one rank writes: global rank 0, or local rank 0 of the node writing
            writer = self.local_rank == 0 if self.replica_groups is not None else None
            save_one_file(self, checkpoint, path, writer=writer)
            self.barrier()
            return
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        tensors.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
        self._checkpoint_writer.save(
            tensors, path, write_extra=lambda folder: torch.save(checkpoint, folder / _METADATA_FILENAME)
        )

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        # Never delete the previous checkpoint before the one replacing it is published.
        self._checkpoint_writer.wait()
        if self.replica_groups is not None:  # the node that wrote the latest checkpoint prunes the folder
            if self.replica_groups.wrote_last_checkpoint and self.local_rank == 0:
                self.checkpoint_io.remove_checkpoint(filepath)
            return
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            remove_node_files(filepath)  # the nodes' states of an outer_sync checkpoint, if any

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        self._checkpoint_writer.wait()
        self.barrier()
        load = functools.partial(self._load_under_module_names, weights_only=weights_only)
        checkpoint = load_or_fall_back(self, checkpoint_path, load, expects_folder=None)
        self._resume.take_from(checkpoint, *resume_ranks(self))  # under outer_sync node 0's; this node's at start
        if self.outer_sync is not None and self.lightning_module.trainer.training:
            self.outer_sync.load(checkpoint, checkpoint_path)
        return checkpoint

    def _load_under_module_names(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        with self._lightning_module_names():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

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
        step alike)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return on_across_nodes(self.replica_groups, self.lightning_module, tensor, "max")

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        if across_nodes_job(self) is None:
            return super().reduce_boolean_decision(decision, all)
        return decide_across_nodes(self.replica_groups, self.lightning_module, decision, all, self.root_device)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # A checkpoint holds rank 0's buffers, as DDP's does: a sharded save writes each from any one rank.
        broadcast_buffers(self.model)
        if self.outer_sync is None:
            with self._lightning_module_names():
                return super().lightning_module_state_dict()
        # Under outer_sync the global weights, so that a checkpoint loads as what the nodes agreed on.
        reshard_everywhere(self.model)
        with self.outer_sync.global_weights(self.model), self._lightning_module_names():
            return {name: value.clone() for name, value in super().lightning_module_state_dict().items()}

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        with self._lightning_module_names():
            return super().optimizer_state(optimizer)

    @contextmanager
    def _lightning_module_names(self) -> Generator[None, None, None]:
        """Let ModelParallelStrategy's save and load see the LightningModule instead of the root around it, so that
        checkpoints hold its own parameter names (no ``module.`` prefix), as with every other strategy."""
        root = self.model
        self.model = self.lightning_module
        try:
            yield
        finally:
            self.model = root

    @override
    def on_exception(self, exception: BaseException) -> None:
        explain_lost_peer_of_job(exception, self.timeout, self.global_rank)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self.recompiles.stop()
        self._checkpoint_writer.wait()
        if across_nodes_job(self) is not None:
            across_nodes_job(self).teardown()
        if self._preemption is not None:
            self._preemption.uninstall()
            self._preemption = None
        if self._synced_batchnorm and self._root is not None:  # as Lightning's DDPStrategy and FSDPStrategy do
            _sync_batchnorm_in_place(self._root, sync=False)
            self._synced_batchnorm = False
        super().teardown()


def _sync_batchnorm_in_place(model: nn.Module, sync: bool) -> None:
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


def _materialize(module: nn.Module, device: torch.device, cpu_offload: bool) -> None:
    """Lightning's meta-device materialisation; under ``cpu_offload`` the parameter shards are made on the CPU,
    where FSDP2 expects them at the first forward (the buffers go to ``device`` in ``model_to_device``)."""
    _materialize_distributed_module(module, torch.device("cpu") if cpu_offload else device)


def _move_all_but_parameters(module: nn.Module, device: torch.device) -> None:
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
        _move_all_but_parameters(child, device)


register_once(FastFSDPStrategy, "fast_fsdp", "FSDP2 applied per block by lightning_fastdist")
