"""``async_checkpointing`` on every engine and format, on 2 gloo ranks with Lightning's own ``ModelCheckpoint``: the
training loop goes on while a save is written, the checkpoints on disk and the weights are those of synchronous saves
(top-k removal, ``save_last``, ``every_n_train_steps``), the end of the fit publishes the last save, an exception
waits for the save in flight, and a resume from it equals the run with synchronous saves bit for bit. One launch runs
every cell; DDP's and DeepSpeed's stop signals are in ``tests/faults/test_preemption.py`` (its cases with
``async_checkpointing``). A kill at fixed points of a background write (halfway through its bytes; written, not yet
published) leaves the previous checkpoint, from which the run resumes to the weights of synchronous saves.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from tests.support.harness import DistributedRunError, run_function
from tests.support.shared_runs import once_per_session

pytestmark = pytest.mark.multiprocess

WORLD, STEPS = 2, 6
HELD_STEP = 2  # the save held in the background while the loop trains step 3
FAILING_STEP = 5  # the step whose training_step raises, while step 4's save is held
HOLD_S = 60  # a held write gives up after this (only where the loop never goes on: a synchronous save)
SETUPS = {
    "fast_ddp": ("FastDDPStrategy", {"comm_hook": "powersgd", "powersgd_start_iter": 2}),  # rank files beside
    "fast_fsdp sharded": ("FastFSDPStrategy", {}),
    "fast_fsdp full": ("FastFSDPStrategy", {"checkpoint_format": "full"}),
    "fast_deepspeed": ("FastDeepSpeedStrategy", {"stage": 2}),
}
WITH_EXCEPTION = ("fast_ddp", "fast_fsdp sharded", "fast_deepspeed")  # the full format shares DDP's one-file path
WITH_STOP = ("fast_fsdp sharded",)  # DDP's and DeepSpeed's: tests/faults/test_preemption.py's async cases
KILLED_STEP = 4  # rank 0 dies in the background write of this step's last.ckpt
KILLS = {  # where, per setup
    "fast_ddp": "halfway through its bytes",
    "fast_fsdp sharded": "written, not yet published",
    "fast_fsdp full": "written, not yet published",
    "fast_deepspeed": "halfway through its bytes",
}


class HeldWrites:
    """``torch.save`` (which every engine's background write calls: DDP's file, DCP's shards, DeepSpeed's state files),
    holding the first background write of the save that starts after :meth:`hold` (in a save thread started since)
    until :meth:`release`; ``outcomes`` has, per held write, whether the release came (the loop went on) rather than
    the time limit."""

    def __init__(self) -> None:
        import torch

        self.torch, self.original = torch, torch.save
        self.armed = False
        self.earlier: set[threading.Thread] = set()
        self.released = threading.Event()
        self.outcomes: list[bool] = []

    def __enter__(self) -> HeldWrites:
        self.torch.save = self.save
        return self

    def __exit__(self, *exc) -> None:
        self.torch.save = self.original

    def hold(self) -> None:
        self.armed, self.earlier = not self.outcomes, set(threading.enumerate())

    def release(self) -> None:
        self.released.set()

    def save(self, *args, **kwargs):
        thread = threading.current_thread()
        if self.armed and thread.name == "checkpoint-save" and thread not in self.earlier:
            self.armed = False
            self.outcomes.append(self.released.wait(HOLD_S))
        return self.original(*args, **kwargs)


def _gate(writes: HeldWrites | None, fail_at: int | None, stop: bool):
    """A callback holding the ``last`` save of a step while the loop trains the next one (DeepSpeed's save of the
    same step after a top-k save waits for that one): released at that step's end, or, where that step raises
    (``fail_at``), as it raises; with ``stop``, SIGTERM to this rank as that step starts."""
    import lightning as L

    held = HELD_STEP if fail_at is None else fail_at - 1

    class Gate(L.Callback):
        saves_of_the_step = 0

        def on_save_checkpoint(self, trainer, module, checkpoint) -> None:
            if writes is not None and trainer.global_step == held:
                self.saves_of_the_step += 1
                if self.saves_of_the_step == 2:  # ModelCheckpoint's second of the step: save_last's
                    writes.hold()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if writes is not None and trainer.global_step == held + 1:  # before ModelCheckpoint's (Lightning's order)
                writes.release()

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if stop and trainer.global_step == held:
                os.kill(os.getpid(), signal.SIGTERM)  # recorded; the ranks agree and stop at a step's end
            if fail_at is not None and trainer.global_step == fail_at - 1:
                if writes is not None:
                    writes.release()
                raise RuntimeError("a bug in the training step")

    return Gate()


def _fit(
    setup: str,
    folder: Path,
    asynchronous: bool,
    writes: HeldWrites | None = None,
    fail_at: int | None = None,
    resume: str | None = None,
    stop: bool = False,
) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.tensor import DTensor

    import lightning_fastdist
    from lightning_fastdist.trainer.preemption import Preempted
    from tests.support.fault_runs import saved_step
    from tests.support.workloads import LossRecorder, distinct_batches, tiny_gpt

    name, options = SETUPS[setup]
    strategy = getattr(lightning_fastdist, name)(**options, async_checkpointing=asynchronous, timeout=120)
    checkpoints = ModelCheckpoint(folder, "{step}", every_n_train_steps=1, save_top_k=1, save_last=True)
    losses = LossRecorder()
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=STEPS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, deterministic=True,
        callbacks=[checkpoints, losses, _gate(writes, fail_at, stop)],
    )  # fmt: skip
    model = tiny_gpt(dropout=0.1)  # dropout: the random states resume too
    error = None
    try:
        trainer.fit(model, distinct_batches(samples=64), ckpt_path=resume)
    except RuntimeError as raised:
        error = str(raised)
    except Preempted as stopped:
        error = f"exit {stopped.code}"
    weights = {
        key: (value.to_local() if isinstance(value, DTensor) else value).detach().clone()
        for key, value in model.state_dict().items()
    }
    return {
        "error": error,
        "losses": losses.losses,
        "weights": weights,
        "files": sorted(os.listdir(folder)),
        "best": Path(checkpoints.best_model_path).name,
        "last": Path(checkpoints.last_model_path).name,
        "copies": strategy.shared.saves.background.copies,
        "held": writes.outcomes if writes is not None else [],
        "last_step": saved_step(folder / "last.ckpt") if (folder / "last.ckpt").exists() else None,
    }


def async_cells(root: str) -> dict:
    """On this rank, per setup: a fit with synchronous saves, the same with asynchronous ones (a write held while the
    loop trains on), and (some setups) one that raises while a save is held, resumed from its last checkpoint."""
    results = {}
    for setup in SETUPS:
        folder = Path(root, setup.replace(" ", "_"))
        results[setup, "sync"] = _fit(setup, folder / "sync", asynchronous=False)
        with HeldWrites() as writes:
            results[setup, "async"] = _fit(setup, folder / "async", True, writes)
        if setup in WITH_EXCEPTION:
            with HeldWrites() as writes:
                results[setup, "raised"] = _fit(setup, folder / "raised", True, writes, fail_at=FAILING_STEP)
            last = str(folder / "raised" / "last.ckpt")
            results[setup, "resumed"] = _fit(setup, folder / "raised", True, resume=last)
        if setup in WITH_STOP:
            with HeldWrites() as writes:
                results[setup, "stopped"] = _fit(setup, folder / "stopped", True, writes, stop=True)
            last = str(folder / "stopped" / "last.ckpt")
            results[setup, "stop resumed"] = _fit(setup, folder / "stopped", True, resume=last)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("async_checkpoints")
    return once_per_session(
        tmp_path_factory,
        "async_checkpoints",
        lambda: run_function(async_cells, WORLD, args=(str(root),), init_process_group=False, timeout=600),
    )


def _same_weights(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("setup", SETUPS)
def test_asynchronous_saves_write_what_synchronous_ones_do_while_the_loop_goes_on(ranks, setup):
    for rank in ranks:
        sync, asynchronous = rank[setup, "sync"], rank[setup, "async"]
        assert asynchronous["losses"] == sync["losses"] and _same_weights(asynchronous["weights"], sync["weights"])
        # ModelCheckpoint's bookkeeping as with synchronous saves: the top-1 removal, save_last, every step.
        assert asynchronous["files"] == sync["files"] and not [name for name in sync["files"] if "partial" in name]
        assert (
            (asynchronous["best"], asynchronous["last"]) == (sync["best"], sync["last"]) == ("step=6.ckpt", "last.ckpt")
        )
        assert asynchronous["last_step"] == STEPS  # the end of the fit published the last save
    writer = ranks[0][setup, "async"]
    assert writer["held"] == [True]  # the held write was released by the loop's next step: training went on
    # One copy per step: save_last's save of the same step shares the top-k save's (DeepSpeed copies each: its engine
    # writes into the staging folder in place, so a save waits for the one in flight).
    assert writer["copies"] == (2 * STEPS if setup == "fast_deepspeed" else STEPS)


@pytest.mark.parametrize("setup", WITH_EXCEPTION)
def test_an_exception_waits_for_the_save_in_flight_and_the_resume_equals_synchronous_saves(ranks, setup):
    for rank in ranks:
        raised, resumed, sync = rank[setup, "raised"], rank[setup, "resumed"], rank[setup, "sync"]
        assert raised["error"] == "a bug in the training step"
        assert raised["last_step"] == FAILING_STEP - 1  # the save held when the step raised, published
        assert not [name for name in raised["files"] if "partial" in name]
        assert resumed["error"] is None and resumed["losses"] == sync["losses"][FAILING_STEP - 1 :]
        assert _same_weights(resumed["weights"], sync["weights"])  # bit for bit
    assert ranks[0][setup, "raised"]["held"] == [True]


@pytest.mark.parametrize("setup", WITH_STOP)
def test_a_stop_signal_writes_its_save_before_the_exit_and_the_resume_equals_synchronous_saves(ranks, setup):
    for rank in ranks:
        stopped, resumed, sync = rank[setup, "stopped"], rank[setup, "stop resumed"], rank[setup, "sync"]
        assert stopped["error"] == "exit 143"
        stop_step = stopped["last_step"]  # the stop's save, written whole before the exit (a save was in flight)
        assert HELD_STEP < stop_step <= HELD_STEP + 2 and not [name for name in stopped["files"] if "partial" in name]
        assert resumed["losses"] == sync["losses"][stop_step:] and _same_weights(resumed["weights"], sync["weights"])


class DiesHalfway:
    """A file that SIGKILLs this process once part of what it is given is on disk: a write cut short by a kill."""

    def __init__(self, path) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 - the process dies holding it
        self.written = 0

    def write(self, data) -> int:
        if self.written > 0:
            self.file.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        self.written += self.file.write(data)
        return len(data)

    def flush(self) -> None:
        self.file.flush()


def kill_in_the_background_write(point: str) -> None:
    """On rank 0, die at ``point`` of the background write of the ``KILLED_STEP``-th save of ``last.ckpt`` (each
    save's write is a thread of its own)."""
    import torch

    from lightning_fastdist.parallel.checkpoint import atomic

    saves: list[threading.Thread] = []

    def in_the_killed_save(target) -> bool:
        thread = threading.current_thread()
        if os.environ["RANK"] != "0" or thread.name != "checkpoint-save" or "last.ckpt.partial" not in str(target):
            return False
        if thread not in saves:
            saves.append(thread)
        return saves.index(thread) == KILLED_STEP - 1

    save, sync_tree = torch.save, atomic.sync_tree

    def save_cut_short(obj, f, *args, **kwargs):
        cut = point == "halfway through its bytes" and in_the_killed_save(f)
        return save(obj, DiesHalfway(f) if cut else f, *args, **kwargs)

    def die_before_publishing(path):
        if point == "written, not yet published" and in_the_killed_save(path):
            os.kill(os.getpid(), signal.SIGKILL)
        return sync_tree(path)

    torch.save, atomic.sync_tree = save_cut_short, die_before_publishing


def killed_fit(setup: str, root: str) -> dict:
    kill_in_the_background_write(KILLS[setup])
    return _fit(setup, Path(root), asynchronous=True)


def resume_each(root: str) -> dict:
    """On this rank, each killed setup's resume from ``last.ckpt``, and what was on disk before it."""
    from tests.support.fault_runs import saved_step

    results = {}
    for setup in KILLS:
        folder = Path(root, setup.replace(" ", "_"))
        found = {"files_before": sorted(os.listdir(folder)), "step_before": saved_step(folder / "last.ckpt")}
        results[setup] = {**found, **_fit(setup, folder, asynchronous=True, resume=str(folder / "last.ckpt"))}
    return results


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> list[dict]:
    """Each setup killed in a launch of its own, then every resume in one launch."""
    root = tmp_path_factory.mktemp("killed")
    for setup in KILLS:
        folder = root / setup.replace(" ", "_")
        with pytest.raises(DistributedRunError, match="exit code -9"):
            run_function(killed_fit, WORLD, args=(setup, str(folder)), init_process_group=False, timeout=300)
    return run_function(resume_each, WORLD, args=(str(root),), init_process_group=False, timeout=300)


@pytest.mark.parametrize("setup", KILLS)
def test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint_to_the_same_weights(
    killed, ranks, setup
):
    for rank, resumed in zip(ranks, killed):
        after = resumed[setup]
        assert after["step_before"] == KILLED_STEP - 1  # the previous complete last.ckpt, never a half-written one
        assert "last.ckpt.partial" in after["files_before"]  # the write the kill cut short, never published
        # Steps 4 to 6 trained again: the weights of the run with synchronous saves, bit for bit.
        assert after["losses"] == rank[setup, "sync"]["losses"][KILLED_STEP - 1 :]
        assert _same_weights(after["weights"], rank[setup, "sync"]["weights"])
        assert not [name for name in after["files"] if "partial" in name]  # the resume's first save removed it
