"""Resuming at another world size continues at the next sample of the epoch: 2 -> 1 and 1 -> 2 gloo processes.

A checkpoint written after 3 steps by 2 ranks x batch 4 is resumed by 1 rank
x batch 8 (the same global batch: the same global batches and, up to fp32
summation order, the same weights as the uninterrupted 2-rank run), by 1 rank x
batch 4 (twice the steps; Lightning's batch count moves to batch 6); one written
by 1 rank x batch 8 is resumed by 2 ranks x batch 4. Every resumed epoch reads
each of its 64 samples exactly once, recorded by sample index. Lightning's own
single-device strategy resumes the checkpoint as it resumes its own (issue 57):
the epoch ``max_steps`` cut short is finished, so a fit of one epoch trains no
more.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_fastdist import FastDDPStrategy
from lightning_fastdist.demo import TextDataModule, TinyGPT
from tests.support.fault_runs import BLOCK, write_corpus
from tests.support.harness import run_function

pytestmark = pytest.mark.multiprocess

SAMPLES = 64  # training windows in the corpus
STOP_AT = 3  # steps before the checkpoint, inside the first epoch
WARNING = "and is resumed by"


class RecordSteps(L.Callback):
    """The input rows of every training batch, in order (this rank's view)."""

    def __init__(self) -> None:
        self.batches: list[list[list[int]]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append(batch[0].tolist())


def fit(
    corpus: str,
    devices: int,
    batch_size: int,
    strategy=None,
    max_steps: int = -1,
    ckpt_path: Path | None = None,
    save_to: Path | None = None,
) -> dict:
    """One seeded epoch at most (dropout 0); returns this rank's batches, weights, steps and resume warnings."""
    L.seed_everything(0, verbose=False)
    record = RecordSteps()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy or FastDDPStrategy(timeout=120), max_steps=max_steps,
        max_epochs=1, deterministic=True, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[record],
    )  # fmt: skip
    model = TinyGPT(n_layer=2, n_embd=32, n_head=2, block_size=BLOCK, dropout=0.0, warmup_steps=2)
    data = TextDataModule(batch_size=batch_size, block_size=BLOCK, corpus_path=corpus, val_fraction=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return {
        "batches": record.batches,
        "weights": {name: value.detach().clone() for name, value in trainer.lightning_module.state_dict().items()},
        "steps": trainer.global_step,
        "warnings": [str(warning.message) for warning in caught if WARNING in str(warning.message)],
    }


def one_rank_before(corpus: str, folder: str) -> dict:
    return {
        "straight": fit(corpus, 1, 8),
        "first": fit(corpus, 1, 8, max_steps=STOP_AT, save_to=Path(folder, "one_rank.ckpt")),
    }


def two_ranks(corpus: str, folder: str) -> dict:
    return {
        "straight": fit(corpus, 2, 4),
        "first": fit(corpus, 2, 4, max_steps=STOP_AT, save_to=Path(folder, "two_ranks.ckpt")),
        "from_one_rank": fit(corpus, 2, 4, ckpt_path=Path(folder, "one_rank.ckpt")),
    }


def one_rank_after(corpus: str, folder: str) -> dict:
    checkpoint = Path(folder, "two_ranks.ckpt")
    return {
        "batch_8": fit(corpus, 1, 8, ckpt_path=checkpoint),
        "batch_4": fit(corpus, 1, 4, ckpt_path=checkpoint),
        "single_device_batch_8": fit(corpus, 1, 8, strategy="auto", ckpt_path=checkpoint),
    }


def sample_indices(corpus: Path) -> dict[tuple[int, ...], int]:
    data = TextDataModule(block_size=BLOCK, corpus_path=str(corpus), val_fraction=0.1)
    data.setup("fit")
    assert len(data.train_set) == SAMPLES
    return {tuple(data.train_set[index][0].tolist()): index for index in range(SAMPLES)}


def global_steps(per_rank: list[list[list[list[int]]]]) -> list[set[tuple[int, ...]]]:
    """The rows of every step over all ranks (``per_rank[rank][step]`` is that rank's batch)."""
    return [{tuple(row) for batch in step for row in batch} for step in zip(*per_rank)]


def assert_close(resumed: dict, straight: dict) -> None:
    # Measured: at most 1.3e-6 apart (fp32 sums in another order, amplified by AdamW on tiny gradients);
    # one different batch moves weights by about the learning rate, 2e-3.
    for name, weight in straight["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], weight, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_two_to_one_and_one_to_two_ranks_read_each_sample_once(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.bin", train_batches_per_rank=8, world_size=2)
    index_of = sample_indices(corpus)
    args = (str(corpus), str(tmp_path))
    [one] = run_function(one_rank_before, 1, args=args, init_process_group=False, timeout=240)
    two = run_function(two_ranks, 2, args=args, init_process_group=False, timeout=240)
    [after] = run_function(one_rank_after, 1, args=args, init_process_group=False, timeout=240)

    def read(*runs: dict) -> list[int]:
        return sorted(index_of[tuple(row)] for run in runs for batch in run["batches"] for row in batch)

    # 2 -> 1: each of the epoch's samples once, whatever the batch size or strategy.
    before = [rank["first"] for rank in two]
    for name, steps in (("batch_8", 8), ("batch_4", STOP_AT + (SAMPLES - STOP_AT * 8) // 4)):
        assert read(*before, after[name]) == list(range(SAMPLES)), name
        assert after[name]["steps"] == steps, name
    single_device = after["single_device_batch_8"]  # as from Lightning's own checkpoint: epoch 0 is finished
    assert single_device["steps"] == STOP_AT and single_device["batches"] == []
    # The same global batch (2 x 4 -> 1 x 8): the uninterrupted run's global batches and,
    # but for summation order, weights.
    straight_two = global_steps([rank["straight"]["batches"] for rank in two])
    assert (
        global_steps([rank["first"]["batches"] for rank in two]) + global_steps([after["batch_8"]["batches"]])
        == straight_two
    )
    assert_close(after["batch_8"], two[0]["straight"])
    assert [len(after[name]["warnings"]) for name in ("batch_8", "batch_4")] == [1, 1]
    assert (
        "written by 2 ranks and is resumed by 1 rank: the run continues at the next sample"
        in after["batch_8"]["warnings"][0]
    )

    # 1 -> 2: the same, the other way round.
    resumed = [rank["from_one_rank"] for rank in two]
    assert read(one["first"], *resumed) == list(range(SAMPLES))
    assert global_steps([one["first"]["batches"]]) + global_steps(
        [rank["batches"] for rank in resumed]
    ) == global_steps([one["straight"]["batches"]])
    for rank in resumed:
        assert rank["steps"] == 8
        assert_close(rank, one["straight"])
    assert len(resumed[0]["warnings"]) == 1
