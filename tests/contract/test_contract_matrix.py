"""Issue 36's contract matrix: Lightning's everyday patterns x every engine, each cell against Lightning's DDP.

Each pattern (Trainer options, a strategy option, or a pattern in the LightningModule) trains a small model with plain
SGD (a wrong learning rate or a missed clip shows at once, unlike under Adam) for 3 optimizer steps on 2 gloo ranks,
each rank reading its own half of the data, under Lightning's ``DDPStrategy`` (the reference) and under each engine.
The zoo's MLP serves every pattern but BatchNorm's, which trains the zoo's small ResNet (BatchNorm in every block).

A cell asserts, on every rank, the per-micro-batch losses, the optimizer steps taken and the final full weights (and
what the pattern adds: gathered tensors; the checkpoints kept; ``validate``, ``test`` and ``predict`` after fit and
from a checkpoint; BatchNorm's running statistics) against DDP's, within the cell's tolerance, or a one-line refusal
before the first step.

Tolerances: relative 1e-5 for exact engines (``torch.allclose(rtol, atol=rtol/100)`` for tensors); relative 1e-2
where bf16 computes (bf16 gradients on the wire, ``bf16-mixed``, ``bf16-true``), each tensor by its relative error in
norm: ``||ours - ddp|| <= 1e-2 * max(||ddp||, rms * sqrt(numel))``, where ``rms`` is the root mean square of every
tensor compared with it (all the weights; all the buffers). bf16 rounds to 8 bits of mantissa of the magnitudes that
made a value, not of the value: a weight near zero, or a tensor that starts at zero (BatchNorm's shift) whose
gradients on the two ranks nearly cancel, carries an error of the model's scale, not of its own.

One launch runs every cell: the processes, the process group and DeepSpeed's set-up are shared. docs/models.md shows
the matrix as its pattern table, which a test here renders and finds there.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from tests.support.harness import run_function
from tests.support.shared_runs import once_per_session

WORLD, STEPS = 2, 3
EXACT = 1e-5  # fp32 (and fp64): the same sums in another order
BF16 = 1e-2  # bf16 computes: 8 bits of mantissa (relative 2**-8, ~4e-3) per rounding
MODELS_DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"

# Pattern -> (how a user writes it, what its cells assert besides the losses, the steps and the final weights).
PATTERNS = {
    "clip_norm": ('`gradient_clip_val=0.05, gradient_clip_algorithm="norm"`', ""),
    "clip_value": ('`gradient_clip_val=0.002, gradient_clip_algorithm="value"`', ""),
    "accumulation": ("`accumulate_grad_batches=2`", "6 micro-batch losses"),
    "step_lr": ('`StepLR(step_size=1, gamma=0.5)`, `interval: "step"`', ""),
    "frozen": ("first layer frozen (`requires_grad_(False)`, left out of SGD)", ""),
    "lora": (
        "a LoRA adapter from `peft` (`get_peft_model`, rank 4 on every Linear): base weights frozen, adapters trained",
        "",
    ),
    "all_gather": ("`self.all_gather` in `training_step`", "every gathered tensor"),
    "checkpoint_best": (
        '`ModelCheckpoint(monitor="val_loss", save_top_k=2)`, validation every step, then `trainer.validate`, '
        '`test` and `predict` with `ckpt_path="best"`',
        "the 2 checkpoints kept, their scores, the best one (not the last step's), what each evaluation gives",
    ),
    "early_stopping": (
        '`EarlyStopping(monitor="val_loss", patience=0)`, validation every step, `max_steps=8`',
        "the step it stopped at (DDP: before 8)",
    ),
    "manual_two_optimizers": ("manual optimization, two SGD optimizers (first layer, the rest)", ""),
    "manual_two_optimizers_named_blocks": (
        'the same, with `blocks=["Sequential"]` given to every engine (the fix FSDP\'s refusal names)',
        "",
    ),
    "batchnorm": (
        "BatchNorm (a small ResNet), each rank's running statistics its own; `validate`, `test`, `predict` after "
        "fit and from the step-2 checkpoint",
        "what each evaluation gives on each rank, and the BatchNorm statistics it used",
    ),
    "sync_batchnorm": (
        "`Trainer(sync_batchnorm=True)` on the ResNet. On CPU torch refuses `SyncBatchNorm` in training, under "
        "Lightning's DDP too: DDP's and FSDP's refusals are torch's, met because they converted the layers",
        "Lightning's DDP refuses alike",
    ),
    "bf16_mixed": ('`precision="bf16-mixed"`', ""),
    "bf16_true": ('`precision="bf16-true"`', ""),
    "64_true": ('`precision="64-true"`', ""),
    "fp16_true": ('`precision="16-true"`', ""),
}
FEATURES = list(PATTERNS)
BF16_FEATURES = ("bf16_mixed", "bf16_true")
FP16_FEATURES = ("fp16_true",)  # half precision with 10 mantissa bits: bf16's tolerance holds it too
EARLY_STOPPING_MAX_STEPS = 8
ENGINES = {
    "fast_ddp": ("FastDDPStrategy", {}),
    "fast_ddp bf16": ("FastDDPStrategy", {"comm_hook": "bf16"}),
    "fast_fsdp zero2": ("FastFSDPStrategy", {"sharding": "zero2"}),
    "fast_fsdp zero3": ("FastFSDPStrategy", {"sharding": "zero3"}),
    "fast_deepspeed 2": ("FastDeepSpeedStrategy", {"stage": 2}),
    "fast_deepspeed 3": ("FastDeepSpeedStrategy", {"stage": 3}),
}
ENGINE_OPTIONS = {"manual_two_optimizers_named_blocks": {"blocks": ["Sequential"]}}  # per pattern, every engine


def tolerance(feature: str, engine: str) -> float:
    """bf16 anywhere (gradients on the wire, or the computation) gets bf16's tolerance; the rest is exact."""
    return BF16 if "bf16" in engine or feature in BF16_FEATURES + FP16_FEATURES else EXACT


