"""``lightning-fastdist to-lightning CHECKPOINT OUTPUT``: the way back to Lightning's own strategies.

A checkpoint of ours, whichever strategy wrote it (``FastDDPStrategy``'s file, ``FastFSDPStrategy``'s file or sharded
folder, ``FastDeepSpeedStrategy``'s folder at any stage), becomes one file in the form Lightning's ``DDPStrategy``
writes: full weights, each optimizer's state numbered by parameter, Lightning's loops, callbacks and schedulers as the
run left them. Lightning's ``DDPStrategy`` and ``ModelParallelStrategy`` resume it (``fit(ckpt_path=OUTPUT)``) where
the run stopped, with its optimizer state; ``M.load_from_checkpoint(OUTPUT)`` loads it anywhere. One process, no GPU,
no process group; written atomically. In Python: ``lightning_fastdist.to_lightning_checkpoint(checkpoint, output)``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from lightning_fastdist.parallel.checkpoint.atomic import save_file_atomically
from lightning_fastdist.parallel.checkpoint.problems import SHARDED_METADATA
from lightning_fastdist.strategies.deepspeed.to_lightning import lightning_checkpoint_of_folder
from lightning_fastdist.strategies.fsdp.one_file import one_file_of_sharded_folder


def to_lightning_checkpoint(checkpoint: str | Path, output: str | Path) -> dict[str, Any]:
    """Write our ``checkpoint`` (a file or a folder) as the one file ``output`` Lightning's strategies resume; return
    what was written. Read as Lightning reads a checkpoint (``weights_only=False``): convert only checkpoints you trust.

    Raises:
        ValueError: ``checkpoint`` is none of our checkpoints (one line naming it).
    """
    source = Path(checkpoint)
    if (source / "latest").is_file():  # DeepSpeed's folder
        converted = lightning_checkpoint_of_folder(source)
    elif (source / SHARDED_METADATA).is_file():  # FastFSDPStrategy's sharded folder
        converted = one_file_of_sharded_folder(source)
    elif source.is_file():  # already Lightning's form
        converted = torch.load(source, map_location="cpu", weights_only=False)
    else:
        raise ValueError(
            f"to-lightning: '{source}' is not a checkpoint of lightning_fastdist (a file, a sharded folder with "
            f"'{SHARDED_METADATA}', or a DeepSpeed folder with 'latest')."
        )
    save_file_atomically(lambda staged: torch.save(converted, staged), Path(output))
    return converted


def main(argv: list[str]) -> int:
    """Convert one checkpoint; a checkpoint that is not ours ends with exit status 2 and one line."""
    parser = argparse.ArgumentParser(prog="lightning-fastdist to-lightning", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint file or folder written by one of our strategies")
    parser.add_argument("output", help="the one Lightning checkpoint file to write")
    args = parser.parse_args(argv)
    try:
        to_lightning_checkpoint(args.checkpoint, args.output)
    except ValueError as error:
        parser.error(str(error).removeprefix("to-lightning: "))
    print(f"wrote {args.output}: resume it with Lightning's DDPStrategy or ModelParallelStrategy (fit(ckpt_path=...))")
    return 0
