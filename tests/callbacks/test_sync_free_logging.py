"""SyncFreeLogging: no host sync on ordinary steps, the same logged values as plain Lightning, SIGTERM still works."""

from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_fastdist import FastDDPStrategy, FastMixedPrecision, SpeedMonitor, SyncFreeLogging, count_host_syncs
from lightning_fastdist.demo import TextDataModule, TinyGPT
from lightning_fastdist.trainer.internals import (
    lightning_version_is_tested,
    missing_internals,
    require_internals,
)
from lightning_fastdist.trainer.preemption import Preempted
from tests.support.harness import run_function

LOG_EVERY = 4


class LoggingGPT(TinyGPT):
    """TinyGPT that also logs a step+epoch metric with sync_dist, both on the progress bar."""

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self(inputs)
        loss = self._loss(logits, targets)
        self.log("train_loss", loss, prog_bar=True)
        accuracy = (logits.argmax(-1) == targets).float().mean()
        self.log("train_acc", accuracy, prog_bar=True, on_step=True, on_epoch=True, sync_dist=True)
        return loss


def tiny_model() -> LoggingGPT:
    return LoggingGPT(n_layer=2, n_embd=32, n_head=2, block_size=16, warmup_steps=0)


class LabelSteps(L.Callback):
    """Tags each sync with the training batch it belongs to (from one batch start to the next)."""

    def __init__(self, syncs):
        self.syncs = syncs

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.syncs.label = trainer.global_step

    def on_train_epoch_end(self, trainer, pl_module):
        self.syncs.label = "epoch end"


def is_log_step(step: int) -> bool:
    return (step + 1) % LOG_EVERY == 0


# ---------------------------------------------------------------- guard on Lightning internals


def test_the_lightning_internals_we_patch_exist_in_the_installed_version():
    assert lightning_version_is_tested(), (
        f"Lightning {L.__version__} is outside the tested range: re-read the internals"
    )
    assert missing_internals(L.Trainer(logger=False)) == []


def test_a_moved_internal_fails_loudly():
    trainer = L.Trainer(logger=False)
    trainer.fit_loop.epoch_loop = object()  # as if Lightning had renamed the per-batch SIGTERM broadcast
    with pytest.raises(RuntimeError, match=r"_broadcast_sigterm_tensor .*does not exist"):
        require_internals(trainer, "SyncFreeLogging")


def test_missing_internals_are_one_short_line_and_the_optional_preemption_path_switches_itself_off():
    from datetime import timedelta

    from lightning_fastdist.trainer.preemption import PreemptionHandler

    trainer = L.Trainer(logger=False)
    trainer._signal_connector = object()  # as a unit test's mocked trainer: every signal internal is missing
    with pytest.raises(RuntimeError) as error:
        require_internals(trainer, "SyncFreeLogging")
    assert "\n" not in str(error.value) and len(str(error.value)) < 300 and "(and 3 more)" in str(error.value)
    loop = trainer.fit_loop.epoch_loop
    with pytest.warns(UserWarning, match="^Preemption handling is off: PreemptionHandler needs Lightning internals"):
        PreemptionHandler(trainer, timedelta(seconds=5)).install()
    assert "advance" not in vars(loop)  # nothing patched: Lightning's own handling stays


def test_the_old_sigterm_interval_is_deprecated_in_one_line():
    with pytest.deprecated_call(match="sigterm_check_every_n_steps is ignored"):
        SyncFreeLogging(sigterm_check_every_n_steps=5)


# ---------------------------------------------------------------- one process


def test_single_process_syncs_only_on_log_steps_and_bar_shows_transferred_values(tmp_path):
    syncs = count_host_syncs(device="cpu")
    trainer = L.Trainer(
        accelerator="cpu", max_steps=8, log_every_n_steps=LOG_EVERY, logger=CSVLogger(tmp_path),
        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[LabelSteps(syncs), SyncFreeLogging()],
    )  # fmt: skip
    L.seed_everything(0)
    with syncs:
        trainer.fit(tiny_model(), TextDataModule(batch_size=4, block_size=16))
    counts = syncs.counts_by_label()
    assert {step: counts[step] for step in range(8)} == {s: (1 if is_log_step(s) else 0) for s in range(8)}, (
        syncs.report()
    )
    assert counts["epoch end"] == 1  # train_acc_epoch, in one copy
    rows = read_csv(Path(trainer.logger.log_dir) / "metrics.csv")
    last_step = [row for row in rows if row["step"] == "7" and row["train_loss"]][0]
    bar = trainer.progress_bar_metrics
    assert bar["train_loss"] == float(last_step["train_loss"]) and isinstance(bar["train_loss"], float)
    assert set(bar) == {"train_loss", "train_acc_step", "train_acc_epoch"}
    # the patches are gone after fit: the module's log and the connector are Lightning's again
    assert "log" not in vars(trainer.lightning_module) and "log_metrics" not in vars(trainer._logger_connector)


