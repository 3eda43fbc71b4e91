"""Agree across ranks on a stop request (a signal one rank received) without synchronising any device.

A signal handler may not run collectives (the others would not be in it), so it only records the request; every rank
polls at the same points (before each batch), each poll starting an asynchronous gloo all-reduce and returning the
previous one's result, long completed. The value is read from a host NumPy array, never through a tensor, so nothing
syncs.
"""

from __future__ import annotations

from datetime import timedelta

import numpy
import torch
import torch.distributed as dist

NO_REQUEST = 0


class StopAgreement:
    """Turns stop requests recorded by any rank into one decision that every rank reads at the same boundary.

    Args:
        group: a gloo process group over all ranks that nothing else uses, or ``None`` for a single process.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.requested = NO_REQUEST
        self._in_flight: tuple[numpy.ndarray, dist.Work] | None = None

    def request(self, code: int) -> None:
        """Record a stop request (for example a signal number > 0) on this rank; safe in a signal handler."""
        self.requested = max(self.requested, int(code))

    def poll(self) -> int:
        """Collective: the largest request any rank had made by the previous poll (``NO_REQUEST`` if none).

        Call it at the same points on every rank. Without a group the answer is this process's own request, at once.
        """
        if self.group is None:
            return self.requested
        agreed = self._finish()
        flag = numpy.array([self.requested], dtype=numpy.int64)
        work = dist.all_reduce(torch.from_numpy(flag), op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._in_flight = (flag, work)
        return agreed

    def _finish(self) -> int:
        if self._in_flight is None:
            return NO_REQUEST
        (flag, work), self._in_flight = self._in_flight, None
        work.wait()
        return int(flag[0])  # the all-reduce wrote into the array's memory

    def close(self) -> None:
        """Wait for the all-reduce still in flight (every rank started it); errors of a lost peer are ignored."""
        try:
            self._finish()
        except RuntimeError:
            pass  # a peer that already failed: training reports that error itself


def new_agreement_group(timeout: timedelta) -> dist.ProcessGroup | None:
    """Collective: a gloo group over all ranks for :class:`StopAgreement`, or ``None`` for a single process.

    gloo reduces host tensors whatever the training backend, and a group of its own keeps these small all-reduces
    out of the order of training's collectives. ``timeout`` bounds how long a rank waits for a silent peer.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    group = dist.new_group(backend="gloo", timeout=timeout)
    # torch's new_group returns without a barrier: a rank that releases the group at once (a refusal raised in setup)
    # could close its connections while a slower rank is still completing them, which then fails with gloo's error
    # instead of the refusal.
    dist.barrier(group=group)
    return group
