"""A node lost under SLURM with ``replica_groups``: n1's slurmd, its slurmstepd and its rank SIGKILLed mid-run (a power
cut), on the packaged ``train.sbatch``: n0 trains on. (Without ``replica_groups`` the job stops and SLURM requeues
it: ``test_stops_under_slurm.py``.)

SLURM notices a silent node only after ``SlurmdTimeout`` (30 s here, 300 s by default) and then marks it DOWN; the
test marks it DOWN itself once the survivor has shown what it does, as a cluster's health check would, and starts
n1 again afterwards, so that the next test finds both nodes idle.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.slurm_cluster import SlurmCluster
from tests.support.slurm_training import (
    finish,
    output,
    submit_training,
    wait_for_output,
    wait_for_step,
)
from tests.support.slurm_workload import tiny_overrides

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess, pytest.mark.slow]

STEPS = 10


def test_with_replica_groups_n0_trains_on_alone_and_says_so_in_one_line(
    cluster: SlurmCluster, tmp_path: Path, node_restored: None
) -> None:
    """The same recipe with ``replica_groups: {min_nodes: 1}`` (exact DDP inside each node, every step across
    them), submitted with ``sbatch --no-kill`` so that SLURM keeps the job when a node fails. n1 is lost after step
    3: n0 says in one line that node 1 left and trains on alone to the last step, and SLURM's DOWN does not end
    the job."""
    samples = tmp_path / "samples"
    fault_tolerant = [
        "--trainer.strategy.init_args.comm_hook", "none",
        "--trainer.strategy.init_args.replica_groups", '{"min_nodes": 1}',
    ]  # fmt: skip
    release = tmp_path / "release"  # every rank holds after step 3 until n1 is gone: n0 cannot finish before
    workload = tiny_overrides(STEPS, samples, hold_at=3, release=release)
    job_id = submit_training(cluster, tmp_path, [*workload, *fault_tolerant], "--no-kill")
    wait_for_step(cluster, job_id, samples, run=0, step=3)
    cluster.kill_node("n1")
    release.touch()
    wait_for_output(cluster, job_id, "replica_groups: node1 left the job at step")
    cluster.set_node_state("n1", "DOWN", reason="lost")
    job = finish(cluster, job_id, tmp_path)

    text = output(job.job)
    assert (job.job.state, job.job.exit_code, job.job.restarts) == ("COMPLETED", 0, 0), text
    left = [line for line in text.splitlines() if "left the job" in line]
    assert len(left) == 1 and "1 of 2 nodes train on" in left[0], left
    trained = [line["step"] for line in job.runs[0, 0].steps]
    assert trained == list(range(1, STEPS + 1)) and job.runs[0, 0].final["final_step"] == STEPS
    assert job.runs[1, 0].steps[-1]["step"] == 3  # n1 trained until it was lost, while it held after step 3
