"""Small deterministic Lightning workloads shared by the strategy tests (run inside spawned ranks)."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_fastdist.demo import TinyGPT

BLOCK_SIZE = 16


class RepeatedSample(Dataset):
    """The same random ``(input, target)`` pair at every index.

    Every batch, on every rank and at any world size, is then identical, so a
    model's loss after ``k`` steps depends only on its state, not on how the
    data was split or where an epoch was resumed.
    """

    def __init__(self, length: int = 256, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        window = torch.randint(0, 256, (BLOCK_SIZE + 1,), generator=generator)
        self.sample = (window[:-1], window[1:])
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sample


def repeated_batches(batch_size: int = 4) -> DataLoader:
    return DataLoader(RepeatedSample(), batch_size=batch_size)


def distinct_batches(batch_size: int = 4, samples: int = 32) -> DataLoader:
    """Seeded random ``(input, target)`` windows, all different: unlike :func:`repeated_batches`, which batches
    a loss is taken over changes it."""
    windows = torch.randint(0, 256, (samples, BLOCK_SIZE + 1), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(windows[:, :-1], windows[:, 1:]), batch_size=batch_size)


def tiny_gpt(**overrides) -> TinyGPT:
    """TinyGPT small enough for CPU tests, seeded so every rank builds the same weights."""
    torch.manual_seed(0)
    options = dict(n_layer=2, n_embd=32, n_head=2, block_size=BLOCK_SIZE, warmup_steps=2)
    return TinyGPT(**{**options, **overrides})


class LossRecorder(L.Callback):
    """Keeps the training loss of every micro-batch, in order."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def make_trainer(strategy, devices: int = 2, **options) -> L.Trainer:
    """A quiet CPU Trainer without validation; ``options`` override the defaults."""
    defaults = dict(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    return L.Trainer(**{**defaults, **options})
