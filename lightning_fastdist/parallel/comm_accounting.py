"""Count what DDP's gradient communication sends, without touching the device.

Every hook in :mod:`lightning_fastdist.parallel.comm_hooks` passes each tensor
it all-reduces through :meth:`CommStats.record`. The count uses only tensor
metadata (``numel() * element_size()``), so it costs no device-to-host sync.

"Bytes" are the payload handed to ``all_reduce`` by this rank, the figure that
compression changes. What travels on the wire depends on the algorithm (a ring
all-reduce sends about ``2 * (world - 1) / world`` times the payload).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class CommStats:
    """Running totals of gradient all-reduces on this rank.

    Attributes:
        rounds: completed gradient synchronisations (one per backward that
            all-reduced, i.e. per optimizer step when accumulation skips the others).
        total_bytes: payload bytes all-reduced since creation.
        pending_bytes: payload bytes since the last :meth:`end_step`.
        last_step_bytes: payload bytes of the most recent finished optimizer step.
    """

    rounds: int = 0
    total_bytes: int = 0
    pending_bytes: int = 0
    last_step_bytes: int = 0

    def record(self, tensor: Tensor) -> None:
        """Add one all-reduced tensor's payload."""
        size = tensor.numel() * tensor.element_size()
        self.total_bytes += size
        self.pending_bytes += size

    def finish_round(self) -> None:
        """Mark the end of one gradient synchronisation (called on DDP's last bucket)."""
        self.rounds += 1

    def end_step(self) -> None:
        """Close the bytes of one optimizer step into :attr:`last_step_bytes`."""
        self.last_step_bytes = self.pending_bytes
        self.pending_bytes = 0
