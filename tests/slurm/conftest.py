"""One SLURM cluster for the session's SLURM tests.

The cluster is SLURM's defaults where they matter to a job: a preempted job gets SIGTERM (no
``preempt_send_user_signal``), partitions ``low`` (preempted and requeued at once), ``low_grace`` (a 5 s GraceTime)
and ``high`` (preempts both, never preempted). Each node offers 2 CPUs, so that two jobs of one task per node run
side by side; a job that must preempt asks for whole nodes (``--exclusive``). Tests leave the nodes idle and up:
their jobs finished, a killed node started again (``node_restored``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.slurm_cluster import SlurmCluster, slurm_available


@pytest.fixture(scope="session")
def cluster() -> Iterator[SlurmCluster]:
    """munged, slurmctld and two slurmd (n0, n1) for the session: about a second to start."""
    why_not = slurm_available()
    if why_not is not None:
        pytest.skip(why_not)
    with SlurmCluster(cpus_per_node=2, preempt_send_user_signal=False) as started:
        yield started


@pytest.fixture
def node_restored(cluster: SlurmCluster) -> Iterator[None]:
    """Whatever the test did to n1 (killed, DOWN), it is up and idle afterwards, for the next test."""
    yield
    cluster.revive_node("n1")
