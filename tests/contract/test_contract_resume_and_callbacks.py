"""Lightning's contract, part four: checkpoints that change nothing, plain loaders that resume, and the callbacks users
reach for (grad norms, fine-tuning, weight averaging, lr_find, a compiled module), each engine against Lightning's DDP.

Each cell runs the user's own code on 2 gloo ranks, under Lightning's ``DDPStrategy`` (the reference) and under each
engine, and asserts per-micro-batch losses and final full weights within 1e-5 relative (fp32 everywhere), or a one-line
refusal before the first step. Where DDP is wrong the reference is the documented better one: a resume equals the run
that was not interrupted (DDP's own resume repeats or skips batches and draws other dropout masks), and parameters
unfrozen after the wrap are averaged over the ranks (DDP trains them on each rank's own gradients). One launch runs
every cell. docs/models.md shows the cells as its second pattern table, which a test here renders and finds there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.harness import run_function
from tests.support.shared_runs import once_per_session

WORLD, EXACT = 2, 1e-5
SAMPLES, BATCH = 32, 4  # 4 batches per rank per epoch
MODELS_DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
ENGINES = {
    "fast_ddp": ("FastDDPStrategy", {}),
    "fast_fsdp": ("FastFSDPStrategy", {}),
    "fast_deepspeed": ("FastDeepSpeedStrategy", {"stage": 2}),
}

# Pattern -> (how a user writes it, what its cells assert besides losses and weights).
PATTERNS = {
    "epoch_checkpoints": (
        "`Dropout`; a default `Trainer`'s `ModelCheckpoint` saving at each epoch's end; 3 epochs",
        "the run that saves equals DDP's without checkpoints; resumed from epoch 0's checkpoint it equals itself",
    ),
    "cut_short_map": (
        "`max_steps=6` (mid-epoch), `trainer.save_checkpoint`, `fit(ckpt_path=...)` to 12; a map-style dataset",
        "resumed equals the run not stopped (each sample once; DDP restarts at the next epoch, skipping 2 batches)",
    ),
    "cut_short_iterable": (
        "the same with an `IterableDataset`",
        "Lightning's behaviour, as DDP's resume, and one line saying what the resume skips",
    ),
    "clip_override": ("`configure_gradient_clipping` overridden: `self.clip_gradients(..., 0.05, 'norm')`", ""),
    "grad_norm": ("`self.log_dict(grad_norm(self, 2))` (Lightning's) in `on_before_optimizer_step`", "the norms"),
    "our_grad_norm": ("the same with `lightning_fastdist.grad_norm`", "the norms (DDP's: Lightning's)"),
    "backbone_finetuning": (
        "`BackboneFinetuning(unfreeze_backbone_at_epoch=1)`",
        "the ranks' weights equal (DDP's end apart); reference: DDP freezing after the wrap",
    ),
    "module_compile": ('`model.compile(backend="eager")`', ""),
    "torch_compile": ('`torch.compile(model, backend="eager")`', ""),
    "weight_averaging": ("`WeightAveraging()` (EMA), validation at each epoch's end", "the validation loss"),
    "lr_find": ("`Tuner(trainer).lr_find(...)`", "the losses and learning rates of the search"),
}
_DEEPSPEED_GRAD_NORM = "FastDeepSpeedStrategy: GradNorms.on_before_optimizer_step calls Lightning's grad_norm"
_LIGHTNING_NO_COMPILE = "Using a compiled model is incompatible with the current strategy"
REFUSALS = {
    ("clip_override", "fast_deepspeed"): "FastDeepSpeedStrategy: ClipOverride overrides configure_gradient_clipping",
    ("grad_norm", "fast_fsdp"): "FastFSDPStrategy: GradNorms.on_before_optimizer_step calls Lightning's grad_norm",
    ("grad_norm", "fast_deepspeed"): _DEEPSPEED_GRAD_NORM,
    # Lightning's own refusals, when the Trainer starts.
    ("backbone_finetuning", "fast_deepspeed"): "The Finetuning callback does not support running with the DeepSpeed",
    ("torch_compile", "fast_fsdp"): _LIGHTNING_NO_COMPILE,
    ("torch_compile", "fast_deepspeed"): _LIGHTNING_NO_COMPILE,
    ("weight_averaging", "fast_fsdp"): "FastFSDPStrategy: WeightAveraging keeps an unsharded copy of the model",
    ("lr_find", "fast_deepspeed"): "FastDeepSpeedStrategy: LearningRateFinder (Tuner.lr_find) steps",
}


def _model(pattern: str):
    """An MLP with dropout on seeded data (each sample's index travels with it), with the pattern's own code."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.utilities import grad_norm
    from torch import nn
    from torch.utils.data import DataLoader, Dataset, IterableDataset

    import lightning_fastdist

    generator = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(SAMPLES, 16, generator=generator), torch.randn(SAMPLES, 4, generator=generator)

    class Indexed(Dataset):
        def __len__(self) -> int:
            return SAMPLES

        def __getitem__(self, index: int):
            return inputs[index], targets[index], index

    class Streamed(IterableDataset):
        def __iter__(self):
            rank = int(os.environ.get("RANK", 0))
            for index in range(rank, SAMPLES, WORLD):
                yield inputs[index], targets[index], index

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5))
            self.head = nn.Linear(32, 4)
            self.seen: list[int] = []
            self.norms: list[dict] = []
            self.lr = 0.1

        def forward(self, x):
            return self.head(self.backbone(x))

        def training_step(self, batch, batch_idx):
            x, y, index = batch
            self.seen.extend(index.tolist())
            return F.mse_loss(self(x), y)

        def validation_step(self, batch, batch_idx):
            x, y, _ = batch
            self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

        def configure_optimizers(self):
            if getattr(self, "freezes_late", False):  # after the strategy wrapped the model (the reference)
                self.backbone.requires_grad_(False)
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)

        def batches(self) -> DataLoader:
            if pattern == "cut_short_iterable":
                return DataLoader(Streamed(), batch_size=BATCH)
            return DataLoader(Indexed(), batch_size=BATCH, shuffle=True)

    class ClipOverride(Model):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")

    class GradNorms(Model):
        def on_before_optimizer_step(self, optimizer):
            norms = grad_norm(self, norm_type=2)
            self.norms.append({name: float(value) for name, value in norms.items()})
            self.log_dict(norms)

    class OurGradNorms(Model):
        def on_before_optimizer_step(self, optimizer):
            norms = lightning_fastdist.grad_norm(self, norm_type=2)
            self.norms.append({name: float(value) for name, value in norms.items()})
            self.log_dict(norms)

    return {"clip_override": ClipOverride, "grad_norm": GradNorms, "our_grad_norm": OurGradNorms}.get(pattern, Model)()


