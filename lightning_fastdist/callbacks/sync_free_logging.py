"""SyncFreeLogging: ``self.log(..., prog_bar=True)`` without a device-to-host sync on every batch.

Lightning converts every ``prog_bar=True`` metric to a number after every batch, every logged metric with one
``.item()`` each on logging steps, and under DDP broadcasts the SIGTERM flag before every batch; each waits for the
GPU. Here ``prog_bar`` values stay on the device, and when Lightning hands the loggers their values (which they get
unchanged) every logged and progress-bar value moves to the host in one batched copy; the progress bar shows those.
:class:`PreemptionHandler` replaces the SIGTERM broadcast. The private Lightning internals used are checked at setup.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from lightning_fastdist.callbacks.host_transfer import scalars_to_host
from lightning_fastdist.trainer.internals import (
    InstancePatches,
    logger_connector,
    require_internals,
    strategy_timeout,
)
from lightning_fastdist.trainer.preemption import PreemptionHandler

# Lightning's suffixes: a metric logged with on_step=True and on_epoch=True appears as NAME_step / NAME_epoch,
# and one logged from an evaluation loop with several dataloaders carries /dataloader_idx_N.
_FORK_SUFFIXES = ("_step", "_epoch")
_DATALOADER_MARK = "/dataloader_idx_"


class SyncFreeLogging(Callback):
    """Keep logged metrics on the device; move them to the host in one copy per logging step.

    Args:
        sigterm_check_every_n_steps: deprecated and ignored.
    """

    def __init__(self, sigterm_check_every_n_steps: int | None = None) -> None:
        if sigterm_check_every_n_steps is not None:
            rank_zero_deprecation(
                "SyncFreeLogging: sigterm_check_every_n_steps is ignored and will be removed: signals are agreed on "
                "at every optimizer step without a host sync."
            )
        self.progress_bar_names: set[str] = set()
        self._preemption: PreemptionHandler | None = None
        self._patches = InstancePatches()

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        require_internals(trainer, type(self).__name__)
        connector = logger_connector(trainer)
        self._patches.replace(pl_module, "log", self._log_sync_free(pl_module))
        self._patches.replace(connector, "log_metrics", self._log_metrics_from_host(trainer, connector.log_metrics))
        if not getattr(trainer.strategy, "handles_preemption", False):
            self._preemption = PreemptionHandler(trainer, strategy_timeout(trainer.strategy) or default_pg_timeout)
            self._preemption.install()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._preemption is not None:
            self._preemption.uninstall()
            self._preemption = None
        self._patches.undo()

    def _log_sync_free(self, pl_module: LightningModule) -> Callable[..., None]:
        """``pl_module.log`` that records ``prog_bar=True`` here and passes ``prog_bar=False`` on.

        A Python number becomes a host tensor (Lightning's copy to the device blocks on a GPU), unless it is to be
        reduced across ranks: collectives need it on the device.
        """
        original = pl_module.log
        signature = inspect.signature(original)

        def log(*args: Any, **kwargs: Any) -> None:
            bound = signature.bind(*args, **kwargs)
            if bound.arguments.get("prog_bar"):
                self.progress_bar_names.add(bound.arguments["name"])
                bound.arguments["prog_bar"] = False
            value = bound.arguments["value"]
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not bound.arguments.get("sync_dist"):
                dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                bound.arguments["value"] = torch.tensor(value, dtype=dtype)  # as Lightning would, but on the host
            original(*bound.args, **bound.kwargs)

        return log

    def progress_bar_items(self, metrics: dict[str, Tensor]) -> dict[str, Tensor]:
        """The entries of Lightning's callback ``metrics`` that it would show in the progress bar.

        For a name logged with ``prog_bar=True``, Lightning shows ``NAME_step`` or ``NAME_epoch`` when both exist,
        else ``NAME``; a ``/dataloader_idx_N`` suffix stays attached.
        """
        chosen: dict[tuple[str, str], tuple[str, Tensor]] = {}
        for key, value in metrics.items():
            base, _, loader = key.partition(_DATALOADER_MARK)
            stems = [base.removesuffix(suffix) for suffix in _FORK_SUFFIXES if base.endswith(suffix)]
            forked_from = next((stem for stem in stems if stem in self.progress_bar_names), None)
            if forked_from is not None:
                chosen[(forked_from, loader)] = (key, value)
            elif base in self.progress_bar_names:
                chosen.setdefault((base, loader), (key, value))
        return dict(chosen.values())

    def _log_metrics_from_host(self, trainer: Trainer, original: Callable[..., None]) -> Callable[..., None]:
        """Lightning's ``log_metrics`` preceded by one batched transfer of logged and progress-bar values."""
        connector = logger_connector(trainer)

        def log_metrics(metrics: dict[str, Any], step: int | None = None) -> None:
            bar = self.progress_bar_items(connector.metrics["callback"])
            scalars = {
                **{f"bar/{k}": v for k, v in bar.items() if isinstance(v, Tensor)},
                **{f"log/{k}": v for k, v in metrics.items() if isinstance(v, Tensor) and v.numel() == 1},
            }
            host = scalars_to_host(scalars) if scalars else {}
            connector._progress_bar_metrics.update({k: host[f"bar/{k}"] for k in bar if f"bar/{k}" in host})
            original({k: host.get(f"log/{k}", v) for k, v in metrics.items()}, step=step)

        return log_metrics
