"""FastMixedPrecision: AMP whose fp16 loss scaling never waits for the GPU, and fp8 on the layers where it pays.

torch's ``GradScaler`` reads ``found_inf`` on the host every step unless the optimizer is fused (the fused kernel
skips the update itself), and Lightning's ``MixedPrecision`` refuses gradient clipping with fused optimizers. This
plugin fuses Adam, AdamW and SGD under ``"16-mixed"`` (under every precision with ``fuse_optimizers="always"``),
allows clipping (it unscales first, once) and logs ``fp16/skipped_steps`` and ``fp16/loss_scale`` with no host sync.
With ``fp8``, the wide linear layers train in fp8 through torchao (``parallel/precision/fp8.py``;
``docs/precision.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fastdist.parallel.precision.fp8 import (
    DEFAULT_SKIP,
    FP8_RECIPES,
    convert_to_fp8,
    fp8_unavailable,
    precompute_fp8_scales,
)
from lightning_fastdist.parallel.precision.fused_optimizer import fuse_optimizer

PRECISIONS = ("bf16-mixed", "16-mixed", "bf16-true")
DEVICES = ("cuda", "cpu")
FP8_PRECISIONS = ("bf16-mixed", "bf16-true")  # fp8 layers beside bf16 (torchao's high precision); fp16 is refused


def compute_device_type(model: Module) -> str | None:
    """The device type ``model`` computes on (``None`` without parameters): where autocast must act.

    A sharded (DTensor) parameter computes on its mesh's device, wherever its shard lives: FSDP2's
    ``cpu_offload`` keeps each shard in host memory and gathers it onto the GPU for every forward,
    so the shard's own ``device`` says ``cpu`` on a CUDA run.
    """
    for parameter in model.parameters():
        mesh = getattr(parameter, "device_mesh", None)
        return mesh.device_type if mesh is not None else parameter.device.type
    return None


class FastMixedPrecision(Precision):
    """Mixed or bf16 precision for Lightning with no host sync per step.

    Args:
        precision: ``"bf16-mixed"`` (autocast to bf16, fp32 weights), ``"16-mixed"`` (autocast to fp16 with loss
            scaling) or ``"bf16-true"`` (weights and compute in bf16).
        device: ``"cuda"`` or ``"cpu"``, where autocast and the loss scaler act; ``None`` picks ``"cuda"`` if available.
        scaler: the ``GradScaler`` for ``"16-mixed"``; ``None`` creates one. Passing one is also how to run
            ``"16-mixed"`` on CPU (slow; meant for testing loss scaling without a GPU).
        fuse_optimizers: ``True``: under ``"16-mixed"``, switch Adam, AdamW and SGD to their fused implementations so
            that skipping a step needs no host sync (other optimizers cost one host sync per step); ``"always"``: fuse
            them under every precision too (one kernel per parameter group instead of a few per tensor list);
            ``False``: never.
        fp8: ``None`` (off), ``"tensorwise"`` or ``"rowwise"``: train the linear layers wide enough to pay in fp8
            with torchao's recipe of that name (``lightning_fastdist.parallel.precision.fp8``), beside ``bf16-mixed`` or
            ``bf16-true``; under FSDP2 their weights are all-gathered in fp8. Refused at construction, in one line,
            without a GPU of compute capability 8.9 or newer or without torchao; at setup when no layer qualifies.
        fp8_skip: layers never converted to fp8: a layer is skipped when one of these is part of its name.
    """

    def __init__(
        self,
        precision: str = "bf16-mixed",
        device: str | None = None,
        scaler: torch.amp.GradScaler | None = None,
        fuse_optimizers: bool | str = True,
        fp8: str | None = None,
        fp8_skip: Sequence[str] = DEFAULT_SKIP,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"FastMixedPrecision: precision must be one of {PRECISIONS}, got {precision!r}.")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in DEVICES:
            raise ValueError(f"FastMixedPrecision: device must be one of {DEVICES}, got {device!r}.")
        if not (isinstance(fuse_optimizers, bool) or fuse_optimizers == "always"):
            raise ValueError(
                f"FastMixedPrecision: fuse_optimizers must be one of true, false, 'always'; got {fuse_optimizers!r}."
            )
        self._check_fp8(fp8, precision, device)
        if precision == "16-mixed" and device == "cpu" and scaler is None:
            raise ValueError(
                "FastMixedPrecision: precision='16-mixed' is refused on device='cpu': fp16 on CPU is slower than fp32 "
                "and needs loss scaling for nothing. Use precision='bf16-mixed' on CPU (or pass "
                "scaler=torch.amp.GradScaler('cpu') to exercise fp16 loss scaling anyway)."
            )
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"FastMixedPrecision: scaler is only used with precision='16-mixed', got {precision!r}.")
        self.precision = precision  # FastFSDPStrategy builds its FSDP2 mixed-precision policy from it
        self.device = device
        self.scaler = torch.amp.GradScaler(device) if precision == "16-mixed" and scaler is None else scaler
        self.fuse_optimizers = fuse_optimizers
        self.fp8 = fp8
        self.fp8_skip = tuple(fp8_skip)
        self.fp8_layers: list[str] = []  # the layers converted, once the module is
        self._fp8_all_gather = False
        self._bf16_true = HalfPrecision("bf16-true") if precision == "bf16-true" else None
        self.skipped_steps: Tensor | None = None  # on the device; created at the first fp16 step
        self._unscaled: set[int] = set()  # ids of optimizers unscaled since the last scaler update

    @staticmethod
    def _check_fp8(fp8: str | None, precision: str, device: str) -> None:
        """Refuse an fp8 setting that cannot run here, in one line, before any process starts."""
        if fp8 is None:
            return
        if fp8 not in FP8_RECIPES:
            raise ValueError(f"FastMixedPrecision: fp8 must be null or one of {', '.join(FP8_RECIPES)}; got {fp8!r}.")
        if precision not in FP8_PRECISIONS:
            raise ValueError(
                f"FastMixedPrecision: fp8 trains beside {' or '.join(FP8_PRECISIONS)}, not precision={precision!r}."
            )
        reason = fp8_unavailable(device, fp8)
        if reason is not None:
            raise ValueError(f"FastMixedPrecision: fp8={fp8!r} is refused: {reason}.")

    @override
    def convert_module(self, module: Module) -> Module:
        if self._bf16_true:
            module = self._bf16_true.convert_module(module)
        if self.fp8 is not None and not self.fp8_layers:  # a second fit finds the layers converted
            # FSDP2 (ModelParallelStrategy, FastFSDPStrategy's base) shards the weights next: gather them in fp8.
            trainer = getattr(module, "_trainer", None)
            self._fp8_all_gather = isinstance(getattr(trainer, "strategy", None), ModelParallelStrategy)
            try:
                self.fp8_layers = convert_to_fp8(module, self.fp8, self.fp8_skip, fsdp_all_gather=self._fp8_all_gather)
            except ValueError as error:
                raise ValueError(f"FastMixedPrecision: {error}") from None
            rank_zero_info(
                f"FastMixedPrecision: {len(self.fp8_layers)} linear layers train in {self.fp8} fp8"
                + (" (all-gathered in fp8 under FSDP2)" if self._fp8_all_gather else "")
            )
        return module

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return self._bf16_true.tensor_init_context() if self._bf16_true else super().tensor_init_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self._bf16_true.module_init_context() if self._bf16_true else super().module_init_context()

    @override
    def convert_input(self, data: Any) -> Any:
        return self._bf16_true.convert_input(data) if self._bf16_true else data

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self._bf16_true:
            with self._bf16_true.forward_context():
                yield
            return
        dtype = torch.float16 if self.precision == "16-mixed" else torch.bfloat16
        with torch.autocast(self.device, dtype=dtype, cache_enabled=False):
            yield

    @override
    def connect(self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> tuple:
        device_type = compute_device_type(model)
        if self.precision != "bf16-true" and device_type is not None and device_type != self.device:
            raise ValueError(
                f"FastMixedPrecision: device is {self.device!r} but the model is on {device_type!r}; "
                f"pass device={device_type!r}."
            )
        if (self.scaler is not None and self.fuse_optimizers) or self.fuse_optimizers == "always":
            for optimizer in optimizers:
                reason = fuse_optimizer(optimizer)
                if reason is None:
                    rank_zero_info(f"FastMixedPrecision: {type(optimizer).__name__} runs fused.")
                elif self.scaler is None:
                    rank_zero_warn(f"FastMixedPrecision: cannot fuse {type(optimizer).__name__}: {reason}.")
                else:
                    rank_zero_warn(
                        f"FastMixedPrecision: cannot fuse {type(optimizer).__name__}: {reason}. fp16 loss scaling "
                        "will read found_inf on the host once per step with it."
                    )
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def _unscale_once(self, optimizer: Optimizer) -> None:
        if id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    @override
    def optimizer_step(
        self, optimizer: Optimizer, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            step_output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            if self._fp8_all_gather:
                precompute_fp8_scales(model)  # one all-reduce for the scales of every fp8 weight gathered next
            return step_output
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "FastMixedPrecision: precision='16-mixed' cannot drive LBFGS (its step re-runs the closure)."
            )
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: no backward, nothing to step
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            # Lightning's order for unfused optimizers: hooks and clipping see unscaled gradients.
            self._unscale_once(optimizer)
        self._after_closure(model, optimizer)
        one = torch.ones((), device=model.device)
        scale_before = self.scaler.scale(one)
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        self._unscaled.clear()
        scale_after = self.scaler.scale(one)
        # GradScaler lowers the scale (backoff_factor < 1) exactly when it skipped the step for inf/NaN gradients.
        skipped = (scale_after < scale_before).float()
        self.skipped_steps = skipped if self.skipped_steps is None else self.skipped_steps + skipped
        model.log("fp16/skipped_steps", self.skipped_steps, on_step=True, on_epoch=False)
        model.log("fp16/loss_scale", scale_after, on_step=True, on_epoch=False)
        return step_output

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val > 0 and self.scaler is not None:
            self._unscale_once(optimizer)  # clip the true gradients; a fused step then skips its own unscaling
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)
