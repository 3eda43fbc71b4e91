"""A node lost and started again in the emulated cluster, and today's path beside it (the whole job restarted from
its last checkpoint): the runs ``benchmarks/lost_node.py`` (``outer_sync``) and ``benchmarks/replica_groups.py``
(``replica_groups``) measure, for a fit module that prints ``FIT {json}`` lines and takes
:mod:`tests.support.node_faults`'s variables. Needs root, ``ip`` and ``tc``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from tests.support.emulated_cluster import REPO_ROOT, EmulatedCluster
from tests.support.node_faults import kill_time, wait_until_held

NODES, KILLED = 3, 2  # node 2 of 3 is the one lost


def fit_reports(folder: Path, names: list[str]) -> list[dict]:
    """The ``FIT`` reports in ``folder``'s ``NAME.out`` files, in the order of ``names``."""
    outputs = [(folder / f"{name}.out").read_text() for name in names]
    return [json.loads(line[4:]) for out in outputs for line in out.splitlines() if line.startswith("FIT ")]


def run_losing_a_node(
    command: list[str], env: dict[str, str], kill_at: int | None, folder: Path, **kill: str
) -> tuple[list[dict], list[int], float | None, float | None]:
    """``command`` on 3 emulated nodes; with ``kill_at``, node 2 is SIGKILLed at that step (``kill``: more of
    NodeFaults' variables, e.g. ``NODE_FAULT_KILL_IN``) and started again once the others finished step
    ``kill_at + 4`` (they wait there until it trains). Returns every node's report (node 2's of its restart), every
    node's exit status, and the wall-clock times of the kill and of the restart."""
    started = folder / "started"
    env = {**env, "NODE_FAULT_HOLD": f"{kill_at + 4}:{started}"} if kill_at is not None else env
    folder.mkdir()
    restarted_at = None
    with EmulatedCluster(nodes=NODES, ranks_per_node=1) as cluster:
        killing = {"NODE_FAULT_KILL": f"{KILLED}:{kill_at}", **kill} if kill_at is not None else {}
        processes = cluster.start(command, env={**env, **killing}, cwd=REPO_ROOT, output=folder)
        if kill_at is not None:
            processes[KILLED].wait(timeout=600)
            wait_until_held(started, timeout=600)
            restarted_at = time.time()
            again = {**env, "NODE_FAULT_ANNOUNCE": str(started)}
            processes[KILLED] = cluster.start_again(KILLED, command, env=again, cwd=REPO_ROOT, output=folder)
        codes = [process.wait(timeout=600) for process in processes]
    names = [f"node{node}" if node != KILLED or kill_at is None else f"node{node}.again" for node in range(NODES)]
    return fit_reports(folder, names), codes, kill_time((folder / f"node{KILLED}.out").read_text()), restarted_at


def restart_whole_job(
    command: list[str],
    env: dict[str, str],
    resume: Callable[[Path], tuple[list[str], dict[str, str]]],
    checkpoints: Path,
    kill_at: int,
    folder: Path,
) -> tuple[float, int]:
    """Today's path: ``command`` on 3 emulated nodes writing checkpoints into ``checkpoints``, node 2 SIGKILLed after
    step ``kill_at``, and the whole job restarted from its last checkpoint as soon as node 2 is gone (a scheduler that
    notices at once: the best case for this path), with the command and environment ``resume`` gives for that
    checkpoint. Returns the seconds from the kill to the end of the first step after the restart, and the steps
    trained again."""
    (folder / "first").mkdir(parents=True)
    (folder / "resumed").mkdir()
    with EmulatedCluster(nodes=NODES, ranks_per_node=1) as cluster:
        kill = {"NODE_FAULT_KILL": f"{KILLED}:{kill_at}"}
        processes = cluster.start(command, env={**env, **kill}, cwd=REPO_ROOT, output=folder / "first")
        processes[KILLED].wait(timeout=600)
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        last = max(checkpoints.glob("step=*.ckpt"), key=lambda path: int(path.stem.split("=")[1]))
        resumed_command, resumed_env = resume(last)
        resumed = cluster.start(resumed_command, env=resumed_env, cwd=REPO_ROOT, output=folder / "resumed")
        codes = [process.wait(timeout=600) for process in resumed]
    if codes != [0] * NODES:
        raise SystemExit(f"the job restarted from {last.name} exited {codes}")
    killed = kill_time((folder / "first" / f"node{KILLED}.out").read_text())
    assert killed is not None
    reports = fit_reports(folder / "resumed", [f"node{node}" for node in range(NODES)])
    first_step_end = max(report["step_ends"][0] for report in reports)
    return first_step_end - killed, kill_at - reports[0]["steps"][0] + 1
