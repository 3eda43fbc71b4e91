"""One Ray cluster for the session's Ray tests: two Ray nodes on this machine, this process their driver.

Every test here is marked ``xdist_group("ray")`` (``make test`` distributes with ``--dist loadgroup``), so one
pytest-xdist worker runs them all on one cluster, started once (about 10 s) and stopped at the end. Where ray[train]
is not installed every test skips with one line saying so.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.ray_cluster import RayTestCluster, ray_missing


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayTestCluster]:
    why_not = ray_missing()
    if why_not is not None:
        pytest.skip(why_not)
    cluster = RayTestCluster()
    try:
        yield cluster
    finally:
        cluster.close()
