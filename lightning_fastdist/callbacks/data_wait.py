"""Time the training loop spends waiting for batches: two ``perf_counter`` calls per batch, no device access.

From one batch's ``on_train_batch_end`` to the next one's ``on_train_batch_start`` Lightning fetches a batch. On a
GPU the host runs ahead of the device, so the wait measured is an upper bound of the time the GPU starves.
"""

from __future__ import annotations

import time


class DataWaitClock:
    """Per-batch data-wait and step seconds, measured on the host.

    Call :meth:`pause` when the loop leaves training (validation), so that the next wait is not counted.
    """

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.steps: list[float] = []
        self._last_end: float | None = None
        self._start: float | None = None

    def batch_started(self) -> None:
        """Call from ``on_train_batch_start``: the time since the previous step's end is a data wait."""
        self._start = time.perf_counter()
        if self._last_end is not None:
            self.waits.append(self._start - self._last_end)

    def batch_ended(self) -> None:
        """Call from ``on_train_batch_end``."""
        self._last_end = time.perf_counter()
        if self._start is not None:
            self.steps.append(self._last_end - self._start)
            self._start = None

    def pause(self) -> None:
        """Forget the previous step's end (the loop is about to do something other than fetch a batch)."""
        self._last_end = None

    def reset(self) -> None:
        self.waits.clear()
        self.steps.clear()
        self._last_end = self._start = None
