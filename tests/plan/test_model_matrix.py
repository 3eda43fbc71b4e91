"""The compatibility matrix: models this project did not write, trained by every setup, against Lightning's DDP.

Each model of tests/support/model_zoo.py trains for a few steps on 2 CPU ranks (gloo) under
Lightning's plain ``DDPStrategy`` (with ``find_unused_parameters`` for the mixture of experts) and under each
setup below, from the same seed and data;
every rank's losses must match DDP's within the tolerance of what the setup sends
(exact in fp32, bf16 gradients, PowerSGD's low-rank approximation). All of it runs in one
spawned pair of processes to keep the cost down. docs/models.md shows the result.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import pytest

from tests.support.harness import run_function

pytestmark = pytest.mark.multiprocess

STEPS = 4
# The MLP stack has no block that "auto" could name: to checkpoint or compile per block, name its layers.
NAMED_BLOCKS = {"mlp": ["Linear"]}
# SwitchTransformers' experts sit idle on some ranks: DDP needs find_unused_parameters (Lightning's DDP too, as
# its own message says); FSDP needs nothing (parallel/plan/idle_experts.py).
DDP_OPTIONS = {"switch": {"find_unused_parameters": True}}
# FSDP units "auto" chooses (blocks + the root), by model (docs/models.md lists them).
AUTO_UNITS = {"gpt2": 3, "bert": 3, "t5": 5, "switch": 5, "lightning-transformer": 5, "resnet": 5, "mlp": 1}


@dataclass(frozen=True)
class Setup:
    """One column of the matrix: a strategy and its options, and how close its losses must be to DDP's."""

    strategy: str  # "fast_ddp" or "fast_fsdp"
    options: dict = field(default_factory=dict)
    rel: float = 1e-5  # fp32: the same sums in another order
    per_block: bool = False  # checkpoints or compiles blocks: needs blocks a model can name


SETUPS = {
    "fast_ddp none": Setup("fast_ddp"),
    "fast_ddp bf16": Setup("fast_ddp", dict(comm_hook="bf16"), rel=1e-3),
    "fast_ddp powersgd": Setup(
        "fast_ddp", dict(comm_hook="powersgd", powersgd_start_iter=2, powersgd_rank=1), rel=1e-2
    ),
    "fast_fsdp zero3": Setup("fast_fsdp"),
    "fast_fsdp zero2 + AC selective": Setup(
        "fast_fsdp", dict(sharding="zero2", activation_checkpointing="selective"), per_block=True
    ),
    # eager: dynamo traces each model as inductor would (graph breaks, recompiles), without aot_eager's extra
    # tracing of the backward (held by test_compile.py): a third less time here.
    "fast_fsdp zero3 + AC full + compile": Setup(
        "fast_fsdp", dict(activation_checkpointing="full", compile={"backend": "eager"}), per_block=True
    ),
}


def _strategy(model_name: str, setup: Setup):
    from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy

    options = dict(setup.options)
    if setup.strategy == "fast_ddp":
        options.update(DDP_OPTIONS.get(model_name, {}))
    if setup.per_block and model_name in NAMED_BLOCKS:
        options["blocks"] = NAMED_BLOCKS[model_name]
    return (FastDDPStrategy if setup.strategy == "fast_ddp" else FastFSDPStrategy)(**options)


