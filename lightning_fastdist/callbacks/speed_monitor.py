"""SpeedMonitor: samples/s, tokens/s, TFLOP/s and MFU, measured without synchronising.

Time is read only on logging steps: on CUDA as events recorded on the stream
(a window is measured once its closing event has completed, which
:meth:`torch.cuda.Event.query` tells without waiting, so a value can lag by
one logging interval); elsewhere with the wall clock. Sample and token counts
come from batch shapes, which live on the host. Values go through
``LightningModule.log`` as host (CPU) tensors, so logging them reads nothing
back from the device.

Logged every logging step, for all ranks together:
``speed/samples_per_sec``, ``speed/tokens_per_sec`` (when batches have a
sequence dimension), ``speed/tflops_per_sec`` and ``speed/mfu`` (model FLOPs
utilisation per device, when the FLOPs per token and the device's peak are known).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_fastdist.callbacks.lightning_internals import require_internals
from lightning_fastdist.callbacks.step_clock import CudaEventClock, WallClock, clock_for
from lightning_fastdist.diagnostics.peak_flops import TERA, matmul_dtype, peak_flops


def batch_shape(batch: Any) -> tuple[int, int] | None:
    """``(samples, tokens per sample)`` of the first tensor in ``batch``; tokens is 0 for 1-D inputs."""
    if isinstance(batch, torch.Tensor):
        return (batch.shape[0], batch.shape[1] if batch.dim() >= 2 else 0) if batch.dim() >= 1 else None
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, Sequence) and not isinstance(batch, str) else ()
    for item in items:
        shape = batch_shape(item)
        if shape is not None:
            return shape
    return None


@dataclass
class _Window:
    start: Any
    end: Any
    samples: int
    tokens: int


class SpeedMonitor(Callback):
    """Log training throughput and MFU on logging steps, never synchronising the device.

    Args:
        flops_per_token: training FLOPs (forward + backward) per token. ``None``
            reads the LightningModule's ``flops_per_token`` attribute if it has
            one (TinyGPT does); without either, TFLOP/s and MFU are not logged.
        peak_flops_per_device: peak FLOP/s of one device for MFU. ``None`` looks
            the GPU up in :mod:`lightning_fastdist.diagnostics.peak_flops` for the
            trainer's precision; on CPU or an unknown GPU, MFU is not logged.
    """

    def __init__(self, flops_per_token: float | None = None, peak_flops_per_device: float | None = None) -> None:
        for name, value in (("flops_per_token", flops_per_token), ("peak_flops_per_device", peak_flops_per_device)):
            if value is not None and value <= 0:
                raise ValueError(f"SpeedMonitor: {name} must be > 0 or None, got {value}.")
        self.flops_per_token = flops_per_token
        self.peak_flops_per_device = peak_flops_per_device
        self._clock: WallClock | CudaEventClock = WallClock()
        self._start: Any = None
        self._samples = 0
        self._tokens = 0
        self._pending: list[_Window] = []

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        require_internals(trainer, type(self).__name__)
        root = trainer.strategy.root_device
        self._clock = clock_for(root)
        if self.flops_per_token is None:
            self.flops_per_token = getattr(pl_module, "flops_per_token", None)
        if self.peak_flops_per_device is None and root.type == "cuda":
            self.peak_flops_per_device = peak_flops(torch.cuda.get_device_name(root), matmul_dtype(str(trainer.precision)))
        if self.flops_per_token is None or self.peak_flops_per_device is None:
            rank_zero_info(
                "SpeedMonitor: MFU is not logged (flops_per_token or the device's peak FLOP/s is unknown; "
                "pass flops_per_token= / peak_flops_per_device=)."
            )

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._start is None:
            self._start = self._clock.mark()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        samples, tokens_per_sample = batch_shape(batch) or (0, 0)
        self._samples += samples
        self._tokens += samples * tokens_per_sample
        if trainer._logger_connector.should_update_logs:
            self._close_window()
            self._log_finished_windows(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._close_window()  # validation time is not training time
            self._start = None

    def _close_window(self) -> None:
        if self._start is None:
            return
        end = self._clock.mark()
        self._pending.append(_Window(self._start, end, self._samples, self._tokens))
        self._start, self._samples, self._tokens = end, 0, 0

    def _log_finished_windows(self, trainer: Trainer, pl_module: LightningModule) -> None:
        seconds = samples = tokens = 0
        while self._pending:
            window = self._pending[0]
            if not self._clock.reached(window.end):
                break
            elapsed = self._clock.seconds(window.start, window.end)
            self._pending.pop(0)
            seconds, samples, tokens = seconds + elapsed, samples + window.samples, tokens + window.tokens
        if seconds <= 0:
            return
        ranks = trainer.world_size
        metrics = {"speed/samples_per_sec": samples * ranks / seconds}
        if tokens:
            metrics["speed/tokens_per_sec"] = tokens * ranks / seconds
            if self.flops_per_token is not None:
                flops_per_sec = metrics["speed/tokens_per_sec"] * self.flops_per_token
                metrics["speed/tflops_per_sec"] = flops_per_sec / TERA
                if self.peak_flops_per_device is not None:
                    metrics["speed/mfu"] = flops_per_sec / (ranks * self.peak_flops_per_device)
        for name, value in metrics.items():
            # A host tensor: Lightning keeps it on the CPU, so neither logging nor reading it touches the device.
            pl_module.log(name, torch.tensor(value, dtype=torch.float64), on_step=True, on_epoch=False)
