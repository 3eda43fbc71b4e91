"""The packaged ``train.sbatch`` against the daemons: it trains, and every way SLURM stops a job (the time-limit
warning ``--signal=USR1@90``, a preemption by a higher-priority partition with a GraceTime, a lost node, ``scancel``)
saves what it must and resumes exactly.

One job takes all four stops, one per run, beside an uninterrupted job of the same script and recipe (run at the same
time in ``high``, which nothing preempts): a requeued run continues exactly where the stop left it, each rank training
the uninterrupted run's samples step for step, none twice and none skipped, with its weights bit for bit after every
step (the weights' digest that :class:`~tests.support.slurm_workload.SampleLog` logs per step).

The time-limit warning comes from slurmctld's 30 s timer (up to 60 s early); the test sends the same signal through
the same delivery path at once, ``scancel --signal=USR1`` (to the tasks, not the batch script, as
``--signal=USR1@N`` does). SLURM notices a lost node only after ``SlurmdTimeout`` (30 s here, 300 s by default); the
test marks it DOWN itself once the survivor has exited, as a cluster's health check would.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.slurm_cluster import SlurmCluster
from tests.support.slurm_training import (
    Finished,
    finish,
    last_step,
    output,
    read_runs,
    submit_training,
    trained_history,
    wait_for_output,
    wait_for_step,
)
from tests.support.slurm_workload import digest, tiny_overrides

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess, pytest.mark.slow]

STEPS = 20  # room for four stops, a few steps apart
# From step 2 on each step sleeps 0.25 s: a stop requested at step k lands by step k + 2, long before the end.
SLOW = {"slow_from": 2, "seconds": 0.25}
RESTORED = "Restoring states from the checkpoint path at "


def stopped_at(text: str, signal: str) -> int:
    """The step both ranks' ``stopped by SIGNAL after step N: saved ...last.ckpt`` lines name (the same on each)."""
    found = re.findall(rf"\[rank (\d)\] stopped by {signal} after step (\d+): saved \S+last\.ckpt; exiting", text)
    assert sorted(rank for rank, _ in found) == ["0", "1"] and len({step for _, step in found}) == 1, found
    return int(found[0][1])


def train_two_steps_more(cluster: SlurmCluster, job_id: int, samples: Path, run: int) -> None:
    """Wait until run ``run`` of the job has trained two steps."""
    wait_for_step(cluster, job_id, samples, run, step=1)
    wait_for_step(cluster, job_id, samples, run, step=last_step(samples, run) + 1)


def check_uninterrupted(run: Finished) -> None:
    """The packaged script trained the ``multi_node`` recipe (its own strategy, the script's node and task counts, the
    user's CPU overrides) on one rank per node, every step, the two ranks on disjoint samples, and exited 0 with
    ``last.ckpt`` complete."""
    job, runs = run.job, run.runs
    assert (job.state, job.exit_code, job.restarts, job.nodes) == ("COMPLETED", 0, 0, "n[0-1]"), output(job)[-4000:]
    assert sorted(runs) == [(0, 0), (1, 0)]
    histories = [trained_history(runs, rank)[0] for rank in (0, 1)]
    assert [[step for step, _, _ in history] for history in histories] == [list(range(1, STEPS + 1))] * 2
    samples = [{index for _, indices, _ in history for index in indices} for history in histories]
    assert len(samples[0]) == len(samples[1]) == STEPS * 2 and not samples[0] & samples[1]
    assert runs[0, 0].final["digest"] == runs[1, 0].final["digest"]  # DDP: the same weights on both nodes
    (config_path,) = run.folder.glob("lightning_logs/multi_node/version_*/config.yaml")
    trainer = yaml.safe_load(config_path.read_text())["trainer"]
    assert (trainer["num_nodes"], str(trainer["devices"]), trainer["accelerator"]) == (2, "1", "cpu")
    assert trainer["strategy"]["init_args"]["comm_hook"] == "powersgd"
    checkpoints = run.folder / "checkpoints" / "multi_node"
    last = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == STEPS and not list(checkpoints.glob("*.partial"))


