"""FastFSDPStrategy: FSDP2 applied automatically, with the parts Lightning leaves to the user.

Lightning's ``ModelParallelStrategy`` runs FSDP2 but asks the user to call
``fully_shard`` in ``configure_model`` and reduce-scatters gradients on every
accumulation micro-batch. This strategy shards the unchanged model itself
(see :meth:`FastFSDPStrategy.parallelize` for the order) inside a root unit
around the LightningModule (:class:`~lightning_fastdist.parallel.fsdp.RootUnit`),
so that a step may call ``self(...)``, ``self.model(...)`` or any submodule,
skips gradient communication on non-final micro-batches,
counts the bytes of every all-gather and reduce-scatter, and writes checkpoints
atomically, optionally in the background.
"""

from __future__ import annotations

import functools
from collections.abc import Generator
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
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_fastdist.parallel.activation_checkpointing import validate_activation_checkpointing
from lightning_fastdist.parallel.atomic_checkpoint import ShardedCheckpointWriter
from lightning_fastdist.parallel.comm_accounting import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CommStats
from lightning_fastdist.parallel.fsdp import RootUnit, build_fsdp_mesh, shard_model, validate_sharding
from lightning_fastdist.parallel.fsdp_comm_accounting import count_fsdp_communication
from lightning_fastdist.strategies.blocks_option import blocks_option, resolve_and_log_blocks, without_kv_cache
from lightning_fastdist.strategies.comm_metrics import CommBytesLogging, GradientRoundPerBackward
from lightning_fastdist.strategies.exact_resume import ExactResume
from lightning_fastdist.strategies.fault_tolerance import FaultTolerance
from lightning_fastdist.strategies.shared_setup import SharedSetup

CHECKPOINT_FORMATS = ("sharded", "full")


