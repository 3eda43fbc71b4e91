"""One reader for a recipe: find it, load its YAML, read what the commands plan with, build its model and data.

``fit``'s checks, ``bench``, ``doctor`` and ``tune`` all read recipes here, so a recipe means the same to each; its
model and data are built as LightningCLI builds them, its precision named with Lightning's own aliases.
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
import pydoc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from lightning.fabric.connector import _PRECISION_INPUT_STR_ALIAS_CONVERSION
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser

from lightning_fastdist.recipes import available_recipes, find_recipe
from lightning_fastdist.recipes.parser_errors import condense_parser_error

DEFAULT_MODEL = "lightning_fastdist.demo.TinyGPT"
DEFAULT_DATA = "lightning_fastdist.demo.TextDataModule"
DEFAULT_CLASSES = {"model": DEFAULT_MODEL, "data": DEFAULT_DATA}
MIXED_PRECISION_PLUGIN = "lightning_fastdist.FastMixedPrecision"
# Our strategies by engine (the names bench shows).
STRATEGY_CLASSES = {
    "DDP": "lightning_fastdist.FastDDPStrategy",
    "FSDP2": "lightning_fastdist.FastFSDPStrategy",
    "DeepSpeed": "lightning_fastdist.FastDeepSpeedStrategy",
}
_BASE_CLASSES = {"model": LightningModule, "data": LightningDataModule}


class RecipeError(Exception):
    """A recipe that cannot be used; the message names the file or section and the problem, in one line."""


class RecipeNotFound(RecipeError):
    """``--config`` names neither a file nor a packaged recipe."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (first at line {seen[key]})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _load(path: Path) -> dict:
    """The mapping of options in the YAML file ``path``; ``RecipeError`` naming the line if it is not one."""
    try:
        content = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        raise RecipeError(f"'{path}' is not valid YAML{where}: {problem}.") from None
    except OSError as error:
        raise RecipeError(f"cannot read '{path}': {error.strerror}.") from None
    if content is None:
        raise RecipeError(f"'{path}' is empty; a recipe holds a mapping of options (trainer:, model:, data:, ...).")
    if not isinstance(content, dict):
        raise RecipeError(
            f"'{path}' must hold a mapping of options (trainer:, model:, data:, ...), got a {type(content).__name__}."
        )
    return content


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


def precision_of(trainer: dict) -> str:
    """The precision a trainer section trains in: a precision plugin's ``precision``, else ``trainer.precision``,
    named as Lightning names it (``bf16`` is ``bf16-mixed``)."""
    for plugin in _as_list(trainer.get("plugins")):
        if isinstance(plugin, dict) and "precision" in (plugin.get("init_args") or {}):
            return str(plugin["init_args"]["precision"])
    precision = str(trainer.get("precision") or "32-true")
    return _PRECISION_INPUT_STR_ALIAS_CONVERSION.get(precision, precision)


def deepspeed_precision(trainer: dict) -> dict:
    """The trainer options under which a DeepSpeed strategy trains in ``trainer``'s precision: DeepSpeed runs
    16-bit training itself, so the precision plugin gives way to ``trainer.precision`` (other plugins stay)."""
    plugins = _as_list(trainer.get("plugins"))
    kept = [p for p in plugins if not (isinstance(p, dict) and p.get("class_path") == MIXED_PRECISION_PLUGIN)]
    return {"plugins": kept, "precision": precision_of(trainer)}


def set_strategy(trainer: dict, strategy: dict) -> None:
    """Make the trainer section train with ``strategy`` (a ``class_path``/``init_args`` entry), in its precision."""
    trainer["strategy"] = strategy
    if strategy["class_path"] == STRATEGY_CLASSES["DeepSpeed"]:
        trainer.update(deepspeed_precision(trainer))
        if not trainer["plugins"]:
            del trainer["plugins"]


def set_demo_defaults(parser: LightningArgumentParser) -> None:
    """Make the demo workload the model and data a LightningCLI ``parser`` builds when the arguments name none: set
    here once, so that every reader of ``fit``'s arguments (the CLI, bench's hand-written loop) builds the same."""
    parser.set_defaults({kind: {"class_path": class_path} for kind, class_path in DEFAULT_CLASSES.items()})


