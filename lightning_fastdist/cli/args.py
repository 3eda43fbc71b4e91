"""What ``lightning-fastdist`` does to its arguments before LightningCLI parses them: ``--config`` values become
checked recipe files, a recipe's ``model``/``data`` init_args are kept from a class given later (jsonargparse would
carry them over), and a YAML file given as ``--ckpt_path`` is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import yaml

from lightning_fastdist.cli.errors import UsageError
from lightning_fastdist.recipes.recipe import Recipe, RecipeError

CONFIG_FLAGS = ("--config", "-c")
SUBCLASS_OPTIONS = ("model", "data")
YAML_SUFFIXES = (".yaml", ".yml")


def _options(argv: Sequence[str]) -> Iterator[tuple[int, str, str | None, int | None]]:
    """``(index, flag, value, value_index)`` of every ``--flag value`` / ``--flag=value`` (``value_index`` is
    ``None`` for the inline form)."""
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            continue
        flag, equals, inline = arg.partition("=")
        if equals:
            yield i, flag, inline, None
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            yield i, flag, argv[i + 1], i + 1
        else:
            yield i, flag, None, None  # no value: the parser reports it


def resolve_config_paths(argv: Sequence[str]) -> list[str]:
    """Replace each ``--config`` value by the file it names (a path or a packaged recipe) and check its YAML."""
    resolved = list(argv)
    for i, flag, value, slot in _options(argv):
        if flag not in CONFIG_FLAGS or value is None:
            continue
        try:
            recipe = Recipe.read(value)
        except RecipeError as error:
            raise UsageError(f"{flag}: {error}") from None
        if slot is None:
            resolved[i] = f"{flag}={recipe.path}"
        else:
            resolved[slot] = str(recipe.path)
    return resolved


def _class_path(value: object) -> str | None:
    """The class a ``model``/``data`` value names: a class path, or a mapping with ``class_path``."""
    if isinstance(value, dict):
        value = value.get("class_path")
    return value if isinstance(value, str) and value not in ("null", "None") else None


def drop_init_args_of_replaced_classes(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Keep a recipe's ``model``/``data`` init_args from reaching another class given after it, by inserting
    ``--data=null`` (or ``--model=null``) before the switch. ``argv`` must hold resolved ``--config`` paths.
    Returns the new arguments and one note per switch that dropped init_args."""
    result, notes = list(argv), []
    in_effect: dict[str, tuple[str, list[str]] | None] = {}  # option -> (class from a config, its init_args)
    inserted = 0
    for i, flag, value, _ in _options(argv):
        if value is None:
            continue
        if flag in CONFIG_FLAGS:
            config = Recipe.read(value).config
            for option in SUBCLASS_OPTIONS:
                section = config.get(option)
                if option in config:
                    arguments = section.get("init_args") if isinstance(section, dict) else None
                    in_effect[option] = (_class_path(section), sorted(arguments or {}))
            continue
        option = flag.removeprefix("--").removesuffix(".class_path")
        if option not in SUBCLASS_OPTIONS:
            continue
        try:
            new_class = _class_path(yaml.safe_load(value))
        except yaml.YAMLError:
            new_class = None  # the parser reports it
        previous = in_effect.get(option)
        in_effect[option] = None
        if previous is None or new_class is None or previous[0] is None or not previous[1]:
            continue
        old_class, arguments = previous
        # A full import path and its short name name one class.
        if old_class == new_class or old_class.endswith("." + new_class) or new_class.endswith("." + old_class):
            in_effect[option] = previous
            continue
        result.insert(i + inserted, f"--{option}=null")
        inserted += 1
        notes.append(
            f"--{option} {new_class}: the recipe's {option} init_args ({', '.join(arguments)}) were written for "
            f"{old_class} and are not applied; pass them as --{option}.NAME VALUE if {new_class} should get them."
        )
    return result, notes


def check_ckpt_path(argv: Sequence[str]) -> None:
    """Refuse a ``--ckpt_path`` that names a YAML file: a recipe given in the wrong place."""
    for _, flag, value, _ in _options(argv):
        if flag == "--ckpt_path" and value is not None and Path(value).suffix.lower() in YAML_SUFFIXES:
            raise UsageError(
                f"--ckpt_path: '{value}' is a YAML file, not a checkpoint. Give a checkpoint file or folder, "
                "or 'last' (the newest in the ModelCheckpoint folder); a recipe goes to --config."
            )
