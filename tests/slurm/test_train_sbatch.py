"""Against real SLURM daemons: a Trainer that does not fit the allocation is refused in one line by the packaged
``train.sbatch`` before any rank waits for another, and ``doctor`` run inside an allocation reads it and judges a
recipe against it. (The script training and stopped: ``test_stops_under_slurm.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.slurm_cluster import SlurmCluster
from tests.support.slurm_training import VENV_BIN, output, submit_training
from tests.support.slurm_workload import cpu_sbatch_options, tiny_overrides

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]


def test_a_trainer_that_does_not_fit_the_allocation_is_refused_in_one_line_before_any_collective(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Two one-node jobs side by side (one per node): ``--trainer.devices 2`` under ``--ntasks-per-node=1`` with the
    recipe's DDP (Lightning's own check raises there, as a traceback), and ``--trainer.num_nodes 2`` on one node
    with FSDP2's strategy (Lightning checks nothing there: rank 0 would wait for a rank 1 that never starts).
    Each task exits 2 with one line naming both values; nothing trains."""
    devices = submit_training(
        cluster, tmp_path / "devices", [*tiny_overrides(2, tmp_path / "devices" / "samples"), "--trainer.devices", "2"],
        nodes=1,
    )  # fmt: skip
    fsdp = ["--trainer.strategy", "fast_fsdp", "--trainer.num_nodes", "2"]
    nodes = submit_training(
        cluster, tmp_path / "nodes", [*tiny_overrides(2, tmp_path / "nodes" / "samples"), *fsdp], nodes=1
    )
    expected = {
        devices: "trainer.devices is 2 but SLURM runs 1 task(s) per node (--ntasks-per-node); set --trainer.devices 1"
        " or sbatch --ntasks-per-node=2.",
        nodes: "trainer.num_nodes is 2 but SLURM allocated 1 node(s) (--nodes); set --trainer.num_nodes 1 or sbatch"
        " --nodes=2.",
    }
    for job_id, mismatch in expected.items():
        job = cluster.wait(job_id, timeout=120)
        text = output(job)
        assert (job.state, job.exit_code) == ("FAILED", 2), text
        errors = [line for line in text.splitlines() if "error" in line.lower()]
        assert errors == [
            f"lightning-fastdist: error: [rank 0] the Trainer does not fit SLURM job {job_id}: {mismatch}",
            "srun: error: n0: task 0: Exited with exit code 2" if job.nodes == "n0" else
            "srun: error: n1: task 0: Exited with exit code 2",
        ], text  # fmt: skip
        assert "Traceback" not in text
        assert not list((tmp_path / ("devices" if job_id == devices else "nodes")).glob("samples/*.jsonl"))


DOCTOR = """#!/bin/bash
set -e
{bin}/lightning-fastdist doctor --config multi_node --output {folder}/doctor-recipe.yaml
"""


def test_doctor_inside_an_allocation_reads_it_and_says_where_the_recipe_does_not_fit(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """``doctor --config multi_node`` in the batch script of a 2-node x 1-task CPU allocation: the allocation as
    SLURM gave it, the recipe's loader workers and GPU accelerator against it, and a plan for those 2 nodes."""
    script = DOCTOR.format(bin=VENV_BIN, folder=tmp_path)
    job = cluster.wait(cluster.submit(script, *cpu_sbatch_options(), cwd=tmp_path), timeout=120)
    text = output(job)
    assert (job.state, job.exit_code) == ("COMPLETED", 0), text
    assert (
        f"  SLURM job {job.job_id}, partition low: 2 node(s) (n[0-1]) x 1 task(s) per node, 1 CPU(s) per task,"
        " GPUs per node: 0"
    ) in text
    assert "  recipe multi_node does not fit it:" in text
    assert (
        "    - data.num_workers is 4 loader process(es) per task but SLURM gives each task 1 CPU(s) (--cpus-per-task);"
        " submit with --cpus-per-task=5, or pass --data.num_workers 0"
    ) in text
    assert "    - the allocation has no GPUs: trainer.accelerator auto trains on CPU processes over gloo" in text
    assert "trainer.num_nodes" not in text and "trainer.devices is" not in text  # those fit
    assert "Recommendation for 2 x 1 cpu(s):" in text
