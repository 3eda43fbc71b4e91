"""Every private Lightning name this package relies on, in one place, checked against the installed Lightning.

Lightning has no public hook for "hand the loggers their values" or "check for SIGTERM before a batch", and its
strategies' extension points are private methods, so the package uses names Lightning may move in any release.
Listing each with its users makes an upgrade that moves one fail in one line (``tests/project`` reads the source to
keep the registry complete); the accessors below are how the callbacks reach Lightning's private objects.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lightning
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from packaging.version import Version

# Lightning versions whose internals were read and tested (lower bound inclusive, upper exclusive).
TESTED_LIGHTNING = (Version("2.6.0"), Version("2.7.0"))

# Replaced or read on one trainer's instances (never on the classes) for the duration of a fit:
# (object path from the trainer, attribute, the parameters it must take, what we use it for)
INTERNALS = (
    ("_logger_connector", "log_metrics", ("metrics", "step"), "hand host-side values to the loggers"),
    ("_logger_connector", "metrics", None, "read this batch's metrics without converting them"),
    ("_logger_connector", "should_update_logs", None, "know whether this batch is a logging step"),
    ("_logger_connector", "_progress_bar_metrics", None, "show the last transferred values in the progress bar"),
    ("_signal_connector", "register_signal_handlers", (), "record SIGTERM/SIGUSR1 without a collective"),
    ("_signal_connector", "_register_signal", ("signum", "handlers"), "install the signal handlers"),
    ("_signal_connector", "_get_current_signal_handlers", (), "restore the previous handlers at teardown"),
    ("_signal_connector", "received_sigterm", None, "stop all ranks together after a signal"),
    ("fit_loop.epoch_loop", "_broadcast_sigterm_tensor", (), "drop the per-batch SIGTERM broadcast (a host sync)"),
    ("fit_loop.epoch_loop", "advance", ("data_fetcher",), "agree on a signal before an optimizer step's first batch"),
    ("fit_loop.epoch_loop.batch_progress", "current", None, "know where an optimizer step starts"),
    (
        "_checkpoint_connector",
        "hpc_save_path",
        ("folderpath",),
        "name the checkpoint of a stopped run without a ModelCheckpoint",
    ),
)


@dataclass(frozen=True)
class PrivateName:
    """Where a private Lightning name is used and why.

    Attributes:
        used_in: the modules of this package that use it directly (``"strategies.fsdp.strategy"``;
            ``"trainer.internals"`` for the names the accessors below reach for the others).
    """

    used_in: tuple[str, ...]
    purpose: str


FABRIC = "lightning.fabric.utilities"
# Private functions, classes and constants imported from Lightning, by the dotted path they are imported from.
PRIVATE_IMPORTS = {
    f"{FABRIC}.cloud_io._atomic_save": PrivateName(
        ("strategies.checkpoint.side_files",), "write a file beside a checkpoint"
    ),
    f"{FABRIC}.cloud_io._load": PrivateName(("strategies.checkpoint.side_files",), "read a file beside a checkpoint"),
    f"{FABRIC}.device_dtype_mixin._DeviceDtypeModuleMixin": PrivateName(
        ("strategies.fsdp.sharded_module",), "set the device a LightningModule reports after sharding"
    ),
    f"{FABRIC}.distributed._destroy_dist_connection": PrivateName(
        ("strategies.common.job",), "destroy the process group at exit, as Lightning does"
    ),
    f"{FABRIC}.load._METADATA_FILENAME": PrivateName(
        ("strategies.fsdp.sharded_module", "strategies.fsdp.one_file"),
        "name the metadata file of a sharded checkpoint as Lightning does",
    ),
    f"{FABRIC}.optimizer._optimizers_to_device": PrivateName(("strategies.fsdp.strategy",), "move optimizer states"),
    f"{FABRIC}.seed._collect_rng_states": PrivateName(
        ("strategies.checkpoint.rng_states",), "save every rank's RNG states"
    ),
    f"{FABRIC}.seed._set_rng_states": PrivateName(
        ("strategies.checkpoint.rng_states",), "restore every rank's RNG states"
    ),
    f"{FABRIC}.types._PATH": PrivateName(
        ("strategies.deepspeed.consolidate", "strategies.deepspeed.to_lightning", "strategies.fsdp.strategy"),
        "type checkpoint paths as Lightning's hooks do",
    ),
    f"{FABRIC}.data._set_sampler_epoch": PrivateName(
        ("strategies.common.shared_hooks",), "set a resumed epoch's sampler before its loader starts"
    ),
    "lightning.pytorch.loops.loop._Loop": PrivateName(
        ("trainer.loop_state",), "set a max_steps fit resumed at an epoch's end to start the next epoch"
    ),
    "lightning.pytorch.utilities.data._update_dataloader": PrivateName(
        ("data.plain_resume",), "rebuild a plain training loader with a sampler that skips what an epoch read"
    ),
    "lightning.fabric.strategies.deepspeed._validate_device_index_selection": PrivateName(
        ("strategies.deepspeed.strategy",), "validate GPU indices, skipped on CPU"
    ),
    "lightning.fabric.connector._PRECISION_INPUT_STR_ALIAS_CONVERSION": PrivateName(
        ("recipes.recipe",), "name a recipe's precision with Lightning's own aliases"
    ),
    "lightning.pytorch.plugins.layer_sync._BatchNormXd": PrivateName(
        ("strategies.fsdp.sharded_module",),
        "revert SyncBatchNorm at teardown to the class Lightning's TorchSyncBatchNorm reverts to",
    ),
    "lightning.pytorch.strategies.launchers.launcher._Launcher": PrivateName(
        ("strategies.common.job",), "type the launcher whose launch checks class names first"
    ),
    "lightning.pytorch.core.optimizer._configure_optimizers": PrivateName(
        ("planning.simulation.trace",), "read a model's optimizers as the Trainer does"
    ),
    "lightning.pytorch.strategies.strategy._ForwardRedirection": PrivateName(
        ("planning.simulation.trace",), "run training_step through the wrapped model, as the strategies do"
    ),
}

TRAINER = "lightning.pytorch.trainer.trainer.Trainer"
CONNECTORS = "lightning.pytorch.trainer.connectors"
STRATEGIES = "lightning.pytorch.strategies"
# Private attributes read, set or overridden on Lightning's objects, by the class that defines them.
PRIVATE_ATTRIBUTES = {
    f"{TRAINER}._accelerator_connector": PrivateName(("trainer.preemption",), "find SLURM's auto-requeue setting"),
    f"{TRAINER}._checkpoint_connector": PrivateName(
        ("strategies.checkpoint.fault_tolerance", "trainer.preemption"), "name and pick the checkpoint to resume from"
    ),
    f"{TRAINER}._logger_connector": PrivateName(
        ("trainer.internals",), "hand values to the loggers; know a logging step"
    ),
    f"{TRAINER}._signal_connector": PrivateName(("trainer.preemption",), "install and restore signal handlers"),
    f"{CONNECTORS}.checkpoint_connector._CheckpointConnector._ckpt_path": PrivateName(
        ("strategies.checkpoint.fault_tolerance",), "resume from the newest checkpoint that loads"
    ),
    f"{CONNECTORS}.logger_connector.logger_connector._LoggerConnector._progress_bar_metrics": PrivateName(
        ("callbacks.sync_free_logging",), "show the last transferred values in the progress bar"
    ),
    f"{CONNECTORS}.signal_connector._SignalConnector._get_current_signal_handlers": PrivateName(
        ("trainer.preemption",), "remember the handlers to restore at teardown"
    ),
    f"{CONNECTORS}.signal_connector._SignalConnector._original_handlers": PrivateName(
        ("trainer.preemption",), "have Lightning's teardown restore them"
    ),
    f"{CONNECTORS}.signal_connector._SignalConnector._register_signal": PrivateName(
        ("trainer.preemption",), "install the signal handlers"
    ),
    "lightning.pytorch.loops.fit_loop._FitLoop._combined_loader": PrivateName(
        ("trainer.loop_state",), "find each training loader's position in a CombinedLoader resumed inside an epoch"
    ),
    "lightning.pytorch.loops.fit_loop._FitLoop._data_source": PrivateName(
        ("strategies.deepspeed.strategy",), "read the training loader's batch size as Lightning's DeepSpeed does"
    ),
    "lightning.pytorch.utilities.combined_loader.CombinedLoader._mode": PrivateName(
        ("trainer.loop_state",), "know whether a CombinedLoader cycles its shorter loaders (max_size_cycle)"
    ),
    "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop._batches_that_stepped": PrivateName(
        ("trainer.loop_state",), "give a node that rejoins a running job the others' logging and scheduler count"
    ),
    "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop._broadcast_sigterm_tensor": PrivateName(
        ("trainer.preemption",), "drop the per-batch SIGTERM broadcast (a host sync)"
    ),
    "lightning.pytorch.cli.LightningCLI._instantiate_trainer": PrivateName(
        ("cli.app",), "give the trainer the recipe's callbacks"
    ),
    "lightning.pytorch.cli.LightningCLI._parse_ckpt_path": PrivateName(
        ("cli.app",), "refuse a recipe given as ckpt_path"
    ),
    "lightning.pytorch.plugins.precision.precision.Precision._after_closure": PrivateName(
        ("precision",), "run Lightning's after-closure hooks around the fused optimizer step"
    ),
    f"{STRATEGIES}.ddp.DDPStrategy._ddp_kwargs": PrivateName(
        ("strategies.ddp.strategy",), "set the bucket size DDP gets"
    ),
    f"{STRATEGIES}.ddp.DDPStrategy._get_process_group_backend": PrivateName(
        ("strategies.ddp.strategy", "strategies.deepspeed.strategy", "strategies.fsdp.strategy"),
        "check the comm hook; join the group",
    ),
    f"{STRATEGIES}.ddp.DDPStrategy._timeout": PrivateName(("trainer.internals",), "the collective timeout"),
    f"{STRATEGIES}.parallel.ParallelStrategy._configure_launcher": PrivateName(
        ("strategies.ddp.strategy", "strategies.deepspeed.strategy", "strategies.fsdp.strategy"), "choose the launcher"
    ),
    f"{STRATEGIES}.strategy.Strategy._launcher": PrivateName(
        ("strategies.ddp.strategy", "strategies.deepspeed.strategy", "strategies.fsdp.strategy"), "the launcher chosen"
    ),
    f"{STRATEGIES}.parallel.ParallelStrategy._layer_sync": PrivateName(
        ("strategies.deepspeed.strategy", "strategies.fsdp.strategy"),
        "Trainer(sync_batchnorm=True): DeepSpeed refuses it; FSDP converts BatchNorm before sharding, back after",
    ),
    f"{STRATEGIES}.model_parallel.ModelParallelStrategy._device_mesh": PrivateName(
        ("strategies.fsdp.strategy",), "the FSDP2 mesh, on the strategy and the LightningModule"
    ),
    f"{STRATEGIES}.model_parallel.ModelParallelStrategy._setup_distributed": PrivateName(
        ("strategies.fsdp.strategy",), "start the process group with our timeout and job identity"
    ),
    f"{STRATEGIES}.deepspeed.DeepSpeedStrategy._init_deepspeed_distributed": PrivateName(
        ("strategies.deepspeed.strategy",), "start DeepSpeed's process group on CPU"
    ),
    f"{STRATEGIES}.deepspeed.DeepSpeedStrategy._initialize_deepspeed_inference": PrivateName(
        ("strategies.deepspeed.strategy",), "build the evaluation engine with a CPU device rank"
    ),
    f"{STRATEGIES}.deepspeed.DeepSpeedStrategy._restore_zero_state": PrivateName(
        ("strategies.deepspeed.strategy",),
        "load full weights into ZeRO-3 partitions, evaluating from a checkpoint folder",
    ),
    f"{STRATEGIES}.deepspeed.DeepSpeedStrategy._auto_select_batch_size": PrivateName(
        ("strategies.deepspeed.strategy",), "take the first loader's batch size of a CombinedLoader"
    ),
    f"{STRATEGIES}.deepspeed.DeepSpeedStrategy._setup_model": PrivateName(
        ("strategies.deepspeed.strategy",), "apply the plan before DeepSpeed wraps the model"
    ),
    f"{STRATEGIES}.deepspeed.DeepSpeedStrategy._setup_model_and_optimizer": PrivateName(
        ("strategies.deepspeed.strategy",), "build the DeepSpeed engine with a torch optimizer"
    ),
    "lightning.pytorch.core.module.LightningModule._trainer": PrivateName(
        (
            "precision",
            "strategies.checkpoint.fault_tolerance",
            "strategies.checkpoint.saves",
            "strategies.common.shared_hooks",
        ),
        "know, when converting a module, that FSDP2 shards it next (fp8 weights gathered in fp8); save and load a "
        "checkpoint where the module is attached to no trainer (the main process after a spawned fit), as Lightning "
        "does",
    ),
    "lightning.pytorch.core.module.LightningModule._compiler_ctx": PrivateName(
        ("strategies.ddp.strategy",), "know a module the user compiled: Lightning unwraps torch.compile(model) into it"
    ),
    "lightning.fabric.utilities.device_dtype_mixin._DeviceDtypeModuleMixin._device": PrivateName(
        ("strategies.fsdp.sharded_module",), "what LightningModule.device reports"
    ),
}

# The fit loop's progress as Lightning writes it into a checkpoint's "loops" (not private names, but not
# documented either), read and rewritten on save and on resume.
CHECKPOINT_KEYS = {
    "loops.fit_loop.epoch_progress": PrivateName(("trainer.loop_state",), "reopen an epoch cut short"),
    "loops.fit_loop.epoch_loop.batch_progress": PrivateName(
        ("trainer.loop_state",), "align the resumed batch count with the data"
    ),
}


def _import_dotted(dotted: str) -> Any:
    """The object at a dotted path (the longest importable module, then attributes); raises if there is none."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            found = getattr(found, part)
        return found
    raise ImportError(dotted)


