"""``lightning-fastdist bench``: train one model under several setups, side by side.

Each setup (our DDP with and without compression or compile, FSDP2 ZeRO-2/3 with and without activation
checkpointing, DeepSpeed ZeRO-1/2/3 with and without offload, Lightning's own DDP, FSDP2 and DeepSpeed
strategies as baselines, our strategy with no option set, and a hand-written loop) trains the same recipe for --steps
steps in fresh processes, with SyncFreeLogging as our recipes do. The command prints a table as rows finish
(throughput also as a ratio to the engine's Lightning baseline, when that ran first, and MFU on a known GPU), then how
far apart the exact setups' final losses are, and writes bench.json and bench.png (tokens/s and peak memory per setup,
coloured by engine) into --output, with each setup's log, overlay recipe and resolved config; nothing else is
written.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import yaml

from lightning_fastdist.commands.arguments import (
    PASSTHROUGH_EPILOG,
    check_steps,
    positive,
    read_recipe,
    setup_names,
    split_passthrough,
)
from lightning_fastdist.commands.bench.setups import ENGINES, BenchSetup, all_setups, recipe_setup
from lightning_fastdist.commands.bench.step_profile import PROFILE_STEPS
from lightning_fastdist.commands.local_ranks import run_local_ranks
from lightning_fastdist.recipes.recipe import MIXED_PRECISION_PLUGIN, deepspeed_precision

DEFAULT_SETUPS = (
    "lightning-ddp,lightning-fsdp2,lightning-deepspeed,ddp,ddp-bf16,fsdp-zero2,fsdp-zero3,"
    "deepspeed-zero1,deepspeed-zero2,deepspeed-zero3"
)
COLUMNS = (
    ("setup", 23, "{}"),
    ("step ms", 9, "{:.1f}"),
    ("tokens/s", 10, "{:,.0f}"),
    ("MFU", 6, "{:.1%}"),
    ("vs Lightning", 12, "{:.2f}x"),
    ("peak MiB", 9, "{:.0f}"),
    ("comm B/step", 12, "{:,.0f}"),
    ("exposed ms", 10, "{:.1f}"),
    ("syncs/step", 10, "{:.1f}"),
    ("loss", 8, "{:.4f}"),
    ("held-out", 8, "{:.4f}"),
)
ENGINE_COLOURS = {"DDP": "tab:blue", "FSDP2": "tab:orange", "DeepSpeed": "tab:green"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lightning-fastdist bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=PASSTHROUGH_EPILOG,
    )
    parser.add_argument("--config", default="cpu_smoke", help="recipe to train (a path or a packaged name)")
    parser.add_argument(
        "--setups",
        default=DEFAULT_SETUPS,
        help=f"comma-separated; known: {', '.join(all_setups())}, and recipe (the recipe's own strategy)",
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps per setup (>= warm-up + 4)")
    parser.add_argument(
        "--warmup-steps",
        type=positive(int),
        default=2,
        help="steps left out of the timing (e.g. until comm_hook auto decided)",
    )
    parser.add_argument("--devices", default=None, help="processes per node per setup (default: the recipe's)")
    parser.add_argument(
        "--nodes", type=positive(int), default=None, help="nodes per setup (default: the recipe's num_nodes)"
    )
    parser.add_argument(
        "--launcher",
        default="",
        help="a command put before each setup's training that runs it across the nodes: once per node with "
        "NODE_RANK set (the emulated cluster's 'python -m tests.support.emulated_cluster ... --') or once per rank "
        "(SLURM's 'srun --ntasks-per-node=8' with --devices 8)",
    )
    parser.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of ddp-compile and hand-loop"
    )
    parser.add_argument("--output", default="bench_results", help="folder for bench.json, bench.png and logs")
    parser.add_argument(
        "--profile",
        action="store_true",
        help=f"record {PROFILE_STEPS} steps of each row with torch.profiler after its measurements: "
        "SETUP.trace.json.gz and SETUP.ops.txt in --output",
    )
    own, passthrough = split_passthrough(argv)
    args = parser.parse_args(own)
    args.passthrough = passthrough
    args.setup_list = setup_names(parser, args.setups, [*all_setups(args.compile_backend), "recipe"])
    check_steps(parser, args.steps, args.warmup_steps + (PROFILE_STEPS if args.profile else 0))
    args.recipe = read_recipe(parser, args.config)
    return args


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
    unavailable = setup.unavailable(args.recipe.config, world_size(args), nodes if isinstance(nodes, int) else 1)
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
    if timeout_s is None:
        return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    # A session of its own, so that the loader workers and compile workers it starts end with it.
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return None


def throughput(row: dict) -> float | None:
    """Tokens per second, or samples per second for a model that does not read tokens."""
    return (row["tokens_per_s"] or row["samples_per_s"]) if "step_time_s" in row else None


def add_baseline_ratio(row: dict, rows: list[dict], setup: BenchSetup) -> None:
    """Set ``vs_lightning``: the row's throughput over its engine's Lightning baseline's (``None``: none ran)."""
    baseline = row if setup.name == setup.baseline else next((r for r in rows if r["setup"] == setup.baseline), None)
    mine, theirs = throughput(row), throughput(baseline) if baseline else None
    row["vs_lightning"] = mine / theirs if mine and theirs else None


