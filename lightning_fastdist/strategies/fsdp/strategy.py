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
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_fastdist.diagnostics.recompiles import RecompileWatcher
from lightning_fastdist.parallel.across_nodes.outer_sync.settings import OuterSync
from lightning_fastdist.parallel.across_nodes.replica_groups.settings import ReplicaGroups
from lightning_fastdist.parallel.comm.accounting import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CommStats
from lightning_fastdist.parallel.comm.buffers import broadcast_buffers
from lightning_fastdist.parallel.comm.exposed import ExposedCommClock
from lightning_fastdist.parallel.faults.collective_timeout import collective_timeout
from lightning_fastdist.parallel.fsdp.comm_accounting import counted_fsdp_communication
from lightning_fastdist.parallel.fsdp.sharding import FSDPSharding, RootUnit, ShardingMode, shard_model
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
from lightning_fastdist.strategies.across_nodes import across_nodes
from lightning_fastdist.strategies.across_nodes.outer_sync_checkpoint import remove_node_files
from lightning_fastdist.strategies.checkpoint.fault_tolerance import load_or_fall_back
from lightning_fastdist.strategies.common.comm_metrics import one_gradient_round
from lightning_fastdist.strategies.common.job import (
    check_names_at_launch,
    check_names_before_joining,
    join_process_group_once,
    names_checkable,
)
from lightning_fastdist.strategies.common.options import (
    blocks_option,
    check_async_checkpointing,
    check_checkpoint_format,
    named_errors,
)
from lightning_fastdist.strategies.common.registry import register_once
from lightning_fastdist.strategies.common.shared_hooks import SharedHooks
from lightning_fastdist.strategies.common.unsupported import FSDP_REFUSALS, refuse_unsupported
from lightning_fastdist.strategies.fsdp.meta_device import materialised_before_loads, materialize
from lightning_fastdist.strategies.fsdp.root_regather import RootRegather
from lightning_fastdist.strategies.fsdp.sharded_module import (
    move_to_device,
    refuse_fsdp1,
    save_sharded,
    sync_batchnorm_in_place,
    under_module_names,
    with_saved_group_keys,
)


