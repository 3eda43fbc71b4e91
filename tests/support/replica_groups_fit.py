"""One node's fits of models we did not write, under FastDDPStrategy(replica_groups=...),
FastFSDPStrategy(replica_groups=...) or, to compare, Lightning's own DDPStrategy on the same nodes; run once per node
by tests (``NODE_RANK`` set).

Usage: ``python -m tests.support.replica_groups_fit ENGINES MODELS STEPS [MIN_NODES]``: ``ENGINES`` a comma-separated
list of ``fast`` (FastDDPStrategy with replica_groups), ``fsdp`` (FastFSDPStrategy, zero3, with replica_groups),
``one-world`` (FastDDPStrategy without it), ``hsdp`` (FastFSDPStrategy as one world, sharded inside each node and
replicated across nodes: the layout ``fsdp`` has) or ``lightning``; ``MODELS`` a comma-separated list of
:data:`tests.support.model_zoo.MODELS` names (or ``gpt2-wide``). Each engine fits each model, one after the other in
this process (a second fit in the same job). Environment:

- ``REPLICA_FIT_NODES``: the nodes (2); ``EMULATED_RANKS_PER_NODE``: ranks per node (1); ``REPLICA_FIT_BATCH``: the
  batch size (4);
- ``REPLICA_FIT_CHECKPOINTS=FOLDER``: the best step by training loss is checkpointed under ``FOLDER/ENGINE/MODEL``,
  or with ``REPLICA_FIT_SAVE_EVERY=N`` every ``N`` steps in ``FOLDER``; ``REPLICA_FIT_RESUME``: a checkpoint to
  resume from;
- ``REPLICA_FIT_NAN=MODEL:NODE:STEP``: one loss is NaN (NonFiniteLoss skips that step);
- faults: :mod:`tests.support.node_faults`'s.

Every rank prints one ``FIT {json}`` line per engine and model: per step the loss, the global step, a digest of the
weights after it, the nodes of the step's quorum and the ranks SpeedMonitor counts, the epoch and sample ids read,
its end (wall clock); the weights the first step started from, the buffers at the end, how the node rejoined if it
did, the steps that did not commit, and the bytes all-reduced across nodes per step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import Dataset

from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy, NonFiniteLoss, SpeedMonitor
from lightning_fastdist.callbacks.speed_monitor import training_ranks
from lightning_fastdist.data.resumable_loader import ResumableDataLoader
from lightning_fastdist.parallel.across_nodes.replica_groups.run import ACROSS_NODES
from tests.support.model_zoo import MODELS, HFCausalLM
from tests.support.node_faults import NodeFaults
from tests.support.outer_sync_fit import digest
from tests.support.workloads import make_trainer


class Served(Dataset):
    """A model's own samples, each served under ``length / len(dataset)`` ids (every id once per epoch: 192 is one
    epoch of 16 steps of 3 nodes x 4), noting the ids read (the loader reads in this process)."""

    def __init__(self, dataset: Dataset, length: int = 192) -> None:
        self.dataset = dataset
        self.length = length
        self.served: list[int] = []

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        self.served.append(int(index))
        return self.dataset[index % len(self.dataset)]  # type: ignore[arg-type]


class StepRecorder(L.Callback):
    def __init__(self, data: Served) -> None:
        self.data = data
        self.losses: list[float] = []
        self.steps: list[int] = []
        self.digests: list[str] = []
        self.members: list[int] = []
        self.training_ranks: list[int] = []
        self.samples: list[tuple[int, list[int]]] = []  # per step: the epoch and the ids read
        self.first_digest: str | None = None
        self.rejoined: dict | None = None
        self.skipped: list[int] = []
        self.sent: list[int] = []  # bytes all-reduced across nodes per step (counted by the strategy)
        self.node_rank_mean: list[float] = []  # the node rank logged with sync_dist=True, as Lightning reduced it
        self.step_ends: list[float] = []  # wall clock, for benchmarks/replica_groups.py (tests never read it)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if "node_rank" in trainer.callback_metrics:  # the previous step's
            self.node_rank_mean.append(float(trainer.callback_metrics["node_rank"]))
        if self.first_digest is None:
            self.first_digest = digest(module)
            run = getattr(getattr(trainer.strategy, "across_nodes", None), "run", None)
            joined = run.rejoined if run is not None else None
            if joined is not None:
                self.rejoined = {"source": joined.source, "step": joined.step, "bytes": joined.received_bytes}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        module.log("node_rank", torch.tensor(float(trainer.node_rank)), sync_dist=True)
        self.step_ends.append(time.time())
        self.losses.append(float(outputs["loss"]))
        self.steps.append(trainer.global_step)
        self.digests.append(digest(module))
        self.training_ranks.append(training_ranks(trainer))
        across = getattr(trainer.strategy, "across_nodes", None)  # our strategies'
        run = getattr(across, "run", None)
        self.members.append(len(run.membership.quorum_nodes) if run is not None else -1)
        self.skipped = list(run.skipped) if run is not None else []
        sent = trainer.strategy.comm_stats.last_step.get(ACROSS_NODES) if across and across.option else None
        self.sent.append(sent.bytes if sent is not None else 0)
        self.samples.append((trainer.current_epoch, self.data.served[:]))
        self.data.served.clear()


class NaNLoss(L.Callback):
    """Turn the loss of ``model``'s forward non-finite on ``node`` at ``step`` (``REPLICA_FIT_NAN=MODEL:NODE:STEP``),
    through a forward hook on the library's model: NonFiniteLoss must skip that step on every node."""

    def __init__(self, name: str) -> None:
        model, node, step = (os.environ.get("REPLICA_FIT_NAN") or "::").split(":")
        self.at = (int(node), int(step)) if model == name else None
        self._hook = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self.at == (trainer.node_rank, trainer.global_step + 1):
            self._hook = module.model.register_forward_hook(self._poison)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @staticmethod
    def _poison(model, args, output):
        output.loss = output.loss * float("nan")
        return output


