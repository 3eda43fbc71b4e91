"""Training runs of ``lightning-fastdist fit`` used by the fault-tolerance tests: a recipe on disk and a launcher
that lets every rank finish (or fail) on its own, so that a test can see how each one ended."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from tests.support.harness import cli_command, free_port, rank_environment

REPO = Path(__file__).resolve().parents[2]
BLOCK, BATCH = 16, 4


def write_corpus(path: Path, train_batches_per_rank: int = 8, world_size: int = 2) -> Path:
    """Random bytes holding ``train_batches_per_rank`` batches per rank in the training split (val_fraction=0.1)."""
    train_bytes = world_size * BATCH * train_batches_per_rank * BLOCK + 1
    data = torch.randint(0, 256, (int(train_bytes / 0.9) + 1,), generator=torch.Generator().manual_seed(0))
    path.write_bytes(bytes(data.tolist()))
    return path


def write_recipe(folder: Path, strategy: dict, max_steps: int, extra_callbacks: list[dict] = ()) -> Path:
    """A recipe for 2 CPU ranks: tiny GPT, checkpoints every 2 steps with ``last.ckpt`` in ``folder/checkpoints``."""
    folder.mkdir(parents=True, exist_ok=True)
    recipe = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 2, "strategy": strategy, "max_steps": max_steps, "deterministic": True,
            "logger": False, "enable_progress_bar": False, "enable_model_summary": False,
            "limit_val_batches": 0, "num_sanity_val_steps": 0,
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"dirpath": str(folder / "checkpoints"), "every_n_train_steps": 2, "save_last": True}},
                {
                    "class_path": "tests.support.faults.WriteFinalLoss",
                    "init_args": {"path": str(folder / "final.json")},
                },
                *extra_callbacks,
            ],
        },
        "model": {"class_path": "lightning_fastdist.demo.TinyGPT",
                  "init_args": {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": BLOCK, "warmup_steps": 2}},
        "data": {"class_path": "lightning_fastdist.demo.TextDataModule",
                 "init_args": {"batch_size": BATCH, "block_size": BLOCK,
                               "corpus_path": str(write_corpus(folder / "corpus.bin")), "val_fraction": 0.1}},
    }  # fmt: skip
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def subprocess_environment() -> dict[str, str]:
    """The environment for ranks that import ``tests.support.faults`` (the repository root on ``PYTHONPATH``)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


@dataclass
class RankEnd:
    """How one rank ended: exit status (negative: killed by that signal), output, whether we had to kill it,
    and when it ended (``time.time()``)."""

    returncode: int
    output: str
    killed_by_test: bool
    ended_at: float


def run_ranks(
    args: list[str],
    world_size: int,
    deadline_s: float,
    cwd: Path,
    wait_for: set[int] | None = None,
    signal_when: tuple[Path, int, int] | None = None,
) -> list[RankEnd]:
    """Start ``lightning-fastdist ARGS`` as ``world_size`` ranks and wait up to ``deadline_s`` for them to exit.

    Unlike :func:`tests.support.harness.run_command`, a failing rank does not cut the
    others' time short: the test sees whether they exit on their own. Once the
    ranks in ``wait_for`` (default: all) have exited, or at the deadline, the
    ranks still alive are killed and marked ``killed_by_test``. With
    ``signal_when=(file, step, rank)``, SIGTERM is sent to that rank's process once
    ``file`` holds a number >= ``step`` (as a scheduler would signal one process).
    """
    wait_for = set(range(world_size)) if wait_for is None else wait_for
    port = free_port()
    processes = []
    for rank in range(world_size):
        log = open(cwd / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed below
        env = {**subprocess_environment(), **rank_environment(rank, world_size, port)}
        processes.append((subprocess.Popen(cli_command(*args), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                           start_new_session=True), log))  # fmt: skip
    end, ended_at = time.monotonic() + deadline_s, {}
    while time.monotonic() < end and not wait_for <= ended_at.keys():
        if (
            signal_when is not None
            and signal_when[0].exists()
            and int(signal_when[0].read_text() or 0) >= signal_when[1]
        ):
            processes[signal_when[2]][0].send_signal(signal.SIGTERM)
            signal_when = None
        for rank, (process, _) in enumerate(processes):
            if rank not in ended_at and process.poll() is not None:
                ended_at[rank] = time.time()
        time.sleep(0.05)
    results = []
    for rank, (process, log) in enumerate(processes):
        killed = process.poll() is None
        if killed:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        log.seek(0)
        results.append(RankEnd(process.returncode, log.read(), killed, ended_at.get(rank, time.time())))
        log.close()
    return results


def saved_step(checkpoint: Path) -> int:
    """The global step a file, sharded (FSDP) or DeepSpeed checkpoint was saved at."""
    deepspeed = checkpoint / "checkpoint" / "mp_rank_00_model_states.pt"  # stages 1 and 2
    path = (deepspeed if deepspeed.exists() else checkpoint / "meta.pt") if checkpoint.is_dir() else checkpoint
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]
