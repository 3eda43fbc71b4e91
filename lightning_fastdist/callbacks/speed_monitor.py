"""SpeedMonitor: samples/s, tokens/s, TFLOP/s and MFU, measured without synchronising.

Time is read only on logging steps, on CUDA from events whose completion is queried without waiting (so a value can
lag by one logging interval). Batches are counted from their shapes, which live on the host, and values are logged
as host tensors, so logging them reads nothing back from the device.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_fastdist.callbacks.step_clock import CudaEventClock, WallClock, clock_for
from lightning_fastdist.diagnostics.peak_flops import TERA, matmul_dtype, peak_flops
from lightning_fastdist.trainer.internals import is_logging_step, require_internals


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor in ``batch`` (a tensor, or nested sequences and mappings), depth first."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        batch = batch.values()
    elif not isinstance(batch, Sequence) or isinstance(batch, str):
        return None
    for item in batch:
        found = first_tensor(item)
        if found is not None:
            return found
    return None


def _is_token_ids(tensor: Any) -> bool:
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.dim() == 2
        and not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)
    )


def default_units(batch: Any, encoder_decoder: bool = False) -> dict[str, int]:
    """``samples`` (the first dimension of the batch's first tensor) and, for token ids, ``tokens``.

    The first tensor is token ids when it is an integer tensor of shape ``(samples, sequence)``. An encoder-decoder
    processes its decoder's tokens too: a HuggingFace-style batch's ``decoder_input_ids``, or else its ``labels``
    (the decoder reads them shifted right), are added to the encoder's ``input_ids``.
    """
    first = first_tensor(batch)
    if first is None or first.dim() == 0:
        return {}
    units = {"samples": first.shape[0]}
    if _is_token_ids(first):
        units["tokens"] = first.numel()
    if encoder_decoder and isinstance(batch, Mapping) and _is_token_ids(batch.get("input_ids")):
        decoder = batch.get("decoder_input_ids", batch.get("labels"))
        units["tokens"] = batch["input_ids"].numel() + (decoder.numel() if _is_token_ids(decoder) else 0)
    return units


def is_encoder_decoder(module: Any) -> bool:
    """Whether ``module`` holds a HuggingFace encoder-decoder (a submodule whose ``config.is_encoder_decoder``)."""
    return any(getattr(getattr(m, "config", None), "is_encoder_decoder", False) is True for m in module.modules())


def training_ranks(trainer: Trainer) -> int:
    """The ranks training now: where the strategy trains across nodes (our ``across_nodes``), those of the nodes still
    in the job (``min_nodes``), else the trainer's world size."""
    across_nodes = getattr(trainer.strategy, "across_nodes", None)
    return across_nodes.training_ranks(trainer.world_size) if across_nodes is not None else trainer.world_size


@dataclass
class _Window:
    start: Any
    end: Any
    units: Counter[str]


class SpeedMonitor(Callback):
    """Log ``speed/<unit>_per_sec`` for all ranks together, TFLOP/s and MFU on logging steps, never synchronising.

    Args:
        flops_per_token: training FLOPs (forward + backward) per token; ``None`` reads the LightningModule's
            ``flops_per_token`` attribute. Without either, TFLOP/s and MFU are not logged.
        peak_flops_per_device: peak FLOP/s of one device for MFU; ``None`` looks the GPU up for the trainer's
            precision. On CPU or an unknown GPU, MFU is not logged.
    """

    def __init__(self, flops_per_token: float | None = None, peak_flops_per_device: float | None = None) -> None:
        for name, value in (("flops_per_token", flops_per_token), ("peak_flops_per_device", peak_flops_per_device)):
            if value is not None and value <= 0:
                raise ValueError(f"SpeedMonitor: {name} must be > 0 or None, got {value}.")
        self.flops_per_token = flops_per_token
        self.peak_flops_per_device = peak_flops_per_device
        self._clock: WallClock | CudaEventClock = WallClock()
        self._start: Any = None
        self._units: Counter[str] = Counter()
        self._encoder_decoder = False
        self._pending: list[_Window] = []

    def count_units(self, batch: Any) -> dict[str, int]:
        """What one training batch of this rank holds, by unit name (:func:`default_units`): override to count your own.

        ``tokens`` also gives TFLOP/s and MFU. Count from shapes only: reading a device tensor's values would
        synchronise. For images, for example::

            class ImageSpeed(SpeedMonitor):
                def count_units(self, batch):
                    images = batch[0]  # (B, C, H, W)
                    return {"images": images.shape[0], "pixels": images.shape[0] * images.shape[2] * images.shape[3]}
        """
        return default_units(batch, self._encoder_decoder)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        require_internals(trainer, type(self).__name__)
        self._encoder_decoder = is_encoder_decoder(pl_module)
        root = trainer.strategy.root_device
        self._clock = clock_for(root)
        if self.flops_per_token is None:
            self.flops_per_token = getattr(pl_module, "flops_per_token", None)
        if self.peak_flops_per_device is None and root.type == "cuda":
            self.peak_flops_per_device = peak_flops(
                torch.cuda.get_device_name(root), matmul_dtype(str(trainer.precision))
            )
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
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ranks = training_ranks(trainer)
        self._units.update({unit: count * ranks for unit, count in self.count_units(batch).items()})
        if is_logging_step(trainer):
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
        self._pending.append(_Window(self._start, end, self._units))
        self._start, self._units = end, Counter()

    def _log_finished_windows(self, trainer: Trainer, pl_module: LightningModule) -> None:
        seconds, units = 0.0, Counter()
        while self._pending:
            window = self._pending[0]
            if not self._clock.reached(window.end):
                break
            seconds += self._clock.seconds(window.start, window.end)
            units.update(window.units)
            self._pending.pop(0)
        if seconds <= 0:
            return
        ranks = training_ranks(trainer)
        metrics = {f"speed/{unit}_per_sec": count / seconds for unit, count in units.items()}
        metrics["speed/ranks"] = ranks
        if units["tokens"] and self.flops_per_token is not None:
            flops_per_sec = metrics["speed/tokens_per_sec"] * self.flops_per_token
            metrics["speed/tflops_per_sec"] = flops_per_sec / TERA
            if self.peak_flops_per_device is not None:
                metrics["speed/mfu"] = flops_per_sec / (ranks * self.peak_flops_per_device)
        for name, value in metrics.items():
            # A host tensor: Lightning keeps it on the CPU, so neither logging nor reading it touches the device.
            pl_module.log(name, torch.tensor(value, dtype=torch.float64), on_step=True, on_epoch=False)
