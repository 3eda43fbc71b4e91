"""NonFiniteLoss on 2 gloo processes: a NaN loss on one rank skips that step on both (DDP and FSDP), with no host
sync per step."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy, SyncFreeLogging, count_host_syncs
from lightning_fastdist.callbacks.nonfinite_loss import METRIC, NonFiniteLoss, NonFiniteLossError
from lightning_fastdist.demo import TextDataModule, TinyGPT
from lightning_fastdist.strategies.checkpoint.fault_tolerance import NonFiniteCheckpointError
from tests.support.harness import DistributedRunError, run_function

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
        enable_model_summary=False, limit_val_batches=0,
        callbacks=[LabelSteps(syncs), SyncFreeLogging(), NonFiniteLoss(action)],
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
@pytest.mark.multiprocess
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
@pytest.mark.multiprocess
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
        (dict(max_consecutive_skips=0), "max_consecutive_skips must be an integer >= 1, got 0"),
    ],
)
def test_bad_options_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NonFiniteLoss(**kwargs)


class NaNFromStepGPT(TinyGPT):
    """Rank 1's loss is NaN from optimizer step ``first_bad`` on (every step, or only that one)."""

    def __init__(self, first_bad: int, every_step: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.first_bad, self.every_step = first_bad, every_step

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        bad = self.global_step >= self.first_bad if self.every_step else self.global_step == self.first_bad
        return loss * float("nan") if bad and self.global_rank == 1 else loss


def train_into_checkpoints(folder: str, callbacks: list, first_bad: int, every_step: bool) -> str:
    """Fit with a checkpoint every 2 steps and a NaN loss from ``first_bad``; return how the fit ended."""
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FastDDPStrategy(timeout=60), max_steps=12, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[
            ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1, save_last=True), *callbacks],
    )  # fmt: skip
    model = NaNFromStepGPT(first_bad, every_step, n_layer=1, n_embd=16, n_head=2, block_size=16, warmup_steps=0)
    try:
        trainer.fit(model, TextDataModule(batch_size=4, block_size=16))
    except (NonFiniteLossError, NonFiniteCheckpointError) as error:
        return f"{type(error).__name__} at step {trainer.global_step}: {error}"
    return f"finished at step {trainer.global_step}"


def saved_steps_all_finite(folder: Path) -> dict[str, bool]:
    finite = {}
    for path in sorted(folder.glob("*.ckpt")):
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        tensors = [*checkpoint["state_dict"].values()]
        tensors += [v for state in checkpoint["optimizer_states"][0]["state"].values() for v in state.values()]
        finite[f"{path.name} (step {checkpoint['global_step']})"] = all(bool(torch.isfinite(t).all()) for t in tensors)
    return finite


def three_runs_into_checkpoints(root: str) -> dict[str, str]:
    """The three scenarios of the test below, one after the other in the same two processes."""
    return {
        "stop": train_into_checkpoints(f"{root}/stop", [NonFiniteLoss("stop", check_every_n_steps=10)], 3, False),
        "no-callback": train_into_checkpoints(f"{root}/no-callback", [], 3, False),
        "skip-every-step": train_into_checkpoints(
            f"{root}/skip-every-step", [NonFiniteLoss("skip", check_every_n_steps=5, max_consecutive_skips=3)], 1, True
        ),
    }


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_nan_loss_never_reaches_a_checkpoint_and_skip_stops_a_diverged_run(tmp_path):
    ranks = run_function(three_runs_into_checkpoints, 2, args=(str(tmp_path),), init_process_group=False, timeout=300)
    for ends in ranks:
        # A NaN at step 3, checked only every 10 steps: the save at step 4 reads the count and stops.
        assert ends["stop"].startswith("NonFiniteLossError at step 4"), ends
        # Without the callback the strategy itself refuses to save NaN weights.
        assert ends["no-callback"].startswith("NonFiniteCheckpointError at step 4"), ends
        # NaN on every step from step 1: skipped, but not for most of the run.
        assert (
            ends["skip-every-step"].startswith("NonFiniteLossError at step 5")
            and "4 of them in a row" in ends["skip-every-step"]
        )
    for scenario in ("stop", "no-callback", "skip-every-step"):
        saved = saved_steps_all_finite(tmp_path / scenario)
        assert saved and all(saved.values()), (scenario, saved)
    for scenario in ("stop", "no-callback"):
        assert "last.ckpt (step 2)" in saved_steps_all_finite(tmp_path / scenario)  # the refused save kept it