# Cells that refuse, in one line, before the first step: (feature, engine) -> a piece of the message.
_SYNC_BATCHNORM_ON_CPU = "SyncBatchNorm layers only work with GPU modules"  # DDP's wrapper, Lightning's DDP too
_SYNC_BATCHNORM_FORWARD_ON_CPU = "SyncBatchNorm expected input tensor to be on GPU"  # torch, at the first forward
_SYNC_BATCHNORM_DEEPSPEED = "FastDeepSpeedStrategy: sync_batchnorm=True is not honoured by DeepSpeed's engine"
REFUSALS: dict[tuple[str, str], str] = {
    # DeepSpeed clips inside its engine, by norm only: Lightning's DeepSpeedStrategy refuses clipping by value.
    ("clip_value", "fast_deepspeed 2"): "DeepSpeed does not support clipping gradients by value.",
    ("clip_value", "fast_deepspeed 3"): "DeepSpeed does not support clipping gradients by value.",
    # DeepSpeed's engine owns one optimizer: Lightning's DeepSpeedStrategy refuses two in its set-up.
    ("manual_two_optimizers", "fast_deepspeed 2"): "DeepSpeed currently only supports single optimizer",
    ("manual_two_optimizers", "fast_deepspeed 3"): "DeepSpeed currently only supports single optimizer",
    ("manual_two_optimizers_named_blocks", "fast_deepspeed 2"): "DeepSpeed currently only supports single optimizer",
    ("manual_two_optimizers_named_blocks", "fast_deepspeed 3"): "DeepSpeed currently only supports single optimizer",
    # A backward inside the step does not reduce a model FSDP shards as one unit (the MLP has no block "auto"
    # finds): FastFSDPStrategy refuses it and names the blocks to give (tests/fsdp/test_fsdp_manual_optimization.py).
    ("manual_two_optimizers", "fast_fsdp zero2"): "under manual optimization ContractMLP needs blocks",
    ("manual_two_optimizers", "fast_fsdp zero3"): "under manual optimization ContractMLP needs blocks",
    # torch runs SyncBatchNorm on GPUs only: DDP's wrapper refuses the model on CPU, FSDP's first forward stops in
    # torch's SyncBatchNorm; DeepSpeed's engine does not convert BatchNorm (Lightning's class ignores the flag).
    ("sync_batchnorm", "fast_ddp"): _SYNC_BATCHNORM_ON_CPU,
    ("sync_batchnorm", "fast_ddp bf16"): _SYNC_BATCHNORM_ON_CPU,
    ("sync_batchnorm", "fast_fsdp zero2"): _SYNC_BATCHNORM_FORWARD_ON_CPU,
    ("sync_batchnorm", "fast_fsdp zero3"): _SYNC_BATCHNORM_FORWARD_ON_CPU,
    ("sync_batchnorm", "fast_deepspeed 2"): _SYNC_BATCHNORM_DEEPSPEED,
    ("sync_batchnorm", "fast_deepspeed 3"): _SYNC_BATCHNORM_DEEPSPEED,
    # Lightning's own precision checks, when the Trainer is built.
    ("64_true", "fast_fsdp zero2"): "The `ModelParallelStrategy` does not support `Fabric(..., precision='64-true')`",
    ("64_true", "fast_fsdp zero3"): "The `ModelParallelStrategy` does not support `Fabric(..., precision='64-true')`",
    ("64_true", "fast_deepspeed 2"): "`Trainer(strategy='deepspeed', precision='64-true')` is not supported.",
    ("64_true", "fast_deepspeed 3"): "`Trainer(strategy='deepspeed', precision='64-true')` is not supported.",
    # DeepSpeed's fp16 keeps fp32 master weights and a loss scaler that skips the first steps: 3 steps ended 14%
    # from DDP's 16-true weights in norm. Refused before any process starts.
    ("fp16_true", "fast_deepspeed 2"): "FastDeepSpeedStrategy: precision='16-true' (fp16 weights, no loss scaling)",
    ("fp16_true", "fast_deepspeed 3"): "FastDeepSpeedStrategy: precision='16-true' (fp16 weights, no loss scaling)",
}
REFERENCE_REFUSALS = {"sync_batchnorm": _SYNC_BATCHNORM_ON_CPU}  # where Lightning's DDP itself refuses (on CPU)

