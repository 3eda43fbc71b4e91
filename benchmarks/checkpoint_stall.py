"""How long training stops for a checkpoint, ours beside Lightning's, on 2 CPU ranks (gloo).

One model and one data set for every row: TinyGPT (fp32, AdamW: 12 bytes of state per parameter), a save every
``--save-every`` optimizer steps, the previous checkpoint removed once the next is saved (``ModelCheckpoint``'s
``save_top_k=1``). Rows: Lightning's ``DDPStrategy`` (synchronous ``torch.save``), the same with ``AsyncCheckpointIO``,
Lightning's ``ModelParallelStrategy`` (synchronous sharded save, the model sharded in ``configure_model``), each of ours
with ``async_checkpointing`` off and on, and ``dcp-async-process``: FSDP's sharded state saved by torch's own
``async_save`` with its checkpoint process, a shared-memory ``DefaultStager`` and cached plans (the alternative to our
background thread, ``docs/checkpoints.md``).

Each row runs in 2 fresh processes: a warm-up, ``--windows`` windows of ``--save-every`` steps without a save, then
``--windows`` windows each starting with a save (the window runs to the next save, so it holds the save's stall and
the steps its background write shares the cores with), then one more save and the end of the fit. Per row:

- ``blocked_s_median``, ``blocked_s_max``: the time the training loop spends in ``trainer.save_checkpoint`` (the
  slower rank's), over every save;
- ``steps_per_s_with_saves``, ``steps_per_s_without``: steps over the windows with a save, and over those without;
- ``publish_s``: the median time from a save's start until its checkpoint is complete at its path (a synchronous
  save: when it returns);
- ``peak_host_gb``: the peak resident memory of the two ranks, summed (``ru_maxrss``);
- ``resume_s``: a new fit resumed from the last checkpoint: the time in the strategy's ``load_checkpoint``,
  ``load_model_state_dict`` and ``load_optimizer_state_dict``.

    python benchmarks/checkpoint_stall.py --out results/checkpoint_stall
    python benchmarks/checkpoint_stall.py --out /tmp/quick --n-layer 2 --n-embd 256 --save-every 3 --windows 2

Prints the table and writes ``checkpoint_stall.json`` (``rows``: one object per row) and ``checkpoint_stall.png``
into ``--out``. Timings need idle cores: anything else running on them is in the numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# setup name -> (engine, async)
SETUPS = {
    "lightning-ddp": ("ddp", False),
    "lightning-ddp-asynccheckpointio": ("ddp", True),
    "lightning-model-parallel": ("fsdp", False),
    "fast-ddp": ("ddp", None),
    "fast-fsdp": ("fsdp", None),
    "fast-deepspeed": ("deepspeed", None),
    "dcp-async-process": ("fsdp", True),
}
WORLD = 2
WARMUP_STEPS = 2
BATCH, BLOCK = 1, 64
POLL_S = 0.02
GB = 1e9


@dataclass
class Spec:
    """One row as its ranks run it."""

    setup: str
    asynchronous: bool
    n_layer: int
    n_embd: int
    save_every: int
    windows: int
    folder: str

    @property
    def engine(self) -> str:
        return SETUPS[self.setup][0]

    @property
    def save_steps(self) -> list[int]:
        """The steps after which a save starts: ``windows + 1`` of them, after the windows without saves."""
        first = WARMUP_STEPS + self.windows * self.save_every
        return [first + index * self.save_every for index in range(self.windows + 1)]

    @property
    def max_steps(self) -> int:
        return self.save_steps[-1] + 1


@dataclass
class Row:
    setup: str
    engine: str
    async_: bool
    blocked_s_median: float
    blocked_s_max: float
    steps_per_s_with_saves: float
    steps_per_s_without: float
    publish_s: float
    peak_host_gb: float
    resume_s: float | None
    params_m: float
    state_gb: float

    def as_json(self) -> dict:
        row = asdict(self)
        row["async"] = row.pop("async_")
        return row


# ------------------------------------------------------------------------------------------------- in each rank


def _model(spec: Spec):
    import torch
    from torch.distributed.fsdp import fully_shard

    from lightning_fastdist.demo import TinyGPT

    class HandSharded(TinyGPT):
        """What a Lightning user writes for ``ModelParallelStrategy``: ``fully_shard`` per block, then the root."""

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

    torch.manual_seed(0)
    kind = HandSharded if spec.setup == "lightning-model-parallel" else TinyGPT
    return kind(n_layer=spec.n_layer, n_embd=spec.n_embd, n_head=16, block_size=BLOCK, warmup_steps=2)


def _data(steps: int):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    windows = torch.randint(0, 256, (steps * BATCH * WORLD, BLOCK + 1), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(windows[:, :-1], windows[:, 1:]), batch_size=BATCH)


def _strategy(spec: Spec) -> tuple[Any, list]:
    """The row's strategy and Trainer plugins."""
    from datetime import timedelta

    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    import lightning_fastdist as lf

    timeout = timedelta(minutes=30)
    if spec.setup == "lightning-ddp":
        return DDPStrategy(gradient_as_bucket_view=True, timeout=timeout), []  # the bucket view: as FastDDPStrategy
    if spec.setup == "lightning-ddp-asynccheckpointio":
        return DDPStrategy(gradient_as_bucket_view=True, timeout=timeout), [AsyncCheckpointIO()]
    if spec.setup == "lightning-model-parallel":
        return ModelParallelStrategy(timeout=timeout), []
    if spec.setup == "fast-ddp":  # exact gradients, as Lightning's DDP: no compression hook
        return lf.FastDDPStrategy(comm_hook="none", async_checkpointing=spec.asynchronous, timeout=1800), []
    if spec.setup == "fast-fsdp":
        return lf.FastFSDPStrategy(async_checkpointing=spec.asynchronous, timeout=1800), []
    if spec.setup == "fast-deepspeed":
        return lf.FastDeepSpeedStrategy(stage=2, async_checkpointing=spec.asynchronous, timeout=1800), []
    return lf.FastFSDPStrategy(timeout=1800), []  # dcp-async-process: its saves are the probe's own


