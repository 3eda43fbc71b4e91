"""FastDeepSpeedStrategy on 2 gloo processes: ZeRO 1-3, exact resume, bytes per collective, host syncs, one file.

One spawned pair of processes runs every training case in turn (DeepSpeed's import and set-up cost
seconds per process): stage 2 and stage 3 (with activation checkpointing) each N steps straight and
N/2 + a checkpoint + resume + N/2, with dropout; stage 1 and 2 under accumulation for the byte counts;
stage 3 with optimizer and parameter offload under bf16; stage 2 resuming from a stage 3 folder. Fast tests check
the options and what a missing DeepSpeed says.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fastdist import FastDeepSpeedStrategy, FastMixedPrecision, SpeedMonitor, SyncFreeLogging
from lightning_fastdist.demo import TextDataModule, TinyGPT
from lightning_fastdist.diagnostics.host_syncs import count_host_syncs
from lightning_fastdist.parallel.checkpoint.checkpoint_files import STAGING_SUFFIX
from lightning_fastdist.parallel.checkpoint.problems import UnusableCheckpointError
from lightning_fastdist.planning.comm_model import estimate_comm
from lightning_fastdist.planning.memory_model import TrainingShape, estimate_memory
from lightning_fastdist.strategies.deepspeed.consolidate import consolidate_checkpoint, full_weights_of_folder
from tests.support.fault_runs import BATCH, BLOCK, write_corpus
from tests.support.harness import run_function
from tests.support.shared_runs import once_per_session

WORLD = 2
TOTAL_STEPS, RESUME_AT = 6, 3
DROPOUT = 0.1  # random masks: each rank's random states travel in the checkpoint
JIT_OPS = {"deepspeed_shm_comm", "cpu_adam", "fused_adam"}  # the C++ ops DeepSpeed would compile and import


class StepRecorder(L.Callback):
    """Each micro-batch's loss, and the host syncs of each micro-batch with where they happened."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.sync_origins: list[list[str]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._syncs = count_host_syncs()
        self._syncs.__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._syncs.__exit__(None, None, None)
        self.sync_origins.append([event.origin for event in self._syncs.events])
        self.losses.append(float(outputs["loss"]))


def full_weights(strategy: FastDeepSpeedStrategy) -> dict[str, torch.Tensor]:
    """Every parameter's full fp32 master copy (a collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = strategy.deepspeed_engine.module
    return {name: safe_get_full_fp32_param(p).detach().clone() for name, p in module.named_parameters()}


def state_bytes(strategy: FastDeepSpeedStrategy) -> dict[str, int]:
    """This rank's weights (its partitions under ZeRO-3) and optimizer state (fp32 master partition + AdamW moments)."""
    engine = strategy.deepspeed_engine
    weights = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    base = engine.optimizer.optimizer  # the torch AdamW DeepSpeed steps over this rank's fp32 partition
    masters = list(base.state)  # the fp32 partitions AdamW has stepped (ZeRO-3 empties param_groups in between)
    moments = [t for p in masters for t in base.state[p].values() if torch.is_tensor(t) and t.dim() > 0]
    return {
        "weights": sum(t.numel() * t.element_size() for t in weights),
        "optimizer": sum(t.numel() * t.element_size() for t in masters + moments),
    }


def fit(corpus: str, folder: Path, max_steps: int, resume: bool = False, precision: str = "32-true", **options) -> dict:
    """Train TinyGPT with FastDeepSpeedStrategy(**options); this rank's record of the run."""
    from deepspeed.comm import comm

    L.seed_everything(0, verbose=False)
    # DeepSpeed's own calls of the collectives torch 2.13 renamed go to the new names (no FutureWarning per call).
    warnings.filterwarnings("error", r".*(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning)
    recorder = StepRecorder()
    checkpoints = ModelCheckpoint(dirpath=folder, every_n_train_steps=RESUME_AT, save_top_k=-1, save_last=True)
    accumulation = options.pop("accumulate_grad_batches", 1)
    strategy = FastDeepSpeedStrategy(timeout=60, **options)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, precision=precision, max_steps=max_steps,
        accumulate_grad_batches=accumulation, deterministic=True, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=100,
        callbacks=[recorder, checkpoints, SyncFreeLogging(), SpeedMonitor()],
    )  # fmt: skip
    model = TinyGPT(n_layer=2, n_embd=32, n_head=2, block_size=BLOCK, dropout=DROPOUT, warmup_steps=2)
    data = TextDataModule(batch_size=BATCH, block_size=BLOCK, corpus_path=corpus, val_fraction=0.1)
    trainer.fit(model, data, ckpt_path=str(folder / "last.ckpt") if resume else None)
    stats = strategy.comm_stats
    return {
        "losses": recorder.losses,
        "sync_origins": recorder.sync_origins,
        "weights": full_weights(strategy),
        "parameters": sum(p.numel() for p in model.parameters()),
        "step": trainer.global_step,
        "last_step": {name: (traffic.calls, traffic.bytes) for name, traffic in stats.last_step.items()},
        "rounds": stats.rounds,
        "checkpointed_blocks": len(strategy.checkpointed_blocks),
        "parameter_dtype": next(strategy.deepspeed_engine.module.parameters()).dtype,
        "state_bytes": state_bytes(strategy),
        "compiled_ops": sorted(JIT_OPS & set(sys.modules)),
        "shm_comm_op": comm.cdb.shm_comm_op,
        "zero_group_timeout": group_timeout(strategy.deepspeed_engine.optimizer.dp_process_group),
    }


