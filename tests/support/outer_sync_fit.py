"""One node's fit of TinyGPT under FastDDPStrategy(outer_sync=...), run once per node by tests (``NODE_RANK`` set);
under FastFSDPStrategy(outer_sync=...) with ``OUTER_SYNC_FIT_ENGINE=fsdp``.

Faults (a SIGTERM, a node SIGKILLed, the others holding until it is back) are :mod:`tests.support.node_faults`'s,
set by its environment variables. Nodes: ``OUTER_SYNC_FIT_NODES`` (default 2).
Ranks per node: ``EMULATED_RANKS_PER_NODE`` (as the emulated cluster sets it; default 1). Each rank reads its own
share of random token windows, so the nodes' weights part between outer syncs. Every rank
prints one ``FIT {json}`` line: per optimizer step the outer syncs applied so far and the bytes of the outer
all-reduces the step started, the losses, a digest of the weights each validation saw and of the final weights
(under FSDP: of this rank's shards), and the most bytes torchft held on the rank (under FSDP: for its shards).

With ``OUTER_SYNC_FIT_BEST=FOLDER`` the step of the highest validation loss is checkpointed there; with
``OUTER_SYNC_FIT_SAVE_LAST=1`` each periodic checkpoint is also saved as ``last.ckpt`` (what ``RESUME_FROM=last``
finds).

Usage: ``python -m tests.support.outer_sync_fit '{"every": 4, "fragments": 2, "delay": 1}' STEPS [FOLDER SAVE_EVERY
[RESUME_FROM]]``: with ``FOLDER``, a checkpoint every ``SAVE_EVERY`` steps is written there, and a fit resumes from
``RESUME_FROM`` (a checkpoint file) if given. Validation runs every 6 steps.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy, SpeedMonitor, SyncFreeLogging
from lightning_fastdist.callbacks.speed_monitor import training_ranks
from lightning_fastdist.data.resumable_loader import ResumableDataLoader
from lightning_fastdist.diagnostics.host_syncs import HostSyncCounter, count_host_syncs
from lightning_fastdist.parallel.across_nodes.outer_sync.run import OUTER_ALL_REDUCE
from lightning_fastdist.parallel.fsdp.local_shards import local_part
from lightning_fastdist.planning.step_memory import optimizer_state_tensors, tensor_bytes
from tests.support.node_faults import NodeFaults
from tests.support.workloads import BLOCK_SIZE, LossRecorder, make_trainer, tiny_gpt


class RandomWindows(Dataset):
    """``length`` random ``(input, target)`` windows, the same on every node for one ``seed`` (a length the ranks
    divide: a sampler pads a share with samples of another)."""

    def __init__(self, length: int = 96, seed: int = 0) -> None:  # 96: the same share for 1, 2, 3, 4 or 6 ranks
        generator = torch.Generator().manual_seed(seed)
        self.windows = torch.randint(0, 256, (length, BLOCK_SIZE + 1), generator=generator)
        self.served: list[int] = []  # indices read, in order (the loader reads in this process)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.served.append(int(index))
        return self.windows[index, :-1], self.windows[index, 1:]


def digest(module: torch.nn.Module) -> str:
    """A digest of the parameters' bytes (of this rank's shards): equal only if every weight is bitwise equal."""
    hasher = hashlib.sha256()
    for parameter in module.parameters():
        hasher.update(local_part(parameter.detach()).contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()[:16]


class OuterSyncRecorder(L.Callback):
    """Per optimizer step: outer syncs applied so far, outer bytes started, host syncs from batch start to batch end;
    digests of the weights validated. First in the callbacks, so that another's reads after the step are not counted."""

    def __init__(self) -> None:
        self.host_syncs: list[int] = []
        self._counting: HostSyncCounter | None = None
        self.syncs: list[int] = []
        self.members: list[int] = []
        self.outer_bytes: list[int] = []
        self.validated: list[str] = []
        self.val_losses: list[float] = []
        self.step_ends: list[float] = []  # wall clock, for benchmarks/lost_node.py (tests never read it)
        self.training_data: RandomWindows | None = None
        self.samples: list[tuple[int, list[int]]] = []  # per step: the epoch and the training samples' indices
        self.steps: list[int] = []  # the global step after each step this process trained
        self.training_ranks: list[int] = []  # the ranks SpeedMonitor counts at each step
        self.digests: list[str] = []  # the weights after each step
        self.first_digest: str | None = None  # the weights the first step started from
        self.rejoined: dict | None = None  # how this node joined a running job, if it did

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self.first_digest is None:
            self.first_digest = digest(module)
            run = trainer.strategy.across_nodes.run
            joined = run.rejoined if run is not None else None
            if joined is not None:
                self.rejoined = {"source": joined.source, "step": joined.step, "bytes": joined.received_bytes}
        self._counting = count_host_syncs()
        self._counting.__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._counting.__exit__(None, None, None)
        self.host_syncs.append(self._counting.count)
        self.steps.append(trainer.global_step)
        self.training_ranks.append(training_ranks(trainer))
        self.digests.append(digest(module))
        strategy = trainer.strategy
        run = strategy.across_nodes.run  # on each rank that talks across nodes
        self.syncs.append(run.syncs if run is not None else -1)
        self.members.append(len(run.membership.quorum_nodes) if run is not None else -1)
        if self.training_data is not None:
            self.samples.append((trainer.current_epoch, self.training_data.served[:]))
            self.training_data.served.clear()
        self.step_ends.append(time.time())
        traffic = strategy.comm_stats.last_step.get(OUTER_ALL_REDUCE)
        self.outer_bytes.append(traffic.bytes if traffic is not None else 0)

    def on_validation_end(self, trainer, module) -> None:
        self.val_losses.append(float(trainer.callback_metrics["val_loss"]))

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0) -> None:
        if batch_idx == 0:  # the strategy's own on_validation_start runs after the callbacks'
            self.validated.append(digest(module))


