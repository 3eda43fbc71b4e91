"""Lightning's contract, part five (issue 57): more everyday Lightning code, each engine against Lightning's DDP.

Each cell runs the user's own code (an MLP, plain SGD at lr 0.1, data that carries each sample's index) on 2 gloo ranks,
under Lightning's ``DDPStrategy`` (the reference) and under each engine, and asserts per-micro-batch losses, the
optimizer steps and the final full weights within 1e-5 relative (fp32), plus what the pattern adds; or a one-line
refusal before the first step. Where DDP is wrong the reference is the documented better one (a resume equals the run
that was not interrupted). One launch runs every cell; docs/models.md shows the cells as its third pattern table, which
a test here renders and finds there.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from tests.support.harness import run_function
from tests.support.shared_runs import once_per_session

WORLD, EXACT = 2, 1e-5
FEATURES, BATCH = 8, 2
MODELS_DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
ENGINES = {
    "fast_ddp": ("FastDDPStrategy", {}),
    "fast_fsdp": ("FastFSDPStrategy", {}),
    "fast_deepspeed 1": ("FastDeepSpeedStrategy", {"stage": 1}),
    "fast_deepspeed 2": ("FastDeepSpeedStrategy", {"stage": 2}),
    "fast_deepspeed 3": ("FastDeepSpeedStrategy", {"stage": 3}),
}
ACCUMULATED_BATCHES = 10  # per rank and epoch, with accumulate_grad_batches=3: windows of 3, 3, 3 and 1
LONG, SHORT = 6, 3  # batches per rank of a CombinedLoader's two loaders
CHECKPOINT_EVERY = 4  # steps: inside epoch 0 (6 batches in max_size_cycle and max_size, 3 in min_size)
MODES = ("max_size_cycle", "max_size", "min_size")

# Pattern -> (how a user writes it, what its cells assert besides losses, steps and weights).
PATTERNS = {
    "accumulation_epoch_end": (
        "`accumulate_grad_batches=3`, 10 batches per rank and epoch, 2 epochs",
        "the epoch's short last window steps at its end (global step 4 after epoch 0, 8 at the end)",
    ),
    "combined_max_size_cycle": (
        '`CombinedLoader({"a": A, "b": B}, "max_size_cycle")` (6 and 3 batches per rank), 2 epochs, resumed from '
        "`ModelCheckpoint(every_n_train_steps=4)`'s step-4 checkpoint",
        "resumed equals the run not stopped, each loader's samples in order (DDP restarts both loaders); the step-4 "
        "checkpoint changes nothing",
    ),
    "combined_max_size": ('the same in mode `"max_size"` (B exhausted at the checkpoint)', "the same"),
    "combined_min_size": ('the same in mode `"min_size"` (3 batches per epoch: the checkpoint in epoch 1)', "the same"),
    "way_back": (
        "`lightning_fastdist.to_lightning_checkpoint` (or `lightning-fastdist to-lightning`) of our checkpoint after "
        "epoch 0 (SGD with momentum, two groups; FSDP's sharded folder, DeepSpeed's folder), resumed by Lightning's "
        "`DDPStrategy` (and `ModelParallelStrategy`: FSDP, ZeRO-3) to epoch 1's end",
        "the resumed run equals ours not interrupted (its optimizer state carried over)",
    ),
    "on_load_checkpoint": (
        "`on_save_checkpoint` and a callback's `state_dict` write the saving rank; the `max_size_cycle` resume above",
        "every rank's `on_load_checkpoint` and the callback's `load_state_dict` receive rank 0's, as under DDP",
    ),
    "stateful_loader": (
        "a stateful loader (an `IterableDataset` and a `DataLoader` with `state_dict`/`load_state_dict`, as LitData's "
        "`StreamingDataLoader`), resumed from the step-4 checkpoint",
        "resumed where DDP's own resume goes (Lightning restores the loader), and no line",
    ),
    "swa": ("`StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)`, 2 epochs", "the averaged weights"),
    "gan_manual": (
        "Lightning's GAN example: manual optimization, `toggle_optimizer`, the generator's loss, backward and step, "
        "then the discriminator's (a head both use outside their blocks)",
        "both losses of every step",
    ),
    "empty_init_load_from_checkpoint": (
        "`with trainer.init_module(empty_init=True): model = M.load_from_checkpoint(path)`",
        "the loaded weights train (DDP: they do; they differ from M's own)",
    ),
    "empty_init_load_state_dict": (
        "`with trainer.init_module(empty_init=True): model = M()`, then `model.load_state_dict(...)`",
        "the same",
    ),
    "lightning_resumes_ours": (
        "our checkpoint resumed by Lightning's `DDPStrategy` (SGD with momentum, two groups): at step 4 (inside an "
        "epoch), at epoch 0's end, and after `fit(max_steps=9)` cut epoch 1 short (`trainer.save_checkpoint`)",
        "bit for bit what `DDPStrategy` resuming DDP's own checkpoint trains, at each of the three",
    ),
}
RESUMED = [*(f"combined_{mode}" for mode in MODES), "stateful_loader"]
RUN_ONLY = {  # the patterns run under some engines only (the mechanism is the same in the others)
    "combined_max_size": ("fast_ddp", "fast_fsdp", "fast_deepspeed 2"),
    "combined_min_size": ("fast_ddp", "fast_fsdp", "fast_deepspeed 2"),
    "stateful_loader": ("fast_ddp", "fast_fsdp", "fast_deepspeed 2"),
    "swa": ("fast_ddp", "fast_fsdp", "fast_deepspeed 2"),
    "gan_manual": ("fast_ddp", "fast_fsdp", "fast_deepspeed 2"),
}
TRAINED = (
    "accumulation_epoch_end",
    "swa",
    "gan_manual",
    "empty_init_load_from_checkpoint",
    "empty_init_load_state_dict",
)
WITH_MOMENTUM = ("lightning_resumes_ours", "way_back")  # SGD with momentum in two groups: its state matters to a resume
FIND_UNUSED = ("gan_manual",)  # DDP needs find_unused_parameters=True: each pass leaves the other model's unused
_NO_SHARDED_SWA = "SWA does not currently support sharded models"

REFUSALS = {
    ("swa", "fast_fsdp"): "FastFSDPStrategy: StochasticWeightAveraging keeps an unsharded copy of the model",
    # Lightning's own refusals, when the fit starts: by class (DeepSpeedStrategy), and of two optimizers.
    ("swa", "fast_deepspeed 2"): _NO_SHARDED_SWA,
    ("gan_manual", "fast_deepspeed 2"): "DeepSpeed currently only supports single optimizer",
}
SAVE_POINTS = ("step=4", "epoch=0-end", "cut")  # inside epoch 0, at its end, after max_steps=9 cut epoch 1 short
SAVERS = {
    "ddp": ("DDPStrategy", {}),
    "fast_ddp": ENGINES["fast_ddp"],
    "fast_fsdp": ("FastFSDPStrategy", {"checkpoint_format": "full"}),
}


def _runs(pattern: str, engine: str) -> bool:
    return engine in RUN_ONLY.get(pattern, ENGINES)


def _samples(count: int, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, FEATURES, generator=generator), torch.randn(count, 1, generator=generator)


def _model(pattern: str):
    """An MLP (two layers) on seeded data whose samples carry their index, with the pattern's own code."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.utilities import CombinedLoader
    from torch import nn
    from torch.utils.data import DataLoader, Dataset, IterableDataset

    class Indexed(Dataset):
        def __init__(self, count: int, seed: int) -> None:
            self.inputs, self.targets = _samples(count, seed)

        def __len__(self) -> int:
            return len(self.inputs)

        def __getitem__(self, index: int):
            return self.inputs[index], self.targets[index], index

    def loader(batches: int, seed: int) -> DataLoader:
        return DataLoader(Indexed(WORLD * BATCH * batches, seed), batch_size=BATCH)

    class Streamed(IterableDataset):
        """This rank's share of the samples, in order, from ``start`` on (the position a resume sets)."""

        def __init__(self, count: int, seed: int) -> None:
            self.inputs, self.targets = _samples(count, seed)
            self.start = 0

        def __iter__(self):
            indices = range(int(os.environ["RANK"]), len(self.inputs), WORLD)
            start, self.start = self.start, 0
            for index in list(indices)[start:]:
                yield self.inputs[index], self.targets[index], index

    class StatefulLoader(DataLoader):
        """Saves how many batches it handed out this epoch, and resumes after them."""

        def __init__(self, dataset: Streamed) -> None:
            super().__init__(dataset, batch_size=BATCH)
            self.handed_out = 0

        def __iter__(self):
            for batch in super().__iter__():
                self.handed_out += 1
                yield batch
            self.handed_out = 0

        def state_dict(self) -> dict:
            return {"handed_out": self.handed_out}

        def load_state_dict(self, state_dict) -> None:
            self.handed_out = state_dict["handed_out"]
            self.dataset.start = self.handed_out * BATCH

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1))
            self.seen: list = []
            self.both_losses: list = []
            self.loaded_from_rank = None

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            parts = batch if isinstance(batch, dict) else {"": batch}
            self.seen.append({name: part[2].tolist() for name, part in parts.items() if part is not None})
            return sum(F.mse_loss(self(x), y) for x, y, _ in (part for part in parts.values() if part is not None))

        def configure_optimizers(self):
            if pattern in WITH_MOMENTUM:  # two groups: each laid out on its own in ZeRO's flat buffers
                groups = [{"params": self.net[0].parameters()}, {"params": self.net[2].parameters(), "lr": 0.05}]
                return torch.optim.SGD(groups, lr=0.1, momentum=0.5)
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def configure_model(self) -> None:
            from lightning.pytorch.strategies import ModelParallelStrategy
            from torch.distributed.fsdp import fully_shard

            attached = self._trainer  # load_from_checkpoint calls this hook too, without a trainer
            if attached is not None and type(attached.strategy) is ModelParallelStrategy:  # the model shards itself
                fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def on_save_checkpoint(self, checkpoint) -> None:
            checkpoint["saved_on_rank"] = self.global_rank

        def on_load_checkpoint(self, checkpoint) -> None:
            self.loaded_from_rank = checkpoint.get("saved_on_rank")

        def batches(self):
            if pattern.startswith("combined_"):
                mode = pattern.removeprefix("combined_")
                return CombinedLoader({"a": loader(LONG, 1), "b": loader(SHORT, 2)}, mode)
            if pattern == "stateful_loader":
                return StatefulLoader(Streamed(WORLD * BATCH * LONG, 1))
            return loader(LONG if pattern in WITH_MOMENTUM else ACCUMULATED_BATCHES, 1)

    class Half(nn.Module):
        """A block: the generator and the discriminator are one each."""

        def __init__(self, outputs: int) -> None:
            super().__init__()
            self.inner, self.outer = nn.Linear(FEATURES, 16), nn.Linear(16, outputs)

        def forward(self, x):
            return self.outer(torch.relu(self.inner(x)))

    class GAN(Model):
        """Lightning's GAN example in small: the generator maps each sample to a fake one; the discriminator and the
        head (outside both blocks) tell real from fake."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.generator, self.discriminator, self.head = Half(FEATURES), Half(4), nn.Linear(4, 1)
            self.automatic_optimization = False

        def judge(self, samples):
            return self.head(self.discriminator(samples))

        def training_step(self, batch, batch_idx):
            real, _, _ = batch
            generator_optimizer, discriminator_optimizer = self.optimizers()
            self.toggle_optimizer(generator_optimizer)
            fooled = self.judge(self.generator(real.flip(1)))
            generator_loss = F.mse_loss(fooled, torch.ones_like(fooled))
            self.manual_backward(generator_loss)
            generator_optimizer.step()
            generator_optimizer.zero_grad()
            self.untoggle_optimizer(generator_optimizer)
            self.toggle_optimizer(discriminator_optimizer)
            fake, genuine = self.judge(self.generator(real.flip(1)).detach()), self.judge(real)
            discriminator_loss = F.mse_loss(fake, torch.zeros_like(fake)) + F.mse_loss(
                genuine, torch.ones_like(genuine)
            )
            self.manual_backward(discriminator_loss)
            discriminator_optimizer.step()
            discriminator_optimizer.zero_grad()
            self.untoggle_optimizer(discriminator_optimizer)
            self.both_losses.append((float(generator_loss), float(discriminator_loss)))
            return {"loss": generator_loss.detach() + discriminator_loss.detach()}

        def configure_optimizers(self):
            judges = [*self.discriminator.parameters(), *self.head.parameters()]
            return torch.optim.SGD(self.generator.parameters(), lr=0.1), torch.optim.SGD(judges, lr=0.1)

    return GAN() if pattern == "gan_manual" else Model()


def _loaded_weights(folder: Path, model) -> Path:
    """A checkpoint of ``model``'s class with weights of its own (each rank writes its copy)."""
    import torch

    path = folder / f"loaded-rank{os.environ['RANK']}.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = {name: value + 0.1 for name, value in model.state_dict().items()}
    torch.save({"state_dict": weights, "pytorch-lightning_version": "2.6.6"}, path)
    return path


