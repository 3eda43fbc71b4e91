"""``comm_hook="auto"``, FastDDPStrategy's default: exact on a fast network, compressed where the link is slow.

Decisions are asserted, never times: the decision on given measurements (a loopback's, a loaded machine's, a
slow link's); a fit whose clocks are given (steps that wait for nothing, as on loopback) that stays exact, with
the losses of Lightning's own DDP bit for bit; and under a shaped link of the emulated cluster, a switch to bf16
and then to PowerSGD at the steps its window says, on every rank alike, and a resume that keeps the level.
"""

from __future__ import annotations

import json
import sys
import time

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_fastdist import FastDDPStrategy
from lightning_fastdist.parallel.ddp.auto_comm_hook import AutoCommState, AutoPolicy, Decision
from lightning_fastdist.parallel.ddp.powersgd import PowerSGDSettings, compression_ratio
from tests.support.clocks import ManualClock
from tests.support.emulated_cluster import EmulatedCluster, cannot_emulate
from tests.support.harness import run_function
from tests.support.workloads import make_trainer, repeated_batches, tiny_gpt

WINDOW = 3
WARMUP = AutoPolicy.warmup


def test_a_window_of_no_steps_is_refused_in_one_line_naming_the_strategys_option():
    with pytest.raises(ValueError, match=r"^comm_hook_window: got 0; use an integer >= 1 \(optimizer steps\)\.$"):
        AutoPolicy(window=0)
    with pytest.raises(ValueError, match=r"^FastDDPStrategy: comm_hook_window: got 0; use an integer >= 1"):
        FastDDPStrategy(comm_hook_window=0)


def test_powersgd_pays_only_for_models_whose_matrices_compress():
    assert compression_ratio(tiny_gpt(), rank=2) > AutoPolicy.min_powersgd_ratio
    vectors = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.LayerNorm(64))
    assert compression_ratio(vectors, rank=2) == 1.0  # nothing to factor: PowerSGD would only cost


def test_the_compression_ratio_counts_a_scalar_parameter_as_sent_whole():
    # CLIP's logit_scale and learned temperatures are 0-dim parameters; an empty matrix has no rows.
    model = torch.nn.Linear(64, 64, bias=False)
    model.temperature = torch.nn.Parameter(torch.tensor(1.0))
    model.empty = torch.nn.Parameter(torch.empty(0, 8))
    factored = 2 * (64 + 64)
    assert compression_ratio(model, rank=2) == (64 * 64 + 1) / (factored + 1)


def test_a_decision_reads_as_one_line_and_a_saved_level_comes_back_with_powersgd_ready():
    decision = Decision(step=23, level_from="none", level_to="bf16", exposed_share=0.42, step_s=0.31)
    assert decision.line(AutoPolicy()) == (
        "comm_hook auto: switching to bf16 after step 23: the step waited 42% of its 310 ms for gradient "
        "communication at none (thresholds: bf16 from 20%, powersgd from 25%)."
    )
    saved = {"level": "powersgd", "steps": 46, "decisions": [vars(decision)] * 2}
    state = AutoCommState(module=tiny_gpt())
    state.load_state_dict(saved)
    assert state.level == "powersgd" and not state.measuring and state.powersgd is not None
    assert state.state_dict() == saved


@pytest.mark.parametrize(
    ("level", "share", "exposed_ms", "allow_bf16", "decided"),
    [
        ("none", 0.05, 2.0, True, "none"),  # loopback: the all-reduce hides under the backward
        ("none", 0.60, 5.0, True, "none"),  # a loaded machine's loopback: a large share of a short wait is latency
        ("none", 0.30, 50.0, True, "bf16"),  # a slow link
        ("none", 0.30, 50.0, False, "none"),  # a backend that does not reduce bfloat16
        ("bf16", 0.30, 50.0, True, "powersgd"),  # still slow at half the bytes
        ("bf16", 0.22, 50.0, True, "bf16"),  # bf16 was enough
    ],
)
def test_the_decision_on_given_measurements(level, share, exposed_ms, allow_bf16, decided):
    state = AutoCommState(
        module=tiny_gpt(), powersgd_settings=PowerSGDSettings(rank=2), allow_bf16=allow_bf16, level=level
    )
    decision = state.decide(share, step_s=0.1, exposed_s=exposed_ms / 1000)
    assert (decision.level_from, decision.level_to, state.level) == (level, decided, decided)
    assert state.measuring == (decided not in (level, "powersgd"))  # a decision that stays is final


def test_one_rank_measures_nothing_so_a_single_gpu_run_makes_no_device_sync_for_it():
    # Nothing crosses a link with one rank: a window would only cost its two device syncs (the first GPU run counted
    # one at step 3, the window's start).
    trainer = make_trainer(FastDDPStrategy(comm_hook_window=1), devices=1, max_steps=WARMUP + 2)
    trainer.fit(tiny_gpt(), repeated_batches())
    state = trainer.strategy.hook_state
    assert isinstance(state, AutoCommState) and state.single_rank
    assert (state.level, state.decisions, state.steps) == ("none", [], 0)


