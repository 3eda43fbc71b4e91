"""Two jobs given the same MASTER_PORT: the second cannot join the first, and says why in one line each.

Job A (2 ranks, run id ``job-a``) trains and pauses after step 2 until job B
(2 ranks, run id ``job-b``, the same port) has come and gone. B's rank 0 cannot
listen on the port and says the port is in use; B's rank 1 reaches A's store,
finds A's run id there and refuses to join. A never notices: it finishes every
step and exits 0.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import lightning as L
import pytest

from lightning_fastdist.parallel.faults.job_identity import launch_run_id
from tests.support.fault_runs import subprocess_environment, write_recipe
from tests.support.harness import cli_command, free_port, rank_environment

MAX_STEPS = 6
DEADLINE_S = 150
PAUSE_AT_STEP = 2


class PauseUntilFile(L.Callback):
    """Every rank writes ``started`` after step ``PAUSE_AT_STEP`` and waits there until ``release`` exists."""

    def __init__(self, started: str, release: str) -> None:
        self.started, self.release = Path(started), Path(release)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step != PAUSE_AT_STEP:
            return
        self.started.write_text(str(trainer.global_step))
        while not self.release.exists():
            time.sleep(0.1)


def start_job(recipe: Path, port: int, run_id: str, folder: Path) -> list[subprocess.Popen]:
    """Two ranks of ``lightning-fastdist fit`` as torchrun would start them (run id in TORCHELASTIC_RUN_ID)."""
    ranks = []
    for rank in range(2):
        env = {**subprocess_environment(), **rank_environment(rank, 2, port), "TORCHELASTIC_RUN_ID": run_id}
        log = open(folder / f"rank{rank}.log", "w")  # noqa: SIM115 - the process owns it until it exits
        ranks.append(subprocess.Popen(cli_command("fit", "--config", str(recipe)), stdout=log, stderr=subprocess.STDOUT,
                                      env=env, cwd=folder, start_new_session=True))  # fmt: skip
    return ranks


def wait(processes: list[subprocess.Popen], deadline: float) -> list[int | None]:
    while time.monotonic() < deadline and any(process.poll() is None for process in processes):
        time.sleep(0.1)
    for process in processes:
        if process.poll() is None:
            process.kill()
    return [process.wait() if process.returncode is None else process.returncode for process in processes]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_second_job_on_the_same_port_cannot_join_the_first(tmp_path):
    port = free_port()
    strategy = {"class_path": "lightning_fastdist.FastDDPStrategy", "init_args": {"timeout": 60}}
    folders = {name: tmp_path / name for name in ("a", "b")}
    progress, release = folders["a"] / "paused.txt", folders["a"] / "release.txt"
    pause = {
        "class_path": "tests.faults.test_job_identity.PauseUntilFile",
        "init_args": {"started": str(progress), "release": str(release)},
    }
    recipe_a = write_recipe(folders["a"], strategy, MAX_STEPS, extra_callbacks=[pause])
    recipe_b = write_recipe(folders["b"], strategy, MAX_STEPS)
    deadline = time.monotonic() + DEADLINE_S

    job_a = start_job(recipe_a, port, "job-a", folders["a"])
    while not progress.exists() and time.monotonic() < deadline and all(p.poll() is None for p in job_a):
        time.sleep(0.1)
    assert progress.exists(), (folders["a"] / "rank0.log").read_text()[-3000:]
    job_b = start_job(recipe_b, port, "job-b", folders["b"])
    codes_b = wait(job_b, deadline)
    release.write_text("go on")
    codes_a = wait(job_a, deadline)

    logs_b = [(folders["b"] / f"rank{rank}.log").read_text() for rank in range(2)]
    assert codes_b == [1, 1], logs_b
    assert f"[rank 0] cannot start: port {port} (MASTER_PORT) is already in use" in logs_b[0], logs_b[0][-2000:]
    assert "[rank 1] refusing to join: the process group at" in logs_b[1], logs_b[1][-2000:]
    assert "TORCHELASTIC_RUN_ID=job-a" in logs_b[1] and "Traceback" not in logs_b[1]
    assert codes_a == [0, 0], (folders["a"] / "rank0.log").read_text()[-3000:]
    assert json.loads((folders["a"] / "final.json").read_text())["step"] == MAX_STEPS


def test_the_run_id_comes_from_the_launcher():
    assert (
        launch_run_id({"LIGHTNING_FASTDIST_RUN_ID": "abc", "TORCHELASTIC_RUN_ID": "x"})
        == "LIGHTNING_FASTDIST_RUN_ID=abc"
    )
    assert launch_run_id({"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun's default id names no launch
    assert launch_run_id({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "2"}) == "SLURM_JOB_ID=77.2"
    assert launch_run_id({}) is None
