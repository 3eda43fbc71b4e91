"""Count the collectives DeepSpeed's engine and ZeRO optimizers run, from tensor metadata only.

Every collective DeepSpeed issues goes through ``deepspeed.comm``, which hands it
to one backend object (``deepspeed.comm.comm.cdb``, a ``TorchBackend`` over
``torch.distributed``). :func:`count_deepspeed_communication` replaces that
object's collective methods with ones that record the bytes in a
:class:`~lightning_fastdist.parallel.comm_accounting.CommStats` and then call
the original; DeepSpeed's own communication logger is not used, as it
synchronises the device after every call.

What is recorded follows :mod:`~lightning_fastdist.parallel.comm_accounting`:
what is all-reduced (or reduced to one rank, or broadcast), the gathered result
of an all-gather, the full input of a reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_fastdist.parallel.comm_accounting import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CommStats

BROADCAST = "broadcast"
REDUCE = "reduce"
ALL_TO_ALL = "all_to_all"

# Backend method -> (collective it is counted as, name and position of the argument holding the full-size
# tensor or tensors). Positions follow TorchBackend's signatures; they cannot be read from its methods,
# whose decorators hide them.
COUNTED_METHODS = {
    "all_reduce": (ALL_REDUCE, "tensor", 0),
    "inference_all_reduce": (ALL_REDUCE, "tensor", 0),
    "all_reduce_coalesced": (ALL_REDUCE, "tensors", 0),
    "reduce": (REDUCE, "tensor", 0),
    "broadcast": (BROADCAST, "tensor", 0),
    "all_gather": (ALL_GATHER, "tensor_list", 0),
    "all_gather_into_tensor": (ALL_GATHER, "output_tensor", 0),
    "all_gather_coalesced": (ALL_GATHER, "output_tensors", 0),
    "reduce_scatter": (REDUCE_SCATTER, "input_list", 1),
    "reduce_scatter_tensor": (REDUCE_SCATTER, "input_tensor", 1),
    "all_to_all_single": (ALL_TO_ALL, "input", 1),
    "all_to_all": (ALL_TO_ALL, "input_tensor_list", 1),
}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [item for item in value or () if isinstance(item, torch.Tensor)]


def _counting(method: Callable, collective: str, argument: str, position: int, stats: CommStats) -> Callable:
    def counted(*args: Any, **kwargs: Any) -> Any:
        value = kwargs[argument] if argument in kwargs else args[position] if len(args) > position else None
        for tensor in _tensors(value):
            stats.record(tensor, collective)
        return method(*args, **kwargs)

    return counted


def count_deepspeed_communication(stats: CommStats) -> Callable[[], None]:
    """Record every collective of DeepSpeed's communication backend in ``stats`` until the returned function is called.

    Call after ``deepspeed.init_distributed``. The returned function puts the backend's own methods back.
    """
    from deepspeed.comm import comm  # noqa: PLC0415 - optional

    backend = comm.cdb
    if backend is None:
        raise RuntimeError("count_deepspeed_communication: DeepSpeed's distributed backend is not initialised yet.")
    replaced = []
    for name, (collective, argument, position) in COUNTED_METHODS.items():
        method = getattr(backend, name, None)
        if method is None:
            continue
        setattr(backend, name, _counting(method, collective, argument, position, stats))
        replaced.append(name)

    def restore() -> None:
        for name in replaced:
            delattr(backend, name)  # the instance attribute; the class's method shows through again

    return restore
