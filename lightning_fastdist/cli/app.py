"""``FastDistCLI``: the LightningCLI behind ``lightning-fastdist fit``/``validate``/``test``/``predict``.

Its model and data default to the demo workload; a mistake in the arguments, a recipe or a class's own checks
becomes a ``UsageError`` with one condensed line; the plain progress bar and model summary are kept whether or not
rich is installed; a damaged ``--ckpt_path`` gets the one-line reason it does not load.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelSummary, ProgressBar, TQDMProgressBar
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from lightning_fastdist.cli.errors import UsageError, raised_in_user_code
from lightning_fastdist.parallel.checkpoint.problems import UnusableCheckpointError, describe_unloadable
from lightning_fastdist.recipes.parser_errors import condense_parser_error
from lightning_fastdist.recipes.recipe import set_demo_defaults
from lightning_fastdist.strategies.checkpoint.fault_tolerance import is_last_checkpoint


class FastDistCLI(LightningCLI):
    """LightningCLI whose model and data default to the demo workload and whose errors are short."""

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # Raise instead of printing the full usage; main() prints one condensed line.
        return super().init_parser(exit_on_error=False, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        set_demo_defaults(parser)

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as error:
            raise UsageError(condense_parser_error(str(error))) from None

    def instantiate_classes(self) -> None:
        # The classes validate their own arguments (ValueError; the Trainer also TypeError for ``devices: two``
        # and MisconfigurationException): report those like parser errors, not as a traceback; a bug in the user's
        # own code keeps its traceback.
        try:
            super().instantiate_classes()
            check_names = getattr(self.trainer.strategy, "check_names", None)
            if check_names is not None:  # a misspelt block class is a recipe mistake too
                check_names(self.model)
        except (ValueError, TypeError, MisconfigurationException) as error:
            bug = raised_in_user_code(error)
            if bug is not None:
                raise bug from None  # a bug in the user's own code: its traceback names the line
            raise UsageError(condense_parser_error(str(error))) from None

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        # Lightning switches to Rich's progress bar and summary whenever rich is installed (transformers brings it),
        # so the output would depend on the environment: keep the plain ones unless the recipe chose its own.
        configured = config.get("callbacks") or []
        chosen = [*(configured if isinstance(configured, list) else [configured]), *callbacks]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in chosen):
            callbacks = [*callbacks, TQDMProgressBar()]
        if config.get("enable_model_summary") is not False and not any(isinstance(c, ModelSummary) for c in chosen):
            callbacks = [*callbacks, ModelSummary()]
        return super()._instantiate_trainer(config, callbacks)

    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads --ckpt_path for hyperparameters first: a damaged file gets the strategies' one-line
        # explanation, except a damaged last*.ckpt, which the strategy replaces by the newest one that loads.
        try:
            super()._parse_ckpt_path()
        except Exception as error:  # noqa: BLE001 - whatever torch.load raised, the file is the problem
            path = Path(self.config[self.config.subcommand].get("ckpt_path"))
            if not is_last_checkpoint(path):
                raise UnusableCheckpointError(describe_unloadable(path, error)) from None
