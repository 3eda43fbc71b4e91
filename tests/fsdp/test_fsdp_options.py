"""FastFSDPStrategy options: block names, registry name, and one clear error per bad input (single process).

How ``blocks: auto`` chooses is tested on real models in tests/plan/test_blocks.py.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

import lightning_fastdist
from lightning_fastdist import FastFSDPStrategy
from lightning_fastdist.demo import Block, TinyGPT
from lightning_fastdist.demo.model import MLP
from lightning_fastdist.parallel.fsdp.sharding import fsdp_dtypes
from lightning_fastdist.parallel.plan.blocks import find_blocks, resolve_blocks


def test_auto_finds_the_repeated_transformer_block():
    model = TinyGPT(n_layer=3, n_embd=16, n_head=2, block_size=8)
    assert find_blocks(model) == [Block]
    assert resolve_blocks(model, "auto") == [Block]


def test_a_one_layer_module_list_still_names_its_block():
    assert find_blocks(TinyGPT(n_layer=1, n_head=2, n_embd=16, block_size=8)) == [Block]
    assert find_blocks(nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])) == []


def test_leaf_layers_are_never_auto_blocks():
    assert find_blocks(nn.Sequential(nn.Linear(2, 3), nn.ReLU())) == []
    assert find_blocks(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))) == []


def test_names_resolve_bare_or_qualified_and_may_name_a_leaf():
    model = TinyGPT(n_layer=2, n_embd=16, n_head=2, block_size=8)
    assert resolve_blocks(model, ["Block", "lightning_fastdist.demo.model.MLP"]) == [Block, MLP]
    assert resolve_blocks(nn.Sequential(nn.Linear(2, 3), nn.ReLU()), ["Linear"]) == [nn.Linear]


def test_a_name_that_matches_nothing_lists_the_classes_found():
    model = TinyGPT(n_layer=2, n_embd=16, n_head=2, block_size=8)
    with pytest.raises(ValueError, match=r"blocks: 'Layer' matches no module class in TinyGPT.*Block.*MLP"):
        resolve_blocks(model, ["Layer"])


def test_the_old_name_shard_modules_still_works_with_one_deprecation_line():
    with pytest.deprecated_call(match=r"FastFSDPStrategy: shard_modules is renamed blocks; write blocks=\['Block'\]"):
        strategy = FastFSDPStrategy(shard_modules=["Block"])
    assert strategy.plan.blocks == ("Block",)
    with pytest.raises(ValueError, match="shard_modules is the old name of blocks; give blocks only"):
        FastFSDPStrategy(blocks=["Block"], shard_modules=["Block"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(sharding="zero4"), r"sharding: got 'zero4'; use one of 'zero3', 'zero2', 'hsdp'"),
        (dict(sharding="hsdp", hsdp_group_size=0), r"hsdp_group_size: got 0"),
        (dict(activation_checkpointing="some"), r"activation_checkpointing: got 'some'"),
        (dict(blocks="Block"), r"blocks: got 'Block'; use 'auto' or a list of module class names, e.g. \['Block'\]"),
        (dict(checkpoint_format="zip"), r"checkpoint_format: got 'zip'; use one of 'sharded', 'full'"),
        (dict(async_checkpointing="yes"), r"FastFSDPStrategy: async_checkpointing: got 'yes'; use True or False"),
    ],
)
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(ValueError, match=message):
        FastFSDPStrategy(**options)


def test_an_hsdp_group_that_does_not_divide_the_world_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"hsdp_group_size: 3 does not divide the world size 2; use one of 1, 2"):
        L.Trainer(accelerator="cpu", devices=2, strategy=FastFSDPStrategy(sharding="hsdp", hsdp_group_size=3))


def test_registered_as_fast_fsdp():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="fast_fsdp", logger=False)
    assert isinstance(trainer.strategy, lightning_fastdist.FastFSDPStrategy)


def test_mixed_precision_policy_follows_the_trainer_precision():
    assert fsdp_dtypes("bf16-mixed") == (torch.bfloat16, torch.float32)
    assert fsdp_dtypes("16-mixed") == (torch.float16, torch.float32)
    assert fsdp_dtypes("32-true") == (None, None)
    assert fsdp_dtypes("bf16-true") == (None, None)  # the module itself is converted to bf16


def test_the_counted_collectives_call_no_deprecated_torch_function():
    import warnings

    import torch.distributed as dist

    from lightning_fastdist.parallel.comm.accounting import CommStats
    from lightning_fastdist.parallel.fsdp.comm_accounting import CountingAllGather, CountingReduceScatter

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        stats, shard = CommStats(), torch.arange(4.0)
        gathered, reduced = torch.empty(4), torch.empty(4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor
            CountingAllGather(stats)(output_tensor=gathered, input_tensor=shard, group=None)
            CountingReduceScatter(stats)(output_tensor=reduced, input_tensor=shard, group=None, op=dist.ReduceOp.SUM)
    finally:
        dist.destroy_process_group()
    assert torch.equal(gathered, shard) and torch.equal(reduced, shard)
    assert stats.total_bytes == 2 * 16