def decide_after_one_rank_waited_for_the_other() -> tuple[str, float, float]:
    state = AutoCommState(module=tiny_gpt(), policy=AutoPolicy(warmup=1, window=1))
    waited_s = [0.0]  # the exposed-communication clock this rank reads
    state.on_optimizer_step(lambda: waited_s[0], lambda: None)  # the window starts
    time.sleep(0.1)
    # Rank 0 computed faster and waited 90 ms for rank 1's gradients; rank 1, the slower, waited 15 ms for the link.
    waited_s[0] = 0.09 if dist.get_rank() == 0 else 0.015
    decision = state.on_optimizer_step(lambda: waited_s[0], lambda: None)
    return decision.level_to, decision.exposed_share, decision.step_s


@pytest.mark.multiprocess
def test_a_wait_for_a_slower_peer_is_not_counted_as_communication():
    # Summed over ranks, the step waited about half its time, which would switch to bf16: the slowest rank's 15 ms
    # of a 100 ms step is the communication, under the 20% from which bf16 pays.
    decisions = run_function(decide_after_one_rank_waited_for_the_other, 2)
    assert decisions[0] == decisions[1]  # the same numbers everywhere
    level, share, step_s = decisions[0]
    assert level == "none" and step_s >= 0.1 and share == pytest.approx(0.015 / step_s)


class LoopbackClocks(L.Callback):
    """Auto's two clocks (a window's wall time, the exposed communication) read one manual clock that moves 100 ms
    per batch, outside the backward: every step takes 100 ms and waits for nothing, as on loopback."""

    def __init__(self) -> None:
        self.now = ManualClock()

    def on_train_start(self, trainer, pl_module):
        trainer.strategy.hook_state.wall_clock = self.now
        trainer.strategy.exposed_comm.now = self.now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.now.advance(0.1)


def exact_on_loopback() -> dict:
    from lightning.pytorch.strategies import DDPStrategy

    from tests.support.workloads import LossRecorder

    runs = {}
    for name, strategy in (("lightning", DDPStrategy()), ("auto", FastDDPStrategy(comm_hook_window=WINDOW))):
        losses = LossRecorder()
        clocks = [LoopbackClocks()] if name == "auto" else []
        trainer = make_trainer(strategy, max_steps=2 * (WARMUP + WINDOW), callbacks=[losses, *clocks])
        trainer.fit(tiny_gpt(), repeated_batches())
        runs[name] = losses.losses
    state = trainer.strategy.hook_state
    runs["decisions"] = [(d.step, d.level_from, d.level_to) for d in state.decisions]
    return runs


@pytest.mark.slow
@pytest.mark.multiprocess
def test_on_loopback_auto_stays_exact_with_lightnings_losses_bit_for_bit():
    for runs in run_function(exact_on_loopback, 2, init_process_group=False):
        assert runs["decisions"] == [(WARMUP + WINDOW, "none", "none")]  # measured once, stayed, measures no more
        assert runs["auto"] == runs["lightning"]  # bitwise: == on floats


@pytest.mark.slow
@pytest.mark.emulated
def test_under_a_slow_link_auto_switches_to_bf16_then_powersgd_and_a_resume_keeps_it(tmp_path):
    reason = cannot_emulate()
    if reason:
        pytest.skip(reason)
    first = 2 * (WARMUP + WINDOW) + 2
    command = [sys.executable, "-m", "tests.support.auto_hook_fit", "--nodes", "2", "--window", str(WINDOW)]
    command += ["--root", str(tmp_path)]
    # 5 Mbit/s: fp32 gradients take ~200 ms each way, bf16 ~100 ms, so each share passes its threshold by far even
    # when a loaded machine slows the compute (at 10 Mbit/s, bf16's share fell under 25% on a busy machine).
    with EmulatedCluster(nodes=2, link_mbit=5) as cluster:
        trained = cluster.run([*command, "--steps", str(first)], timeout=240, forked=True)
        resumed = cluster.run([*command, "--steps", str(first + 2), "--resume"], timeout=240, forked=True)
    report = json.loads(trained[0].stdout.split("AUTO ", 1)[1])
    assert [decision[:3] for decision in report["decisions"]] == [
        [WARMUP + WINDOW, "none", "bf16"],
        [2 * (WARMUP + WINDOW), "bf16", "powersgd"],
    ]
    assert report["level"] == "powersgd" and report["metric"] == 2.0
    assert all(torch.isfinite(torch.tensor(report["losses"])))
    again = json.loads(resumed[0].stdout.split("AUTO ", 1)[1])
    assert again["level"] == "powersgd" and again["decisions"] == report["decisions"]  # kept, not measured again
