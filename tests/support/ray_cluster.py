"""A Ray cluster of two Ray nodes on this machine (``ray.cluster_utils.Cluster``, as Ray's own tests make one), with
this process connected as its driver, and the ``TorchTrainer`` runs the tests and the benchmark start on it.

Each node offers one CPU, so the two workers of a run land one per node and removing the second node takes one
worker's node away. The second node listens on another loopback address: Ray Train groups workers into nodes by
address (``node_rank``, ``local_world_size``), so two nodes on one address would count as one machine. The object
stores are kept small (the machine is shared); the workers find this repository (``tests.support.ray_training``)
through ``PYTHONPATH`` and use one intra-op thread, as the suite's own ranks do.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[2]
OBJECT_STORE_BYTES = 100 * 1024**2
WORKERS = 2
SECOND_NODE_ADDRESS = "127.0.0.2"  # Ray counts nodes by address (its node_rank): a machine of its own to Ray


def ray_missing() -> str | None:
    """Why Ray Train cannot run here (one line), or ``None``."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.train") is None:
        return "ray[train] is not installed (make test installs it: pip install -e '.[ray]')"
    return None


class RayTestCluster:
    """Two Ray nodes (the head and ``second``), this process their driver; :meth:`close` stops them."""

    def __init__(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        node = {"num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES}
        self.cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        self.second = self.cluster.add_node(**node, node_ip_address=SECOND_NODE_ADDRESS)
        self.cluster.wait_for_nodes()
        workers_env = {"PYTHONPATH": str(REPOSITORY), "OMP_NUM_THREADS": "1", "POSSIBLE_USER_WARNINGS": "off"}
        ray.init(address=self.cluster.address, runtime_env={"env_vars": workers_env}, log_to_driver=False)
        self._node = node

    def fit(self, train_func: Any, config: dict, storage: Path, max_failures: int = 0, **scaling: Any) -> Any:
        """``TorchTrainer(train_func).fit()`` with ``WORKERS`` workers of one CPU each; Ray's ``Result``."""
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        trainer = TorchTrainer(
            train_func,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=scaling.pop("num_workers", WORKERS), **scaling),
            run_config=RunConfig(
                storage_path=str(storage), name="run", failure_config=FailureConfig(max_failures=max_failures)
            ),
        )
        return trainer.fit()

    def remove_second_node(self) -> None:
        """Take the second node away, as a machine lost: its raylet and the workers on it end."""
        self.cluster.remove_node(self.second, allow_graceful=False)

    def restore_second_node(self) -> None:
        """A second node again (a new one), for the runs after."""
        self.second = self.cluster.add_node(**self._node, node_ip_address=SECOND_NODE_ADDRESS)
        self.cluster.wait_for_nodes()

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
