"""Shared fixtures. Tests run on CPU only; multi-process tests use gloo through tests/support/harness.py."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

# Keep Lightning's tips and the accelerator banner out of test output.
os.environ.setdefault("POSSIBLE_USER_WARNINGS", "off")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests marked slow first (in file order otherwise): with ``make test``'s two workers, the longest
    tests then start early instead of one of them running alone while the other worker has nothing left."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def in_tmp_dir(tmp_path, monkeypatch):
    """Run the test with the working directory set to a fresh temporary folder."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@contextlib.contextmanager
def environment_restored() -> Iterator[None]:
    """Put ``os.environ`` back as it was on leaving the block."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def restore_environment():
    """Undo changes a test makes to ``os.environ``.

    Lightning's launcher writes MASTER_PORT, LOCAL_RANK, NODE_RANK, ... into the
    environment of the process that calls ``fit`` with a DDP or FSDP strategy,
    even for one device; left behind, they make a later test's processes believe
    they are ranks of an external job (hangs, "address already in use").
    """
    with environment_restored():
        yield


@pytest.fixture(autouse=True, scope="module")
def restore_environment_after_module():
    """The same around each module: a module-scoped fixture (one fit shared by a module's tests) is set up before
    the per-test fixture saves the environment, so what its fit wrote would otherwise outlive the module."""
    with environment_restored():
        yield
