"""``lightning-fastdist doctor``: report the machine, estimate memory per device, write a recipe that fits.

Examples::

    lightning-fastdist doctor                                     # this machine, the demo model
    lightning-fastdist doctor --config cpu_smoke                  # the model and batch of a recipe
    lightning-fastdist doctor --params 1.3B --seq-len 2048 --micro-batch 8 --gpus 8 --gpu-memory 80
    lightning-fastdist doctor --config my.yaml --simulate --world-size 64 --gpus 8 --gpu-memory 80 --json plan.json

The recipe it writes (``--output``) runs with ``lightning-fastdist fit --config PATH``.
Without ``--config`` the recipe's model is the demo TinyGPT sized to ``--params``:
replace its ``model:``/``data:`` sections with yours, keeping the trainer section.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import NoReturn

from lightning_fastdist.commands.arguments import positive
from lightning_fastdist.commands.doctor import simulate as doctor_simulate
from lightning_fastdist.commands.doctor.demo_model import DEMO_VOCAB
from lightning_fastdist.commands.doctor.output import HEADER_START, check_ours, recipe_comments
from lightning_fastdist.commands.doctor.plan_inputs import (
    DEFAULT_MICRO_BATCH,
    DEFAULT_SEQ_LEN,
    DoctorError,
    read_recipe,
    replica_groups_of,
    simulated_cluster,
    what_to_plan,
)
from lightning_fastdist.commands.doctor.report import format_environment, format_estimates
from lightning_fastdist.commands.doctor.slurm import format_allocation
from lightning_fastdist.commands.written_marks import write_json, write_recipe
from lightning_fastdist.diagnostics.environment import Environment, detect_environment
from lightning_fastdist.planning.advisor import HEADROOM, build_recipe, recommend
from lightning_fastdist.planning.memory_model import GiB
from lightning_fastdist.planning.simulation.recipe_run import NotTraceable, RecipeRun
from lightning_fastdist.planning.simulation.simulate import simulate
from lightning_fastdist.recipes.recipe import RecipeError

PROG = "lightning-fastdist doctor"
_SIZE_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise DoctorError(message)


def parse_parameter_count(text: str) -> int:
    """``"124M"``, ``"1.3B"``, ``"7e9"`` or ``"836352"`` -> an integer >= 1."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    count = int(float(match.group(1)) * _SIZE_SUFFIX[match.group(2).upper()]) if match else 0
    if count < 1:
        raise argparse.ArgumentTypeError(
            f"must be a parameter count >= 1 such as 836352, 124M, 1.3B or 7e9 (suffixes K, M, B, T), got {text!r}"
        )
    return count


def build_parser() -> _Parser:
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model (a recipe, or a size)")
    model.add_argument(
        "--config",
        metavar="RECIPE",
        help="a recipe YAML (path or packaged name): its model, batch and (for GPUs) device count",
    )
    model.add_argument("--params", type=parse_parameter_count, help="trainable parameters, e.g. 124M, 1.3B, 7e9")
    model.add_argument(
        "--layers", type=positive(int), help="transformer blocks (default: from the recipe or sized from --params)"
    )
    model.add_argument(
        "--hidden", type=positive(int), help="hidden width (default: from the recipe or sized from --params)"
    )
    model.add_argument(
        "--vocab-size", type=positive(int), help=f"output vocabulary (default: the recipe's, else {DEMO_VOCAB})"
    )
    model.add_argument(
        "--seq-len", type=positive(int), help=f"tokens per sample (default: the recipe's, else {DEFAULT_SEQ_LEN})"
    )
    model.add_argument(
        "--micro-batch",
        type=positive(int),
        help=f"samples per device per forward (default: the recipe's, else {DEFAULT_MICRO_BATCH})",
    )
    model.add_argument(
        "--global-batch",
        type=positive(int),
        help="samples per optimizer step over all devices (default: no accumulation)",
    )
    devices = parser.add_argument_group("devices (default: what this machine has)")
    devices.add_argument("--gpus", type=positive(int), help="GPUs per node to plan for")
    devices.add_argument("--nodes", type=positive(int), help="nodes (default: the recipe's, else 1)")
    devices.add_argument("--gpu-memory", type=positive(float), metavar="GIB", help="memory of one GPU in GiB")
    devices.add_argument("--no-bf16", action="store_true", help="the planned GPUs have no bfloat16 (V100, T4)")
    simulation = parser.add_argument_group("simulation (trace the recipe's own model and step; docs/doctor.md)")
    simulation.add_argument(
        "--simulate",
        action="store_true",
        help="trace one training step of the recipe's model as rank 0 of --world-size ranks (fake tensors, no memory)",
    )
    simulation.add_argument(
        "--world-size", type=positive(int), help="ranks to simulate (default: --gpus x --nodes, else the recipe's)"
    )
    simulation.add_argument("--json", metavar="PATH", help="also write the simulated numbers as JSON (bytes)")
    output = parser.add_argument_group("output")
    output.add_argument(
        "--output", default="doctor-recipe.yaml", help="where to write the recipe (default doctor-recipe.yaml)"
    )
    output.add_argument(
        "--max-steps", type=positive(int), default=300, help="trainer.max_steps in the recipe (default 300)"
    )
    return parser


