"""One setup trained in fresh processes, and its row: what bench runs for each row and ``tune`` for each trial.

A run is the recipe with an overlay recipe on top (the setup's strategy and precision, and the probe that measures,
written as ``SETUP.yaml`` into the output folder), given to ``lightning-fastdist fit`` (or to the hand-written loop)
in processes of its own, so that no run inherits another's state. The row is the probe's JSON (``SETUP.json``), or
why the setup did not run, with the run's log (``SETUP.log``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import yaml

from lightning_fastdist.commands.bench.setups import BenchSetup
from lightning_fastdist.commands.local_ranks import run_local_ranks
from lightning_fastdist.commands.stopping import end_session, start_session
from lightning_fastdist.recipes.recipe import MIXED_PRECISION_PLUGIN, deepspeed_precision


def world_size(args: argparse.Namespace) -> int | None:
    """Ranks per run: ``--devices`` x ``--nodes`` (each defaulting to the recipe's), or ``None``."""
    devices = args.devices or args.recipe.trainer.get("devices")
    try:
        return int(devices) * int(node_count(args))
    except (TypeError, ValueError):
        return None


def node_count(args: argparse.Namespace) -> object:
    """Nodes per run: ``--nodes``, else the recipe's ``trainer.num_nodes`` (as written there), else 1."""
    return args.nodes or args.recipe.trainer.get("num_nodes") or 1


def profiling(args: argparse.Namespace) -> bool:
    """Whether ``--profile`` was given (``tune`` measures through ``run_setup`` too, with no such flag)."""
    return getattr(args, "profile", False)


def precision_options(setup: BenchSetup, trainer: dict) -> dict:
    """The trainer options that give ``setup`` its precision (``setup.precision``) for the recipe's ``trainer``."""
    if setup.uses_deepspeed or setup.precision == "lightning":  # Lightning's (or DeepSpeed's) own mixed precision
        return deepspeed_precision(trainer)
    if setup.precision == "ours":
        options = deepspeed_precision(trainer)  # the recipe's plugins, ours removed, and its precision
        if options["precision"] != "32-true":
            plugin = {"class_path": MIXED_PRECISION_PLUGIN, "init_args": {"precision": options["precision"]}}
            options = {"plugins": [*options["plugins"], plugin], "precision": None}  # the plugin decides it
        return options
    return {}


def _overlay(setup: BenchSetup, probe_output: Path, run_folder: Path, args: argparse.Namespace) -> dict:
    if setup.runner == "hand-loop":
        return {"trainer": {"strategy": "auto", "devices": 1, "num_nodes": 1, "default_root_dir": str(run_folder),
                            "logger": False, "enable_checkpointing": False, "callbacks": []}}  # fmt: skip
    overlay = {
        "trainer": {
            "strategy": setup.strategy_config(world_size(args)),
            "default_root_dir": str(run_folder),  # the resolved config goes here, not into the working directory
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "limit_val_batches": 0,  # none during the timed steps: BenchProbe validates once, after the last step
            "callbacks": [
                {"class_path": "lightning_fastdist.SyncFreeLogging"},
                {
                    "class_path": "lightning_fastdist.commands.bench.probe.BenchProbe",
                    "init_args": {
                        "output": str(probe_output),
                        "warmup_steps": args.warmup_steps,
                        "profile": profiling(args),
                    },
                },
            ],
        }
    }
    overlay["trainer"].update(precision_options(setup, args.recipe.trainer))
    if setup.model_class is not None:
        overlay["model"] = {"class_path": setup.model_class}  # the recipe's init_args are kept
    return overlay


def _base_config(setup: BenchSetup, args: argparse.Namespace, output: Path) -> str:
    """The recipe a setup's overlay goes on: the recipe as given; for a ``bare`` row a copy whose strategy has no
    option (an overlay could not remove the recipe's: LightningCLI merges the ``init_args`` of one class); for the
    hand-written loop the recipe's file (it is read without the CLI's packaged names)."""
    if setup.bare:
        config = dict(args.recipe.config)
        config["trainer"] = {**args.recipe.trainer, "strategy": setup.strategy_config(world_size(args))}
        base = output / f"{setup.name}.recipe.yaml"
        base.write_text(yaml.safe_dump(config, sort_keys=False))
        return str(base)
    if setup.runner == "hand-loop" and args.recipe.path is not None:
        return str(args.recipe.path)
    return args.config


def _modified_ns(path: Path) -> int | None:
    """When ``path`` was last written (ns), or ``None`` when there is no such file."""
    return path.stat().st_mtime_ns if path.is_file() else None


def run_setup(
    setup: BenchSetup,
    args: argparse.Namespace,
    output: Path,
    steps: int | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float | None = None,
) -> dict:
    """Train ``setup`` in fresh processes for ``steps`` (default ``args.steps``), with ``extra_args`` given to
    ``fit``; return its measurements, or why it did not run. ``timeout_s`` (one process per run only: one device and
    no launcher) ends a run that outlasts it, with everything it started."""
    row = {"setup": setup.name, "engine": setup.engine}
    nodes = node_count(args)
    unavailable = setup.unavailable(args.recipe, world_size(args), nodes if isinstance(nodes, int) else 1)
    if unavailable:
        return {**row, "skipped": unavailable}
    probe_output = output / f"{setup.name}.json"
    earlier = _modified_ns(probe_output)  # an earlier run's numbers must not pass for this one's
    overlay = output / f"{setup.name}.yaml"
    overlay.write_text(yaml.safe_dump(_overlay(setup, probe_output, output / setup.name, args)))
    fit_arguments = [
        "--config", _base_config(setup, args, output), "--config", str(overlay),
        "--trainer.max_steps", str(steps or args.steps), *extra_args,
    ]  # fmt: skip
    if setup.runner == "hand-loop":
        command = [sys.executable, "-m", "lightning_fastdist.commands.bench.hand_loop", "--output", str(probe_output),
                   "--warmup-steps", str(args.warmup_steps), "--compile", json.dumps(setup.strategy_args["compile"]),
                   *(["--profile"] if profiling(args) else []), "--", *fit_arguments, *args.passthrough]  # fmt: skip
    else:
        command = [sys.executable, "-m", "lightning_fastdist.cli", "fit", *fit_arguments]
        if args.devices:
            command += ["--trainer.devices", args.devices]
        if args.nodes:
            command += ["--trainer.num_nodes", str(args.nodes)]
        command = [*shlex.split(args.launcher), *command, *args.passthrough]
    log = output / f"{setup.name}.log"
    with open(log, "w") as handle:
        returncode = _run_training(command, args, handle, timeout_s)
    if returncode is None:
        return {**row, "failed": f"cut after {timeout_s:.0f} s; see {log}", "log_tail": log.read_text()[-1500:]}
    if returncode != 0 or _modified_ns(probe_output) in (None, earlier):
        return {**row, "failed": f"exit {returncode}; see {log}", "log_tail": log.read_text()[-1500:]}
    return {**row, "exact": setup.exact, **json.loads(probe_output.read_text())}


def _run_training(command: list[str], args: argparse.Namespace, log: IO, timeout_s: float | None = None) -> int | None:
    """Run one setup's training; its exit status (``None``: cut at ``timeout_s``). Without a launcher, a one-node run's
    ranks start together; otherwise the launcher or Lightning starts them."""
    ranks = world_size(args)
    if not args.launcher and ranks and ranks > 1 and node_count(args) == 1:
        return run_local_ranks(command, ranks, log)
    # A session of its own, so that the loader workers and compile workers it starts end with it, whatever ends this
    # process's wait (the timeout, Ctrl-C, SIGTERM: commands/stopping.py).
    process = start_session(command, log)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        end_session(process)
