"""Data loading that survives a restart: the position inside an epoch is part of the checkpoint."""

from lightning_fastdist.data.epoch_shuffle import EpochShuffleSampler
from lightning_fastdist.data.resumable_loader import ResumableDataLoader, ResumeRefusedError

__all__ = ["EpochShuffleSampler", "ResumableDataLoader", "ResumeRefusedError"]