def _defines(owner: type, attribute: str) -> bool:
    """Whether Lightning's class ``owner`` has ``attribute``, or a class in its MRO sets it on ``self``."""
    assigned = re.compile(rf"self\.{attribute}\b")
    return hasattr(owner, attribute) or any(
        assigned.search(inspect.getsource(cls)) for cls in inspect.getmro(owner) if cls is not object
    )


def missing_private_names() -> list[str]:
    """One line for each name in :data:`PRIVATE_IMPORTS` and :data:`PRIVATE_ATTRIBUTES` this Lightning lacks."""
    missing = []
    for names, attribute in ((PRIVATE_IMPORTS, False), (PRIVATE_ATTRIBUTES, True)):
        for dotted, use in names.items():
            owner, name = dotted.rsplit(".", 1)
            try:
                found = _defines(_import_dotted(owner), name) if attribute else _import_dotted(dotted) is not None
            except (ImportError, AttributeError):
                found = False
            if not found:
                missing.append(
                    f"{dotted} (used in {', '.join(use.used_in)} to {use.purpose}) is not in Lightning "
                    f"{lightning.__version__}"
                )
    return missing


def logger_connector(trainer: Trainer) -> Any:
    """The trainer's logger connector (:data:`INTERNALS` lists what is used on it)."""
    return trainer._logger_connector


