"""FSDP2's room: ``FastFSDPStrategy`` and what only it uses (what it does to the LightningModule it shards)."""

from lightning_fastdist.strategies.fsdp.strategy import FastFSDPStrategy

__all__ = ["FastFSDPStrategy"]