class WideGPT2(HFCausalLM):
    """The zoo's GPT-2 made wider and deeper (4 layers, width 256: 3.4M parameters), for benchmarks whose steps must
    take tens of milliseconds."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2LMHeadModel  # noqa: PLC0415 - the test extra

        config = self.model.config
        config.n_embd, config.n_layer, config.n_head = 256, 4, 4
        self.model = GPT2LMHeadModel(config)


def fit(engine: str, name: str, steps: int, min_nodes: int) -> None:
    if engine == "fast":
        strategy = FastDDPStrategy(comm_hook="none", replica_groups={"min_nodes": min_nodes}, timeout=120)
    elif engine == "fsdp":
        strategy = FastFSDPStrategy(replica_groups={"min_nodes": min_nodes}, timeout=120)
    elif engine == "one-world":
        strategy = FastDDPStrategy(comm_hook="none", timeout=120)
    elif engine == "hsdp":
        strategy = FastFSDPStrategy(sharding="hsdp", timeout=120)
    else:
        strategy = DDPStrategy(timeout=timedelta(seconds=120))
    L.seed_everything(0)
    model = WideGPT2() if name == "gpt2-wide" else MODELS[name]()
    data = Served(model.batches().dataset)
    recorder = StepRecorder(data)
    callbacks = [NodeFaults(), recorder, SpeedMonitor(), NaNLoss(name), NonFiniteLoss(action="skip")]
    folder = os.environ.get("REPLICA_FIT_CHECKPOINTS")
    save_every = int(os.environ.get("REPLICA_FIT_SAVE_EVERY", "0"))
    if folder and save_every:  # every so many steps, for a whole job restarted from its last one
        callbacks.append(ModelCheckpoint(folder, "{step}", every_n_train_steps=save_every, save_top_k=-1))
    elif folder:  # the best step by training loss, a decision every rank must agree on
        folder = os.path.join(folder, engine, name)
        callbacks.append(ModelCheckpoint(folder, "{step}", monitor="train_loss", every_n_train_steps=1))
    trainer = make_trainer(
        strategy, devices=int(os.environ.get("EMULATED_RANKS_PER_NODE", "1")),
        num_nodes=int(os.environ.get("REPLICA_FIT_NODES", "2")), max_steps=steps, callbacks=callbacks,
        enable_checkpointing=bool(folder),
    )  # fmt: skip
    batch_size = int(os.environ.get("REPLICA_FIT_BATCH", "4"))
    trainer.fit(model, ResumableDataLoader(data, batch_size=batch_size), ckpt_path=os.environ.get("REPLICA_FIT_RESUME"))
    report = {
        "engine": engine, "model": name, "node": trainer.node_rank, "local_rank": trainer.local_rank,
        "losses": recorder.losses, "steps": recorder.steps, "digests": recorder.digests, "members": recorder.members,
        "training_ranks": recorder.training_ranks, "samples": recorder.samples, "first_digest": recorder.first_digest,
        "rejoined": recorder.rejoined, "final": digest(model),
        "buffers": [buffer.double().sum().item() for buffer in model.buffers()],
        "skipped": recorder.skipped, "sent": recorder.sent, "step_ends": recorder.step_ends,
        "node_rank_mean": recorder.node_rank_mean,
        # Global rank 0 writes them: the other nodes may list the folder while it replaces the best one. The run's
        # lock (a hidden file, held while it writes the folder) is not a checkpoint.
        "checkpoints": sorted(name for name in os.listdir(folder) if not name.startswith("."))
        if trainer.is_global_zero and os.path.isdir(folder or "") else None,
    }  # fmt: skip
    # One write for the whole line: the node's ranks share its output file.
    os.write(sys.stdout.fileno(), f"FIT {json.dumps(report)}\n".encode())


def main(engines: str, models: str, steps: int, min_nodes: int) -> None:
    torch.use_deterministic_algorithms(True)
    for engine in engines.split(","):
        for name in models.split(","):
            fit(engine, name, steps, min_nodes)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int((sys.argv[4:] or ["1"])[0]))
