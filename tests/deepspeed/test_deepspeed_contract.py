"""FastDeepSpeedStrategy gives Lightning's ``DDPStrategy`` results where a user trains and evaluates every day.

HuggingFace's GPT-2 (tiny random config) called as its users call it, plain SGD (which, unlike Adam, shows a wrong
effective learning rate at once), 2 gloo ranks: the same per-step losses and weights under gradient accumulation, and
the same ``validate``, ``test`` and ``predict`` results after fit, as Lightning's own DDP. One pair of processes runs
every case (DeepSpeed's set-up costs seconds per process).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastdist import FastDeepSpeedStrategy
from tests.support.harness import run_function
from tests.support.model_zoo import HFCausalLM, _tokens
from tests.support.shared_runs import once_per_session
from tests.support.workloads import LossRecorder

WORLD, STEPS, ACCUMULATION = 2, 3, 2
EXACT = 1e-5  # fp32: only the order of the reductions differs


class GPT2WithSGD(HFCausalLM):
    """GPT-2 trained with SGD, evaluated with its own loss and predicting its logits."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        (tokens,) = batch
        self.log("val_loss", self.model(input_ids=tokens, labels=tokens).loss, sync_dist=True)

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        (tokens,) = batch
        self.log("test_loss", self.model(input_ids=tokens, labels=tokens).loss, sync_dist=True)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens).logits[:, -1]


def held_out() -> DataLoader:
    return DataLoader(TensorDataset(_tokens(seed=1)[:16]), batch_size=4)


def train_and_evaluate(strategy: L.pytorch.strategies.Strategy) -> dict:
    """Fit with accumulation, then validate, test and predict; this rank's record."""
    L.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=ACCUMULATION,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[recorder],
    )  # fmt: skip
    model = GPT2WithSGD()
    trainer.fit(model, model.batches())
    weights = [p.detach().clone() for p in model.parameters()]
    if isinstance(strategy, FastDeepSpeedStrategy):  # the full fp32 master copy (a collective under ZeRO-3)
        from deepspeed.utils import safe_get_full_fp32_param

        weights = [safe_get_full_fp32_param(p).detach().clone() for p in strategy.deepspeed_engine.module.parameters()]
    (validated,) = trainer.validate(model, held_out(), verbose=False)
    (tested,) = trainer.test(model, held_out(), verbose=False)
    predictions = torch.cat(trainer.predict(model, held_out()))
    return {
        "losses": recorder.losses,
        "weights": weights,
        "val_loss": validated["val_loss"],
        "test_loss": tested["test_loss"],
        "predictions": predictions,
    }


def contract_cases() -> dict:
    return {
        "ddp": train_and_evaluate(DDPStrategy()),
        "deepspeed-2": train_and_evaluate(FastDeepSpeedStrategy(stage=2)),
        "deepspeed-3": train_and_evaluate(FastDeepSpeedStrategy(stage=3)),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return once_per_session(
        tmp_path_factory,
        "deepspeed_contract",
        lambda: run_function(contract_cases, WORLD, init_process_group=False, timeout=400),
    )


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["deepspeed-2", "deepspeed-3"])
def test_accumulation_trains_as_ddp_does(runs, engine):
    for rank, record in enumerate(runs):
        ddp, ours = record["ddp"], record[engine]
        assert len(ours["losses"]) == len(ddp["losses"]) == STEPS * ACCUMULATION
        assert ours["losses"] == pytest.approx(ddp["losses"], rel=EXACT), f"rank {rank}"
        assert len(ours["weights"]) == len(ddp["weights"])
        for index, (weight, expected) in enumerate(zip(ours["weights"], ddp["weights"])):
            assert torch.allclose(weight, expected, rtol=EXACT, atol=1e-7), f"rank {rank}: parameter {index}"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["deepspeed-2", "deepspeed-3"])
def test_validate_test_and_predict_run_on_cpu_and_give_ddps_results(runs, engine):
    for rank, record in enumerate(runs):
        ddp, ours = record["ddp"], record[engine]
        assert ours["val_loss"] == pytest.approx(ddp["val_loss"], rel=EXACT), f"rank {rank}"
        assert ours["test_loss"] == pytest.approx(ddp["test_loss"], rel=EXACT), f"rank {rank}"
        assert torch.allclose(ours["predictions"], ddp["predictions"], rtol=EXACT, atol=1e-6), f"rank {rank}"
