"""A FastDeepSpeedStrategy checkpoint folder as the one file Lightning's ``DDPStrategy`` writes and resumes: the full
fp32 weights, the optimizer's state per parameter, and Lightning's own state as saved (loops, callbacks, schedulers).

``consolidate.py`` gives the weights alone, for inference; a resume needs the optimizer's state too, which ZeRO keeps in
every rank's partition (``parallel/deepspeed/folder_state.py`` joins it per parameter). ``commands/to_lightning.py``
writes the result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.utilities.types import _PATH

from lightning_fastdist.parallel.deepspeed.folder_state import folder_training_state
from lightning_fastdist.parallel.deepspeed.runtime import import_deepspeed


def lightning_checkpoint_of_folder(folder: _PATH) -> dict[str, Any]:
    """The DeepSpeed checkpoint ``folder`` as Lightning's ``DDPStrategy`` writes a checkpoint. One process; DeepSpeed
    installed (its objects are in the files)."""
    import_deepspeed("to-lightning")
    weights, optimizer, saved = folder_training_state(Path(folder))
    return {**saved, "state_dict": weights, "optimizer_states": [optimizer]}
