"""Exposed communication: how long each optimizer step waits for communication its compute did not hide.

Measured, per engine, where the waiting happens (the sources that justify each choice are cited where it is made):

- DDP (:class:`BackwardTail`): from the accumulation of the last parameter gradient to the end of DDP's
  ``finalize_backward`` (inside ``backward()``), on backward passes that synchronise gradients. DDP
  all-reduces each bucket as it fills, under the rest of the backward, and waits for every bucket before
  ``backward()`` returns; what is left after the last gradient is the part the backward did not hide.
- FSDP2 and DeepSpeed (:func:`timed_collective`, called by their counting wrappers): every blocking
  collective call and every ``wait()`` on an asynchronous one.

:class:`ExposedCommClock` adds these intervals up per optimizer step. On CPU a mark is the thread's
``time.perf_counter()``; on CUDA it is an event recorded on the current stream, so an interval is how long
the stream stalled, and the events are read only when a value is asked for: no host sync on ordinary steps.
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
        device: the training device: ``cuda`` marks with events on the current stream, anything else with
            ``now()``.
        now: the CPU clock, in seconds (a test gives one that only moves when it says, so that what is counted
            does not depend on how busy the machine is).

    Attributes:
        steps: optimizer steps closed so far.
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

    def mark(self, reuse: Mark | None = None) -> Mark:
        """Now: a :attr:`now` reading, or a CUDA event recorded on the current stream (``reuse`` re-recorded)."""
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
        if not self.on_compute_stream():
            yield
            return
        start = self.mark()
        yield
        self.add(start)

    def end_step(self) -> None:
        """Close the intervals of one optimizer step into :attr:`last_step_s`."""
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
        """How many intervals the most recent closed step had (e.g. one per synchronising DDP backward)."""
        return len(self._last_step)

    @property
    def total_s(self) -> float:
        """Seconds waited since creation, the step in progress included; on CUDA waits for the last event."""
        self._total_s += sum(_seconds(interval) for interval in self._unread)
        self._unread = []
        return self._total_s


class BackwardTail:
    """DDP's exposed communication: from the last gradient's accumulation to the end of each synchronising backward.

    DDP's reducer all-reduces a bucket as soon as its gradients are in (``Reducer::mark_variable_ready`` ->
    ``mark_bucket_ready``: buckets launched in order, each through the comm hook), and once the last bucket
    is launched it queues an autograd final callback, ``finalize_backward``, that waits for every bucket's
    future (torch/csrc/distributed/c10d/reducer.cpp). A ``register_post_accumulate_grad_hook`` runs inside
    ``AccumulateGrad`` once a parameter's gradient is in, before the reducer's post-hook on that node. From
    the last such hook to the end of ``finalize_backward`` the training thread (on CUDA, the stream) only
    launches the buckets not yet launched, waits, and copies results back: communication the backward did
    not hide.

    The end is marked inside autograd, not after ``backward()`` returns, so nothing run after it (Lightning's
    ``on_after_backward`` callbacks) counts: the first hook of a backward queues a final callback, which runs
    once the graph is done and queues a second one; the engine runs callbacks queued by callbacks after the
    ones already queued (``GraphTask::exec_post_processing``, torch/csrc/autograd/engine.cpp), so the second
    runs after DDP's ``finalize_backward``, on the caller's streams (the engine's ``MultiStreamGuard`` there).

    Args:
        module: the module DDP wraps; each trainable parameter gets a hook (one ``perf_counter`` call, or an
            event record on CUDA, per parameter per backward).
        clock: where the intervals go.
        syncing: whether the backward running now all-reduces; for DDP its ``require_backward_grad_sync``,
            which ``no_sync()`` turns off on accumulation micro-batches (they send nothing and add nothing).
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
        """Take the hooks off the parameters."""
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

    A ``dist.Work`` subclass, so callers that check the type (FSDP2 waits only on a ``Work``) still wait on it.
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
        return TimedWork(work, clock) if work is not None else None
    with clock.blocked():
        return call()
