"""FastDDPStrategy: Lightning's DDP with gradient compression by name on every backend, sized buckets
and measured communication.

Lightning's ``DDPStrategy`` takes a comm hook only as a Python callable and
registers it only on CUDA (on CPU/gloo it is silently dropped). This subclass
registers one of :mod:`lightning_fastdist.parallel`'s hooks on any device and
backend, saves the hook's state (PowerSGD error feedback and ``Q`` factors, per
rank) in checkpoints and restores it on resume, writes checkpoints atomically
(``<name>.partial`` renamed onto ``<name>``, so ``last.ckpt`` is always complete),
and logs the bytes each rank all-reduced in the last optimizer step as
``comm/allreduce_bytes_per_step``.

Gradient accumulation needs nothing extra: Lightning runs non-final
micro-batches under DDP's ``no_sync()``, which the byte and round counters
confirm (``tests/test_fast_ddp.py``).

Lightning's contract is kept: other keyword arguments go to
``DistributedDataParallel`` (``broadcast_buffers=False``, ``init_sync=False``, ...),
every ``start_method`` works and the strategy pickles. Lightning's callable
comm-hook arguments are refused with the option to use instead
(:data:`~lightning_fastdist.strategies.ddp_options.REPLACED_LIGHTNING_OPTIONS`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_fastdist.diagnostics.recompiles import RecompileWatcher
from lightning_fastdist.parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    validate_activation_checkpointing,
)
from lightning_fastdist.parallel.atomic_checkpoint import check_save_target, is_local_path, save_file_atomically
from lightning_fastdist.parallel.buckets import auto_bucket_cap_mb
from lightning_fastdist.parallel.collective_timeout import collective_timeout
from lightning_fastdist.parallel.comm_accounting import ALL_REDUCE, CommStats
from lightning_fastdist.parallel.comm_hook_registry import register_comm_hook
from lightning_fastdist.parallel.comm_hooks import HookState
from lightning_fastdist.parallel.compile import apply_compile, normalize_compile_config, validate_compile_scope
from lightning_fastdist.parallel.powersgd import PowerSGDState
from lightning_fastdist.strategies.blocks_option import blocks_option, resolve_and_log_blocks, without_kv_cache
from lightning_fastdist.strategies.comm_hook_checkpoint import gather_to_rank_zero, restore_hook_state
from lightning_fastdist.strategies.comm_metrics import CommBytesLogging
from lightning_fastdist.strategies.ddp_options import (
    check_bf16_backend,
    check_ddp_kwargs,
    check_ddp_options,
    sends_bf16,
)
from lightning_fastdist.strategies.exact_resume import ExactResume
from lightning_fastdist.strategies.fault_tolerance import FaultTolerance

CHECKPOINT_KEY = "fast_ddp_comm_hook"
CommHookName = Literal["none", "fp16", "bf16", "powersgd"]


class FastDDPStrategy(FaultTolerance, ExactResume, CommBytesLogging, DDPStrategy):
    """DDP with a named gradient-compression hook, auto-sized buckets and communication accounting.

    Args:
        comm_hook: how gradients are averaged: ``"none"`` (full precision),
            ``"fp16"`` or ``"bf16"`` (sent in half precision: half the bytes),
            ``"powersgd"`` (low-rank compression, see ``powersgd_*``).
        powersgd_rank: rank of PowerSGD's factors (>= 1); higher is closer to exact and sends more.
        powersgd_start_iter: optimizer steps averaged exactly before PowerSGD starts (>= 2);
            early training is sensitive to compression, so start after the learning-rate warm-up.
        powersgd_error_feedback: carry each rank's compression error into its next gradient.
        powersgd_warm_start: reuse last step's ``Q`` factors (better approximation for free).
        powersgd_factor_dtype: ``"fp32"``, ``"fp16"`` or ``"bf16"``: what PowerSGD's factors are
            all-reduced in; half precision halves their bytes (bf16 cannot overflow, fp16 keeps
            more mantissa). The arithmetic stays in the gradients' dtype.
        bucket_cap_mb: DDP gradient bucket size in MB, or ``"auto"``: gradient MB / 8 clamped to
            [1, 100] MB, so communication overlaps the backward in several buckets without
            paying per-message latency on tiny ones (see ``parallel/buckets.py``).
        gradient_as_bucket_view: let gradients live in DDP's buckets (saves one copy and memory).
        static_graph: promise DDP the set of used parameters never changes (enables optimisations).
        find_unused_parameters: search for parameters without gradients every step; costs a
            traversal of the graph, so only enable it for models that need it.
        log_comm_bytes: log ``comm/allreduce_bytes_per_step`` (a host-side count, no device sync).
        activation_checkpointing: ``"none"``, ``"full"`` (recompute each block in backward),
            ``"selective"`` (keep matmul/attention outputs, recompute the cheap ops) or an integer
            ``n`` (every n-th block); the same implementation FastFSDPStrategy uses.
        blocks: the blocks that activation checkpointing and per-block compile act on:
            ``"auto"`` (the outermost repeated modules that hold layers, e.g. TinyGPT's ``Block``,
            see :func:`~lightning_fastdist.parallel.blocks.find_blocks`) or a list of class names.
        compile: ``false``, ``true`` (inductor) or a mapping of ``torch.compile`` arguments
            (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``).
        compile_scope: ``"blocks"``: compile each block's forward before DDP wraps the model
            (one graph reused by every identical block); ``"model"``: compile the module's
            forward after wrapping, where dynamo splits the graph at DDP's bucket boundaries.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; ``None`` picks by device.
        timeout: seconds (or a ``timedelta``) a collective may wait for the other ranks before this
            process fails with an error instead of hanging (a rank that died or is stuck); ``None``
            keeps torch's 30 minutes. Jobs that restart themselves want a few minutes.
        start_method: how Lightning starts the other processes.
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.
        block_modules: deprecated spelling of ``blocks`` (one more release).
        **kwargs: passed to ``DistributedDataParallel``, as by Lightning's ``DDPStrategy``
            (``broadcast_buffers=False``, ``init_sync=False``, ...); checked at construction.
    """

    strategy_name = "fast_ddp"

    def __init__(
        self,
        comm_hook: CommHookName = "none",
        powersgd_rank: int = 2,
        powersgd_start_iter: int = 1000,
        powersgd_error_feedback: bool = True,
        powersgd_warm_start: bool = True,
        powersgd_factor_dtype: Literal["fp32", "fp16", "bf16"] = "fp32",
        bucket_cap_mb: float | Literal["auto"] = "auto",
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        log_comm_bytes: bool = True,
        activation_checkpointing: Literal["none", "full", "selective"] | int = "none",
        blocks: Literal["auto"] | list[str] = "auto",
        compile: bool | dict[str, Any] = False,
        compile_scope: Literal["blocks", "model"] = "blocks",
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
        check_ddp_options(
            comm_hook, powersgd_rank, powersgd_start_iter, bucket_cap_mb, process_group_backend, powersgd_factor_dtype
        )
        validate_activation_checkpointing(activation_checkpointing)
        blocks = blocks_option("FastDDPStrategy", blocks, "block_modules", block_modules)
        self.compile_config = normalize_compile_config(compile)
        self.compile_scope = validate_compile_scope(compile_scope)
        self.timeout = collective_timeout(timeout, "FastDDPStrategy")
        ddp_kwargs: dict[str, Any] = {
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
            "find_unused_parameters": find_unused_parameters,
        }
        if bucket_cap_mb != "auto":
            ddp_kwargs["bucket_cap_mb"] = float(bucket_cap_mb)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=self.timeout,
            start_method=start_method,
            **ddp_kwargs,
            **kwargs,  # to DistributedDataParallel, as in Lightning (and LightningCLI sees them through this call)
        )
        self.comm_hook = comm_hook
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_iter = powersgd_start_iter
        self.powersgd_error_feedback = powersgd_error_feedback
        self.powersgd_warm_start = powersgd_warm_start
        self.powersgd_factor_dtype = powersgd_factor_dtype
        self.bucket_cap_mb = bucket_cap_mb
        self.log_comm_bytes = log_comm_bytes
        self.activation_checkpointing = activation_checkpointing
        self.blocks = blocks
        self.hook_state: HookState | None = None
        self.checkpointed_blocks: list[torch.nn.Module] = []
        self.compiled_regions: list[torch.nn.Module] = []
        self.recompiles = RecompileWatcher(report=rank_zero_warn)
        self._pending_hook_checkpoint: dict | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="DDP with named gradient compression (fp16/bf16/PowerSGD) on any backend",
        )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        option = sends_bf16(self.comm_hook, self.powersgd_factor_dtype)
        if option is not None:
            check_bf16_backend(self._get_process_group_backend(), self.root_device, option=option)

    @override
    def configure_ddp(self) -> None:
        # Fixed order: activation checkpointing and per-block compile on the bare blocks,
        # then size buckets, wrap in DDP and register the hook; whole-model compile last,
        # inside DDP, so that dynamo splits the graph at bucket boundaries.
        self._prepare_blocks()
        if self.bucket_cap_mb == "auto":
            self._ddp_kwargs["bucket_cap_mb"] = auto_bucket_cap_mb(self.model)
        super().configure_ddp()
        assert isinstance(self.model, DistributedDataParallel)
        self.hook_state = register_comm_hook(
            self.model,
            self.comm_hook,
            powersgd_rank=self.powersgd_rank,
            powersgd_start_iter=self.powersgd_start_iter,
            powersgd_error_feedback=self.powersgd_error_feedback,
            powersgd_warm_start=self.powersgd_warm_start,
            powersgd_factor_dtype=self.powersgd_factor_dtype,
        )
        if self._pending_hook_checkpoint is not None:
            self._restore_hook_state(self._pending_hook_checkpoint)
            self._pending_hook_checkpoint = None
        if self.compile_config is not None and self.compile_scope == "model":
            self.compiled_regions = apply_compile(self.lightning_module, self.compile_config, "model", [])

    def _prepare_blocks(self) -> None:
        compiles_blocks = self.compile_config is not None and self.compile_scope == "blocks"
        if self.activation_checkpointing == "none" and not compiles_blocks:
            return
        block_classes = resolve_and_log_blocks(self.model, self.blocks)
        without_kv_cache(self.model, self.activation_checkpointing, compiles_blocks)
        self.checkpointed_blocks = apply_activation_checkpointing(
            self.model, self.activation_checkpointing, block_classes
        )
        if compiles_blocks:
            self.compiled_regions = apply_compile(self.model, self.compile_config, "blocks", block_classes)

    @override
    def setup(self, trainer: Any) -> None:
        self.start_fault_handling(trainer)
        if self.compile_config is not None:
            self.recompiles.start()
        super().setup(trainer)

    @override
    def teardown(self) -> None:
        self.recompiles.stop()
        super().teardown()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self.refuse_non_finite(checkpoint, filepath)
        self._add_resume_state(checkpoint)
        if isinstance(self.hook_state, PowerSGDState):
            checkpoint[CHECKPOINT_KEY] = {
                "comm_hook": self.comm_hook,
                "per_rank": gather_to_rank_zero(self.hook_state.state_dict(), self.world_size, self.global_rank),
            }
        if not (isinstance(self.checkpoint_io, TorchCheckpointIO) and is_local_path(filepath)):
            super().save_checkpoint(checkpoint, filepath, storage_options)  # e.g. a remote or asynchronous writer
            return
        check_save_target(Path(filepath), sharded=False)  # every rank refuses a user's folder alike
        if self.is_global_zero:
            # Written under <name>.partial and renamed onto <name> once complete (last.ckpt included).
            save_file_atomically(
                lambda staged: self.checkpoint_io.save_checkpoint(checkpoint, staged, storage_options), Path(filepath)
            )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        load = functools.partial(super().load_checkpoint, weights_only=weights_only)
        checkpoint = self.load_or_fall_back(checkpoint_path, load, expects_folder=False)
        self._take_resume_state(checkpoint)
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is not None:
            if self.hook_state is None:
                self._pending_hook_checkpoint = saved  # applied once the hook is registered
            else:
                self._restore_hook_state(saved)
        return checkpoint

    @property
    def comm_stats(self) -> CommStats | None:
        """This rank's all-reduce bytes and rounds (``None`` until DDP wraps the model)."""
        return self.hook_state.stats if self.hook_state is not None else None

    comm_collectives = (ALL_REDUCE,)

    def _restore_hook_state(self, saved: dict) -> None:
        restore_hook_state(self.hook_state, self.comm_hook, saved, self.world_size, self.global_rank, self.root_device)


FastDDPStrategy.register_strategies(StrategyRegistry)