def _late_freezing():
    """Lightning's BackboneFinetuning whose freezing the model does itself, in ``configure_optimizers``: after the
    strategy wrapped it (the correct DDP reference, with ``find_unused_parameters=True``)."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    class FreezingAfterTheWrap(BackboneFinetuning):
        def setup(self, trainer, pl_module, stage) -> None:
            pl_module.freezes_late = True

    return FreezingAfterTheWrap(unfreeze_backbone_at_epoch=1, verbose=False)


def _strategy(engine: str, pattern: str):
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_fastdist

    if engine == "ddp":
        return DDPStrategy(find_unused_parameters=pattern == "backbone_finetuning_reference")
    name, options = ENGINES[engine]
    return getattr(lightning_fastdist, name)(**options)


def _full_weights(trainer, model) -> list:
    """Every parameter, whole (ZeRO's fp32 masters, not yet copied into the module only where training goes on)."""
    from torch.distributed.tensor import DTensor

    return [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in model.parameters()]


def _fit(engine: str, pattern: str, folder: Path, max_steps: int = 12, resume: str | None = None) -> dict:
    """One fit of ``pattern`` under ``engine`` (``ddp``: Lightning's), recording what its cells compare."""
    import warnings

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint, WeightAveraging

    from tests.support.workloads import LossRecorder

    L.seed_everything(0, verbose=False)
    model = _model(pattern.removesuffix("_reference").removesuffix("_stop"))
    recorder = LossRecorder()
    callbacks: list = [recorder]
    options: dict = {"limit_val_batches": 0}
    if pattern == "epoch_checkpoints":
        callbacks.append(ModelCheckpoint(dirpath=folder, save_top_k=-1))
    if pattern == "backbone_finetuning":
        callbacks.append(BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False))
    if pattern == "backbone_finetuning_reference":
        callbacks.append(_late_freezing())
    if pattern == "weight_averaging":
        callbacks.append(WeightAveraging())
        options.update(limit_val_batches=None)
    if pattern in ("module_compile",):
        model.compile(backend="eager")
    record: dict = {"losses": recorder.losses}
    trainer = None
    try:
        trainer = L.Trainer(
            accelerator="cpu", devices=WORLD, strategy=_strategy(engine, pattern), max_steps=max_steps,
            max_epochs=-1, callbacks=callbacks, logger=False, enable_checkpointing=pattern == "epoch_checkpoints",
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=folder,
            **options,
        )  # fmt: skip
        fitted = torch.compile(model, backend="eager") if pattern == "torch_compile" else model
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if pattern == "lr_find":
                from lightning.pytorch.tuner import Tuner

                found = Tuner(trainer).lr_find(
                    model, model.batches(), min_lr=1e-3, max_lr=1.0, num_training=8, early_stop_threshold=None
                )
                record.update(lr_losses=found.results["loss"], lrs=found.results["lr"])
                return record
            validation = model.batches() if pattern == "weight_averaging" else None
            trainer.fit(fitted, model.batches(), validation, ckpt_path=resume)
        record["lines"] = [str(warning.message) for warning in caught]
        record["weights"] = _full_weights(trainer, model)
        record["seen"] = model.seen
        record["norms"] = model.norms
        record["val_loss"] = float(trainer.callback_metrics.get("val_loss", float("nan")))
        if pattern.endswith("_stop"):
            trainer.save_checkpoint(folder / "stop.ckpt")
    except Exception as error:  # noqa: BLE001 - a refusal is a cell's answer too; a failure is reported by its cell
        record["error"] = f"{type(error).__name__}: {error}"
    return record


