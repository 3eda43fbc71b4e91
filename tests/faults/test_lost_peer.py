"""The lost-peer line tells a crashed peer from a silent one, and under NCCL names what the watchdog does.

The gloo messages are provoked for real by the fault campaign's kill_rank and hung_peer trials; NCCL's cannot be here
(no GPU), so its messages are the ones torch's ProcessGroupNCCL writes, verbatim.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_fastdist.parallel.faults.collective_timeout import (
    explain_lost_peer,
    explained_lost_peer,
    lost_peer_cause,
    lost_peer_message,
    nccl_error_handling,
)
from lightning_fastdist.recipes import recipes_dir

TIMEOUT = timedelta(seconds=600)


@pytest.mark.parametrize(
    ("text", "cause"),
    [
        ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:45123", "crashed"),
        ("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection reset by peer", "crashed"),
        ("NCCL error: remote process exited or there was a network error, NCCL version 2.27.3", "crashed"),
        ("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 8000ms for recv operation", "timed out"),
        (
            "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=78, OpType=ALLREDUCE, "
            "Timeout(ms)=600000) ran for 600043 milliseconds before timing out.",
            "timed out",
        ),
        ("NCCL communicator was aborted on rank 1.", "aborted"),
        ("a shape mismatch", None),
    ],
)
def test_each_backend_message_gets_its_cause(text, cause):
    error_class = dist.DistBackendError if "NCCL" in text else RuntimeError
    assert lost_peer_cause(error_class(text)) == cause


def test_a_crash_is_never_explained_with_the_collective_timeout():
    crash = lost_peer_message(TIMEOUT, 1, "crashed")
    assert "crashed or was killed" in crash and "600" not in crash and "timeout" not in crash.split(";")[0]
    assert "within the collective timeout (600 s)" in lost_peer_message(TIMEOUT, 1, "timed out")


def test_the_cause_is_found_in_the_error_a_lightning_error_was_raised_from():
    try:
        try:
            raise RuntimeError("Connection closed by peer [10.0.0.2]:29500")
        except RuntimeError as inner:
            raise ValueError("while running the training step") from inner
    except ValueError as outer:
        explain_lost_peer(outer, TIMEOUT, 0)
        assert "another rank crashed or was killed" in outer.__notes__[0]
        assert explained_lost_peer(outer) == outer.__notes__[0]  # the CLI ends on it, without the traceback
    assert explained_lost_peer(ValueError("a bug of the user's")) is None


def test_under_nccl_the_line_names_the_watchdogs_setting(monkeypatch):
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(name, raising=False)
    assert nccl_error_handling().startswith("TORCH_NCCL_ASYNC_ERROR_HANDLING unset: torch's default 3 (end the")
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "1")  # the deprecated name still counts, as in torch
    assert nccl_error_handling() == "NCCL_ASYNC_ERROR_HANDLING=1 (abort the communicator, then end the process)"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # the new name wins
    line = lost_peer_message(TIMEOUT, 3, "aborted", backend="nccl")
    assert "NCCL's watchdog: TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (abort the communicator; the next" in line
    assert "NCCL's watchdog" not in lost_peer_message(TIMEOUT, 3, "crashed", backend="gloo")


def test_the_slurm_script_sets_no_deprecated_nccl_variable():
    sbatch = (recipes_dir() / "slurm" / "train.sbatch").read_text()
    assert "export NCCL_ASYNC_ERROR_HANDLING" not in sbatch and "export TORCH_NCCL_ASYNC_ERROR_HANDLING" not in sbatch
    assert "Watchdog caught collective operation timeout" in sbatch  # says what to look for when a run fails
