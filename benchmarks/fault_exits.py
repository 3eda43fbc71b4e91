"""The faults other than a signal, each on the real command: exit status, time to exit and the line a user reads.

Each case runs ``lightning-fastdist fit`` on 2 CPU processes (gloo) launched as
torchrun would, with the TinyGPT recipe of ``preemption.py``:

- a rank killed (SIGKILL) mid-run: how long the surviving rank takes to exit;
- a second job started on the port of a running one: how long its ranks take to
  refuse, and whether the first job keeps training;
- a truncated checkpoint given to ``--ckpt_path``: time to the one-line error;
- a truncated ``last.ckpt`` with ``--ckpt_path last``: the fallback and its run.

    python benchmarks/fault_exits.py

Times for the errors count from the start of the command (imports included);
for the kill and the second job, from the fault.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from pathlib import Path

from preemption import free_port, launch, wait_all, wait_for_first_step, write_recipe

LONG_RUN_STEPS = 400


def telling_line(folder: Path, rank: int, words: tuple[str, ...]) -> str:
    """The first line of the rank's log holding one of ``words`` (the line the user reads)."""
    lines = (folder / f"rank{rank}.log").read_text().splitlines()
    return next((line.strip() for line in lines if any(word in line for word in words)), "(no such line)")


def report(fault: str, ends: list[tuple[int, float]], since: float, line: str) -> None:
    """Each rank's exit status (from :func:`wait_all`) and the time from ``since`` until the last one exited."""
    codes, last_exit = [code for code, _ in ends], max(at for _, at in ends)
    print(f"{fault}\n  exit {codes} after {last_exit - since:.2f} s\n  {line}", flush=True)


def killed_rank(root: Path) -> None:
    folder = root / "killed"
    folder.mkdir()
    processes = launch(["fit", "--config", str(write_recipe(folder, LONG_RUN_STEPS))], folder)
    wait_for_first_step(folder, processes)
    time.sleep(0.5)
    processes[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    # The killed rank exits at once, so the last exit is the survivor's.
    report("rank 1 SIGKILLed mid-run (survivor: rank 0)", wait_all(processes), killed_at,
           telling_line(folder, 0, ("training stopped",)))  # fmt: skip


def second_job(root: Path) -> None:
    first, second = root / "first", root / "second"
    first.mkdir()
    second.mkdir()
    port = free_port()
    job_a = launch(["fit", "--config", str(write_recipe(first, LONG_RUN_STEPS))], first, port, run_id="job-a")
    wait_for_first_step(first, job_a)
    started_at = time.monotonic()
    recipe_b = write_recipe(second, LONG_RUN_STEPS)
    ends = wait_all(launch(["fit", "--config", str(recipe_b)], second, port, run_id="job-b"))
    step_when_b_ended = int((first / "step.txt").read_text())
    time.sleep(2.0)
    a_kept_training = all(p.poll() is None for p in job_a) and int((first / "step.txt").read_text()) > step_when_b_ended
    for process in job_a:
        process.send_signal(signal.SIGTERM)
    wait_all(job_a)
    report("a second job on the port of a running one (job B)", ends, started_at,
           f"{telling_line(second, 0, ('cannot start',))}\n  {telling_line(second, 1, ('refusing to join',))}\n"
           f"  job A kept training: {a_kept_training}")  # fmt: skip


def truncated_checkpoints(root: Path) -> None:
    folder = root / "truncated"
    folder.mkdir()
    recipe = str(write_recipe(folder, 8))
    wait_all(launch(["fit", "--config", recipe], folder))
    last = folder / "checkpoints" / "last.ckpt"
    bad = folder / "bad.ckpt"
    shutil.copy(last, bad)
    for path in (bad, last):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    started_at = time.monotonic()
    ends = wait_all(launch(["fit", "--config", recipe, "--ckpt_path", str(bad)], folder))
    report("a truncated checkpoint given to --ckpt_path", ends, started_at, telling_line(folder, 0, ("bad.ckpt",)))

    (folder / "rank0.log").write_text("")
    started_at = time.monotonic()
    ends = wait_all(launch(["fit", "--config", recipe, "--ckpt_path", "last", "--trainer.max_steps", "12"], folder))
    report("a truncated last.ckpt with --ckpt_path last (resumes from the newest that loads, 4 more steps)",
           ends, started_at, telling_line(folder, 0, ("Resuming from",)))  # fmt: skip


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="fault-exits-") as directory:
        root = Path(directory)
        for case in (killed_rank, second_job, truncated_checkpoints):
            case(root)


if __name__ == "__main__":
    main()
