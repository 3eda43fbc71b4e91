"""A node lost mid-run under ``outer_sync`` with ``min_nodes``: what the other nodes do, in the emulated cluster.

Three emulated nodes x 1 rank train TinyGPT (``tests/support/outer_sync_fit.py``) with DiLoCo across the nodes
(parameter averaging every 2 steps, ``min_nodes: 2``) twice: once uninterrupted, once with every rank of node 2
SIGKILLed after step ``--kill-at``. From the second run, measured on the surviving nodes:

- ``continue_s``: seconds from the kill to the end of the survivors' first step whose quorum no longer holds node 2
  (torchft's lighthouse drops a node whose heartbeat stopped for 5 s);
- ``steps_lost``: outer steps the survivors did not commit (each would have discarded up to ``every`` steps of their
  work), and steps they did not train;
- ``samples_repeated``: training samples read by both survivors in the same epoch;
- ``final_loss_vs_uninterrupted``: the survivors' last validation loss (of the global weights, on the same held-out
  data) relative to the uninterrupted run's.

``rejoin_s`` and ``weights_equal_after_rejoin`` are ``null``: a node restarted with the same command does not join a
running job yet (issue 38). The last line is one JSON object. Needs root, ``ip`` and ``tc``.

    python benchmarks/lost_node.py
    python benchmarks/lost_node.py --steps 40 --kill-at 12
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support.emulated_cluster

from tests.support.emulated_cluster import EmulatedCluster, cannot_emulate  # noqa: E402

NODES, KILLED = 3, 2
OPTIONS = {"every": 2, "fragments": 1, "delay": 0, "lr": 1.0, "momentum": 0.0, "nesterov": False, "min_nodes": 2}
KILL_LINE = re.compile(r"^KILLED \d+ \d+ ([0-9.]+)$", re.MULTILINE)


def run(steps: int, kill_at: int | None, folder: Path) -> tuple[list[dict], list[int], float | None]:
    """One fit of ``steps`` steps on 3 emulated nodes; with ``kill_at``, node 2 is SIGKILLed after that step.
    Returns the reports of the nodes that finished, every node's exit status, and the kill's wall-clock time."""
    command = [sys.executable, "-m", "tests.support.outer_sync_fit", json.dumps(OPTIONS), str(steps)]
    env = {"OUTER_SYNC_FIT_NODES": str(NODES)}
    if kill_at is not None:
        env["OUTER_SYNC_FIT_KILL"] = f"{KILLED}:{kill_at}"
    folder.mkdir()
    with EmulatedCluster(nodes=NODES, ranks_per_node=1) as cluster:
        processes = cluster.start(command, env=env, cwd=ROOT, output=folder)
        codes = [process.wait(timeout=600) for process in processes]
    outputs = [(folder / f"node{node}.out").read_text() for node in range(NODES)]
    reports = [json.loads(line[4:]) for out in outputs for line in out.splitlines() if line.startswith("FIT ")]
    killed = KILL_LINE.search(outputs[KILLED])
    return reports, codes, float(killed.group(1)) if killed else None


def samples_read_twice(survivors: list[dict]) -> int:
    """Training samples both survivors read in the same epoch."""
    by_epoch: list[dict[int, set[int]]] = []
    for report in survivors:
        epochs: dict[int, set[int]] = {}
        for epoch, indices in report["samples"]:
            epochs.setdefault(epoch, set()).update(indices)
        by_epoch.append(epochs)
    first, second = by_epoch
    return sum(len(first[epoch] & second.get(epoch, set())) for epoch in first)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=10, help="node 2 is SIGKILLed after this optimizer step")
    args = parser.parse_args(argv)
    reason = cannot_emulate()
    if reason:
        print(f"cannot run the emulated cluster here: {reason}")
        return 2
    with tempfile.TemporaryDirectory(prefix="lost-node-") as scratch:
        uninterrupted, codes, _ = run(args.steps, None, Path(scratch, "uninterrupted"))
        if codes != [0] * NODES:
            raise SystemExit(f"the uninterrupted run exited {codes}; see its output above")
        survivors, codes, killed_at = run(args.steps, args.kill_at, Path(scratch, "killed"))
        if codes[:KILLED] != [0] * KILLED or killed_at is None:
            raise SystemExit(f"the run with node {KILLED} killed exited {codes}")
    first_without = [report["members"].index(NODES - 1) for report in survivors]
    continue_s = max(report["step_ends"][step] for report, step in zip(survivors, first_without)) - killed_at
    uncommitted = max(args.steps // OPTIONS["every"] - report["syncs"][-1] for report in survivors)
    untrained = max(args.steps - len(report["losses"]) for report in survivors)
    reference = uninterrupted[0]["val_losses"][-1]
    result = {
        "nodes": NODES,
        "killed_node": KILLED,
        "killed_after_step": args.kill_at,
        "steps": args.steps,
        "continue_s": round(continue_s, 2),
        "first_step_without_it": first_without[0] + 1,
        "steps_lost": uncommitted + untrained,
        "samples_repeated": samples_read_twice(survivors),
        "survivors_weights_equal": len({report["final"] for report in survivors}) == 1,
        "final_loss": survivors[0]["val_losses"][-1],
        "final_loss_uninterrupted": reference,
        "final_loss_vs_uninterrupted": survivors[0]["val_losses"][-1] / reference - 1,
        "rejoin_s": None,
        "weights_equal_after_rejoin": None,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