class HeldBytesRecorder(L.Callback):
    """The most bytes torchft's DiLoCo held at once on this rank (under DDP each node's local rank 0, the others hold
    none; under FSDP every rank, for its shards), by what they are, as
    :class:`~lightning_fastdist.planning.outer_sync_memory.OuterSyncMemory` names them: the global copies and the
    outer optimizers' state after each step; the pseudo-gradient of the fragment in flight after the step that
    started its all-reduce, with the copies that cross the link (their bytes as the strategy counted the tensors it
    sent); the pseudo-gradient and the local parameters torchft keeps when an outer step is applied. A DTensor (an
    FSDP rank's outer momentum, its pseudo-gradient as the parameters' gradient) counts its local shard's bytes
    (:func:`~lightning_fastdist.planning.step_memory.tensor_bytes`)."""

    def __init__(self) -> None:
        self.held = dict.fromkeys(("global_copy", "outer_momentum", "in_flight", "applying"), 0)
        self._hooks: list = []

    def _keep(self, name: str, nbytes: int) -> None:
        self.held[name] = max(self.held[name], nbytes)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        run = trainer.strategy.across_nodes.run  # started after the callbacks' on_train_start
        if self._hooks or run is None:
            return
        for fragment in run.diloco._fragments:
            applying = functools.partial(self._applying, fragment)
            self._hooks.append(fragment._outer_optimizer.register_step_pre_hook(applying))

    def _applying(self, fragment, optimizer, args, kwargs) -> None:
        pseudo_gradient = [p.grad for group in optimizer.param_groups for p in group["params"]]
        self._keep("applying", tensor_bytes(pseudo_gradient) + tensor_bytes(fragment._local_parameters.values()))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        run = trainer.strategy.across_nodes.run
        if run is None:
            return
        fragments = run.diloco._fragments
        self._keep("global_copy", tensor_bytes(t for f in fragments for t in f.original_parameters.values()))
        self._keep("outer_momentum", tensor_bytes(t for o in run.outer_optimizers for t in optimizer_state_tensors(o)))
        sent = trainer.strategy.comm_stats.last_step.get(OUTER_ALL_REDUCE)
        pseudo_gradients = tensor_bytes(t for f in fragments for t in f._grads.values())
        self._keep("in_flight", pseudo_gradients + (sent.bytes if sent is not None else 0))

    def on_train_end(self, trainer, module) -> None:
        for hook in self._hooks:
            hook.remove()