# Per pattern: Trainer options and the model's own pattern.
TRAINER_OPTIONS = {
    "clip_norm": dict(gradient_clip_val=0.05, gradient_clip_algorithm="norm"),
    "clip_value": dict(gradient_clip_val=0.002, gradient_clip_algorithm="value"),
    "accumulation": dict(accumulate_grad_batches=2),
    "sync_batchnorm": dict(sync_batchnorm=True),
    "bf16_mixed": dict(precision="bf16-mixed"),
    "bf16_true": dict(precision="bf16-true"),
    "64_true": dict(precision="64-true"),
    "fp16_true": dict(precision="16-true"),
}
VALIDATES = ("checkpoint_best", "early_stopping")  # validation every step
BATCHNORM = ("batchnorm", "sync_batchnorm")  # the ResNet
BATCHNORM_CHECKPOINT = "epoch=0-step=2.ckpt"  # not the final state: evaluating from it shows a load
MANUAL = ("manual_two_optimizers", "manual_two_optimizers_named_blocks")


def _contract_model(feature: str):
    """The zoo's MLP (or, for BatchNorm, its ResNet) with SGD, evaluation steps, and the pattern's own code."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from tests.support.model_zoo import MLPStack, ResidualCNN

    class Evaluated:
        """The evaluation steps both models share: the validation loss of all ranks, the test loss of this one."""

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.evaluation_loss(batch), sync_dist=True)

        def test_step(self, batch, batch_idx):
            self.log("test_loss", self.evaluation_loss(batch))

    class ContractMLP(Evaluated, MLPStack):
        def __init__(self) -> None:
            super().__init__()
            self.gathered: list[torch.Tensor] = []
            if feature == "frozen":
                self.net[0].requires_grad_(False)
            if feature == "lora":  # as a peft user writes it; A is drawn from the seeded generator, B starts at 0
                import peft

                self.net = peft.get_peft_model(self.net, peft.LoraConfig(r=4, target_modules=["0", "2", "4"]))
            self.automatic_optimization = feature not in MANUAL

        def configure_optimizers(self):
            if feature in MANUAL:  # the first layer at one rate, the rest at another
                rest = [p for layer in self.net[1:] for p in layer.parameters()]
                return torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(rest, lr=0.05)
            optimizer = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)
            if feature != "step_lr":
                return optimizer
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if feature in MANUAL:
                first, rest = self.optimizers()
                self.manual_backward(loss)
                first.step()
                rest.step()
                first.zero_grad()
                rest.zero_grad()
            if feature == "all_gather":
                inputs, _ = batch
                self.gathered.append(self.all_gather(torch.stack([loss.detach(), inputs.sum()])).clone())
            return loss

        def predict_step(self, batch, batch_idx):
            inputs, _ = batch
            return self.net(inputs)

        def evaluation_loss(self, batch):
            inputs, targets = batch
            return F.mse_loss(self.net(inputs), targets)

        def held_out(self) -> DataLoader:
            """16 new samples, split between the ranks by Lightning's sampler."""
            generator = torch.Generator().manual_seed(1)
            return DataLoader(
                TensorDataset(torch.randn(16, 16, generator=generator), torch.randn(16, 4, generator=generator))
            )

    class ContractCNN(Evaluated, ResidualCNN):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def logits(self, images):
            return self.head(self.stages(self.stem(images)).mean(dim=(2, 3)))

        def predict_step(self, batch, batch_idx):
            images, _ = batch
            return self.logits(images)

        def evaluation_loss(self, batch):
            images, labels = batch
            return F.cross_entropy(self.logits(images), labels)

        def held_out(self) -> DataLoader:
            """16 new images, split between the ranks by Lightning's sampler, 4 to a batch."""
            generator = torch.Generator().manual_seed(1)
            images = torch.randn(16, 3, 16, 16, generator=generator)
            return DataLoader(TensorDataset(images, torch.randint(0, 10, (16,), generator=generator)), batch_size=4)

    return ContractCNN() if feature in BATCHNORM else ContractMLP()


