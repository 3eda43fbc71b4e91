"""``lightning-fastdist bench``: train one model under several setups, side by side.

Each setup (DDP with and without compression or compile, FSDP2 ZeRO-2/3 with
and without activation checkpointing, DeepSpeed ZeRO-2/3 where it can run)
trains the same recipe for ``--steps`` steps in fresh processes, measured by
:class:`~lightning_fastdist.commands.bench_probe.BenchProbe`. The command
prints a table as rows finish, and writes ``bench.json`` and ``bench.png``
(tokens/s and peak memory per setup) into ``--output``, with each setup's log,
overlay recipe and resolved config; nothing else is written. Every setup trains
with :class:`~lightning_fastdist.SyncFreeLogging`, the stack our recipes use.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

from lightning_fastdist.commands.bench_setups import BenchSetup, all_setups
from lightning_fastdist.recipes import find_recipe

DEFAULT_SETUPS = "ddp,ddp-fp16,ddp-powersgd,fsdp-zero2,fsdp-zero3,fsdp-zero3-ac,deepspeed-zero2,deepspeed-zero3"
COLUMNS = (
    ("setup", 16, "{}"),
    ("step ms", 9, "{:.1f}"),
    ("tokens/s", 10, "{:,.0f}"),
    ("peak MiB", 9, "{:.0f}"),
    ("comm B/step", 12, "{:,.0f}"),
    ("syncs/step", 10, "{:.1f}"),
    ("loss", 7, "{:.3f}"),
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lightning-fastdist bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Arguments after -- go to every `lightning-fastdist fit` run, e.g. -- --model.n_layer 2",
    )
    parser.add_argument("--config", default="cpu_smoke", help="recipe to train (a path or a packaged name)")
    parser.add_argument("--setups", default=DEFAULT_SETUPS, help=f"comma-separated; known: {', '.join(all_setups())}")
    parser.add_argument("--steps", type=int, default=20, help="training steps per setup (>= 6)")
    parser.add_argument("--devices", default=None, help="processes per setup (default: the recipe's)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of ddp-compile")
    parser.add_argument("--output", default="bench_results", help="folder for bench.json, bench.png and logs")
    own, _, passthrough = _split_passthrough(argv)
    args = parser.parse_args(own)
    args.passthrough = passthrough
    known = all_setups(args.compile_backend)
    args.setup_list = [name.strip() for name in args.setups.split(",") if name.strip()]
    unknown = [name for name in args.setup_list if name not in known]
    if unknown or not args.setup_list:
        parser.error(f"--setups: unknown {', '.join(unknown) or '(empty)'}; known: {', '.join(known)}")
    if args.steps < 6:
        parser.error(f"--steps: must be >= 6 (2 warm-up, timed steps, 2 sync-counting, 1 last), got {args.steps}")
    if find_recipe(args.config) is None:
        parser.error(f"--config: recipe file {args.config!r} not found")
    return args


def _split_passthrough(argv: list[str]) -> tuple[list[str], str, list[str]]:
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], "--", argv[index + 1 :]
    return argv, "", []


def _overlay(setup: BenchSetup, probe_output: Path, run_folder: Path) -> dict:
    return {
        "trainer": {
            "strategy": setup.strategy_config(),
            "default_root_dir": str(run_folder),  # the resolved config goes here, not into the working directory
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "limit_val_batches": 0,
            "callbacks": [
                {"class_path": "lightning_fastdist.SyncFreeLogging"},
                {"class_path": "lightning_fastdist.commands.bench_probe.BenchProbe", "init_args": {"output": str(probe_output)}},
            ],
        }
    }


def run_setup(setup: BenchSetup, args: argparse.Namespace, output: Path) -> dict:
    """Train ``setup`` in fresh processes; return its measurements, or why it did not run."""
    if setup.needs:
        return {"setup": setup.name, "skipped": setup.needs}
    probe_output = output / f"{setup.name}.json"
    overlay = output / f"{setup.name}.yaml"
    overlay.write_text(yaml.safe_dump(_overlay(setup, probe_output, output / setup.name)))
    command = [
        sys.executable, "-m", "lightning_fastdist.cli", "fit", "--config", args.config, "--config", str(overlay),
        "--trainer.max_steps", str(args.steps),
    ]  # fmt: skip
    if args.devices:
        command += ["--trainer.devices", args.devices]
    command += args.passthrough
    log = output / f"{setup.name}.log"
    with open(log, "w") as handle:
        finished = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT)
    if finished.returncode != 0 or not probe_output.is_file():
        tail = log.read_text()[-1500:]
        return {"setup": setup.name, "failed": f"exit {finished.returncode}; see {log}", "log_tail": tail}
    return {"setup": setup.name, **json.loads(probe_output.read_text())}


def format_row(row: dict) -> str:
    if "skipped" in row or "failed" in row:
        return f"{row['setup']:<16} {'skipped: ' + row['skipped'] if 'skipped' in row else 'FAILED: ' + row['failed']}"
    values = (
        row["setup"],
        1000 * row["step_time_s"] if row["step_time_s"] else None,
        row["tokens_per_s"],
        row["peak_memory_bytes_max_rank"] / 2**20,
        row["comm_bytes_per_step"],
        row["host_syncs_per_step"],
        row["final_loss"],
    )
    cells = [
        (fmt.format(value) if value is not None else "n/a").rjust(width) if i else f"{value:<{width}}"
        for i, ((_, width, fmt), value) in enumerate(zip(COLUMNS, values))
    ]
    return " ".join(cells)


def header() -> str:
    return " ".join(name.rjust(width) if i else f"{name:<{width}}" for i, (name, width, _) in enumerate(COLUMNS))


def write_plot(rows: list[dict], path: Path) -> None:
    """Bar charts of tokens/s and peak memory per setup that ran."""
    import matplotlib  # noqa: PLC0415 - only bench needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    measured = [r for r in rows if "step_time_s" in r and r["tokens_per_s"]]
    names = [r["setup"] for r in measured]
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4))
    speed.barh(names, [r["tokens_per_s"] for r in measured], color="tab:blue")
    speed.set_xlabel("tokens / s (all ranks)")
    memory.barh(names, [r["peak_memory_bytes_max_rank"] / 2**20 for r in measured], color="tab:orange")
    memory.set_xlabel(f"peak MiB per rank ({measured[0]['peak_memory_kind'] if measured else ''})")
    for axis in (speed, memory):
        axis.invert_yaxis()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str]) -> int:
    """Run the comparison; exit status 1 if any setup that could run failed."""
    args = parse_args(argv)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    setups = all_setups(args.compile_backend)
    print(f"bench: {len(args.setup_list)} setups x {args.steps} steps of {args.config}; logs in {output}/", flush=True)
    print(header(), flush=True)
    rows = []
    for index, name in enumerate(args.setup_list, start=1):
        if sys.stdout.isatty():  # a progress note that the row then overwrites
            print(f"[{index}/{len(args.setup_list)}] {name} ...", end="\r", flush=True)
        row = run_setup(setups[name], args, output)
        rows.append(row)
        print(format_row(row), flush=True)
    (output / "bench.json").write_text(json.dumps(rows, indent=2))
    write_plot(rows, output / "bench.png")
    print(f"wrote {output / 'bench.json'} and {output / 'bench.png'}")
    return 1 if any("failed" in row for row in rows) else 0
