"""What ``outer_sync`` costs in quality: held-out loss at equal tokens against exact DDP, in the emulated cluster.

Each setup trains ``cpu_smoke`` (TinyGPT 0.84M) for ``--steps`` optimizer steps on 2 emulated nodes x 1 rank (an
unshaped link: the loss does not depend on the link rate, only the time does), every node reading its own share of
the corpus: the same tokens per step for every setup. Then one process evaluates each run's last checkpoint (the
global weights, for outer_sync) on the same ``--val-batches`` held-out batches. The last line is one JSON object:
per setup its held-out loss and its distance from exact DDP's. Needs root, ``ip`` and ``tc``.

    python benchmarks/outer_sync_quality.py                          # ddp, ddp-diloco, ddp-streaming-diloco
    python benchmarks/outer_sync_quality.py --steps 1000 --seed 7 --setups ddp ddp-streaming-diloco
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support.emulated_cluster

from lightning_fastdist.commands.bench.setups import all_setups  # noqa: E402
from tests.support.emulated_cluster import cannot_emulate  # noqa: E402

ENVIRONMENT = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
VAL_LOSS = re.compile(r"val_loss\s*│\s*([0-9.]+)")


def train(setup: str, steps: int, seed: int, ranks_per_node: int, folder: Path) -> None:
    """Train ``setup`` (a bench row) on 2 emulated nodes; its checkpoints land in ``folder/checkpoints``."""
    row = all_setups()[setup]
    strategy = json.dumps(row.strategy_config(world_size=2 * ranks_per_node))
    ranks = str(ranks_per_node)
    launcher = [sys.executable, "-m", "tests.support.emulated_cluster", "--nodes", "2", "--ranks-per-node", ranks, "--"]
    fit = [
        sys.executable, "-m", "lightning_fastdist.cli", "fit", "--config", "cpu_smoke", "--trainer.num_nodes", "2",
        "--trainer.devices", ranks, "--trainer.max_steps", str(steps), "--trainer.strategy", strategy,
        "--trainer.enable_progress_bar", "false", "--trainer.val_check_interval", str(steps),
        "--seed_everything", str(seed),
    ]  # fmt: skip
    log = folder / "fit.log"
    with open(log, "w") as output:
        code = subprocess.run(
            [*launcher, *fit], cwd=folder, env=ENVIRONMENT, stdout=output, stderr=subprocess.STDOUT
        ).returncode
    if code != 0:
        raise SystemExit(f"{setup}: training exited {code}; see {log}")


def held_out_loss(folder: Path, val_batches: int) -> float:
    """The validation loss of ``folder``'s last checkpoint on ``val_batches`` held-out batches, in one process."""
    checkpoint = folder / "checkpoints" / "cpu_smoke" / "last.ckpt"
    command = [
        sys.executable, "-m", "lightning_fastdist.cli", "validate", "--config", "cpu_smoke", "--trainer.devices", "1",
        "--trainer.strategy", "auto", "--trainer.limit_val_batches", str(val_batches), "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--ckpt_path", str(checkpoint),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=folder, capture_output=True, text=True)
    found = VAL_LOSS.findall(result.stdout)
    if result.returncode != 0 or not found:
        raise SystemExit(f"validating {checkpoint} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return float(found[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1234, help="seed_everything: initial weights and data order")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks of each node (16 samples a step each)")
    parser.add_argument("--val-batches", type=int, default=64, help="held-out batches of 16 x 128 tokens")
    parser.add_argument("--setups", nargs="+", default=["ddp", "ddp-diloco", "ddp-streaming-diloco"])
    args = parser.parse_args(argv)
    reason = cannot_emulate()
    if reason:
        print(f"cannot run the emulated cluster here: {reason}")
        return 2
    losses: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="outer-sync-quality-") as scratch:
        for setup in args.setups:
            folder = Path(scratch, setup)
            folder.mkdir()
            train(setup, args.steps, args.seed, args.ranks_per_node, folder)
            losses[setup] = held_out_loss(folder, args.val_batches)
            print(f"{setup:24} held-out loss after {args.steps} steps: {losses[setup]:.4f}", flush=True)
    exact = losses.get("ddp")
    result = {
        "steps": args.steps,
        "seed": args.seed,
        "ranks_per_node": args.ranks_per_node,
        "val_batches": args.val_batches,
        "held_out_loss": losses,
        "vs_ddp": {name: loss / exact - 1 for name, loss in losses.items()} if exact else None,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
