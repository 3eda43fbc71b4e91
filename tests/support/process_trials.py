"""The fault campaign's trials whose fault ends or stops a process: each launches ``lightning-fastdist fit`` (one world,
2 ranks, as torchrun would: each rank a process of its own session) or a job across nodes, injects the fault, and
resumes where the job ended (``tests/support/fault_campaign.py`` has the campaign's checks).

- ``kill_rank``: rank 1 SIGKILLed after a step; rank 0 must end in one line, the resume reach the straight run;
- ``hung_peer``: rank 1 hangs after a step; rank 0 must end within the strategy's timeout (+ a margin), in one line;
  the launcher then ends rank 1, as torchrun's agent does; the resume reaches the straight run;
- ``second_job``: a second job started on the port of a running one (held at a step meanwhile): the second's ranks
  are refused in one line, the first trains on to the straight run's weights;
- ``kill_node``: under ``replica_groups`` or ``outer_sync``, node 1 SIGKILLed after a step and started again: node 0
  goes on, node 1 rejoins from its memory, both end with the same weights;
- ``stranger``: the same job in the emulated cluster, a stranger on the nodes' network trying every port node 0
  listens on while it holds: it is answered nothing, learns no replica to kill, and the job ends as without it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L

from lightning_fastdist.parallel.faults.collective_timeout import lost_peer_message
from tests.support.fault_campaign import (
    MAX_STEPS,
    USER_FILE,
    USER_TEXT,
    Outcome,
    Trial,
    user_files_intact,
)
from tests.support.fault_runs import subprocess_environment, write_recipe
from tests.support.harness import ForkedModule, free_port, free_port_span, rank_environment, session_members

JOB_ENDED = "the job ended before a quorum took this node back"  # what a node restarted too late says (JobEndedError)
STRATEGY_TIMEOUT_S = 20  # the strategies' collective timeout in these runs: a hung peer is noticed after it
MARGIN_S = 40  # on top of it, for a process to notice, say so and exit on 2 busy cores
LAUNCH_DEADLINE_S = 240
ENGINE_CLASSES = {
    "ddp": "lightning_fastdist.FastDDPStrategy",
    "fsdp": "lightning_fastdist.FastFSDPStrategy",
    "deepspeed": "lightning_fastdist.FastDeepSpeedStrategy",
}


class FinalDigest(L.Callback):
    """Each rank writes ``{"step", "digest"}`` of its weights (its shard) to ``folder/final-rankR.json`` at the end
    of training."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        from tests.support.fault_campaign import digest, local_weights  # noqa: PLC0415 - in the rank

        final = {"step": trainer.global_step, "digest": digest(local_weights(module))}
        (self.folder / f"final-rank{trainer.global_rank}.json").write_text(json.dumps(final))


class HoldAt(L.Callback):
    """Every rank writes ``FILE.held`` after step ``step`` and waits until ``FILE`` exists."""

    def __init__(self, step: int, file: str) -> None:
        self.step, self.file = step, Path(file)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            Path(f"{self.file}.held").write_text("")
            deadline = time.monotonic() + LAUNCH_DEADLINE_S
            while not self.file.exists() and time.monotonic() < deadline:
                time.sleep(0.05)


def _recipe(folder: Path, engine: str, callbacks: list[dict]) -> Path:
    strategy = {"class_path": ENGINE_CLASSES[engine], "init_args": {"timeout": STRATEGY_TIMEOUT_S}}
    if engine == "deepspeed":
        strategy["init_args"]["stage"] = 2
    digests = {"class_path": "tests.support.process_trials.FinalDigest", "init_args": {"folder": str(folder)}}
    return write_recipe(folder, strategy, MAX_STEPS, [*callbacks, digests])


