"""Count the collectives DeepSpeed's engine and ZeRO optimizers run, from tensor metadata only.

Every collective DeepSpeed issues goes through one backend object (``deepspeed.comm.comm.cdb``), whose methods are
wrapped to record bytes and time waits. DeepSpeed's own communication logger is not used: it synchronises the device
after every call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_fastdist.parallel.comm.accounting import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CommStats
from lightning_fastdist.parallel.comm.exposed import ExposedCommClock, timed_collective

BROADCAST = "broadcast"
REDUCE = "reduce"
ALL_TO_ALL = "all_to_all"

# Backend method -> (collective it is counted as, name and position of the argument holding the full-size
# tensor or tensors, position of ``async_op``; None: it has none). Positions follow TorchBackend's signatures;
# they cannot be read from its methods, whose decorators hide them (deepspeed.comm passes async_op by position
# to all_reduce and all_reduce_coalesced, by name elsewhere).
COUNTED_METHODS = {
    "all_reduce": (ALL_REDUCE, "tensor", 0, 3),
    "inference_all_reduce": (ALL_REDUCE, "tensor", 0, None),
    "all_reduce_coalesced": (ALL_REDUCE, "tensors", 0, 3),
    "reduce": (REDUCE, "tensor", 0, 4),
    "broadcast": (BROADCAST, "tensor", 0, 3),
    "all_gather": (ALL_GATHER, "tensor_list", 0, 3),
    "all_gather_into_tensor": (ALL_GATHER, "output_tensor", 0, 3),
    "all_gather_coalesced": (ALL_GATHER, "output_tensors", 0, 3),
    "reduce_scatter": (REDUCE_SCATTER, "input_list", 1, 4),
    "reduce_scatter_tensor": (REDUCE_SCATTER, "input_tensor", 1, 4),
    "all_to_all_single": (ALL_TO_ALL, "input", 1, 5),
    "all_to_all": (ALL_TO_ALL, "input_tensor_list", 1, 3),
}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [item for item in value or () if isinstance(item, torch.Tensor)]


def _argument(args: tuple, kwargs: dict, name: str, position: int | None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[position] if position is not None and len(args) > position else None


def _counting(
    method: Callable,
    entry: tuple[str, str, int, int | None],
    stats: CommStats,
    clock: ExposedCommClock | None,
) -> Callable:
    collective, argument, position, async_position = entry

    def counted(*args: Any, **kwargs: Any) -> Any:
        for tensor in _tensors(_argument(args, kwargs, argument, position)):
            stats.record(tensor, collective)
        asynchronous = bool(_argument(args, kwargs, "async_op", async_position))
        return timed_collective(clock, lambda: method(*args, **kwargs), asynchronous)

    return counted


def count_deepspeed_communication(stats: CommStats, clock: ExposedCommClock | None = None) -> Callable[[], None]:
    """Record every collective of DeepSpeed's communication backend in ``stats`` until the returned function is called.

    Call after ``deepspeed.init_distributed``. With ``clock``, also time the waits: a blocking call whole, an
    asynchronous one's ``wait()``; on CUDA, calls on DeepSpeed's own reduction stream are left out.
    """
    from deepspeed.comm import comm  # noqa: PLC0415 - optional

    backend = comm.cdb
    if backend is None:
        raise RuntimeError("count_deepspeed_communication: DeepSpeed's distributed backend is not initialised yet.")
    replaced = [name for name in COUNTED_METHODS if getattr(backend, name, None) is not None]
    for name in replaced:
        setattr(backend, name, _counting(getattr(backend, name), COUNTED_METHODS[name], stats, clock))

    def restore() -> None:
        for name in replaced:
            delattr(backend, name)  # the instance attribute; the class's method shows through again

    return restore
