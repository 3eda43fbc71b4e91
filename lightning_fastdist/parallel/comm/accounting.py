"""Count what a strategy's collectives send, without touching the device.

The count uses only metadata (``numel() * element_size()``), so no device-to-host sync. The bytes recorded are the
collective's full-size tensor: what is all-reduced, the gathered result of an all-gather, the input of a
reduce-scatter (what each rank sends on a ring: ``docs/doctor.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

ALL_REDUCE = "allreduce"
ALL_GATHER = "allgather"
REDUCE_SCATTER = "reduce_scatter"


@dataclass(frozen=True)
class Traffic:
    """Calls of one collective and their bytes."""

    calls: int = 0
    bytes: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.calls + other.calls, self.bytes + other.bytes)

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(self.calls - other.calls, self.bytes - other.bytes)


def metric_name(collective: str) -> str:
    """The name a collective's bytes per optimizer step are logged under."""
    return f"comm/{collective}_bytes_per_step"


@dataclass
class CommStats:
    """Running totals of this rank's gradient and parameter communication.

    Attributes:
        rounds: completed gradient synchronisations (one per optimizer step when accumulation skips the others).
        totals: traffic per collective name since creation.
        last_step: traffic per collective name of the most recent finished optimizer step.
    """

    rounds: int = 0
    totals: dict[str, Traffic] = field(default_factory=dict)
    last_step: dict[str, Traffic] = field(default_factory=dict)
    _pending: dict[str, Traffic] = field(default_factory=dict, repr=False)

    def record(self, tensor: Tensor, collective: str = ALL_REDUCE) -> None:
        """Add one call of ``collective`` on ``tensor`` (its full-size tensor, see the module docstring)."""
        call = Traffic(1, tensor.numel() * tensor.element_size())
        self.totals[collective] = self.totals.get(collective, Traffic()) + call
        self._pending[collective] = self._pending.get(collective, Traffic()) + call

    def finish_round(self) -> None:
        self.rounds += 1

    def end_step(self) -> None:
        """Close the traffic of one optimizer step into ``last_step``."""
        self.last_step, self._pending = self._pending, {}

    @property
    def total_bytes(self) -> int:
        return sum(traffic.bytes for traffic in self.totals.values())

    @property
    def last_step_bytes(self) -> int:
        return sum(traffic.bytes for traffic in self.last_step.values())

    def gradient_bytes_so_far(self) -> int:
        """Bytes all-reduced or reduce-scattered since creation (gradients, not parameters)."""
        return sum(self.totals.get(name, Traffic()).bytes for name in (ALL_REDUCE, REDUCE_SCATTER))
