"""DataLoaderTuner: audit rules, rebuilt loaders under a real 2-process Trainer, data-wait measurement."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from lightning_fastdist import DataLoaderTuner
from lightning_fastdist.demo import TextDataModule, TinyGPT
from lightning_fastdist.diagnostics.dataloader_audit import audit_dataloader, tuned_settings, workers_for
from tests.callbacks.test_bottleneck_report import SLOW_SAMPLE_SECONDS, SlowData
from tests.support.harness import run_function

DATASET = TensorDataset(torch.arange(64))


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))


def settings(findings) -> dict:
    return {f.setting: (f.found, f.proposed) for f in findings}


@pytest.mark.filterwarnings(
    "ignore:This DataLoader will create 12 worker processes"
)  # torch's own warning, same reason
def test_audit_proposes_workers_persistence_pinning_and_prefetch():
    found = settings(audit_dataloader(DataLoader(DATASET, batch_size=4), "train", "cuda", cores_per_rank=6))
    assert found == {"num_workers": (0, 5), "pin_memory": (False, True), "persistent_workers": (False, True)}
    loader = DataLoader(
        DATASET, batch_size=4, num_workers=12, prefetch_factor=1, pin_memory=True, persistent_workers=True
    )
    assert settings(audit_dataloader(loader, "val", "cuda", cores_per_rank=4)) == {
        "num_workers": (12, 4), "prefetch_factor": (1, 2),
    }  # fmt: skip
    sound = DataLoader(DATASET, batch_size=4, num_workers=2, persistent_workers=True)
    assert audit_dataloader(sound, "train", "cpu", cores_per_rank=3) == []
    assert workers_for(1) == 1 and workers_for(64) == 8


def test_iterable_datasets_are_reported_not_given_workers():
    (finding,) = audit_dataloader(DataLoader(Stream(), batch_size=2), "train", "cpu", cores_per_rank=8)
    assert (finding.setting, finding.proposed) == ("num_workers", None)
    assert "get_worker_info" in finding.reason and "left as is" in finding.describe()
    assert tuned_settings(DataLoader(Stream()), [finding])["num_workers"] == 0


def test_bad_mode_names_the_accepted_values():
    with pytest.raises(ValueError, match="mode must be one of 'audit', 'auto', got 'fast'"):
        DataLoaderTuner(mode="fast")


def test_loaders_passed_to_fit_are_audited_but_not_rebuilt():
    tuner = DataLoaderTuner(mode="auto")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, limit_val_batches=1, num_sanity_val_steps=0, callbacks=[tuner],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = TextDataModule(batch_size=4, block_size=32)
    data.setup("fit")
    train, val = DataLoader(data.train_set, batch_size=4), DataLoader(data.val_set, batch_size=4)
    trainer.fit(TinyGPT(n_layer=1, n_embd=32, n_head=2, block_size=32), train_dataloaders=train, val_dataloaders=val)
    expected = ["num_workers", "persistent_workers"]
    assert [f.setting for f in tuner.findings["train"]] == expected == [f.setting for f in tuner.findings["val"]]
    assert tuner.applied == {"train": [], "val": []} and trainer.train_dataloader.num_workers == 0
    assert "[advice] train.num_workers: 0 -> 1" in tuner.report()


class FirstTokens(L.Callback):
    """Record the first token of every sample of every training batch (which data each step saw)."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.seen.append(batch[0][:, 0].tolist())


def fit_with_tuner(mode: str, slow: bool) -> dict:
    torch.manual_seed(0)
    tuner, tokens = DataLoaderTuner(mode=mode), FirstTokens()
    data = (SlowData if slow else TextDataModule)(batch_size=16, block_size=32)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=4, limit_val_batches=2, val_check_interval=2,
        num_sanity_val_steps=0, callbacks=[tuner, tokens], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(TinyGPT(n_layer=1, n_embd=32, n_head=2, block_size=32), data)
    train, val = trainer.train_dataloader, trainer.val_dataloaders
    return {
        "train": (
            type(train).__name__,
            train.num_workers,
            train.persistent_workers,
            isinstance(train.sampler, DistributedSampler),
        ),
        "val": (val.num_workers, val.persistent_workers),
        "applied": {name: [f.setting for f in found] for name, found in tuner.applied.items()},
        "advice": {name: [f.setting for f in found] for name, found in tuner.findings.items()},
        "report": tuner.report(),
        "seen": tokens.seen,
        "waits": list(tuner.clock.waits),
        "data_methods_restored": "train_dataloader" not in vars(trainer.datamodule),
    }


def three_fits() -> dict:
    return {
        "audit": fit_with_tuner("audit", slow=False),
        "auto": fit_with_tuner("auto", slow=False),
        "slow": fit_with_tuner("audit", slow=True),
    }


@pytest.mark.slow
@pytest.mark.multiprocess
def test_auto_rebuilds_loaders_keeps_the_data_and_measures_waits():
    for result in run_function(three_fits, world_size=2, timeout=240, init_process_group=False):
        audit, auto, slow = result["audit"], result["auto"], result["slow"]
        # Audit only: the demo loaders (no workers) are reported and left alone.
        assert audit["train"] == ("ResumableDataLoader", 0, False, True) and audit["applied"] == {
            "train": [],
            "val": [],
        }
        assert audit["advice"]["train"] == ["num_workers", "persistent_workers"]
        assert "[advice] train.num_workers: 0 -> 1" in audit["report"]
        # Auto: same class, a worker that persists, Lightning's DistributedSampler still added, same batches.
        assert auto["train"] == ("ResumableDataLoader", 1, True, True)
        assert auto["val"] == (1, True)
        assert auto["applied"] == {
            "train": ["num_workers", "persistent_workers"],
            "val": ["num_workers", "persistent_workers"],
        }
        assert "[changed] train.num_workers: 0 -> 1" in auto["report"]
        assert auto["seen"] == audit["seen"] and len(auto["seen"]) == 4
        assert auto["data_methods_restored"]
        # Waits: one per batch after the first of each training stretch (validation in between is not a wait).
        assert len(audit["waits"]) == 2
        assert all(wait >= 16 * SLOW_SAMPLE_SECONDS for wait in slow["waits"])  # each batch sleeps that long