def _strategy(engine: str, pattern: str):
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    import lightning_fastdist

    find_unused = {"find_unused_parameters": True} if pattern in FIND_UNUSED else {}
    if engine == "ddp":
        return DDPStrategy(**find_unused)
    if engine == "model_parallel":
        return ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    name, options = (SAVERS if pattern == "lightning_resumes_ours saving" else ENGINES)[engine]
    return getattr(lightning_fastdist, name)(**options, **(find_unused if engine == "fast_ddp" else {}))


def _full_weights(trainer, model) -> list:
    """Every parameter, whole: gathered under FSDP and ZeRO-3, DeepSpeed's fp32 masters where it keeps them."""
    from torch.distributed.tensor import DTensor

    from lightning_fastdist import FastDeepSpeedStrategy

    if isinstance(trainer.strategy, FastDeepSpeedStrategy):
        import deepspeed

        parameters = list(trainer.strategy.deepspeed_engine.module.parameters())
        with deepspeed.zero.GatheredParameters(parameters):
            return [p.detach().float().clone() for p in parameters]
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in model.parameters()]


def _callbacks() -> list:
    """The global step at each training epoch's end; a callback whose state is the rank that saves it."""
    import lightning as L

    class EpochSteps(L.Callback):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_train_epoch_end(self, trainer, module) -> None:
            self.steps.append(trainer.global_step)

    class SavingRank(L.Callback):
        def __init__(self) -> None:
            self.rank, self.loaded = None, None

        def setup(self, trainer, module, stage) -> None:
            self.rank = trainer.global_rank

        def state_dict(self) -> dict:
            return {"rank": self.rank}

        def load_state_dict(self, state_dict) -> None:
            self.loaded = state_dict["rank"]

    return [EpochSteps(), SavingRank()]


