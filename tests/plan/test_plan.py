"""ParallelPlan and FSDPSharding on their own: the order the wrapper sees, and checks made once, when built."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.distributed._composable import checkpoint

from lightning_fastdist.parallel.fsdp.sharding import FSDPSharding
from lightning_fastdist.parallel.plan.parallel_plan import ParallelPlan, PreparedBlocks
from tests.support.model_zoo import HFCausalLM


def is_compiled(module: torch.nn.Module) -> bool:
    return hasattr(module.forward, "_torchdynamo_orig_callable")


def test_the_wrapper_meets_a_huggingface_model_with_its_cache_off_and_its_blocks_checkpointed_then_compiled():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    module = HFCausalLM()
    seen: dict[str, object] = {}

    def wrap(model: torch.nn.Module, prepared: PreparedBlocks) -> str:
        seen["use_cache"] = model.model.config.use_cache
        seen["checkpointed"] = [checkpoint.state(block) is not None for block in prepared.checkpointed]
        seen["compiled"] = [is_compiled(block) for block in prepared.compiled]
        return "wrapped"

    lines: list[str] = []
    plan = ParallelPlan(activation_checkpointing="full", compile={"backend": "eager"})
    wrapped, prepared = plan.apply(module, wrap, log=lines.append)

    assert wrapped == "wrapped"
    assert prepared.block_classes == (GPT2Block,)
    assert prepared.checkpointed == prepared.compiled == tuple(module.model.transformer.h)
    assert seen == {"use_cache": False, "checkpointed": [True, True], "compiled": [True, True]}
    assert lines[0] == "blocks: GPT2Block x 2 (+ root: wte, wpe, ln_f, lm_head)"
    assert lines[1].startswith("use_cache: off for training in model: activation checkpointing and per-block compile")


def test_whole_model_compile_without_checkpointing_resolves_no_block():
    module = HFCausalLM()
    _, prepared = ParallelPlan(compile={"backend": "eager"}, compile_scope="model").apply(module)
    assert prepared == PreparedBlocks(compiled=(module,))
    assert is_compiled(module) and module.model.config.use_cache  # the cache is only turned off for blocks


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"blocks": "Block"}, "blocks: got 'Block'; use 'auto' or a list of module class names"),
        ({"activation_checkpointing": "some"}, "activation_checkpointing: got 'some'"),
        ({"activation_checkpointing": 0}, "activation_checkpointing: got 0"),
        ({"compile": {"backend": "nope"}}, "compile.backend: 'nope' is not a torch.compile backend"),
        ({"compile_scope": "layers"}, "compile_scope: got 'layers'; accepted values: 'blocks', 'model'"),
    ],
)
def test_a_bad_value_fails_when_the_plan_is_built_naming_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        ParallelPlan(**options)


def test_a_plan_travels_to_spawned_processes_unchanged():
    plan = ParallelPlan(blocks=["Block"], activation_checkpointing=2, compile={"backend": "eager"})
    copy = pickle.loads(pickle.dumps(plan))
    assert copy == plan and copy.blocks == ("Block",) and copy.compile_config == {"backend": "eager"}


def test_hsdp_takes_one_node_as_its_group_unless_told_and_refuses_a_group_that_does_not_divide_the_world():
    assert FSDPSharding("hsdp").for_world(8, devices_per_node=4).hsdp_group_size == 4
    assert FSDPSharding("hsdp", hsdp_group_size=2).for_world(8, devices_per_node=4).hsdp_group_size == 2
    assert FSDPSharding("zero3").for_world(8, devices_per_node=4) == FSDPSharding("zero3")
    with pytest.raises(ValueError, match="hsdp_group_size: 3 does not divide the world size 8; use one of 1, 2, 4, 8"):
        FSDPSharding("hsdp", hsdp_group_size=3).for_world(8, devices_per_node=4)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "zero4"}, "sharding: got 'zero4'; use one of 'zero3', 'zero2', 'hsdp'"),
        ({"mode": "zero3", "hsdp_group_size": 2}, "hsdp_group_size: only used with sharding='hsdp'"),
        ({"mode": "hsdp", "hsdp_group_size": 0}, "hsdp_group_size: got 0; use a positive integer"),
    ],
)
def test_a_bad_sharding_fails_when_built_naming_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        FSDPSharding(**options)