def main(
    options: dict, steps: int, folder: str | None = None, save_every: int = 0, resume_from: str | None = None
) -> None:
    losses, recorder, held = LossRecorder(), OuterSyncRecorder(), HeldBytesRecorder()
    callbacks: list[L.Callback] = [NodeFaults(), recorder, losses, held, SyncFreeLogging(), SpeedMonitor()]
    if folder is not None:
        save_last = os.environ.get("OUTER_SYNC_FIT_SAVE_LAST") == "1"
        callbacks.append(
            ModelCheckpoint(folder, "{step}", every_n_train_steps=save_every, save_top_k=-1, save_last=save_last)
        )
    best = os.environ.get("OUTER_SYNC_FIT_BEST")
    if best:  # the highest validation loss: a decision every rank of a node must agree on, whichever way it goes
        callbacks.append(ModelCheckpoint(best, "best-{step}", monitor="val_loss", mode="max", save_top_k=1))
    if os.environ.get("OUTER_SYNC_FIT_ENGINE") == "fsdp":
        strategy = FastFSDPStrategy(outer_sync=options, timeout=120, checkpoint_format="sharded")
    else:
        strategy = FastDDPStrategy(comm_hook="none", outer_sync=options, timeout=120)
    ranks_per_node = int(os.environ.get("EMULATED_RANKS_PER_NODE", "1"))
    nodes = int(os.environ.get("OUTER_SYNC_FIT_NODES", "2"))
    trainer = make_trainer(
        strategy, devices=ranks_per_node, num_nodes=nodes, max_steps=steps, callbacks=callbacks,
        enable_checkpointing=folder is not None or bool(best), limit_val_batches=2, val_check_interval=6,
        check_val_every_n_epoch=None,
    )  # fmt: skip
    model = tiny_gpt()
    # The resumable loader continues an epoch where a checkpoint left it (a plain one restarts the epoch).
    recorder.training_data = RandomWindows()
    train = ResumableDataLoader(recorder.training_data, batch_size=4)
    val = DataLoader(RandomWindows(16, seed=1), batch_size=4)
    trainer.fit(model, train, val, ckpt_path=resume_from)
    report = {
        "node": trainer.node_rank, "local_rank": trainer.local_rank, "losses": losses.losses, "syncs": recorder.syncs,
        "outer_bytes": recorder.outer_bytes, "members": recorder.members, "step_ends": recorder.step_ends,
        "validated": recorder.validated, "samples": recorder.samples,
        "val_losses": recorder.val_losses, "host_syncs": recorder.host_syncs, "final": digest(model),
        "fragment_numels": strategy.across_nodes.fragment_numels, "held_bytes": held.held,
        "steps": recorder.steps, "digests": recorder.digests, "first_digest": recorder.first_digest,
        "rejoined": recorder.rejoined, "training_ranks": recorder.training_ranks,
    }  # fmt: skip
    # One write for the whole line: the node's ranks share its output file, and a buffered print of a line longer than
    # the buffer would go out in pieces between which another rank's line can land.
    os.write(sys.stdout.fileno(), f"FIT {json.dumps(report)}\n".encode())


if __name__ == "__main__":
    folder, save_every, resume_from = (sys.argv[3:] + [None, "0", None])[:3]
    main(json.loads(sys.argv[1]), int(sys.argv[2]), folder, int(save_every), resume_from)
