"""What ``doctor`` plans for, from its flags, the recipe and this machine: the model and batch (the recipe's own
model built on the meta device, or the demo sized to ``--params``), the devices (flags, then the recipe's, then this
machine's GPUs, then its CPU), the world ``--simulate`` traces, and the recipe's ``replica_groups`` checked against
the nodes. What cannot be planned for is a :class:`DoctorError`, reported as one line.
"""

from __future__ import annotations

import argparse

import torch

from lightning_fastdist.commands.arguments import device_memory
from lightning_fastdist.commands.doctor.demo_model import (
    DEFAULT_PARAMETERS,
    DEMO_VOCAB,
    demo_model_shape,
    demo_sections,
)
from lightning_fastdist.diagnostics.environment import Environment
from lightning_fastdist.parallel.across_nodes.replica_groups.settings import ReplicaGroups
from lightning_fastdist.planning.advisor import Target
from lightning_fastdist.planning.memory_model import GiB, TrainingShape
from lightning_fastdist.recipes import available_recipes
from lightning_fastdist.recipes.recipe import Recipe, RecipeNotFound, build

DEFAULT_SEQ_LEN = 128
DEFAULT_MICRO_BATCH = 16
CPU_PROCESSES = 2
SIMULATED_GPU_MEMORY_GIB = 80.0  # planned for when --gpu-memory is not given and no GPU is visible
# Names under which common models keep their shape in hyper-parameters.
_HPARAM_NAMES = {
    "layers": ("n_layer", "n_layers", "num_layers", "num_hidden_layers"),
    "hidden": ("n_embd", "hidden_size", "d_model", "dim"),
    "seq_len": ("block_size", "seq_len", "max_seq_len", "max_position_embeddings"),
    "vocab_size": ("vocab_size",),
}


class DoctorError(Exception):
    """A bad flag or recipe: reported as one line, exit status 2."""


def read_recipe(reference: str) -> Recipe:
    """The recipe ``--config`` names (a path or a packaged name)."""
    try:
        return Recipe.read(reference)
    except RecipeNotFound:
        raise DoctorError(
            f"--config: recipe {reference!r} not found; give a YAML path or one of: {', '.join(available_recipes())}."
        ) from None


def model_facts(model_section: dict) -> dict:
    """Parameters and shape of the recipe's model, built on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        model = build("model", model_section)
    facts = {"parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    hparams = dict(getattr(model, "hparams", {}) or {})
    for field, names in _HPARAM_NAMES.items():
        facts[field] = next((hparams[n] for n in names if isinstance(hparams.get(n), int)), None)
    return facts


def what_to_plan(
    args: argparse.Namespace, environment: Environment
) -> tuple[TrainingShape, Target, dict, dict, Recipe | None]:
    """The model and batch (the recipe's, or the demo's sized to ``--params``), the devices, the ``model:`` and
    ``data:`` sections of the recipe to write, and the recipe read (``None`` without ``--config``)."""
    recipe = None
    if args.config is not None:
        recipe = read_recipe(args.config)
        model_section, data_section = recipe.section("model"), recipe.section("data")
        facts = model_facts(model_section)
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
        model_section, data_section = demo_sections(seq_len, layers, hidden, heads)
    shape = TrainingShape(parameters, layers, hidden, seq_len, micro_batch, vocab_size=vocab)
    return shape, resolve_target(args, environment, recipe), model_section, data_section, recipe


def resolve_target(args: argparse.Namespace, environment: Environment, recipe: Recipe | None) -> Target:
    """The devices to plan for: flags first, then the SLURM allocation's nodes (``train.sbatch`` runs any recipe on
    them), then the recipe's, then this machine's GPUs, then its CPU."""
    allocation_nodes = environment.slurm.nodes if environment.slurm is not None else None
    nodes = args.nodes or allocation_nodes or (recipe.nodes if recipe is not None else None) or 1
    if args.gpus is not None or environment.gpus:
        devices = args.gpus or (recipe.devices if recipe is not None else None) or len(environment.gpus)
        memory = device_memory(args.gpu_memory, environment)
        if memory is None:
            raise DoctorError("--gpu-memory: needed with --gpus when no GPU is visible (GiB of one GPU, e.g. 80).")
        # planned GPUs (--gpus) are taken to have bf16 unless --no-bf16; this machine's must all have it
        bf16 = not args.no_bf16 and (args.gpus is not None or all(gpu.bf16 for gpu in environment.gpus))
        return Target("gpu", devices, memory, bf16, environment.cpu_cores, nodes)
    allocation_tasks = environment.slurm.uniform_tasks_per_node if environment.slurm is not None else None
    devices = allocation_tasks or min(CPU_PROCESSES, environment.cpu_cores)
    memory = (environment.host_memory_bytes or 8 * GiB) // devices
    return Target("cpu", devices, memory, environment.cpu_bf16_autocast, environment.cpu_cores, nodes)


def simulated_cluster(args: argparse.Namespace, recipe: Recipe, environment: Environment) -> tuple[int, int, int]:
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


def replica_groups_of(recipe: Recipe | None, nodes: int) -> ReplicaGroups | None:
    """The recipe's ``replica_groups`` option (the written recipe keeps it), checked against the ``nodes`` planned."""
    options = recipe.strategy_options.get("replica_groups") if recipe is not None else None
    if options is None:
        return None
    try:
        replica_groups = ReplicaGroups.of(options)
    except ValueError as error:
        raise DoctorError(f"--config: {error}") from None
    assert replica_groups is not None
    try:
        replica_groups.check_nodes(nodes, "--nodes")
    except ValueError as error:
        raise DoctorError(f"--nodes: the recipe's {error}") from None
    return replica_groups
