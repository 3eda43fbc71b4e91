"""Selective activation checkpointing under FSDP2's bf16 policy, on models this project did not write.

FSDP casts a unit's inputs in a pre-forward hook that runs before checkpointing's in the forward and
inside the recomputation in the backward; selective checkpointing then met ops its forward never ran
and every step failed (found by ``doctor --simulate`` on a HuggingFace Llama). The blocks now cast
their own inputs inside the checkpointed region: the losses equal those without checkpointing.
"""

from __future__ import annotations

import pytest

from tests.support.harness import run_function

pytestmark = pytest.mark.multiprocess

STEPS = 3


def losses_by_setup(model_names: list[str]) -> dict:
    import torch

    from lightning_fastdist import FastFSDPStrategy, FastMixedPrecision
    from tests.support.model_zoo import MODELS, HFLlama
    from tests.support.workloads import LossRecorder, make_trainer

    models = {**MODELS, "llama": HFLlama}
    runs = {}
    for name in model_names:
        for sharding in ("zero2", "zero3"):
            for checkpointing in ("none", "selective"):
                torch.manual_seed(0)
                model, recorder = models[name](), LossRecorder()
                data = MODELS["gpt2"]().batches() if name == "llama" else model.batches()
                strategy = FastFSDPStrategy(sharding=sharding, activation_checkpointing=checkpointing)
                plugins = [FastMixedPrecision("bf16-mixed", device="cpu")]
                trainer = make_trainer(strategy, max_steps=STEPS, callbacks=[recorder], plugins=plugins)
                trainer.fit(model, data)
                runs[(name, sharding, checkpointing)] = recorder.losses
    return runs


@pytest.mark.slow
def test_selective_checkpointing_trains_under_bf16_mixed_with_the_losses_of_no_checkpointing():
    models = ["llama", "gpt2", "lightning-transformer"]
    for runs in run_function(losses_by_setup, 2, args=(models,), init_process_group=False, timeout=300):
        for name in models:
            for sharding in ("zero2", "zero3"):
                reference = runs[(name, sharding, "none")]
                assert len(reference) == STEPS
                assert runs[(name, sharding, "selective")] == pytest.approx(reference, rel=1e-6), (name, sharding)
