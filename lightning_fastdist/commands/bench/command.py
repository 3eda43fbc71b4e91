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
import sys
from pathlib import Path

from lightning_fastdist.commands.arguments import (
    PASSTHROUGH_EPILOG,
    check_steps,
    positive,
    read_recipe,
    setup_names,
    split_passthrough,
)
from lightning_fastdist.commands.bench.plot import write_plot
from lightning_fastdist.commands.bench.rows import add_baseline_ratio, format_row, header, loss_spread
from lightning_fastdist.commands.bench.setup_run import run_setup
from lightning_fastdist.commands.bench.setups import all_setups, recipe_setup
from lightning_fastdist.commands.bench.step_profile import PROFILE_STEPS
from lightning_fastdist.commands.stopping import sigterm_ends_the_command
from lightning_fastdist.commands.written_marks import claim_folder, folder_refusal

DEFAULT_SETUPS = (
    "lightning-ddp,lightning-fsdp2,lightning-deepspeed,ddp,ddp-bf16,fsdp-zero2,fsdp-zero3,"
    "deepspeed-zero1,deepspeed-zero2,deepspeed-zero3"
)


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
    parser.add_argument(
        "--output",
        default="bench_results",
        help="folder for bench.json, bench.png and logs: new, empty, or one bench wrote (it is not written otherwise)",
    )
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
    refused = folder_refusal("--output", Path(args.output), "bench")  # its files are named after the setups
    if refused:
        parser.error(refused)
    return args


def main(argv: list[str]) -> int:
    """Run the comparison; exit status 1 if any setup that could run failed."""
    args = parse_args(argv)
    output = Path(args.output)
    claim_folder(output, "bench")
    with sigterm_ends_the_command():  # the setup training is ended with everything it started
        return _compare(args, output)


def _compare(args: argparse.Namespace, output: Path) -> int:
    """Train every setup, one after the other, printing each row as it finishes; write the JSON and the plot."""
    setups = {**all_setups(args.compile_backend), "recipe": recipe_setup(args.recipe)}
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
