"""FastFSDPStrategy on 2 real gloo processes: shards, per-rank bytes, reduce-scatter counts, losses.

Losses equal to Lightning's DDPStrategy (fp32, zero2/zero3, five models) are checked in tests/plan/test_model_matrix.py.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_fastdist.parallel.comm.collective_names import ALL_GATHER_FUNCTION, REDUCE_SCATTER_FUNCTION
from lightning_fastdist.planning.comm_model import estimate_comm
from lightning_fastdist.planning.memory_model import TrainingShape
from tests.support.harness import run_function
from tests.support.workloads import LossRecorder, make_trainer, repeated_batches, tiny_gpt

pytestmark = pytest.mark.multiprocess


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _global_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()  # a DTensor reports its global shape


class MeasureShards(L.Callback):
    """At the second optimizer step (gradients and optimizer state both exist), count local and global bytes."""

    def __init__(self) -> None:
        self.report: dict = {}

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        if trainer.global_step != 1:
            return
        params = list(module.parameters())
        states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        tensors = params + [p.grad for p in params] + states
        self.report = {
            "all_params_dtensor": all(isinstance(p, DTensor) for p in params),
            "grads_dtensor": all(isinstance(p.grad, DTensor) for p in params),
            "local_bytes": sum(_local_bytes(t) for t in tensors),
            "global_bytes": sum(_global_bytes(t) for t in tensors),
            "units": [name for name, m in trainer.strategy.model.named_modules() if isinstance(m, FSDPModule)],
        }


class CountCollectives(L.Callback):
    """Counts the real FSDP collective calls (``torch.distributed`` functions, wrapped) during each micro-batch."""

    FUNCTIONS = {
        "reduce_scatter": REDUCE_SCATTER_FUNCTION,
        "all_reduce": "all_reduce",
        "all_gather": ALL_GATHER_FUNCTION,
    }
    NAMES = tuple(FUNCTIONS)

    def __init__(self) -> None:
        self.per_batch: dict[str, list[int]] = {name: [] for name in self.NAMES}
        self._counts = dict.fromkeys(self.NAMES, 0)
        for name, function in self.FUNCTIONS.items():
            setattr(dist, function, self._counting(name, getattr(dist, function)))  # called as dist.<function>(...)

    def _counting(self, name, original):
        def counting(*args, **kwargs):
            self._counts[name] += 1
            return original(*args, **kwargs)

        return counting

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._counts = dict.fromkeys(self.NAMES, 0)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        for name, count in self._counts.items():
            self.per_batch[name].append(count)


def doctor_estimate(parameter_bytes: int, mode: str, accumulation: int) -> dict[str, int]:
    """What ``lightning-fastdist doctor``'s communication model predicts for tiny_gpt (fp32) on 2 ranks."""
    shape = TrainingShape(parameter_bytes // 4, layers=2, hidden=32, seq_len=16, micro_batch=4, world_size=2)
    return estimate_comm(shape, mode, accumulation).by_collective()


def count_comm_logs(model: L.LightningModule) -> list[str]:
    """The names of the ``comm/`` metrics ``model.log`` is called with, in order (each call still logs)."""
    names: list[str] = []
    log = model.log

    def counting_log(name: str, value, **options):
        if name.startswith("comm/"):
            names.append(name)
        return log(name, value, **options)

    model.log = counting_log
    return names


def train_and_measure(sharding: str, accumulate: int, hsdp_group_size: int | None, world_size: int = 2) -> dict:
    from lightning_fastdist import FastFSDPStrategy

    shards, collectives, losses = MeasureShards(), CountCollectives(), LossRecorder()
    strategy = FastFSDPStrategy(sharding=sharding, hsdp_group_size=hsdp_group_size)
    trainer = make_trainer(
        strategy, world_size, max_steps=2, accumulate_grad_batches=accumulate, callbacks=[shards, collectives, losses]
    )
    model = tiny_gpt()
    comm_logs = count_comm_logs(model)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    trainer.fit(model, repeated_batches())
    counted = {name: (t.calls, t.bytes) for name, t in strategy.comm_stats.last_step.items()}
    logged = {name: float(value) for name, value in trainer.callback_metrics.items() if name.startswith("comm/")}
    return {
        **shards.report,
        **collectives.per_batch,
        "losses": losses.losses,
        "parameter_bytes": parameter_bytes,
        "root_parameter_bytes": parameter_bytes - block_bytes,
        "counted_last_step": counted,
        "logged": logged,
        "comm_log_calls": len(comm_logs),
        "rounds": strategy.comm_stats.rounds,
    }


@pytest.mark.slow
def test_zero3_shards_everything_and_reduce_scatters_only_on_the_last_micro_batch():
    ranks = run_function(train_and_measure, 2, args=("zero3", 4, None), init_process_group=False)
    for rank in ranks:
        assert rank["all_params_dtensor"] and rank["grads_dtensor"]
        assert rank["units"] == [
            "",
            "module.blocks.0",
            "module.blocks.1",
        ]  # the root around the LightningModule, two blocks
        assert rank["local_bytes"] <= rank["global_bytes"] / 2 * 1.05
        # 2 optimizer steps x 4 micro-batches; one reduce-scatter per unit, on micro-batches 4 and 8 only
        assert rank["reduce_scatter"] == [0, 0, 0, 3, 0, 0, 0, 3]
        assert rank["all_reduce"] == [0] * 8
        # Each block gathered for forward and again for backward; the root once, kept from the end
        # of forward (the head) to the start of backward.
        assert rank["all_gather"] == [5] * 8
        # Bytes per optimizer step, fp32, no padding (every dim 0 is even): the blocks' parameters
        # twice and the root's once per micro-batch; every gradient reduce-scattered once per step.
        size, root = rank["parameter_bytes"], rank["root_parameter_bytes"]
        assert rank["counted_last_step"] == {"allgather": (20, 4 * (2 * size - root)), "reduce_scatter": (3, size)}
        assert {name: b for name, (_, b) in rank["counted_last_step"].items()} == doctor_estimate(size, "zero3", 4)
        assert rank["logged"] == {
            "comm/allgather_bytes_per_step": 4 * (2 * size - root),
            "comm/reduce_scatter_bytes_per_step": size,
        }
        # Logged when the counts change (the first micro-batch, the first after step 1), not on all 8.
        assert rank["comm_log_calls"] == 2 * 2
        assert rank["rounds"] == 2  # one gradient synchronisation per optimizer step
    assert ranks[0]["losses"] == pytest.approx(ranks[1]["losses"])


@pytest.mark.slow
def test_zero2_shards_state_at_rest_like_zero3_and_gathers_once_per_accumulated_step():
    zero2 = run_function(train_and_measure, 2, args=("zero2", 4, None), init_process_group=False)
    zero3 = run_function(train_and_measure, 2, args=("zero3", 4, None), init_process_group=False)
    for rank, zero3_rank in zip(zero2, zero3):
        assert rank["all_params_dtensor"]
        assert rank["local_bytes"] <= rank["global_bytes"] / 2 * 1.05
        assert rank["reduce_scatter"] == [0, 0, 0, 3, 0, 0, 0, 3]
        # Gathered on the first micro-batch and kept, through backward, until the step's last one.
        assert rank["all_gather"] == [3, 0, 0, 0, 3, 0, 0, 0]
        size = rank["parameter_bytes"]
        assert rank["counted_last_step"] == {"allgather": (3, size), "reduce_scatter": (3, size)}
        assert {name: b for name, (_, b) in rank["counted_last_step"].items()} == doctor_estimate(size, "zero2", 4)
        assert rank["losses"] == pytest.approx(zero3_rank["losses"], rel=1e-6)


@pytest.mark.slow
def test_hsdp_with_groups_of_one_replicates_and_all_reduces_across_groups():
    ranks = run_function(train_and_measure, 2, args=("hsdp", 1, 1), init_process_group=False)
    for rank in ranks:
        assert rank["all_params_dtensor"]
        assert rank["local_bytes"] == rank["global_bytes"]  # shard groups of 1: every rank holds everything
        assert rank["all_reduce"] == [3, 3] and rank["reduce_scatter"] == [0, 0]
        assert rank["counted_last_step"]["allreduce"] == (3, rank["parameter_bytes"])
        assert "reduce_scatter" not in rank["counted_last_step"]
    assert ranks[0]["losses"] == pytest.approx(ranks[1]["losses"])


@pytest.mark.slow
def test_hsdp_on_four_ranks_reduce_scatters_in_pairs_and_all_reduces_the_shards_across_them():
    hsdp = run_function(train_and_measure, 4, args=("hsdp", 1, 2, 4), init_process_group=False, timeout=240)
    zero3 = run_function(train_and_measure, 2, args=("zero3", 1, None), init_process_group=False)
    for rank in hsdp:
        assert rank["local_bytes"] <= rank["global_bytes"] / 2 * 1.05  # sharded within a pair of ranks
        assert rank["reduce_scatter"] == [3, 3] and rank["all_reduce"] == [3, 3]
        size, root = rank["parameter_bytes"], rank["root_parameter_bytes"]
        assert rank["counted_last_step"] == {
            "allgather": (5, 2 * size - root),
            "reduce_scatter": (3, size),
            "allreduce": (3, size // 2),  # each pair's gradient shards, across the two pairs
        }
        # Every rank sees the same batch, so the averaged gradient, and the loss, do not depend on the layout.
        assert rank["losses"] == pytest.approx(zero3[0]["losses"], rel=1e-5)


class BuildOnMeta(L.Callback):
    """Records, once training starts, whether any parameter is still on the meta device."""

    def __init__(self) -> None:
        self.meta_after_setup: bool | None = None

    def on_train_start(self, trainer, module) -> None:
        self.meta_after_setup = any(p.is_meta for p in module.parameters())


def train_meta_initialised_model() -> dict:
    from lightning_fastdist import FastFSDPStrategy
    from lightning_fastdist.demo import Block, TinyGPT

    class MetaBlocksGPT(TinyGPT):
        """Builds its blocks in configure_model on the meta device, as a model too big for one rank would."""

        def configure_model(self) -> None:
            hp = self.hparams
            with torch.device("meta"):
                self.blocks = nn.ModuleList(Block(hp.n_embd, hp.n_head, hp.dropout) for _ in range(hp.n_layer))
            self.blocks_were_meta = all(p.is_meta for p in self.blocks.parameters())

    torch.manual_seed(0)
    model = MetaBlocksGPT(n_layer=2, n_embd=32, n_head=2, block_size=16)
    probe, losses = BuildOnMeta(), LossRecorder()
    make_trainer(FastFSDPStrategy(), max_steps=5, callbacks=[probe, losses]).fit(model, repeated_batches())
    return {
        "built_on_meta": model.blocks_were_meta,
        "meta_after_setup": probe.meta_after_setup,
        "losses": losses.losses,
    }


@pytest.mark.slow
def test_a_model_built_on_the_meta_device_is_materialised_shard_by_shard_and_trains():
    for rank in run_function(train_meta_initialised_model, 2, init_process_group=False):
        assert rank["built_on_meta"] and rank["meta_after_setup"] is False
        losses = rank["losses"]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


class OffloadedUnits(L.Callback):
    """Records whether every parameter of every FSDP unit is marked for CPU offload (read from FSDP2's state)."""

    def __init__(self) -> None:
        self.all_offloaded: bool | None = None

    def on_train_start(self, trainer, module) -> None:
        units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        params = [p for u in units for group in u._get_fsdp_state()._fsdp_param_groups for p in group.fsdp_params]
        self.all_offloaded = bool(params) and all(p.offload_to_cpu for p in params)


def train_with_offload(cpu_offload: bool) -> dict:
    from lightning_fastdist import FastFSDPStrategy

    probe, losses = OffloadedUnits(), LossRecorder()
    make_trainer(FastFSDPStrategy(cpu_offload=cpu_offload), max_steps=4, callbacks=[probe, losses]).fit(
        tiny_gpt(), repeated_batches()
    )
    return {"all_offloaded": probe.all_offloaded, "losses": losses.losses}


@pytest.mark.slow
def test_cpu_offload_runs_on_a_cpu_mesh_with_the_losses_of_no_offload():
    offloaded = run_function(train_with_offload, 2, args=(True,), init_process_group=False)
    kept = run_function(train_with_offload, 2, args=(False,), init_process_group=False)
    for rank in range(2):
        assert offloaded[rank]["all_offloaded"] is True and kept[rank]["all_offloaded"] is False
        assert offloaded[rank]["losses"] == pytest.approx(kept[rank]["losses"], rel=1e-6)
