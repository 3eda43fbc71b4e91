"""Lightning's DDP contract kept by FastDDPStrategy (and FastFSDPStrategy where it applies).

Every ``start_method`` trains, extra keyword arguments reach ``DistributedDataParallel``,
the strategies pickle, and Lightning's callable comm-hook arguments are refused with the
option to use instead, before any process starts.
"""

from __future__ import annotations

import pickle

import lightning as L
import pytest
import torch

from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy
from tests.support.workloads import make_trainer, repeated_batches, tiny_gpt


class LogDDPSettings(L.Callback):
    """Logs what the wrapped DDP module was built with, so that the values travel back from spawned ranks."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        ddp = trainer.strategy.model
        module.log("ddp_broadcast_buffers", float(ddp.broadcast_buffers))
        module.log("ddp_bucket_cap_mb", float(ddp.bucket_bytes_cap) / 2**20)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_spawn_and_fork_train_and_extra_arguments_reach_distributed_data_parallel():
    # "forkserver" pickles the trainer as "spawn" does (the pickling tests below); "popen" is every other test.
    for start_method in ("spawn", "fork"):
        strategy = FastDDPStrategy(start_method=start_method, broadcast_buffers=False, init_sync=False, bucket_cap_mb=2)
        model = tiny_gpt()
        before = model.lm_head.weight.detach().clone()
        trainer = make_trainer(strategy, max_steps=2, callbacks=[LogDDPSettings()])
        trainer.fit(model, repeated_batches())
        metrics = trainer.callback_metrics  # sent back from rank 0 by Lightning's launcher
        assert metrics["ddp_broadcast_buffers"] == 0.0, start_method
        assert metrics["ddp_bucket_cap_mb"] == 2.0, start_method
        assert torch.isfinite(metrics["train_loss"]), start_method
        assert not torch.equal(model.lm_head.weight, before), start_method  # trained weights come back


@pytest.mark.parametrize(
    "strategy",
    [
        lambda: FastDDPStrategy(comm_hook="powersgd", compile={"backend": "eager"}, broadcast_buffers=False),
        lambda: FastFSDPStrategy(compile={"backend": "eager"}, async_checkpointing=True, blocks=["Block"]),
    ],
    ids=["fast_ddp", "fast_fsdp"],
)
def test_a_strategy_in_a_trainer_pickles_while_it_watches_recompiles(strategy):
    strategy = strategy()
    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    strategy.recompiles.start()
    try:
        copy = pickle.loads(pickle.dumps(strategy))
    finally:
        strategy.recompiles.stop()
    assert type(copy) is type(strategy) and copy.plan.compile_config == {"backend": "eager"}
    assert copy.recompiles.count == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(ddp_comm_hook=print),
         "FastDDPStrategy: ddp_comm_hook is not taken; name the hook instead: comm_hook='fp16'"),
        (dict(ddp_comm_state=object()), "ddp_comm_state is not taken; use comm_hook='powersgd' with powersgd_rank"),
        (dict(ddp_comm_wrapper=print), "ddp_comm_wrapper is not taken; use comm_hook='fp16' or 'bf16' instead"),
        (dict(model_averaging_period=4), "model_averaging_period is not taken; post-local SGD is not offered"),
        (dict(broadcast_bufers=False),
         "'broadcast_bufers' is an option of neither FastDDPStrategy nor DistributedDataParallel; "
         "DistributedDataParallel takes: output_device, dim, broadcast_buffers, init_sync"),
        (dict(device_ids=[0]), "'device_ids' is an option of neither"),  # the strategy sets it
    ],
)  # fmt: skip
def test_arguments_distributed_data_parallel_would_refuse_are_refused_at_construction(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        FastDDPStrategy(**options)


def test_the_old_name_block_modules_still_works_with_one_deprecation_line():
    with pytest.deprecated_call(match=r"FastDDPStrategy: block_modules is renamed blocks; write blocks=\['Block'\]"):
        strategy = FastDDPStrategy(block_modules="Block")
    assert strategy.plan.blocks == ("Block",)


def test_a_recipe_passes_distributed_data_parallel_arguments_as_with_lightnings_ddp(in_tmp_dir, capsys):
    from lightning_fastdist.cli import main

    recipe = in_tmp_dir / "ddp.yaml"
    recipe.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_fastdist.FastDDPStrategy\n"
        "    init_args: {broadcast_buffers: false, init_sync: false}\n"
    )
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(recipe), "--print_config"])
    printed = capsys.readouterr().out
    assert "broadcast_buffers: false" in printed and "init_sync: false" in printed


def test_an_unusable_checkpoint_is_still_the_value_error_lightning_raises():
    from lightning_fastdist.parallel.checkpoint.problems import UnusableCheckpointError

    with pytest.raises(ValueError):  # a user's `except ValueError` around Lightning's load keeps working
        raise UnusableCheckpointError("'x.ckpt' is not a checkpoint")


def test_fsdp_refuses_a_model_holding_fsdp1_modules_with_lightnings_type_error():
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel

    legacy = FullyShardedDataParallel.__new__(FullyShardedDataParallel)  # FSDP1 cannot be built on CPU
    nn.Module.__init__(legacy)
    model = tiny_gpt()
    model.legacy = legacy
    strategy = FastFSDPStrategy()
    strategy.model = model
    strategy.accelerator = object()
    with pytest.raises(TypeError, match="FullyShardedDataParallel` \\(FSDP1\\); FastFSDPStrategy shards with FSDP2"):
        strategy.setup(L.Trainer(logger=False))
