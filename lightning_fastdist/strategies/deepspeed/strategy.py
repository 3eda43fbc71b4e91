"""FastDeepSpeedStrategy: DeepSpeed ZeRO through Lightning, on CUDA (NCCL) and on CPU (gloo), with our pieces.

Lightning's ``DeepSpeedStrategy`` refuses every accelerator but CUDA, although DeepSpeed trains ZeRO 1-3 on CPU
processes over gloo. This subclass makes the changes a CPU device needs (``docs/deepspeed.md``) and adds what our
other strategies do: activation checkpointing, the collective ``timeout``, preemption, communication accounting,
atomic checkpoints and exact resume.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.strategies.deepspeed import _validate_device_index_selection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_fastdist.parallel.comm.accounting import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CommStats
from lightning_fastdist.parallel.comm.buffers import broadcast_buffers
from lightning_fastdist.parallel.comm.exposed import ExposedCommClock
from lightning_fastdist.parallel.deepspeed.comm_accounting import count_deepspeed_communication
from lightning_fastdist.parallel.deepspeed.runtime import (
    call_current_collective_names,
    check_deepspeed_device,
    engines_placed_on,
    groups_wait_as_long_as,
    import_deepspeed,
    skip_jit_built_comm_ops,
)
from lightning_fastdist.parallel.deepspeed.settings import BucketSize, DeepSpeedSettings
from lightning_fastdist.parallel.deepspeed.zero3_trace import start_zero3_steps_at_the_outer_forward
from lightning_fastdist.parallel.faults.collective_timeout import collective_timeout
from lightning_fastdist.parallel.plan.blocks import block_modules, resolve_blocks
from lightning_fastdist.parallel.plan.idle_experts import IdleExperts
from lightning_fastdist.parallel.plan.parallel_plan import (
    BlocksOption,
    CheckpointingOption,
    ParallelPlan,
    PreparedBlocks,
)
from lightning_fastdist.strategies.checkpoint.fault_tolerance import load_or_fall_back
from lightning_fastdist.strategies.common.comm_metrics import one_gradient_round
from lightning_fastdist.strategies.common.job import (
    check_names_at_launch,
    check_names_before_joining,
    join_process_group_once,
    names_checkable,
)
from lightning_fastdist.strategies.common.options import check_async_checkpointing, named_errors
from lightning_fastdist.strategies.common.registry import register_once
from lightning_fastdist.strategies.common.shared_hooks import SharedHooks, attached_trainer
from lightning_fastdist.strategies.common.unsupported import DEEPSPEED_REFUSALS, refuse_unsupported
from lightning_fastdist.strategies.deepspeed.accumulation_windows import (
    epoch_ends_at_this_batch,
    window_closes_at_this_batch,
)
from lightning_fastdist.strategies.deepspeed.checkpoint_folder import save_checkpoint_folder
from lightning_fastdist.strategies.deepspeed.consolidate import full_weights_of_folder
from lightning_fastdist.strategies.deepspeed.micro_batch_size import micro_batch_size
from lightning_fastdist.strategies.deepspeed.offload import offloaded_optimizer
from lightning_fastdist.strategies.deepspeed.trainer_settings import refuse_settings_deepspeed_ignores

DEVICE_TYPES = ("cpu", "cuda")


class FastDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO stage 1, 2 or 3 on GPUs or CPU processes, with our activation checkpointing and accounting.

    Args:
        stage: the ZeRO stage; with ``offload_optimizer``, ``offload_parameters``, ``allgather_bucket_size`` and
            ``reduce_bucket_size``, described in
            :class:`~lightning_fastdist.parallel.deepspeed.settings.DeepSpeedSettings`.
        activation_checkpointing: with ``blocks``, the plan's
            (:class:`~lightning_fastdist.parallel.plan.parallel_plan.ParallelPlan`), applied before DeepSpeed
            wraps the model.
        load_full_weights: at stage 3, ``ckpt_path`` is one file of full weights (e.g. from ``consolidate_checkpoint``)
            instead of a DeepSpeed checkpoint folder; optimizer state is then not restored.
        log_comm_bytes: log the bytes of the last optimizer step's collectives as ``comm/<collective>_bytes_per_step``
            (host-side, no device sync) and the time the step waited for them as ``comm/exposed_s``.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; ``None`` picks by device.
        timeout: seconds (or a ``timedelta``) a collective may wait for the other ranks; ``None`` keeps torch's.
        async_checkpointing: write checkpoint folders in the background while the fit trains on.
        accelerator: with ``parallel_devices``, ``cluster_environment``, ``precision_plugin``: set by the Trainer
            (``Trainer(precision=...)``: DeepSpeed runs bf16/fp16 itself).
    """

    handles_preemption = True  # read by SyncFreeLogging, which otherwise installs the same handler itself

    def __init__(
        self,
        stage: Literal[1, 2, 3] = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        activation_checkpointing: CheckpointingOption = "none",
        blocks: BlocksOption = "auto",
        allgather_bucket_size: BucketSize = "auto",
        reduce_bucket_size: BucketSize = "auto",
        load_full_weights: bool = False,
        log_comm_bytes: bool = True,
        process_group_backend: str | None = None,
        timeout: float | timedelta | None = None,
        async_checkpointing: bool = False,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        import_deepspeed(type(self).__name__)
        with named_errors(type(self).__name__):
            self.settings = DeepSpeedSettings(
                stage, offload_optimizer, offload_parameters, allgather_bucket_size, reduce_bucket_size
            )
            # No compile option: DeepSpeed's engine wraps the module and runs its forward.
            self.plan = ParallelPlan(blocks, activation_checkpointing)
            check_async_checkpointing(async_checkpointing)
        self.timeout = collective_timeout(timeout, type(self).__name__)
        until_sized = self.settings.bucket_sizes()  # "auto" is sized to the model in _setup_model
        super().__init__(
            accelerator=accelerator,
            stage=stage,
            offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters,
            allgather_bucket_size=until_sized["allgather_bucket_size"],
            reduce_bucket_size=until_sized["reduce_bucket_size"],
            load_full_weights=load_full_weights,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=self.timeout,
        )
        # Offload may keep the module's own torch optimizer (where DeepSpeedCPUAdam, a C++ op compiled at run
        # time, cannot replace it: see _offloaded_optimizer); DeepSpeed would otherwise refuse it.
        self.config["zero_force_ds_cpu_optimizer"] = False
        self.shared = SharedHooks(self, log_comm_bytes=log_comm_bytes, async_checkpointing=async_checkpointing)
        self.comm_stats: CommStats | None = None  # this rank's collective bytes and gradient rounds, once counted
        self._stop_counting: Callable[[], None] | None = None
        self.exposed_comm: ExposedCommClock | None = None  # set when the engine is built
        self.prepared: PreparedBlocks | None = None
        self._full_weights_to_load = False  # set by load_checkpoint for an evaluation from a ZeRO-3 folder

    @override
    def _configure_launcher(self) -> None:
        refuse_settings_deepspeed_ignores(type(self).__name__, self.precision_plugin, self._layer_sync)
        super()._configure_launcher()
        check_names_at_launch(self._launcher, self, self.check_names, self.num_nodes)

    def check_names(self, module: LightningModule | None) -> None:
        """Raise the one-line ``ValueError`` of a block class name that ``module`` lacks, before any process starts
        (a model that builds its layers in ``configure_model`` is checked when the plan is applied)."""
        if names_checkable(module):
            resolve_blocks(module, self.plan.blocks)

    @override
    def setup_environment(self) -> None:
        check_names_before_joining(self._launcher, self, self.check_names)
        device = self.root_device
        if device.type not in DEVICE_TYPES:
            raise RuntimeError(f"{type(self).__name__}: runs on {' or '.join(DEVICE_TYPES)}, not {device.type}.")
        check_deepspeed_device(device, type(self).__name__)
        if device.type == "cuda":  # offloaded state in page-locked host memory: faster copies to and from the GPU
            for section in ("offload_optimizer", "offload_param"):
                self.config.get("zero_optimization", {}).get(section, {}).update(pin_memory=True)
        # Lightning's DeepSpeedStrategy refuses any accelerator but CUDA here; what follows is DDP's.
        super(DeepSpeedStrategy, self).setup_environment()

    @override
    def setup_distributed(self) -> None:
        # Lightning's, with the device-index check only where devices have indices, and our process group.
        if self.root_device.type == "cuda":
            assert self.parallel_devices is not None
            _validate_device_index_selection(self.parallel_devices)
        self.set_world_ranks()
        join_process_group_once(self, self._get_process_group_backend(), self.timeout)
        reset_seed()
        self._init_deepspeed_distributed()

    @override
    def _init_deepspeed_distributed(self) -> None:
        skip_jit_built_comm_ops()
        super()._init_deepspeed_distributed()
        call_current_collective_names()
        groups_wait_as_long_as(self.timeout)

    @override
    def setup(self, trainer: Any) -> None:
        refuse_unsupported(trainer, type(self).__name__, DEEPSPEED_REFUSALS)
        self.shared.setup(trainer)
        super().setup(trainer)  # builds the DeepSpeed engine
        if self._stop_counting is None:
            self.exposed_comm = ExposedCommClock(self.root_device)
            if self.comm_stats is None:  # a second fit counts on
                self.comm_stats = CommStats()
            self._stop_counting = count_deepspeed_communication(self.comm_stats, self.exposed_comm)

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        # Called by Lightning's setup before deepspeed.initialize, which is the plan's wrapper here.
        self.config["zero_optimization"].update(self.settings.bucket_sizes(model))
        if self.prepared is None:  # a second fit meets the blocks already checkpointed
            self._give_idle_experts_zero_gradients(model)
            _, self.prepared = self.plan.apply(model, log=rank_zero_info)
        return model

    def _give_idle_experts_zero_gradients(self, model: torch.nn.Module) -> None:
        """Stages 1-2: experts idle on a rank get zero gradients there (parallel/plan/idle_experts.py), so every rank
        reduces the same buffers; stage 3 gathers a module's parameters only when it is called: refused."""
        units = [model, *block_modules(model, resolve_blocks(model, self.plan.blocks))]
        idle_experts = IdleExperts(model, units)
        if idle_experts.trackers and self.settings.stage == 3:
            raise ValueError(
                f"FastDeepSpeedStrategy: stage 3 cannot train experts that may sit idle on a rank "
                f"({idle_experts.describe()}: ZeRO-3 gathers a module's weights only when it is called); use "
                "stage=2 or FastFSDPStrategy, which give an idle expert a zero gradient."
            )

    @override
    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
        import deepspeed  # noqa: PLC0415 - optional; import_deepspeed checked it in __init__

        if self.settings.offload_optimizer and optimizer is not None:
            optimizer = offloaded_optimizer(self, optimizer)
        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        start_zero3_steps_at_the_outer_forward(engine)  # a LightningModule calls itself inside its forward
        return engine, deepspeed_optimizer

    @override
    def _initialize_deepspeed_inference(self, model: torch.nn.Module) -> None:
        with engines_placed_on(self._device_rank):  # validate, test and predict build an engine of their own
            super()._initialize_deepspeed_inference(model)

    @property
    def _device_rank(self) -> int:
        """Where DeepSpeed's engine goes: the device's index, and on CPU (no index) the local rank."""
        return self.root_device.index if self.root_device.index is not None else self.local_rank

    @override
    def _auto_select_batch_size(self) -> int:
        assert self.lightning_module is not None  # only logged by DeepSpeed: the first loader's (micro_batch_size.py)
        data_source = self.lightning_module.trainer.fit_loop._data_source
        return micro_batch_size(data_source.dataloader()) if data_source.is_defined() else 1

    @property
    def comm_collectives(self) -> tuple[str, ...]:
        """Gradient reduction and parameter gathering: all-reduce / reduce-scatter and all-gather."""
        return (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER)

    @property
    def checkpointed_blocks(self) -> tuple[torch.nn.Module, ...]:
        """The blocks under activation checkpointing (empty until the plan is applied)."""
        return self.prepared.checkpointed if self.prepared is not None else ()

    @property
    def compiled_regions(self) -> tuple[torch.nn.Module, ...]:
        """Always empty: DeepSpeed's engine runs the module's forward, nothing is compiled."""
        return ()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.shared.on_train_start()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        broadcast_buffers(self.model)

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
        output = super().training_step(*args, **kwargs)
        return self.shared.after_training_step(output)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Lightning's closure has already divided the loss by the accumulation (DDP's gradients are the mean over
        # micro-batches); DeepSpeed's engine would divide it again, as if the learning rate were that much smaller.
        kwargs.setdefault("scale_wrt_gas", False)
        with one_gradient_round(self.comm_stats):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        # The engine accumulates, but not over an epoch's end: Lightning counts an epoch's last step as under DDP.
        trainer = attached_trainer(self)
        return trainer is None or not trainer.training or not epoch_ends_at_this_batch(trainer)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # Lightning calls this on every micro-batch; the engine steps where Lightning's window closes, told before the
        # closure's forward and backward (accumulation_windows.py). The step's communication count closes there too.
        boundary = window_closes_at_this_batch(self.lightning_module.trainer)
        self.deepspeed_engine.set_gradient_accumulation_boundary(boundary)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if boundary:
            self.shared.after_optimizer_step()
        return output

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint: storage_options is not supported.")
        path = Path(self.broadcast(filepath))
        self.shared.prepare_save(checkpoint, path)
        # DeepSpeed's writer fills <name>.partial on every rank; rank 0 then publishes it as <name>.
        write = functools.partial(super().save_checkpoint, checkpoint)
        save_checkpoint_folder(self.shared.saves, self.deepspeed_engine, write, path)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self.shared.saves.remove(filepath, self.is_global_zero)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        load = functools.partial(super().load_checkpoint, weights_only=weights_only)
        self._full_weights_to_load = self._evaluates_from_zero3_folder(checkpoint_path)
        if self._full_weights_to_load:
            load = full_weights_of_folder
        checkpoint, checkpoint_path = load_or_fall_back(self, checkpoint_path, load, not self.load_full_weights)
        # Under ZeRO-3 every rank reads its own file: every rank takes rank 0's, as every rank reads DDP's one file
        # (the LightningModule's and the callbacks' state, and the resume state of every rank).
        checkpoint.update(self.broadcast({key: value for key, value in checkpoint.items() if key != "state_dict"}))
        self.shared.take_loaded(checkpoint, checkpoint_path)
        return checkpoint

    def _evaluates_from_zero3_folder(self, checkpoint_path: Any) -> bool:
        """validate/test/predict from a ZeRO-3 checkpoint folder: DeepSpeed's inference engine has no ZeRO optimizer
        and its ``load_checkpoint`` fails on that (DeepSpeed 0.19): the weights are assembled from the folder."""
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return self.zero_stage_3 and not self.load_full_weights and not fitting and Path(checkpoint_path).is_dir()

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._full_weights_to_load:
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        self._full_weights_to_load = False
        self.model_to_device()
        self._restore_zero_state(checkpoint, strict=strict)  # Lightning's: gathers each module's weights to load

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.shared.on_exception(exception)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if self._stop_counting is not None:
            self._stop_counting()
            self._stop_counting = None
        self.shared.teardown()
        super().teardown()


register_once(FastDeepSpeedStrategy, "fast_deepspeed", "DeepSpeed ZeRO 1-3 on GPUs and CPUs by lightning_fastdist")
