"""FastDDPStrategy under a real Lightning Trainer on 2 gloo processes: hooks, bytes, accumulation, resume."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_fastdist import FastDDPStrategy
from lightning_fastdist.cli import main
from lightning_fastdist.demo import TextDataModule, TinyGPT
from lightning_fastdist.parallel.comm.accounting import ALL_REDUCE, metric_name
from lightning_fastdist.parallel.ddp.buckets import gradient_bytes
from lightning_fastdist.planning.comm_model import estimate_comm
from lightning_fastdist.planning.memory_model import TrainingShape
from tests.support import workloads
from tests.support.harness import run_function


class RecordComm(L.Callback):
    """After every optimizer step, note the strategy's byte count for it and its round counter."""

    def __init__(self) -> None:
        self.step_bytes: list[int] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.step_bytes.append(trainer.strategy.hook_state.stats.last_step_bytes)


def make_trainer(strategy: FastDDPStrategy, callbacks=(), **kwargs) -> L.Trainer:
    """The shared quiet CPU Trainer, deterministic, running until ``max_steps``/``max_epochs`` given here."""
    return workloads.make_trainer(
        strategy, callbacks=list(callbacks), deterministic=True, **{"max_steps": -1, **kwargs}
    )


def small_data() -> TextDataModule:
    return TextDataModule(batch_size=4, block_size=32)


# ---------------------------------------------------------------- construction


def test_registered_as_fast_ddp():
    trainer = L.Trainer(strategy="fast_ddp", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, FastDDPStrategy)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            dict(comm_hook="fp8"),
            "comm_hook='fp8' is not supported; accepted values: 'auto', 'none', 'fp16', 'bf16', 'powersgd'",
        ),
        (dict(powersgd_rank=0), "powersgd_rank must be an integer >= 1, got 0"),
        (dict(powersgd_start_iter=1), "powersgd_start_iter must be an integer >= 2, got 1"),
        (dict(bucket_cap_mb=-5), "bucket_cap_mb must be a finite number > 0 or 'auto', got -5"),
        (dict(bucket_cap_mb="big"), "bucket_cap_mb must be a finite number > 0 or 'auto', got 'big'"),
        (
            dict(comm_hook="bf16", process_group_backend="mpi"),
            "comm_hook='bf16' needs process_group_backend in 'gloo', 'nccl'",
        ),
        (
            dict(powersgd_factor_dtype="fp8"),
            "powersgd_factor_dtype='fp8' is not supported; accepted values: 'fp32', 'fp16', 'bf16'",
        ),
    ],
)
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        FastDDPStrategy(**options)


def test_cli_yaml_options_reach_the_strategy_and_errors_are_one_line(in_tmp_dir, capsys):
    recipe = in_tmp_dir / "ddp.yaml"
    recipe.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_fastdist.FastDDPStrategy\n"
        "    init_args: {comm_hook: powersgd, powersgd_rank: 4}\n"
    )
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(recipe), "--print_config"])
    printed = capsys.readouterr().out
    assert "comm_hook: powersgd" in printed and "powersgd_rank: 4" in printed
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(recipe), "--trainer.strategy.init_args.comm_hook", "fp8"])
    assert stop.value.code == 2
    assert "comm_hook" in capsys.readouterr().err


# ---------------------------------------------------------------- bytes per step


