"""What ``outer_sync`` adds to a rank's memory: the state torchft's DiLoCo keeps on each rank that talks across nodes.

Under ``FastDDPStrategy(outer_sync=...)`` one process per node talks across nodes, its local rank 0, and holds
whole fragments; the node's other ranks hold none of it. Under ``FastFSDPStrategy(outer_sync=...)`` every rank
talks, for its own shard of each fragment (FSDP2 shards over the node's ranks:
:mod:`~lightning_fastdist.planning.fsdp_shards`), and holds the same state for that shard only. There torchft
0.2.0's ``DiLoCo`` (``torchft/local_sgd.py``) keeps, for each fragment of which the rank holds ``F`` parameters of
``w`` bytes (``N`` in all):

- **on the host**, its global copy (``original_parameters``, allocated on torchft's backup device, the CPU; pinned
  when an accelerator is present): ``w F``, for all of them ``w N``;
- **on the device**, the outer ``torch.optim.SGD``'s momentum buffer, only with ``momentum > 0``, created by the
  fragment's first outer step: ``w F``;
- **on the device, while the fragment's all-reduce is in flight** (from the step that starts it to the step that
  applies it, ``delay`` steps later): its pseudo-gradient (``_grads``, in the parameters' dtype) and the copy of it
  that crosses the link in ``dtype`` (none when that is the parameters' dtype): ``(w + l) F``;
- **on the device, while the outer step is applied** (inside that step's optimizer hook): the pseudo-gradient, now
  the parameters' gradients, and a copy of the local parameters (``_local_parameters``, kept for ``mix`` and freed
  at the end of the hook, whatever ``mix`` and ``delay`` are): ``2 w F``.

One fragment is synchronised at a time, so the transient bytes are those of the largest fragment.
``docs/semi-sync.md`` ("Memory") writes it out; ``tests/semi_sync/test_outer_sync.py`` compares it with what
torchft holds on each rank in real runs of two nodes, under DDP and under FSDP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_fastdist.parallel.semi_sync.settings import PSEUDO_GRADIENT_DTYPES, OuterSync
from lightning_fastdist.planning.step_memory import StepMemory


@dataclass(frozen=True)
class OuterSyncMemory:
    """Bytes a rank that talks across nodes holds for the outer synchronisation, on top of its step (DDP's, on
    each node's local rank 0; FSDP's, on every rank, for its shard).

    Attributes:
        global_copy: on the host: the global copy of every parameter the rank holds.
        outer_momentum: on the device: the outer optimizers' momentum (0 without momentum).
        in_flight: on the device while the largest fragment's all-reduce is in flight: its pseudo-gradient and the
            copy crossing the link.
        applying: on the device while the largest fragment's outer step is applied: its pseudo-gradient and a copy
            of its local parameters.
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
    """What DiLoCo keeps on a rank that talks across nodes (see the module docstring).

    Args:
        settings: the outer synchronisation's options.
        fragment_numels: the parameters of each fragment
            (:func:`~lightning_fastdist.parallel.semi_sync.fragments.split_into_fragments`) the rank holds: all of
            them under DDP, its shard's under FSDP (:func:`~lightning_fastdist.planning.fsdp_shards.shard_numels`).
        parameter_dtype: the dtype of the trained parameters (``float32``, or the 16-bit one of a ``-true``
            precision).
    """
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
