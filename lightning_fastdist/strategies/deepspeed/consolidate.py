"""One file from a DeepSpeed checkpoint folder: full fp32 weights for inference, without DeepSpeed or its ranks.

Under ZeRO-2 and 3 no single file of the folder holds the weights (each rank's partition is its own), so
:func:`consolidate_checkpoint` assembles them into an ordinary Lightning checkpoint, which
``MyModel.load_from_checkpoint`` loads on one device and ``FastDeepSpeedStrategy(load_full_weights=True)`` starts from.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.types import _PATH

from lightning_fastdist.parallel.checkpoint.atomic import save_file_atomically
from lightning_fastdist.parallel.deepspeed.runtime import import_deepspeed


def consolidate_checkpoint(folder: _PATH, output: _PATH) -> dict[str, Any]:
    """Write the DeepSpeed checkpoint ``folder`` as the single Lightning checkpoint file ``output``; return it.

    One process, no process group; fp32 weights whatever the training precision, no optimizer state.
    """
    folder = Path(folder)
    if not (folder / "latest").is_file():
        raise FileNotFoundError(f"consolidate_checkpoint: {folder} is not a DeepSpeed checkpoint (no 'latest' file).")
    converted: dict[str, Any] = {}
    save_file_atomically(lambda staged: converted.update(_convert(folder, staged)), Path(output))
    return converted


def full_weights_of_folder(folder: _PATH) -> dict[str, Any]:
    """The DeepSpeed checkpoint ``folder`` as :func:`consolidate_checkpoint` writes it (Lightning's state and the full
    fp32 ``state_dict``), without keeping the file: every rank reads every rank's partition."""
    with tempfile.TemporaryDirectory() as scratch:
        return _convert(Path(folder), Path(scratch) / "full.ckpt")


def _convert(folder: Path, output: Path) -> dict[str, Any]:
    """Lightning's converter, quiet: it prints what it reads."""
    import_deepspeed("consolidate_checkpoint")
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict  # noqa: PLC0415

    with contextlib.redirect_stdout(io.StringIO()):
        return convert_zero_checkpoint_to_fp32_state_dict(folder, output)
