"""Marks in time that are read later: the wall clock on CPU, CUDA events on a GPU.

A CUDA event is recorded on the stream and read only when the measurement is
over (:meth:`CudaEventClock.resolve` synchronises once, or :meth:`CudaEventClock.reached`
asks without waiting), so the marks show when
the *device* reached each point: a gap between one step's end and the next
step's start is time the GPU sat idle. The CUDA path is untested on a GPU here.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class WallClock:
    """Marks are ``time.perf_counter()`` values."""

    def mark(self) -> float:
        """The current time."""
        return time.perf_counter()

    def resolve(self) -> None:
        """Nothing to wait for."""

    def reached(self, mark: float) -> bool:
        """Whether time has passed ``mark`` (always, for the wall clock)."""
        return True

    def seconds(self, start: float, end: float) -> float:
        """Seconds from ``start`` to ``end``."""
        return end - start


class CudaEventClock:
    """Marks are CUDA events recorded on the current stream."""

    def mark(self) -> torch.cuda.Event:
        """An event recorded now on the current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self) -> None:
        """Wait for the device to pass every recorded mark (one sync, at the end of a measurement)."""
        torch.cuda.synchronize()

    def reached(self, mark: torch.cuda.Event) -> bool:
        """Whether the device has passed ``mark``; asks without waiting."""
        return mark.query()

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two recorded events (after :meth:`resolve`)."""
        return start.elapsed_time(end) / 1000.0


def clock_for(device: torch.device) -> WallClock | CudaEventClock:
    """CUDA events for a CUDA device, else the wall clock."""
    return CudaEventClock() if device.type == "cuda" else WallClock()
