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
import math
import re
import sys
from pathlib import Path
from typing import NoReturn

import torch

from lightning_fastdist.commands.arguments import device_memory, positive
from lightning_fastdist.commands.doctor import simulate as doctor_simulate
from lightning_fastdist.commands.written_marks import (
    first_line_starts_with,
    json_written_by,
    refusal,
    write_json,
    write_recipe,
)
from lightning_fastdist.diagnostics.environment import Environment, detect_environment
from lightning_fastdist.parallel.replica_groups.settings import ReplicaGroups
from lightning_fastdist.planning.advisor import HEADROOM, Recommendation, Target, build_recipe, recommend
from lightning_fastdist.planning.comm_model import estimate_comm
from lightning_fastdist.planning.memory_model import GiB, TrainingShape, estimate_table
from lightning_fastdist.planning.simulate import NotTraceable, RecipeRun, simulate
from lightning_fastdist.recipes import available_recipes
from lightning_fastdist.recipes.recipe import DEFAULT_DATA, DEFAULT_MODEL, Recipe, RecipeError, RecipeNotFound, build

PROG = "lightning-fastdist doctor"
DEMO_VOCAB = 256
SMALL_HEAD_WIDTH = 16
LARGE_HEAD_WIDTH = 64
LARGE_MODEL_WIDTH = 256
DEFAULT_SEQ_LEN = 128
DEFAULT_MICRO_BATCH = 16
DEFAULT_PARAMETERS = 836_352  # the demo TinyGPT's default size
CPU_PROCESSES = 2
_SIZE_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
# Names under which common models keep their shape in hyper-parameters.
_HPARAM_NAMES = {
    "layers": ("n_layer", "n_layers", "num_layers", "num_hidden_layers"),
    "hidden": ("n_embd", "hidden_size", "d_model", "dim"),
    "seq_len": ("block_size", "seq_len", "max_seq_len", "max_position_embeddings"),
    "vocab_size": ("vocab_size",),
}


class DoctorError(Exception):
    """A bad flag or recipe: reported as one line, exit status 2."""


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


def _demo_parameters(layers: int, hidden: int, seq_len: int) -> int:
    """TinyGPT's parameter count: 12 L h^2 + 13 L h per block, tied embedding/head, positions, final norm."""
    return 12 * layers * hidden**2 + (13 * layers + DEMO_VOCAB + seq_len + 2) * hidden


