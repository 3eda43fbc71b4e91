"""When a rank dies or hangs, the other ranks exit with a clear error on their own instead of hanging.

Real ranks of ``lightning-fastdist fit`` over gloo; rank 1 is SIGKILLed (or
stops answering) after step 3. gloo fails the survivor's next collective at
once for a dead peer, and after the strategy's ``timeout`` for a silent one;
either way the survivor must exit non-zero with the lost-peer message that
names what happened (a crash, or a timeout with its seconds) well before the
test's own deadline.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from lightning_fastdist.parallel.faults.collective_timeout import lost_peer_message
from tests.support.fault_runs import run_ranks, write_recipe

pytestmark = pytest.mark.multiprocess

DEADLINE_S = 150  # the test's bound; a hang would run into it
COLLECTIVE_TIMEOUT_S = 8  # long enough for start-up (both ranks start together), short for a test
FAULT_STEP = 3


def survivor_message(hang: bool) -> str:
    """A crashed peer is named as a crash, never with the timeout; a silent one with the timeout it ran past."""
    return lost_peer_message(timedelta(seconds=COLLECTIVE_TIMEOUT_S), 0, "timed out" if hang else "crashed")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy_class", "hang"),
    [("lightning_fastdist.FastDDPStrategy", False), ("lightning_fastdist.FastFSDPStrategy", True)],
    ids=["ddp-rank-killed", "fsdp-rank-hung"],
)
def test_the_surviving_rank_exits_with_a_clear_error(tmp_path, strategy_class, hang):
    marker = tmp_path / "fault.txt"
    fault = {
        "class_path": "tests.support.faults.KillOnce",
        "init_args": {"at_step": FAULT_STEP, "rank": 1, "marker": str(marker), "hang": hang},
    }
    strategy = {"class_path": strategy_class, "init_args": {"timeout": COLLECTIVE_TIMEOUT_S}}
    recipe = write_recipe(tmp_path, strategy, max_steps=10, extra_callbacks=[fault])

    survivor, faulty = run_ranks(["fit", "--config", str(recipe)], 2, DEADLINE_S, tmp_path, wait_for={0})

    assert marker.exists(), survivor.output
    assert faulty.returncode == -9 and (faulty.killed_by_test == hang)  # hung ranks are killed by the test at the end
    assert not survivor.killed_by_test, "rank 0 hung after its peer " + ("hung" if hang else "died")
    assert survivor.returncode != 0
    assert survivor_message(hang) in survivor.output, survivor.output[-3000:]
    assert (f"({COLLECTIVE_TIMEOUT_S} s)" in survivor.output) == hang  # the timeout is quoted for a hang only
    seconds = survivor.ended_at - marker.stat().st_mtime
    print(
        f"rank 0 exited {seconds:.1f} s after rank 1 {'hung' if hang else 'died'} "
        f"(collective timeout {COLLECTIVE_TIMEOUT_S} s)"
    )
