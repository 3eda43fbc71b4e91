"""The packaged Ray script: ``lightning-fastdist`` run by every worker of a Ray Train ``TorchTrainer``.

    python -m lightning_fastdist.cli.ray_train --workers 2 fit --config cpu_smoke --trainer.max_steps 50

Ray's options come before the command, the command's after it, as ``lightning-fastdist`` takes them: any recipe, any
option that works elsewhere. The driver connects to the Ray cluster (``--address``; Ray's own default: the
``RAY_ADDRESS`` variable, else a cluster of this machine) and starts the workers; each runs the command in-process,
with Ray's ``RayLightningEnvironment`` added to the Trainer's plugins and, for ``fit``, ``RayReport`` to its callbacks,
resuming from the checkpoint Ray restored after a failure (``docs/ray.md``). Relative paths (a recipe's
``lightning_logs``, ``checkpoints/...``) are where the script was started, on machines that have that folder. The exit
status is the job's: 0, or 1 with Ray's error.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_fastdist.callbacks.ray_report import RayReport
from lightning_fastdist.cli.command import main as command_main

PROGRAM = "python -m lightning_fastdist.cli.ray_train"
RAY_ENVIRONMENT = "ray.train.lightning.RayLightningEnvironment"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description="Run a lightning-fastdist command in every worker of a Ray Train TorchTrainer.",
        epilog="Everything from the command on (fit, validate, test, predict) goes to lightning-fastdist.",
    )
    parser.add_argument("--workers", default="2", help="workers, or MIN:MAX for elastic sizing (default: 2)")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs each worker holds (default: 1)")
    parser.add_argument("--gpus-per-worker", type=float, default=0.0, help="GPUs each worker holds (default: 0)")
    parser.add_argument("--max-failures", type=int, default=3, help="restarts from the last checkpoint (default: 3)")
    parser.add_argument("--report-every", type=int, default=100, help="steps between checkpoints (default: 100)")
    parser.add_argument("--storage-path", help="where Ray keeps checkpoints: a folder every node sees, or s3://...")
    parser.add_argument("--name", help="the run's name in the storage path (default: Ray's)")
    parser.add_argument("--address", help="the Ray cluster (default: RAY_ADDRESS, else one on this machine)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="lightning-fastdist fit ... (or validate, ...)")
    return parser


def workers(value: str) -> int | tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` as Ray's ``ScalingConfig(num_workers=...)`` takes it."""
    low, _, high = value.partition(":")
    return (int(low), int(high)) if high else int(low)


def absolute_configs(command: Sequence[str]) -> list[str]:
    """``command`` with each ``--config`` that names a file here made absolute: Ray runs the workers in a folder of
    its own (a packaged recipe's name stays a name)."""
    args, after_config = [], False
    for arg in command:
        if after_config and Path(arg).is_file():
            arg = str(Path(arg).resolve())
        elif arg.startswith("--config=") and Path(arg.partition("=")[2]).is_file():
            arg = "--config=" + str(Path(arg.partition("=")[2]).resolve())
        args.append(arg)
        after_config = arg == "--config"
    return args


def worker_command(command: Sequence[str], report_every: int, restored: str | None) -> list[str]:
    """What a worker runs: ``command`` with Ray's environment plugin, and for ``fit`` RayReport and the checkpoint Ray
    restored (last, so it wins over a ``--ckpt_path`` of the command's)."""
    args = [*command, f"--trainer.plugins+={RAY_ENVIRONMENT}"]
    if command[0] == "fit":
        args += [
            "--trainer.callbacks+=lightning_fastdist.RayReport",
            f"--trainer.callbacks.every_n_train_steps={report_every}",
        ]
        if restored is not None:
            args.append(f"--ckpt_path={restored}")
    return args


def train_func(config: dict[str, Any]) -> None:
    """Each worker's part: the command in-process, in ``config["folder"]`` where this machine has it (the recipes'
    relative paths then land where the script was started; elsewhere in Ray's folder for the run); a failure is an
    exception (Ray ends a worker that exits). The worker's folder and environment are put back afterwards (a recipe's
    ``seed_everything`` sets ``PL_GLOBAL_SEED``, which seeds every later fit's sampler in the process)."""
    before, environment = os.getcwd(), dict(os.environ)
    if Path(config["folder"]).is_dir():
        os.chdir(config["folder"])
    try:
        command_main(worker_command(config["command"], config["report_every"], RayReport.latest()))
    except SystemExit as stopped:
        if stopped.code not in (0, None):
            raise RuntimeError(f"lightning-fastdist ended with status {stopped.code} (its lines say why)") from None
    finally:
        os.chdir(before)
        os.environ.clear()
        os.environ.update(environment)


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not args.command:
        parser().error("give the command to run: fit, validate, test or predict, and its arguments")
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address=args.address or os.environ.get("RAY_ADDRESS"))
    resources = {"CPU": args.cpus_per_worker, **({"GPU": args.gpus_per_worker} if args.gpus_per_worker else {})}
    trainer = TorchTrainer(
        train_func,
        train_loop_config={
            "command": absolute_configs(args.command),
            "report_every": args.report_every,
            "folder": os.getcwd(),
        },
        scaling_config=ScalingConfig(
            num_workers=workers(args.workers), use_gpu=args.gpus_per_worker > 0, resources_per_worker=resources
        ),
        run_config=RunConfig(
            name=args.name, storage_path=args.storage_path, failure_config=FailureConfig(max_failures=args.max_failures)
        ),
    )
    result = trainer.fit()
    if result.error is not None:
        print(f"{PROGRAM}: the run failed: {result.error}", file=sys.stderr)
        raise SystemExit(1)
    if result.checkpoint is not None:
        print(f"{PROGRAM}: the last checkpoint: {Path(result.checkpoint.path) / 'checkpoint.ckpt'}")


if __name__ == "__main__":
    main()
