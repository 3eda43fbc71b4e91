"""The fault campaign's fixed seeded subset: one trial of every fault kind (``benchmarks/fault_campaign.py`` runs
hundreds), each checked as a user would check it (``tests/support/fault_campaign.py``): the job went on or ended in one
line, a resume reached the uninterrupted run bit for bit, no file of the user's changed, no process is left, nothing
was served to or done for a stranger. Seed 1691 draws the one-world trials on FSDP (a read error on one rank needs a
file one rank alone reads: its shards), so the campaign makes one uninterrupted run per launch kind.
"""

from __future__ import annotations

import pytest

from tests.support.campaign import run_campaign, summary, unmount_under
from tests.support.emulated_cluster import cannot_emulate
from tests.support.fault_campaign import FAULT_KINDS, plan

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.emulated]

SEED = 1691


def test_one_trial_of_every_fault_kind_loses_nothing_leaves_nothing_and_lets_nobody_in(tmp_path):
    reason = cannot_emulate()  # the stranger's namespace; the small disk's tmpfs needs root too
    if reason:
        pytest.skip(reason)
    trials = plan(len(FAULT_KINDS), SEED)
    assert sorted(trial.fault for trial in trials) == sorted(FAULT_KINDS)
    try:
        outcomes = run_campaign(trials, tmp_path)
    finally:
        unmount_under(tmp_path)
    failed = {outcome.trial.fault: outcome for outcome in outcomes if not all(outcome.checks.values())}
    assert failed == {}, {fault: (o.checks, o.detail) for fault, o in failed.items()}
    counts = summary(outcomes)
    assert counts == {"trials": len(FAULT_KINDS), **{name: 0 for name in counts if name != "trials"}}
