"""bench and tune start every rank of a one-node run at once, with torchrun's variables."""

from __future__ import annotations

import os
import sys
import time

from lightning_fastdist.commands import local_ranks
from lightning_fastdist.commands.local_ranks import run_local_ranks

REPORT = (
    "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'],"
    " os.environ['LIGHTNING_FASTDIST_RUN_ID'])"
)


def test_every_rank_runs_with_its_own_rank_and_one_shared_port(tmp_path):
    before = dict(os.environ)
    log_path = tmp_path / "ranks.log"
    with open(log_path, "w") as log:
        assert run_local_ranks([sys.executable, "-c", REPORT], 3, log) == 0
    lines = sorted(log_path.read_text().splitlines())
    assert [line.split()[:4] for line in lines] == [["rank", str(r), "of", "3"] for r in range(3)]
    assert len({tuple(line.split()[4:]) for line in lines}) == 1  # one port and one run id for the whole run
    assert dict(os.environ) == before  # the variables went to the ranks only


def test_a_failed_rank_fails_the_run_and_a_rank_left_waiting_is_killed_after_the_grace(tmp_path, monkeypatch):
    monkeypatch.setattr(local_ranks, "FAILURE_GRACE_S", 0.5)
    rank_1_fails = "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(600)"
    started = time.monotonic()
    with open(tmp_path / "ranks.log", "w") as log:
        assert run_local_ranks([sys.executable, "-c", rank_1_fails], 2, log) == 3
    assert time.monotonic() - started < 60  # not the waiting rank's 600 s
