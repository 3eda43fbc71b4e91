"""NonFiniteLoss on 2 gloo processes: a NaN loss on one rank skips that step on both (DDP and FSDP), with no host
sync per step."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy, SyncFreeLogging, count_host_syncs
from lightning_fastdist.callbacks.nonfinite_loss import METRIC, NonFiniteLoss
from lightning_fastdist.demo import TextDataModule, TinyGPT
from tests.harness import DistributedRunError, run_function

STEPS, LOG_EVERY, BAD_STEP, BAD_RANK = 6, 3, 1, 1


class NaNLossGPT(TinyGPT):
    """Rank ``BAD_RANK`` returns a NaN loss at step ``BAD_STEP``; the weights around that step are kept."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == BAD_STEP and self.global_rank == BAD_RANK:
            loss = loss * float("nan")  # on the device; nothing is read back
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == BAD_STEP:
            self.weights_before = {n: p.detach().clone() for n, p in self.named_parameters()}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step == BAD_STEP + 1:
            self.weights_after = {n: p.detach().clone() for n, p in self.named_parameters()}


class LabelSteps(L.Callback):
    def __init__(self, syncs) -> None:
        self.syncs = syncs

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.syncs.label = trainer.global_step


def train_with_nan(action: str, log_dir: str, kind: str = "ddp") -> dict:
    syncs = count_host_syncs(device="cpu")
    strategy = FastDDPStrategy(timeout=60) if kind == "ddp" else FastFSDPStrategy(timeout=60)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, log_every_n_steps=LOG_EVERY,
        logger=CSVLogger(log_dir, name="", version=""), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[LabelSteps(syncs), SyncFreeLogging(), NonFiniteLoss(action)],
    )  # fmt: skip
    model = NaNLossGPT(n_layer=2, n_embd=32, n_head=2, block_size=16, warmup_steps=0)
    with syncs:
        trainer.fit(model, TextDataModule(batch_size=4, block_size=16))
    optimizer = trainer.optimizers[0]
    return {
        "unchanged": all(torch.equal(model.weights_before[n], model.weights_after[n]) for n in model.weights_before),
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "adam_steps": {float(state["step"]) for state in optimizer.state.values()},
        "syncs_by_step": dict(syncs.counts_by_label()),
    }


def read_metric(log_dir: Path) -> dict[int, float]:
    with (log_dir / "metrics.csv").open() as file:
        return {int(row["step"]): float(row[METRIC]) for row in csv.DictReader(file) if row.get(METRIC)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_skip_leaves_the_bad_step_out_on_every_rank_and_never_syncs_between_log_steps(tmp_path, kind):
    results = run_function(train_with_nan, 2, args=("skip", str(tmp_path), kind), init_process_group=False, timeout=240)
    for rank, result in enumerate(results):
        assert result["unchanged"], f"rank {rank} changed its weights on the step with the NaN loss"
        assert result["finite"]
        assert result["adam_steps"] == {float(STEPS - 1)}  # the fused kernel rolled its step counter back
        non_log_steps = [s for s in range(STEPS) if (s + 1) % LOG_EVERY]
        assert all(result["syncs_by_step"].get(s, 0) == 0 for s in non_log_steps), result["syncs_by_step"]
    logged = read_metric(tmp_path)
    assert logged[max(logged)] == 1.0 and logged[min(logged)] == 1.0  # counted at the bad step, reported at log steps


@pytest.mark.slow
def test_stop_raises_on_every_rank_at_the_check(tmp_path):
    with pytest.raises(DistributedRunError) as failure:
        run_function(train_with_nan, 2, args=("stop", str(tmp_path)), init_process_group=False, timeout=240)
    message = str(failure.value)
    assert message.count("NonFiniteLossError") >= 2, message  # both ranks stop, neither waits for the other
    # Not skipped, the NaN step poisons the weights, so the next step's loss is NaN too; both are counted.
    assert "2 optimizer step(s) between steps 0 and 3 had a NaN/inf training loss" in message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(action="ignore"), "action must be one of 'skip', 'stop', 'off', got 'ignore'"),
        (dict(check_every_n_steps=0), "check_every_n_steps must be an integer >= 1 or None, got 0"),
    ],
)
def test_bad_options_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NonFiniteLoss(**kwargs)
