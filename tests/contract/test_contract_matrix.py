"""Issue 36's contract matrix: Lightning's everyday features x every engine, each cell against Lightning's DDP.

Each feature (a column of Trainer options or a pattern in the LightningModule) trains the zoo's MLP with plain SGD
(a wrong learning rate or a missed clip shows at once, unlike under Adam) for 3 optimizer steps on 2 gloo ranks,
each rank reading its own half of the data, under Lightning's ``DDPStrategy`` (the reference) and under each engine.
A cell asserts, on every rank, the per-micro-batch losses and the final full weights (and what the feature adds:
the gathered tensors, the checkpoints kept and the validation from the best one) against DDP's, within the
engine's tolerance, or a documented one-line refusal before the first step. One launch runs every cell: the
processes, the process group and DeepSpeed's set-up are shared. docs/models.md, "The contract matrix", shows it.

Tolerances: relative 1e-5 for exact engines (``torch.allclose(rtol, atol=rtol/100)`` for tensors); relative 1e-2
where bf16 computes (bf16 gradients on the wire, ``bf16-mixed``), each tensor by its relative error in norm:
``||ours - ddp|| <= 1e-2 * max(||ddp||, rms * sqrt(numel))``, where ``rms`` is the root mean square of every tensor
compared with it (all the weights). bf16 rounds to 8 bits of mantissa of the magnitudes that made a value, not of the
value: a weight near zero carries an error of the model's scale, not of its own.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from tests.support.harness import run_function

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

WORLD, STEPS = 2, 3
EXACT = 1e-5  # fp32: the same sums in another order
BF16 = 1e-2  # bf16 computes: 8 bits of mantissa (relative 2**-8, ~4e-3) per rounding

FEATURES = [
    "clip_norm", "clip_value", "accumulation", "step_lr", "frozen", "all_gather", "checkpoint_best",
    "early_stopping", "manual_two_optimizers", "bf16_mixed",
]  # fmt: skip
EARLY_STOPPING_MAX_STEPS = 8
ENGINES = {
    "fast_ddp": ("FastDDPStrategy", {}),
    "fast_ddp bf16": ("FastDDPStrategy", {"comm_hook": "bf16"}),
    "fast_fsdp zero2": ("FastFSDPStrategy", {"sharding": "zero2"}),
    "fast_fsdp zero3": ("FastFSDPStrategy", {"sharding": "zero3"}),
    "fast_deepspeed 2": ("FastDeepSpeedStrategy", {"stage": 2}),
    "fast_deepspeed 3": ("FastDeepSpeedStrategy", {"stage": 3}),
}


def tolerance(feature: str, engine: str) -> float:
    """bf16 anywhere (gradients on the wire, or the whole computation) gets bf16's tolerance; the rest is exact."""
    return BF16 if "bf16" in engine or feature == "bf16_mixed" else EXACT


# Cells that refuse, in one line, before the first step: (feature, engine) -> a piece of the message.
# DeepSpeed clips inside its engine, by norm only ("gradient_clipping"): Lightning's DeepSpeedStrategy refuses
# clipping by value in its set-up, before any step, and ours inherits that.
REFUSALS: dict[tuple[str, str], str] = {
    ("clip_value", "fast_deepspeed 2"): "DeepSpeed does not support clipping gradients by value.",
    ("clip_value", "fast_deepspeed 3"): "DeepSpeed does not support clipping gradients by value.",
    # DeepSpeed's engine owns one optimizer: Lightning's DeepSpeedStrategy refuses two in its set-up.
    ("manual_two_optimizers", "fast_deepspeed 2"): "DeepSpeed currently only supports single optimizer",
    ("manual_two_optimizers", "fast_deepspeed 3"): "DeepSpeed currently only supports single optimizer",
    # A backward inside the step does not reduce a model FSDP shards as one unit (the MLP has no block "auto"
    # finds): FastFSDPStrategy refuses it and names the blocks to give (tests/fsdp/test_fsdp_manual_optimization.py).
    ("manual_two_optimizers", "fast_fsdp zero2"): "under manual optimization ContractMLP needs blocks",
    ("manual_two_optimizers", "fast_fsdp zero3"): "under manual optimization ContractMLP needs blocks",
}
# Per feature: Trainer options and the model's own pattern.
TRAINER_OPTIONS = {
    "clip_norm": dict(gradient_clip_val=0.05, gradient_clip_algorithm="norm"),
    "clip_value": dict(gradient_clip_val=0.002, gradient_clip_algorithm="value"),
    "accumulation": dict(accumulate_grad_batches=2),
    "bf16_mixed": dict(precision="bf16-mixed"),
}
VALIDATES = ("checkpoint_best", "early_stopping")  # validation every step