def run_simulation(args: argparse.Namespace, argv: list[str], environment: Environment) -> int | None:
    """``--simulate``: print the table, write the JSON and the recipe; ``None`` when the model cannot be traced."""
    if args.config is None:
        raise DoctorError("--simulate: needs --config RECIPE (the recipe whose model, data and step are traced).")
    json_path = Path(args.json) if args.json else None
    if json_path is not None:
        check_ours(json_path, json=True)
    recipe = read_recipe(args.config)
    world_size, gpus_per_node, memory = simulated_cluster(args, recipe, environment)
    replica_groups_of(recipe, world_size // gpus_per_node)
    run = RecipeRun.of(recipe)
    try:
        simulation = simulate(run, world_size, gpus_per_node)
    except NotTraceable as error:
        print(f"\ndoctor --simulate: cannot trace the recipe ({error}); the formula estimate follows.")
        args.gpus, args.nodes, args.gpu_memory = gpus_per_node, world_size // gpus_per_node, memory / GiB
        return None
    usable = int(memory * (1 - HEADROOM))
    chosen, fits = doctor_simulate.choose(simulation, usable)
    print()
    print(doctor_simulate.format_simulation(simulation, run.precision, usable, memory))
    print(f"\nRecommendation for world {world_size}: {doctor_simulate.describe_setup_of(chosen)}")
    if not fits:
        print("  WARNING: no simulated setup fits; the recipe is the most frugal one.")
    if json_path is not None:
        write_json(json_path, doctor_simulate.simulation_json(simulation, usable, memory, chosen))
        print(f"Wrote {json_path}.")
    tailored = doctor_simulate.tailored_recipe(recipe, chosen, gpus_per_node, world_size // gpus_per_node)
    header = [" ".join([HEADER_START, *argv]), *doctor_simulate.recipe_comments(chosen, fits, usable, world_size)]
    output = Path(args.output)
    write_recipe(output, header, tailored)
    print(f"Wrote {output}. Run: lightning-fastdist fit --config {output}")
    return 0


def run(argv: list[str]) -> int:
    """Parse ``argv``, print the report and write the recipe; raises DoctorError or RecipeError on bad input."""
    args = build_parser().parse_args(argv)
    output = Path(args.output)
    check_ours(output, json=False)
    environment = detect_environment()
    print(format_environment(environment))
    if environment.slurm is not None:
        recipe = read_recipe(args.config) if args.config is not None else None
        print()
        print(format_allocation(environment.slurm, recipe, args.config))
    if args.simulate:
        status = run_simulation(args, argv, environment)
        if status is not None:
            return status
    elif args.world_size is not None or args.json is not None:
        raise DoctorError("--world-size and --json: only with --simulate.")
    shape, target, model_section, data_section, recipe = what_to_plan(args, environment)
    replica_groups = replica_groups_of(recipe, target.nodes)
    try:
        recommendation = recommend(shape, target, args.global_batch, replica_groups)
    except ValueError as error:
        raise DoctorError(f"--global-batch: {error}") from None
    print()
    print(format_estimates(recommendation.shape, recommendation.usable_bytes, recommendation.accumulate_grad_batches))
    print(f"\nRecommendation for {target.nodes} x {target.devices} {target.accelerator}(s):")
    for reason in recommendation.reasons:
        print(f"  - {reason}")
    if not recommendation.fits:
        print("  WARNING: the estimate does not fit; the recipe is the most frugal configuration.")
    recipe = build_recipe(recommendation, target, model_section, data_section, args.max_steps)
    write_recipe(output, recipe_comments(recommendation, target, argv), recipe)
    print(f"\nWrote {output}. Run: lightning-fastdist fit --config {output}")
    return 0


def main(argv: list[str]) -> int:
    """Entry point for ``lightning-fastdist doctor``: exit status 0, or 2 with one line on stderr for bad input."""
    try:
        return run(argv)
    except (DoctorError, RecipeError) as error:
        flag = "--config: " if isinstance(error, RecipeError) else ""
        print(f"{PROG}: error: {flag}{error}", file=sys.stderr)
        print(f"Run '{PROG} --help'.", file=sys.stderr)
        return 2
