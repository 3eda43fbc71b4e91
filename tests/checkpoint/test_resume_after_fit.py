"""A fit that ``max_steps`` stopped inside an epoch resumes there, bit for bit, with dropout, on 2 gloo processes.

``fit(max_steps=4)`` then ``trainer.save_checkpoint`` (and, separately, the
``ModelCheckpoint`` file written in ``on_train_epoch_end`` of that fit), then a
new Trainer ``fit(max_steps=10, ckpt_path=...)``: the resumed run continues epoch
0 at batch 4, crosses into epoch 1, and ends with the weights of 10 straight steps
(``torch.equal``), although the model draws dropout masks and the runs validate,
sanity-check and start DataLoader iterators at different moments.
FastDDPStrategy and FastFSDPStrategy (sharded checkpoints); plain Lightning
``DDPStrategy`` reads the same checkpoint as it reads its own (issue 57): the
epoch ``max_steps`` cut short is finished, and it goes on with epoch 1.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy
from lightning_fastdist.demo import TextDataModule, TinyGPT
from tests.support.fault_runs import BATCH, BLOCK, write_corpus
from tests.support.harness import run_function

pytestmark = pytest.mark.multiprocess

WORLD = 2
BATCHES_PER_EPOCH = 6  # per rank
TOTAL_STEPS, STOP_AT = 10, 4  # the first fit stops inside epoch 0; the resumed one ends inside epoch 1


class RecordBatches(L.Callback):
    """Each training batch's inputs, in order (this rank's view)."""

    def __init__(self) -> None:
        self.batches: list[list[list[int]]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append(batch[0].tolist())


def fit(strategy, corpus: str, max_steps: int, ckpt_path: Path | None = None, checkpoint_dir: Path | None = None):
    """One seeded fit with dropout 0.1 and validation; returns the trainer and this rank's batches and weights."""
    L.seed_everything(0, verbose=False)
    record = RecordBatches()
    callbacks: list[L.Callback] = [record]
    if checkpoint_dir is not None:  # saves once, in on_train_epoch_end of the epoch max_steps cuts short
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_last=True, save_on_train_epoch_end=True))
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=max_steps, deterministic=True, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1, num_sanity_val_steps=1,
        enable_checkpointing=checkpoint_dir is not None, callbacks=callbacks,
    )  # fmt: skip
    model = TinyGPT(n_layer=2, n_embd=32, n_head=2, block_size=BLOCK, dropout=0.1, warmup_steps=2)
    data = TextDataModule(batch_size=BATCH, block_size=BLOCK, corpus_path=corpus, val_fraction=0.1)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    weights = {
        name: (value.to_local() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in trainer.lightning_module.state_dict().items()
    }
    return trainer, {"batches": record.batches, "weights": weights, "steps": trainer.global_step}


def save_after_fit_then_resume(kind: str, corpus: str, folder: str) -> dict:
    """Every run of the test, one after the other in this rank's process."""
    strategy = (lambda: FastDDPStrategy(timeout=120)) if kind == "ddp" else (lambda: FastFSDPStrategy(timeout=120))
    folder = Path(folder)
    runs = {"straight": fit(strategy(), corpus, TOTAL_STEPS)[1]}
    trainer, runs["first"] = fit(strategy(), corpus, STOP_AT, checkpoint_dir=folder / "checkpoints")
    trainer.save_checkpoint(folder / "after_fit.ckpt")
    runs["from_save"] = fit(strategy(), corpus, TOTAL_STEPS, ckpt_path=folder / "after_fit.ckpt")[1]
    runs["from_callback"] = fit(strategy(), corpus, TOTAL_STEPS, ckpt_path=folder / "checkpoints" / "last.ckpt")[1]
    if kind == "ddp":
        runs["plain_lightning"] = fit("ddp", corpus, TOTAL_STEPS, ckpt_path=folder / "after_fit.ckpt")[1]
    runs["checkpoints"] = sorted(path.name for path in (folder / "checkpoints").iterdir())
    return runs


def run(kind: str, tmp_path: Path) -> list[dict]:
    corpus = str(write_corpus(tmp_path / "corpus.bin", BATCHES_PER_EPOCH, WORLD))
    return run_function(
        save_after_fit_then_resume, WORLD, args=(kind, corpus, str(tmp_path)), init_process_group=False, timeout=300
    )


def assert_resumes_where_it_stopped(per_rank: list[dict]) -> None:
    for rank, runs in enumerate(per_rank):
        straight = runs["straight"]
        assert straight["steps"] == TOTAL_STEPS and len(straight["batches"]) == TOTAL_STEPS
        assert runs["checkpoints"] == ["epoch=0-step=4.ckpt", "last.ckpt"]  # written in on_train_epoch_end
        assert len(runs["first"]["batches"]) == STOP_AT
        for resumed in ("from_save", "from_callback"):
            # Batch 4 of epoch 0 next (not the first batch of epoch 1), then the rest: the straight run's batches.
            assert runs["first"]["batches"] + runs[resumed]["batches"] == straight["batches"], f"rank {rank}: {resumed}"
            assert runs[resumed]["steps"] == TOTAL_STEPS
            for name, weight in straight["weights"].items():
                assert torch.equal(runs[resumed]["weights"][name], weight), f"rank {rank}, {resumed}: {name} differs"


@pytest.mark.slow
def test_ddp_save_after_fit_resumes_inside_the_epoch_bitwise_with_dropout(tmp_path):
    per_rank = run("ddp", tmp_path)
    assert_resumes_where_it_stopped(per_rank)
    for runs in per_rank:  # plain Lightning reads our checkpoint as its own: epoch 1 next, not batch 4 of epoch 0
        plain, straight = runs["plain_lightning"]["batches"], runs["straight"]["batches"]
        assert len(plain) == TOTAL_STEPS - STOP_AT and plain[0] == straight[BATCHES_PER_EPOCH] != straight[STOP_AT]


@pytest.mark.slow
def test_fsdp_save_after_fit_resumes_inside_the_epoch_bitwise_with_dropout(tmp_path):
    assert_resumes_where_it_stopped(run("fsdp", tmp_path))
