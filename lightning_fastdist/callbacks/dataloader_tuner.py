"""DataLoaderTuner: audit the train/val DataLoaders when fit starts, optionally rebuild them tuned, time data waits.

The tuner wraps this fit's ``train_dataloader``/``val_dataloader`` hooks so it sees each loader before Lightning adds
its ``DistributedSampler``. A rebuilt loader is the loader's own class called with the arguments Lightning recorded,
so subclasses keep their behaviour. Loaders passed to ``trainer.fit`` directly are reported only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_fastdist.callbacks.data_wait import DataWaitClock
from lightning_fastdist.diagnostics.dataloader_audit import DataLoaderFinding, audit_dataloader, tuned_settings
from lightning_fastdist.diagnostics.environment import cpu_cores
from lightning_fastdist.trainer.internals import InstancePatches

MODES = ("audit", "auto")
LOADER_HOOKS = {"train": "train_dataloader", "val": "val_dataloader"}
WAIT_METRIC = "data/wait_ms"
# Lightning internal: while a *_dataloader hook runs, Lightning records each DataLoader's constructor arguments on it.
SAVED_ARGS, SAVED_KWARGS, SAVED_ARG_NAMES = "__pl_saved_args", "__pl_saved_kwargs", "__pl_saved_arg_names"


class DataLoaderTuner(Callback):
    """Audit (and with ``mode="auto"`` rebuild) the train/val DataLoaders; measure data-wait time per step.

    Args:
        mode: ``"audit"`` reports what should change; ``"auto"`` also rebuilds the loaders with the proposed values.
        log_data_wait: log ``data/wait_ms`` (host time waiting for each batch) every training step.
    """

    def __init__(self, mode: Literal["audit", "auto"] = "audit", log_data_wait: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"DataLoaderTuner: mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}.")
        self.mode = mode
        self.log_data_wait = log_data_wait
        self.findings: dict[str, list[DataLoaderFinding]] = {}
        self.applied: dict[str, list[DataLoaderFinding]] = {}
        self.clock = DataWaitClock()
        self._patches = InstancePatches()
        self._cores_per_rank = 1
        self._accelerator = "cpu"

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.findings, self.applied = {}, {}
        self.clock.reset()
        self._cores_per_rank = max(1, cpu_cores() // max(1, trainer.num_devices))
        self._accelerator = trainer.strategy.root_device.type
        source: Any = trainer.datamodule if trainer.datamodule is not None else pl_module
        for name, hook in LOADER_HOOKS.items():
            if is_overridden(hook, source):  # the module or data module implements it itself
                self._patches.replace(source, hook, self._tuned(name, getattr(source, hook)))

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Loaders passed straight to fit(): Lightning never called a hook we could wrap.
        for name, loader in (("train", trainer.train_dataloader), ("val", trainer.val_dataloaders)):
            if name not in self.findings and isinstance(loader, DataLoader):
                self._record(name, loader, rebuilt=False)
        lines = self.report().splitlines()
        if lines:
            rank_zero_info("DataLoaderTuner:\n" + "\n".join(f"  {line}" for line in lines))
        else:
            rank_zero_info("DataLoaderTuner: the train/val DataLoader settings look right.")

    def _tuned(self, name: str, original: Callable[[], Any]) -> Callable[[], Any]:
        def tuned_loaders() -> Any:
            return _map_loaders(original(), lambda loader: self._tune(name, loader))

        return tuned_loaders

    def _tune(self, name: str, loader: DataLoader) -> DataLoader:
        rebuild = self.mode == "auto" and hasattr(loader, SAVED_ARGS)
        if self.mode == "auto" and not rebuild:
            rank_zero_warn(
                f"DataLoaderTuner: cannot rebuild the {name} loader: Lightning did not record its constructor "
                f"arguments ({SAVED_ARGS}; tested with Lightning 2.6). Reporting only."
            )
        findings = self._record(name, loader, rebuilt=rebuild)
        if not rebuild or not any(f.proposed is not None for f in findings):
            return loader
        return rebuild_with(loader, tuned_settings(loader, findings))

    def _record(self, name: str, loader: DataLoader, rebuilt: bool) -> list[DataLoaderFinding]:
        findings = audit_dataloader(loader, name, self._accelerator, self._cores_per_rank)
        self.findings[name] = findings
        self.applied[name] = [f for f in findings if rebuilt and f.proposed is not None]
        return findings

    def report(self) -> str:
        """Every finding of the last fit, one line each, marked ``changed`` or ``advice``."""
        return "\n".join(
            f"[{'changed' if f in self.applied.get(name, []) else 'advice'}] {f.describe()}"
            for name, findings in self.findings.items()
            for f in findings
        )

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._patches.undo()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._patches.undo()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        waits_before = len(self.clock.waits)
        self.clock.batch_started()
        if self.log_data_wait and len(self.clock.waits) > waits_before:
            # A host tensor: logging it never touches the device.
            pl_module.log(
                WAIT_METRIC, torch.tensor(self.clock.waits[-1] * 1e3, dtype=torch.float64), on_step=True, on_epoch=False
            )

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.clock.batch_ended()

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.clock.pause()


def rebuild_with(loader: DataLoader, settings: dict) -> DataLoader:
    """A new loader of ``loader``'s class, from the constructor arguments Lightning recorded, ``settings`` replaced."""
    arguments = dict(zip(getattr(loader, SAVED_ARG_NAMES), getattr(loader, SAVED_ARGS)))
    arguments.update(getattr(loader, SAVED_KWARGS))
    arguments.update(settings)
    if arguments["prefetch_factor"] is None:
        del arguments["prefetch_factor"]  # DataLoader refuses an explicit value without workers
    return type(loader)(**arguments)


def _map_loaders(loaders: Any, tune: Callable[[DataLoader], DataLoader]) -> Any:
    """Apply ``tune`` to every DataLoader a ``*_dataloader`` hook returned (a loader, a list or a dict of them)."""
    if isinstance(loaders, DataLoader):
        return tune(loaders)
    if isinstance(loaders, Mapping):
        return {key: _map_loaders(value, tune) for key, value in loaders.items()}
    if isinstance(loaders, Sequence) and not isinstance(loaders, str):
        return type(loaders)(_map_loaders(value, tune) for value in loaders)
    return loaders
