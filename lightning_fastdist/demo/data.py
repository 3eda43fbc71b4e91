"""TextDataModule: byte-level language-model data over the demo corpus."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_fastdist.data import EpochShuffleSampler, ResumableDataLoader
from lightning_fastdist.demo.corpus import load_corpus


class ByteWindows(Dataset):
    """Non-overlapping windows of a byte tensor, each as ``(input, target)`` shifted by one.

    Window ``i`` covers bytes ``[i * block_size, (i + 1) * block_size + 1)``: every byte is predicted once per epoch
    and an index fixes its sample's content, which keeps the dataset deterministic and sampler-friendly.

    Args:
        data: 1-D ``uint8`` tensor of token ids.
    """

    def __init__(self, data: Tensor, block_size: int) -> None:
        if len(data) < block_size + 1:
            raise ValueError(
                f"TextDataModule: a split of {len(data)} bytes is shorter than block_size + 1 ({block_size + 1})."
            )
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.block_size
        window = self.data[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


class TextDataModule(LightningDataModule):
    """Byte-level next-token data over text that needs no download (``lightning_fastdist.demo.corpus``).

    The first ``1 - val_fraction`` of the corpus bytes train, the rest validate (``test`` and ``predict`` too); under
    several processes Lightning shards them through ``DistributedSampler``. The training order depends only on
    ``seed`` and the epoch, and its loader is a ``ResumableDataLoader``, so a run resumed from a mid-epoch checkpoint
    continues with exactly the batches the uninterrupted run would have seen next.

    Args:
        batch_size: sequences per batch on each process.
        block_size: bytes per sequence; must not exceed the model's ``block_size``.
        num_workers: DataLoader worker processes per rank (0 loads in the main process).
        val_fraction: share of the corpus held out for validation, in (0, 0.5].
        corpus_path: a text file to train on instead of the standard library sources.
        seed: seed of the training shuffle on one process; ``None``: the ``seed_everything`` seed, which Lightning's
            ``DistributedSampler`` shuffles with under several processes, so one order serves every world size (and
            a checkpoint resumes at another world size).
    """

    def __init__(
        self,
        batch_size: int = 16,
        block_size: int = 128,
        num_workers: int = 0,
        val_fraction: float = 0.1,
        corpus_path: str | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        for name, value, minimum in (
            ("batch_size", batch_size, 1),
            ("block_size", block_size, 1),
            ("num_workers", num_workers, 0),
        ):
            if value < minimum:
                raise ValueError(f"TextDataModule: {name} must be >= {minimum}, got {value}.")
        if not 0.0 < val_fraction <= 0.5:
            raise ValueError(f"TextDataModule: val_fraction must be in (0, 0.5], got {val_fraction}.")
        self.save_hyperparameters()
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        data = torch.frombuffer(bytearray(load_corpus(self.hparams.corpus_path)), dtype=torch.uint8)
        split = int(len(data) * (1 - self.hparams.val_fraction))
        self.train_set = ByteWindows(data[:split], self.hparams.block_size)
        self.val_set = ByteWindows(data[split:], self.hparams.block_size)

    def _loader_options(self) -> dict:
        workers = self.hparams.num_workers
        return dict(
            batch_size=self.hparams.batch_size,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> ResumableDataLoader:
        sampler = EpochShuffleSampler(self.train_set, seed=self.hparams.seed)
        return ResumableDataLoader(self.train_set, sampler=sampler, drop_last=True, **self._loader_options())

    def _evaluation_loader(self) -> DataLoader:
        return DataLoader(self.val_set, **self._loader_options())  # evaluation always runs whole, in order

    def val_dataloader(self) -> DataLoader:
        return self._evaluation_loader()

    def test_dataloader(self) -> DataLoader:
        return self._evaluation_loader()

    def predict_dataloader(self) -> DataLoader:
        return self._evaluation_loader()