def _contract_mlp(feature: str):
    """The zoo's MLP with SGD and, per feature, a scheduler, a frozen first layer, all_gather or validation."""
    import torch
    import torch.nn.functional as F

    from tests.support.model_zoo import MLPStack

    class ContractMLP(MLPStack):
        def __init__(self) -> None:
            super().__init__()
            self.gathered: list[torch.Tensor] = []
            if feature == "frozen":
                self.net[0].requires_grad_(False)
            self.automatic_optimization = feature != "manual_two_optimizers"

        def configure_optimizers(self):
            if feature == "manual_two_optimizers":  # the first layer at one rate, the rest at another
                rest = [p for layer in self.net[1:] for p in layer.parameters()]
                return torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(rest, lr=0.05)
            optimizer = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)
            if feature != "step_lr":
                return optimizer
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if feature == "manual_two_optimizers":
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

        def validation_step(self, batch, batch_idx):
            inputs, targets = batch
            self.log("val_loss", F.mse_loss(self.net(inputs), targets), sync_dist=True)

    return ContractMLP()


def _strategy(engine: str):
    import lightning_fastdist

    name, options = ENGINES[engine]
    return getattr(lightning_fastdist, name)(**options)


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


def _held_out():
    """Validation data: 16 new samples, split between the ranks by Lightning's sampler."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(16, 16, generator=generator), torch.randn(16, 4, generator=generator)))


def _fit(feature: str, strategy, checkpoints: Path) -> dict:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from tests.support.workloads import LossRecorder, make_trainer

    L.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    callbacks: list = [recorder]
    options = dict(TRAINER_OPTIONS.get(feature, {}))
    if feature == "checkpoint_best":
        keeper = ModelCheckpoint(dirpath=checkpoints, monitor="val_loss", mode="min", save_top_k=2)
        callbacks.append(keeper)
        options.update(enable_checkpointing=True)
    if feature == "early_stopping":
        callbacks.append(EarlyStopping(monitor="val_loss", mode="min", patience=0))
        options.update(max_steps=EARLY_STOPPING_MAX_STEPS)
    if feature in VALIDATES:
        options.update(limit_val_batches=None, val_check_interval=1, check_val_every_n_epoch=None)
    model = _contract_mlp(feature)
    record: dict = {"losses": recorder.losses}
    try:
        trainer = make_trainer(strategy(), **{"max_steps": STEPS, "callbacks": callbacks, **options})
        trainer.fit(model, model.batches(), _held_out() if feature in VALIDATES else None)
        record["stopped_at"] = trainer.global_step
        record["weights"] = _full_weights(trainer, model)
        if feature == "all_gather":
            record["gathered"] = torch.stack(model.gathered)
        if feature == "checkpoint_best":
            record["kept"] = {Path(path).name: float(score) for path, score in keeper.best_k_models.items()}
            record["best"] = Path(keeper.best_model_path).name
            (validated,) = trainer.validate(model, _held_out(), ckpt_path="best", verbose=False)
            record["validated"] = validated["val_loss"]
    except Exception as error:  # noqa: BLE001 - a refusal is a cell's answer too; a failure is reported by its cell
        record["error"] = f"{type(error).__name__}: {error}"
    return record


def run_the_matrix(checkpoints: str) -> dict:
    """On each rank: per feature, Lightning's DDP and every engine; a plain DDP run shows each feature bites."""
    from lightning.pytorch.strategies import DDPStrategy

    root = Path(checkpoints)
    runs: dict = {("plain", "ddp"): _fit("plain", DDPStrategy, root / "plain")}
    for feature in FEATURES:
        runs[(feature, "ddp")] = _fit(feature, DDPStrategy, root / feature / "ddp")
        for engine in ENGINES:
            build = functools.partial(_strategy, engine)  # built in the cell: a refusal there is the cell's answer
            runs[(feature, engine)] = _fit(feature, build, root / feature / engine.replace(" ", "-"))
    runs["rank"] = int(os.environ["RANK"])
    return runs


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    checkpoints = tmp_path_factory.mktemp("contract")
    return run_function(run_the_matrix, WORLD, args=(str(checkpoints),), init_process_group=False, timeout=500)


def _assert_all_close(ours: list, expected: list, rel: float, what: str) -> None:
    """Tensor by tensor: exact engines element by element; bf16 by relative error in norm (the module's docstring)."""
    import torch

    assert len(ours) == len(expected), what
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


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_changes_what_ddp_trains(ranks, feature):
    """The reference itself: every feature changes DDP's result (a clip that never bites would prove nothing)."""
    for record in ranks:
        plain, reference = record[("plain", "ddp")], record[(feature, "ddp")]
        assert "error" not in reference, reference.get("error")
        if feature == "checkpoint_best":  # the best is not the final state: validating from it shows a load
            assert reference["best"] != f"epoch=0-step={STEPS}.ckpt" and len(reference["kept"]) == 2
        if feature == "early_stopping":
            assert reference["stopped_at"] < EARLY_STOPPING_MAX_STEPS
            continue
        if feature in ("all_gather", "checkpoint_best"):
            continue  # they observe training, they do not change it
        assert any(not (ours == theirs).all() for ours, theirs in zip(reference["weights"], plain["weights"])), (
            f"{feature} left DDP's weights as without it"
        )


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
            assert ours["validated"] == pytest.approx(reference["validated"], rel=rel), f"rank {rank}: validate"
