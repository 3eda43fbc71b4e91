"""One file from a DeepSpeed checkpoint folder: full fp32 weights for inference, without DeepSpeed or its ranks.

A checkpoint of :class:`~lightning_fastdist.FastDeepSpeedStrategy` is a folder
(DeepSpeed's layout: ``latest`` names the tag folder ``checkpoint/`` that holds
each rank's partition of the weights and optimizer state). Under ZeRO-2 and 3
no single file there holds the weights. :func:`consolidate_checkpoint`
assembles them, with Lightning's
:func:`~lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict`,
into an ordinary Lightning checkpoint: ``MyModel.load_from_checkpoint(file)``
loads it on one device, and ``FastDeepSpeedStrategy(load_full_weights=True)``
can start from it (without the optimizer state).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.types import _PATH

from lightning_fastdist.parallel.checkpoint.atomic import save_file_atomically
from lightning_fastdist.parallel.deepspeed.runtime import import_deepspeed


def consolidate_checkpoint(folder: _PATH, output: _PATH) -> dict[str, Any]:
    """Write the DeepSpeed checkpoint ``folder`` as the single Lightning checkpoint file ``output``; return it.

    One process, no process group; the file is written under ``<output>.partial`` and renamed into place.
    The weights are fp32 whatever the training precision; the optimizer state is left out.
    """
    import_deepspeed("consolidate_checkpoint")
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict  # noqa: PLC0415

    folder = Path(folder)
    if not (folder / "latest").is_file():
        raise FileNotFoundError(f"consolidate_checkpoint: {folder} is not a DeepSpeed checkpoint (no 'latest' file).")
    converted: dict[str, Any] = {}

    def write(staged: Path) -> None:
        with contextlib.redirect_stdout(io.StringIO()):  # the converter prints the staging name
            converted.update(convert_zero_checkpoint_to_fp32_state_dict(folder, staged))

    save_file_atomically(write, Path(output))
    return converted