def launch(recipe: Path, folder: Path, port: int, run_id: str, resume: bool = False) -> list[ForkedModule]:
    """The job's 2 ranks, each forked as ``python -m lightning_fastdist.cli fit`` in a session of its own."""
    args = ["fit", "--config", str(recipe), *(["--ckpt_path", "last"] if resume else [])]
    ranks = []
    for rank in range(2):
        environment = {**subprocess_environment(), **rank_environment(rank, 2, port)}
        environment["LIGHTNING_FASTDIST_RUN_ID"] = run_id
        out, err = folder / f"{run_id}.rank{rank}.out", folder / f"{run_id}.rank{rank}.err"
        command = [sys.executable, "-m", "lightning_fastdist.cli", *args]
        ranks.append(ForkedModule(command, environment, cwd=folder, out=out, err=err))
    return ranks


def wait_as_torchrun(ranks: list[ForkedModule], deadline_s: float = LAUNCH_DEADLINE_S) -> tuple[list[int], list[float]]:
    """Wait for the ranks; once one ended with a failure the others get ``MARGIN_S`` to end on their own, then are
    killed, as torchrun's agent kills a failed group. Their exit statuses (``None``-free: a killed rank's is
    negative) and the wall-clock time each ended on its own (``math.inf``: it was still running, and was killed)."""
    deadline, failed_at = time.monotonic() + deadline_s, None
    ended = [math.inf] * len(ranks)
    while time.monotonic() < deadline:
        for index, rank in enumerate(ranks):
            if ended[index] == math.inf and rank.poll() is not None:
                ended[index] = time.time()
        if all(rank.poll() is not None for rank in ranks):
            break
        if failed_at is None and any(rank.poll() not in (None, 0) for rank in ranks):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > MARGIN_S:
            break
        time.sleep(0.05)
    for rank in ranks:
        if rank.poll() is None:
            os.killpg(rank.pid, 9)
            rank.wait()
    return [rank.returncode for rank in ranks], ended


def _final(folder: Path) -> list[dict]:
    return [json.loads((folder / f"final-rank{rank}.json").read_text()) for rank in range(2)]


def straight_run(engine: str, root: Path) -> list[dict]:
    """The uninterrupted run's final step and digest per rank (made once per engine under ``root``)."""
    folder = root / f"straight-{engine}"
    if not (folder / "final-rank1.json").exists():
        recipe = _recipe(folder, engine, [])
        codes, _ = wait_as_torchrun(launch(recipe, folder, free_port(), "straight"))
        assert codes == [0, 0], (folder / "straight.rank0.err").read_text()[-3000:]
    return _final(folder)


def _one_line_of_ours(err: str) -> bool:
    """Whether a rank's stderr ends its run with a line of ours and no traceback of this package's code."""
    return "lightning_fastdist/" not in err.split("Traceback")[-1] if "Traceback" in err else True


