"""The optimizer ZeRO-Offload steps on the CPU: DeepSpeed's CPU Adam where every rank can build it, else the
LightningModule's own torch optimizer (``parallel/deepspeed/runtime.py`` says which and why, in one line)."""

from __future__ import annotations

from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer

from lightning_fastdist.parallel.deepspeed.runtime import choose_offload_optimizer


def offloaded_optimizer(strategy: DeepSpeedStrategy, optimizer: Optimizer) -> Optimizer:
    """DeepSpeed's CPU Adam for the offloaded step where every rank of ``strategy`` built it, else ``optimizer``: the
    ranks agree (a collective), since they must step one optimizer. Says which in one line."""
    chosen, line = choose_offload_optimizer(optimizer, strategy.root_device.type)
    everywhere = strategy.reduce_boolean_decision(chosen is not optimizer, all=True)
    if chosen is not optimizer and not everywhere:
        chosen = optimizer
        line = (
            f"ZeRO-Offload: the CPU step runs torch's {type(optimizer).__name__}: DeepSpeed's CPU Adam did not "
            "build on every rank."
        )
    rank_zero_info(line)
    return chosen