def run_part_four(root: str) -> dict:
    """On each rank: per pattern, Lightning's DDP and every engine (and the reference runs and resumes they need)."""
    folder = Path(root)
    runs: dict = {"rank": int(os.environ["RANK"])}
    for engine in ("ddp", *ENGINES):
        runs[("plain", engine)] = _fit(engine, "plain", folder / "plain" / engine)
        runs[("epoch_checkpoints", engine)] = _fit(engine, "epoch_checkpoints", folder / "epochs" / engine)
        checkpoint = folder / "epochs" / engine / "epoch=0-step=4.ckpt"
        runs[("epoch_checkpoints resumed", engine)] = _fit(
            engine, "epoch_checkpoints", folder / "epochs-resumed" / engine, resume=str(checkpoint)
        )
        for data in ("cut_short_map", "cut_short_iterable"):
            if data == "cut_short_iterable" and engine not in ("ddp", "fast_ddp"):
                continue
            stopped = folder / data / engine
            runs[(data, engine)] = _fit(engine, data, folder / data / f"{engine}-straight")
            runs[(f"{data} stopped", engine)] = _fit(engine, f"{data}_stop", stopped, max_steps=6)
            runs[(f"{data} resumed", engine)] = _fit(engine, data, stopped, resume=str(stopped / "stop.ckpt"))
        for pattern in ("clip_override", "grad_norm", "our_grad_norm", "backbone_finetuning", "module_compile"):
            runs[(pattern, engine)] = _fit(engine, pattern, folder / pattern / engine)
        for pattern in ("torch_compile", "weight_averaging", "lr_find"):
            runs[(pattern, engine)] = _fit(engine, pattern, folder / pattern / engine)
    runs[("backbone_finetuning_reference", "ddp")] = _fit("ddp", "backbone_finetuning_reference", folder / "reference")
    return runs


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("contract_part_four")
    return once_per_session(
        tmp_path_factory,
        "contract_part_four",
        lambda: run_function(run_part_four, WORLD, args=(str(root),), init_process_group=False, timeout=600),
    )


def _close(ours: list, reference: list, what: str) -> None:
    import torch

    assert len(ours) == len(reference), what
    for index, (tensor, expected) in enumerate(zip(ours, reference)):
        difference = (tensor.double() - expected.double()).abs().max().item()
        assert torch.allclose(tensor.double(), expected.double(), rtol=EXACT, atol=EXACT * 1e-2), (
            f"{what} {index}: max difference {difference:.3g}"
        )


def _matches(ours: dict, reference: dict, what: str) -> None:
    assert "error" not in ours, f"{what}: {ours['error']}"
    assert len(ours["losses"]) == len(reference["losses"]) > 0, what
    assert ours["losses"] == pytest.approx(reference["losses"], rel=EXACT), f"{what}: losses"
    _close(ours["weights"], reference["weights"], f"{what}: parameter")


def _refused(ours: dict, piece: str) -> None:
    assert "error" in ours and piece in ours["error"], ours.get("error")
    assert "\n" not in ours["error"].strip() and ours["losses"] == [], "a refusal: one line, before a step"


