"""DeepSpeed's room: ``FastDeepSpeedStrategy`` and what only it uses (one file of full weights from its folders)."""

from lightning_fastdist.strategies.deepspeed.consolidate import consolidate_checkpoint
from lightning_fastdist.strategies.deepspeed.strategy import FastDeepSpeedStrategy  # deepspeed itself: when constructed

__all__ = ["FastDeepSpeedStrategy", "consolidate_checkpoint"]