class FastFSDPStrategy(
    SharedSetup, FaultTolerance, ExactResume, CommBytesLogging, GradientRoundPerBackward, ModelParallelStrategy
):
    """FSDP2 sharding of an unchanged LightningModule: ZeRO-3, ZeRO-2 or HSDP, per block.

    Args:
        blocks: ``"auto"`` (the outermost repeated modules that hold layers, e.g.
            the transformer layers; see :func:`~lightning_fastdist.parallel.blocks.find_blocks`),
            or a list of class names (``"Block"`` or ``"my_pkg.model.Block"``) whose
            instances become FSDP units. Parameters outside every unit belong to the
            root (the LightningModule), sharded last; a model without blocks is one unit.
        sharding: ``"zero3"`` (free gathered parameters after each block's
            forward), ``"zero2"`` (keep them until its backward: less
            communication, more memory) or ``"hsdp"`` (shard within groups of
            ``hsdp_group_size`` ranks, replicate across groups).
        hsdp_group_size: ranks per shard group under ``"hsdp"``; must divide the
            world size. ``None`` means the devices of one node.
        cpu_offload: keep sharded parameters, gradients and the optimizer step on
            the CPU; each block is copied to the device for its compute.
        activation_checkpointing: ``"none"``, ``"full"`` (recompute each block in
            backward), ``"selective"`` (keep matmul/attention outputs, recompute
            the rest) or an integer ``n`` (full checkpointing of every n-th block).
        compile: ``false``, ``true`` (inductor) or a mapping of ``torch.compile`` arguments
            (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``).
        compile_scope: ``"blocks"`` (compile each block's forward between checkpointing and
            sharding; FSDP's hooks stay outside the graphs) or ``"model"`` (the module's forward).
        checkpoint_format: ``"sharded"`` (a folder of per-rank shards, loadable at
            any world size) or ``"full"`` (one file gathered on rank 0).
        async_checkpointing: write sharded checkpoints in a background thread
            (training continues once the state is copied to host memory).
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; ``None`` picks the device's default.
        timeout: seconds (or a ``timedelta``) a collective may wait for the other ranks before this
            process fails with an error instead of hanging (a rank that died or is stuck); ``None``
            keeps torch's 30 minutes. Jobs that restart themselves want a few minutes.
        log_comm_bytes: log the bytes of the last optimizer step's parameter all-gathers and
            gradient reduce-scatters (and HSDP all-reduces) as ``comm/allgather_bytes_per_step``,
            ``comm/reduce_scatter_bytes_per_step`` (``comm/allreduce_bytes_per_step``): host-side
            counts, no device sync. Needs torch >= 2.9 (FSDP2's custom collectives).
        shard_modules: deprecated spelling of ``blocks`` (one more release).
    """

    strategy_name = "fast_fsdp"
    strategy_description = "FSDP2 applied per block by lightning_fastdist"

    def __init__(
        self,
        blocks: Literal["auto"] | list[str] = "auto",
        sharding: Literal["zero3", "zero2", "hsdp"] = "zero3",
        hsdp_group_size: int | None = None,
        cpu_offload: bool = False,
        activation_checkpointing: Literal["none", "full", "selective"] | int = "none",
        compile: bool | dict[str, Any] = False,
        compile_scope: Literal["blocks", "model"] = "blocks",
        checkpoint_format: Literal["sharded", "full"] = "sharded",
        async_checkpointing: bool = False,
        process_group_backend: str | None = None,
        timeout: float | timedelta | None = None,
        log_comm_bytes: bool = True,
        shard_modules: str | list[str] | None = None,
    ) -> None:
        validate_sharding(sharding, hsdp_group_size)
        timeout = self.take_shared_options(timeout, compile, compile_scope)
        validate_activation_checkpointing(activation_checkpointing)
        blocks = blocks_option("FastFSDPStrategy", blocks, "shard_modules", shard_modules)
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"checkpoint_format: got {checkpoint_format!r}; use one of {', '.join(map(repr, CHECKPOINT_FORMATS))}."
            )
        if async_checkpointing and checkpoint_format != "sharded":
            raise ValueError(
                "async_checkpointing: needs checkpoint_format='sharded' (a full file is written by rank 0 alone)."
            )
        super().__init__(
            save_distributed_checkpoint=checkpoint_format == "sharded",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.blocks = blocks
        self.sharding = sharding
        self.hsdp_group_size = hsdp_group_size
        self.cpu_offload = cpu_offload
        self.activation_checkpointing = activation_checkpointing
        self.checkpoint_format = checkpoint_format
        self.async_checkpointing = async_checkpointing
        self._checkpoint_writer = ShardedCheckpointWriter()
        self.compiled_regions: list[nn.Module] = []
        self.log_comm_bytes = log_comm_bytes
        self._comm_stats = CommStats()
        self._comm_counted = False
        self._root: RootUnit | None = None

    @property
    def _shard_group_size(self) -> int:
        return self.hsdp_group_size or self.num_processes

    @override
    def _configure_launcher(self) -> None:
        # The world size is known here, before any process starts: refuse a bad HSDP split now.
        if self.sharding == "hsdp":
            validate_sharding(self.sharding, self._shard_group_size, self.num_nodes * self.num_processes)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        self._device_mesh = build_fsdp_mesh(
            self.root_device.type, self.world_size, self.sharding, self._shard_group_size
        )
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
        # Every rank is a data-parallel replica, whatever the sharding.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.start_shared(trainer)
        self.accelerator.setup(trainer)
        if self._root is None or self._root.module is not self.lightning_module:  # a second fit reuses the root
            module = self.precision_plugin.convert_module(self.lightning_module)
            self._root = self.parallelize(module)  # where ModelParallelStrategy expects configure_model to have sharded
            _materialize_distributed_module(self._root, self.root_device)
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
        """Move what FSDP did not place: parameterless modules (torchmetrics metrics), ``LightningModule.device``.

        FSDP puts every parameter and buffer on the device itself; ``Module.to`` then moves
        the rest, as in Lightning. Under ``cpu_offload`` the parameter shards stay on the CPU.
        """
        assert self.model is not None
        if self.cpu_offload:
            _move_all_but_parameters(self.model, self.root_device)
        else:
            self.model.to(self.root_device)

    def parallelize(self, model: nn.Module) -> RootUnit:
        """Resolve the blocks, then checkpoint, compile and shard ``model`` in place; return the root.

        The order and its reasons: :func:`~lightning_fastdist.parallel.fsdp.shard_model`.
        """
        one_unit = "; FSDP shards the whole model as one unit (name its blocks for one unit each)"
        block_classes = resolve_and_log_blocks(model, self.blocks, without_blocks=one_unit)
        without_kv_cache(model, self.activation_checkpointing, self.compiles_blocks)
        root, units, self.compiled_regions = shard_model(
            model,
            self.device_mesh,
            block_classes,
            sharding=self.sharding,
            activation_checkpointing=self.activation_checkpointing,
            precision=self.precision_plugin.precision,
            cpu_offload=self.cpu_offload,
            compile_config=self.compile_config,
            compile_scope=self.compile_scope,
        )
        self._comm_counted = count_fsdp_communication(units, self._comm_stats, replicated=self.sharding == "hsdp")
        return root

    @property
    def comm_stats(self) -> CommStats | None:
        """This rank's FSDP collective bytes and gradient rounds (``None`` when this torch cannot count them)."""
        return self._comm_stats if self._comm_counted else None

    @property
    def comm_collectives(self) -> tuple[str, ...]:
        """The collectives this strategy runs: all-gather and reduce-scatter, plus HSDP's all-reduce."""
        return (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE) if self.sharding == "hsdp" else (ALL_GATHER, REDUCE_SCATTER)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the gradient reduce-scatter (and HSDP all-reduce) on a non-final accumulation micro-batch.

        Under ``zero2`` the gathered weights also stay gathered after such a micro-batch's
        backward: the next forward needs them unchanged (no optimizer step in between), so one
        all-gather per optimizer step replaces one per micro-batch. Memory does not grow: ZeRO-2
        holds every gathered weight at the end of each forward anyway.
        """
        if not isinstance(self.model, FSDPModule):
            yield
            return
        keep_gathered = self.sharding == "zero2"
        self.model.set_requires_gradient_sync(False)
        if keep_gathered:
            self.model.set_reshard_after_backward(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)
            if keep_gathered:
                self.model.set_reshard_after_backward(True)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint: storage_options is not supported.")
        self.refuse_non_finite(checkpoint, filepath)
        self._add_resume_state(checkpoint)
        path = Path(self.broadcast(filepath))
        if self.checkpoint_format == "full":
            self.save_one_file(checkpoint, path)
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
        super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        self._checkpoint_writer.wait()
        self.barrier()
        load = functools.partial(self._load_under_module_names, weights_only=weights_only)
        checkpoint = self.load_or_fall_back(checkpoint_path, load, expects_folder=None)
        self._take_resume_state(checkpoint)
        return checkpoint

    def _load_under_module_names(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        with self._lightning_module_names():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        with self._lightning_module_names():
            return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        with self._lightning_module_names():
            return super().optimizer_state(optimizer)

    @contextmanager
    def _lightning_module_names(self) -> Generator[None, None, None]:
        """Let ModelParallelStrategy's save and load see the LightningModule instead of the root around it.

        Checkpoints then hold the LightningModule's own parameter names (no ``module.`` prefix), as with every
        other strategy; FSDP's state-dict hooks on the modules that hold the root's parameters still reshard them.
        """
        root = self.model
        self.model = self.lightning_module
        try:
            yield
        finally:
            self.model = root

    @override
    def teardown(self) -> None:
        self.stop_shared()
        self._checkpoint_writer.wait()
        super().teardown()


def _move_all_but_parameters(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for every part of ``module`` that holds no parameter; device attributes updated."""
    if next(module.parameters(), None) is None:
        module.to(device)
        return
    if isinstance(module, _DeviceDtypeModuleMixin):
        module._device = device  # what LightningModule.device reports
    for child in module.children():
        _move_all_but_parameters(child, device)


FastFSDPStrategy.register_once()
