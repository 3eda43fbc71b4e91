"""lightning_fastdist: fast distributed training for PyTorch Lightning by default."""

__version__ = "0.1.0"
