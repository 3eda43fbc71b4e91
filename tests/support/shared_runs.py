"""A multi-process run that a module's tests all read, made once per test session.

``make test`` spreads a module's tests over two pytest-xdist workers, and a module-scoped fixture runs in each worker
that gets one of them: the contract matrix's launch ran twice, each beside the other on two cores. Here the first
worker to ask makes the run and leaves its result in the session's own folder; the other waits on a lock (idle,
leaving both cores to the run) and reads it. One process without xdist just makes it.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import TypeVar

import pytest
from filelock import FileLock

T = TypeVar("T")


def once_per_session(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[], T]) -> T:
    """``make()``'s result, made by one worker of this session and read by the others (``name``: the run's own)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make()
    shared = tmp_path_factory.getbasetemp().parent  # this session's folder, the workers' folders in it
    result = shared / f"{name}.pickle"
    with FileLock(f"{result}.lock"):
        if result.is_file():
            return pickle.loads(result.read_bytes())
        made = make()
        staged = result.with_suffix(".partial")
        staged.write_bytes(pickle.dumps(made))
        staged.replace(result)
        return made
