"""A clock for tests that count waiting: it moves only when the test says, so a busy machine changes nothing."""

from __future__ import annotations


class ManualClock:
    """Seconds that pass only through :meth:`advance`; call it to read them (a ``time.perf_counter`` stand-in)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass."""
        self.seconds += seconds
