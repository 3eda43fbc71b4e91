"""Check a ``DataLoader``'s settings against the rank's share of the CPU cores and propose better ones.

The rules are tabled in ``docs/bottlenecks.md``. Iterable datasets are only reported for ``num_workers``: extra
workers would each yield the whole stream unless the dataset splits itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import DataLoader, IterableDataset

MAX_WORKERS = 8
MIN_PREFETCH = 2
TUNED_SETTINGS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")


@dataclass(frozen=True)
class DataLoaderFinding:
    """One setting of one DataLoader that should change.

    Attributes:
        loader: which loader (``"train"``, ``"val"``, ...).
        setting: the DataLoader argument.
        proposed: the value to use, or ``None`` when only a report is possible.
    """

    loader: str
    setting: str
    found: object
    proposed: object
    reason: str

    def describe(self) -> str:
        """One line: ``train.num_workers: 0 -> 1 (reason)``."""
        change = f"{self.found!r} -> {self.proposed!r}" if self.proposed is not None else f"{self.found!r} (left as is)"
        return f"{self.loader}.{self.setting}: {change}: {self.reason}"


def workers_for(cores_per_rank: int) -> int:
    """Workers for one rank: its cores minus one for the training loop, in [1, :data:`MAX_WORKERS`]."""
    return max(1, min(MAX_WORKERS, cores_per_rank - 1))


def audit_dataloader(loader: DataLoader, name: str, accelerator: str, cores_per_rank: int) -> list[DataLoaderFinding]:
    """Findings for ``loader`` (empty when its settings are sound).

    Args:
        name: how findings refer to ``loader`` (``"train"``, ``"val"``).
        accelerator: the device type the batches go to (``"cuda"``, ``"cpu"``, ...).
        cores_per_rank: CPU cores available to this rank (the node's cores / processes on the node).
    """
    findings: list[DataLoaderFinding] = []
    workers = loader.num_workers
    if workers == 0 and isinstance(loader.dataset, IterableDataset):
        findings.append(DataLoaderFinding(
            name, "num_workers", 0, None,
            "batches load in the training process; an IterableDataset needs to split its stream with "
            "get_worker_info() before workers can be added",
        ))  # fmt: skip
    elif workers == 0:
        findings.append(DataLoaderFinding(
            name, "num_workers", 0, workers_for(cores_per_rank),
            f"batches load in the training process between steps; {cores_per_rank} core(s) per rank allow workers",
        ))  # fmt: skip
    elif workers > cores_per_rank:
        findings.append(DataLoaderFinding(
            name, "num_workers", workers, max(1, cores_per_rank),
            f"more workers than this rank's {cores_per_rank} core(s): ranks' workers compete for the CPU",
        ))  # fmt: skip
    effective_workers = next((f.proposed for f in findings if f.setting == "num_workers" and f.proposed), workers)
    if accelerator == "cuda" and not loader.pin_memory:
        findings.append(DataLoaderFinding(
            name, "pin_memory", False, True, "copies to the GPU cannot overlap compute from pageable host memory",
        ))  # fmt: skip
    if effective_workers > 0 and not loader.persistent_workers:
        findings.append(DataLoaderFinding(
            name, "persistent_workers", False, True,
            "worker processes would be started again every epoch / validation run",
        ))  # fmt: skip
    if workers > 0 and loader.prefetch_factor is not None and loader.prefetch_factor < MIN_PREFETCH:
        findings.append(DataLoaderFinding(
            name, "prefetch_factor", loader.prefetch_factor, MIN_PREFETCH,
            "one batch ready per worker: any slow batch stalls the step",
        ))  # fmt: skip
    return findings


def tuned_settings(loader: DataLoader, findings: list[DataLoaderFinding]) -> dict:
    """The loader's :data:`TUNED_SETTINGS` with the findings applied.

    Consistent for DataLoader's checks: without workers, ``persistent_workers`` is off and ``prefetch_factor`` unset.
    """
    settings = {key: getattr(loader, key) for key in TUNED_SETTINGS}
    for finding in findings:
        if finding.proposed is not None:
            settings[finding.setting] = finding.proposed
    if settings["num_workers"] == 0:
        settings["persistent_workers"], settings["prefetch_factor"] = False, None
    return settings
