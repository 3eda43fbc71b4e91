"""Shared fixtures. Tests run on CPU only; multi-process tests use gloo through tests/harness.py."""

from __future__ import annotations

import os

import pytest

# Keep Lightning's tips and the accelerator banner out of test output.
os.environ.setdefault("POSSIBLE_USER_WARNINGS", "off")


@pytest.fixture
def in_tmp_dir(tmp_path, monkeypatch):
    """Run the test with the working directory set to a fresh temporary folder."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