def group_timeout(group: torch.distributed.ProcessGroup) -> float:
    """How long a collective of ``group`` waits, in seconds."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def shape_of(record: dict) -> TrainingShape:
    """The doctor's description of the runs here."""
    return TrainingShape(record["parameters"], layers=2, hidden=32, seq_len=BLOCK, micro_batch=BATCH, world_size=WORLD)


def deepspeed_cases(tmp: str) -> dict:
    """Every case, in one pair of processes; returns this rank's records by case name."""
    tmp_path = Path(tmp)
    corpus = str(write_corpus(tmp_path / "corpus.bin", 8, WORLD))
    runs: dict = {}
    for stage, options in ((2, {}), (3, {"activation_checkpointing": "full"})):
        options["stage"] = stage
        runs[f"zero{stage}-straight"] = fit(corpus, tmp_path / f"straight{stage}", TOTAL_STEPS, **options)
        runs[f"zero{stage}-first"] = fit(corpus, tmp_path / f"split{stage}", RESUME_AT, **options)
        runs[f"zero{stage}-resumed"] = fit(corpus, tmp_path / f"split{stage}", TOTAL_STEPS, True, **options)
    for stage in (1, 2):
        options = {"stage": stage, "accumulate_grad_batches": 2}
        runs[f"zero{stage}-accumulate"] = fit(corpus, tmp_path / f"acc{stage}", 2, **options)
    offload = {"offload_optimizer": True, "offload_parameters": True}
    runs["zero3-offload-bf16"] = fit(corpus, tmp_path / "offload", 2, precision="bf16-mixed", stage=3, **offload)
    if torch.distributed.get_rank() == 0:  # one file from the ZeRO-3 checkpoint, loaded without DeepSpeed
        consolidate_checkpoint(tmp_path / "split3" / "last.ckpt", tmp_path / "model.ckpt")
        model = TinyGPT.load_from_checkpoint(tmp_path / "model.ckpt", map_location="cpu")
        runs["one-file"] = {name: p.detach() for name, p in model.named_parameters()}
    try:  # DeepSpeed's stage 1-2 reader finds no model states of its own name in a ZeRO-3 folder
        fit(corpus, tmp_path / "split3", TOTAL_STEPS, True, stage=2)
        runs["zero2-from-zero3"] = "loaded"
    except UnusableCheckpointError as error:
        runs["zero2-from-zero3"] = str(error)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], Path]:
    def run_in(tmp_path: Path) -> tuple[list[dict], Path]:  # the folder of the worker that made the run comes with it
        records = run_function(deepspeed_cases, WORLD, args=(str(tmp_path),), init_process_group=False, timeout=300)
        return records, tmp_path

    return once_per_session(tmp_path_factory, "deepspeed_resume", lambda: run_in(tmp_path_factory.mktemp("deepspeed")))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_zeros_own_process_group_waits_the_strategys_timeout(runs):
    # DeepSpeed makes it with torch's default, 30 minutes: a hung peer held the other ranks silent that long.
    records, _ = runs
    timeouts = {(rank, name): run["zero_group_timeout"] for rank, record in enumerate(records)
                for name, run in record.items() if isinstance(run, dict) and "zero_group_timeout" in run}  # fmt: skip
    assert len(timeouts) == 2 * 9 and set(timeouts.values()) == {60.0}, timeouts


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_n_steps_straight_equal_half_a_checkpoint_and_a_resume_bitwise(runs, stage):
    records, _ = runs
    for rank in range(WORLD):
        straight, first, resumed = (records[rank][f"zero{stage}-{part}"] for part in ("straight", "first", "resumed"))
        assert resumed["step"] == straight["step"] == TOTAL_STEPS
        assert first["losses"] + resumed["losses"] == straight["losses"]
        for name, weight in straight["weights"].items():
            assert torch.equal(resumed["weights"][name], weight), f"rank {rank}: {name} differs"
    if stage == 3:  # activation checkpointing recomputes the same dropout masks: stage 3 retraces stage 2
        assert records[0]["zero3-straight"]["checkpointed_blocks"] == 2
        assert records[0]["zero3-straight"]["losses"] == records[0]["zero2-straight"]["losses"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_checkpoints_are_deepspeed_folders_published_whole(runs):
    _, tmp_path = runs
    folder = tmp_path / "split2"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    last = folder / "last.ckpt"
    assert (last / "latest").read_text() == "checkpoint"
    assert sorted(p.name for p in (last / "checkpoint").iterdir()) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert not list(tmp_path.rglob(f"*{STAGING_SUFFIX}"))  # every save was published
    assert torch.load(last / "checkpoint" / "mp_rank_00_model_states.pt", weights_only=False)["global_step"] == 6


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_zero3_checkpoint_loads_as_one_file_for_inference(runs):
    records, tmp_path = runs
    loaded, trained = records[0]["one-file"], records[0]["zero3-resumed"]["weights"]
    assert loaded.keys() == trained.keys()
    for name, weight in trained.items():
        assert torch.equal(loaded[name], weight), name
    assert not (tmp_path / f"model.ckpt{STAGING_SUFFIX}").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_evaluating_from_a_zero3_folder_assembles_the_weights_in_memory_and_writes_nothing(runs, monkeypatch, tmp_path):
    """``validate``/``test``/``predict`` from a ZeRO-3 folder assembles the full fp32 weights on every rank: each rank
    wrote them to a file of its own in ``TMPDIR`` first (ranks x the model on a node's local disk); no longer."""
    records, runs_path = runs
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no_scratch_folder"))  # any file there would fail
    assembled = full_weights_of_folder(runs_path / "split3" / "last.ckpt")
    for name, weight in records[0]["one-file"].items():
        assert torch.equal(assembled["state_dict"][name], weight), name
    assert assembled["global_step"] == 6 and "module" not in assembled  # Lightning's state, not DeepSpeed's


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_folder_deepspeed_cannot_load_is_one_line_naming_its_stage_and_deepspeeds_error(runs):
    records, tmp_path = runs
    for record in records:
        message = record["zero2-from-zero3"]
        assert message.startswith(
            f"checkpoint '{tmp_path / 'split3' / 'last.ckpt'}' (a DeepSpeed folder written at ZeRO "
            "stage 3) cannot be loaded: AssertionError raised in runtime/state_dict_factory.py"
        )
        assert "\n" not in message and ".metadata" not in message  # not taken for a sharded folder of torch's


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bytes_per_collective_follow_the_stage_and_accumulation(runs):
    records, _ = runs
    zero1, zero2 = records[0]["zero1-accumulate"], records[0]["zero2-accumulate"]
    full = 4 * zero1["parameters"]  # fp32 gradients and weights
    # ZeRO-1 reduces the gradients once per optimizer step, ZeRO-2 on every micro-batch (2 here); both then
    # gather the updated weights. A few bytes more: the all-reduced gradient norm and overflow flag.
    assert zero1["rounds"] == 2 and zero2["rounds"] == 4
    for stage, record in ((1, zero1), (2, zero2)):  # the doctor's communication model, checked
        expected = estimate_comm(shape_of(record), f"ds-zero{stage}", accumulation=2)
        assert expected.allreduce == stage * full and record["last_step"]["allgather"][1] == expected.allgather == full
        assert 0 <= record["last_step"]["allreduce"][1] - expected.allreduce <= 16
    zero3, expected = records[0]["zero3-straight"], estimate_comm(shape_of(zero1), "ds-zero3")
    assert zero3["last_step"]["reduce_scatter"][1] == expected.reduce_scatter == full
    assert zero3["last_step"]["allgather"][1] == expected.allgather == full  # once, kept for the backward


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_weights_and_optimizer_state_per_rank_match_the_memory_model(runs, stage):
    records, _ = runs
    record = records[0][f"zero{stage}-accumulate" if stage < 3 else "zero3-straight"]
    estimate = estimate_memory(shape_of(record), f"ds-zero{stage}")
    measured = record["state_bytes"]
    # DeepSpeed pads each rank's partition to an alignment: a few bytes more than the formula.
    assert measured["weights"] == pytest.approx(estimate.weights, rel=0.01)
    assert measured["optimizer"] == pytest.approx(estimate.optimizer, rel=0.01)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["zero2-straight", "zero3-straight", "zero3-offload-bf16"])
