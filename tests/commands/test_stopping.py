"""bench and tune end what they started, whatever ends them: SIGTERM (a scheduler, ``kill``) and Ctrl-C run the cleanup
that kills each training's session, its own children included, and a bench output folder that holds a user's files is
refused before anything is written into it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from lightning_fastdist.commands.bench.command import main as bench
from lightning_fastdist.commands.written_marks import claim_folder, folder_refusal
from tests.support.harness import session_members, wait_for_session_end

# A command that starts a training-like child (itself starting a grandchild), as bench does, then waits on it.
RUNNER = """
import sys, time
from lightning_fastdist.commands.stopping import end_session, sigterm_ends_the_command, start_session
sleep = "import time; time.sleep(300)"
grandchild = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {sleep!r}]); time.sleep(300)"
with sigterm_ends_the_command():
    child = start_session([sys.executable, "-c", grandchild], sys.stdout)
    print(child.pid, flush=True)
    try:
        child.wait()
    finally:
        end_session(child)
"""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_command_ends_the_training_it_started_and_what_that_started(stop):
    runner = subprocess.Popen([sys.executable, "-c", RUNNER], stdout=subprocess.PIPE, text=True)
    child = int(runner.stdout.readline())
    deadline = time.monotonic() + 30
    while len(session_members([child])) < 2 and time.monotonic() < deadline:  # the grandchild started
        time.sleep(0.05)
    assert len(session_members([child])) == 2
    runner.send_signal(stop)
    assert runner.wait(timeout=30) != 0
    wait_for_session_end(child, time.monotonic() + 30)  # on busy cores the kernel ends a killed process later
    assert session_members([child]) == []  # the child and the grandchild it started are gone
    assert stop != signal.SIGTERM or runner.returncode == 128 + signal.SIGTERM


def test_bench_refuses_an_output_folder_holding_the_users_files_before_writing_anything(in_tmp_dir, capsys):
    users = "# the user's own recipe\ntrainer: {max_steps: 3}\n"
    (in_tmp_dir / "recipe.yaml").write_text(users)
    with pytest.raises(SystemExit) as stop:  # its "recipe" setup would write recipe.yaml there
        bench(["--config", "recipe.yaml", "--setups", "recipe", "--output", "."])
    assert stop.value.code == 2
    assert "--output: . holds files bench did not write; give a new or empty folder" in capsys.readouterr().err
    assert (in_tmp_dir / "recipe.yaml").read_text() == users and sorted(os.listdir(in_tmp_dir)) == ["recipe.yaml"]
    claim_folder(in_tmp_dir / "results", "bench")
    (in_tmp_dir / "results" / "bench.json").write_text("[]")
    assert folder_refusal("--output", in_tmp_dir / "results", "bench") is None  # bench's own: it may replace
