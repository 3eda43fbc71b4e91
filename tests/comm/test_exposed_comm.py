"""Exposed communication (comm/exposed_s, bench's exposed_comm_s): what is counted per step, and that a late
collective shows up in it, for every engine, Lightning's own strategies included.

Nothing here depends on how fast the machine is: where a wait's length is asserted, the clock is a
:class:`~tests.support.clocks.ManualClock` that moves only where a test delays a collective (inside a DDP comm
hook's future, inside a blocking call, inside an asynchronous one's ``wait()``), so the count is exact; the run of
every engine asserts what is counted and when, never how long.
"""

from __future__ import annotations

import math
import time

import lightning as L
import pytest

from lightning_fastdist.parallel.comm.exposed import ExposedCommClock, timed_collective
from tests.support.clocks import ManualClock
from tests.support.harness import run_function

DELAY = 0.4  # seconds a delayed collective takes by the manual clock
STEPS = 6


def test_the_clock_closes_intervals_per_step_and_keeps_a_total():
    clock = ExposedCommClock()
    assert clock.last_step_s == 0.0 and clock.last_step_waits == 0  # before any step
    clock.add(1.0, 1.25)
    clock.add(2.0, 2.5)
    assert clock.last_step_s == 0.0  # the step is still open
    clock.end_step()
    assert (clock.last_step_s, clock.last_step_waits, clock.total_s, clock.steps) == (0.75, 2, 0.75, 1)
    clock.add(3.0, 2.0)  # an end before its start (another thread's mark) counts as no wait
    clock.end_step()
    assert (clock.last_step_s, clock.last_step_waits, clock.total_s) == (0.0, 1, 0.75)
    clock.end_step()
    assert (clock.last_step_s, clock.last_step_waits) == (0.0, 0)


def test_a_blocking_call_is_timed_and_without_a_clock_nothing_is():
    clock = ExposedCommClock()
    assert timed_collective(None, lambda: "sent", asynchronous=False) == "sent"
    assert timed_collective(clock, lambda: time.sleep(0.01) or "sent", asynchronous=False) == "sent"
    clock.end_step()
    assert clock.last_step_waits == 1 and clock.last_step_s > 0


class LateWork:
    """An asynchronous collective's work whose ``wait()`` takes ``DELAY`` by the manual clock."""

    def __init__(self, now: ManualClock) -> None:
        self.now = now

    def wait(self) -> str:
        self.now.advance(DELAY)
        return "arrived"


def test_a_late_collective_counts_its_delay_whether_it_blocks_or_is_waited_for():
    now = ManualClock()
    clock = ExposedCommClock(now=now)
    timed_collective(clock, lambda: now.advance(DELAY), asynchronous=False)  # FSDP2's and DeepSpeed's blocking calls
    work = timed_collective(clock, lambda: LateWork(now), asynchronous=True)
    now.advance(1.0)  # compute while the collective runs: not a wait
    assert work.wait() == "arrived"  # what FSDP2 and DeepSpeed wait on
    clock.end_step()
    assert (clock.last_step_s, clock.last_step_waits) == (pytest.approx(2 * DELAY), 2)


