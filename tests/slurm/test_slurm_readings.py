"""How the package reads what SLURM says, on text SLURM 22.05 printed in this project's cluster (``tests/slurm``'s
other files run every flow against the daemons; these pin the readings one by one, in one process, no daemon):
the allocation from a task's variables, the mismatch lines, the fields ``scontrol show job`` gives during a
preemption's grace time and after ``scancel``, and ``doctor``'s verdict on a recipe that fits.
"""

from __future__ import annotations

from lightning_fastdist.commands.doctor.slurm import recipe_findings
from lightning_fastdist.diagnostics.slurm_allocation import SlurmAllocation, expand_counts, launch_mismatches
from lightning_fastdist.recipes.recipe import Recipe
from lightning_fastdist.trainer.slurm_requeue import job_fields_of, preempted_in_grace

# Task 1 of `sbatch --gpus-per-node=0 -N2 --ntasks-per-node=1 --cpus-per-task=1` running `srun` (the SLURM_* part).
TASK_ENVIRONMENT = {
    "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[0-1]", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_CPUS_PER_TASK": "1",
    "SLURM_GPUS_PER_NODE": "0", "SLURM_JOB_PARTITION": "low", "SLURM_NODEID": "1", "SLURM_PROCID": "1",
    "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[0-1]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}  # fmt: skip
# `scontrol --oneliner show job` (abridged) seen by a task on its SIGTERM: preempted in low_grace, then scancel.
IN_GRACE = (
    "JobId=1 JobName=batch.sh JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
    "ExitCode=0:0 PreemptEligibleTime=2026-12-06T00:57:18 PreemptTime=2026-12-06T00:57:22 SuspendTime=None "
    "Partition=low_grace NodeList=n[0-1]"
)
CANCELLED = IN_GRACE.replace("JobState=RUNNING", "JobState=COMPLETING").replace(
    "PreemptTime=2026-12-06T00:57:22", "PreemptTime=None"
)


def test_counts_and_the_allocation_of_a_task_are_read_as_slurm_wrote_them():
    assert expand_counts("8(x2),4") == (8, 8, 4) and expand_counts("1(x2)") == (1, 1) and expand_counts("x") == ()
    allocation = SlurmAllocation.from_environment(TASK_ENVIRONMENT)
    assert allocation == SlurmAllocation(
        job_id="1", node_list="n[0-1]", nodes=2, tasks=2, tasks_per_node=(1, 1), cpus_per_task=1, gpus_per_node=0,
        partition="low", step=True,
    )  # fmt: skip
    assert SlurmAllocation.from_environment({}) is None
    assert launch_mismatches(allocation, num_nodes=2, devices=1) == []
    uneven = SlurmAllocation.from_environment({**TASK_ENVIRONMENT, "SLURM_STEP_TASKS_PER_NODE": "2,1"})
    assert launch_mismatches(uneven, num_nodes=2, devices=2) == [
        "SLURM runs 2,1 tasks on its nodes, not the same number on each, and trainer.devices is 2 per node; submit "
        "with --ntasks-per-node=2"
    ]


def test_only_a_preemption_in_its_grace_time_asks_the_job_to_requeue_itself():
    assert preempted_in_grace(job_fields_of(IN_GRACE))
    assert not preempted_in_grace(job_fields_of(CANCELLED))  # scancel, scontrol requeue, a time limit
    assert not preempted_in_grace(job_fields_of(IN_GRACE.replace("Requeue=1", "Requeue=0")))  # --no-requeue


def test_doctor_finds_nothing_to_change_in_a_recipe_that_fits_the_allocation():
    recipe = Recipe({
        "trainer": {"accelerator": "cpu", "num_nodes": 2, "devices": 1},
        "data": {"class_path": "lightning_fastdist.demo.TextDataModule", "init_args": {"num_workers": 0}},
    })  # fmt: skip
    assert recipe_findings(SlurmAllocation.from_environment(TASK_ENVIRONMENT), recipe) == []
