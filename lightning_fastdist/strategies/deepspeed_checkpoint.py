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


def full_weights_of_folder(folder: _PATH) -> dict[str, Any]:
    """The DeepSpeed checkpoint ``folder`` as :func:`consolidate_checkpoint` writes it (Lightning's state and the full
    fp32 ``state_dict``), in memory: every rank reads every rank's partition."""
    import_deepspeed("full_weights_of_folder")
    import torch  # noqa: PLC0415
    from deepspeed.utils.zero_to_fp32 import (  # noqa: PLC0415
        get_fp32_state_dict_from_zero_checkpoint,
        get_model_state_file,
        get_optim_files,
    )
    from lightning.pytorch.utilities.deepspeed import ds_checkpoint_dir  # noqa: PLC0415

    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints what it reads
        state_dict = get_fp32_state_dict_from_zero_checkpoint(folder)
    tag_folder = ds_checkpoint_dir(folder)
    zero_stage = torch.load(get_optim_files(tag_folder)[0], map_location="cpu", weights_only=False)[
        "optimizer_state_dict"
    ]["zero_stage"]
    client_state = torch.load(get_model_state_file(tag_folder, zero_stage), map_location="cpu", weights_only=False)
    checkpoint = {key: value for key, value in client_state.items() if key not in _DEEPSPEED_STATES}
    checkpoint["state_dict"] = {key.removeprefix("_forward_module."): value for key, value in state_dict.items()}
    return checkpoint


# What DeepSpeed adds to a rank's model-states file beside Lightning's checkpoint (Lightning's converter drops them).
_DEEPSPEED_STATES = (
    "module", "optimizer", "lr_scheduler", "csr_tensor_module_names", "skipped_steps", "global_steps",
    "dp_world_size", "mp_world_size",
)  # fmt: skip
