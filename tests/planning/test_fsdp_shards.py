"""The elements one rank holds under FSDP2, by the arithmetic, against the local shards ``fully_shard`` makes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_fastdist.planning.fsdp_shards import shard_numel, shard_numels


def uneven() -> nn.Module:
    """Dims 0 of 3, 7 and 2 rows over 4 ranks: short chunks, an empty one, and rows of several elements."""
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(5, 3), nn.Embedding(7, 2), nn.LayerNorm(2))


@pytest.mark.parametrize("rank", range(4))
def test_each_rank_holds_what_fully_shard_gives_it(rank):
    dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
    try:
        model = fully_shard(uneven(), mesh=init_device_mesh("cpu", (4,)))
        local = [p.to_local().numel() for p in model.parameters()]
    finally:
        dist.destroy_process_group()
    assert [shard_numel(p.shape, 4, rank) for p in uneven().parameters()] == local


def test_the_ranks_hold_every_element_once_and_one_rank_holds_all():
    model = uneven()
    parts = [model[0], model[1:]]
    assert [sum(shard_numels(parts, 4, rank)[i] for rank in range(4)) for i in (0, 1)] == [18, 18]
    assert shard_numels(parts, 4, 0) == [6, 6] and shard_numels(parts, 4, 3) == [0, 2]
    assert shard_numels(parts, 1, 0) == [sum(p.numel() for p in part.parameters()) for part in parts]
