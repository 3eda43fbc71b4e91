"""BatchNorm under FastFSDPStrategy as under Lightning's DDPStrategy: one evaluation answer on every rank, and
``Trainer(sync_batchnorm=True)`` honoured.

A small ResNet (plain torch, BatchNorm in every block) trains 3 steps on 2 gloo ranks, each rank reading its own
half of the data (so each rank's running statistics differ), then validates, tests and predicts on the same held-out
images on every rank, under Lightning's ``DDPStrategy`` and under ``FastFSDPStrategy`` (zero2 and zero3). With
``sync_batchnorm=True``, the BatchNorm layers are ``SyncBatchNorm`` while fitting and reverted at teardown, as under
Lightning's ``DDPStrategy``.
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastdist import FastFSDPStrategy
from tests.support.harness import run_function
from tests.support.model_zoo import ResidualCNN
from tests.support.shared_runs import once_per_session
from tests.support.workloads import LossRecorder

WORLD, STEPS = 2, 3
EXACT = 1e-5


class EvaluatedCNN(ResidualCNN):
    """The zoo's ResNet with SGD, a per-rank validation and test loss (not reduced) and logits as predictions."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.head(self.stages(self.stem(images)).mean(dim=(2, 3))), labels)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))  # this rank's own value: no sync_dist

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, _ = batch
        return self.head(self.stages(self.stem(images)).mean(dim=(2, 3)))


def held_out() -> DataLoader:
    """The same 8 images on every rank (no distributed sampler: a plain loader of one batch per rank)."""
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(8, 3, 16, 16, generator=generator)
    return DataLoader(TensorDataset(images, torch.randint(0, 10, (8,), generator=generator)), batch_size=8)


def train_and_evaluate(strategy) -> dict:
    L.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[recorder],
    )  # fmt: skip
    model = EvaluatedCNN()
    rank = int(os.environ["RANK"])
    batches = model.batches()
    own_half = torch.utils.data.Subset(batches.dataset, range(rank, len(batches.dataset), WORLD))
    trainer.fit(model, DataLoader(own_half, batch_size=4))
    (validated,) = trainer.validate(model, held_out(), verbose=False)
    (tested,) = trainer.test(model, held_out(), verbose=False)
    (predicted,) = trainer.predict(model, held_out())
    return {
        "losses": recorder.losses,
        "val_loss": validated["val_loss"],
        "test_loss": tested["test_loss"],
        "predictions": predicted,
    }


def batchnorm_classes(module: torch.nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in module.modules() if "BatchNorm" in type(m).__name__})


class BatchNormClassesAtFitStart(L.Callback):
    """The model's BatchNorm classes once the strategy set it up for each fit."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def on_fit_start(self, trainer, module) -> None:
        self.seen.append(batchnorm_classes(module))


def sync_batchnorm_fits_then_evaluation(strategy) -> dict:
    """``Trainer(sync_batchnorm=True)``: two fits of the same model and trainer, then validate and predict.

    The fits take no step (``max_steps=0``): torch's SyncBatchNorm refuses a CPU input in training (Lightning's DDP
    wrapper refuses the model outright on CPU, before its first step), so only the set-up and teardown of each fit
    and the evaluation after them run here.
    """
    L.seed_everything(0, verbose=False)
    at_fit_start = BatchNormClassesAtFitStart()
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, sync_batchnorm=True, max_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[at_fit_start],
    )  # fmt: skip
    model = EvaluatedCNN()
    record: dict = {"after fit": []}
    for _ in range(2):
        try:
            trainer.fit(model, model.batches())
        except ValueError as error:  # Lightning's DDP on CPU
            record["fit error"] = str(error)
        record["after fit"].append(batchnorm_classes(model))
    record["at fit start"] = at_fit_start.seen
    (validated,) = trainer.validate(model, held_out(), verbose=False)
    (predicted,) = trainer.predict(model, held_out())
    return {**record, "val_loss": validated["val_loss"], "predictions": predicted}


def batchnorm_cases() -> dict:
    return {
        "ddp": train_and_evaluate(DDPStrategy()),
        "fsdp-zero2": train_and_evaluate(FastFSDPStrategy(sharding="zero2")),
        "fsdp-zero3": train_and_evaluate(FastFSDPStrategy(sharding="zero3")),
        "sync_batchnorm ddp": sync_batchnorm_fits_then_evaluation(DDPStrategy()),
        "sync_batchnorm fsdp": sync_batchnorm_fits_then_evaluation(FastFSDPStrategy()),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return once_per_session(
        tmp_path_factory,
        "fsdp_batchnorm",
        lambda: run_function(batchnorm_cases, WORLD, init_process_group=False, timeout=400),
    )


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["fsdp-zero2", "fsdp-zero3"])
def test_evaluation_gives_one_answer_on_every_rank_and_it_is_ddps(runs, engine):
    first = runs[0][engine]
    for rank, record in enumerate(runs):
        ddp, ours = record["ddp"], record[engine]
        assert ours["losses"] == pytest.approx(ddp["losses"], rel=EXACT), f"rank {rank}"
        assert ours["val_loss"] == pytest.approx(ddp["val_loss"], rel=EXACT), f"rank {rank}"
        assert ours["test_loss"] == pytest.approx(ddp["test_loss"], rel=EXACT), f"rank {rank}"
        assert torch.allclose(ours["predictions"], ddp["predictions"], rtol=EXACT, atol=1e-6), f"rank {rank}"
        assert torch.equal(ours["predictions"], first["predictions"]) and ours["val_loss"] == first["val_loss"]
    assert runs[0]["ddp"]["losses"] != runs[1]["ddp"]["losses"]  # each rank trained on its own data


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sync_batchnorm_is_syncbatchnorm_while_fitting_and_reverted_at_teardown_as_under_ddp(runs):
    for record in runs:
        ddp, ours = record["sync_batchnorm ddp"], record["sync_batchnorm fsdp"]
        assert ddp["fit error"] == "SyncBatchNorm layers only work with GPU modules"  # set up, then refused on CPU
        assert ours["at fit start"] == [["SyncBatchNorm"], ["SyncBatchNorm"]]  # the second fit's too
        assert ours["after fit"] == ddp["after fit"] == [["_BatchNormXd"], ["_BatchNormXd"]]  # Lightning's revert
        # The reverted layers are the ones FSDP sharded: evaluation computes with their gathered weights, as DDP.
        assert ours["val_loss"] == pytest.approx(ddp["val_loss"], rel=EXACT)
        assert torch.allclose(ours["predictions"], ddp["predictions"], rtol=EXACT, atol=1e-6)
