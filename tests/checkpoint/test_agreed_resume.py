"""Every rank resumes from the same checkpoint (issue 56, item 5): a read error on one rank only (an NFS hiccup after
a requeue) made that rank alone fall back to an older checkpoint, and the ranks resumed from different steps.

Two forked gloo ranks run the strategies' own ``load_or_fall_back`` on tiny files; the read error is rank 1's ``load``
raising for one file, since a hiccup of a network file system cannot be made to order here.
"""

from __future__ import annotations

import errno
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_fastdist.parallel.checkpoint.problems import UnusableCheckpointError
from lightning_fastdist.strategies.across_nodes import OneWorld
from lightning_fastdist.strategies.checkpoint.fault_tolerance import load_or_fall_back
from lightning_fastdist.strategies.checkpoint.saves import CheckpointSaves
from tests.support.harness import run_function


def resume_where_rank_1_cannot_read(folder: str, unreadable: str) -> dict:
    """This rank's resume from ``last.ckpt`` (the fall-back allowed) and from ``step=3.ckpt`` given by path, where
    rank 1 cannot read ``unreadable``."""
    rank = dist.get_rank()
    module = SimpleNamespace(_trainer=None)  # what load_or_fall_back reads of a strategy: no trainer, one world
    saves = CheckpointSaves(SimpleNamespace(lightning_module=module), asynchronous=False)  # nothing in flight
    strategy = SimpleNamespace(lightning_module=module, shared=SimpleNamespace(across_nodes=OneWorld(), saves=saves))

    def load(path: Path) -> dict:
        if rank == 1 and path.name == unreadable:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return torch.load(path, weights_only=True)

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        checkpoint, loaded = load_or_fall_back(strategy, Path(folder) / "last.ckpt", load, expects_folder=False)
    outcome = {"last": (Path(loaded).name, checkpoint["global_step"]), "warned": [str(w.message) for w in warned]}
    outcome["by_path"] = "loaded"
    try:
        load_or_fall_back(strategy, Path(folder) / "step=3.ckpt", load, expects_folder=False)
    except UnusableCheckpointError as error:
        outcome["by_path"] = str(error)
    return outcome


@pytest.mark.multiprocess
def test_a_checkpoint_one_rank_cannot_read_is_skipped_by_every_rank(tmp_path):
    torch.save({"global_step": 2}, tmp_path / "step=2.ckpt")
    torch.save({"global_step": 3}, tmp_path / "step=3.ckpt")
    torch.save({"global_step": 4}, tmp_path / "last.ckpt")
    ranks = run_function(resume_where_rank_1_cannot_read, 2, args=(str(tmp_path), "last.ckpt"), timeout=60)
    assert [rank["last"] for rank in ranks] == [("step=3.ckpt", 3)] * 2  # the newest every rank reads
    assert "(on rank 1 of 2; the others read it)" in ranks[0]["warned"][0]
    ranks = run_function(resume_where_rank_1_cannot_read, 2, args=(str(tmp_path), "step=3.ckpt"), timeout=60)
    assert [rank["last"] for rank in ranks] == [("last.ckpt", 4)] * 2
    line = f"checkpoint '{tmp_path / 'step=3.ckpt'}' cannot be loaded: OSError: [Errno 5] Input/output error"
    assert ranks[0]["by_path"] == ranks[1]["by_path"]  # given by path: every rank refuses it alike, in one line
    assert ranks[0]["by_path"].startswith(line) and "(on rank 1 of 2; the others read it)." in ranks[0]["by_path"]
