"""The ``lightning-fastdist`` command: LightningCLI with the demo workload as default.

``lightning-fastdist fit|validate|test|predict`` accept every LightningCLI
flag. Without ``--model``/``--data`` they train the demo
:class:`~lightning_fastdist.demo.TinyGPT` on
:class:`~lightning_fastdist.demo.TextDataModule`; any LightningModule or
LightningDataModule can be named instead (``--model my_pkg.MyModel``).
``--config`` also accepts the name of a packaged recipe (``cpu_smoke``);
``lightning-fastdist recipes`` lists them. Other subcommands
(:data:`EXTRA_COMMANDS`) live in :mod:`lightning_fastdist.commands`.

Mistakes (an unknown option, a missing or malformed recipe, a value a class
rejects) end the command with exit status 2 and one message on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

import torch.distributed
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from lightning_fastdist.cli_errors import UsageError, check_yaml_file, condense_parser_error
from lightning_fastdist.recipes import available_recipes, find_recipe

PROGRAM = "lightning-fastdist"
DEFAULT_MODEL = "lightning_fastdist.demo.TinyGPT"
DEFAULT_DATA = "lightning_fastdist.demo.TextDataModule"
CONFIG_FLAGS = ("--config", "-c")
# Subcommand -> module in lightning_fastdist.commands with main(argv) -> exit status.
EXTRA_COMMANDS = {"recipes": "recipes", "bench": "bench", "doctor": "doctor"}
TRAINER_COMMANDS = ("fit", "validate", "test", "predict")


class FastDistCLI(LightningCLI):
    """LightningCLI whose model and data default to the demo workload and whose errors are short."""

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # Raise instead of printing the full usage; main() prints one condensed line.
        return super().init_parser(exit_on_error=False, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}})

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as error:
            raise UsageError(condense_parser_error(str(error))) from None

    def instantiate_classes(self) -> None:
        # Constructor arguments are validated by the classes themselves: ours raise ValueError,
        # Lightning's Trainer also TypeError (``devices: two``) and MisconfigurationException.
        # Report those like parser errors rather than as a traceback.
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, MisconfigurationException) as error:
            raise UsageError(condense_parser_error(str(error))) from None


def _resolve_config_paths(argv: Sequence[str]) -> list[str]:
    """Replace each ``--config`` value by the file it names (a path or a packaged recipe) and check its YAML."""
    resolved = list(argv)
    for i, arg in enumerate(resolved):
        flag, _, inline_value = arg.partition("=")
        if flag not in CONFIG_FLAGS:
            continue
        if inline_value:
            value, slot = inline_value, None
        elif i + 1 < len(resolved):
            value, slot = resolved[i + 1], i + 1
        else:
            continue  # the parser itself reports a flag without a value
        recipe = find_recipe(value)
        if recipe is None:
            raise UsageError(
                f"{flag}: recipe file '{value}' not found. Give a path to a YAML file or one of the "
                f"packaged recipes: {', '.join(available_recipes())}."
            )
        check_yaml_file(flag, recipe)
        if slot is None:
            resolved[i] = f"{flag}={recipe}"
        else:
            resolved[slot] = str(recipe)
    return resolved


def _close_process_group(wait_for_peers: bool) -> None:
    """Close the process group Lightning leaves open after fit/validate/test/predict.

    A gloo group still alive at interpreter exit can abort the process ("terminate called
    without an active exception"), and so can one rank tearing its connections down while
    another is still using them: after a normal run, all ranks meet at a barrier first.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if wait_for_peers:
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command line.

    Args:
        argv: the arguments after the program name; ``None`` reads ``sys.argv``.
            (Lightning's process launcher re-runs ``sys.argv`` on the other
            ranks, so when reading it the resolved recipe paths are written back.)
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in EXTRA_COMMANDS:
        command = importlib.import_module(f"lightning_fastdist.commands.{EXTRA_COMMANDS[args[0]]}")
        raise SystemExit(command.main(args[1:]))
    try:
        if args and not args[0].startswith("-") and args[0] not in TRAINER_COMMANDS:
            raise UsageError(f"unknown command {args[0]!r}; choose from {', '.join([*TRAINER_COMMANDS, *EXTRA_COMMANDS])}.")
        args = _resolve_config_paths(args)
        if argv is None:
            sys.argv[1:] = args
        FastDistCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=None if argv is None else args,
            parser_kwargs={"prog": PROGRAM},
            save_config_kwargs={"overwrite": True},
        )
        _close_process_group(wait_for_peers=True)
    except UsageError as error:
        subcommand = args[0] if args and args[0] in TRAINER_COMMANDS else ""
        print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        print(f"Run '{PROGRAM} {subcommand} --help'.".replace("  ", " "), file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        _close_process_group(wait_for_peers=False)


if __name__ == "__main__":
    main()
