"""Running a fault campaign (``fault_campaign.py`` plans the trials and runs the in-process ones,
``process_trials.py`` the others) and summing it up: what ``benchmarks/fault_campaign.py`` prints and writes, and
what ``tests/faults/test_fault_campaign.py`` asserts."""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from tests.support.fault_campaign import (
    IN_PROCESS_KINDS,
    Outcome,
    Trial,
    in_process_outcomes,
    prepare_corpus,
    run_in_process_trials,
)
from tests.support.harness import run_function
from tests.support.process_trials import across_nodes_trial, one_world_trial

# Each summary count: how many trials failed which checks.
SUMMARY_CHECKS = {
    "lost": ("not_lost",),
    "inconsistent": ("consistent",),
    "hangs": ("no_hang_past_timeout",),
    "user_files_changed": ("user_files_unchanged",),
    "processes_left": ("no_process_left",),
    "served_to_stranger": ("nothing_served_to_stranger", "stranger_tried_ports"),  # untried counts as served
    "executed_for_stranger": ("no_replica_named_to_stranger",),
    "not_one_line": ("ends_in_one_line", "names_the_cause"),
    "did_not_go_on": ("went_on",),
}


def run_campaign(trials: list[Trial], root: Path, report: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Every trial of ``trials`` under ``root``: the in-process ones in one launch of 2 ranks per engine, the others one
    launch each; ``report`` is called with each outcome as it is known."""
    outcomes: list[Outcome] = []
    corpus = prepare_corpus(root)
    in_process = [trial for trial in trials if trial.fault in IN_PROCESS_KINDS]
    for engine in sorted({trial.engine for trial in in_process}):
        batch = [trial for trial in in_process if trial.engine == engine]
        per_rank = run_function(
            run_in_process_trials, 2, args=(engine, corpus, str(root / f"in-process-{engine}"), batch),
            init_process_group=False, timeout=120 + 60 * len(batch),
        )  # fmt: skip
        for outcome in in_process_outcomes(batch, per_rank):
            outcomes.append(outcome)
            if report is not None:
                report(outcome)
    for trial in trials:
        if trial.fault in IN_PROCESS_KINDS:
            continue
        run = one_world_trial if trial.form == "one_world" else across_nodes_trial
        outcome = run(trial, root)
        outcomes.append(outcome)
        if report is not None:
            report(outcome)
    return sorted(outcomes, key=lambda outcome: outcome.trial.number)


def unmount_under(root: Path) -> None:
    """Unmount (lazily) whatever a trial left mounted under ``root`` (a small disk of a trial that failed)."""
    for line in Path("/proc/mounts").read_text().splitlines():
        mounted = line.split()[1]
        if mounted.startswith(f"{root}/"):
            subprocess.run(["umount", "--lazy", mounted], check=False)


def summary(outcomes: list[Outcome]) -> dict[str, int]:
    """The campaign's counts: trials, and for each kind of failure the trials that showed it."""
    counts = {"trials": len(outcomes)}
    for name, checks in SUMMARY_CHECKS.items():
        counts[name] = sum(any(outcome.checks.get(check) is False for check in checks) for outcome in outcomes)
    return counts


def table(outcomes: list[Outcome]) -> list[str]:
    """One line per fault kind: its trials by outcome, and how many passed every check."""
    lines = [f"{'fault':<16} {'trials':>6} {'passed':>6}  outcomes"]
    for fault in sorted({outcome.trial.fault for outcome in outcomes}):
        mine = [outcome for outcome in outcomes if outcome.trial.fault == fault]
        passed = sum(all(outcome.checks.values()) for outcome in mine)
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(Counter(o.outcome for o in mine).items()))
        lines.append(f"{fault:<16} {len(mine):>6} {passed:>6}  {kinds}")
    return lines
