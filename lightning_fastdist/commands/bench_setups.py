"""The setups ``lightning-fastdist bench`` compares, as strategy overrides of one recipe."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch

FAST_DDP = "lightning_fastdist.FastDDPStrategy"
FAST_FSDP = "lightning_fastdist.FastFSDPStrategy"
DEEPSPEED = "lightning.pytorch.strategies.DeepSpeedStrategy"


@dataclass(frozen=True)
class BenchSetup:
    """One row of the comparison.

    Args:
        name: the row's name, as given to ``--setups``.
        strategy_class: import path of the strategy.
        strategy_args: its ``init_args``.
        needs: a reason this setup cannot run here, or ``None`` if it can.
    """

    name: str
    strategy_class: str
    strategy_args: dict[str, Any] = field(default_factory=dict)
    needs: str | None = None

    def strategy_config(self) -> dict[str, Any]:
        return {"class_path": self.strategy_class, "init_args": dict(self.strategy_args)}


def _deepspeed_unavailable() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install deepspeed)"
    if not torch.cuda.is_available():
        return "DeepSpeed ZeRO needs CUDA GPUs"
    return None


def all_setups(compile_backend: str = "inductor") -> dict[str, BenchSetup]:
    """Every setup bench knows, by name, in the order the table lists them."""
    deepspeed_missing = _deepspeed_unavailable()
    setups = [
        BenchSetup("ddp", FAST_DDP),
        BenchSetup("ddp-fp16", FAST_DDP, {"comm_hook": "fp16"}),
        BenchSetup("ddp-powersgd", FAST_DDP, {"comm_hook": "powersgd", "powersgd_rank": 4, "powersgd_start_iter": 2}),
        BenchSetup("ddp-compile", FAST_DDP, {"compile": {"backend": compile_backend}}),
        BenchSetup("fsdp-zero2", FAST_FSDP, {"sharding": "zero2"}),
        BenchSetup("fsdp-zero3", FAST_FSDP, {"sharding": "zero3"}),
        BenchSetup("fsdp-zero3-ac", FAST_FSDP, {"sharding": "zero3", "activation_checkpointing": "full"}),
        BenchSetup("deepspeed-zero2", DEEPSPEED, {"stage": 2}, needs=deepspeed_missing),
        BenchSetup("deepspeed-zero3", DEEPSPEED, {"stage": 3}, needs=deepspeed_missing),
    ]
    return {setup.name: setup for setup in setups}
