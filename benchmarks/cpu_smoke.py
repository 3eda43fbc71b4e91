"""Time the demo job: `lightning-fastdist fit --config cpu_smoke` on 2 CPU processes (gloo).

Prints wall time, first and last logged train loss, final validation loss and
tokens/s (from the progress bar's steady-state rate, so start-up is excluded;
the end-to-end rate including start-up is printed too).

    python benchmarks/cpu_smoke.py [extra CLI flags, e.g. --trainer.max_steps 100]
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from lightning_fastdist.recipes import find_recipe


def main(extra_args: list[str]) -> None:
    recipe = yaml.safe_load(find_recipe("cpu_smoke").read_text())
    with tempfile.TemporaryDirectory(prefix="cpu-smoke-bench-") as workdir:
        command = [
            str(Path(sys.executable).with_name("lightning-fastdist")),
            "fit",
            "--config",
            "cpu_smoke",
            *extra_args,
        ]
        started = time.perf_counter()
        result = subprocess.run(command, cwd=workdir, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if result.returncode != 0:
            sys.exit(result.stderr[-4000:])
        log_dir = next(Path(workdir, "lightning_logs", "cpu_smoke").glob("version_*"))
        config = yaml.safe_load((log_dir / "config.yaml").read_text())
        with open(log_dir / "metrics.csv") as handle:
            rows = list(csv.DictReader(handle))
    train = [(int(r["step"]), float(r["train_loss"])) for r in rows if r["train_loss"]]
    val = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    steps = config["trainer"]["max_steps"]
    world = config["trainer"]["devices"] * config["trainer"]["num_nodes"]
    data = config["data"]["init_args"]
    tokens_per_step = data["batch_size"] * data["block_size"] * world
    rates = re.findall(r"(\d+\.\d+)it/s", result.stdout + result.stderr)
    steady_its = float(rates[-1]) if rates else float("nan")
    print(f"recipe            : cpu_smoke ({recipe['trainer']['strategy']}, {world} processes, {steps} steps)")
    print(f"wall time         : {wall:.1f} s (process start to exit)")
    print(
        f"train loss        : first logged {train[0][1]:.3f} (step {train[0][0]}), "
        f"last {train[-1][1]:.3f} (step {train[-1][0]})"
    )
    print(f"val loss          : {' -> '.join(f'{v:.3f}' for v in val)}")
    print(
        f"tokens/s steady   : {steady_its * tokens_per_step:,.0f} ({steady_its:.2f} steps/s x {tokens_per_step} tokens)"
    )
    print(f"tokens/s end2end  : {steps * tokens_per_step / wall:,.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
