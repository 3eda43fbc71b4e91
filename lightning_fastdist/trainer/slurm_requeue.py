"""Which stops by a signal requeue a SLURM job, and the requeue itself (rank 0, after every rank saved).

SLURM requeues a job by itself when it requeues or preempts it without a grace time, and ends it when it is
cancelled or out of time: there the saved job just exits. Two stops are requeued here because SLURM would not:

- SIGUSR1, which ``--signal=USR1@N`` sends ahead of the time limit (and a preemption too, where the cluster sends
  the job's ``--signal`` instead of SIGTERM): Lightning's auto-requeue contract, ``scontrol requeue``;
- SIGTERM from a preemption in a partition with a ``GraceTime``: SLURM sends SIGTERM to the tasks when the grace
  starts and requeues the job when it ends, but a job that exits within the grace is finished, not requeued
  (measured on SLURM 22.05: FAILED with the tasks' 143). ``scontrol show job`` tells this SIGTERM from a
  ``scancel`` or a time limit: the job is still ``RUNNING`` and its ``PreemptTime`` is set.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from collections.abc import Mapping

log = logging.getLogger(__name__)

_FIELD = re.compile(r"(\S+?)=(\S*)")
_SCONTROL_TIMEOUT_S = 10


def slurm_job_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """The id ``scontrol`` knows this job by (``ARRAY_TASK`` form for an array task), or None outside SLURM."""
    array_job = environ.get("SLURM_ARRAY_JOB_ID")
    if array_job and environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{array_job}_{environ['SLURM_ARRAY_TASK_ID']}"
    return environ.get("SLURM_JOB_ID")


def job_fields(job: str) -> dict[str, str] | None:
    """``scontrol --oneliner show job JOB`` as ``{field: value}`` (values without spaces are enough here), or None
    when scontrol is missing or fails (one warning line says why)."""
    try:
        result = subprocess.run(
            ["scontrol", "--oneliner", "show", "job", job], capture_output=True, text=True,
            timeout=_SCONTROL_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warning(f"cannot ask SLURM about job {job} ({error}); it is not requeued by this process")
        return None
    if result.returncode != 0:
        log.warning(f"scontrol show job {job} failed ({result.stderr.strip()}); it is not requeued by this process")
        return None
    return job_fields_of(result.stdout)


def job_fields_of(text: str) -> dict[str, str]:
    """The ``field=value`` pairs of one ``scontrol --oneliner show job`` line."""
    return dict(_FIELD.findall(text))


def preempted_in_grace(fields: Mapping[str, str]) -> bool:
    """Whether SLURM is preempting the job and waits for its grace time to end (so it has not requeued it yet), and
    the job may be requeued."""
    return (
        fields.get("JobState") == "RUNNING"
        and fields.get("PreemptTime", "None") not in ("None", "Unknown", "")
        and fields.get("Requeue") == "1"
    )


def requeue_reason(signum: int, auto_requeue: bool, job: str) -> str | None:
    """Why this stop requeues the job (the words of the log line), or None when SLURM decides by itself.

    ``auto_requeue``: Lightning's ``SLURMEnvironment(auto_requeue=...)``; off, the job is never requeued here.
    SLURM is asked about the job (``scontrol show job``) only for SIGTERM.
    """
    if not auto_requeue:
        return None
    if signum == signal.SIGUSR1:
        return "SIGUSR1 asks for it (the job's --signal, ahead of its time limit or at a preemption)"
    if signum == signal.SIGTERM:
        fields = job_fields(job)
        if fields is not None and preempted_in_grace(fields):
            return (
                f"SLURM is preempting it (PreemptTime={fields['PreemptTime']}) and would not requeue a job that ends "
                "within its partition's GraceTime"
            )
    return None


def requeue(job: str, reason: str, rank: int) -> None:
    """``scontrol requeue JOB``, saying why in one line; a failure is one warning line (the job then ends)."""
    try:
        result = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=_SCONTROL_TIMEOUT_S, check=False
        )
        failure = result.stderr.strip() if result.returncode != 0 else None
    except (OSError, subprocess.TimeoutExpired) as error:
        failure = str(error)
    if failure is None:
        log.warning(f"[rank {rank}] requeued SLURM job {job}: {reason}; the requeued run resumes from last.ckpt.")
    else:
        log.warning(f"[rank {rank}] scontrol requeue {job} failed ({failure}): the job is not requeued.")
