"""TextDataModule: no download, deterministic, argument checks, and disjoint shards under DDP."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_fastdist.demo import TextDataModule, TinyGPT
from lightning_fastdist.demo.corpus import MINIMUM_CORPUS_BYTES, load_corpus, stdlib_source_paths
from lightning_fastdist.demo.data import ByteWindows
from tests.support.harness import run_function


def test_default_corpus_is_read_from_the_standard_library():
    paths = stdlib_source_paths()
    assert len(paths) > 30 and all(p.suffix == ".py" for p in paths)
    corpus = load_corpus()
    assert len(corpus) >= MINIMUM_CORPUS_BYTES
    assert b"def " in corpus and b"class " in corpus


def test_setup_is_deterministic_and_splits_by_position():
    first, second = TextDataModule(block_size=32), TextDataModule(block_size=32)
    first.setup("fit")
    second.setup("fit")
    assert torch.equal(first.train_set.data, second.train_set.data)
    total = len(first.train_set.data) + len(first.val_set.data)
    assert len(first.val_set.data) == total - int(total * 0.9)


def test_windows_are_shifted_pairs_that_cover_each_byte_once():
    data = torch.arange(0, 65, dtype=torch.uint8)
    windows = ByteWindows(data, block_size=8)
    assert len(windows) == 8
    inputs, targets = windows[1]
    assert inputs.tolist() == list(range(8, 16)) and targets.tolist() == list(range(9, 17))
    assert torch.cat([windows[i][0] for i in range(8)]).tolist() == list(range(64))


def test_training_order_is_seeded(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 20)

    def first_batch(seed: int) -> torch.Tensor:
        module = TextDataModule(batch_size=4, block_size=16, corpus_path=str(corpus), seed=seed)
        module.setup("fit")
        return next(iter(module.train_dataloader()))[0]

    assert torch.equal(first_batch(1), first_batch(1))
    assert not torch.equal(first_batch(1), first_batch(2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(batch_size=0), "batch_size must be >= 1"),
        (dict(block_size=0), "block_size must be >= 1"),
        (dict(num_workers=-1), "num_workers must be >= 0"),
        (dict(val_fraction=0.0), "val_fraction must be in"),
        (dict(val_fraction=0.9), "val_fraction must be in"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TextDataModule(**kwargs)


def test_missing_corpus_file_names_the_field(tmp_path):
    module = TextDataModule(corpus_path=str(tmp_path / "absent.txt"))
    with pytest.raises(FileNotFoundError, match="corpus_path"):
        module.setup("fit")


def test_a_corpus_shorter_than_one_block_is_refused(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="shorter than block_size"):
        TextDataModule(block_size=64, corpus_path=str(corpus)).setup("fit")


def record_training_inputs(corpus_path: str) -> list[list[int]]:
    """One epoch of DDP training on 2 ranks; returns the input rows this rank saw."""
    seen: list[list[int]] = []

    class RecordInputs(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.extend(batch[0].tolist())

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[RecordInputs()],
    )  # fmt: skip
    data = TextDataModule(batch_size=4, block_size=16, corpus_path=corpus_path, val_fraction=0.2)
    trainer.fit(TinyGPT(n_layer=1, n_head=1, n_embd=8, block_size=16), data)
    return seen


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ranks_see_disjoint_shards_that_cover_the_training_split(tmp_path):
    corpus = tmp_path / "corpus.bin"  # 1282 bytes: the 80% training split holds 64 windows of 16 + 1
    generator = torch.Generator().manual_seed(0)
    corpus.write_bytes(bytes(torch.randint(0, 256, (1282,), generator=generator).tolist()))
    per_rank = run_function(record_training_inputs, world_size=2, args=(str(corpus),), init_process_group=False)

    module = TextDataModule(batch_size=4, block_size=16, corpus_path=str(corpus), val_fraction=0.2)
    module.setup("fit")
    index_of = {tuple(module.train_set[i][0].tolist()): i for i in range(len(module.train_set))}
    seen = [{index_of[tuple(row)] for row in rows} for rows in per_rank]
    assert len(module.train_set) == 64
    assert [len(rows) for rows in per_rank] == [32, 32]
    assert seen[0].isdisjoint(seen[1])
    assert seen[0] | seen[1] == set(range(64))
