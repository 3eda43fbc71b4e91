"""The options of the outer synchronisation across nodes, described and checked once.

Each node trains on its own for ``every`` steps, then the nodes average how far they moved (the pseudo-gradient) and
an outer Nesterov SGD applies it (DiLoCo, Douillard et al. 2023). Streaming DiLoCo (2025) syncs ``fragments`` pieces
at staggered steps, each all-reduce overlapping ``delay`` steps of compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

import torch

from lightning_fastdist.parallel.across_nodes.form_settings import FormSettings

PseudoGradientDtype = Literal["fp32", "bf16"]
OuterSyncForm = Literal["diloco", "streaming-diloco"]
PSEUDO_GRADIENT_DTYPES = dict(zip(get_args(PseudoGradientDtype), (torch.float32, torch.bfloat16)))


@dataclass(frozen=True)
class OuterSync(FormSettings):
    """DiLoCo's outer synchronisation (``outer_sync`` of FastDDPStrategy).

    Attributes:
        every: ``H``, optimizer steps between two synchronisations of each fragment (>= 1, a multiple of
            ``fragments``); the whole model crosses the link once per ``every`` steps.
        fragments: how many pieces of the model are synchronised at staggered steps (Streaming DiLoCo), each
            made of consecutive blocks (it must divide the number of blocks); 1 is DiLoCo, all at once.
        delay: optimizer steps an outer all-reduce overlaps before the step that applies it waits for it
            (Streaming DiLoCo's tau; 0 waits at once; less than ``every / fragments``).
        lr: the outer SGD's learning rate (> 0); DiLoCo's 0.7. ``momentum=0`` and ``lr=1`` is plain averaging.
        momentum: the outer SGD's momentum in [0, 1); DiLoCo's 0.9.
        nesterov: Nesterov momentum, as DiLoCo does (needs ``momentum > 0``).
        dtype: what the pseudo-gradient crosses the link in: ``"bf16"`` (half the bytes) or ``"fp32"``; it is
            applied in the parameters' dtype either way.
        mix: after a fragment's sync, its weights become ``lerp(global, local, mix)``; 0 takes the new global
            weights (what the steps during ``delay`` did to that fragment is dropped), 0.5 keeps half of it.
        min_nodes: the fewest nodes the job trains on: with fewer than all, a node lost after the start leaves the
            others training on at their next sync, and started again it joins them. ``None``: every node, so a lost
            node ends the job.
    """

    option: ClassVar[str] = "outer_sync"

    every: int = 100
    fragments: int = 2
    delay: int = 1
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    dtype: PseudoGradientDtype = "bf16"
    mix: float = 0.0
    min_nodes: int | None = None

    def __post_init__(self) -> None:
        _at_least("every", self.every, 1)
        _at_least("fragments", self.fragments, 1)
        _at_least("delay", self.delay, 0)
        if self.every % self.fragments:
            raise ValueError(
                f"outer_sync.every={self.every} is not a multiple of outer_sync.fragments={self.fragments}: "
                "each fragment is synchronised every `every` steps, one fragment every every/fragments steps."
            )
        if self.delay >= self.every // self.fragments:
            raise ValueError(
                f"outer_sync.delay={self.delay} must be less than every/fragments={self.every // self.fragments}: "
                "a fragment's all-reduce must finish before the next fragment's starts."
            )
        if not self.lr > 0:
            raise ValueError(f"outer_sync.lr={self.lr} must be > 0 (DiLoCo uses 0.7).")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer_sync.momentum={self.momentum} must be in [0, 1) (DiLoCo uses 0.9).")
        if self.nesterov and self.momentum == 0:
            raise ValueError("outer_sync.nesterov needs momentum > 0: give momentum or nesterov: false.")
        if self.dtype not in PSEUDO_GRADIENT_DTYPES:
            raise ValueError(f"outer_sync.dtype={self.dtype!r}: accepted values are {list(PSEUDO_GRADIENT_DTYPES)}.")
        if not 0 <= self.mix <= 1:
            raise ValueError(f"outer_sync.mix={self.mix} must be in [0, 1].")
        if self.min_nodes is not None:
            _at_least("min_nodes", self.min_nodes, 1)

    @property
    def steps_between_fragments(self) -> int:
        return self.every // self.fragments

    def in_flight(self, optimizer_steps: int) -> bool:
        """Whether after ``optimizer_steps`` steps a fragment's all-reduce has started and is not applied yet."""
        period = self.steps_between_fragments
        return self.delay > 0 and optimizer_steps % period >= period - self.delay

    def sync_steps(self, first_step: int, last_step: int) -> list[tuple[int, int]]:
        """``(optimizer step, fragment)`` of each outer sync applied in ``[first_step, last_step]`` (1-based steps)."""
        period = self.steps_between_fragments
        return [
            (step, (step // period - 1) % self.fragments)
            for step in range(first_step, last_step + 1)
            if step % period == 0
        ]


# The forms bench and tune compare, short enough that bench's steps see several syncs, with plain parameter averaging
# (outer lr 1, no momentum): DiLoCo's outer Nesterov is tuned for a far larger `every` (docs/outer-sync.md).
OUTER_SYNC_FORMS: dict[OuterSyncForm, dict[str, Any]] = {
    "diloco": {"every": 10, "fragments": 1, "delay": 0, "lr": 1.0, "momentum": 0.0, "nesterov": False},
    "streaming-diloco": {"every": 12, "fragments": 4, "delay": 1, "lr": 1.0, "momentum": 0.0, "nesterov": False},
}


def form_of(options: Mapping[str, Any] | OuterSync) -> OuterSyncForm:
    """The form a strategy's ``outer_sync`` options take: one fragment is DiLoCo, more are streaming."""
    fragments = options.fragments if isinstance(options, OuterSync) else options.get("fragments", OuterSync.fragments)
    return "diloco" if fragments == 1 else "streaming-diloco"


def _at_least(name: str, value: object, lowest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"outer_sync.{name}={value!r} must be an integer >= {lowest}.")
