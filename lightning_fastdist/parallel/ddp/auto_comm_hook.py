"""``comm_hook="auto"``: DDP's gradients start exact and are compressed only where the network makes it pay.

What compression gains depends on the cluster: on a fast link the all-reduce hides under the backward and
compression only costs accuracy. So the ranks measure the exposed share of their steps and agree on moving up one
level, ``none`` -> ``bf16`` -> ``powersgd``, never back (``docs/ddp.md``, "comm_hook: auto").
"""

# No "from __future__ import annotations": DDP compares the hook's annotations with its own types.

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.futures import Future

from lightning_fastdist.parallel.ddp.comm_hooks import HookState, allreduce_hook, bf16_compress_hook
from lightning_fastdist.parallel.ddp.powersgd import (
    PowerSGDSettings,
    PowerSGDState,
    compression_ratio,
    powersgd_hook,
)

AUTO_LEVELS = ("none", "bf16", "powersgd")


@dataclass(frozen=True)
class AutoPolicy:
    """When ``comm_hook="auto"`` switches (docs/ddp.md has the measurements behind the numbers).

    Attributes:
        warmup: optimizer steps not measured after the start and after each switch (allocations, a compile).
        window: optimizer steps measured per decision.
        bf16_share: the exposed share of a step from which sending bf16 pays.
        powersgd_share: the exposed share, already sending bf16, from which PowerSGD pays.
        min_powersgd_ratio: how many times fewer bytes than fp32 PowerSGD must send to be worth its extra compute.
        min_exposed_ms: the least wait per step worth compressing for: below it the wait is mostly per-message
            latency, which sending fewer bytes does not shorten.
    """

    warmup: int = 3
    window: int = 20
    bf16_share: float = 0.20
    powersgd_share: float = 0.25
    min_powersgd_ratio: float = 4.0
    min_exposed_ms: float = 10.0

    def __post_init__(self) -> None:
        # How a user gives each: the strategy's option for the window, the policy's own field for the warm-up.
        for name, option in (("warmup", "AutoPolicy.warmup"), ("window", "comm_hook_window")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{option}: got {value!r}; use an integer >= 1 (optimizer steps).")


@dataclass(frozen=True)
class Decision:
    """One decision of ``auto``: at which optimizer step, from and to which level, on which numbers."""

    step: int
    level_from: str
    level_to: str
    exposed_share: float
    step_s: float

    def line(self, policy: AutoPolicy) -> str:
        """The one line rank 0 logs."""
        verdict = f"switching to {self.level_to}" if self.level_to != self.level_from else f"staying at {self.level_to}"
        return (
            f"comm_hook auto: {verdict} after step {self.step}: the step waited {100 * self.exposed_share:.0f}% of "
            f"its {1000 * self.step_s:.0f} ms for gradient communication at {self.level_from} "
            f"(thresholds: bf16 from {100 * policy.bf16_share:.0f}%, powersgd from {100 * policy.powersgd_share:.0f}%)."
        )


@dataclass
class AutoCommState(HookState):
    """The ``auto`` hook's level, its measurements and decisions on one rank.

    Args:
        module: the model DDP wraps (PowerSGD keys its memories by its parameters).
        decision_group: a CPU (gloo) group over the same ranks, for the decisions' all-reduce.
        allow_bf16: whether the backend and device reduce bfloat16 (else ``auto`` stays exact).
        wall_clock: in seconds; a test gives its own so that decisions do not depend on the machine's load.
        single_rank: no gradient crosses a link: nothing is measured (no device syncs), the level stays ``none``.
    """

    module: nn.Module | None = None
    policy: AutoPolicy = field(default_factory=AutoPolicy)
    powersgd_settings: PowerSGDSettings = field(default_factory=PowerSGDSettings)
    decision_group: dist.ProcessGroup | None = None
    allow_bf16: bool = True
    wall_clock: Callable[[], float] = time.perf_counter
    single_rank: bool = False
    level: str = "none"
    decisions: list[Decision] = field(default_factory=list)
    powersgd: PowerSGDState | None = None
    steps: int = 0  # optimizer steps seen while measuring (a decision names the step it was made at)
    _steps_at_level: int = 0
    _window_start: tuple[float, float] | None = None

    @property
    def measuring(self) -> bool:
        """Whether a decision is still to come: more than one rank, the level can still go up, and the last
        decision switched."""
        if self.single_rank:
            return False
        stayed = bool(self.decisions) and self.decisions[-1].level_to == self.decisions[-1].level_from
        return self.level != "powersgd" and not stayed

    def on_optimizer_step(
        self, exposed_total_s: Callable[[], float], synchronize: Callable[[], None]
    ) -> Decision | None:
        """Count one optimizer step; at a window's end, decide together with the other ranks (collective).

        Args:
            exposed_total_s: the exposed-communication clock's running total (read at the window's ends only).
            synchronize: waits for the device, so that the wall clock covers the device's work.
        """
        self.steps += 1
        if not self.measuring:
            return None
        self._steps_at_level += 1
        policy = self.policy
        if self._steps_at_level == policy.warmup:
            synchronize()
            self._window_start = (self.wall_clock(), exposed_total_s())
        elif self._steps_at_level == policy.warmup + policy.window and self._window_start is not None:
            synchronize()
            started, exposed_before = self._window_start
            # The maximum of (wall, -exposed): the longest wall time and the shortest wait, the same everywhere
            # (a rank that waited for a slower peer's compute did not wait for the network).
            measured = torch.tensor(
                [self.wall_clock() - started, exposed_before - exposed_total_s()], dtype=torch.float64
            )
            dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=self.decision_group)
            wall, exposed = measured[0].item(), -measured[1].item()
            share = exposed / wall if wall > 0 else 0.0
            return self.decide(share, wall / policy.window, exposed / policy.window)
        return None

    def decide(self, share: float, step_s: float, exposed_s: float) -> Decision:
        """Decide on one window's measurements (combined over the ranks) and switch to the level decided.

        ``share`` is the exposed share of the window's wall time; ``step_s`` and ``exposed_s`` are per optimizer step.
        """
        policy, level = self.policy, self.level
        target = level
        bandwidth_bound = 1000 * exposed_s >= policy.min_exposed_ms  # else latency: fewer bytes would not help
        if bandwidth_bound and level == "none" and share >= policy.bf16_share and self.allow_bf16:
            target = "bf16"
        elif (
            bandwidth_bound
            and level == "bf16"
            and share >= policy.powersgd_share
            and compression_ratio(self.module, self.powersgd_settings.rank) >= policy.min_powersgd_ratio
        ):
            target = "powersgd"
        decision = Decision(self.steps, level, target, share, step_s)
        self.decisions.append(decision)
        self._switch_to(target)
        return decision

    def _switch_to(self, level: str) -> None:
        if level == self.level:
            return
        self.level = level
        self._steps_at_level = 0
        self._window_start = None
        if level == "powersgd" and self.powersgd is None:
            state = PowerSGDState(process_group=self.process_group, stats=self.stats, settings=self.powersgd_settings)
            # The exact and bf16 steps before were PowerSGD's warm-up: it compresses from the first bucket.
            state.iteration = self.powersgd_settings.start_iter
            state.index_parameters(self.module)
            self.powersgd = state

    def state_dict(self) -> dict:
        """The level, the decisions and the steps (PowerSGD's memories are saved by the strategy, per rank)."""
        return {
            "level": self.level,
            "steps": self.steps,
            "decisions": [dataclasses.asdict(decision) for decision in self.decisions],
        }

    def load_state_dict(self, saved: dict) -> None:
        """Resume at the saved level with its decisions; a level still measuring starts its window again."""
        self.steps = saved["steps"]
        self.decisions = [Decision(**decision) for decision in saved["decisions"]]
        self._switch_to(saved["level"])


def auto_hook(state: AutoCommState, bucket: dist.GradBucket) -> Future[Tensor]:
    """Average one bucket with the hook of the current level (DDP takes one hook per model)."""
    if state.level == "powersgd":
        return powersgd_hook(state.powersgd, bucket)
    if state.level == "bf16":
        return bf16_compress_hook(state, bucket)
    return allreduce_hook(state, bucket)
