"""Exposed communication: how long each optimizer step waits for communication its compute did not hide.

DDP waits from its last gradient to the end of ``finalize_backward`` (``BackwardTail``); FSDP2 and DeepSpeed wait in
blocking collectives and in ``wait()`` on asynchronous ones (``timed_collective``). On CUDA the marks are events on
the current stream, read only when a value is asked for, so ordinary steps need no host sync.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

Mark = float | torch.cuda.Event
# One interval: seconds (CPU, known at once) or a pair of CUDA events (read later).
Interval = float | tuple[torch.cuda.Event, torch.cuda.Event]


def _seconds(interval: Interval) -> float:
    if isinstance(interval, float):
        return interval
    start, end = interval
    for event in (start, end):
        if not event.query():  # only where a value is asked for before the device got there
            event.synchronize()
    return max(start.elapsed_time(end), 0.0) / 1000


class ExposedCommClock:
    """Intervals of waiting for communication, closed per optimizer step like ``CommStats.end_step``.

    Args:
        device: ``cuda`` marks with events on the current stream, anything else with ``now()``.
        now: the CPU clock, in seconds (tests pass a manual one so counts don't depend on machine load).
    """

    def __init__(self, device: torch.device | str = "cpu", now: Callable[[], float] = time.perf_counter) -> None:
        self.device = torch.device(device)
        self.now = now
        self.on_cuda = self.device.type == "cuda"
        # The stream the training thread computes on; a wait issued on another (a collective's own stream)
        # is not a stall of the compute, so blocked() leaves it out.
        self._compute_stream = torch.cuda.current_stream(self.device) if self.on_cuda else None
        self.steps = 0
        self._step: list[Interval] = []
        self._last_step: list[Interval] = []
        self._total_s = 0.0
        self._unread: list[Interval] = []  # CUDA intervals not yet in _total_s

    def synchronize(self) -> None:
        """Wait for the device's queued work (its events complete), where it has a queue: CUDA."""
        if self.on_cuda:
            torch.cuda.synchronize(self.device)

    def mark(self, reuse: Mark | None = None) -> Mark:
        """A ``now()`` reading, or a CUDA event recorded on the current stream (``reuse`` re-recorded)."""
        if not self.on_cuda:
            return self.now()
        event = reuse if isinstance(reuse, torch.cuda.Event) else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, start: Mark, end: Mark | None = None) -> None:
        """Count the wait from ``start`` to ``end`` (default: now) in the current step."""
        end = self.mark() if end is None else end
        if self.on_cuda:
            interval: Interval = (start, end)
            self._unread.append(interval)
        else:
            interval = max(end - start, 0.0)
            self._total_s += interval
        self._step.append(interval)

    def on_compute_stream(self) -> bool:
        """Whether work issued now would stall the compute (always on CPU; on CUDA, the compute stream is current)."""
        return not self.on_cuda or torch.cuda.current_stream(self.device) == self._compute_stream

    @contextmanager
    def blocked(self) -> Iterator[None]:
        """Count the time the body takes as waiting for communication (where it stalls the compute)."""
        start = self.mark() if self.on_compute_stream() else None
        yield
        if start is not None:
            self.add(start)

    def end_step(self) -> None:
        self._last_step, self._step = self._step, []
        self.steps += 1
        unread, self._unread = self._unread, []
        for interval in unread:  # fold in what the device has finished, without waiting for the rest
            if all(event.query() for event in interval):
                self._total_s += _seconds(interval)
            else:
                self._unread.append(interval)

    @property
    def last_step_s(self) -> float:
        """Seconds waited in the most recent closed step (0 before the first); on CUDA waits for its last event."""
        return sum((_seconds(interval) for interval in self._last_step), 0.0)

    @property
    def last_step_waits(self) -> int:
        return len(self._last_step)

    @property
    def total_s(self) -> float:
        """Seconds waited since creation, the step in progress included; on CUDA waits for the last event."""
        self._total_s += sum(_seconds(interval) for interval in self._unread)
        self._unread = []
        return self._total_s


class BackwardTail:
    """DDP's exposed communication: from the last gradient's accumulation to the end of each synchronising backward.

    DDP's reducer launches each bucket as its gradients come in and queues ``finalize_backward``, which waits for
    every bucket (torch/csrc/distributed/c10d/reducer.cpp). A post-accumulate-grad hook runs once a parameter's
    gradient is in, before the reducer's hook, so from the last such hook to the end of ``finalize_backward`` the
    thread only launches the remaining buckets, waits and copies back: communication the backward did not hide.

    The end is marked inside autograd so that Lightning's ``on_after_backward`` does not count: the first hook
    queues a final callback that queues a second one, and the engine runs callbacks queued by callbacks after those
    already queued (``GraphTask::exec_post_processing``), so the second runs after ``finalize_backward``.

    Args:
        module: the module DDP wraps; each trainable parameter gets a hook (one clock mark per backward).
        syncing: whether the backward running now all-reduces (DDP's ``require_backward_grad_sync``, off under
            ``no_sync()``: accumulation micro-batches add nothing).
    """

    def __init__(self, module: nn.Module, clock: ExposedCommClock, syncing: Callable[[], bool]) -> None:
        self.clock = clock
        self.syncing = syncing
        self._in_backward = False
        self._timing = False
        self._ready: Mark | None = None
        self._handles = [
            p.register_post_accumulate_grad_hook(self._gradient_ready) for p in module.parameters() if p.requires_grad
        ]

    def _gradient_ready(self, _parameter: torch.Tensor) -> None:
        if not self._in_backward:  # the first gradient of this backward
            self._in_backward = True
            self._timing = self.syncing()
            self._ready = None  # a fresh event per backward: the last one may still be unread
            _queue_final_callback(lambda: _queue_final_callback(self._backward_done))
        if self._timing:
            self._ready = self.clock.mark(reuse=self._ready)

    def _backward_done(self) -> None:
        if self._timing and self._ready is not None:
            self.clock.add(self._ready)
        self._in_backward = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _queue_final_callback(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def watch_ddp(ddp: nn.Module, clock: ExposedCommClock) -> BackwardTail:
    """A :class:`BackwardTail` on a ``DistributedDataParallel`` module, timing the backward passes that sync."""
    return BackwardTail(ddp.module, clock, syncing=lambda: bool(ddp.require_backward_grad_sync))


class TimedWork(dist.Work):
    """An asynchronous collective's ``Work`` whose ``wait()`` counts as waiting for communication.

    A ``dist.Work`` subclass because FSDP2 waits only on a ``Work``.
    """

    def __init__(self, work: Any, clock: ExposedCommClock) -> None:
        super().__init__()
        self._work = work
        self._clock = clock

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        with self._clock.blocked():
            return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self) -> Any:
        return self._work.get_future()

    def exception(self) -> Any:
        return self._work.exception()

    def result(self) -> Any:
        return self._work.result()


def timed_collective(clock: ExposedCommClock | None, call: Callable[[], Any], asynchronous: bool) -> Any:
    """Run ``call`` (one collective): a blocking one counted as waiting, an asynchronous one's ``wait()`` timed."""
    if clock is None:
        return call()
    if asynchronous:
        work = call()
        return None if work is None else TimedWork(work, clock)
    with clock.blocked():
        return call()
