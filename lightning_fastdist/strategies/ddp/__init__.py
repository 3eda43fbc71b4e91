"""DDP's room: ``FastDDPStrategy`` and what only it uses (its comm hook's state in checkpoints)."""

from lightning_fastdist.strategies.ddp.strategy import FastDDPStrategy

__all__ = ["FastDDPStrategy"]