@functools.cache
def _parser(kind: str) -> LightningArgumentParser:
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(_BASE_CLASSES[kind], kind, subclass_mode=True)
    return parser


def build(kind: str, section: dict) -> Any:
    """The ``model`` or ``data`` of a recipe section, built as LightningCLI builds it; ``RecipeError`` if not."""
    parser = _parser(kind)
    try:
        config = parser.parse_object({kind: section})
        return parser.instantiate(config)[kind]
    except (argparse.ArgumentError, TypeError, ValueError) as error:  # the class's own checks raise the last two
        message = condense_parser_error(str(error))
        if message == f"{kind}: ":  # all jsonargparse said was that the class is of another kind
            message = f"{kind}: {section.get('class_path')!r} is not a {_BASE_CLASSES[kind].__name__}"
        raise RecipeError(message) from None


@dataclass(frozen=True)
class Recipe:
    """A recipe's options as written (``config``, from the file ``path``), and what the commands read from them."""

    config: dict
    path: Path | None = None

    @classmethod
    def read(cls, reference: str) -> Recipe:
        """The recipe a ``--config`` value names (a path or a packaged name); ``RecipeNotFound`` or ``RecipeError``
        when there is none or it is not a mapping of options."""
        path = find_recipe(reference)
        if path is None:
            raise RecipeNotFound(
                f"recipe file '{reference}' not found. Give a path to a YAML file or one of the packaged recipes: "
                f"{', '.join(available_recipes())}."
            )
        return cls(_load(path), path)

    @property
    def trainer(self) -> dict:
        return self.config.get("trainer") or {}

    def section(self, kind: str) -> dict:
        """The ``model`` or ``data`` entry, its class defaulting to the demo's as the CLI's does."""
        entry = self.config.get(kind) or {"class_path": DEFAULT_CLASSES[kind]}
        if not isinstance(entry, dict) or "class_path" not in entry:
            raise RecipeError(f"{kind}: needs a class_path (and optional init_args).")
        return {"class_path": entry["class_path"], "init_args": dict(entry.get("init_args") or {})}

    def class_path(self, kind: str) -> str:
        """The class the ``model`` or ``data`` entry names, the demo's where it names none: ``fit`` builds the demo's
        class from an entry of ``init_args`` only, where :meth:`section` asks for a ``class_path``."""
        return (self.config.get(kind) or {}).get("class_path", DEFAULT_CLASSES[kind])

    def _trainer_int(self, name: str) -> int | None:
        value = self.trainer.get(name)
        return value if isinstance(value, int) else None

    @property
    def devices(self) -> int | None:
        """``trainer.devices`` when it is a number."""
        return self._trainer_int("devices")

    @property
    def nodes(self) -> int | None:
        """``trainer.num_nodes`` when it is a number."""
        return self._trainer_int("num_nodes")

    @property
    def accumulation(self) -> int:
        return int(self.trainer.get("accumulate_grad_batches") or 1)

    @property
    def precision(self) -> str:
        return precision_of(self.trainer)

    @property
    def micro_batch(self) -> int | None:
        """The data's ``batch_size``, when the recipe gives a number."""
        batch_size = ((self.config.get("data") or {}).get("init_args") or {}).get("batch_size")
        return batch_size if isinstance(batch_size, int) else None

    @property
    def strategy_options(self) -> dict:
        strategy = self.trainer.get("strategy")
        return dict(strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}

    @property
    def blocks(self) -> str | list[str]:
        """The strategy's ``blocks`` option (its older spellings too), ``"auto"`` unless the recipe names them."""
        options = self.strategy_options
        return options.get("blocks") or options.get("shard_modules") or options.get("block_modules") or "auto"

    def with_strategy(self, strategy: dict) -> dict:
        """A copy of the recipe training with ``strategy``, in the recipe's precision: the user's other strategy
        options kept where the new class takes them (``blocks``, ``timeout``, ...)."""
        config = copy.deepcopy(self.config)
        strategy = copy.deepcopy(strategy)
        init_args = strategy.setdefault("init_args", {})
        accepted = inspect.signature(pydoc.locate(strategy["class_path"])).parameters
        for option, value in self.strategy_options.items():
            if option in accepted and option not in init_args:
                init_args[option] = value
        config["trainer"] = config.get("trainer") or {}  # a bare "trainer:" is None
        set_strategy(config["trainer"], strategy)
        return config
