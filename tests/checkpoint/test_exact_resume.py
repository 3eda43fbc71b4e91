"""Exact resume on 2 gloo processes: N steps straight == N/2 steps, a checkpoint on disk, resume, N/2 steps.

Bitwise-identical weights (``torch.equal``) with dropout (each rank's random
states travel in the checkpoint), the same batches in the same order on every
rank (nothing seen twice, nothing skipped, the resume falling in the middle of an
epoch), for FastDDPStrategy with PowerSGD and an fp16 GradScaler and for
FastFSDPStrategy with a sharded checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy, FastMixedPrecision
from lightning_fastdist.demo import TextDataModule, TinyGPT
from tests.support.fault_runs import BATCH, BLOCK, write_corpus
from tests.support.harness import run_function

pytestmark = pytest.mark.multiprocess

WORLD = 2
BATCHES_PER_EPOCH = 8  # per rank (what write_corpus holds)
TOTAL_STEPS, RESUME_AT = 12, 6  # the resume falls in the middle of the first epoch
DROPOUT = 0.1  # random masks: each rank's random state must be restored too


class RecordBatches(L.Callback):
    """Each training batch's inputs, in order, as lists (this rank's view)."""

    def __init__(self) -> None:
        self.batches: list[list[list[int]]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append(batch[0].tolist())


def local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()


def make_strategy(kind: str):
    if kind == "ddp":
        return FastDDPStrategy(comm_hook="powersgd", powersgd_start_iter=2, powersgd_rank=2, timeout=120)
    return FastFSDPStrategy(checkpoint_format="sharded", timeout=120)


def make_plugins(kind: str) -> list:
    if kind != "ddp":
        return []
    # fp16 loss scaling on CPU (an explicit scaler); a short growth interval makes the scale move during the run.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    return [FastMixedPrecision("16-mixed", device="cpu", scaler=scaler)]


def train(kind: str, corpus: str, folder: str, max_steps: int, resume: bool) -> dict:
    """Fit up to ``max_steps`` (resuming from ``folder``/last.ckpt if asked); return this rank's record."""
    L.seed_everything(0, verbose=False)
    record = RecordBatches()
    checkpoints = ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=-1, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=make_strategy(kind), plugins=make_plugins(kind),
        max_steps=max_steps, deterministic=True, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[record, checkpoints],
    )  # fmt: skip
    model = TinyGPT(n_layer=2, n_embd=32, n_head=2, block_size=BLOCK, dropout=DROPOUT, warmup_steps=2)
    data = TextDataModule(batch_size=BATCH, block_size=BLOCK, corpus_path=corpus, val_fraction=0.1)
    trainer.fit(model, data, ckpt_path=str(Path(folder, "last.ckpt")) if resume else None)
    result = {
        "batches": record.batches,
        "weights": {name: local(value) for name, value in trainer.lightning_module.state_dict().items()},
        "optimizer_steps": trainer.global_step,
    }
    if kind == "ddp":
        result["powersgd"] = trainer.strategy.hook_state.state_dict()
        result["scaler"] = trainer.precision_plugin.scaler.state_dict()
    return result


def run(kind: str, tmp_path: Path) -> tuple[list[dict], list[dict], list[dict]]:
    corpus = str(write_corpus(tmp_path / "corpus.bin", BATCHES_PER_EPOCH, WORLD))

    def train_to(folder: str, max_steps: int, resume: bool) -> list[dict]:
        args = (kind, corpus, str(tmp_path / folder), max_steps, resume)
        return run_function(train, WORLD, args=args, init_process_group=False, timeout=240)

    straight = train_to("straight", TOTAL_STEPS, resume=False)
    first = train_to("split", RESUME_AT, resume=False)
    second = train_to("split", TOTAL_STEPS, resume=True)
    return straight, first, second


def assert_identical(straight: list[dict], first: list[dict], second: list[dict]) -> None:
    for rank in range(WORLD):
        assert second[rank]["optimizer_steps"] == straight[rank]["optimizer_steps"] == TOTAL_STEPS
        # The same batches, in the same order: the resumed epoch continues at batch RESUME_AT.
        assert len(first[rank]["batches"]) == RESUME_AT
        assert first[rank]["batches"] + second[rank]["batches"] == straight[rank]["batches"]
        for name, weight in straight[rank]["weights"].items():
            assert torch.equal(second[rank]["weights"][name], weight), f"rank {rank}: {name} differs"
    # Within the first epoch the two ranks together see every training window exactly once.
    first_epoch = [
        tuple(row) for rank in range(WORLD) for batch in straight[rank]["batches"][:BATCHES_PER_EPOCH] for row in batch
    ]
    assert len(first_epoch) == len(set(first_epoch)) == WORLD * BATCH * BATCHES_PER_EPOCH


@pytest.mark.slow
def test_ddp_with_powersgd_and_fp16_scaler_resumes_bitwise(tmp_path):
    straight, first, second = run("ddp", tmp_path)
    assert_identical(straight, first, second)
    for rank in range(WORLD):
        a, b = straight[rank], second[rank]
        assert a["scaler"] == b["scaler"]
        assert a["powersgd"]["iteration"] == b["powersgd"]["iteration"] == TOTAL_STEPS
        assert a["powersgd"]["errors"].keys() == b["powersgd"]["errors"].keys() and a["powersgd"]["errors"]
        for key in a["powersgd"]["errors"]:
            assert torch.equal(a["powersgd"]["errors"][key], b["powersgd"]["errors"][key])
            assert torch.equal(a["powersgd"]["q_memory"][key], b["powersgd"]["q_memory"][key])
    # The scale moved during the run (so the restored scaler state mattered).
    assert straight[0]["scaler"]["scale"] != 2.0**16


@pytest.mark.slow
def test_fsdp_sharded_checkpoint_resumes_bitwise(tmp_path):
    assert_identical(*run("fsdp", tmp_path))
