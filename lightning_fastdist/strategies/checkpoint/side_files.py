"""Files a strategy writes beside a checkpoint (a rank's PowerSGD memory, a node's own state under outer_sync).

Written atomically on a local disk (staged, then renamed: a crash never leaves a torn file), through Lightning's
writer on a remote file system, into the folder of their save
(:mod:`~lightning_fastdist.parallel.checkpoint.side_saves`); read weights-only with Lightning's reader, which
understands both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _atomic_save, _load

from lightning_fastdist.parallel.checkpoint.atomic import is_local_path, save_file_atomically


def write_side_file(state: dict, path: str) -> None:
    """Write ``state`` to ``path``, atomically where the disk is local."""
    if is_local_path(path):
        save_file_atomically(lambda staged: torch.save(state, staged), Path(path))
    else:
        _atomic_save(state, path)  # Lightning's write for remote file systems


def read_side_file(path: str) -> Any:
    """Read what :func:`write_side_file` wrote, onto the CPU: tensors and plain values only (``weights_only``), since
    nothing from a side file is unpickled.

    Raises:
        pickle.UnpicklingError: the file holds anything else.
    """
    return _load(path, map_location="cpu", weights_only=True)
