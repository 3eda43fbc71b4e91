"""The packaged ``train.sbatch`` submitted to the test cluster, and what its runs left behind.

:func:`submit_training` submits the very file a user submits (``lightning_fastdist/recipes/slurm/train.sbatch``),
with the CPU sbatch options and the recipe shrunk by command-line arguments (:mod:`tests.support.slurm_workload`),
from the test's own folder: its ``checkpoints/`` and ``lightning_logs/`` land there. The job's environment is the
test's (sbatch's ``--export=ALL``) with the venv's ``lightning-fastdist`` first on ``PATH``, the repository on
``PYTHONPATH`` (for :class:`~tests.support.slurm_workload.SampleLog`) and a free ``MASTER_PORT``: Lightning's default
(15000 + the job id) would collide between two clusters of one test run, whose job ids both start at 1.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_fastdist.recipes import recipes_dir
from tests.support.fault_runs import subprocess_environment
from tests.support.harness import free_port
from tests.support.slurm_cluster import Job, SlurmCluster
from tests.support.slurm_workload import cpu_sbatch_options

TRAIN_SBATCH = recipes_dir() / "slurm" / "train.sbatch"
_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")  # states a requeued job never passes through
VENV_BIN = Path(sys.executable).parent


def training_environment() -> dict[str, str]:
    """What the job's environment adds to the test's: see the module's notes."""
    env = subprocess_environment()
    return {
        "PATH": f"{VENV_BIN}:{env.get('PATH', '')}",
        "PYTHONPATH": env["PYTHONPATH"],
        "MASTER_PORT": str(free_port()),
    }


def submit_training(
    cluster: SlurmCluster, folder: Path, fit_args: list[str], *sbatch_args: str, nodes: int = 2, tasks_per_node: int = 1
) -> int:
    """``sbatch [CPU options] [sbatch_args] train.sbatch [fit_args]`` from ``folder``; the job's output goes to
    ``folder/slurm-<job id>.out`` (appended to by each requeued run, as the script asks)."""
    folder.mkdir(parents=True, exist_ok=True)
    output = f"{folder}/slurm-%j.out"
    options = [*cpu_sbatch_options(nodes, tasks_per_node), f"--output={output}", f"--error={output}", *sbatch_args]
    return cluster.submit(TRAIN_SBATCH, *options, script_args=fit_args, env=training_environment(), cwd=folder)


@dataclass(frozen=True)
class Run:
    """What one rank recorded in one run of the job (``SLURM_RESTART_COUNT`` = ``run``)."""

    rank: int
    run: int
    steps: list[dict]  # {"step", "epoch", "samples", "digest", "time"} per trained batch, in order
    final: dict | None  # {"final_step", "digest"} when the run trained to the end


@dataclass(frozen=True)
class Finished:
    """A training job SLURM has finished: its folder (``checkpoints/``, ``lightning_logs/``, ``samples/``), the job
    as ``scontrol`` last showed it, and every rank's record of every run, by ``(rank, run)``."""

    folder: Path
    job: Job
    runs: dict[tuple[int, int], Run]


def finish(cluster: SlurmCluster, job_id: int, folder: Path, timeout: float = 180.0) -> Finished:
    """Wait until the job has finished; what it left in ``folder``."""
    job = cluster.wait(job_id, timeout=timeout)
    return Finished(folder, job, read_runs(folder / "samples"))


def read_runs(log_folder: Path) -> dict[tuple[int, int], Run]:
    """Every rank's record of every run, by ``(rank, run)``."""
    runs = {}
    for path in sorted(log_folder.glob("rank*.run*.jsonl")):
        rank, run = (int(part[4:] if part.startswith("rank") else part[3:]) for part in path.stem.split("."))
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        final = next((line for line in lines if "final_step" in line), None)
        runs[rank, run] = Run(rank, run, [line for line in lines if "step" in line], final)
    return runs


def trained_history(runs: dict[tuple[int, int], Run], rank: int) -> tuple[list[tuple[int, list[int], str]], int]:
    """What ``rank`` trained into its last weights, run after run, as ``(step, sample indices, weights' digest
    after the step)`` in order, and how many steps it trained that a later run trained again.

    A requeued run starts from the checkpoint it resumed (its first step minus one): the steps an earlier run
    trained after that checkpoint (a lost node's run, between its last checkpoint and the loss) are not in the
    final weights, and count as trained again. A stop by a signal saves the step it stopped at: nothing is trained
    again after it."""
    history: list[tuple[int, list[int], str]] = []
    retrained = 0
    for run in sorted(number for owner, number in runs if owner == rank):
        steps = runs[rank, run].steps
        if steps:
            resumed_at = steps[0]["step"] - 1
            retrained += sum(1 for step, _, _ in history if step > resumed_at)
            history = [entry for entry in history if entry[0] <= resumed_at]
        history += [(line["step"], line["samples"], line["digest"]) for line in steps]
    return history, retrained


def last_step(log_folder: Path, run: int) -> int:
    """The last step rank 0 trained in ``run`` so far (0 before its first)."""
    path = log_folder / f"rank0.run{run}.jsonl"
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines()] if path.exists() else []
    return max(steps, default=0)


def wait_for_step(
    cluster: SlurmCluster, job_id: int, log_folder: Path, run: int, step: int, timeout: float = 120.0
) -> None:
    """Wait until rank 0 of the job's run ``run`` has trained ``step``; fail early, with the job's output, once the
    job has ended for good (a requeued job passes through other states, never these)."""
    deadline = time.monotonic() + timeout
    while last_step(log_folder, run) < step:
        job = cluster.job(job_id)
        if job.state in _ENDED:
            raise AssertionError(f"job {job_id} is {job.state} before run {run} step {step}:\n{output(job)[-4000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run} of job {job_id} did not reach step {step}:\n{output(job)[-4000:]}")
        time.sleep(0.1)


def wait_for_output(cluster: SlurmCluster, job_id: int, text: str, timeout: float = 60.0) -> None:
    """Wait until the job's output holds ``text``."""
    deadline = time.monotonic() + timeout
    while text not in output(cluster.job(job_id)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id}'s output lacks {text!r}:\n{output(cluster.job(job_id))[-4000:]}")
        time.sleep(0.1)


def output(job: Job) -> str:
    """The job's output so far (its stdout and stderr, one file: every run's, appended)."""
    return job.stdout.read_text(errors="replace") if job.stdout and job.stdout.exists() else ""
