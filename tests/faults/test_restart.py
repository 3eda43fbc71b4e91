"""``torchrun --max-restarts 1``: a rank SIGKILLed mid-run, the job restarts itself from ``last.ckpt`` and ends
with exactly the final loss (and weights) of an uninterrupted run.

Both runs are ``lightning-fastdist fit --config RECIPE --ckpt_path last`` under
torchrun with a c10d rendezvous on 2 CPU processes. The recipe checkpoints every
2 steps with ``save_last: true`` into a fixed folder; rank 1 kills itself after
step 7 (once: a marker file stops it from dying again after the restart), so the
restarted workers resume from step 6.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is part of the recipe: with torch's
default (workers share the rendezvous TCP store), the restarted workers read
the previous attempt's gloo addresses and fail to connect (measured on torch
2.13; pytorch/pytorch#135712 describes the same for NCCL).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.fault_runs import subprocess_environment, write_recipe
from tests.support.harness import cli_command, free_port

pytestmark = pytest.mark.multiprocess

MAX_STEPS, KILL_AFTER = 12, 7
DEADLINE_S = 240


def torchrun(recipe: Path, max_restarts: int, cwd: Path) -> subprocess.CompletedProcess:
    command = [
        str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--no-python",
        *cli_command("fit", "--config", str(recipe), "--ckpt_path", "last"),
    ]  # fmt: skip
    env = {**subprocess_environment(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=DEADLINE_S)


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]


@pytest.mark.slow
def test_a_killed_rank_restarts_from_the_last_checkpoint_and_finishes_like_an_uninterrupted_run(tmp_path):
    strategy = {"class_path": "lightning_fastdist.FastDDPStrategy", "init_args": {"timeout": 60}}
    straight = write_recipe(tmp_path / "straight", strategy, MAX_STEPS)
    started = time.monotonic()
    finished = torchrun(straight, max_restarts=0, cwd=tmp_path / "straight")
    straight_s = time.monotonic() - started
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]

    marker = tmp_path / "restarted" / "killed.txt"
    kill = {
        "class_path": "tests.support.faults.KillOnce",
        "init_args": {"at_step": KILL_AFTER, "rank": 1, "marker": str(marker)},
    }
    restarted = write_recipe(tmp_path / "restarted", strategy, MAX_STEPS, extra_callbacks=[kill])
    started = time.monotonic()
    recovered = torchrun(restarted, max_restarts=1, cwd=tmp_path / "restarted")
    print(f"uninterrupted {straight_s:.1f} s, killed and restarted {time.monotonic() - started:.1f} s")  # not asserted
    output = recovered.stdout + recovered.stderr
    assert recovered.returncode == 0, output[-4000:]
    assert marker.exists()  # rank 1 really died once
    assert "Restoring states from the checkpoint path" in output and "last.ckpt" in output

    expected = json.loads((tmp_path / "straight" / "final.json").read_text())
    got = json.loads((tmp_path / "restarted" / "final.json").read_text())
    assert got == expected and got["step"] == MAX_STEPS
    reference = final_weights(tmp_path / "straight")
    for name, weight in final_weights(tmp_path / "restarted").items():
        assert torch.equal(weight, reference[name]), name
