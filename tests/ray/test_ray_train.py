"""Our strategies under Ray Train, against a real Ray cluster of two Ray nodes on this machine (``conftest.py``).

One ``TorchTrainer`` job of two workers (one per Ray node, gloo) runs ``train_func`` as Ray's guide writes it
(``plugins=[RayLightningEnvironment()]``, ``prepare_trainer``): one uninterrupted fit each under Ray's own
``RayDDPStrategy``, ``FastDDPStrategy()``, ``FastFSDPStrategy(sharding="zero3")`` and
``FastDeepSpeedStrategy(stage=2)``, then ``FastDDPStrategy`` through ``RayReport(every_n_train_steps=2)`` with rank 1
killed (SIGKILL) at a random step; ``FailureConfig(max_failures=1)`` lets Ray restart the group, which resumes from
the checkpoint Ray restored (``RayReport.latest()``). Every test reads that one job (``tests/support/ray_training.py``
says what it leaves). Times are not asserted: ``benchmarks/ray_flows.py`` measures them (``docs/ray.md``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.ray_cluster import WORKERS, RayTestCluster
from tests.support.ray_training import STEPS, read_lines, train_engines_then_killed

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.xdist_group("ray")]

REPORT_EVERY = 2
EXACT = 1e-5  # the contract matrix's tolerance for exact engines (fp32 sums in another order)


@dataclass(frozen=True)
class RayJob:
    out: Path
    result: Any  # Ray's Result
    kill_step: int

    def results(self, fit: str) -> list[dict]:
        return [torch.load(self.out / fit / f"result-rank{rank}.pt") for rank in range(WORKERS)]

    def steps(self, fit: str, rank: int) -> list[dict]:
        return read_lines(self.out / fit / f"steps-rank{rank}.jsonl")

    def starts(self, fit: str, rank: int) -> list[dict]:
        return read_lines(self.out / fit / f"starts-rank{rank}.jsonl")


def unequal_weights(result: dict, reference: dict) -> list[str]:
    """The weights of ``result`` not bit for bit those of ``reference`` (every name of either)."""
    ours, theirs = result["weights"], reference["weights"]
    names = ours.keys() | theirs.keys()
    return sorted(
        name for name in names if name not in ours or name not in theirs or not torch.equal(ours[name], theirs[name])
    )


@pytest.fixture(scope="module")
def job(ray_cluster: RayTestCluster, tmp_path_factory: pytest.TempPathFactory) -> RayJob:
    out = tmp_path_factory.mktemp("ray_train")
    kill_step = random.randint(3, STEPS - 1)  # after the first report, before the last step
    config = {"out": str(out), "report_every": REPORT_EVERY, "kill": {"rank": 1, "step": kill_step}}
    result = ray_cluster.fit(train_engines_then_killed, config, out / "storage", max_failures=1)
    return RayJob(out, result, kill_step)


def test_the_job_finishes_after_the_restart(job: RayJob):
    assert job.result.error is None, job.result.error
    for rank in range(WORKERS):
        starts = job.starts("killed", rank)
        assert [start["attempt"] for start in starts] == [0, 1], starts
        assert starts[0]["ckpt_path"] is None and starts[1]["ckpt_path"] is not None, starts


def test_our_strategies_take_rays_job(job: RayJob):
    """Lightning's picture of each fit is Ray's: 2 nodes of 1 worker, Ray's ranks, the CPU Ray assigned."""
    for engine in ("fast_ddp", "fast_fsdp", "fast_deepspeed"):
        for rank, result in enumerate(job.results(engine)):
            assert result["lightning_job"] == (2, 1, WORKERS, rank), (engine, result["lightning_job"])
            assert result["device"] == "cpu"
            assert result["global_step"] == STEPS


def test_fast_ddp_matches_ray_ddp_bit_for_bit(job: RayJob):
    """The same train_func under Ray's RayDDPStrategy and FastDDPStrategy(): every loss and every final weight equal."""
    for rank in range(WORKERS):
        ray_losses = [step["loss"] for step in job.steps("ray_ddp", rank)]
        assert len(ray_losses) == STEPS
        assert [step["loss"] for step in job.steps("fast_ddp", rank)] == ray_losses
    for ours, rays in zip(job.results("fast_ddp"), job.results("ray_ddp")):
        assert not unequal_weights(ours, rays)


@pytest.mark.parametrize("engine", ["fast_fsdp", "fast_deepspeed"])
def test_fsdp_zero3_and_deepspeed_stage2_match_ddp(job: RayJob, engine: str):
    for rank in range(WORKERS):
        losses = torch.tensor([step["loss"] for step in job.steps(engine, rank)])
        reference = torch.tensor([step["loss"] for step in job.steps("fast_ddp", rank)])
        assert torch.allclose(losses, reference, rtol=EXACT, atol=EXACT / 100), (losses, reference)
    for ours, ddp in zip(job.results(engine), job.results("fast_ddp")):
        for name, weight in ddp["weights"].items():
            assert torch.allclose(ours["weights"][name], weight, rtol=EXACT, atol=EXACT / 100), name


def test_a_killed_worker_resumes_from_the_last_reported_checkpoint_exactly(job: RayJob):
    """Rank 1 killed at step k (after Ray registered the reports so far): the restart resumes from the last step
    reported before k, trains again only the steps since (each rank the samples the uninterrupted run trained at that
    step) and ends on the uninterrupted run's weights bit for bit."""
    killed = json.loads((job.out / "killed" / "killed.json").read_text())
    assert killed["step"] == job.kill_step
    resumed_at = (job.kill_step - 1) // REPORT_EVERY * REPORT_EVERY  # the kill comes before step k's own report
    reported = sorted({metrics["step"] for _, metrics in job.result.best_checkpoints})
    assert reported == list(range(REPORT_EVERY, STEPS + 1, REPORT_EVERY)), reported
    for rank in range(WORKERS):
        uninterrupted = {step["step"]: step["samples"] for step in job.steps("fast_ddp", rank)}
        lines = job.steps("killed", rank)
        first, second = ([line for line in lines if line["attempt"] == attempt] for attempt in (0, 1))
        assert [line["step"] for line in second] == list(range(resumed_at + 1, STEPS + 1)), (rank, job.kill_step)
        assert [line["step"] for line in first] == list(range(1, len(first) + 1))
        assert len(first) <= job.kill_step
        for line in lines:
            assert line["samples"] == uninterrupted[line["step"]], (rank, line)
        trained_twice = {line["step"] for line in first} & {line["step"] for line in second}
        assert trained_twice <= set(range(resumed_at + 1, job.kill_step + 1)), (rank, trained_twice)
    for resumed, uninterrupted in zip(job.results("killed"), job.results("fast_ddp")):
        assert not unequal_weights(resumed, uninterrupted), job.kill_step