def _fit(model_name: str, strategy) -> dict:
    import torch
    from torch.distributed.fsdp import FSDPModule

    from tests.support.model_zoo import MODELS
    from tests.support.workloads import LossRecorder, make_trainer

    torch._dynamo.reset()
    losses = LossRecorder()
    model = MODELS[model_name]()
    trainer = make_trainer(strategy, max_steps=STEPS, callbacks=[losses])
    trainer.fit(model, model.batches())
    run = {"losses": losses.losses, "units": sum(isinstance(m, FSDPModule) for m in trainer.strategy.model.modules())}
    if hasattr(strategy, "recompiles"):
        run["recompiles"] = strategy.recompiles.count
    if getattr(strategy, "comm_stats", None) is not None:
        from lightning_fastdist.parallel.comm.accounting import Traffic, metric_name

        metrics = trainer.callback_metrics
        run["comm_logged"] = {name: float(value) for name, value in metrics.items() if name.startswith("comm/")}
        last_step = strategy.comm_stats.last_step
        run["comm_counted"] = {
            metric_name(collective): float(last_step.get(collective, Traffic()).bytes)
            for collective in strategy.comm_collectives
        }
    if getattr(strategy, "comm", None) is not None and strategy.comm.name == "powersgd":
        stats = strategy.hook_state.stats
        run["compressed"] = stats.last_step_bytes < sum(p.numel() * 4 for p in model.parameters())
    if model_name == "gpt2":
        run["use_cache"] = model.model.config.use_cache
    return run


def train_the_matrix(model_names: list[str]) -> dict:
    """On each rank: every model under Lightning's DDP and every setup; a failure is kept as its message."""
    from lightning.pytorch.strategies import DDPStrategy

    runs: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for model_name in model_names:
            runs[(model_name, "ddp")] = _fit(model_name, DDPStrategy(**DDP_OPTIONS.get(model_name, {})))
            for setup_name, setup in SETUPS.items():
                try:
                    runs[(model_name, setup_name)] = _fit(model_name, _strategy(model_name, setup))
                except Exception as error:  # noqa: BLE001 - every cell of the matrix is reported
                    runs[(model_name, setup_name)] = {"error": f"{type(error).__name__}: {error}"[:500]}
    runs["our_future_warnings"] = sorted(
        {
            f"{w.filename}:{w.lineno}: {w.message}"
            for w in caught
            if issubclass(w.category, FutureWarning) and "lightning_fastdist" in w.filename
        }
    )
    return runs


@pytest.mark.slow
def test_every_model_trains_under_every_setup_with_the_losses_of_lightning_ddp():
    from tests.support.model_zoo import MODELS

    ranks = run_function(train_the_matrix, 2, args=(list(MODELS),), init_process_group=False, timeout=500)
    failures = []
    for rank, runs in enumerate(ranks):
        assert runs.pop("our_future_warnings") == []
        for model_name in MODELS:
            reference = runs[(model_name, "ddp")]["losses"]
            assert len(reference) == STEPS
            for setup_name, setup in SETUPS.items():
                run = runs[(model_name, setup_name)]
                cell = f"rank {rank} {model_name} / {setup_name}"
                if "error" in run:
                    failures.append(f"{cell}: {run['error']}")
                elif run["losses"] != pytest.approx(reference, rel=setup.rel):
                    failures.append(f"{cell}: losses {run['losses']} vs DDP {reference}")
    assert not failures, "\n".join(failures)

    runs = ranks[0]
    for model_name, units in AUTO_UNITS.items():
        assert runs[(model_name, "fast_fsdp zero3")]["units"] == units, model_name
    # blocks: [Linear], 3 of them, and the root
    assert runs[("mlp", "fast_fsdp zero3 + AC full + compile")]["units"] == 4
    assert all(runs[(name, "fast_ddp powersgd")]["compressed"] for name in MODELS)
    # The comm/ metrics are logged only when due, yet what a callback reads is the last step's count
    # (every step sends the same bytes by the end of these runs, PowerSGD's compressed steps included).
    for (model_name, setup_name), run in runs.items():
        if setup_name != "ddp":
            assert run["comm_logged"] == run["comm_counted"] != {}, (model_name, setup_name)
    # HuggingFace's KV cache was turned off for per-block work: GPT-2's two layers share one graph.
    compiled = runs[("gpt2", "fast_fsdp zero3 + AC full + compile")]
    assert compiled["use_cache"] is False and compiled["recompiles"] == 0
    assert runs[("gpt2", "fast_fsdp zero3")]["use_cache"] is True  # left alone where nothing needs it off
