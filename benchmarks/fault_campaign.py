"""The fault campaign: seeded random faults at random points of real training runs, and what each did.

    python benchmarks/fault_campaign.py --trials 300 --seed 7 --out bench_results/fault_campaign

Faults: a stop signal (SIGTERM, SIGUSR1) at any moment of a step, a full disk (a small tmpfs; needs root), a truncated
newest checkpoint, a read error on one rank (its own shard or partition truncated), a rank SIGKILLed, a peer that
hangs, a second job on the job's port, a node SIGKILLed under replica_groups, and a stranger on the nodes' network (the
emulated cluster; needs root and tc). Over DDP, FSDP and DeepSpeed in one world, and DDP with replica_groups or
outer_sync across two nodes. Each trial checks that the job went on or ended in one line, that a resume reaches the
uninterrupted run's weights bit for bit (the steps since the last complete save trained again), that no file of the
user's changed, that no process is left, and that nothing was served to or done for a stranger
(tests/support/fault_campaign.py).

Any seed and any --trials of at least the number of fault kinds runs every kind. Prints the trials by fault and
outcome, and writes fault_campaign.json into --out: the trials (each with its fault, engine, form, seed, outcome and
each check's result) and the summary counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support, as the other benchmarks import it

from tests.support.campaign import run_campaign, summary, table, unmount_under  # noqa: E402
from tests.support.fault_campaign import FAULT_KINDS, Outcome, plan  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=len(FAULT_KINDS), help=f"at least {len(FAULT_KINDS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_results/fault_campaign", help="folder for fault_campaign.json")
    args = parser.parse_args(argv)
    if args.trials < len(FAULT_KINDS):
        parser.error(f"--trials: give at least {len(FAULT_KINDS)} (one per fault kind), got {args.trials}")
    trials = plan(args.trials, args.seed)
    started = time.monotonic()

    def say(outcome: Outcome) -> None:
        verdict = "ok" if all(outcome.checks.values()) else f"FAILED {[k for k, v in outcome.checks.items() if not v]}"
        trial = outcome.trial
        print(f"trial {trial.number:4d} {trial.fault:<15} {trial.engine}/{trial.form} step {trial.step}: "
              f"{outcome.outcome} {verdict}", flush=True)  # fmt: skip

    with tempfile.TemporaryDirectory(prefix="fault-campaign-") as scratch:
        try:
            outcomes = run_campaign(trials, Path(scratch), say)
        finally:
            unmount_under(Path(scratch))
    elapsed = time.monotonic() - started
    counts = summary(outcomes)
    print("\n".join(table(outcomes)))
    print(f"{counts['trials']} trials in {elapsed / 60:.1f} min (seed {args.seed}): " + json.dumps(counts))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    document = {"seed": args.seed, "wall_s": round(elapsed, 1), "trials": [o.as_json() for o in outcomes],
                "summary": counts}  # fmt: skip
    (out / "fault_campaign.json").write_text(json.dumps(document, indent=2))
    print(f"wrote {out / 'fault_campaign.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
