"""Log a strategy's communication bytes per optimizer step without a device sync."""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
import torch

from lightning_fastdist.parallel.comm_accounting import CommStats, Traffic, metric_name


def log_step_bytes(module: pl.LightningModule, stats: CommStats, collectives: Sequence[str]) -> None:
    """Log each of ``collectives``' bytes in the last optimizer step as ``comm/<collective>_bytes_per_step``.

    Args:
        module: the LightningModule whose ``log`` records the values (call from inside ``training_step``).
        stats: the strategy's counters.
        collectives: the collectives this strategy runs (logged as 0 before the first optimizer step).
    """
    for collective in collectives:
        # A CPU tensor stays on the host through Lightning's logging: no copy to or from the device
        # (a Python float would become a tensor on the accelerator). float64 keeps byte counts exact.
        step_bytes = torch.tensor(stats.last_step.get(collective, Traffic()).bytes, dtype=torch.float64)
        module.log(metric_name(collective), step_bytes, on_step=True)