def _fit(engine: str, pattern: str, folder: Path, resume: str | None = None, save_to: Path | None = None, **options):
    """One fit of ``pattern`` under ``engine`` (``ddp``: Lightning's), recording what its cells compare."""
    import warnings

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging

    from tests.support.workloads import LossRecorder

    L.seed_everything(0, verbose=False)
    model = _model(pattern.removesuffix(" saving"))
    recorder, (epochs, saving_rank) = LossRecorder(), _callbacks()
    callbacks = [recorder, epochs, saving_rank]
    record: dict = {"losses": recorder.losses}
    trainer_options = {"max_epochs": 2, "max_steps": -1, "enable_checkpointing": False}
    if pattern == "accumulation_epoch_end":
        trainer_options.update(accumulate_grad_batches=3)
    if pattern in RESUMED and resume is None or pattern == "lightning_resumes_ours saving":
        callbacks.append(ModelCheckpoint(folder, "{step}", every_n_train_steps=CHECKPOINT_EVERY, save_top_k=-1))
        trainer_options.update(enable_checkpointing=True)
    if pattern == "lightning_resumes_ours saving":
        callbacks.append(ModelCheckpoint(folder, "{epoch}-end", save_on_train_epoch_end=True, save_top_k=-1))
        trainer_options.update(max_epochs=-1, max_steps=9)
    if pattern == "swa":
        callbacks.append(StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1))
    if pattern.startswith("empty_init"):
        trainer_options.update(max_steps=4)
    trainer_options.update(options)
    try:
        trainer = L.Trainer(
            accelerator="cpu", devices=WORLD, strategy=_strategy(engine, pattern), callbacks=callbacks, logger=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            default_root_dir=folder, **trainer_options,
        )  # fmt: skip
        if pattern.startswith("empty_init"):
            model = _built_under_empty_init(trainer, pattern, model, _loaded_weights(folder, model))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, model.batches(), ckpt_path=resume)
        record["lines"] = [str(warning.message) for warning in caught]
        record.update(weights=_full_weights(trainer, model), steps=trainer.global_step, epoch_steps=epochs.steps)
        record.update(seen=model.seen, loaded_from_rank=model.loaded_from_rank, callback_loaded=saving_rank.loaded)
        record["both_losses"] = model.both_losses
        if pattern == "lightning_resumes_ours saving":
            trainer.save_checkpoint(folder / "cut.ckpt")
        if save_to is not None:
            trainer.save_checkpoint(save_to)
    except Exception as error:  # noqa: BLE001 - a refusal is a cell's answer too; a failure is reported by its cell
        record["error"] = f"{type(error).__name__}: {error}"
    return record


