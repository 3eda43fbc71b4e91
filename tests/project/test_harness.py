"""The multi-process harness itself: results come back, failures and hangs are reported, not hidden."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import DistributedRunError, ForkedModule, run_command, run_function

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def all_reduce_rank_plus_one() -> tuple[int, float]:
    tensor = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(tensor)
    return dist.get_rank(), tensor.item()


def fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 waits here for a rank that is gone


def hang_on_rank_one() -> None:
    if dist.get_rank() == 1:
        time.sleep(600)


def test_run_function_returns_each_rank_result_over_gloo():
    results = run_function(all_reduce_rank_plus_one, world_size=2)
    assert results == [(0, 3.0), (1, 3.0)]
    assert not dist.is_initialized()  # the test process itself stays outside the group


def test_run_function_reports_the_failing_rank_traceback():
    with pytest.raises(DistributedRunError, match="rank 1 failed") as failure:
        run_function(fail_on_rank_one, world_size=2, timeout=60)
    assert "deliberate failure on rank 1" in str(failure.value)


def test_run_function_kills_a_hung_rank_at_the_timeout():
    started = time.monotonic()
    with pytest.raises(DistributedRunError, match="rank 1 did not finish"):
        run_function(hang_on_rank_one, world_size=2, timeout=4)
    assert time.monotonic() - started < 60


def test_run_command_gives_torchrun_environment_and_shows_failing_output():
    script = (
        "import os, sys; r = os.environ['RANK']; print('rank', r, 'of', os.environ['WORLD_SIZE']); sys.exit(int(r) * 3)"
    )
    with pytest.raises(DistributedRunError) as failure:
        run_command([sys.executable, "-c", script], world_size=2, timeout=60)
    message = str(failure.value)
    assert "rank 1 (exit 3)" in message and "rank 1 of 2" in message
    assert "rank 0 (exit" not in message  # the rank that succeeded is not blamed
    outputs = run_command([sys.executable, "-c", script.replace("int(r) * 3", "0")], world_size=2, timeout=60)
    assert [o.stdout.strip() for o in outputs] == ["rank 0 of 2", "rank 1 of 2"]


def test_a_forked_module_runs_as_python_m_with_its_directory_environment_output_and_exit_status(tmp_path):
    (tmp_path / "good.json").write_text('{"b": 1}')
    (tmp_path / "bad.json").write_text("{")
    environment = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    good = ForkedModule([sys.executable, "-m", "json.tool", "--sort-keys", "good.json"], environment, cwd=tmp_path)
    assert good.communicate(timeout=60) == ('{\n    "b": 1\n}\n', "") and good.returncode == 0
    bad = ForkedModule([sys.executable, "-m", "json.tool", "bad.json"], environment, cwd=tmp_path)
    out, err = bad.communicate(timeout=60)
    assert (bad.returncode, out) == (1, "") and "Expecting property name" in err  # as `python -m json.tool` exits
    killed = ForkedModule([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"], environment, cwd=tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        killed.wait(timeout=0.5)
    os.killpg(killed.pid, signal.SIGKILL)  # its own session, as run_processes kills it
    assert killed.wait(timeout=30) == -signal.SIGKILL
    with pytest.raises(ValueError, match="ForkedModule runs .* -m MODULE"):
        ForkedModule(["echo", "hi"], environment)
