"""How a strategy's processes start, join and fail as one job: a Ray Train worker's job taken as Ray made it
(:mod:`.ray_worker`), the options' class names checked before another process starts, the Trainer's nodes and devices
checked against a SLURM allocation before any rank waits for another, a fresh run id where Lightning starts every rank
(a hand-made multi-node launch would draw one id per node, refused by the others), the process group joined once, a lost
peer named in one line.
"""

from __future__ import annotations

import atexit
import functools
import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeGuard

import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_fastdist.diagnostics.slurm_allocation import LaunchMismatchError, SlurmAllocation, launch_mismatches
from lightning_fastdist.parallel.faults.collective_timeout import explain_lost_peer
from lightning_fastdist.parallel.faults.job_identity import OWN_RUN_ID_VARIABLE, join_process_group, new_run_id
from lightning_fastdist.strategies.common.ray_worker import take_ray_job


def names_checkable(module: LightningModule | None) -> TypeGuard[LightningModule]:
    """Whether ``module``'s layers exist before any process starts (not built later in ``configure_model``), so
    that a class name of the options that it lacks (a misspelt block) can be refused now."""
    return module is not None and not is_overridden("configure_model", module)


def check_names_at_launch(
    launcher: _Launcher | None,
    strategy: ParallelStrategy,
    check_names: Callable[[LightningModule | None], None],
    num_nodes: int,
) -> None:
    """Make ``launcher.launch`` check the Trainer against a SLURM allocation (:func:`check_slurm_allocation`), call
    ``check_names(strategy.lightning_module)`` and only then launch, under the launch's run id; an instance
    attribute, so the launcher's class (and isinstance checks) stay Lightning's. Call once Lightning configured the
    launcher: ``strategy``'s cluster environment and ``num_nodes`` are final. Inside a Ray Train worker they are made
    Ray's first (:func:`.ray_worker.take_ray_job`): Ray started the processes, so this launcher starts none."""
    take_ray_job(strategy)
    if launcher is None:
        return
    environment = strategy.cluster_environment
    starts_every_rank = environment is not None and not environment.creates_processes_externally and num_nodes == 1
    checked = functools.partial(_checked_launch, launcher.launch, strategy, check_names, starts_every_rank)
    launcher.launch = checked  # type: ignore[method-assign]  # on this instance only, on purpose (see above)


def check_names_before_joining(
    launcher: _Launcher | None, strategy: ParallelStrategy, check_names: Callable[[LightningModule | None], None]
) -> None:
    """Where the processes were started outside Lightning (torchrun, SLURM: no ``launcher``), check the launch
    against a SLURM allocation (:func:`check_slurm_allocation`) and call ``check_names(strategy.lightning_module)``
    before the first collective: every rank then refuses at the same point, and none is cut off inside a collective
    by a peer that refused and left first."""
    if launcher is None:
        check_slurm_allocation(strategy)
        check_names(strategy.lightning_module)


def check_slurm_allocation(strategy: ParallelStrategy) -> None:
    """Under SLURM, raise :class:`LaunchMismatchError` (one line naming both values) when the Trainer's
    ``num_nodes`` or ``devices`` is not the allocation's: a rank would otherwise wait for ranks SLURM never starts
    (FSDP2's strategy does not check; Lightning's DDP check misses ``--ntasks`` without ``--ntasks-per-node``)."""
    if not isinstance(strategy.cluster_environment, SLURMEnvironment):
        return
    allocation = SlurmAllocation.from_environment()
    if allocation is None:
        return
    mismatches = launch_mismatches(allocation, strategy.num_nodes, strategy.num_processes)
    if mismatches:
        raise LaunchMismatchError(
            f"[rank {strategy.cluster_environment.global_rank()}] the Trainer does not fit SLURM job "
            f"{allocation.job_id}: " + "; and ".join(mismatches) + "."
        )


def _checked_launch(
    launch: Callable[..., Any],
    strategy: ParallelStrategy,
    check_names: Callable[[LightningModule | None], None],
    fresh_run_id: bool,
    function: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    check_slurm_allocation(strategy)  # before Lightning's launch: its own check is a traceback, where it checks
    check_names(strategy.lightning_module)
    with _fresh_run_id(fresh_run_id):
        return launch(function, *args, **kwargs)


@contextmanager
def _fresh_run_id(wanted: bool) -> Generator[None, None, None]:
    """The processes started inside inherit a fresh run id (if ``wanted``); the variable is then put back."""
    if not wanted:
        yield
        return
    before = os.environ.get(OWN_RUN_ID_VARIABLE)
    os.environ[OWN_RUN_ID_VARIABLE] = new_run_id()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(OWN_RUN_ID_VARIABLE, None)
        else:
            os.environ[OWN_RUN_ID_VARIABLE] = before


def join_process_group_once(strategy: ParallelStrategy, backend: str, timeout: timedelta) -> None:
    """Join the job's process group with ``timeout`` as its collective timeout, unless this process already has.
    Call after the strategy set its world ranks."""
    if dist.is_initialized():
        return
    assert strategy.accelerator is not None and isinstance(strategy.cluster_environment, ClusterEnvironment)
    device = strategy.root_device
    strategy.accelerator.setup_device(device)
    os.environ["MASTER_ADDR"] = strategy.cluster_environment.main_address
    os.environ["MASTER_PORT"] = str(strategy.cluster_environment.main_port)
    join_process_group(
        backend, strategy.global_rank, strategy.world_size, timeout, device if device.type != "cpu" else None
    )
    if backend == "nccl":
        atexit.register(_destroy_dist_connection)  # as Lightning does: no warning about a live group at exit


def explain_lost_peer_of_job(exception: BaseException, timeout: timedelta, rank: int) -> None:
    """Name a peer lost during a collective in one line (:func:`explain_lost_peer`), for this job's backend."""
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    explain_lost_peer(exception, timeout, rank, backend)
