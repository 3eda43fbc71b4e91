"""RayReport's mistakes, each in one line, without a Ray cluster: a step count that is not one, and a fit or a resume
outside a Ray Train worker."""

from __future__ import annotations

import pytest

from lightning_fastdist import RayReport
from tests.support.ray_cluster import ray_missing


@pytest.mark.parametrize("every", [0, -2, 1.5, True])
def test_every_n_train_steps_is_an_integer_of_at_least_one(every):
    with pytest.raises(ValueError, match="RayReport: every_n_train_steps must be an integer >= 1"):
        RayReport(every_n_train_steps=every)


def test_outside_a_ray_train_worker_it_says_where_it_runs():
    if ray_missing():
        pytest.skip(ray_missing())
    with pytest.raises(RuntimeError, match=r"RayReport: runs inside a Ray Train worker \(the train_func of a ray"):
        RayReport.latest()
