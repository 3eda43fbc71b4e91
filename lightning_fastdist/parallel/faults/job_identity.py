"""Join the process group only with the ranks of one's own launch.

Two jobs given the same ``MASTER_PORT`` mix: the second job's ranks would connect to the first job's store. So rank
0 publishes the launcher's run id in the store and every other rank compares it with its own
(``docs/fault-tolerance.md``, "Job identity").
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

# Where each launcher puts an id of the launch, most specific first.
RUN_ID_VARIABLES = ("LIGHTNING_FASTDIST_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
OWN_RUN_ID_VARIABLE = RUN_ID_VARIABLES[0]
_STORE_KEY = "lightning_fastdist/run_id"
_UNKNOWN = "(none)"
_ADDRESS_IN_USE = ("EADDRINUSE", "address already in use")


class JobIdentityError(RuntimeError):
    """This process cannot join the process group: its port belongs to another job, or is in use."""


def launch_run_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """The id the launcher gave this launch, or ``None`` when it gave none (``torchrun``'s default "none" included)."""
    for variable in RUN_ID_VARIABLES:
        value = environ.get(variable)
        if value and value != "none":
            step = environ.get("SLURM_STEP_ID") if variable == "SLURM_JOB_ID" else None
            return f"{variable}={value}" + (f".{step}" if step else "")
    return None


def new_run_id() -> str:
    """A fresh id for a launch that starts its own processes (to put in ``OWN_RUN_ID_VARIABLE``)."""
    return uuid.uuid4().hex


def join_process_group(
    backend: str, rank: int, world_size: int, timeout: timedelta, device_id: torch.device | None = None
) -> None:
    """``init_process_group`` from ``MASTER_ADDR``/``MASTER_PORT`` (``env://``), after checking the launch's run id.

    ``timeout`` bounds the store and the collectives. Raises :class:`JobIdentityError` if the port is in use (rank 0)
    or the store there belongs to another launch.
    """
    port = os.environ.get("MASTER_PORT", "?")
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{port}"
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    except dist.DistNetworkError as error:
        if any(text in str(error) for text in _ADDRESS_IN_USE):
            raise JobIdentityError(
                f"[rank {rank}] cannot start: port {port} (MASTER_PORT) is already in use on {address.split(':')[0]}, "
                "probably by another job; give this job another MASTER_PORT."
            ) from None
        raise
    store.set_timeout(timeout)
    verify_run_id(store, rank, launch_run_id(), address)
    # The same key prefix torch uses when it creates the store itself.
    dist.init_process_group(
        backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world_size, timeout=timeout,
        device_id=device_id,
    )  # fmt: skip


def verify_run_id(store: dist.Store, rank: int, run_id: str | None, address: str) -> None:
    """Rank 0 publishes ``run_id`` in ``store``; every other rank checks that it equals its own.

    Ranks launched without a run id accept any; a rank with one refuses (:class:`JobIdentityError`) a store whose
    rank 0 published another (or none).
    """
    own = run_id or _UNKNOWN
    if rank == 0:
        store.set(_STORE_KEY, own)
        return
    published = store.get(_STORE_KEY).decode()
    if run_id is not None and published != own:
        raise JobIdentityError(
            f"[rank {rank}] refusing to join: the process group at {address} belongs to another job "
            f"(its run id is {published}, this process was launched as {own}); two jobs were given the same "
            "MASTER_PORT. Give each job its own port."
        )


def claim_or_check_run_id(store: dist.Store, run_id: str | None, what: str) -> None:
    """Every process of the job that uses ``store`` (``what`` names it: which store, on which address and port) calls
    this first: the first one claims the store for its run id, every later one must have the same, or is refused
    (:class:`JobIdentityError`, one line naming the store and both ids). Nothing is refused where this process was
    launched without an id (it cannot tell jobs apart), nor by a store claimed without one."""
    own = run_id or _UNKNOWN
    held = store.compare_set(_STORE_KEY, "", own).decode()
    if run_id is not None and held not in (own, _UNKNOWN):
        raise JobIdentityError(
            f"refusing to use {what}: it belongs to another job (its run id is {held}, this process was launched as "
            f"{own}); two jobs were given the same port. Give each job its own."
        )
