"""What ``outer_sync`` adds to a rank's memory: the state torchft's DiLoCo keeps on each rank that talks across nodes.

Under DDP that is each node's local rank 0, holding whole fragments; under FSDP every rank, for its own shard of each
fragment. Following torchft 0.2.0's ``DiLoCo`` (``torchft/local_sgd.py``): a global copy on the host, the outer SGD's
momentum on the device, and, one fragment at a time, its pseudo-gradient in flight or being applied. The formula and
its measurements: docs/outer-sync.md ("Memory").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_fastdist.parallel.across_nodes.outer_sync.settings import PSEUDO_GRADIENT_DTYPES, OuterSync
from lightning_fastdist.planning.step_memory import StepMemory


@dataclass(frozen=True)
class OuterSyncMemory:
    """Bytes a rank that talks across nodes holds for the outer synchronisation, on top of its step.

    Attributes:
        global_copy: on the host (pinned when an accelerator is present): every parameter the rank holds.
        outer_momentum: on the device: the outer SGD's momentum, created by a fragment's first outer step (0 without
            momentum).
        in_flight: on the device from the step that starts the largest fragment's all-reduce to the one that applies
            it, ``delay`` steps later: its pseudo-gradient and the copy crossing the link (none when the link's dtype
            is the parameters').
        applying: on the device inside the optimizer hook that applies the largest fragment's outer step: its
            pseudo-gradient and the copy of its local parameters torchft keeps for ``mix``, whatever ``mix`` is.
        overlaps_steps: an all-reduce stays in flight during later steps (``delay > 0``), so its bytes are alive at
            their peak; with ``delay: 0`` it starts and ends inside one step's optimizer hook.
    """

    global_copy: int
    outer_momentum: int
    in_flight: int
    applying: int
    overlaps_steps: bool

    def device_peak(self, step: StepMemory) -> int:
        """The peak of a rank that trains ``step`` with this added: at the peak of a step an all-reduce overlaps, or
        inside the optimizer hook of a step that synchronises (after the step, its activations freed)."""
        overlapped = self.in_flight if self.overlaps_steps else 0
        in_the_hook = step.state + max(self.in_flight, self.applying)
        return self.outer_momentum + max(step.peak + overlapped, in_the_hook)


def outer_sync_memory(
    settings: OuterSync, fragment_numels: Sequence[int], parameter_dtype: torch.dtype
) -> OuterSyncMemory:
    """What DiLoCo keeps on a rank that talks across nodes, holding ``fragment_numels`` parameters of each fragment
    (all of them under DDP, its shard under FSDP: :func:`~lightning_fastdist.planning.fsdp_shards.shard_numels`) in
    ``parameter_dtype`` (``float32``, or the 16-bit one of a ``-true`` precision)."""
    weight = parameter_dtype.itemsize
    link = PSEUDO_GRADIENT_DTYPES[settings.dtype]
    link_copy = 0 if link == parameter_dtype else link.itemsize
    parameters, largest = sum(fragment_numels), max(fragment_numels)
    return OuterSyncMemory(
        global_copy=weight * parameters,
        outer_momentum=weight * parameters if settings.momentum > 0 else 0,
        in_flight=(weight + link_copy) * largest,
        applying=2 * weight * largest,
        overlaps_steps=settings.delay > 0,
    )