def one_world_trial(trial: Trial, root: Path) -> Outcome:
    """``kill_rank``, ``hung_peer`` or ``second_job`` on one world of 2 ranks, then the resume."""
    straight = straight_run(trial.engine, root)
    folder = root / f"trial{trial.number:04d}"
    folder.mkdir(parents=True)
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / USER_FILE).write_text(USER_TEXT)
    release = folder / "release"
    if trial.fault == "second_job":
        callbacks = [{"class_path": "tests.support.process_trials.HoldAt",
                      "init_args": {"step": trial.step, "file": str(release)}}]  # fmt: skip
    else:
        fault = {
            "at_step": trial.step,
            "rank": 1,
            "marker": str(folder / "faulted"),
            "hang": trial.fault == "hung_peer",
        }
        callbacks = [{"class_path": "tests.support.faults.KillOnce", "init_args": fault}]
    recipe = _recipe(folder, trial.engine, callbacks)
    port = free_port()
    job = launch(recipe, folder, port, "faulted")
    sessions = [rank.pid for rank in job]
    checks: dict[str, bool] = {}
    if trial.fault == "second_job":
        deadline = time.monotonic() + LAUNCH_DEADLINE_S
        while not Path(f"{release}.held").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        intruder_folder = folder / "second"
        intruder_folder.mkdir()
        intruder = launch(_recipe(intruder_folder, trial.engine, []), intruder_folder, port, "intruder")
        sessions += [rank.pid for rank in intruder]
        intruder_codes, _ = wait_as_torchrun(intruder, 120)
        errors = [(intruder_folder / f"intruder.rank{r}.err").read_text() for r in range(2)]
        checks["ends_in_one_line"] = all(code != 0 for code in intruder_codes) and all(map(_one_line_of_ours, errors))
        checks["names_the_cause"] = (  # its rank 0 cannot listen, its rank 1 finds the other job's run id
            f"[rank 0] cannot start: port {port} (MASTER_PORT) is already in use" in errors[0]
            and "[rank 1] refusing to join: the process group at" in errors[1]
            and "its run id is LIGHTNING_FASTDIST_RUN_ID=faulted" in errors[1]
        )
        release.write_text("")
        codes, _ = wait_as_torchrun(job)
        outcome = "refused"
        checks["went_on"] = codes == [0, 0]
    else:
        codes, ended = wait_as_torchrun(job)
        fault = folder / "faulted"  # written by rank 1 at the moment it dies or hangs
        noticed_s = ended[0] - fault.stat().st_mtime if fault.exists() else math.inf
        error = (folder / "faulted.rank0.err").read_text()
        checks["ends_in_one_line"] = codes[0] not in (0, None) and _one_line_of_ours(error)
        cause = "timed out" if trial.fault == "hung_peer" else "crashed"  # a timeout is quoted for a hang only
        expected = lost_peer_message(timedelta(seconds=STRATEGY_TIMEOUT_S), 0, cause)
        checks["names_the_cause"] = expected in error and (f"({STRATEGY_TIMEOUT_S} s)" in error) == (
            cause == "timed out"
        )
        checks["no_hang_past_timeout"] = noticed_s < STRATEGY_TIMEOUT_S + MARGIN_S
        resumed = launch(recipe, folder, free_port(), "resumed", resume=True)
        sessions += [rank.pid for rank in resumed]
        codes, _ = wait_as_torchrun(resumed)
        outcome = "resumed"
        checks["not_lost"] = codes == [0, 0]
    final = _final(folder) if (folder / "final-rank1.json").exists() else []
    checks["consistent"] = [entry["digest"] for entry in final] == [entry["digest"] for entry in straight]
    checks["user_files_unchanged"] = user_files_intact(folder / "checkpoints")
    checks["no_process_left"] = session_members(sessions) == []
    detail = "" if all(checks.values()) else (folder / "faulted.rank0.err").read_text()[-1500:]
    return Outcome(trial, outcome, checks, detail)


def _across_nodes_fit(trial: Trial) -> tuple[list[str], int, int]:
    """The command each node runs in ``trial``'s form, its steps, and the step node 0 holds at until node 1 is back.
    ``replica_groups``: node 1 rejoins at the next step. ``outer_sync`` (a sync every 2 steps, ``min_nodes`` 1): node
    0 notices the loss at its next sync and node 1 rejoins at a sync after it started, so the fit is 4 steps longer
    and node 0 holds 4 steps after the kill."""
    if trial.form == "replica_groups":
        steps = MAX_STEPS
        command = [sys.executable, "-m", "tests.support.replica_groups_fit", "fast", "mlp", str(steps), "1"]
        return command, steps, min(trial.step + 2, steps - 1)
    steps = MAX_STEPS + 4
    options = {"every": 2, "fragments": 1, "delay": 0, "min_nodes": 1}
    command = [sys.executable, "-m", "tests.support.outer_sync_fit", json.dumps(options), str(steps)]
    return command, steps, trial.step + 4


