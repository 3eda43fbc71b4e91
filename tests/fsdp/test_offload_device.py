"""FSDP2 ``cpu_offload`` on a GPU run: autocast follows the mesh's device, offloaded shards are made in host memory.

No GPU here: the meta device stands for "a device other than the CPU", as in tests/fsdp/test_fsdp_call_paths.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from lightning_fastdist import FastMixedPrecision
from lightning_fastdist.precision import compute_device_type
from lightning_fastdist.strategies.fsdp.meta_device import materialize
from lightning_fastdist.strategies.fsdp.sharded_module import move_all_but_parameters


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def reset_parameters(self) -> None:
        self.scale.fill_(1.0)


@pytest.fixture
def one_rank_mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_autocast_device_comes_from_the_mesh_not_from_where_a_shard_lives(one_rank_mesh):
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    fully_shard(model, mesh=one_rank_mesh)  # shards on the meta device, mesh on "cpu": like a CPU shard, CUDA mesh
    assert next(model.parameters()).device.type == "meta"
    assert compute_device_type(model) == "cpu"
    FastMixedPrecision("bf16-mixed", device="cpu").connect(model, [], [])  # refused before: "the model is on meta"
    with pytest.raises(ValueError, match="device is 'cuda' but the model is on 'cpu'; pass device='cpu'"):
        FastMixedPrecision("bf16-mixed", device="cuda").connect(nn.Linear(2, 2), [], [])
    assert compute_device_type(nn.ReLU()) is None  # nothing to check without parameters
    FastMixedPrecision("bf16-mixed", device="cpu").connect(nn.ReLU(), [], [])


def test_offloaded_shards_of_a_meta_model_are_made_on_the_cpu_and_buffers_go_to_the_device(one_rank_mesh):
    with torch.device("meta"):
        model = WithBuffer()
    fully_shard(model, mesh=one_rank_mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    device = torch.device("meta")  # stands for the GPU
    materialize(model, device, cpu_offload=True)
    move_all_but_parameters(model, device)
    shards = [parameter.to_local() for parameter in model.parameters()]
    assert all(shard.device.type == "cpu" for shard in shards)  # where FSDP2's offload policy wants them
    assert all(torch.isfinite(shard).all() for shard in shards) and shards[0].abs().sum() > 0  # reset_parameters ran
    assert model.scale.is_meta  # a module holding parameters still gets its buffers moved
