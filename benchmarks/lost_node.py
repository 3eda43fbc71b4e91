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
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support.emulated_cluster

from tests.support.emulated_cluster import EmulatedCluster, cannot_emulate  # noqa: E402
from tests.support.node_faults import kill_time, samples_read_twice, wait_until_held  # noqa: E402

NODES, KILLED = 3, 2
OPTIONS = {"every": 2, "fragments": 1, "delay": 0, "lr": 1.0, "momentum": 0.0, "nesterov": False, "min_nodes": 2}


WITHOUT_MIN_NODES = {name: value for name, value in OPTIONS.items() if name != "min_nodes"}


def run(
    steps: int, kill_at: int | None, folder: Path, options: dict = OPTIONS
) -> tuple[list[dict], list[int], float | None, float | None]:
    """One fit of ``steps`` steps on 3 emulated nodes; with ``kill_at``, node 2 is SIGKILLed after that step and
    started again once the others finished step ``kill_at + 4``. Returns every node's report (node 2's of its
    restart), every node's exit status, and the wall-clock times of the kill and of the restart."""
    command = [sys.executable, "-m", "tests.support.outer_sync_fit", json.dumps(options), str(steps)]
    env = {"OUTER_SYNC_FIT_NODES": str(NODES)}
    started = folder / "started"
    if kill_at is not None:
        env["NODE_FAULT_HOLD"] = f"{kill_at + 4}:{started}"
    folder.mkdir()
    restarted_at = None
    with EmulatedCluster(nodes=NODES, ranks_per_node=1) as cluster:
        kill = {"NODE_FAULT_KILL": f"{KILLED}:{kill_at}"} if kill_at is not None else {}
        processes = cluster.start(command, env={**env, **kill}, cwd=ROOT, output=folder)
        if kill_at is not None:
            processes[KILLED].wait(timeout=600)
            wait_until_held(started, timeout=600)
            restarted_at = time.time()
            again = {**env, "NODE_FAULT_ANNOUNCE": str(started)}
            processes[KILLED] = cluster.start_again(KILLED, command, env=again, cwd=ROOT, output=folder)
        codes = [process.wait(timeout=600) for process in processes]
    names = [f"node{node}" if node != KILLED or kill_at is None else f"node{node}.again" for node in range(NODES)]
    outputs = [(folder / f"{name}.out").read_text() for name in names]
    reports = [json.loads(line[4:]) for out in outputs for line in out.splitlines() if line.startswith("FIT ")]
    return reports, codes, kill_time((folder / f"node{KILLED}.out").read_text()), restarted_at


def restart_path(steps: int, kill_at: int, save_every: int, folder: Path) -> tuple[float, int]:
    """Today's path, without ``min_nodes``: the same job writing a checkpoint every ``save_every`` steps, node 2
    SIGKILLed after step ``kill_at``, and the whole job restarted from its last checkpoint as soon as node 2 is gone
    (a scheduler that notices at once: the best case for this path). Returns the seconds from the kill to the end of
    the first step after the restart, and the steps trained again."""
    checkpoints = folder / "checkpoints"
    command = [sys.executable, "-m", "tests.support.outer_sync_fit", json.dumps(WITHOUT_MIN_NODES), str(steps)]
    command += [str(checkpoints), str(save_every)]
    env = {"OUTER_SYNC_FIT_NODES": str(NODES)}
    (folder / "first").mkdir(parents=True)
    (folder / "resumed").mkdir()
    with EmulatedCluster(nodes=NODES, ranks_per_node=1) as cluster:
        kill = {"NODE_FAULT_KILL": f"{KILLED}:{kill_at}"}
        processes = cluster.start(command, env={**env, **kill}, cwd=ROOT, output=folder / "first")
        processes[KILLED].wait(timeout=600)
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        last = max(checkpoints.glob("step=*.ckpt"), key=lambda path: int(path.stem.split("=")[1]))
        resumed = cluster.start([*command, str(last)], env=env, cwd=ROOT, output=folder / "resumed")
        codes = [process.wait(timeout=600) for process in resumed]
    if codes != [0] * NODES:
        raise SystemExit(f"the job restarted from {last.name} exited {codes}")
    killed = kill_time((folder / "first" / f"node{KILLED}.out").read_text())
    assert killed is not None
    outputs = [(folder / "resumed" / f"node{node}.out").read_text() for node in range(NODES)]
    reports = [json.loads(line[4:]) for out in outputs for line in out.splitlines() if line.startswith("FIT ")]
    first_step_end = max(report["step_ends"][0] for report in reports)
    return first_step_end - killed, kill_at - reports[0]["steps"][0] + 1


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