def _built_under_empty_init(trainer, pattern: str, model, weights: Path):
    """``model``'s class built in ``trainer.init_module(empty_init=True)``, given ``weights`` as ``pattern`` says."""
    import torch

    with trainer.init_module(empty_init=True):
        if pattern == "empty_init_load_from_checkpoint":
            return type(model).load_from_checkpoint(weights)
        built = type(model)()
    built.load_state_dict(torch.load(weights, weights_only=True)["state_dict"])
    return built


def _way_back(engine: str, folder: Path) -> dict:
    """Our run not interrupted; stopped after epoch 0, converted by ``to_lightning_checkpoint``, and resumed by
    Lightning's ``DDPStrategy`` (each rank converts its own copy)."""
    import lightning_fastdist

    runs = {("way_back", engine): _fit(engine, "way_back", folder / "straight")}
    stopped = folder / "stopped.ckpt"
    runs[("way_back stopped", engine)] = stopped_run = _fit(engine, "way_back", folder, save_to=stopped, max_epochs=1)
    if "error" in stopped_run:  # the fit or its save failed: say why, not that the conversion found nothing
        raise RuntimeError(f"way_back: {engine}'s run saving {stopped} failed: {stopped_run['error']}")
    converted = folder / f"lightning-rank{os.environ['RANK']}.ckpt"
    lightning_fastdist.to_lightning_checkpoint(stopped, converted)
    runs[("way_back resumed", engine)] = _fit("ddp", "way_back", folder / "resumed", resume=str(converted))
    if engine in ("fast_fsdp", "fast_deepspeed 3"):  # the same file under ModelParallelStrategy; the folder under DDP
        runs[("way_back model_parallel", engine)] = _fit("model_parallel", "way_back", folder / "mp", str(converted))
        runs[("way_back unconverted", engine)] = _fit("ddp", "way_back", folder / "unconverted", resume=str(stopped))
    return runs


