"""One Ray cluster for the session's Ray tests: two Ray nodes on this machine, this process their driver, started
when a test first asks (about 10 s) and stopped at the end. The one job the tests read is run once per session
(``test_ray_train.py``'s ``job``): under ``make test``'s two pytest-xdist workers only the worker that runs it starts a
cluster. Where ray[train] is not installed every test skips with one line saying so.
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