def is_logging_step(trainer: Trainer) -> bool:
    """Whether the loggers take this batch's values (``log_every_n_steps``)."""
    return trainer._logger_connector.should_update_logs


def strategy_timeout(strategy: Any) -> timedelta | None:
    """The collective timeout Lightning's strategies keep (``None`` where a strategy has none)."""
    return getattr(strategy, "_timeout", None)


def lightning_version_is_tested(version: str = lightning.__version__) -> bool:
    low, high = TESTED_LIGHTNING
    return low <= Version(version) < high


def missing_internals(trainer: Trainer) -> list[str]:
    """Descriptions of the :data:`INTERNALS` that ``trainer`` lacks or whose signature changed."""
    missing = []
    for path, name, parameters, purpose in INTERNALS:
        owner: object | None = trainer
        for part in path.split("."):
            owner = getattr(owner, part, None)
        where = f"Trainer.{path}.{name}"
        # Looked up on the class and the instance's __dict__: getattr on the instance would run a property.
        if owner is None or not hasattr(type(owner), name) and name not in getattr(owner, "__dict__", {}):
            missing.append(f"{where} (used to {purpose}) does not exist")
        elif parameters is not None:
            found = tuple(inspect.signature(getattr(owner, name)).parameters)
            if found != parameters:
                missing.append(f"{where} takes {found}, expected {parameters}")
    return missing