CELLS = [(pattern, engine) for pattern in PATTERNS for engine in ENGINES]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("pattern", "engine"), CELLS, ids=[f"{p}-{e}" for p, e in CELLS])
def test_cell_matches_lightning_ddp_or_the_better_reference_or_refuses_in_one_line(ranks, pattern, engine):
    for record in ranks:
        what = f"rank {record['rank']}: {pattern} under {engine}"
        if (pattern, engine) in REFUSALS:
            _refused(record[(pattern, engine)], REFUSALS[(pattern, engine)])
            continue
        if pattern == "epoch_checkpoints":
            _matches(record[(pattern, engine)], record[("plain", "ddp")], f"{what}, saving")
            resumed, straight = record[("epoch_checkpoints resumed", engine)], record[(pattern, engine)]
            _matches(resumed, {**straight, "losses": straight["losses"][4:]}, f"{what}, resumed")
        elif pattern.startswith("cut_short") and engine != "fast_ddp" and pattern == "cut_short_iterable":
            continue  # the iterable dataset runs under DDP and FastDDPStrategy only
        elif pattern == "cut_short_map":
            straight, stopped = record[(pattern, engine)], record[(f"{pattern} stopped", engine)]
            resumed = record[(f"{pattern} resumed", engine)]
            _matches(straight, record[(pattern, "ddp")], f"{what}, not stopped")
            _matches(resumed, {**straight, "losses": straight["losses"][6:]}, f"{what}, resumed")
            assert stopped["seen"] + resumed["seen"] == straight["seen"], f"{what}: each sample once, in order"
        elif pattern == "cut_short_iterable":  # the data Lightning's resume reads (dropout: this run's saved states)
            ours, reference = record[(f"{pattern} resumed", engine)], record[(f"{pattern} resumed", "ddp")]
            assert "error" not in ours and ours["seen"] == reference["seen"] and len(ours["losses"]) == 6, what
            lines = record[(f"{pattern} stopped", engine)]["lines"] + record[(f"{pattern} resumed", engine)]["lines"]
            if record["rank"] == 0:
                assert any("a resume goes on with epoch 2 and skips" in line for line in lines), lines
        elif pattern == "backbone_finetuning":
            _matches(record[(pattern, engine)], record[("backbone_finetuning_reference", "ddp")], what)
        elif pattern == "lr_find":
            ours, reference = record[(pattern, engine)], record[(pattern, "ddp")]
            assert "error" not in ours, ours.get("error")
            assert ours["lrs"] == pytest.approx(reference["lrs"], rel=EXACT), f"{what}: learning rates"
            assert ours["lr_losses"] == pytest.approx(reference["lr_losses"], rel=EXACT), f"{what}: losses"
        else:
            reference = record[("grad_norm", "ddp") if pattern == "our_grad_norm" else (pattern, "ddp")]
            _matches(record[(pattern, engine)], reference, what)
            if pattern in ("grad_norm", "our_grad_norm"):
                ours, expected = record[(pattern, engine)]["norms"], reference["norms"]
                assert [step.keys() for step in ours] == [step.keys() for step in expected] and len(ours) == 12, what
                for step, (got, wanted) in enumerate(zip(ours, expected)):
                    assert got == pytest.approx(wanted, rel=EXACT), f"{what}: the norms of step {step}"
            if pattern == "weight_averaging":
                assert record[(pattern, engine)]["val_loss"] == pytest.approx(reference["val_loss"], rel=EXACT)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_where_ddp_is_wrong_it_differs_from_the_better_reference(ranks):
    """The references bite: DDP's own resume after a cut-short epoch skips the epoch's last batches (each sample once
    is not what it trains), and DDP trains a backbone unfrozen after the wrap on each rank's own gradients."""
    for record in ranks:
        straight, stopped = record[("cut_short_map", "ddp")], record[("cut_short_map stopped", "ddp")]
        assert stopped["seen"] + record[("cut_short_map resumed", "ddp")]["seen"] != straight["seen"]
    first, second = (record[("backbone_finetuning", "ddp")]["weights"] for record in ranks)
    assert any(not (a == b).all() for a, b in zip(first, second)), "DDP's ranks ended apart"
    first, second = (record[("backbone_finetuning", "fast_ddp")]["weights"] for record in ranks)
    assert all((a == b).all() for a, b in zip(first, second)), "ours ended equal"


def _answer(pattern: str, engine: str) -> str:
    if (pattern, engine) in REFUSALS:
        piece = REFUSALS[(pattern, engine)]
        return f"refuses: `{piece}`"
    if pattern == "cut_short_iterable" and engine != "fast_ddp":
        return "(not run)"
    if pattern in ("epoch_checkpoints", "cut_short_map", "backbone_finetuning"):
        return "matches the better reference"
    return "matches"


def pattern_table() -> str:
    """docs/models.md's second pattern table, from these cells: one row per pattern, one column per engine."""
    lines = [
        "| pattern | asserted besides losses and weights | " + " | ".join(f"`{e}`" for e in ENGINES) + " |",
        "| --- | --- | " + " | ".join("---" for _ in ENGINES) + " |",
    ]
    for pattern, (how, also) in PATTERNS.items():
        lines.append(f"| {how} | {also} | " + " | ".join(_answer(pattern, e) for e in ENGINES) + " |")
    return "\n".join(lines) + "\n"


def test_docs_models_shows_these_cells_as_its_second_pattern_table():
    table = pattern_table()
    assert table in MODELS_DOC.read_text(), f"docs/models.md's second pattern table differs; it is:\n{table}"