def _strategy(engine: str, feature: str):
    import lightning_fastdist

    name, options = ENGINES[engine]
    return getattr(lightning_fastdist, name)(**options, **ENGINE_OPTIONS.get(feature, {}))


def _full_weights(trainer, model) -> list:
    """Every parameter, whole, in the model's order (a collective under FSDP and ZeRO-3)."""
    from torch.distributed.tensor import DTensor

    from lightning_fastdist import FastDeepSpeedStrategy

    if isinstance(trainer.strategy, FastDeepSpeedStrategy):  # the fp32 master copy where one is kept (bf16)
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        parameters = list(trainer.strategy.deepspeed_engine.module.parameters())
        with deepspeed.zero.GatheredParameters(parameters):
            module_values = [p.detach().float().clone() for p in parameters]
        masters = [safe_get_full_fp32_param(p) for p in parameters]  # None for a frozen parameter
        return [m.detach().clone() if m is not None else v for m, v in zip(masters, module_values)]
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in model.parameters()]


def _buffers(model) -> list:
    """BatchNorm's running statistics and counts, as this rank holds them."""
    return [buffer.detach().clone() for buffer in model.buffers()]


def _evaluate(trainer, model, ckpt_path: str | None = None) -> dict:
    """What ``validate``, ``test`` and ``predict`` give on this rank, and the buffers the model then holds."""
    import torch

    (validated,) = trainer.validate(model, model.held_out(), ckpt_path=ckpt_path, verbose=False)
    (tested,) = trainer.test(model, model.held_out(), ckpt_path=ckpt_path, verbose=False)
    predicted = trainer.predict(model, model.held_out(), ckpt_path=ckpt_path)
    return {
        "validate": validated["val_loss"],
        "test": tested["test_loss"],
        "predict": torch.cat(predicted),
        "buffers": _buffers(model),
    }


def _fit(feature: str, strategy, checkpoints: Path) -> dict:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from tests.support.workloads import LossRecorder, make_trainer

    L.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    callbacks: list = [recorder]
    options = {
        "max_steps": STEPS,
        "callbacks": callbacks,
        "limit_val_batches": None,
        **TRAINER_OPTIONS.get(feature, {}),
    }
    if feature == "checkpoint_best":
        keeper = ModelCheckpoint(dirpath=checkpoints, monitor="val_loss", mode="min", save_top_k=2)
        callbacks.append(keeper)
        options.update(enable_checkpointing=True)
    if feature == "batchnorm":
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=2, save_top_k=-1))
        options.update(enable_checkpointing=True)
    if feature == "early_stopping":
        callbacks.append(EarlyStopping(monitor="val_loss", mode="min", patience=0))
        options.update(max_steps=EARLY_STOPPING_MAX_STEPS)
    if feature in VALIDATES:
        options.update(val_check_interval=1, check_val_every_n_epoch=None)
    model = _contract_model(feature)
    record: dict = {"losses": recorder.losses}
    try:
        trainer = make_trainer(strategy(), **options)
        trainer.fit(model, model.batches(), model.held_out() if feature in VALIDATES else None)
        record["stopped_at"] = trainer.global_step
        record["weights"] = _full_weights(trainer, model)
        if feature == "all_gather":
            record["gathered"] = torch.stack(model.gathered)
        if feature == "checkpoint_best":
            record["kept"] = {Path(path).name: float(score) for path, score in keeper.best_k_models.items()}
            record["best"] = Path(keeper.best_model_path).name
            record["from checkpoint"] = _evaluate(trainer, model, ckpt_path="best")
        if feature == "batchnorm":
            record["buffers after fit"] = _buffers(model)
            record["after fit"] = _evaluate(trainer, model)
            record["from checkpoint"] = _evaluate(trainer, model, ckpt_path=str(checkpoints / BATCHNORM_CHECKPOINT))
    except Exception as error:  # noqa: BLE001 - a refusal is a cell's answer too; a failure is reported by its cell
        record["error"] = f"{type(error).__name__}: {error}"
    return record