def test_no_host_sync_of_ours_only_deepspeeds_own_step_checks(runs, case):
    records, _ = runs
    # Ordinary steps: not the first, nor the one after the step-3 checkpoint (random states are restored there).
    steps = records[0][case]["sync_origins"]
    per_step = [origins for index, origins in enumerate(steps) if index not in (0, RESUME_AT)]
    assert [origin for step in per_step for origin in step if not origin.startswith("deepspeed/")] == []
    if case == "zero2-straight":  # the ZeRO-1/2 step reads its gradient norm once, to skip a non-finite step
        assert [len(step) for step in per_step] == [1] * (TOTAL_STEPS - 2)
    if case == "zero3-straight":  # so does ZeRO-3's, once its trace is recorded and checked (the first two steps)
        assert [len(steps[index]) for index in (2, 4, 5)] == [1, 1, 1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_offload_and_bf16_train_in_bf16_without_compiling(runs):
    record = runs[0][0]["zero3-offload-bf16"]
    assert record["parameter_dtype"] == torch.bfloat16
    assert all(torch.isfinite(torch.tensor(record["losses"])))
    assert record["last_step"]["reduce_scatter"][1] == 2 * record["parameters"]  # bf16 gradients
    for rank in range(WORLD):  # DeepSpeed's shared-memory all-reduce was not built; no other op was either
        record = runs[0][rank]["zero3-offload-bf16"]
        assert record["shm_comm_op"] is None and record["compiled_ops"] == []


def test_options_are_checked_before_anything_starts():
    cases = [
        (dict(stage=4), "stage: got 4; use 1, 2 or 3"),
        (dict(stage=2, offload_parameters=True), "offload_parameters: needs stage=3"),
        (dict(blocks=5), "blocks: got 5; use .auto. or a list of module class names"),
        (dict(activation_checkpointing="most"), "activation_checkpointing: got 'most'"),
        (dict(timeout=-1), "timeout must be a finite number of seconds"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            FastDeepSpeedStrategy(**options)


def test_precision_comes_from_the_trainer_not_a_plugin():
    with pytest.raises(ValueError, match="precision comes from Trainer\\(precision=...\\)"):
        L.Trainer(
            accelerator="cpu", devices=2, strategy=FastDeepSpeedStrategy(),
            plugins=[FastMixedPrecision("bf16-mixed", device="cpu")], logger=False,
        )  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="fast_deepspeed", precision="bf16-mixed", logger=False)
    assert isinstance(trainer.strategy, FastDeepSpeedStrategy) and trainer.strategy.settings.stage == 2


def test_without_deepspeed_the_package_imports_and_the_strategy_says_how_to_install():
    script = (
        "import sys; sys.modules['deepspeed'] = None\n"  # what an environment without DeepSpeed gives
        "import lightning_fastdist\n"
        "try:\n    lightning_fastdist.FastDeepSpeedStrategy()\n"
        "except ImportError as error:\n    print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout == (
        "FastDeepSpeedStrategy needs DeepSpeed, which is not installed: pip install lightning-fastdist[deepspeed]\n"
    )


def test_auto_buckets_count_zero3_partitioned_parameters_by_their_full_size():
    """A model ZeRO-3 partitioned (validated after fit, or after ``GatheredParameters``) holds empty tensors whose
    size is ``ds_numel``: the buckets it gets are its size, not 0 (DeepSpeed refuses a bucket of 0)."""
    from lightning_fastdist.parallel.deepspeed.runtime import auto_bucket_size

    model = torch.nn.Linear(8, 4)
    for parameter in model.parameters():
        parameter.ds_numel = parameter.numel()
        parameter.data = torch.empty(0)
    assert auto_bucket_size(model) == 8 * 4 + 4
