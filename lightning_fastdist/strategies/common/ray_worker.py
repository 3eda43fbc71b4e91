"""A strategy inside a Ray Train worker: Ray started the processes, made the process group and assigned each one its
device, so our strategies launch nothing and take Ray's job as it is (``docs/ray.md``).

Ray runs ``train_func`` in every worker of a ``TorchTrainer`` after ``init_process_group``; Lightning's picture of
the job is still the Trainer's ``num_nodes`` and ``devices``, which Ray's guide leaves at their defaults. Under it a
CPU worker sees one device whatever its local rank (Lightning's ``root_device`` then indexes past its list), and DDP's
sampler splits the data over ``num_nodes * devices`` replicas instead of Ray's world. Ray's own strategies override
both; ours make Lightning's picture Ray's instead, once, when the Trainer configures them, so that every reader of
``num_nodes``, ``num_processes`` and ``root_device`` (Lightning's and ours) sees the same job.

Ray is optional: nothing here imports it unless the process has imported ``ray.train`` already, which every Ray Train
worker has.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info


def ray_train_context() -> Any | None:
    """Ray Train's context (world size and ranks) where this process is a Ray Train worker, else ``None``."""
    ray_train = sys.modules.get("ray.train")
    if ray_train is None:  # a Ray Train worker has imported it before it runs train_func
        return None
    try:
        return ray_train.get_context()
    except RuntimeError:  # Ray's answer outside a training function (the driver, a plain task)
        return None


@dataclass(frozen=True)
class RayJob:
    """The job Ray Train started, as Lightning counts it.

    Attributes:
        nodes: Lightning's ``num_nodes``: Ray's nodes, where each holds as many workers; one otherwise.
        devices: Lightning's ``devices`` per node: the workers on each node (the whole world where nodes differ).
        local_rank: this worker's index among ``devices``.
        device: the device Ray assigned this worker (``ray.train.torch.get_device()``).
        per_node: each worker's count of the workers on its node, by rank.
    """

    nodes: int
    devices: int
    local_rank: int
    device: torch.device
    per_node: tuple[int, ...]

    @classmethod
    def of_this_worker(cls, context: Any, ray_torch: ModuleType) -> RayJob:
        """Read from Ray's context; every worker calls it at once (one gather of the workers per node)."""
        world_size, local_world_size = context.get_world_size(), context.get_local_world_size()
        per_node: list[int] = [0] * world_size
        dist.all_gather_object(per_node, local_world_size)  # Ray may place more workers on one node than another
        device = ray_torch.get_device()
        if len(set(per_node)) == 1:
            nodes = world_size // local_world_size
            return cls(nodes, local_world_size, context.get_local_rank(), device, tuple(per_node))
        return cls(1, world_size, context.get_world_rank(), device, tuple(per_node))

    def uneven_line(self) -> str | None:
        """The line that says Lightning counts one node, where Ray placed more workers on one node than another."""
        if len(set(self.per_node)) == 1:
            return None
        return (
            f"Ray placed {sorted(self.per_node)} workers per node: Lightning counts one node of {self.devices} devices "
            "(ZeRO and DDP are unaffected; HSDP's default group is then the whole world)."
        )

    def parallel_devices(self) -> list[torch.device]:
        """Lightning's list of the node's devices, this worker's own at its local rank."""
        if self.device.type == "cpu":
            return [self.device] * self.devices
        devices = [torch.device(self.device.type, index) for index in range(self.devices)]
        devices[self.local_rank] = self.device
        return devices


def take_ray_job(strategy: ParallelStrategy) -> None:
    """Inside a Ray Train worker, make ``strategy``'s job Ray's: Ray's ranks (Lightning's default environment replaced
    by Ray's ``RayLightningEnvironment``, which Ray's guide passes anyway), Ray's nodes and workers per node, the
    device Ray assigned, and ``ray.train.lightning.prepare_trainer`` accepting the strategy. Elsewhere nothing.
    Call where the Trainer configures the strategy's launcher: once its environment and devices are set, before it
    is prepared or fits."""
    context = ray_train_context()
    if context is None:
        return
    from ray.train import lightning as ray_lightning
    from ray.train import torch as ray_torch

    if type(strategy.cluster_environment) is LightningEnvironment:  # Lightning's default: it would count one node
        strategy.cluster_environment = ray_lightning.RayLightningEnvironment()
    job = RayJob.of_this_worker(context, ray_torch)
    strategy.parallel_devices = job.parallel_devices()
    strategy.num_nodes = job.nodes
    strategy.set_world_ranks()  # Lightning set them from its own picture: rank_zero_only's rank becomes Ray's too
    line = job.uneven_line()
    if line is not None:
        rank_zero_info(line)
    _accepted_by_prepare_trainer(type(strategy), ray_lightning)


def _accepted_by_prepare_trainer(strategy_class: type, ray_lightning: ModuleType) -> None:
    """``prepare_trainer`` accepts instances of Ray's three strategy classes only: register ``strategy_class`` as a
    virtual subclass of its engine's (``ABCMeta.register``: Lightning's strategies are abstract base classes), which
    changes no class's behaviour and nothing but what ``isinstance`` answers for our strategies."""
    if issubclass(strategy_class, DeepSpeedStrategy):
        ray_class = ray_lightning.RayDeepSpeedStrategy
    elif issubclass(strategy_class, ModelParallelStrategy):
        ray_class = ray_lightning.RayFSDPStrategy
    else:
        ray_class = ray_lightning.RayDDPStrategy
    ray_class.register(strategy_class)