def demo_model_shape(
    parameters: int, seq_len: int, layers: int | None = None, hidden: int | None = None
) -> tuple[int, int, int]:
    """``(layers, hidden, heads)`` of a demo TinyGPT with about ``parameters`` parameters.

    Heads are 16 wide below 256 and 64 wide from there (GPT-2's head width); ``hidden`` is the
    multiple of the head width whose parameter count is closest to ``parameters``.
    """
    if layers is None:
        # GPT-like aspect ratio: hidden ~ 64 x layers, with 12 x layers x hidden^2 parameters in the blocks.
        layers = max(1, round((parameters / (12 * 64**2)) ** (1 / 3)))
    if hidden is None:
        a, b = 12 * layers, 13 * layers + DEMO_VOCAB + seq_len + 2
        width = (-b + math.sqrt(b * b + 4 * a * parameters)) / (2 * a)
        step = SMALL_HEAD_WIDTH if width < LARGE_MODEL_WIDTH else LARGE_HEAD_WIDTH
        candidates = {max(step, step * math.floor(width / step)), step * math.ceil(width / step)}
        hidden = min(candidates, key=lambda h: abs(_demo_parameters(layers, h, seq_len) - parameters))
    head_width = SMALL_HEAD_WIDTH if hidden < LARGE_MODEL_WIDTH or hidden % LARGE_HEAD_WIDTH else LARGE_HEAD_WIDTH
    return layers, hidden, max(1, hidden // head_width) if hidden % head_width == 0 else 1


def _read_recipe(reference: str) -> Recipe:
    try:
        return Recipe.read(reference)
    except RecipeNotFound:
        raise DoctorError(
            f"--config: recipe {reference!r} not found; give a YAML path or one of: {', '.join(available_recipes())}."
        ) from None


def _model_facts(model_section: dict) -> dict:
    """Parameters and shape of the recipe's model, built on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        model = build("model", model_section)
    facts = {"parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    hparams = dict(getattr(model, "hparams", {}) or {})
    for field, names in _HPARAM_NAMES.items():
        facts[field] = next((hparams[n] for n in names if isinstance(hparams.get(n), int)), None)
    return facts


def resolve_target(args: argparse.Namespace, environment: Environment, recipe: Recipe | None) -> Target:
    """The devices to plan for: flags first, then the recipe's, then this machine's GPUs, then its CPU."""
    nodes = args.nodes or (recipe.nodes if recipe is not None else None) or 1
    if args.gpus is not None or environment.gpus:
        devices = args.gpus or (recipe.devices if recipe is not None else None) or len(environment.gpus)
        memory = device_memory(args.gpu_memory, environment)
        if memory is None:
            raise DoctorError("--gpu-memory: needed with --gpus when no GPU is visible (GiB of one GPU, e.g. 80).")
        # planned GPUs (--gpus) are taken to have bf16 unless --no-bf16; this machine's must all have it
        bf16 = not args.no_bf16 and (args.gpus is not None or all(gpu.bf16 for gpu in environment.gpus))
        return Target("gpu", devices, memory, bf16, environment.cpu_cores, nodes)
    devices = min(CPU_PROCESSES, environment.cpu_cores)
    memory = (environment.host_memory_bytes or 8 * GiB) // devices
    return Target("cpu", devices, memory, environment.cpu_bf16_autocast, environment.cpu_cores, nodes)


def _gib(value: int | None) -> str:
    return "unknown" if value is None else f"{value / GiB:.2f} GiB"


def format_environment(env: Environment) -> str:
    lines = [
        "Environment",
        f"  torch {env.torch_version}, Lightning {env.lightning_version or 'not installed'}",
        f"  CUDA {env.cuda_version or 'none (CPU build)'}, NCCL {env.nccl_version or 'none'}",
        f"  GPUs: {len(env.gpus) or 'none'}",
    ]
    lines += [f"    {g.index}: {g.name}, {_gib(g.memory_bytes)}, bf16 {'yes' if g.bf16 else 'no'}" for g in env.gpus]
    nvlink = {True: "yes", False: "no", None: "unknown (no nvidia-smi)"}[env.nvlink]
    infiniband = "unknown" if env.infiniband_devices is None else (", ".join(env.infiniband_devices) or "none")
    lines += [
        f"  NVLink: {nvlink}; InfiniBand: {infiniband}",
        f"  CPU cores: {env.cpu_cores}; host memory: {_gib(env.host_memory_bytes)}; "
        f"CPU bf16 autocast: {'yes' if env.cpu_bf16_autocast else 'no'}",
        f"  torch.distributed backends: {', '.join(env.backends) or 'none'}",
    ]
    return "\n".join(lines)


def format_estimates(shape: TrainingShape, usable: int, accumulation: int) -> str:
    """The memory table, one row per configuration, with what each device sends per optimizer step."""
    lines = [
        f"Memory per device (N={shape.parameters:,} parameters, {shape.layers} layers x {shape.hidden} wide, "
        f"seq {shape.seq_len}, micro-batch {shape.micro_batch}, {shape.world_size} ranks, {shape.precision}; "
        f"usable {usable / GiB:.2f} GiB) and bytes each device sends per optimizer step "
        f"({accumulation} micro-batch(es), ring collectives); formulas in docs/doctor.md",
        f"  {'mode':8} {'checkpoint':10} {'offload':7} {'state':>10} {'gathered':>10} {'activations':>11} "
        f"{'total':>10}  fits {'sent/step':>10}",
    ]
    for e in estimate_table(shape):
        sent = estimate_comm(shape, e.mode, accumulation).sent_per_device
        lines.append(
            f"  {e.mode:8} {e.activation_checkpointing:10} {'yes' if e.cpu_offload else 'no':7} {e.state / GiB:9.3f}G "
            f"{e.gathered_weights / GiB:9.3f}G {e.activations / GiB:10.3f}G {e.total / GiB:9.3f}G  "
            f"{'yes' if e.total <= usable else 'NO':4} {sent / GiB:9.3f}G"
        )
    return "\n".join(lines)


# First words of every recipe doctor writes (then its arguments): the only files ``--output`` may replace.
HEADER_START = f"# Written by: {PROG}"


def check_ours(path: Path, json: bool) -> None:
    """Refuse an ``--output`` (``--json``) that is a folder or a file doctor did not write (it is never replaced)."""
    if json:
        mark = doctor_simulate.JSON_MARKER["written_by"]
        ours, writer, advice = (lambda p: json_written_by(p) == mark), "doctor --simulate", "give another --json path"
        problem = refusal("--json", path, "simulation.json", ours, writer, advice)
    else:
        ours, advice = (lambda p: first_line_starts_with(p, HEADER_START)), "give another --output or move that file"
        problem = refusal("--output", path, "doctor-recipe.yaml", ours, "doctor", advice)
    if problem:
        raise DoctorError(problem + ".")


def _recipe_comments(recommendation: Recommendation, target: Target, argv: list[str]) -> list[str]:
    return [
        " ".join([HEADER_START, *argv]),
        f"# For {target.nodes} node(s) x {target.devices} {target.accelerator}(s), "
        f"{target.device_memory_bytes / GiB:.1f} GiB each.",
        f"# Estimated peak per device: {recommendation.estimate.total / GiB:.3f} GiB"
        f" (usable {recommendation.usable_bytes / GiB:.2f} GiB){'' if recommendation.fits else ' -- DOES NOT FIT'}.",
        *(f"#   {reason}" for reason in recommendation.reasons),
    ]


def _plan(
    args: argparse.Namespace, environment: Environment
) -> tuple[TrainingShape, Target, dict, dict, Recipe | None]:
    recipe = None
    if args.config is not None:
        recipe = _read_recipe(args.config)
        model_section, data_section = recipe.section("model"), recipe.section("data")
        facts = _model_facts(model_section)
        parameters = args.params or facts["parameters"]
        layers, hidden = args.layers or facts["layers"], args.hidden or facts["hidden"]
        missing = [flag for flag, value in (("--layers", layers), ("--hidden", hidden)) if value is None]
        if missing:
            raise DoctorError(
                f"--config: the model's shape is not in its hyper-parameters; pass {' and '.join(missing)}."
            )
        seq_len = args.seq_len or data_section["init_args"].get("block_size") or facts["seq_len"] or DEFAULT_SEQ_LEN
        micro_batch = args.micro_batch or data_section["init_args"].get("batch_size") or DEFAULT_MICRO_BATCH
        vocab = args.vocab_size or facts["vocab_size"] or DEMO_VOCAB
    else:
        parameters = args.params or DEFAULT_PARAMETERS
        seq_len = args.seq_len or DEFAULT_SEQ_LEN
        micro_batch = args.micro_batch or DEFAULT_MICRO_BATCH
        layers, hidden, heads = demo_model_shape(parameters, seq_len, args.layers, args.hidden)
        vocab = args.vocab_size or DEMO_VOCAB
        model_section = {
            "class_path": DEFAULT_MODEL,
            "init_args": {"n_layer": layers, "n_embd": hidden, "n_head": heads, "block_size": seq_len},
        }
        data_section = {"class_path": DEFAULT_DATA, "init_args": {"block_size": seq_len}}
    shape = TrainingShape(parameters, layers, hidden, seq_len, micro_batch, vocab_size=vocab)
    return shape, resolve_target(args, environment, recipe), model_section, data_section, recipe


def _replica_groups_of(recipe: Recipe | None, nodes: int) -> ReplicaGroups | None:
    """The recipe's ``replica_groups`` option (the written recipe keeps it), checked against the ``nodes`` planned."""
    options = recipe.strategy_options.get("replica_groups") if recipe is not None else None
    if options is None:
        return None
    try:
        replica_groups = ReplicaGroups.of(options)
    except ValueError as error:
        raise DoctorError(f"--config: {error}") from None
    assert replica_groups is not None
    if nodes < 2:
        raise DoctorError(
            "--nodes: the recipe's replica_groups trains each node as a torchft replica group and needs 2 or more "
            "nodes: give --nodes 2 or more (or remove replica_groups from the recipe)."
        )
    if replica_groups.min_nodes > nodes:
        raise DoctorError(
            f"--nodes: the recipe's replica_groups.min_nodes={replica_groups.min_nodes} is more than the "
            f"{nodes} nodes planned for: give --nodes {replica_groups.min_nodes} or more."
        )
    return replica_groups


SIMULATED_GPU_MEMORY_GIB = 80.0  # planned for when --gpu-memory is not given and no GPU is visible


def _simulated_cluster(args: argparse.Namespace, recipe: Recipe, environment: Environment) -> tuple[int, int, int]:
    """``(world_size, gpus_per_node, memory_bytes)`` to simulate, from the flags, the recipe and this machine."""
    world_size = args.world_size or (args.gpus or recipe.devices or 0) * (args.nodes or recipe.nodes or 1)
    if not world_size:
        raise DoctorError("--world-size: needed with --simulate (ranks to plan for, e.g. 64).")
    gpus_per_node = min(args.gpus or recipe.devices or len(environment.gpus) or 8, world_size)
    if world_size % gpus_per_node:
        raise DoctorError(f"--world-size: {world_size} is not a multiple of --gpus {gpus_per_node} (GPUs per node).")
    memory = device_memory(args.gpu_memory, environment)
    if memory is None:
        print(f"No GPU visible and no --gpu-memory: fits is judged for {SIMULATED_GPU_MEMORY_GIB:.0f} GiB GPUs.")
        memory = int(SIMULATED_GPU_MEMORY_GIB * GiB)
    return world_size, gpus_per_node, memory


def run_simulation(args: argparse.Namespace, argv: list[str], environment: Environment) -> int | None:
    """``--simulate``: print the table, write the JSON and the recipe; ``None`` when the model cannot be traced."""
    if args.config is None:
        raise DoctorError("--simulate: needs --config RECIPE (the recipe whose model, data and step are traced).")
    json_path = Path(args.json) if args.json else None
    if json_path is not None:
        check_ours(json_path, json=True)
    recipe = _read_recipe(args.config)
    world_size, gpus_per_node, memory = _simulated_cluster(args, recipe, environment)
    _replica_groups_of(recipe, world_size // gpus_per_node)
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
    if args.simulate:
        status = run_simulation(args, argv, environment)
        if status is not None:
            return status
    elif args.world_size is not None or args.json is not None:
        raise DoctorError("--world-size and --json: only with --simulate.")
    shape, target, model_section, data_section, recipe = _plan(args, environment)
    replica_groups = _replica_groups_of(recipe, target.nodes)
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
    write_recipe(output, _recipe_comments(recommendation, target, argv), recipe)
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