def run_part_five(root: str) -> dict:
    """On each rank: per pattern, Lightning's DDP and every engine (and the runs the references need)."""
    folder = Path(root)
    runs: dict = {"rank": int(os.environ["RANK"])}
    for saver in SAVERS:
        saved = folder / "lightning_resumes_ours" / saver
        runs[("lightning_resumes_ours saving", saver)] = _fit(saver, "lightning_resumes_ours saving", saved)
        for point in SAVE_POINTS:
            checkpoint = str(saved / f"{point}.ckpt")
            runs[(f"lightning_resumes_ours {point}", saver)] = _fit(
                "ddp", "lightning_resumes_ours", saved / point, resume=checkpoint, max_epochs=3
            )
    for engine in ENGINES:
        runs.update(_way_back(engine, folder / "way_back" / engine.replace(" ", "_")))
    for engine in ("ddp", *ENGINES):
        for pattern in TRAINED:
            if engine == "ddp" or _runs(pattern, engine):
                runs[(pattern, engine)] = _fit(engine, pattern, folder / pattern / engine.replace(" ", "_"))
        for pattern in RESUMED:
            if engine != "ddp" and not _runs(pattern, engine):
                continue
            saved = folder / pattern / engine.replace(" ", "_")
            runs[(pattern, engine)] = _fit(engine, pattern, saved)
            checkpoint = saved / f"step={CHECKPOINT_EVERY}.ckpt"
            runs[(f"{pattern} resumed", engine)] = _fit(engine, pattern, saved / "resumed", resume=str(checkpoint))
    return runs


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("contract_part_five")
    return once_per_session(
        tmp_path_factory,
        "contract_part_five",
        lambda: run_function(run_part_five, WORLD, args=(str(root),), init_process_group=False, timeout=600),
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
    assert "error" not in reference, f"{what}, the reference: {reference['error']}"
    assert len(ours["losses"]) == len(reference["losses"]) > 0, what
    assert ours["losses"] == pytest.approx(reference["losses"], rel=EXACT), f"{what}: losses"
    assert ours["steps"] == reference["steps"], f"{what}: optimizer steps"
    _close(ours["weights"], reference["weights"], f"{what}: parameter")


def _identical(ours: dict, reference: dict, what: str) -> None:
    import torch

    assert "error" not in ours and "error" not in reference, (what, ours.get("error"), reference.get("error"))
    assert all(math.isfinite(loss) for loss in reference["losses"]), f"{what}: the reference's losses"
    assert ours["losses"] == reference["losses"] and ours["steps"] == reference["steps"], f"{what}: losses, steps"
    assert ours["seen"] == reference["seen"], f"{what}: the samples read"
    assert all(torch.equal(a, b) for a, b in zip(ours["weights"], reference["weights"], strict=True)), what


def _refused(ours: dict, piece: str) -> None:
    assert "error" in ours and piece in ours["error"], ours.get("error")
    assert "\n" not in ours["error"].strip() and ours["losses"] == [], "a refusal: one line, before a step"


CELLS = [(pattern, engine) for pattern in PATTERNS for engine in ENGINES]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("pattern", "engine"), CELLS, ids=[f"{p}-{e}" for p, e in CELLS])
def test_cell_matches_lightning_ddp_or_the_better_reference_or_refuses_in_one_line(ranks, pattern, engine):
    if not _runs(pattern, engine):
        pytest.skip(f"{pattern} runs under {', '.join(RUN_ONLY[pattern])} only")
    for record in ranks:
        what = f"rank {record['rank']}: {pattern} under {engine}"
        if (pattern, engine) in REFUSALS:
            _refused(record[(pattern, engine)], REFUSALS[(pattern, engine)])
        elif pattern in TRAINED:
            _matches(record[(pattern, engine)], record[(pattern, "ddp")], what)
            if pattern == "accumulation_epoch_end":
                assert record[(pattern, engine)]["epoch_steps"] == [4, 8], what
            if pattern == "gan_manual":
                ours, reference = record[(pattern, engine)]["both_losses"], record[(pattern, "ddp")]["both_losses"]
                assert len(ours) == len(reference) and all(
                    got == pytest.approx(wanted, rel=EXACT) for got, wanted in zip(ours, reference)
                ), what
        elif pattern == "stateful_loader":  # Lightning's own resume, which restores the loader
            resumed, reference = (record[(f"{pattern} resumed", name)] for name in (engine, "ddp"))
            _matches(record[(pattern, engine)], record[(pattern, "ddp")], f"{what}, not stopped")
            _matches(resumed, reference, f"{what}, resumed")
            assert resumed["seen"] == reference["seen"], f"{what}: resumed where DDP's resume goes"
            assert not any("cannot be found again" in line for line in resumed["lines"]), resumed["lines"]
        elif pattern in RESUMED:  # the better reference: the run not stopped
            straight, resumed = record[(pattern, engine)], record[(f"{pattern} resumed", engine)]
            _matches(straight, record[(pattern, "ddp")], f"{what}, not stopped")
            tail = {**straight, "losses": straight["losses"][CHECKPOINT_EVERY:]}
            _matches(resumed, tail, f"{what}, resumed")
            assert resumed["seen"] == straight["seen"][CHECKPOINT_EVERY:], f"{what}: each loader where it stood"
        elif pattern == "lightning_resumes_ours":
            if engine not in SAVERS:
                continue
            for point in SAVE_POINTS:
                ours, reference = (record[(f"{pattern} {point}", saver)] for saver in (engine, "ddp"))
                _identical(ours, reference, f"{what}, resumed from {point}")
        elif pattern == "way_back":  # Lightning's DDPStrategy resuming our converted checkpoint: ours not interrupted
            straight, resumed = record[(pattern, engine)], record[(f"{pattern} resumed", engine)]
            assert "error" not in straight and len(straight["losses"]) == 2 * LONG, straight.get("error")
            _matches(resumed, {**straight, "losses": straight["losses"][LONG:]}, f"{what}, resumed by DDPStrategy")
            if ("way_back model_parallel", engine) in record:
                tail = {**straight, "losses": straight["losses"][LONG:]}
                _matches(record[("way_back model_parallel", engine)], tail, f"{what}, by ModelParallelStrategy")
        elif pattern == "on_load_checkpoint":
            resumed = record[("combined_max_size_cycle resumed", engine)]
            assert "error" not in resumed, resumed.get("error")
            assert resumed["loaded_from_rank"] == 0 and resumed["callback_loaded"] == 0, what


