"""One file from a DeepSpeed checkpoint folder: full fp32 weights for inference, without DeepSpeed or its ranks.

Under ZeRO-2 and 3 no single file of the folder holds the weights (each rank's partition is its own), so
:func:`consolidate_checkpoint` assembles them into an ordinary Lightning checkpoint, which
``MyModel.load_from_checkpoint`` loads on one device and ``FastDeepSpeedStrategy(load_full_weights=True)`` starts from.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities.deepspeed import ds_checkpoint_dir

from lightning_fastdist.parallel.checkpoint.atomic import save_file_atomically
from lightning_fastdist.parallel.deepspeed.runtime import import_deepspeed

# The model-states file holding Lightning's state: one per rank under ZeRO-3 (rank 0's is read), one in all below.
_ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
_MODEL_STATES = "mp_rank_00_model_states.pt"
# What that file holds of DeepSpeed's own besides Lightning's state (Lightning's converter leaves them out too).
_DEEPSPEED_STATES = (
    "module", "optimizer", "lr_scheduler", "csr_tensor_module_names", "skipped_steps", "global_steps",
    "dp_world_size", "mp_world_size",
)  # fmt: skip


def consolidate_checkpoint(folder: _PATH, output: _PATH) -> dict[str, Any]:
    """Write the DeepSpeed checkpoint ``folder`` as the single Lightning checkpoint file ``output``; return it.

    One process, no process group; fp32 weights whatever the training precision, no optimizer state.
    """
    folder = Path(folder)
    if not (folder / "latest").is_file():
        raise FileNotFoundError(f"consolidate_checkpoint: {folder} is not a DeepSpeed checkpoint (no 'latest' file).")
    converted = full_weights_of_folder(folder)
    save_file_atomically(lambda staged: torch.save(converted, staged), Path(output))
    return converted


def full_weights_of_folder(folder: _PATH) -> dict[str, Any]:
    """The DeepSpeed checkpoint ``folder`` as :func:`consolidate_checkpoint` writes it (Lightning's state and the full
    fp32 ``state_dict``), assembled in memory: every rank reads every rank's partition, and nothing is written (a
    file per rank in ``TMPDIR`` was ranks x the model's size on a node's local disk).

    What Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` returns, without its ``torch.save``: DeepSpeed's
    assembled weights, and Lightning's state from the model-states file (ZeRO-3 writes one per rank, each holding it).
    """
    import_deepspeed("consolidate_checkpoint")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: PLC0415

    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints what it reads
        weights = get_fp32_state_dict_from_zero_checkpoint(str(folder))
    states = Path(ds_checkpoint_dir(folder))
    model_states = states / _ZERO3_MODEL_STATES
    if not model_states.is_file():
        model_states = states / _MODEL_STATES
    # DeepSpeed's own file (of the checkpoint asked for, not a side file): its format pickles its objects.
    saved = torch.load(model_states, map_location="cpu", weights_only=False)
    converted = {key: value for key, value in saved.items() if key not in _DEEPSPEED_STATES}
    # Checkpoints of Lightning < 2.1 name the weights under its wrapper: the prefix goes, as Lightning's converter does.
    converted["state_dict"] = {name.removeprefix("_forward_module."): value for name, value in weights.items()}
    return converted