class DcpProcessSaves:
    """FSDP's sharded weights and optimizer state saved by ``torch.distributed.checkpoint.async_save`` with its
    checkpoint process, a shared-memory stager and cached plans: what a user of torch's own machinery writes."""

    def __init__(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(StagingOptions(False, True, False, False))
        self.pending = None

    def save(self, trainer, path: Path) -> Any:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self.pending is not None:
            self.pending.result()  # at most one in flight: its shared memory is reused
        model, optimizer = trainer.strategy.model, trainer.optimizers[0]
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
        self.pending = dcp.async_save(
            state,
            checkpoint_id=str(path),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=self.stager,
            planner=DefaultSavePlanner(enable_plan_caching=True),
        )
        return self.pending

    def finish(self) -> None:
        if self.pending is not None:
            self.pending.result()


def _probe(spec: Spec, dcp_saves: DcpProcessSaves | None):
    import lightning as L

    class StallProbe(L.Callback):
        """Saves at the row's steps (the previous checkpoint removed, as top-1), and times the loop around them."""

        def __init__(self) -> None:
            self.step_starts: dict[int, float] = {}
            self.save_starts: list[float] = []
            self.blocked: list[float] = []
            self.published: list[float | None] = []
            self.paths: list[Path] = []
            self._watch: list[tuple[int, Path]] = []
            self._lock = threading.Lock()

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            self.step_starts.setdefault(trainer.global_step, time.perf_counter())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            step = trainer.global_step
            if step not in spec.save_steps or len(self.save_starts) > spec.save_steps.index(step):
                return
            path = Path(spec.folder, "checkpoints", f"step={step}.ckpt")
            start = time.perf_counter()
            self.save_starts.append(start)
            future = dcp_saves.save(trainer, path) if dcp_saves is not None else trainer.save_checkpoint(path)
            self.blocked.append(time.perf_counter() - start)
            self.published.append(None if spec.asynchronous else time.perf_counter() - start)
            if spec.asynchronous and trainer.is_global_zero:
                self._watch_for(len(self.published) - 1, path, start, future)
            if self.paths and dcp_saves is None:
                trainer.strategy.remove_checkpoint(self.paths[-1])
            self.paths.append(path)

        def _watch_for(self, index: int, path: Path, start: float, future: Any) -> None:
            def watch() -> None:
                while not (future.done() if future is not None else path.exists()):
                    time.sleep(POLL_S)
                self.published[index] = time.perf_counter() - start

            threading.Thread(target=watch, daemon=True).start()

    return StallProbe()


def _timed_loads(strategy) -> list[float]:
    """Time what a resume spends loading: the strategy's ``load_checkpoint`` and its model and optimizer loads."""
    spent: list[float] = []
    for name in ("load_checkpoint", "load_model_state_dict", "load_optimizer_state_dict"):
        original = getattr(strategy, name)

        def timed(*args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)

        setattr(strategy, name, timed)
    return spent


def _trainer(spec: Spec, max_steps: int, callbacks: list):
    import lightning as L

    strategy, plugins = _strategy(spec)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, plugins=plugins, precision="32-true",
        max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks,
    )  # fmt: skip
    return trainer


