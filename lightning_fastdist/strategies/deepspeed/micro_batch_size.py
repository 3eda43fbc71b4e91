"""The micro-batch size DeepSpeed's config is given when the user names none (``train_micro_batch_size_per_gpu``).

DeepSpeed only logs throughput and counts samples with it. Lightning reads ``batch_sampler.batch_size`` of the training
loader, which a ``CombinedLoader`` (or a dict or list of loaders given to ``fit``) holds once per loader: the fit ended
before its first step (``AttributeError: 'dict' object has no attribute 'batch_size'``). The first loader's size is
taken instead, and 1 where no loader says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning.pytorch.utilities import CombinedLoader


def micro_batch_size(training_loaders: object) -> int:
    """The batch size of the first of ``training_loaders`` (a loader, a ``CombinedLoader``, a dict or a list of
    loaders) that has one, else 1."""
    if isinstance(training_loaders, CombinedLoader):
        training_loaders = training_loaders.flattened
    if isinstance(training_loaders, Mapping):
        training_loaders = list(training_loaders.values())
    loaders = training_loaders if isinstance(training_loaders, Sequence) else [training_loaders]
    sizes = [getattr(getattr(loader, "batch_sampler", None), "batch_size", None) for loader in loaders]
    return next((size for size in sizes if isinstance(size, int)), 1)
