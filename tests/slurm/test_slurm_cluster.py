"""The SLURM cluster fixture itself: jobs span nodes, signals reach whom SLURM says they do, and a stopped cluster
leaves no process, folder or variable behind.

Each job here runs a bash batch script that logs the signals it gets, around ``srun`` of a Python task that logs
its own (one line per event, ``<who> restart=<SLURM_RESTART_COUNT> <event>``): the facts that tests of the package
under SLURM build on. The session's cluster (``conftest.py``) serves them. What SLURM does on a preemption is
measured with the package's own jobs (``test_stops_under_slurm.py``; ``docs/slurm.md``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests.support.slurm_cluster import SlurmCluster, slurm_available

WHY_NOT = slurm_available()
pytestmark = [pytest.mark.multiprocess, pytest.mark.slurm, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

# A task: logs its start and the signals it gets; exits 128 + 15 on SIGTERM.
TASK = """\
import os, signal, sys, time
log = open(sys.argv[1], "a", buffering=1)
rank, restart = os.environ["SLURM_PROCID"], os.environ.get("SLURM_RESTART_COUNT", "0")
def note(event):
    log.write(f"task{rank} restart={restart} {event}\\n")
def on_signal(signum, frame):
    note(signal.Signals(signum).name)
    if signum == signal.SIGTERM:
        sys.exit(128 + signum)
for signum in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(signum, on_signal)
note("start")
while True:
    time.sleep(0.05)
"""

# The batch script: logs its start and signals (a trap runs as soon as `wait` is interrupted), exits 143 on
# SIGTERM, and outlives srun until then: SIGTERM reaches the batch script and the tasks in no set order, so a
# script that ended with srun might be gone before its own SIGTERM came.
BATCH = """\
#!/bin/bash
note() {{ echo "batch restart=${{SLURM_RESTART_COUNT:-0}} $1" >> {log}; }}
trap 'note SIGTERM; exit 143' TERM
trap 'note SIGUSR1' USR1
note start
srun {python} {task} {log} &
while kill -0 $! 2>/dev/null; do wait $!; done
sleep 300 &
while kill -0 $! 2>/dev/null; do wait $!; done
"""


def probe_job(tmp_path: Path) -> tuple[str, Path]:
    """The batch script's text and the log its batch shell and tasks write."""
    task, log = tmp_path / "task.py", tmp_path / "signals.log"
    task.write_text(TASK)
    return BATCH.format(log=log, python=sys.executable, task=task), log


def wait_lines(log: Path, *lines: str, timeout: float = 30.0) -> list[str]:
    """Wait until ``log`` holds every one of ``lines``; return all its lines."""
    deadline = time.monotonic() + timeout
    while True:
        found = log.read_text().splitlines() if log.exists() else []
        if all(line in found for line in lines):
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"{log} lacks {[line for line in lines if line not in found]}; it holds {found}")
        time.sleep(0.05)


def test_two_node_job_runs_one_task_per_node(cluster: SlurmCluster) -> None:
    job_id = cluster.submit(
        "#!/bin/bash\nsrun bash -c 'echo node=$SLURM_NODEID rank=$SLURM_PROCID name=$SLURMD_NODENAME'\n",
        "--nodes=2",
        "--ntasks-per-node=1",
    )
    job = cluster.wait(job_id)
    assert (job.state, job.exit_code) == ("COMPLETED", 0)
    assert sorted(cluster.output(job_id).splitlines()) == ["node=0 rank=0 name=n0", "node=1 rank=1 name=n1"]


def test_scancel_signals_the_tasks_the_batch_script_or_both(cluster: SlurmCluster, tmp_path: Path) -> None:
    """``scancel --signal=USR1`` reaches the tasks only, ``--batch`` the batch script only; a plain ``scancel``
    sends SIGTERM to both (SIGKILL follows after KillWait)."""
    script, log = probe_job(tmp_path)
    job_id = cluster.submit(script, "--nodes=1", "--ntasks=1")
    wait_lines(log, "task0 restart=0 start")

    cluster.scancel(job_id, "USR1")
    wait_lines(log, "task0 restart=0 SIGUSR1")
    cluster.scancel(job_id, "USR1", batch=True)
    wait_lines(log, "batch restart=0 SIGUSR1")
    cluster.scancel(job_id)
    assert cluster.wait(job_id).state == "CANCELLED"

    lines = log.read_text().splitlines()
    assert lines.count("task0 restart=0 SIGUSR1") == 1
    assert lines.count("batch restart=0 SIGUSR1") == 1
    assert {"task0 restart=0 SIGTERM", "batch restart=0 SIGTERM"} <= set(lines)


def test_cluster_leaves_no_process_folder_or_variable_behind() -> None:
    """Leaving the block kills the daemons and a running job's steps, removes the state folder, and
    ``os.environ`` is as it was: every process of a cluster (daemons, slurmstepd, tasks) has its
    ``SLURM_CONF`` in its environment, which is how this test finds them."""
    environ = dict(os.environ)
    with SlurmCluster(nodes=1) as small:
        root = small.root
        small.submit("#!/bin/bash\nsrun sleep 300\n", "--nodes=1")
        deadline = time.monotonic() + 30
        while not any(b"sleep\x00300" in command for command in processes_mentioning(str(root)).values()):
            assert time.monotonic() < deadline, "the job's task did not start"
            time.sleep(0.05)
    assert not root.exists()
    assert processes_mentioning(str(root)) == {}
    assert dict(os.environ) == environ


def processes_mentioning(text: str) -> dict[int, bytes]:
    """The live processes whose command line or environment contains ``text``, and their command lines."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            command = (proc / "cmdline").read_bytes()
            if text.encode() in command or text.encode() in (proc / "environ").read_bytes():
                found[int(proc.name)] = command
        except OSError:
            continue
    return found


def test_a_state_folder_that_exists_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    users = tmp_path / "state"
    users.mkdir()
    (users / "notes.txt").write_text("the user's")
    cluster = SlurmCluster(users)
    with pytest.raises(FileExistsError):
        cluster.start()
    cluster.stop()  # nothing of ours to remove
    assert (users / "notes.txt").read_text() == "the user's"
