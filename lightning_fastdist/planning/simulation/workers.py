"""Run a simulation's traces in this process and in spawned workers, each worker rank 0 of a fake world of its own.

A trace of a large model takes seconds, a worker's start-up about as long: this process traces from the start while
the workers boot, and each takes the next trace when free. A trace that fails returns its one-line reason (it would
fail in training too); a worker that dies stops them all.
"""

from __future__ import annotations

import collections
import functools
import multiprocessing
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from lightning_fastdist.planning.setup import Setup
from lightning_fastdist.planning.simulation.recipe_run import NotTraceable, RecipeRun
from lightning_fastdist.planning.simulation.trace import TracedStep, measure_setup
from lightning_fastdist.planning.step_memory import fake_world, join_fake_world


@dataclass(frozen=True)
class TraceTask:
    """One step to trace.

    Args:
        precision: overrides the recipe's (DeepSpeed's activation dtype), or ``None``.
        ranks: FSDP shards over one node's ``ranks`` (as under ``outer_sync`` and ``replica_groups``); ``None``: the
            world's.
    """

    setup: Setup
    precision: str | None = None
    ranks: int | None = None


def run_tasks(
    run: RecipeRun, batch: Any, tasks: list[TraceTask], world_size: int, gpus_per_node: int, processes: int
) -> list[TracedStep | str]:
    """Each task's traced step, or the one-line reason it did not trace, in the order of ``tasks``; traced in this
    process and ``processes - 1`` spawned workers, the recomputing (slower) ones first."""
    trace = functools.partial(_run_task, run, batch, gpus_per_node=gpus_per_node)
    waiting = collections.deque(
        sorted(enumerate(tasks), key=lambda item: item[1].setup.activation_checkpointing == "none")
    )
    results: list[TracedStep | str | None] = [None] * len(tasks)
    failures: list[BaseException] = []

    def take_in_turn(run_one: Callable[[TraceTask], TracedStep | str]) -> None:
        while not failures:
            try:
                index, task = waiting.popleft()
            except IndexError:  # none left
                return
            try:
                results[index] = run_one(task)
            except BaseException as error:  # a worker died (or Ctrl-C): everyone stops, it is raised below
                failures.append(error)

    workers = processes - 1
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no process group, no threads inherited
    pool = ProcessPoolExecutor(workers, context, initializer=_start_worker, initargs=(world_size,)) if workers else None
    with pool or nullcontext():
        feeders = [
            threading.Thread(target=take_in_turn, args=(lambda task: pool.submit(trace, task).result(),))
            for _ in range(workers)
        ]
        for feeder in feeders:
            feeder.start()
        with warnings.catch_warnings(), fake_world(world_size):
            warnings.simplefilter("ignore")  # self.log without a Trainer, FSDP's notes on fake tensors
            take_in_turn(trace)
        for feeder in feeders:
            feeder.join()
    if failures:
        raise failures[0]
    return results


def _start_worker(world_size: int) -> None:
    """A worker process is rank 0 of its own fake world for its whole life."""
    warnings.simplefilter("ignore")
    join_fake_world(world_size)


def _run_task(run: RecipeRun, batch: Any, task: TraceTask, *, gpus_per_node: int) -> TracedStep | str:
    """One trace, or the one-line reason it failed."""
    try:
        return measure_setup(run, batch, task.setup, gpus_per_node, task.precision, ranks=task.ranks)
    except NotTraceable as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 - whatever fake tensors met (data-dependent shapes, custom kernels)
        lines = str(error).strip().splitlines()
        return f"{type(error).__name__}: {lines[0] if lines else 'no message'}"