@pytest.mark.slow
@pytest.mark.multiprocess
def test_where_ddp_is_wrong_it_differs_from_the_better_reference(ranks):
    """The references bite: DDP's own resume restarts a CombinedLoader's loaders at their first batch; under DDP every
    rank loads rank 0's saved state (each rank saved its own); the weights loaded under ``empty_init`` are not the
    model's own (the first batch's loss differs from a fit of the model as built); DDPStrategy does not read FSDP's
    sharded folder or DeepSpeed's folder (the way back converts them)."""
    for record in ranks:
        straight, resumed = (
            record[("combined_max_size_cycle", "ddp")],
            record[("combined_max_size_cycle resumed", "ddp")],
        )
        assert resumed["seen"] != straight["seen"][CHECKPOINT_EVERY:]
        assert resumed["loaded_from_rank"] == 0 and resumed["callback_loaded"] == 0
        assert record[("combined_max_size_cycle", "ddp")]["steps"] == 2 * LONG
        for engine in ("fast_fsdp", "fast_deepspeed 3"):  # the way back is needed: DDP does not read our folders
            assert "error" in record[("way_back unconverted", engine)]
        for pattern in ("empty_init_load_from_checkpoint", "empty_init_load_state_dict"):  # the loaded weights train
            assert record[(pattern, "ddp")]["losses"][0] != record[("accumulation_epoch_end", "ddp")]["losses"][0]


