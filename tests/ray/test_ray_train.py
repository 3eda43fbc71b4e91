"""Our strategies under Ray Train, against a real Ray cluster of two Ray nodes on this machine (``conftest.py``).

One ``TorchTrainer`` job (one or two workers, one per Ray node, gloo; ``FailureConfig(max_failures=2)``) runs
``train_func`` as Ray's guide writes it (``plugins=[RayLightningEnvironment()]``, ``prepare_trainer``): one
uninterrupted fit each under Ray's own ``RayDDPStrategy``, ``FastDDPStrategy()``,
``FastFSDPStrategy(sharding="zero3", async_checkpointing=True)`` and ``FastDeepSpeedStrategy(stage=2)``, ours through
``RayReport(every_n_train_steps=4)``; the packaged script's worker part (``lightning_fastdist.cli.ray_train``) on a
recipe; then ``FastDDPStrategy`` through RayReport (every 2) with rank 1 killed at a
random step, Ray restarting both workers, which resume from the checkpoint Ray restored (``RayReport.latest()``); then
the same with the second Ray node removed at a random step, Ray restarting one worker (elastic sizing), which resumes
at the smaller world. Every test reads that one job (``tests/support/ray_training.py`` says what it leaves). Times
are not asserted: ``benchmarks/ray_flows.py`` measures them (``docs/ray.md``).
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_fastdist.callbacks.ray_report import CHECKPOINT_NAME
from tests.support.ray_cluster import SECOND_NODE_ADDRESS, WORKERS, RayTestCluster
from tests.support.ray_training import (
    SAMPLES,
    SCRIPT_REPORT_EVERY,
    SCRIPT_STEPS,
    STEPS,
    read_lines,
    train_engines_then_lose_workers,
)
from tests.support.shared_runs import once_per_session

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

REPORT_EVERY = 2  # the killed and node-removed fits'
ENGINES_REPORT_EVERY = 4  # the uninterrupted fits'
EXACT = 1e-5  # the contract matrix's tolerance for exact engines (fp32 sums in another order)
STAGING_ROOT = Path(tempfile.gettempdir()) / "lightning_fastdist-ray"  # RayReport's default staging_dir


@dataclass(frozen=True)
class RayJob:
    """What the job left: its folder, Ray's error (``None``: it finished), every checkpoint Ray registered in the order
    reported (the kind of checkpoint in it, ``"file"``: DDP's, ``"sharded"``: FSDP's folder, ``"deepspeed"``:
    DeepSpeed's folder; the step; its path), the steps the job lost a worker at, and what it left staged."""

    out: Path
    error: str | None
    reports: list[tuple[str, int, Path]]
    kill_step: int
    removal_step: int
    staged_left: list[Path]  # RayReport's staging folders the job left behind

    def results(self, fit: str) -> list[dict]:
        return [torch.load(self.out / fit / f"result-rank{rank}.pt") for rank in range(WORKERS)]

    def steps(self, fit: str, rank: int) -> list[dict]:
        return read_lines(self.out / fit / f"steps-rank{rank}.jsonl")

    def starts(self, fit: str, rank: int) -> list[dict]:
        return read_lines(self.out / fit / f"starts-rank{rank}.jsonl")


def registered(result: Any) -> list[tuple[str, int, Path]]:
    """:attr:`RayJob.reports` of Ray's ``Result``."""
    reports = []
    for checkpoint, metrics in sorted(result.best_checkpoints, key=lambda pair: pair[0].path):
        path = Path(checkpoint.path) / CHECKPOINT_NAME
        kind = "file" if path.is_file() else "sharded" if (path / ".metadata").exists() else "deepspeed"
        reports.append((kind, metrics["step"], path))
    return reports


def unequal_weights(result: dict, reference: dict) -> list[str]:
    """The weights of ``result`` not bit for bit those of ``reference`` (every name of either)."""
    ours, theirs = result["weights"], reference["weights"]
    names = ours.keys() | theirs.keys()
    return sorted(
        name for name in names if name not in ours or name not in theirs or not torch.equal(ours[name], theirs[name])
    )


def run_the_job(ray_cluster: RayTestCluster, out: Path) -> RayJob:
    kill_step, removal_step = (random.randint(3, STEPS - 1) for _ in range(2))  # after a report, before the last
    config = {
        "out": str(out),
        "report_every": REPORT_EVERY,
        "engines_report_every": ENGINES_REPORT_EVERY,
        "kill_step": kill_step,
        "removal_step": removal_step,
        "second_node": SECOND_NODE_ADDRESS,
    }
    removal = out / "node_removed" / "lost.json"
    staged_before = set(STAGING_ROOT.iterdir()) if STAGING_ROOT.is_dir() else set()
    try:
        result = ray_cluster.fit(
            train_engines_then_lose_workers,
            config,
            out / "storage",
            max_failures=2,
            remove_second_node_at=removal,
            num_workers=(1, WORKERS),  # elastic: after the node is removed, Ray restarts one worker
        )
    finally:
        if Path(f"{removal}.removed").exists():
            ray_cluster.restore_second_node()  # the cluster as the session's next test expects it
    error = None if result.error is None else str(result.error)
    staged_left = sorted(set(STAGING_ROOT.iterdir()) - staged_before) if STAGING_ROOT.is_dir() else []
    return RayJob(out, error, registered(result), kill_step, removal_step, staged_left)


@pytest.fixture(scope="module")
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> RayJob:
    """The job, run once per test session: under ``make test``'s two pytest-xdist workers the first to ask runs it
    (and starts the Ray cluster), the other reads what it left."""

    def run() -> RayJob:
        return run_the_job(request.getfixturevalue("ray_cluster"), tmp_path_factory.mktemp("ray_train"))

    return once_per_session(tmp_path_factory, "ray_train_job", run)


def test_the_job_finishes_after_the_restart(job: RayJob):
    assert job.error is None, job.error
    assert not job.staged_left  # each fit's staging folder removed: at its end, on its exception, or at a restart
    for rank in range(WORKERS):
        starts = job.starts("killed", rank)
        assert [(start["attempt"], start["world_size"]) for start in starts] == [(0, 2), (1, 2)], starts
        assert starts[0]["ckpt_path"] is None and starts[1]["ckpt_path"] is not None, starts
    starts = job.starts("node_removed", 0)
    assert [(start["attempt"], start["world_size"]) for start in starts] == [(0, 2), (1, 1)], starts


def test_our_strategies_take_rays_job(job: RayJob):
    """Lightning's picture of each fit is Ray's: 2 nodes of 1 worker, Ray's ranks, the CPU Ray assigned (the DeepSpeed
    fit without ``plugins=[RayLightningEnvironment()]``: ours put it in, and ``prepare_trainer`` accepted that)."""
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


def test_the_packaged_script_runs_a_recipe_under_ray(job: RayJob):
    """``python -m lightning_fastdist.cli.ray_train ... fit --config cpu_smoke ...``'s workers: the recipe's fit on
    both, its outputs where the script was started, its steps reported to Ray (the last at the end of training)."""
    folder = job.out / "script"
    assert all((folder / f"done-rank{rank}").exists() for rank in range(WORKERS))
    assert (folder / "checkpoints" / "cpu_smoke" / "last.ckpt").is_file()
    assert (folder / "lightning_logs" / "cpu_smoke" / "version_0" / "metrics.csv").is_file()
    reports = [(kind, step) for kind, step, _ in job.reports]
    assert ("file", SCRIPT_REPORT_EVERY) in reports and ("file", SCRIPT_STEPS) in reports


def test_sharded_and_background_checkpoints_reach_ray_complete(job: RayJob):
    """FastFSDPStrategy(async_checkpointing=True) and FastDeepSpeedStrategy through RayReport: Ray holds every step
    reported, each checkpoint whole (every rank's shards and the index; nothing staged)."""
    reports = job.reports
    every_report = list(range(ENGINES_REPORT_EVERY, STEPS + 1, ENGINES_REPORT_EVERY))
    for kind in ("sharded", "deepspeed"):
        assert [step for each, step, _ in reports if each == kind] == every_report, (kind, reports)
    for kind, _, path in reports:
        assert not [part for part in path.parent.rglob("*") if part.name.endswith(".partial")], path
        if kind == "sharded":
            assert {part.name for part in path.iterdir()} >= {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"}
        elif kind == "deepspeed":
            tag = path / (path / "latest").read_text().strip()
            files = {part.name for part in tag.iterdir()}
            assert {f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in range(WORKERS)} <= files, files


def test_a_killed_worker_resumes_from_the_last_reported_checkpoint_exactly(job: RayJob):
    """Rank 1 killed at step k (after Ray registered the reports so far): the restart resumes from the last step
    reported before k, trains again only the steps since (each rank the samples the uninterrupted run trained at that
    step) and ends on the uninterrupted run's weights bit for bit."""
    killed = json.loads((job.out / "killed" / "lost.json").read_text())
    assert killed["step"] == job.kill_step
    resumed_at = (job.kill_step - 1) // REPORT_EVERY * REPORT_EVERY  # the kill comes before step k's own report
    every_report = list(range(REPORT_EVERY, STEPS + 1, REPORT_EVERY))  # each restart reports the steps after r
    uninterrupted = list(range(ENGINES_REPORT_EVERY, STEPS + 1, ENGINES_REPORT_EVERY))
    script = [SCRIPT_REPORT_EVERY, SCRIPT_STEPS]  # the last one saved at the end of training
    files = uninterrupted + script + every_report + every_report  # then the killed and node-removed fits'
    assert [step for kind, step, _ in job.reports if kind == "file"] == files
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


def test_a_removed_node_restarts_a_smaller_world_that_resumes_and_says_so(job: RayJob):
    """The second Ray node removed while its worker is at step k (``ScalingConfig(num_workers=(1, 2))``): Ray restarts
    one worker, which resumes from the last step reported before k at world size 1, says so in one line, reads each
    sample once per epoch across the change (ResumableDataLoader) and trains to the last step."""
    lost = json.loads((job.out / "node_removed" / "lost.json").read_text())
    assert lost["step"] == job.removal_step
    resumed_at = (job.removal_step - 1) // REPORT_EVERY * REPORT_EVERY
    lines = {rank: job.steps("node_removed", rank) for rank in range(WORKERS)}
    before = [line for rank in range(WORKERS) for line in lines[rank] if line["attempt"] == 0]
    after = [line for line in lines[0] if line["attempt"] == 1]
    assert [line["step"] for line in after] == list(range(resumed_at + 1, STEPS + 1)), job.removal_step
    assert not [line for line in lines[1] if line["attempt"] == 1]  # one worker after the restart
    kept = sorted((line for line in before if line["step"] <= resumed_at), key=lambda line: line["step"])
    read = [sample for line in kept + after for sample in line["samples"]]
    epochs = [read[start : start + SAMPLES] for start in range(0, len(read), SAMPLES)]
    for epoch in epochs:
        assert len(set(epoch)) == len(epoch), (job.removal_step, epochs)
    assert all(sorted(epoch) == list(range(SAMPLES)) for epoch in epochs[:-1]), epochs
    [result] = [torch.load(job.out / "node_removed" / "result-rank0.pt")]
    assert result["global_step"] == STEPS
    assert result["lightning_job"][2] == 1
    said = [line for line in result["warnings"] if "written by 2 ranks and is resumed by 1 rank" in line]
    assert len(said) == 1, result["warnings"]