def loss_spread(rows: list[dict]) -> tuple[float, list[str]] | None:
    """Largest minus smallest final loss over the exact setups that ran (fp32 data parallelism computes
    the same thing, whatever the engine), and their names; ``None`` with fewer than two."""
    exact = [row for row in rows if row.get("exact") and row.get("final_loss") is not None]
    if len(exact) < 2:
        return None
    losses = [row["final_loss"] for row in exact]
    return max(losses) - min(losses), [row["setup"] for row in exact]


def format_row(row: dict) -> str:
    name_width = COLUMNS[0][1]
    if "skipped" in row or "failed" in row:
        reason = "skipped: " + row["skipped"] if "skipped" in row else "FAILED: " + row["failed"]
        return f"{row['setup']:<{name_width}} {reason}"
    values = (
        row["setup"],
        1000 * row["step_time_s"] if row["step_time_s"] else None,
        row["tokens_per_s"],
        row.get("mfu"),
        row.get("vs_lightning"),
        row["peak_memory_bytes_max_rank"] / 2**20,
        row["comm_bytes_per_step"],
        1000 * row["exposed_comm_s"] if row.get("exposed_comm_s") is not None else None,
        row["host_syncs_per_step"],
        row["final_loss"],
        row["held_out_loss"],
    )
    cells = [
        (fmt.format(value) if value is not None else "n/a").rjust(width) if i else f"{value:<{width}}"
        for i, ((_, width, fmt), value) in enumerate(zip(COLUMNS, values))
    ]
    return " ".join(cells)


def header() -> str:
    return " ".join(name.rjust(width) if i else f"{name:<{width}}" for i, (name, width, _) in enumerate(COLUMNS))


def write_plot(rows: list[dict], path: Path) -> None:
    """Bar charts of throughput and peak memory per setup that ran, coloured by engine; Lightning's own hatched."""
    import matplotlib  # noqa: PLC0415 - only bench needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    measured = [r for r in rows if throughput(r)]
    names = [r["setup"] for r in measured]
    colours = [ENGINE_COLOURS[r["engine"]] for r in measured]
    hatches = ["//" if r["setup"].startswith("lightning-") else "" for r in measured]
    unit = "tokens" if all(r["tokens_per_s"] for r in measured) else "samples"
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(12, 0.9 + 0.35 * max(len(measured), 4)))
    speed.barh(names, [throughput(r) for r in measured], color=colours, hatch=hatches, edgecolor="black")
    speed.set_xlabel(f"{unit} / s (all ranks)")
    peaks = [r["peak_memory_bytes_max_rank"] / 2**20 for r in measured]
    memory.barh(names, peaks, color=colours, hatch=hatches, edgecolor="black")
    memory.set_xlabel(f"peak MiB per rank ({measured[0]['peak_memory_kind'] if measured else ''})")
    for axis in (speed, memory):
        axis.invert_yaxis()
    legend = [Patch(facecolor=ENGINE_COLOURS[engine], edgecolor="black", label=engine) for engine in ENGINES]
    legend.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="Lightning's own strategy"))
    figure.legend(handles=legend, loc="lower center", ncol=len(legend), frameon=False)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str]) -> int:
    """Run the comparison; exit status 1 if any setup that could run failed."""
    args = parse_args(argv)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    setups = {**all_setups(args.compile_backend), "recipe": recipe_setup(args.recipe.config)}
    print(f"bench: {len(args.setup_list)} setups x {args.steps} steps of {args.config}; logs in {output}/", flush=True)
    print(header(), flush=True)
    rows: list[dict] = []
    for index, name in enumerate(args.setup_list, start=1):
        if sys.stdout.isatty():  # a progress note that the row then overwrites
            print(f"[{index}/{len(args.setup_list)}] {name} ...", end="\r", flush=True)
        row = run_setup(setups[name], args, output)
        add_baseline_ratio(row, rows, setups[name])
        rows.append(row)
        print(format_row(row), flush=True)
    spread = loss_spread(rows)
    if spread is not None:
        print(f"loss parity: the final losses of {', '.join(spread[1])} lie within {spread[0]:.2e} of each other")
    (output / "bench.json").write_text(json.dumps(rows, indent=2))
    write_plot(rows, output / "bench.png")
    print(f"wrote {output / 'bench.json'} and {output / 'bench.png'}")
    return 1 if any("failed" in row for row in rows) else 0