class FastFSDPStrategy(ModelParallelStrategy):
    """FSDP2 sharding of an unchanged LightningModule: ZeRO-3, ZeRO-2 or HSDP, per block.

    Args:
        blocks: with ``activation_checkpointing``, ``compile`` and ``compile_scope``, the plan's (``ParallelPlan``):
            each block is an FSDP unit; parameters outside every block belong to the root, sharded last.
        sharding: ``"zero3"``, ``"zero2"`` or ``"hsdp"``; it and ``hsdp_group_size``, ``cpu_offload``, ``keep_fp32``
            are described in ``FSDPSharding``.
        checkpoint_format: ``"sharded"`` (per-rank shards, loadable at any world size) or ``"full"`` (one file).
        async_checkpointing: write checkpoints (either format) in the background while the fit trains on.
        outer_sync: as FastDDPStrategy's, each rank crossing nodes with the same shard's ranks. Not with HSDP.
        replica_groups: as FastDDPStrategy's, each rank crossing nodes as under ``outer_sync``. Not with HSDP.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; ``None`` picks the device's default.
        timeout: seconds (or a ``timedelta``) a collective may wait for the other ranks; ``None`` keeps torch's.
        log_comm_bytes: as FastDDPStrategy's, for each collective (FSDP2's custom collectives: torch >= 2.9).
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
        owner = type(self).__name__
        with named_errors(owner):
            self.fsdp = FSDPSharding(sharding, hsdp_group_size, cpu_offload, tuple(keep_fp32 or ()))
            blocks = blocks_option(owner, blocks, "shard_modules", shard_modules)
            self.plan = ParallelPlan(blocks, activation_checkpointing, compile, compile_scope)
            check_checkpoint_format(checkpoint_format)
            check_async_checkpointing(async_checkpointing)
            nodes = across_nodes(outer_sync, replica_groups, owner, self.plan.blocks, sharded=True)
            nodes.check_sharding(sharding)
        self.timeout = collective_timeout(timeout, owner)
        super().__init__(
            save_distributed_checkpoint=checkpoint_format == "sharded",
            process_group_backend=process_group_backend,
            timeout=self.timeout,
        )
        self.checkpoint_format = checkpoint_format
        self.async_checkpointing = async_checkpointing
        self.across_nodes = nodes
        self.shared = SharedHooks(self, nodes, log_comm_bytes, async_checkpointing)
        self.comm_stats: CommStats | None = None  # this rank's FSDP collective bytes and gradient rounds, once counted
        self._root: RootUnit | None = None
        self._root_regather = RootRegather()
        self._idle_experts: IdleExperts | None = None
        self._accumulating = False
        self._synced_batchnorm = False  # BatchNorm layers are SyncBatchNorm for this fit (Trainer(sync_batchnorm=True))
        self.prepared: PreparedBlocks | None = None
        self.recompiles = RecompileWatcher(report=rank_zero_warn)
        self.exposed_comm: ExposedCommClock | None = None  # set when the model is sharded

    @override
    def _configure_launcher(self) -> None:
        self.fsdp = self.fsdp.for_world(self.num_nodes * self.num_processes, self.num_processes)  # HSDP's split, now
        super()._configure_launcher()
        check_names_at_launch(self._launcher, self, self.check_names, self.num_nodes)
        self.across_nodes.check_launch(self.num_nodes)

    def check_names(self, module: pl.LightningModule | None) -> None:
        """Refuse a block or ``keep_fp32`` name ``module`` lacks, before any process starts (or at sharding)."""
        if names_checkable(module):
            block_classes = resolve_blocks(module, self.plan.blocks)
            self.fsdp.refuse_unreduced_root(module, block_classes, backward_in_step=not module.automatic_optimization)
            self.fsdp.units(module, [])  # resolves keep_fp32
            self.across_nodes.check_blocks(module, outermost_block_modules(module, block_classes))

    @override
    def setup_environment(self) -> None:
        check_names_before_joining(self._launcher, self, self.check_names)
        self.set_world_ranks()
        self.across_nodes.join(self, self._get_process_group_backend(), self.timeout)  # a world per node: FSDP in it
        join_process_group_once(self, self._get_process_group_backend(), self.timeout)
        self._setup_distributed()  # Lightning's: finds the group initialised and keeps it
        self._device_mesh = self.fsdp.mesh(self.root_device.type, dist.get_world_size())
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank is a data-parallel replica, whatever the sharding (across nodes: ``across_nodes``' sampler)."""
        return self.across_nodes.evaluation_sampler(self) or {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        refuse_fsdp1(self.model, type(self).__name__)  # as Lightning's ModelParallelStrategy, whose setup this replaces
        refuse_unsupported(trainer, type(self).__name__, FSDP_REFUSALS)
        self.shared.setup(trainer)
        if self.plan.compile_config is not None:
            self.recompiles.start()
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING  # Trainer(sync_batchnorm=True): SyncBatchNorm while fitting
        self._synced_batchnorm = fitting and self._layer_sync is not None
        if self._root is None or self._root.module is not self.lightning_module:  # a second fit reuses the root
            module = self.precision_plugin.convert_module(self.lightning_module)
            if self._synced_batchnorm:
                module = self._layer_sync.apply(module)  # before sharding, as Lightning's FSDPStrategy does
            self._root = self.parallelize(module)  # where ModelParallelStrategy expects configure_model to have sharded
            materialize(self._root, self.root_device, self.fsdp.cpu_offload)
            self._root_regather.set_root(self._root)
        elif self._synced_batchnorm:
            sync_batchnorm_in_place(self._root, sync=True)  # the previous fit's teardown reverted it
        self.model = self._root  # Lightning's forward redirection runs each step through it: inside the root's hooks
        self.model_to_device()  # as in Lightning: move all that is left (parameterless modules, .device)
        self.barrier()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        move_to_device(self.model, self.root_device, self.fsdp.cpu_offload)  # what FSDP did not place

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        with super().tensor_init_context(empty_init), materialised_before_loads(empty_init):
            yield  # Trainer.init_module: weights loaded into the meta model are the weights that train (empty_init.py)

    def parallelize(self, model: nn.Module) -> RootUnit:
        """Apply the plan to ``model`` in place with FSDP as its wrapper; return the root unit."""
        manual = not getattr(model, "automatic_optimization", True)  # a model built in configure_model is checked here
        self.fsdp.refuse_unreduced_root(model, resolve_blocks(model, self.plan.blocks), backward_in_step=manual)
        root, units, self.prepared, self._idle_experts = shard_model(
            model, self.device_mesh, self.plan, self.fsdp, self.precision_plugin.precision, rank_zero_info
        )
        self.recompiles.call_sites = self.prepared.compiled_call_sites  # a recompile's report names them
        if self._idle_experts.trackers:
            self._idle_experts.group = dist.new_group(backend="gloo")  # host-side flags: no device sync
        hsdp = self.fsdp.mode == "hsdp"
        self.comm_stats, self.exposed_comm = counted_fsdp_communication(units, self.comm_stats, hsdp, self.root_device)
        return root

    @property
    def comm_collectives(self) -> tuple[str, ...]:
        """All-gather and reduce-scatter, plus HSDP's all-reduce or the one across nodes."""
        hsdp = (ALL_REDUCE,) if self.fsdp.mode == "hsdp" else ()
        return (ALL_GATHER, REDUCE_SCATTER, *hsdp, *self.across_nodes.collectives)

    @property
    def checkpointed_blocks(self) -> tuple[nn.Module, ...]:
        """The blocks under activation checkpointing (empty until the plan is applied)."""
        return self.prepared.checkpointed if self.prepared is not None else ()

    @property
    def compiled_regions(self) -> tuple[nn.Module, ...]:
        """The modules whose ``forward`` is compiled (empty until the plan is applied)."""
        return self.prepared.compiled if self.prepared is not None else ()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.shared.on_train_start()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        broadcast_buffers(self.model)
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
    def on_test_start(self) -> None:
        super().on_test_start()
        broadcast_buffers(self.model)

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        broadcast_buffers(self.model)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self.shared.training_data(super().process_dataloader(dataloader))

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.shared.before_batch()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._root_regather.during_step():  # manual optimization may toggle or step the root's parameters
            output = super().training_step(*args, **kwargs)
        return self.shared.after_training_step(output)

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
            self._idle_experts.drop_gradients_of_experts_idle_everywhere()
        self._root_regather.arm()  # under manual optimization, a forward may follow inside the step (GAN)
        return output

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        closure = self.across_nodes.averaging_after(closure)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.shared.after_optimizer_step()
        return output

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint: storage_options is not supported.")
        path = Path(self.broadcast(filepath))
        if not self.shared.prepare_save(checkpoint, path):
            return
        if self.checkpoint_format == "full":
            self.shared.saves.one_file(checkpoint, path, self.across_nodes.writes_files(self), [])
            return
        save_sharded(self.shared.saves, checkpoint, path)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        # The rank that wrote it, with the nodes' own states beside a checkpoint written across nodes, if any.
        self.shared.saves.remove(filepath, self.across_nodes.writes_files(self), remove_node_files)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        read = functools.partial(under_module_names(self, super().load_checkpoint), weights_only=weights_only)
        load = with_saved_group_keys(read, self.optimizers)  # each candidate's index read where a fall-back sees it
        checkpoint, checkpoint_path = load_or_fall_back(self, checkpoint_path, load, expects_folder=None)
        self.shared.take_loaded(checkpoint, checkpoint_path)
        return checkpoint

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Lightning's reduction over the world, then across nodes where they train one model every step."""
        reduced = super().reduce(tensor, group, reduce_op)
        return reduced if group is not None else self.across_nodes.reduce(self.lightning_module, reduced, reduce_op)

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s maximum over every rank training, in place (NonFiniteLoss: every rank skips a step alike)."""
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
        broadcast_buffers(self.model)  # rank 0's in the checkpoint, as DDP's (a sharded save writes any rank's)
        return self.across_nodes.weights_to_save(
            self.model, under_module_names(self, super().lightning_module_state_dict)
        )

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return under_module_names(self, super().optimizer_state)(optimizer)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.shared.on_exception(exception)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self.recompiles.stop()
        self.shared.teardown()
        if self._synced_batchnorm and self._root is not None:  # as Lightning's DDPStrategy and FSDPStrategy do
            sync_batchnorm_in_place(self._root, sync=False)
            self._synced_batchnorm = False
        super().teardown()


register_once(FastFSDPStrategy, "fast_fsdp", "FSDP2 applied per block by lightning_fastdist")