def test_packaged_script_trains_and_resumes_bit_for_bit_after_every_stop_slurm_delivers(
    cluster: SlurmCluster, tmp_path: Path, node_restored: None
) -> None:
    """The uninterrupted job (``check_uninterrupted``), and one job in ``low_grace`` (GraceTime 5 s), checkpoints
    every 2 steps:

    - run 0, SIGUSR1 (the time-limit warning): every rank saves the step in progress, rank 0 requeues the job;
    - run 1, a ``high`` job preempts it: SIGTERM to the tasks, and SLURM would requeue the job only when the grace
      ends, but a job that exits within its grace is finished instead: so after saving, rank 0 requeues it;
    - run 2, n1 lost: rank 0's next collective fails at once, srun waits for n1's task until SLURM marks n1 DOWN,
      then the script's last line names n1 and SLURM requeues the job; the next run resumes from the last periodic
      checkpoint (the steps since are trained again, and not in the final weights);
    - run 3, ``scancel``: both ranks save one complete checkpoint and exit 143 before SLURM's SIGKILL; the job ends
      CANCELLED, not requeued.
    """
    straight = tmp_path / "uninterrupted"
    straight_id = submit_training(cluster, straight, tiny_overrides(STEPS, straight / "samples"), "--partition=high")
    folder = tmp_path / "stopped"
    samples = folder / "samples"
    job_id = submit_training(cluster, folder, tiny_overrides(STEPS, samples, **SLOW), "--partition=low_grace")
    wait_for_step(cluster, job_id, samples, run=0, step=3)
    cluster.scancel(job_id, "USR1")
    uninterrupted = finish(cluster, straight_id, straight)
    check_uninterrupted(uninterrupted)

    train_two_steps_more(cluster, job_id, samples, run=1)
    high = cluster.submit("#!/bin/bash\ntrue\n", "--partition=high", "--nodes=1", "--exclusive")

    train_two_steps_more(cluster, job_id, samples, run=2)
    cluster.kill_node("n1")
    wait_for_output(cluster, job_id, "srun: error: n0: task 0: Exited with exit code 1\n")  # not 143: run 1's
    cluster.set_node_state("n1", "DOWN", reason="lost")
    wait_for_output(cluster, job_id, "train.sbatch: lost node")  # the run's last line, while n1 is still DOWN
    cluster.wait(job_id, ["PENDING"], restarts=3)
    cluster.revive_node("n1")

    train_two_steps_more(cluster, job_id, samples, run=3)
    cluster.scancel(job_id)
    job = finish(cluster, job_id, folder)

    text = output(job.job)
    assert (job.job.state, job.job.restarts) == ("CANCELLED", 3), text[-4000:]
    assert cluster.job(high).state == "COMPLETED"
    runs = text.split(RESTORED)  # each requeued run prints the line as it resumes
    assert len(runs) == 4, text[-4000:]
    first_steps = [job.runs[0, run].steps[0]["step"] for run in (1, 2, 3)]

    # Run 0: SIGUSR1, saved, requeued by rank 0; run 1 starts at the next step.
    usr1 = stopped_at(runs[0], "SIGUSR1")
    assert f"[rank 0] requeued SLURM job {job_id}: SIGUSR1 asks for it" in runs[0]
    assert first_steps[0] == usr1 + 1
    # Run 1: preempted in the grace time: SIGTERM, saved, requeued by rank 0; run 2 starts at the next step.
    preempted = stopped_at(runs[1], "SIGTERM")
    assert f"[rank 0] requeued SLURM job {job_id}: SLURM is preempting it (PreemptTime=" in runs[1]
    assert first_steps[1] == preempted + 1
    # Run 2: n1 lost; the survivor's line, then the script's last line names n1; run 3 resumes from the last checkpoint.
    assert "[rank 0] training stopped: a collective failed because another rank crashed or was killed" in runs[2]
    script_lines = [line for line in runs[2].splitlines() if line.startswith("train.sbatch:")]
    assert script_lines[-1] == (
        "train.sbatch: lost node n1 (SLURM marked it DOWN or not responding); training stopped (status 1). SLURM"
        " requeues the job, and the requeued run resumes from last.ckpt."
    )
    resumed_at = first_steps[2] - 1  # the newest complete checkpoint: run 1's stop, or a periodic one of run 2
    assert resumed_at == preempted or (resumed_at % 2 == 0 and preempted < resumed_at <= last_step(samples, 2))
    # Run 3: scancel; one complete checkpoint of the step both ranks stopped at, every task exits 143, no requeue.
    cancelled = stopped_at(runs[3], "SIGTERM")
    assert cancelled == last_step(samples, 3) and runs[3].count("stopped by SIGTERM") == 2
    for node, task in (("n0", 0), ("n1", 1)):
        assert f"srun: error: {node}: task {task}: Exited with exit code 143" in runs[3]
    assert "requeued SLURM job" not in runs[3]
    checkpoints = folder / "checkpoints" / "multi_node"
    last = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=False)
    assert not list(checkpoints.glob("*.partial"))

    # Across the requeues: what each rank trained, step by step, is the uninterrupted run's (samples and weights), up
    # to the step scancel saved, whose checkpoint holds the uninterrupted weights of that step.
    reference = {rank: trained_history(uninterrupted.runs, rank)[0] for rank in (0, 1)}
    for rank in (0, 1):
        history, retrained = trained_history(job.runs, rank)
        assert history == reference[rank][:cancelled]
        assert retrained == job.runs[rank, 2].steps[-1]["step"] - resumed_at  # only the lost node's
    assert (last["global_step"], digest(last["state_dict"])) == (cancelled, reference[0][cancelled - 1][2])
    assert read_runs(samples).keys() == {(rank, run) for rank in (0, 1) for run in range(4)}
