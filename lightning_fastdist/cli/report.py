"""The lines ``lightning-fastdist`` prints after a run: the final numbers and where everything went."""

from __future__ import annotations

import os

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger

from lightning_fastdist.cli.config import OwnConfigSaver
from lightning_fastdist.parallel.checkpoint.atomic import is_local_path


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it is inside it (Lightning makes some absolute)."""
    relative = os.path.relpath(path) if is_local_path(path) and os.path.isabs(path) else path
    return path if relative.startswith("..") else relative


def _metrics_location(logger: Logger) -> str:
    if isinstance(logger, CSVLogger):
        return _shown(logger.experiment.metrics_file_path)
    return _shown(str(logger.log_dir or logger.save_dir))


def _checkpoints_location(trainer: Trainer) -> str:
    saver = trainer.checkpoint_callback
    if not isinstance(saver, ModelCheckpoint) or saver.dirpath is None:
        return "checkpoints: none (checkpointing is off)"
    if not saver.last_model_path and not saver.best_model_path:
        return f"checkpoints: none saved in this run (folder {_shown(saver.dirpath)})"
    newest = saver.last_model_path or saver.best_model_path
    return f"checkpoints in {_shown(saver.dirpath)}{os.sep} (newest: {os.path.basename(newest)})"


def _config_location(trainer: Trainer) -> str | None:
    saver = next((callback for callback in trainer.callbacks if isinstance(callback, OwnConfigSaver)), None)
    if saver is None:
        return None
    if saver.saved_to is not None:
        return f"config in {_shown(saver.saved_to)}"
    return "config not saved" + (f" ({saver.not_saved_because})" if saver.not_saved_because else "")


def final_numbers(trainer: Trainer) -> str:
    """``finished at step N: train_loss 1.980, val_loss 2.310``: the progress bar's last values."""
    values = ", ".join(f"{name} {float(value):.4g}" for name, value in sorted(trainer.progress_bar_metrics.items()))
    return f"finished at step {trainer.global_step}" + (f": {values}" if values else "")


def where_things_went(trainer: Trainer, fitted: bool) -> str:
    """One line naming the metrics file or folder, the saved config and (after ``fit``) the checkpoints."""
    loggers = [_metrics_location(logger) for logger in trainer.loggers]
    parts = [f"metrics in {', '.join(loggers)}" if loggers else "metrics: none (no logger)"]
    config = _config_location(trainer)
    if config is not None:
        parts.append(config)
    if fitted:
        parts.append(_checkpoints_location(trainer))
    return "; ".join(parts)
