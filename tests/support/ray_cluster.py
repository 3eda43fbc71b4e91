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
import threading
import time
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[2]
OBJECT_STORE_BYTES = 100 * 1024**2
WORKERS = 2
SECOND_NODE_ADDRESS = "127.0.0.2"  # Ray counts nodes by address (its node_rank): a machine of its own to Ray
PLACEMENT_WAIT_S = 5  # RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (RayTestCluster says why)
# A removed node is known dead after 2 missed health checks of 0.5 s (Ray's default: 5 of 3 s, after 5 s).
NODE_DEATH_DETECTION = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 2,
}


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
        head = {**node, "include_dashboard": False, "_system_config": NODE_DEATH_DETECTION}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self.second = self.cluster.add_node(**node, node_ip_address=SECOND_NODE_ADDRESS)
        self.cluster.wait_for_nodes()
        workers_env = {
            "PYTHONPATH": str(REPOSITORY),
            "OMP_NUM_THREADS": "1",
            "POSSIBLE_USER_WARNINGS": "off",
            # Ray's elastic sizing reads free resources as Ray Data's autoscaling coordinator last saw them (every
            # 20 s): after a node is lost it may ask for a worker there and wait this long for it (60 s by
            # default) before it asks for fewer. A healthy cluster's workers are placed in under a second.
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(PLACEMENT_WAIT_S),
        }
        ray.init(address=self.cluster.address, runtime_env={"env_vars": workers_env}, log_to_driver=False)
        self._node = node

    def fit(
        self,
        train_func: Any,
        config: dict,
        storage: Path,
        max_failures: int = 0,
        remove_second_node_at: Path | None = None,
        **scaling: Any,
    ) -> Any:
        """``TorchTrainer(train_func).fit()`` with ``WORKERS`` workers of one CPU each (``scaling``: more of Ray's
        ``ScalingConfig``); Ray's ``Result``. ``remove_second_node_at``: once that file exists, the second node is
        removed (the time goes to ``<file>.removed``)."""
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
        if remove_second_node_at is None:
            return trainer.fit()
        done = threading.Event()
        watcher = threading.Thread(target=self._remove_second_node_at, args=(remove_second_node_at, done), daemon=True)
        watcher.start()
        try:
            return trainer.fit()
        finally:
            done.set()
            watcher.join()

    def _remove_second_node_at(self, signal: Path, done: threading.Event) -> None:
        while not done.wait(0.05):
            if signal.exists():
                self.remove_second_node()
                Path(f"{signal}.removed").write_text(str(time.time()))
                return

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
