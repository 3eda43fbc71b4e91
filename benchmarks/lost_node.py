"""A node lost mid-run under ``outer_sync`` with ``min_nodes``, then restarted: what every node does, in the emulated
cluster.

Three emulated nodes x 1 rank train TinyGPT (``tests/support/outer_sync_fit.py``) with DiLoCo across the nodes
(parameter averaging every 2 steps, ``min_nodes: 2``) twice: once uninterrupted, once with every rank of node 2
SIGKILLed after step ``--kill-at`` and node 2 started again with the same command once the others finished step
``--kill-at + 4`` (they wait there until it starts training, so that it joins before the run ends). Measured:

- ``continue_s``: seconds from the kill to the end of the survivors' first step whose quorum no longer holds node 2
  (torchft's lighthouse drops a node whose heartbeat stopped for 5 s);
- ``rejoin_s``: seconds from the restart to the end of the restarted node's first step (it starts Python, joins
  the others' next sync, receives a live node's state from its memory and trains); ``rejoin_bytes`` what it received;
- ``weights_equal_after_rejoin``: its weights equal the others' bit for bit when its first step starts and after its
  first sync;
- ``steps_lost``: outer steps the survivors did not commit (each would have discarded up to ``every`` steps of their
  work), and steps they did not train;
- ``samples_repeated``: training samples read by two nodes in the same epoch (the restarted node included);
- ``final_loss_vs_uninterrupted``: the last validation loss (of the global weights, on the same held-out data)
  relative to the uninterrupted run's;
- ``min_nodes_overhead``: seconds per step of the uninterrupted run against the same run without ``min_nodes``;
- ``restart_path_*``: today's path beside it (:func:`restart_path`).

The last line is one JSON object. Needs root, ``ip`` and ``tc``.

    python benchmarks/lost_node.py
    python benchmarks/lost_node.py --steps 40 --kill-at 12
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support.emulated_cluster

from tests.support.emulated_cluster import cannot_emulate  # noqa: E402
from tests.support.lost_node_runs import KILLED, NODES, restart_whole_job, run_losing_a_node  # noqa: E402
from tests.support.node_faults import samples_read_twice  # noqa: E402

OPTIONS = {"every": 2, "fragments": 1, "delay": 0, "lr": 1.0, "momentum": 0.0, "nesterov": False, "min_nodes": 2}


WITHOUT_MIN_NODES = {name: value for name, value in OPTIONS.items() if name != "min_nodes"}


def run(
    steps: int, kill_at: int | None, folder: Path, options: dict = OPTIONS
) -> tuple[list[dict], list[int], float | None, float | None]:
    """One fit of ``steps`` steps on 3 emulated nodes; with ``kill_at``, node 2 is SIGKILLed after that step and
    started again once the others finished step ``kill_at + 4`` (:func:`run_losing_a_node`)."""
    command = [sys.executable, "-m", "tests.support.outer_sync_fit", json.dumps(options), str(steps)]
    return run_losing_a_node(command, {"OUTER_SYNC_FIT_NODES": str(NODES)}, kill_at, folder)


def restart_path(steps: int, kill_at: int, save_every: int, folder: Path) -> tuple[float, int]:
    """Today's path, without ``min_nodes``: the same job writing a checkpoint every ``save_every`` steps, node 2
    SIGKILLed after step ``kill_at``, and the whole job restarted from its last checkpoint at once
    (:func:`restart_whole_job`)."""
    checkpoints = folder / "checkpoints"
    command = [sys.executable, "-m", "tests.support.outer_sync_fit", json.dumps(WITHOUT_MIN_NODES), str(steps)]
    command += [str(checkpoints), str(save_every)]
    env = {"OUTER_SYNC_FIT_NODES": str(NODES)}
    return restart_whole_job(command, env, lambda last: ([*command, str(last)], env), checkpoints, kill_at, folder)


def step_seconds(reports: list[dict]) -> float:
    """Seconds per step of an uninterrupted run, from the end of the first step to the end of the last (validation
    included), on its slowest node."""
    return max((ends[-1] - ends[0]) / (len(ends) - 1) for ends in (report["step_ends"] for report in reports))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=10, help="node 2 is SIGKILLed after this optimizer step")
    parser.add_argument("--save-every", type=int, default=4, help="checkpoints of today's path, every so many steps")
    args = parser.parse_args(argv)
    reason = cannot_emulate()
    if reason:
        print(f"cannot run the emulated cluster here: {reason}")
        return 2
    with tempfile.TemporaryDirectory(prefix="lost-node-") as scratch:
        uninterrupted, codes, _, _ = run(args.steps, None, Path(scratch, "uninterrupted"))
        plain, plain_codes, _, _ = run(args.steps, None, Path(scratch, "without-min-nodes"), WITHOUT_MIN_NODES)
        if codes != [0] * NODES or plain_codes != [0] * NODES:
            raise SystemExit(f"the uninterrupted runs exited {codes} and {plain_codes}")
        reports, codes, killed_at, restarted_at = run(args.steps, args.kill_at, Path(scratch, "killed"))
        if codes != [0] * NODES or killed_at is None or restarted_at is None:
            raise SystemExit(f"the run with node {KILLED} killed and restarted exited {codes}")
        job_restart_s, steps_trained_again = restart_path(
            args.steps, args.kill_at, args.save_every, Path(scratch, "restart")
        )
    *survivors, restarted = reports
    first_without = [report["members"].index(NODES - 1) for report in survivors]
    continue_s = max(report["step_ends"][step] for report, step in zip(survivors, first_without)) - killed_at
    uncommitted = max(args.steps // OPTIONS["every"] - report["syncs"][-1] for report in survivors)
    untrained = max(args.steps - len(report["losses"]) for report in survivors)
    came_back = restarted["rejoined"]["step"]
    first_sync = restarted["steps"].index(came_back + OPTIONS["every"])
    weights_equal = (
        restarted["first_digest"] == survivors[0]["digests"][came_back - 1]
        and restarted["digests"][first_sync] == survivors[0]["digests"][came_back + OPTIONS["every"] - 1]
    )
    reference = uninterrupted[0]["val_losses"][-1]
    result = {
        "nodes": NODES,
        "killed_node": KILLED,
        "killed_after_step": args.kill_at,
        "steps": args.steps,
        "continue_s": round(continue_s, 2),
        "first_step_without_it": first_without[0] + 1,
        "steps_lost": uncommitted + untrained,
        "rejoin_s": round(restarted["step_ends"][0] - restarted_at, 2),
        "rejoined_at_step": came_back,
        "rejoined_from": restarted["rejoined"]["source"],
        "rejoin_bytes": restarted["rejoined"]["bytes"],
        "weights_equal_after_rejoin": weights_equal,
        "samples_repeated": samples_read_twice(reports),
        "final_weights_equal": len({report["final"] for report in reports}) == 1,
        "final_loss": survivors[0]["val_losses"][-1],
        "final_loss_uninterrupted": reference,
        "final_loss_vs_uninterrupted": survivors[0]["val_losses"][-1] / reference - 1,
        "step_s": round(step_seconds(uninterrupted), 4),
        "step_s_without_min_nodes": round(step_seconds(plain), 4),
        "min_nodes_overhead": step_seconds(uninterrupted) / step_seconds(plain) - 1,
        "restart_path_resume_s": round(job_restart_s, 2),
        "restart_path_steps_trained_again": steps_trained_again,
        "restart_path_save_every": args.save_every,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
