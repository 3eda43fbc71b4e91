"""How ``lightning-fastdist tune`` spends its budget: the order of trials, the quality guard, successive halving.

A compared candidate is accepted only while its loss stays within tolerance of its reference's at equal tokens.
Halving keeps the fastest third rather than half, because a trial costs mostly its start-up; a run starts only if
the runs so far say it ends within the budget. ``docs/tune.md`` has the details.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from lightning_fastdist.commands.bench.rows import throughput
from lightning_fastdist.commands.tune.candidates import Candidate, MemoryPlan, larger_micro_batches, memory_verdict

COMPILED_LEADERS = 2  # how many of the fastest accepted setups are tried with compile
HALVING_RATE = 3  # each round keeps the fastest third (at least two) and trains them three times as long


@dataclass
class Trial:
    """What happened to one candidate.

    Attributes:
        status: ``pruned`` (memory plan), ``rejected`` (quality guard), ``failed``, ``not tried`` (the budget,
            a reference that did not run, or it cannot run here), ``measured`` (eliminated by halving), or
            ``winner``.
        reason: one line for every status but ``measured`` and ``winner``.
        guard: the quality guard's comparison of its latest round, once its reference trained as many steps.
        peak_plan_bytes: the memory plan's peak per rank, when there was a plan.
        rounds: bench's row per round it trained in.
    """

    candidate: Candidate
    status: str = "waiting"
    reason: str | None = None
    guard: str | None = None
    peak_plan_bytes: int | None = None
    rounds: list[dict] = field(default_factory=list)

    @property
    def speed(self) -> float:
        """Throughput in its latest round (tokens/s, else samples/s); 0 when it has none."""
        return (throughput(self.rounds[-1]) or 0.0) if self.rounds else 0.0


Measure = Callable[[Candidate, int, int], dict]  # (candidate, steps, round) -> bench's row for it


def losses_to_compare(row: dict, reference_row: dict) -> tuple[str, float | None, float | None]:
    """``(which loss, the candidate's, the reference's)``: the held-out loss where both rows have it (of the weights
    each setup delivers, the global ones under ``outer_sync``), else the training tail loss."""
    if row.get("held_out_loss") is not None and reference_row.get("held_out_loss") is not None:
        return "held-out loss", row["held_out_loss"], reference_row["held_out_loss"]
    return "training tail loss", row.get("tail_loss"), reference_row.get("tail_loss")


@dataclass
class Search:
    """One tune run's trials, in the order they were decided.

    Args:
        measure: trains a candidate in fresh processes and returns bench's row.
        steps: optimizer steps of round 1.
        budget_s: seconds the trials may take in all.
        loss_tolerance: the quality guard's relative tolerance.
        compile_backend: the backend of the compile trials, or ``None`` for none.
        report: called with each trial as it is decided (the progress line).
    """

    measure: Measure
    plan: MemoryPlan
    steps: int
    budget_s: float
    loss_tolerance: float
    compile_backend: str | None
    report: Callable[[Trial, int], None]
    trials: dict[str, Trial] = field(default_factory=dict)
    halving_stopped: str | None = None  # why halving ended before one was left, if the budget ended it
    _started: float = field(default_factory=time.monotonic)
    _seconds_per_step: list[float] = field(default_factory=list)

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started

    def _fits_budget(self, steps: int) -> bool:
        if not self._seconds_per_step:
            return True
        expected = max(self._seconds_per_step) * steps  # the slowest so far, start-up included: conservative
        return self.elapsed_s() + expected <= self.budget_s

    def add(self, candidate: Candidate) -> Trial:
        """Plan ``candidate``: waiting to train, or pruned by the memory plan (reported at once)."""
        peak, too_large = memory_verdict(candidate, self.plan)
        trial = Trial(candidate, peak_plan_bytes=peak)
        if too_large:
            trial.status, trial.reason = "pruned", too_large
            self.report(trial, 1)
        self.trials[candidate.name] = trial
        return trial

    def _run(self, trial: Trial, steps: int, round_number: int) -> bool:
        """Train ``trial`` for ``steps``; whether it produced numbers that passed the guard (so far)."""
        started = time.monotonic()
        row = self.measure(trial.candidate, steps, round_number)
        self._seconds_per_step.append((time.monotonic() - started) / steps)
        if "failed" in row or "skipped" in row:  # skipped: it cannot run here (e.g. DeepSpeed not installed)
            trial.status = "failed" if "failed" in row else "not tried"
            trial.reason = row.get("failed") or row.get("skipped")
            self.report(trial, round_number)
            return False
        trial.rounds.append({**row, "round": round_number, "steps": steps})
        trial.status, trial.guard = "measured", None  # the guard compares this round's loss, when it can
        self._guard(trial)
        self.report(trial, round_number)
        return trial.status == "measured"

    def _guard(self, trial: Trial) -> None:
        """Reject ``trial`` if its latest loss is not within tolerance of its reference's after as many steps."""
        reference = self.trials.get(trial.candidate.compared_with or "")
        if reference is not None and trial.status == "measured":
            self._compare_losses(trial, reference)

    def _compare_losses(self, trial: Trial, reference: Trial) -> None:
        """Reject ``trial`` if ``reference`` trained as many steps and their losses differ beyond the tolerance."""
        steps = trial.rounds[-1]["steps"]
        reference_row = next((r for r in reference.rounds if r["steps"] == steps), None)
        if reference_row is None:
            return
        kind, loss, expected = losses_to_compare(trial.rounds[-1], reference_row)
        name = reference.candidate.name
        if loss is None or expected is None or not math.isfinite(loss):
            trial.status, trial.reason = "rejected", f"no finite {kind} to compare with {name}'s"
            trial.guard = trial.reason
            return
        within = abs(loss - expected) <= self.loss_tolerance * abs(expected)
        trial.guard = (
            f"{kind} {loss:.4f} vs {name}'s {expected:.4f}, both after {steps} steps of the same global batch "
            f"(equal tokens): {100 * abs(loss - expected) / abs(expected):.3g}% apart, "
            f"{'within' if within else 'beyond'} the tolerance of {100 * self.loss_tolerance:g}%"
        )
        if not within:
            trial.status, trial.reason = "rejected", trial.guard

    def _exact_root(self, trial: Trial) -> Trial | None:
        """The exact setup at the end of ``trial``'s chain of references (``ddp`` for ``ddp-bf16+compile``)."""
        root = trial
        while root.candidate.compared_with:
            root = self.trials[root.candidate.compared_with]
        return None if root is trial else root

    def _confirm(self, order: list[Trial], round_number: int) -> Trial | None:
        """The first of ``order`` whose loss after its last round is within tolerance of its exact root's after
        as many steps (the root trains that long first if halving left it behind: the gap of a compression grows
        with the steps); ``None`` when none is."""
        for trial in order:
            root = self._exact_root(trial)
            steps = trial.rounds[-1]["steps"]
            if root is not None and not any(r["steps"] == steps for r in root.rounds):
                if not self._fits_budget(steps):
                    self.halving_stopped = f"the budget left no time to train {root.candidate.name} as a reference"
                    return trial
                self._run(root, steps, round_number)
            if root is not None:
                self._compare_losses(trial, root)
            if trial.status == "rejected":
                self.report(trial, round_number)
            if trial.status == "measured":
                return trial
        return None

    def try_in_order(self, candidates: list[Candidate]) -> None:
        """Round 1 for ``candidates``, each after the one it is compared with, while the budget lasts."""
        for candidate in candidates:
            trial = self.trials.get(candidate.name) or self.add(candidate)
            if trial.status != "waiting":
                continue
            reference = self.trials.get(candidate.compared_with) if candidate.compared_with else None
            if reference is not None and reference.status not in ("measured", "winner"):
                trial.status = "not tried"
                trial.reason = f"{reference.candidate.name}, which its loss is compared with, did not train"
            elif not self._fits_budget(self.steps):
                trial.status, trial.reason = "not tried", f"the budget ({self.budget_s / 60:.1f} min) was spent"
            else:
                self._run(trial, self.steps, 1)
                continue
            self.report(trial, 1)

    def accepted(self) -> list[Trial]:
        """The candidates still in the running, fastest first."""
        return sorted((t for t in self.trials.values() if t.status == "measured"), key=lambda t: -t.speed)

    def try_compile(self) -> None:
        """Compile the fastest accepted setups that can (DeepSpeed has no per-block compile here)."""
        if self.compile_backend is None:
            return
        leaders = [t for t in self.accepted() if not t.candidate.setup.uses_deepspeed]
        compiled = [
            replace(t.candidate, compile_backend=self.compile_backend, compared_with=t.candidate.name)
            for t in leaders[:COMPILED_LEADERS]
        ]
        self.try_in_order(compiled)

    def try_larger_micro_batches(self, micro_batch: int | None, accumulation: int) -> None:
        """Fewer, larger micro-batches for the fastest accepted setup, where they fit."""
        accepted = self.accepted()
        if not accepted:
            return
        leader = accepted[0].candidate
        splits = larger_micro_batches(micro_batch, accumulation)
        # Not compared: the same gradients, but the last micro-batch holds other samples, so its loss differs.
        variants = [replace(leader, micro_batch=m, accumulation=a, compared_with=None) for m, a in splits]
        self.try_in_order(variants)

    def halve(self) -> Trial | None:
        """Successive halving over the accepted candidates; the winner, or ``None`` when none was accepted."""
        ranking, steps, round_number = self.accepted(), self.steps, 1
        while len(ranking) > 1:
            survivors = ranking[: max(2, math.ceil(len(ranking) / HALVING_RATE))]
            if not self._fits_budget(HALVING_RATE * steps * len(survivors)):
                self.halving_stopped = (
                    f"the budget ({self.budget_s / 60:.1f} min) left no time for round {round_number + 1}"
                )
                break
            steps, round_number = steps * HALVING_RATE, round_number + 1
            for trial in survivors:
                self._run(trial, steps, round_number)
            for trial in survivors:  # a reference that trained after the trial compared with it
                guarded = trial.guard
                self._guard(trial)
                if trial.guard != guarded:  # its comparison of this round: printed now that there is one
                    self.report(trial, round_number)
            ranking = sorted((t for t in survivors if t.status == "measured"), key=lambda t: -t.speed)
            if len(survivors) == 2:
                break
        # If the guard rejects the finalists, the next best are those halving left behind, latest round first.
        behind = sorted((t for t in self.accepted() if t not in ranking), key=lambda t: (-len(t.rounds), -t.speed))
        winner = self._confirm(ranking + behind, round_number)
        if winner is not None:
            winner.status = "winner"
        return winner
