"""Close each optimizer step's communication count and exposed time, and log them without a device sync.

Each strategy counts its collectives in a :class:`~lightning_fastdist.parallel.comm.accounting.CommStats`
(``comm_stats``, ``None`` while nothing is counted) and may time what its steps waited for them in an
:class:`~lightning_fastdist.parallel.comm.exposed.ExposedCommClock` (``exposed_comm``). It calls
:func:`end_comm_step` after every optimizer step, :meth:`CommMetricsLog.log` after every training step
(when ``log_comm_bytes``), and runs a backward whose hooks send gradients (FSDP, DeepSpeed) inside
:func:`one_gradient_round`.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager

import torch
from lightning.pytorch import LightningModule

from lightning_fastdist.parallel.comm.accounting import CommStats, Traffic, metric_name
from lightning_fastdist.parallel.comm.exposed import ExposedCommClock

EXPOSED_METRIC = "comm/exposed_s"


def end_comm_step(stats: CommStats | None, clock: ExposedCommClock | None) -> None:
    """Close the optimizer step's traffic (``CommStats.end_step``) and exposed time, where counted."""
    if stats is not None:
        stats.end_step()
    if clock is not None:
        clock.end_step()


@contextmanager
def one_gradient_round(stats: CommStats | None) -> Generator[None, None, None]:
    """Around a backward whose hooks send gradients: if it sent gradient bytes, it closes one round of gradient
    communication in ``stats`` (where counted); a backward under ``no_sync`` (accumulation) sent none and closes
    nothing."""
    sent_before = stats.gradient_bytes_so_far() if stats is not None else 0
    yield
    if stats is not None and stats.gradient_bytes_so_far() > sent_before:
        stats.finish_round()


class CommMetricsLog:
    """Logs each collective's bytes of the last optimizer step as ``comm/<collective>_bytes_per_step``.

    From inside a training step, on the steps whose metrics the loggers write (``log_every_n_steps``) and
    whenever the counts changed since they were last logged (0 before the first step). Between those the
    values logged last are still current, and each ``log`` call costs Lightning's bookkeeping host time,
    which a fast accelerator step would feel on every step.

    The last step's exposed seconds (``comm/exposed_s``) and a strategy's other host-side values are logged on
    logging steps only: the exposed time changes every step, and on CUDA reading it waits for that step's events.
    """

    def __init__(self) -> None:
        self._logged: tuple[int, ...] | None = None  # what the last log call sent, per collective

    def new_fit(self) -> None:
        """Forget what was logged: a new fit logs into new results. Call in ``on_train_start``."""
        self._logged = None

    def log(
        self,
        module: LightningModule | None,
        stats: CommStats | None,
        collectives: Sequence[str],
        clock: ExposedCommClock | None,
        extra: Mapping[str, float] | None = None,
    ) -> None:
        """Log from ``module`` (inside its training step) what ``stats`` and ``clock`` hold of the last step (nothing
        while nothing is counted)."""
        if module is None or stats is None:
            return
        step_bytes = tuple(stats.last_step.get(collective, Traffic()).bytes for collective in collectives)
        due = module.trainer._logger_connector.should_update_logs
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