def across_nodes_trial(trial: Trial, root: Path) -> Outcome:
    """``kill_node`` under the trial's form (2 loopback nodes of 1 rank): node 1 SIGKILLed after the trial's step
    and started again once node 0 holds at its step (:func:`_across_nodes_fit`); both must end with the same weights
    and every step of node 0 applied. ``stranger``: the same job in the emulated cluster, node 1 killed and a
    stranger probing node 0 while it holds."""
    from tests.support.emulated_cluster import REPO_ROOT, EmulatedCluster  # noqa: PLC0415 - only these trials
    from tests.support.node_faults import start_again_once_held  # noqa: PLC0415

    folder = root / f"trial{trial.number:04d}"
    folder.mkdir(parents=True)
    started = folder / "started"
    command, steps, hold_at = _across_nodes_fit(trial)
    # The grace: node 0's next quorum forms at once with node 0 alone unless node 1's request is in first (seen once
    # in a loaded suite run, and in campaign trial 209: node 1 then waited out torchft's quorum timeout).
    faults = {"NODE_FAULT_KILL": f"1:{trial.step}", "NODE_FAULT_HOLD": f"{hold_at}:{started}",
              "NODE_FAULT_HOLD_GRACE": "5"}  # fmt: skip
    checks: dict[str, bool] = {}
    if trial.fault == "kill_node":
        port = free_port_span(3)
        environments = [
            {**subprocess_environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node),
             "OMP_NUM_THREADS": "1", **faults}
            for node in range(2)
        ]  # fmt: skip
        nodes = [ForkedModule(command, environment, cwd=folder) for environment in environments]
        sessions = [node.pid for node in nodes]
        nodes[1] = start_again_once_held(nodes[1], command, environments[1], started, start=ForkedModule)
        sessions.append(nodes[1].pid)
        outputs = [node.communicate(timeout=LAUNCH_DEADLINE_S) for node in nodes]
        codes = [node.returncode for node in nodes]
    else:
        with EmulatedCluster(nodes=2, strangers=1) as cluster:
            nodes = cluster.start(command, faults, REPO_ROOT, folder, forked=True)
            nodes[1].wait(timeout=LAUNCH_DEADLINE_S)
            from tests.support.node_faults import wait_until_held  # noqa: PLC0415

            wait_until_held(started)
            endpoints = [e for e in cluster.listening(0) if not e.startswith("127.")]
            probe = [sys.executable, "-m", "tests.support.stranger", *endpoints]
            answers = [json.loads(line) for line in cluster.run_as_stranger(probe, timeout=120).splitlines()]
            checks["stranger_tried_ports"] = len(answers) == len(endpoints) > 0  # else the checks below say nothing
            checks["nothing_served_to_stranger"] = all(answer["answered_200"] == 0 for answer in answers)
            checks["no_replica_named_to_stranger"] = all(answer["replicas_named"] == 0 for answer in answers)
            again = {**faults, "NODE_FAULT_ANNOUNCE": str(started)}
            nodes[1] = cluster.start_again(1, command, again, REPO_ROOT, folder, forked=True)
            codes = [node.wait(timeout=LAUNCH_DEADLINE_S) for node in nodes]
            names = (("node0.out", "node0.err"), ("node1.again.out", "node1.again.err"))
            outputs = [((folder / out).read_text(), (folder / err).read_text()) for out, err in names]
            sessions = []
    reports = [[json.loads(line[4:]) for line in out.splitlines() if line.startswith("FIT ")] for out, _ in outputs]
    # Node 1 may come back as node 0 takes its last step (campaign trial 209): then it says that the job ended.
    came_back_at_the_end = trial.form == "replica_groups" and codes[1] == 1 and JOB_ENDED in outputs[1][1]
    node_0_finished = bool(reports[0]) and reports[0][0]["steps"] == list(range(1, steps + 1))
    checks["went_on"] = codes[0] == 0 and (codes[1] == 0 or came_back_at_the_end) and node_0_finished
    same_weights = bool(reports[1]) and reports[0][0]["final"] == reports[1][0]["final"]
    checks["consistent"] = came_back_at_the_end or same_weights  # a node that trained nothing holds none of the job's
    checks["no_process_left"] = session_members(sessions) == []
    detail = "" if all(checks.values()) else f"{codes} {outputs[0][1][-1500:]} {outputs[1][1][-1500:]}"
    return Outcome(trial, "came_back_at_the_end" if came_back_at_the_end else "went_on", checks, detail)
