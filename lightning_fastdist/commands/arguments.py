"""The command-line pieces ``bench``, ``doctor`` and ``tune`` share, so that their flags mean the same in each."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence

from lightning_fastdist.diagnostics.environment import Environment, detect_environment
from lightning_fastdist.planning.memory_model import GiB
from lightning_fastdist.recipes.recipe import Recipe, RecipeError, RecipeNotFound

PASSTHROUGH_EPILOG = "Arguments after -- go to every `lightning-fastdist fit` run, e.g. -- --model.n_layer 2"


def positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An argparse ``type``: an integer >= 1, or a finite number > 0 (NaN and infinity are refused too)."""
    bound = "an integer >= 1" if kind is int else "a finite number > 0"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return value

    return parse


def check_steps(parser: argparse.ArgumentParser, steps: int, warmup_steps: int) -> None:
    """A measured run (bench's probe) needs its warm-up, timed steps, two steps that count host syncs and a last one."""
    if steps < warmup_steps + 4:
        parser.error(
            f"--steps: must be >= {warmup_steps + 4} (warm-up, timed steps, 2 sync-counting, 1 last), got {steps}"
        )


def split_passthrough(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(the command's own arguments, those after --)``."""
    if "--" in argv:
        index = list(argv).index("--")
        return list(argv[:index]), list(argv[index + 1 :])
    return list(argv), []


def read_recipe(parser: argparse.ArgumentParser, reference: str) -> Recipe:
    """The recipe ``--config`` names; a missing or malformed one is the parser's error (one line, exit 2)."""
    try:
        return Recipe.read(reference)
    except RecipeNotFound:
        parser.error(f"--config: recipe file {reference!r} not found")
    except RecipeError as error:
        parser.error(f"--config: {error}")


def setup_names(parser: argparse.ArgumentParser, text: str, known: Sequence[str]) -> list[str]:
    """The names in a ``--setups`` value, each one of ``known``; otherwise the parser's error."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        parser.error(f"--setups: unknown {', '.join(unknown) or '(empty)'}; known: {', '.join(known)}")
    return names


def device_memory(gpu_memory_gib: float | None, environment: Environment | None = None) -> int | None:
    """Bytes of one device to plan for: ``--gpu-memory`` GiB, else the smallest GPU of this machine (``environment``,
    detected when not given), else ``None``."""
    if gpu_memory_gib is not None:
        return int(gpu_memory_gib * GiB)
    return min((gpu.memory_bytes for gpu in (environment or detect_environment()).gpus), default=None)