def bytes_per_step_by_hook() -> dict:
    results = {}
    for hook in ("none", "fp16", "bf16", "powersgd"):
        torch.manual_seed(0)
        model = TinyGPT(block_size=32)
        record = RecordComm()
        strategy = FastDDPStrategy(comm_hook=hook, powersgd_start_iter=2, powersgd_rank=2)
        trainer = make_trainer(strategy, [record], max_steps=5)
        trainer.fit(model, small_data())
        results[hook] = {
            "step_bytes": record.step_bytes,
            "logged": trainer.callback_metrics[metric_name(ALL_REDUCE)].item(),
            "rounds": strategy.hook_state.stats.rounds,
            "model_bytes": gradient_bytes(model),
        }
    return results


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bytes_per_step_half_for_fp16_bf16_and_tiny_for_powersgd():
    for result in run_function(bytes_per_step_by_hook, world_size=2, timeout=300):
        full = result["none"]["model_bytes"]
        assert result["none"]["step_bytes"] == [full] * 5
        assert result["fp16"]["step_bytes"] == [full // 2] * 5
        assert result["bf16"]["step_bytes"] == [full // 2] * 5
        powersgd = result["powersgd"]["step_bytes"]
        assert powersgd[:2] == [full, full]  # exact before powersgd_start_iter
        assert all(b <= 0.10 * full for b in powersgd[2:]), [b / full for b in powersgd]
        for hook in ("none", "fp16", "bf16", "powersgd"):
            assert result[hook]["rounds"] == 5
            # Logged during step 5's training_step, so it reports step 4's bytes.
            assert result[hook]["logged"] == result[hook]["step_bytes"][3]


# ---------------------------------------------------------------- accumulation


def rounds_with_accumulation(accumulate: int, micro_batches: int) -> dict:
    record = RecordComm()
    # Exact fp32, pinned: under a loaded machine the default "auto" may measure waits and switch to bf16 at step 23.
    strategy = FastDDPStrategy(comm_hook="none")
    model = TinyGPT(n_layer=1, n_head=1, n_embd=16, block_size=8)
    trainer = make_trainer(
        strategy, [record], max_epochs=1, limit_train_batches=micro_batches, accumulate_grad_batches=accumulate
    )
    trainer.fit(model, TextDataModule(batch_size=2, block_size=8))
    stats = strategy.hook_state.stats
    return {"rounds": stats.rounds, "total_bytes": stats.total_bytes, "model_bytes": gradient_bytes(model)}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_accumulation_of_4_over_100_micro_batches_all_reduces_25_times():
    for result in run_function(rounds_with_accumulation, world_size=2, args=(4, 100), timeout=300):
        assert result["rounds"] == 25
        assert result["total_bytes"] == 25 * result["model_bytes"]
        shape = TrainingShape(result["model_bytes"] // 4, layers=1, hidden=16, seq_len=8, micro_batch=2, world_size=2)
        assert result["total_bytes"] == 25 * estimate_comm(shape, "ddp", accumulation=4).allreduce  # doctor's model


# ---------------------------------------------------------------- resume


def powersgd_state_after_two_epochs(checkpoint_dir: str, interrupted: bool) -> dict:
    def fit(max_epochs: int, ckpt_path: str | None) -> tuple[L.Trainer, FastDDPStrategy]:
        torch.manual_seed(0)
        strategy = FastDDPStrategy(comm_hook="powersgd", powersgd_start_iter=2, powersgd_rank=2)
        trainer = make_trainer(strategy, max_epochs=max_epochs, limit_train_batches=4)
        trainer.fit(TinyGPT(n_layer=2, n_head=2, n_embd=64, block_size=32), small_data(), ckpt_path=ckpt_path)
        return trainer, strategy

    if interrupted:
        trainer, _ = fit(max_epochs=1, ckpt_path=None)
        path = f"{checkpoint_dir}/after-epoch-1.ckpt"
        trainer.save_checkpoint(path)
        trainer, strategy = fit(max_epochs=2, ckpt_path=path)
    else:
        trainer, strategy = fit(max_epochs=2, ckpt_path=None)
    return {
        "state": strategy.hook_state.state_dict(),
        "weights": {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()},
    }


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_continues_with_the_same_powersgd_state_as_an_uninterrupted_run(tmp_path):
    straight = run_function(powersgd_state_after_two_epochs, world_size=2, args=(str(tmp_path), False), timeout=300)
    resumed = run_function(powersgd_state_after_two_epochs, world_size=2, args=(str(tmp_path), True), timeout=300)
    for rank in range(2):
        a, b = straight[rank]["state"], resumed[rank]["state"]
        assert a["iteration"] == b["iteration"] == 8
        assert a["errors"].keys() == b["errors"].keys() and a["errors"]
        for key in a["errors"]:
            torch.testing.assert_close(b["errors"][key], a["errors"][key], rtol=0, atol=1e-6)
            torch.testing.assert_close(b["q_memory"][key], a["q_memory"][key], rtol=0, atol=1e-6)
        for name, weight in straight[rank]["weights"].items():
            torch.testing.assert_close(resumed[rank]["weights"][name], weight, rtol=0, atol=1e-6)
    # Error feedback is per rank: the two ranks' residuals differ, so each must be restored to its own.
    key = next(iter(straight[0]["state"]["errors"]))
    assert not torch.equal(straight[0]["state"]["errors"][key], straight[1]["state"]["errors"][key])


# ---------------------------------------------------------------- activation checkpointing


def losses_with_checkpointing(mode) -> list[float]:
    record = workloads.LossRecorder()
    torch.manual_seed(0)
    model = TinyGPT(n_layer=2, n_head=2, n_embd=32, block_size=16)
    strategy = FastDDPStrategy(activation_checkpointing=mode)
    trainer = make_trainer(strategy, [record], max_steps=3)
    trainer.fit(model, TextDataModule(batch_size=4, block_size=16))
    assert all(block in list(model.blocks) for block in strategy.checkpointed_blocks)
    return [len(strategy.checkpointed_blocks), *record.losses]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_activation_checkpointing_keeps_the_losses_and_wraps_every_block():
    reference = run_function(losses_with_checkpointing, world_size=2, args=("none",))
    checkpointed = run_function(losses_with_checkpointing, world_size=2, args=("full",))
    assert reference[0][0] == 0 and checkpointed[0][0] == 2
    assert checkpointed[0][1:] == pytest.approx(reference[0][1:], rel=1e-6)


def test_bad_activation_checkpointing_and_block_names_are_refused():
    with pytest.raises(ValueError, match="activation_checkpointing: got 'partial'"):
        FastDDPStrategy(activation_checkpointing="partial")