def run_the_matrix(checkpoints: str) -> dict:
    """On each rank: per pattern, Lightning's DDP and every engine; a plain DDP run shows each pattern bites."""
    from lightning.pytorch.strategies import DDPStrategy

    root = Path(checkpoints)
    runs: dict = {("plain", "ddp"): _fit("plain", DDPStrategy, root / "plain")}
    for feature in FEATURES:
        runs[(feature, "ddp")] = _fit(feature, DDPStrategy, root / feature / "ddp")
        for engine in ENGINES:
            build = functools.partial(_strategy, engine, feature)  # built in the cell: a refusal there is its answer
            runs[(feature, engine)] = _fit(feature, build, root / feature / engine.replace(" ", "-"))
    runs["rank"] = int(os.environ["RANK"])
    return runs


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    checkpoints = tmp_path_factory.mktemp("contract")
    return once_per_session(
        tmp_path_factory,
        "contract_matrix",
        lambda: run_function(run_the_matrix, WORLD, args=(str(checkpoints),), init_process_group=False, timeout=500),
    )


def _assert_all_close(ours: list, expected: list, rel: float, what: str) -> None:
    """Tensor by tensor: exact engines element by element; bf16 by relative error in norm (the module's docstring)."""
    import torch

    assert len(ours) == len(expected), what
    if not expected:  # a model without buffers
        return
    expected = [tensor.double() for tensor in expected]
    typical = torch.cat([tensor.flatten() for tensor in expected]).square().mean().sqrt().item()  # RMS of them all
    for index, (tensor, reference) in enumerate(zip(ours, expected)):
        label = f"{what} {index}"
        assert tensor.shape == reference.shape, label
        tensor = tensor.double()
        if rel == EXACT:
            difference = (tensor - reference).abs().max().item()
            assert torch.allclose(tensor, reference, rtol=rel, atol=rel * 1e-2), (
                f"{label}: max difference {difference:.3g}"
            )
            continue
        scale = max(torch.linalg.vector_norm(reference).item(), typical * reference.numel() ** 0.5)
        error = torch.linalg.vector_norm(tensor - reference).item()
        assert error <= rel * scale, f"{label}: error in norm {error / scale:.3g} of its scale"


def _assert_evaluations_match(ours: dict, reference: dict, rel: float, what: str) -> None:
    assert ours["validate"] == pytest.approx(reference["validate"], rel=rel), f"{what}: validate"
    assert ours["test"] == pytest.approx(reference["test"], rel=rel), f"{what}: test"
    _assert_all_close([ours["predict"]], [reference["predict"]], rel, f"{what}: predictions")
    _assert_all_close(ours["buffers"], reference["buffers"], rel, f"{what}: buffer")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("feature", FEATURES)
