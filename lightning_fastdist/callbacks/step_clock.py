"""Marks in time that are read later: the wall clock on CPU, CUDA events on a GPU.

A CUDA event is recorded on the stream and read only when the measurement is over, so the marks show when the
*device* reached each point: a gap between one step's end and the next step's start is time the GPU sat idle.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class WallClock:
    """Marks are ``time.perf_counter()`` values."""

    def mark(self) -> float:
        return time.perf_counter()

    def resolve(self) -> None:
        """Nothing to wait for."""

    def reached(self, mark: float) -> bool:
        return True

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaEventClock:
    """Marks are CUDA events recorded on the current stream."""

    def mark(self) -> torch.cuda.Event:
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
        """Seconds between two recorded events (after :meth:`resolve` or :meth:`reached`)."""
        return start.elapsed_time(end) / 1000.0


def clock_for(device: torch.device) -> WallClock | CudaEventClock:
    return CudaEventClock() if device.type == "cuda" else WallClock()
