"""Lightning strategies that compose :mod:`lightning_fastdist.parallel` in the right order."""

from lightning_fastdist.strategies.ddp import FastDDPStrategy
from lightning_fastdist.strategies.deepspeed import FastDeepSpeedStrategy  # imports deepspeed only when constructed
from lightning_fastdist.strategies.fsdp import FastFSDPStrategy

__all__ = ["FastDDPStrategy", "FastDeepSpeedStrategy", "FastFSDPStrategy"]