def missing_internals_line(trainer: Trainer, user: str) -> str | None:
    """One short line saying what ``user`` lacks in this trainer's Lightning, or ``None`` if nothing is missing."""
    missing = missing_internals(trainer)
    if not missing:
        return None
    low, high = TESTED_LIGHTNING
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return (
        f"{user} needs Lightning internals that this Lightning {lightning.__version__} does not have "
        f"(tested with >={low},<{high}): {missing[0]}{more}"
    )


def require_internals(trainer: Trainer, user: str) -> None:
    """Raise if a private Lightning internal that ``user`` (a class name) needs has moved; warn on an untested version.

    Raises:
        RuntimeError: one or more internals are missing or changed shape (one line naming the first).
    """
    line = missing_internals_line(trainer, user)
    if line is not None:
        raise RuntimeError(line)
    if not lightning_version_is_tested():
        low, high = TESTED_LIGHTNING
        rank_zero_warn(f"{user} was tested with Lightning >={low},<{high}; found {lightning.__version__}.")


class InstancePatches:
    """Attributes replaced on single objects (never on classes), undone in reverse order by :meth:`undo`."""

    def __init__(self) -> None:
        self._undo: list[tuple[object, str, bool, object]] = []

    def replace(self, owner: object, name: str, replacement: object) -> None:
        had_own = name in vars(owner)
        self._undo.append((owner, name, had_own, vars(owner).get(name)))
        object.__setattr__(owner, name, replacement)

    def undo(self) -> None:
        while self._undo:
            owner, name, had_own, previous = self._undo.pop()
            if had_own:
                object.__setattr__(owner, name, previous)
            else:
                object.__delattr__(owner, name)