def test_each_pattern_changes_what_ddp_trains(ranks, feature):
    """The reference itself: every pattern changes DDP's result (a clip that never bites would prove nothing)."""
    for record in ranks:
        plain, reference = record[("plain", "ddp")], record[(feature, "ddp")]
        if feature in REFERENCE_REFUSALS:
            assert REFERENCE_REFUSALS[feature] in reference.get("error", ""), reference.get("error")
            continue
        assert "error" not in reference, reference.get("error")
        if feature == "checkpoint_best":  # the best is not the final state: evaluating from it shows a load
            assert reference["best"] != f"epoch=0-step={STEPS}.ckpt" and len(reference["kept"]) == 2
        if feature == "early_stopping":
            assert reference["stopped_at"] < EARLY_STOPPING_MAX_STEPS
            continue
        if feature in ("all_gather", "checkpoint_best"):
            continue  # they observe training, they do not change it
        if feature == "batchnorm":  # each rank's statistics are its own: evaluation would differ without a broadcast
            rank0, rank1 = (other[("batchnorm", "ddp")]["buffers after fit"] for other in ranks)
            assert any(not (a == b).all() for a, b in zip(rank0, rank1))
            continue
        assert any(not (ours == theirs).all() for ours, theirs in zip(reference["weights"], plain["weights"])), (
            f"{feature} left DDP's weights as without it"
        )


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("feature", "engine"),
    [(feature, engine) for feature in FEATURES for engine in ENGINES],
    ids=[f"{feature}-{engine.replace(' ', '_')}" for feature in FEATURES for engine in ENGINES],
)
def test_cell_matches_lightning_ddp_or_refuses_in_one_line(ranks, feature, engine):
    for record in ranks:
        rank = record["rank"]
        reference, ours = record[(feature, "ddp")], record[(feature, engine)]
        if (feature, engine) in REFUSALS:
            assert "error" in ours and REFUSALS[(feature, engine)] in ours["error"], ours.get("error")
            assert "\n" not in ours["error"].strip() and ours["losses"] == [], "a refusal: one line, before a step"
            continue
        assert "error" not in ours, f"rank {rank}: {ours['error']}"
        rel = tolerance(feature, engine)
        assert ours["stopped_at"] == reference["stopped_at"], f"rank {rank}: optimizer steps"
        assert len(ours["losses"]) == len(reference["losses"]) > 0
        assert ours["losses"] == pytest.approx(reference["losses"], rel=rel), f"rank {rank}: losses"
        _assert_all_close(ours["weights"], reference["weights"], rel, f"rank {rank}: parameter")
        if feature == "all_gather":
            _assert_all_close([ours["gathered"]], [reference["gathered"]], rel, f"rank {rank}: all_gather")
        if feature == "checkpoint_best":
            assert ours["kept"].keys() == reference["kept"].keys() and len(ours["kept"]) == 2, f"rank {rank}"
            assert list(ours["kept"].values()) == pytest.approx(list(reference["kept"].values()), rel=rel)
            assert ours["best"] == reference["best"]
        if feature == "batchnorm":
            # Rank 0's statistics after fit are DDP's under every engine. Rank 1's are not compared: DDP overwrites
            # them with rank 0's at every forward, FSDP and DeepSpeed keep rank 1's own; every engine makes them
            # rank 0's before evaluation, where they are compared.
            if rank == 0:
                _assert_all_close(ours["buffers after fit"], reference["buffers after fit"], rel, "rank 0: buffer")
            _assert_evaluations_match(ours["after fit"], reference["after fit"], rel, f"rank {rank}: after fit")
        if "from checkpoint" in reference:
            _assert_evaluations_match(ours["from checkpoint"], reference["from checkpoint"], rel, f"rank {rank}: ckpt")


def _answer(feature: str, engine: str) -> str:
    if (feature, engine) in REFUSALS:
        return f"refuses: {_code(REFUSALS[(feature, engine)])}"
    if tolerance(feature, engine) == EXACT:
        return "matches"
    return (
        "matches within 1e-2 (fp16)"
        if feature in FP16_FEATURES and "bf16" not in engine
        else "matches within 1e-2 (bf16)"
    )


def _code(text: str) -> str:
    """``text`` as Markdown code, also when it holds backticks."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def pattern_table() -> str:
    """docs/models.md's pattern table, from the matrix: one row per pattern, one column per engine."""
    lines = [
        "| pattern | asserted besides losses, steps and weights | " + " | ".join(f"`{e}`" for e in ENGINES) + " |",
        "| --- | --- | " + " | ".join("---" for _ in ENGINES) + " |",
    ]
    for feature, (pattern, also) in PATTERNS.items():
        lines.append(f"| {pattern} | {also} | " + " | ".join(_answer(feature, e) for e in ENGINES) + " |")
    return "\n".join(lines) + "\n"


def test_docs_models_shows_the_matrix_as_its_pattern_table():
    table = pattern_table()
    assert table in MODELS_DOC.read_text(), f"docs/models.md's pattern table differs from the matrix; it is:\n{table}"
