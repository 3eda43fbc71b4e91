"""Close each optimizer step's communication count and exposed time and log them without a device sync:
mixins for every strategy."""

from __future__ import annotations

from typing import Any

import torch

from lightning_fastdist.parallel.comm.accounting import CommStats, Traffic, metric_name
from lightning_fastdist.parallel.comm.exposed import BackwardTail, ExposedCommClock, watch_ddp

EXPOSED_METRIC = "comm/exposed_s"


class CommBytesLogging:
    """Mixin for a Lightning strategy that counts its collectives in a :class:`CommStats`.

    After every optimizer step it closes the step's traffic (``CommStats.end_step``); inside a
    training step it logs each collective's bytes of the last optimizer step as
    ``comm/<collective>_bytes_per_step`` (0 before the first step), on the steps whose metrics the
    loggers write (``log_every_n_steps``) and whenever the counts changed since it last logged them.
    Between those the values logged last are still current, and each ``self.log`` call costs
    Lightning's bookkeeping about 0.3 ms of host time (measured on 2 CPU cores), which a fast
    accelerator step would feel on every step.

    It also closes the step of ``exposed_comm`` (an
    :class:`~lightning_fastdist.parallel.comm.exposed.ExposedCommClock`: the time the step waited for
    communication its compute did not hide) and logs the last step's seconds as ``comm/exposed_s``, on
    logging steps only: the value changes every step, and on CUDA reading it waits for that step's events.
    The strategy provides:

    - ``comm_stats``: its counters, or ``None`` while nothing is counted;
    - ``comm_collectives``: the names of the collectives it runs;
    - ``log_comm_bytes``: whether to log (the bytes and the exposed time);
    - ``exposed_comm``: its clock, or ``None`` (the default) while nothing is timed; a DDP strategy gets
      one from :meth:`watch_ddp_backward`.
    """

    comm_stats: CommStats | None
    comm_collectives: tuple[str, ...]
    log_comm_bytes: bool
    exposed_comm: ExposedCommClock | None = None
    _backward_tail: BackwardTail | None = None
    _comm_bytes_logged: tuple[int, ...] | None = None  # what the last log call sent, per collective

    def on_train_start(self) -> None:
        self._comm_bytes_logged = None  # a new fit logs into new results
        super().on_train_start()  # type: ignore[misc]

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)  # type: ignore[misc]
        stats = self.comm_stats
        if self.log_comm_bytes and stats is not None:
            self._log_comm_bytes(stats)
        return output

    def _log_comm_bytes(self, stats: CommStats) -> None:
        step_bytes = tuple(stats.last_step.get(collective, Traffic()).bytes for collective in self.comm_collectives)
        module = self.lightning_module  # type: ignore[attr-defined]
        due = module.trainer._logger_connector.should_update_logs
        # A CPU tensor stays on the host through Lightning's logging: no copy to or from the device
        # (a Python float would become a tensor on the accelerator). float64 keeps byte counts exact.
        if due and self.exposed_comm is not None:
            module.log(EXPOSED_METRIC, torch.tensor(self.exposed_comm.last_step_s, dtype=torch.float64), on_step=True)
        for name, value in self.extra_comm_metrics().items() if due else ():
            module.log(name, torch.tensor(value, dtype=torch.float64), on_step=True)
        if step_bytes == self._comm_bytes_logged and not due:
            return
        self._comm_bytes_logged = step_bytes
        for collective, count in zip(self.comm_collectives, step_bytes):
            module.log(metric_name(collective), torch.tensor(count, dtype=torch.float64), on_step=True)

    def extra_comm_metrics(self) -> dict[str, float]:
        """More host-side values a strategy logs on logging steps (FastDDPStrategy: ``comm_hook: auto``'s level)."""
        return {}

    def watch_ddp_backward(self, ddp: torch.nn.Module) -> None:
        """Time ``ddp``'s exposed communication (a :class:`BackwardTail`) in a new ``exposed_comm``."""
        if self._backward_tail is not None:  # a second fit wraps the model again
            self._backward_tail.remove()
        self.exposed_comm = ExposedCommClock(self.root_device)  # type: ignore[attr-defined]
        self._backward_tail = watch_ddp(ddp, self.exposed_comm)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        stats = self.comm_stats
        if stats is not None:
            stats.end_step()
        if self.exposed_comm is not None:
            self.exposed_comm.end_step()
        return output


class GradientRoundPerBackward:
    """Mixin for a strategy whose gradients are sent from inside ``backward`` (FSDP's and DeepSpeed's hooks).

    A backward that sent gradient bytes closes one round of gradient communication in ``_comm_stats``;
    a backward under ``no_sync`` (accumulation) sent none and closes nothing.
    """

    _comm_stats: CommStats

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        sent_before = self._comm_stats.gradient_bytes_so_far()
        output = super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]
        if self._comm_stats.gradient_bytes_so_far() > sent_before:
            self._comm_stats.finish_round()
        return output
