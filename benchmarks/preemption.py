"""SIGTERM at random moments to rank 0, rank 1 or both of ``lightning-fastdist fit``: exit status, time to exit,
the checkpoint left behind, and whether the resumed run ends like an uninterrupted one.

Every run is the real command on 2 CPU processes (gloo), launched as torchrun
would (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` ...): TinyGPT (2 x 32), a
checkpoint every 4 steps with ``last.ckpt``, ``--trainer.max_steps`` steps.
Once rank 0 has written its first step, the script waits a random time and
sends SIGTERM to the chosen rank processes, then measures how long each rank
takes to exit. ``--ckpt_path last`` then finishes the run, and its final loss is
compared with an uninterrupted run's.

    python benchmarks/preemption.py [--runs 10] [--steps 150] [--seed 0]

Prints one line per run and a summary per target (rank 0 / rank 1 / both).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import yaml

TARGETS = {"rank 0": (0,), "rank 1": (1,), "both": (0, 1)}
DEADLINE_S = 180


class StepFile(L.Callback):
    """Rank 0 writes the global step after every batch (the ranks import this module by ``preemption.StepFile``)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            self.path.write_text(str(trainer.global_step))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_recipe(folder: Path, steps: int) -> Path:
    data = torch.randint(0, 256, (40_000,), generator=torch.Generator().manual_seed(0))
    (folder / "corpus.bin").write_bytes(bytes(data.tolist()))
    step_file = folder / "step.txt"
    recipe = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 2, "max_steps": steps, "deterministic": True, "logger": False,
            "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 0,
            "strategy": {"class_path": "lightning_fastdist.FastDDPStrategy", "init_args": {"timeout": 60}},
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"dirpath": str(folder / "checkpoints"), "every_n_train_steps": 4, "save_last": True}},
                {"class_path": "preemption.StepFile", "init_args": {"path": str(step_file)}},
            ],
        },
        "model": {"class_path": "lightning_fastdist.demo.TinyGPT",
                  "init_args": {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16, "dropout": 0.1}},
        "data": {"class_path": "lightning_fastdist.demo.TextDataModule",
                 "init_args": {"batch_size": 4, "block_size": 16, "corpus_path": str(folder / "corpus.bin")}},
    }  # fmt: skip
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def launch(args: list[str], folder: Path, port: int | None = None, run_id: str | None = None) -> list[subprocess.Popen]:
    """Both ranks of ``lightning-fastdist ARGS`` as torchrun starts them (on a free port unless given)."""
    port, script = port or free_port(), Path(sys.executable).with_name("lightning-fastdist")
    launcher = {"TORCHELASTIC_RUN_ID": run_id} if run_id else {}
    processes = []
    for rank in range(2):
        env = {**os.environ, **launcher, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}  # fmt: skip
        log = open(folder / f"rank{rank}.log", "a")  # noqa: SIM115 - closed with the process
        processes.append(
            subprocess.Popen([str(script), *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder)
        )
    return processes


def wait_for_first_step(folder: Path, processes: list[subprocess.Popen]) -> None:
    """Until rank 0 has written its first step (``StepFile``) or a rank has exited."""
    while not (folder / "step.txt").exists() and all(p.poll() is None for p in processes):
        time.sleep(0.01)


def wait_all(processes: list[subprocess.Popen]) -> list[tuple[int, float]]:
    """(exit status, time.monotonic() at exit) per process; kills whatever outlives the deadline."""
    ended: dict[int, tuple[int, float]] = {}
    deadline = time.monotonic() + DEADLINE_S
    while len(ended) < len(processes) and time.monotonic() < deadline:
        for index, process in enumerate(processes):
            if index not in ended and process.poll() is not None:
                ended[index] = (process.returncode, time.monotonic())
        time.sleep(0.01)
    for index, process in enumerate(processes):
        if index not in ended:
            process.kill()
            ended[index] = (-9, float("inf"))  # a hang
    return [ended[index] for index in range(len(processes))]


def last_checkpoint(folder: Path) -> dict:
    return torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


def final_state(folder: Path) -> tuple[int, dict[str, torch.Tensor]]:
    checkpoint = last_checkpoint(folder)
    return checkpoint["global_step"], checkpoint["state_dict"]


def same_state(a: tuple[int, dict], b: tuple[int, dict]) -> bool:
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def one_run(root: Path, name: str, ranks: tuple[int, ...], delay: float, steps: int) -> dict:
    folder = root / name
    folder.mkdir()
    recipe = write_recipe(folder, steps)
    processes = launch(["fit", "--config", str(recipe)], folder)
    wait_for_first_step(folder, processes)
    time.sleep(delay)
    signalled_at = time.monotonic()
    for rank in ranks:
        processes[rank].send_signal(signal.SIGTERM)
    ends = wait_all(processes)
    if not (folder / "checkpoints" / "last.ckpt").exists():
        kept = Path(tempfile.gettempdir()) / f"preemption-failure-{name}"
        shutil.copytree(folder, kept, dirs_exist_ok=True)
        return {"codes": [code for code, _ in ends], "exit_s": max(at for _, at in ends) - signalled_at,
                "saved_step": None, "resumed_ok": False, "final": None, "kept": str(kept)}  # fmt: skip
    saved_step = last_checkpoint(folder)["global_step"]
    resumed = wait_all(launch(["fit", "--config", str(recipe), "--ckpt_path", "last"], folder))
    return {
        "codes": [code for code, _ in ends], "exit_s": max(at for _, at in ends) - signalled_at,
        "saved_step": saved_step, "resumed_ok": all(code == 0 for code, _ in resumed), "final": final_state(folder),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="runs per target")
    parser.add_argument("--steps", type=int, default=150, help="steps of a run: enough that the signal lands mid-run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    generator = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="preemption-") as directory:
        root = Path(directory)
        straight_folder = root / "straight"
        straight_folder.mkdir()
        wait_all(launch(["fit", "--config", str(write_recipe(straight_folder, args.steps))], straight_folder))
        reference = final_state(straight_folder)
        summary: dict[str, list[dict]] = {target: [] for target in TARGETS}
        for index in range(args.runs):
            for target, ranks in TARGETS.items():
                delay = generator.uniform(0.0, 1.5)
                result = one_run(root, f"{target.replace(' ', '')}-{index}", ranks, delay, args.steps)
                final = result.pop("final")
                result["equal"] = final is not None and same_state(final, reference)
                summary[target].append(result)
                print(f"{target:7s} run {index}: signal after {delay:.2f} s -> exit {result['codes']} in "
                      f"{result['exit_s']:.2f} s, saved step {result['saved_step']}, resumed "
                      f"{'ok' if result['resumed_ok'] else 'FAILED'}, final state equal: {result['equal']}"
                      + (f" (no checkpoint; logs kept in {result['kept']})" if "kept" in result else ""),
                      flush=True)  # fmt: skip
        print("\ntarget   runs  exit 143  hangs  median / max s to exit  resumed equal")
        for target, results in summary.items():
            times = [r["exit_s"] for r in results]
            exited = sum(r["codes"] == [143, 143] for r in results)
            hangs = sum(t == float("inf") for t in times)
            equal = sum(r["equal"] and r["resumed_ok"] for r in results)
            print(f"{target:7s}  {len(results):4d}  {exited:8d}  {hangs:5d}  "
                  f"{statistics.median(times):6.2f} / {max(times):6.2f}"
                  f"          {equal}/{len(results)}")  # fmt: skip


if __name__ == "__main__":
    main()