def ddp_under_a_late_all_reduce(delay: float) -> dict:
    """On each rank: DDP with a comm hook whose all-reduce arrives ``delay`` late (by a manual clock) on some steps."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from lightning_fastdist.parallel.comm.exposed import watch_ddp

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)))
    late = {"now": False}
    now = ManualClock()

    def delayed_all_reduce(state, bucket):  # no annotations: DDP checks them against its own types
        work = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True)

        def arrived(future):  # runs when the all-reduce is done, before DDP's backward may return
            if late["now"]:
                now.advance(delay)
            return future.value()[0]

        return work.get_future().then(arrived)

    model.register_comm_hook(None, delayed_all_reduce)
    clock = ExposedCommClock(now=now)
    watch_ddp(model, clock)
    batch = torch.randn(8, 64)

    def step(slowed: bool) -> tuple[float, int]:
        late["now"] = slowed
        model(batch).sum().backward()
        clock.end_step()
        return clock.last_step_s, clock.last_step_waits

    for _ in range(2):  # DDP rebuilds its buckets after the first
        step(False)
    runs = {"fast": [step(False) for _ in range(3)], "slowed": [step(True) for _ in range(3)]}
    with model.no_sync():  # an accumulation micro-batch: nothing sent
        model(batch).sum().backward()
    clock.end_step()
    runs["no_sync"] = (clock.last_step_s, clock.last_step_waits)
    return runs


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ddp_counts_the_wait_after_the_last_gradient_and_nothing_under_no_sync():
    for rank in run_function(ddp_under_a_late_all_reduce, 2, args=(DELAY,)):
        assert [waits for _, waits in rank["fast"] + rank["slowed"]] == [1] * 6  # one per synchronising backward
        assert [seconds for seconds, _ in rank["fast"]] == [0.0] * 3  # the manual clock did not move
        assert [seconds for seconds, _ in rank["slowed"]] == [pytest.approx(DELAY)] * 3  # the bucket arrived late
        assert rank["no_sync"] == (0.0, 0)


class ExposedRecorder(L.Callback):
    """Per optimizer step, the exposed seconds and waits; per micro-batch, host syncs and whether logs were due."""

    def __init__(self, clock_holder) -> None:
        self.clock_holder = clock_holder  # the strategy, or the BenchProbe for Lightning's strategies
        self.per_step: list[tuple[float, int]] = []
        self.micro_batches: list[dict] = []

    def _read(self, trainer) -> None:
        clock = self.clock_holder.exposed_comm
        while len(self.per_step) < min(clock.steps, trainer.global_step):
            self.per_step.append((clock.last_step_s, clock.last_step_waits))

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        from lightning_fastdist.diagnostics.host_syncs import count_host_syncs

        self._read(trainer)
        due = trainer._logger_connector.should_update_logs
        self.micro_batches.append({"step": trainer.global_step, "due": due})
        self._syncs = count_host_syncs()
        self._syncs.__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._syncs.__exit__(None, None, None)
        self.micro_batches[-1]["syncs"] = [event.origin for event in self._syncs.events]

    def on_train_end(self, trainer, module):
        self._read(trainer)


def fit_every_engine(probe_folder: str) -> dict:
    """On each rank: fit TinyGPT under each engine; what each run measured."""
    from pathlib import Path

    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_fastdist import FastDDPStrategy, FastDeepSpeedStrategy, FastFSDPStrategy, SyncFreeLogging
    from lightning_fastdist.commands.bench.baselines import HandShardedTinyGPT
    from lightning_fastdist.commands.bench.probe import BenchProbe
    from lightning_fastdist.parallel.deepspeed.runtime import deepspeed_available
    from tests.support.workloads import repeated_batches, tiny_gpt

    setups = {
        "fast_ddp": (lambda: FastDDPStrategy(), tiny_gpt, 2),
        "fast_fsdp": (lambda: FastFSDPStrategy(sharding="zero3"), tiny_gpt, 1),
        "lightning_ddp": (lambda: DDPStrategy(), tiny_gpt, 1),
        "lightning_fsdp2": (
            lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            lambda: HandShardedTinyGPT(n_layer=2, n_embd=32, n_head=2, block_size=16, warmup_steps=2),
            1,
        ),
    }
    if deepspeed_available():
        setups["fast_deepspeed"] = (lambda: FastDeepSpeedStrategy(stage=3, timeout=60), tiny_gpt, 1)
    runs = {}
    for name, (make_strategy, make_model, accumulate) in setups.items():
        strategy, model = make_strategy(), make_model()
        probe = BenchProbe(str(Path(probe_folder) / f"{name}.json"))
        recorder = ExposedRecorder(probe)
        logged: list = []
        log = model.log

        def counting_log(metric, value, _logged=logged, _log=log, **options):
            if metric == "comm/exposed_s":
                _logged.append(value)  # read after the fit: a read here would be a host sync of the test's own
            return _log(metric, value, **options)

        model.log = counting_log
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=accumulate,
            log_every_n_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
            callbacks=[SyncFreeLogging(), probe, recorder],
        )  # fmt: skip
        trainer.fit(model, repeated_batches())
        runs[name] = {
            "per_step": recorder.per_step,
            "micro_batches": recorder.micro_batches,
            "logged": [float(value) for value in logged],
        }
    return runs


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_engine_times_its_collectives_every_step_and_logs_them_without_a_host_sync(tmp_path):
    import json

    ranks = run_function(fit_every_engine, 2, args=(str(tmp_path),), init_process_group=False, timeout=400)
    for rank_index, runs in enumerate(ranks):
        for name, run in runs.items():
            where = f"rank {rank_index} {name}"
            assert len(run["per_step"]) == STEPS, where
            assert all(math.isfinite(s) and s >= 0 for s, _ in run["per_step"]), where
            assert all(waits >= 1 for _, waits in run["per_step"]), where  # each step's collectives are timed
            if name == "fast_ddp":  # accumulation of 2: the micro-batch under no_sync adds no wait
                assert [waits for _, waits in run["per_step"]] == [1] * STEPS
            ours = name.startswith("fast_")
            if ours:  # logged on the steps whose logs are due, not on the others
                due = [batch for batch in run["micro_batches"] if batch["due"]]
                assert 1 <= len(run["logged"]) == len(due) < len(run["micro_batches"]), where
                assert all(math.isfinite(value) and value >= 0 for value in run["logged"]), where
            after_setup = [batch for batch in run["micro_batches"] if batch["step"] >= 1]
            foreign = [o for batch in after_setup for o in batch["syncs"] if not o.startswith("deepspeed/")]
            assert foreign == [], where  # not even on logging steps; DeepSpeed's own gradient-norm check is its own
    for name in ranks[0]:  # the bench probe writes it for Lightning's strategies too
        probe = json.loads((tmp_path / f"{name}.json").read_text())
        assert probe["exposed_comm_s"] is not None and probe["exposed_comm_s"] >= 0, name
