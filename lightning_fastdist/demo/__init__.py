"""The built-in workload: a small GPT and byte-level text data that need no download."""

from lightning_fastdist.demo.data import TextDataModule
from lightning_fastdist.demo.model import Block, TinyGPT

__all__ = ["Block", "TextDataModule", "TinyGPT"]