def _answer(pattern: str, engine: str) -> str:
    if (pattern, engine) in REFUSALS:
        return f"refuses: `{REFUSALS[(pattern, engine)]}`"
    if pattern == "lightning_resumes_ours" and engine not in SAVERS:
        return "a folder: converted by `to-lightning` (its row)"
    if not _runs(pattern, engine):
        return "(not run)"
    if pattern == "lightning_resumes_ours":
        return (
            'bit for bit (`checkpoint_format="full"`; sharded: `way_back`)' if engine == "fast_fsdp" else "bit for bit"
        )
    if pattern in RESUMED and pattern != "stateful_loader":
        return "matches the better reference"
    return "matches"


def pattern_table() -> str:
    """docs/models.md's third pattern table, from these cells: one row per pattern, one column per engine."""
    lines = [
        "| pattern | asserted besides losses, steps and weights | " + " | ".join(f"`{e}`" for e in ENGINES) + " |",
        "| --- | --- | " + " | ".join("---" for _ in ENGINES) + " |",
    ]
    for pattern, (how, also) in PATTERNS.items():
        lines.append(f"| {how} | {also} | " + " | ".join(_answer(pattern, e) for e in ENGINES) + " |")
    return "\n".join(lines) + "\n"


def test_docs_models_shows_these_cells_as_its_third_pattern_table():
    table = pattern_table()
    assert table in MODELS_DOC.read_text(), f"docs/models.md's third pattern table differs; it is:\n{table}"