# ---------------------------------------------------------------- two processes


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def fit_and_report(sync_free: bool, root: str) -> dict:
    """Fit on 2 ranks with plain DDP; return this rank's progress bar and CSV path."""
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, limit_train_batches=6, limit_val_batches=2,
        log_every_n_steps=2, logger=CSVLogger(root), enable_checkpointing=False, enable_model_summary=False,
        callbacks=[SyncFreeLogging()] if sync_free else [],
    )  # fmt: skip
    trainer.fit(tiny_model(), TextDataModule(batch_size=4, block_size=16))
    return {"bar": dict(trainer.progress_bar_metrics), "csv": str(Path(trainer.logger.log_dir) / "metrics.csv")}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_csv_logger_receives_the_same_steps_and_values_as_plain_lightning(tmp_path):
    plain = run_function(fit_and_report, world_size=2, args=(False, str(tmp_path / "plain")), init_process_group=False)
    ours = run_function(fit_and_report, world_size=2, args=(True, str(tmp_path / "ours")), init_process_group=False)
    plain_rows, our_rows = read_csv(Path(plain[0]["csv"])), read_csv(Path(ours[0]["csv"]))
    assert list(plain_rows[0]) == list(our_rows[0])  # same columns: step+epoch forks, val metrics, epoch
    assert len(plain_rows) == len(our_rows) >= 4
    for plain_row, our_row in zip(plain_rows, our_rows):
        assert plain_row["step"] == our_row["step"] and plain_row["epoch"] == our_row["epoch"]
        for key, value in plain_row.items():
            assert (value == "") == (our_row[key] == ""), key
            if value:
                assert float(our_row[key]) == pytest.approx(float(value), rel=1e-6), key
    assert ours[0]["bar"] == pytest.approx(plain[0]["bar"], rel=1e-6)


def count_syncs_per_step(root: str) -> dict:
    """The full sync-free stack on FastDDPStrategy; syncs per training step on this rank."""
    syncs = count_host_syncs(device="cpu")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FastDDPStrategy(), plugins=[FastMixedPrecision("bf16-mixed")],
        max_steps=2 * LOG_EVERY + 2, log_every_n_steps=LOG_EVERY, logger=CSVLogger(root), enable_checkpointing=False,
        enable_model_summary=False, limit_val_batches=0,
        callbacks=[LabelSteps(syncs), SyncFreeLogging(), SpeedMonitor()],
    )  # fmt: skip
    with syncs:
        trainer.fit(tiny_model(), TextDataModule(batch_size=4, block_size=16))
    return {"counts": dict(syncs.counts_by_label()), "report": syncs.report(), "steps": trainer.global_step}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_no_host_sync_on_ordinary_steps_under_fast_ddp_with_bf16_and_speed_monitor(tmp_path):
    for rank in run_function(count_syncs_per_step, world_size=2, args=(str(tmp_path),), init_process_group=False):
        steps = rank["steps"]
        per_step = {step: rank["counts"].get(step, 0) for step in range(steps)}
        assert all(per_step[s] == 0 for s in range(steps) if not is_log_step(s)), rank["report"]
        assert all(1 <= per_step[s] <= 2 for s in range(steps) if is_log_step(s)), rank["report"]
        assert rank["counts"]["epoch end"] <= 2, rank["report"]  # the SIGTERM check and epoch metrics, if any


class SigtermOnRankZero(L.Callback):
    """Rank 0 alone receives SIGTERM in the middle of training (as when a scheduler signals one process)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 0 and trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)


def fit_until_sigterm(root: str) -> dict:
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=20, log_every_n_steps=LOG_EVERY,
        logger=CSVLogger(root), enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
        enable_progress_bar=False, callbacks=[SyncFreeLogging(), SigtermOnRankZero()], default_root_dir=root,
    )  # fmt: skip
    try:
        trainer.fit(tiny_model(), TextDataModule(batch_size=4, block_size=16, num_workers=0))
        stopped_by = "finished"
    except Preempted as stop:
        stopped_by = f"exit {stop.code}"
    return {
        "stopped_by": stopped_by, "steps": trainer.global_step, "received_sigterm": trainer.received_sigterm,
        "saved": sorted(path.name for path in Path(root).glob("hpc_ckpt_*.ckpt")),
        "status": trainer.state.status.value, "handler_restored": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_on_one_rank_under_lightnings_ddp_stops_every_rank_at_the_same_step(tmp_path):
    # SyncFreeLogging brings the preemption handler to a strategy that lacks it (Lightning's own DDPStrategy).
    ranks = run_function(fit_until_sigterm, world_size=2, args=(str(tmp_path),), init_process_group=False, timeout=150)
    for rank in ranks:
        assert rank["stopped_by"] == "exit 143"
        assert rank["received_sigterm"] and rank["status"] == "interrupted"
        assert (
            rank["steps"] == 3
        )  # signalled after step 2; sent with the next boundary's all-reduce, read at the one after
        assert rank["saved"] == ["hpc_ckpt_1.ckpt"]
        assert rank["handler_restored"]
