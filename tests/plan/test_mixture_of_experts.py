"""A mixture of experts with one module per expert (SwitchTransformers): experts idle on some ranks, a router that
keeps its own dtype. The model matrix holds the losses under every setup (tests/plan/test_model_matrix.py); here, what
each engine does with it, and what it refuses in one line."""

from __future__ import annotations

import pytest
import torch

from lightning_fastdist.parallel.plan.blocks import block_modules, find_blocks
from lightning_fastdist.parallel.plan.idle_experts import IdleExperts
from tests.support.harness import run_function
from tests.support.model_zoo import MODELS


def test_experts_no_token_reached_get_zero_gradients_and_dense_models_get_no_hook():
    model = MODELS["switch"]()
    units = [*block_modules(model, find_blocks(model)), model]
    experts = IdleExperts(model, units)
    assert experts.describe() == "2 SwitchTransformersExperts of 16 experts each"
    model.model(**next(iter(model.batches()))).loss.backward()
    all_experts = [expert for tracker in experts.trackers for expert in tracker.experts]
    called = {id(expert) for tracker in experts.trackers for expert in tracker.experts if id(expert) in tracker.called}
    idle = [expert for expert in all_experts if id(expert) not in called]
    assert idle and len(idle) < len(all_experts)  # the batch leaves some experts idle
    assert all(p.grad is not None and not p.grad.any() for expert in idle for p in expert.parameters())
    assert all(
        p.grad is not None and p.grad.any() for expert in all_experts if expert not in idle for p in expert.parameters()
    )
    for name in ("gpt2", "t5", "bert", "lightning-transformer", "resnet", "mlp"):
        dense = MODELS[name]()
        assert IdleExperts(dense, [*block_modules(dense, find_blocks(dense)), dense]).trackers == [], name


def _train(setup: str) -> list[float] | str:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_fastdist import FastDeepSpeedStrategy, FastFSDPStrategy
    from tests.support.workloads import LossRecorder, make_trainer

    strategies = {
        "ddp find_unused": lambda: DDPStrategy(find_unused_parameters=True),
        "zero2 bf16": lambda: FastFSDPStrategy(sharding="zero2"),
        "zero2 bf16 keep_fp32": lambda: FastFSDPStrategy(sharding="zero2", keep_fp32=["SwitchTransformersTop1Router"]),
        "deepspeed stage 2": lambda: FastDeepSpeedStrategy(stage=2),
        "deepspeed stage 3": lambda: FastDeepSpeedStrategy(stage=3),
    }
    losses = LossRecorder()
    model = MODELS["switch"]()
    precision = "bf16-mixed" if "bf16" in setup else "32-true"
    trainer = make_trainer(strategies[setup](), max_steps=4, callbacks=[losses], precision=precision)
    try:
        trainer.fit(model, model.batches())
    except Exception as error:  # noqa: BLE001 - the refusals are the result
        return f"{type(error).__name__}: {error}"
    return losses.losses


def train_each(setups: list[str]) -> dict:
    return {setup: _train(setup) for setup in setups}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_engine_trains_the_experts_or_refuses_in_one_line():
    setups = ["ddp find_unused", "zero2 bf16", "zero2 bf16 keep_fp32", "deepspeed stage 2", "deepspeed stage 3"]
    for rank, runs in enumerate(run_function(train_each, 2, args=(setups,), init_process_group=False, timeout=400)):
        reference = runs["ddp find_unused"]
        # The router casts itself to float32 inside a bfloat16 unit: refused at the first forward, no abort.
        refused = runs["zero2 bf16"]
        assert refused.startswith("ParameterDtypeChangedError: keep_fp32: 'layer.1.mlp.router.classifier'")
        assert "keep_fp32: ['SwitchTransformersTop1Router']" in refused and "\n" not in refused
        # Named, the router is a float32 unit of its own: bf16 training close to fp32's.
        assert runs["zero2 bf16 keep_fp32"] == pytest.approx(reference, rel=2e-2), rank
        # Stage 2 trains (an expert idle on every rank still moves by AdamW's momentum: looser than FSDP's match);
        # stage 3 is refused before the first step.
        assert runs["deepspeed stage 2"] == pytest.approx(reference, rel=1e-2), rank
        assert runs["deepspeed stage 2"][0] == pytest.approx(reference[0], rel=1e-6)
        assert runs["deepspeed stage 3"].startswith("ValueError: FastDeepSpeedStrategy: stage 3 cannot train experts")
    assert torch.isfinite(torch.tensor(reference)).all()
