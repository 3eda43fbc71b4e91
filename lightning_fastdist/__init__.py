"""lightning_fastdist: fast distributed training for PyTorch Lightning by default."""

__version__ = "0.1.0"

from lightning_fastdist.strategies.ddp import FastDDPStrategy  # noqa: E402 - also registers "fast_ddp"
from lightning_fastdist.strategies.fsdp import FastFSDPStrategy  # noqa: E402 - also registers "fast_fsdp"
