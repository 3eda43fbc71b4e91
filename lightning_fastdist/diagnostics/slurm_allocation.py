"""The SLURM allocation this process runs in, read from SLURM's variables, and where a run's shape disagrees with it.

SLURM starts the processes (``srun``: one task per GPU), Lightning only reads their ranks: a Trainer whose
``num_nodes`` or ``devices`` differs from the allocation waits for ranks that never start (Lightning checks some
cases, and only under some strategies). :func:`launch_mismatches` says it before any rank waits for another;
``doctor`` prints :meth:`SlurmAllocation.describe` and the same comparison for a recipe.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

# SLURM's compressed count lists: "8(x2),4" is 8, 8, 4.
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


class LaunchMismatchError(ValueError):
    """The Trainer's nodes or processes per node are not the SLURM allocation's (raised before any collective)."""


def expand_counts(text: str) -> tuple[int, ...]:
    """``"8(x2),4"`` -> ``(8, 8, 4)`` (SLURM_TASKS_PER_NODE, SLURM_JOB_CPUS_PER_NODE); ``()`` if unreadable."""
    counts: list[int] = []
    for part in text.split(","):
        match = _COUNT.match(part.strip())
        if match is None:
            return ()
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return tuple(counts)


def _gpu_count(text: str | None) -> int | None:
    """``--gpus-per-node`` as SLURM exports it (``"8"``, ``"a100:8"``, ``"0"``), or None when not requested."""
    if not text:
        return None
    counts = [int(part.rsplit(":", 1)[-1]) for part in text.split(",") if part.rsplit(":", 1)[-1].isdigit()]
    return sum(counts) if counts else None


@dataclass(frozen=True)
class SlurmAllocation:
    """What SLURM gave the job (in a batch script or in one of its ``srun`` tasks).

    Attributes:
        tasks_per_node: tasks on each node, in node order (a step's when inside ``srun``, else the job's).
        cpus_per_task: ``--cpus-per-task``, or None when not requested (then SLURM gives one CPU per task).
        gpus_per_node: ``--gpus-per-node`` (0 included), or None when the job did not ask for GPUs that way.
        step: whether this process is a task of an ``srun`` step (else the batch script or ``salloc``'s shell).
    """

    job_id: str
    node_list: str
    nodes: int
    tasks: int
    tasks_per_node: tuple[int, ...]
    cpus_per_task: int | None
    gpus_per_node: int | None
    partition: str | None
    step: bool

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> SlurmAllocation | None:
        """The allocation SLURM's variables describe, or None outside SLURM (no ``SLURM_JOB_ID``)."""
        job_id = environ.get("SLURM_JOB_ID")
        if not job_id:
            return None
        step = "SLURM_STEP_ID" in environ

        def read(name: str) -> str | None:  # inside a step its own SLURM_STEP_* value first
            return (environ.get(f"SLURM_STEP_{name}") if step else None) or environ.get(f"SLURM_{name}")

        tasks_per_node = expand_counts(read("TASKS_PER_NODE") or "")
        nodes = int(read("NUM_NODES") or environ.get("SLURM_NNODES") or len(tasks_per_node) or 1)
        tasks = int(read("NUM_TASKS") or environ.get("SLURM_NTASKS") or sum(tasks_per_node) or nodes)
        cpus_per_task = environ.get("SLURM_CPUS_PER_TASK")
        return cls(
            job_id=job_id,
            node_list=read("NODELIST") or environ.get("SLURM_JOB_NODELIST", "?"),
            nodes=nodes,
            tasks=tasks,
            tasks_per_node=tasks_per_node or (tasks // nodes,) * nodes,
            cpus_per_task=int(cpus_per_task) if cpus_per_task and cpus_per_task.isdigit() else None,
            gpus_per_node=_gpu_count(environ.get("SLURM_GPUS_PER_NODE")),
            partition=environ.get("SLURM_JOB_PARTITION"),
            step=step,
        )

    @property
    def uniform_tasks_per_node(self) -> int | None:
        """Tasks per node when every node runs as many, else None."""
        return self.tasks_per_node[0] if len(set(self.tasks_per_node)) == 1 else None

    def describe_tasks_per_node(self) -> str:
        uniform = self.uniform_tasks_per_node
        return str(uniform) if uniform is not None else ",".join(map(str, self.tasks_per_node))

    def describe(self) -> str:
        """One line: job, nodes, tasks per node, CPUs per task, GPUs per node."""
        cpus = self.cpus_per_task if self.cpus_per_task is not None else "1 (not requested)"
        gpus = self.gpus_per_node if self.gpus_per_node is not None else "not requested with --gpus-per-node"
        partition = f", partition {self.partition}" if self.partition else ""
        return (
            f"SLURM job {self.job_id}{partition}: {self.nodes} node(s) ({self.node_list}) x "
            f"{self.describe_tasks_per_node()} task(s) per node, {cpus} CPU(s) per task, GPUs per node: {gpus}"
        )


def launch_mismatches(allocation: SlurmAllocation, num_nodes: int, devices: int) -> list[str]:
    """Each way a run of ``num_nodes`` x ``devices`` processes differs from ``allocation``, one phrase naming both
    values and the fix; empty when they agree."""
    found = []
    if num_nodes != allocation.nodes:
        found.append(
            f"trainer.num_nodes is {num_nodes} but SLURM allocated {allocation.nodes} node(s) (--nodes); "
            f"set --trainer.num_nodes {allocation.nodes} or sbatch --nodes={num_nodes}"
        )
    per_node = allocation.uniform_tasks_per_node
    if per_node is None:
        found.append(
            f"SLURM runs {allocation.describe_tasks_per_node()} tasks on its nodes, not the same number on each, "
            f"and trainer.devices is {devices} per node; submit with --ntasks-per-node={devices}"
        )
    elif per_node != devices:
        found.append(
            f"trainer.devices is {devices} but SLURM runs {per_node} task(s) per node (--ntasks-per-node); "
            f"set --trainer.devices {per_node} or sbatch --ntasks-per-node={devices}"
        )
    return found
