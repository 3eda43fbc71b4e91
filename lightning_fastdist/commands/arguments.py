"""What the command lines of ``bench``, ``doctor`` and ``tune`` share: the recipe ``--config`` names, the
comma-separated ``--setups``, and the arguments after ``--`` that go to every ``fit`` run."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lightning_fastdist.recipes.recipe import Recipe, RecipeError, RecipeNotFound

PASSTHROUGH_EPILOG = "Arguments after -- go to every `lightning-fastdist fit` run, e.g. -- --model.n_layer 2"


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