def run_rank(spec: Spec) -> None:
    """One rank of one row: the timed fit, then a fit resumed from its last checkpoint; writes ``rank<N>.json``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dcp_saves = DcpProcessSaves() if spec.setup == "dcp-async-process" else None
    probe = _probe(spec, dcp_saves)
    model = _model(spec)
    params = sum(p.numel() for p in model.parameters())
    trainer = _trainer(spec, spec.max_steps, [probe])
    trainer.fit(model, _data(spec.max_steps))
    if dcp_saves is not None:
        dcp_saves.finish()
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
    result = {
        "rank": rank,
        "params": params,
        "step_starts": {str(step): at for step, at in probe.step_starts.items()},
        "save_starts": probe.save_starts,
        "blocked": probe.blocked,
        "published": probe.published,
        "peak_gb": peak_gb,
    }
    last = probe.paths[-1]
    del trainer, model
    gc.collect()
    resume_s = None
    if dcp_saves is None:  # dcp-async-process writes the tensors only: nothing Lightning resumes from
        resumed = _trainer(spec, spec.max_steps, [])  # one step after the last save
        spent = _timed_loads(resumed.strategy)
        resumed.fit(_model(spec), _data(spec.max_steps), ckpt_path=str(last))
        resume_s = sum(spent)
    result["resume_s"] = resume_s
    if dist.is_initialized():
        dist.barrier()
    Path(spec.folder, f"rank{rank}.json").write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------- the parent


def _row(spec: Spec, ranks: list[dict]) -> Row:
    zero = ranks[0]
    starts = {int(step): at for step, at in zero["step_starts"].items()}
    saves = zero["save_starts"]
    clean = saves[0] - starts[WARMUP_STEPS]  # the windows without a save: from the warm-up's end to the first save
    with_saves = saves[-1] - saves[0]  # from the first save to the last: windows, each with its save
    blocked = [max(rank["blocked"][index] for rank in ranks) for index in range(len(saves))]
    published = [value for value in zero["published"] if value is not None]
    params = zero["params"]
    return Row(
        setup=spec.setup,
        engine=spec.engine,
        async_=spec.asynchronous,
        blocked_s_median=statistics.median(blocked),
        blocked_s_max=max(blocked),
        steps_per_s_with_saves=spec.windows * spec.save_every / with_saves,
        steps_per_s_without=spec.windows * spec.save_every / clean,
        publish_s=statistics.median(published) if published else float("nan"),
        peak_host_gb=sum(rank["peak_gb"] for rank in ranks),
        resume_s=zero["resume_s"],
        params_m=params / 1e6,
        state_gb=params * 12 / GB,
    )


def _run_row(spec: Spec, log_path: Path) -> Row:
    from lightning_fastdist.commands.local_ranks import run_local_ranks

    folder = Path(spec.folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    command = [sys.executable, str(Path(__file__).resolve()), "--rank-of", str(spec_path)]
    with log_path.open("a") as log:
        log.write(f"\n===== {spec.setup} (async {spec.asynchronous})\n")
        log.flush()
        status = run_local_ranks(command, WORLD, log)
    if status != 0:
        raise RuntimeError(f"{spec.setup}: a rank exited {status}; see {log_path}")
    ranks = [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)  # several GB each: only the numbers are kept
    return _row(spec, ranks)


def _table(rows: list[Row]) -> str:
    header = (
        f"{'setup':34} {'async':>5} {'blocked med s':>13} {'blocked max s':>13} {'steps/s saves':>13} "
        f"{'steps/s none':>12} {'ratio':>6} {'publish s':>9} {'peak GB':>8} {'resume s':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        ratio = row.steps_per_s_with_saves / row.steps_per_s_without
        resume = f"{row.resume_s:8.2f}" if row.resume_s is not None else f"{'-':>8}"
        lines.append(
            f"{row.setup:34} {'on' if row.async_ else 'off':>5} {row.blocked_s_median:13.3f} "
            f"{row.blocked_s_max:13.3f} {row.steps_per_s_with_saves:13.4f} {row.steps_per_s_without:12.4f} "
            f"{ratio:6.2f} {row.publish_s:9.2f} {row.peak_host_gb:8.1f} {resume}"
        )
    return "\n".join(lines)


def _plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{row.setup}\n(async {'on' if row.async_ else 'off'})" for row in rows]
    figure, (blocked, speed) = plt.subplots(1, 2, figsize=(16, 6))
    blocked.barh(names, [row.blocked_s_median for row in rows], color="tab:red")
    blocked.set_xscale("log")
    blocked.set_xlabel("training blocked per save, median (s, log)")
    ratios = [row.steps_per_s_with_saves / row.steps_per_s_without for row in rows]
    speed.barh(names, ratios, color="tab:blue")
    speed.axvline(0.9, color="black", linestyle="--", linewidth=1)
    speed.set_xlabel("steps/s with a save every K steps / steps/s without")
    speed.set_yticklabels([])
    figure.suptitle(
        f"Checkpoint stall, 2 CPU ranks, {rows[0].params_m:.0f}M parameters, AdamW ({rows[0].state_gb:.1f} GB)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _specs(arguments: argparse.Namespace) -> list[Spec]:
    specs = []
    for setup in arguments.setups:
        engine, fixed = SETUPS[setup]
        for asynchronous in (False, True) if fixed is None else (fixed,):
            folder = str(Path(arguments.out) / "runs" / f"{setup}-{'async' if asynchronous else 'sync'}")
            spec = Spec(setup, asynchronous, arguments.n_layer, arguments.n_embd, arguments.save_every,
                        arguments.windows, folder)  # fmt: skip
            specs.append(spec)
    return specs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for checkpoint_stall.json, the plot and the runs' logs (required)")
    parser.add_argument("--n-layer", type=int, default=24, help="TinyGPT blocks (24 x 1024: 303M parameters)")
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--save-every", type=int, default=4, help="K: optimizer steps between two saves")
    parser.add_argument("--windows", type=int, default=2, help="windows of K steps with a save, and without")
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)  # one rank of one row (the benchmark starts them)
    arguments = parser.parse_args(argv)
    if arguments.rank_of:
        run_rank(Spec(**json.loads(Path(arguments.rank_of).read_text())))
        return 0
    if arguments.out is None:
        parser.error("--out is required")
    out = Path(arguments.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in _specs(arguments):
        started = time.perf_counter()
        rows.append(_run_row(spec, out / "runs.log"))
        print(f"{spec.setup} (async {spec.asynchronous}): {time.perf_counter() - started:.0f} s", flush=True)
        (out / "checkpoint_stall.json").write_text(json.dumps(_report(arguments, rows), indent=2))
    print(_table(rows))
    _plot(rows, out / "checkpoint_stall.png")
    return 0


def _report(arguments: argparse.Namespace, rows: list[Row]) -> dict:
    return {
        "command": "python benchmarks/checkpoint_stall.py " + " ".join(sys.argv[1:]),
        "world_size": WORLD,
        "n_layer": arguments.n_layer,
        "n_embd": arguments.n_embd,
        "save_every": arguments.save_every,
        "windows": arguments.windows,
        "rows": [row.as_json() for row in rows],
    }


if __name__ == "__main__":
    sys.exit(main())
