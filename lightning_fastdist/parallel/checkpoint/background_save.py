"""A checkpoint written while training goes on (``async_checkpointing``), the one mechanism every engine's save uses.

Training stops only while this rank's part of the state is copied into host memory that the next save reuses
(``torch.distributed.checkpoint``'s ``DefaultStager``: a second save copies into the buffers of the first, without
allocating, and that copy is most of a save's stall). A daemon thread then writes the copy under staging names
(:mod:`.atomic`), every rank learns over a process group of the saves' own whether every part is complete
(:func:`~.save_failure.agree_on_save`), and only then does the publishing rank call :func:`~.atomic.publish`: until
that rename the previous checkpoint is the resumable one, and a process killed at any point leaves it whole.

At most one save is in flight: the next one waits for it before its state is copied (the copy would overwrite what
is being written), except a save of the same state (Lightning's ``save_last`` beside a top-k save of the same step),
which is written from the same copy after it. What must not happen before a save is published (removing the
checkpoint it replaces) waits for it too (:meth:`BackgroundSave.after_published`). A failure of any rank's part is
raised on every rank by the next call that waits (the next save, a load, the end of the fit).

Why a thread of ours and not ``async_save``'s process: ``docs/checkpoints.md`` (measured). Nothing here imports
Lightning.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from lightning_fastdist.parallel.checkpoint.checkpoint_files import delete_checkpoint
from lightning_fastdist.parallel.checkpoint.save_failure import SAVE_ERRORS, agree_on_save, failure_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SavePart:
    """What this rank writes of one save: ``write(state)`` puts ``state`` (or its copy) under staging names."""

    state: Any
    write: Callable[[Any], None]


@dataclass(frozen=True)
class Publication:
    """The publishing rank's step, once every rank's part is complete: ``publish()``; ``staged``, what it removes
    where a part failed (the save's staging file or folder)."""

    publish: Callable[[], None]
    staged: Path


class BackgroundSave:
    """This rank's checkpoint saves: written in place of the caller, or once :meth:`go_background` was called, from a
    copy in host memory by a background thread, published when every rank's part is complete.

    Every rank of the world calls :meth:`save` for every save, in the same order (the agreement is a collective).

    Attributes:
        copies: how many times a state was copied into host memory (a save of the state in flight shares its copy).
    """

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None
        self.asynchronous = False
        self.copies = 0
        self._stager: DefaultStager | None = None
        self._in_flight: Future | None = None
        self._copied: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live, copy) of the save in flight's tensors
        self._lock = threading.Lock()
        self._after_publish: list[Callable[[], None]] = []
        self._unpublished = 0  # saves started and neither published nor failed
        self._failed = False  # a save failed and the failure is not raised yet

    def __reduce__(self) -> tuple[type, tuple]:
        """A copy (the strategy a spawned process starts from) starts with no save of its own: the thread, lock and
        group of this one belong to this process."""
        return (BackgroundSave, ())

    def go_background(self, group: dist.ProcessGroup | None) -> None:
        """Write later saves in the background, agreeing over ``group`` (of their own: the background thread's
        collectives must never mix with training's; ``None`` in a single process)."""
        self.asynchronous = True
        self.group = group

    def save(self, path: Path, parts: list[SavePart], publication: Publication | None, in_background: bool) -> None:
        """Write this rank's ``parts`` of the save of ``path``; the rank that holds ``publication`` publishes it once
        every rank's part is complete.

        Args:
            in_background: return once the state is copied (where :meth:`go_background` was called); else return
                once the save is published (a stop, or a save outside a fit, whose caller then exits or reads it).

        Raises:
            CheckpointSaveError: written here, on every rank where another rank's part failed; and on every rank, a
                failure of the save in flight (raised here, before this save starts).
        """
        if not (self.asynchronous and in_background):
            self.wait()
            self._write_agree_publish(path, parts, publication, group=None)  # over the world: nothing in flight
            return
        states = [part.state for part in parts]
        copies, reused = self._copy(states)
        writes = [SavePart(state, part.write) for part, state in zip(parts, copies)]
        previous = self._in_flight if reused else None
        with self._lock:
            self._unpublished += 1
        self._in_flight = _start_daemon(lambda: self._complete(previous, path, writes, publication))

    def after_published(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the saves in flight are published (now, where none is): removing the checkpoint a new
        one replaces (``ModelCheckpoint``'s top-k) never leaves the run without a complete one. Dropped if a save
        fails: the checkpoint it would have replaced stays."""
        with self._lock:
            if self._failed:
                return
            if self._unpublished:
                self._after_publish.append(action)
                return
        action()

    def wait(self) -> None:
        """Block until the save in flight (if any) is published; raise its failure (on every rank alike)."""
        in_flight, self._in_flight = self._in_flight, None
        self._copied = []
        if in_flight is None:
            return
        try:
            in_flight.result()
        finally:
            with self._lock:
                self._failed = False

    def finish_quietly(self) -> None:
        """Wait for the save in flight without raising its failure (logged): an exception is already ending the fit,
        and a save that fails leaves the previous checkpoint the resumable one."""
        try:
            self.wait()
        except SAVE_ERRORS as error:
            log.warning(f"the checkpoint being written when the fit failed was not published: {error}")

    def release_memory(self) -> None:
        """Free the host memory copies are made in (the end of a fit); the next background save allocates it again."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _copy(self, states: list[Any]) -> tuple[list[Any], bool]:
        """``states`` with every tensor copied into host memory, and whether that is the copy of the save in flight
        (the same tensors holding the same values: the copy is shared and this save waits for it in the background);
        otherwise the save in flight is waited for first, since the copy reuses its buffers."""
        live = list(_tensors(states))
        if self._in_flight is not None and _same_values(live, self._copied):
            memo = {id(new): copied for new, (_, copied) in zip(live, self._copied)}
            return copy.deepcopy(states, memo), True
        self.wait()
        if self._stager is None:
            self._stager = DefaultStager(_staging_options())
        copies = self._stager.stage(states)
        self.copies += 1
        self._copied = list(zip(live, _tensors(copies)))
        return copies, False

    def _complete(
        self, previous: Future | None, path: Path, parts: list[SavePart], publication: Publication | None
    ) -> None:
        """In the background, after ``previous`` (the save whose copy this one shares, if any): write, agree,
        publish, agree; once no other save is in flight, what waited for the publish runs (dropped where a save
        failed)."""
        try:
            if previous is not None:
                previous.result()  # its failure is this save's too: every rank raises it
            self._write_agree_publish(path, parts, publication, self.group)
        except SAVE_ERRORS:
            with self._lock:
                self._after_publish, self._unpublished, self._failed = [], self._unpublished - 1, True
            raise
        with self._lock:
            self._unpublished -= 1
            actions = [] if self._unpublished else self._after_publish
            self._after_publish = self._after_publish if self._unpublished else []
        for action in actions:
            _run_logged(action)

    @staticmethod
    def _write_agree_publish(
        path: Path, parts: list[SavePart], publication: Publication | None, group: dist.ProcessGroup | None
    ) -> None:
        """On every rank, a failure of any rank's part raises, the partial save removed by the publishing rank."""
        failure = failure_of(lambda: [part.write(part.state) for part in parts])
        try:
            agree_on_save(failure, path, group)
        except SAVE_ERRORS:
            if publication is not None:
                delete_checkpoint(publication.staged)
            raise
        agree_on_save(failure_of(publication.publish) if publication is not None else None, path, group)


def _run_logged(action: Callable[[], None]) -> None:
    """Run what waited for a publish; a failure (an old checkpoint that cannot be removed) is a warning, as the new
    checkpoint is published and training goes on."""
    try:
        action()
    except OSError as error:
        log.warning(f"after a checkpoint was published: {error}")


def _start_daemon(job: Callable[[], None]) -> Future:
    """Run ``job`` in a daemon thread: a process that ends (an exception, a kill) never waits for a write, which
    publishes nothing unless it completes."""
    done: Future = Future()

    def run() -> None:
        try:
            job()
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(error)
        else:
            done.set_result(None)

    threading.Thread(target=run, name="checkpoint-save", daemon=True).start()
    return done


def _staging_options() -> StagingOptions:
    """Plain host memory on a CPU machine; page-locked memory and copies off the compute stream with an accelerator.
    The copy is made before :meth:`BackgroundSave.save` returns (no staging thread): the next optimizer step changes
    the weights in place."""
    accelerated = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=accelerated,
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=accelerated,
    )


def _tensors(state: Any) -> Iterator[torch.Tensor]:
    """The tensors of ``state`` (nested dicts, lists and tuples), in order."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from _tensors(value)


def _same_values(live: list[torch.Tensor], copied: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether ``live`` holds the tensors a copy was made of, with the values copied (nothing trained since)."""
    if not copied or len(live) != len(copied):
        return False
    for new, (old, kept) in zip(live, copied):
        if new.shape != old.shape or new.dtype != old.dtype or type(new) is not type(old):
            return False
    return all(torch.equal(_local(new), _local(kept)) for new, (_, kept) in zip(live, copied))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
