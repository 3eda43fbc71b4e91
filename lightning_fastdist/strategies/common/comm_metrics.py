"""Close each optimizer step's communication count and exposed time, and log them without a device sync.

A strategy calls :func:`end_comm_step` after every optimizer step, :meth:`CommMetricsLog.log` after every training
step, and runs a backward whose hooks send gradients (FSDP, DeepSpeed) inside :func:`one_gradient_round`.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager

import torch
from lightning.pytorch import LightningModule

from lightning_fastdist.parallel.comm.accounting import CommStats, Traffic, metric_name
from lightning_fastdist.parallel.comm.exposed import ExposedCommClock
from lightning_fastdist.trainer.internals import is_logging_step

EXPOSED_METRIC = "comm/exposed_s"


def end_comm_step(stats: CommStats | None, clock: ExposedCommClock | None) -> None:
    """Close the optimizer step's traffic and exposed time, where counted."""
    if stats is not None:
        stats.end_step()
    if clock is not None:
        clock.end_step()


@contextmanager
def one_gradient_round(stats: CommStats | None) -> Generator[None, None, None]:
    """Around a backward whose hooks send gradients: one round of gradient communication closed in ``stats`` if it
    sent gradient bytes (a backward under ``no_sync``, accumulating, sent none)."""
    sent_before = stats.gradient_bytes_so_far() if stats is not None else 0
    yield
    if stats is not None and stats.gradient_bytes_so_far() > sent_before:
        stats.finish_round()


class CommMetricsLog:
    """Logs each collective's bytes of the last optimizer step as ``comm/<collective>_bytes_per_step``.

    Only on the steps the loggers write and whenever the counts changed: between those the values logged last are
    still current, and each ``log`` call costs host time a fast accelerator step would feel. The exposed seconds
    (``comm/exposed_s``) and other host-side values go on logging steps only: on CUDA reading them waits for the
    step's events.
    """

    def __init__(self) -> None:
        self._logged: tuple[int, ...] | None = None  # what the last log call sent, per collective

    def new_fit(self) -> None:
        """A new fit logs into new results: call in ``on_train_start``."""
        self._logged = None

    def log(
        self,
        module: LightningModule | None,
        stats: CommStats | None,
        collectives: Sequence[str],
        clock: ExposedCommClock | None,
        extra: Mapping[str, float] | None = None,
    ) -> None:
        """Log from ``module``, inside its training step, what ``stats`` and ``clock`` hold of the last step."""
        if module is None or stats is None:
            return
        step_bytes = tuple(stats.last_step.get(collective, Traffic()).bytes for collective in collectives)
        due = is_logging_step(module.trainer)
        # A CPU tensor stays on the host through Lightning's logging: no copy to or from the device
        # (a Python float would become a tensor on the accelerator). float64 keeps byte counts exact.
        if due and clock is not None:
            module.log(EXPOSED_METRIC, torch.tensor(clock.last_step_s, dtype=torch.float64), on_step=True)
        for name, value in (extra or {}).items() if due else ():
            module.log(name, torch.tensor(value, dtype=torch.float64), on_step=True)
        if step_bytes == self._logged and not due:
            return
        self._logged = step_bytes
        for collective, count in zip(collectives, step_bytes):
            module.log(metric_name(collective), torch.tensor(count, dtype=torch.float64), on_step=True)
