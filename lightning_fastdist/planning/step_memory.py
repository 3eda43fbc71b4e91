"""Measure one training step's memory on one rank, with real tensors or fake ones (shapes, no memory).

torch's memory tracker (``MemTracker``, or ``FSDPMemTracker`` for an FSDP2 model) attributes every tensor to
parameters, gradients, optimizer state, gathered parameters or activations; under :func:`fake_world` and
``FakeTensorMode`` the same measurement simulates rank 0 of a world of N. The trackers are private torch APIs.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_fastdist.parallel.fsdp.local_shards import local_part

# Tracker categories (the values of torch's _MemRefType and _FSDPRefType) that are model state or gathered weights;
# every other category at the peak (activations, temporaries, inputs, unsharded gradients) counts as activations.
STATE_CATEGORIES = ("Parameter", "Buffer", "Gradient", "Optstate", "OptState", "Sharded Param", "Sharded Grad")
GATHERED_CATEGORIES = ("Unsharded Param", "All Gather")
TOTAL = "Total"


@dataclass(frozen=True)
class StepMemory:
    """Bytes one rank holds during a training step.

    Attributes:
        params: this rank's parameters (its shards under FSDP).
        grads: after the backward (DDP's buckets, FSDP's sharded gradients).
        gathered_peak: parameters gathered for compute (FSDP's unsharded weights and all-gather buffers) at the peak.
        activations_peak: everything else alive at the peak: activations saved for backward, temporaries, inputs,
            unsharded gradients.
        peak: the most bytes alive at once during the step.
    """

    params: int
    grads: int
    optimizer: int
    gathered_peak: int
    activations_peak: int
    peak: int

    @property
    def state(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optimizer


def tracing_unavailable() -> str | None:
    """``None`` when this torch has what a simulation needs, else one line saying what is missing."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401, PLC0415
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: F401, PLC0415
        from torch.distributed._tools.mem_tracker import MemTracker  # noqa: F401, PLC0415
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401, PLC0415
    except ImportError as error:
        return f"torch {torch.__version__} lacks the memory tracker or fake process group ({error})"
    return None


def join_fake_world(world_size: int) -> None:
    """Make this process rank 0 of a fake process group of ``world_size`` ranks (collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415 - private torch API

    if dist.is_initialized():
        raise RuntimeError("fake world: a process group is already initialised in this process.")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


@contextmanager
def fake_world(world_size: int) -> Generator[None, None, None]:
    """:func:`join_fake_world` for the duration of a ``with`` block."""
    join_fake_world(world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def to_empty_keeping_ties(module: nn.Module, device: str | torch.device) -> None:
    """``module.to_empty(device=device)`` that keeps shared (tied) parameters shared.

    Under ``FakeTensorMode``, ``Module.to_empty`` gives every module a new ``Parameter``, so a tied embedding and head
    would become two weights (counted, and optimized, twice). FSDP2 modules have their own ``to_empty``, keeping ties.
    """
    replaced: dict[int, torch.Tensor] = {}
    for submodule in module.modules():
        for name, parameter in submodule._parameters.items():
            if parameter is not None:
                if id(parameter) not in replaced:
                    empty = torch.empty_like(parameter, device=device)
                    replaced[id(parameter)] = nn.Parameter(empty, requires_grad=parameter.requires_grad)
                submodule._parameters[name] = replaced[id(parameter)]
        for name, buffer in submodule._buffers.items():
            if buffer is not None:
                if id(buffer) not in replaced:
                    replaced[id(buffer)] = torch.empty_like(buffer, device=device)
                submodule._buffers[name] = replaced[id(buffer)]


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local shard)."""
    storages = {}
    for tensor in tensors:
        storage = local_part(tensor).untyped_storage()
        storages[storage._cdata] = storage.nbytes()  # one entry per storage: tied weights count once
    return sum(storages.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in ``optimizer``'s state (AdamW's moments and step counters, ...)."""
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def _peak_only(tracker_class: type) -> type:
    """``tracker_class`` keeping only the peak of the whole rank (the per-module peaks are not read here).

    torch's trackers update every active module's peak after every op, most of a large model's simulation time. The
    override keeps the rank's peak and its categories as ``MemTracker._update_peak_stats`` does, and lets device
    queries (``prim.device``, which allocate nothing) pass untracked.
    """

    class PeakOnly(tracker_class):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.prim.device.default:  # a device query: tens of thousands a step, no memory
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot[TOTAL]:
                    self._peak_mem[device] = snapshot[TOTAL]
                    self._peak_mem_snap[device] = dict(snapshot)

    return PeakOnly


def _tracker(model: nn.Module, optimizer: torch.optim.Optimizer | None, inputs: tuple):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: PLC0415 - private torch API
    from torch.distributed._tools.mem_tracker import MemTracker  # noqa: PLC0415
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    if isinstance(model, FSDPModule):
        tracker = _peak_only(FSDPMemTracker)(model, optimizer)
        tracker.track_inputs(inputs)
        return tracker
    tracker = _peak_only(MemTracker)()
    optimizers = [optimizer] if optimizer is not None else []
    tracker.track_external(model, *optimizers, *[t for t in inputs if isinstance(t, torch.Tensor)])
    return tracker


def measure_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    forward_backward: Callable[[], object],
    inputs: tuple = (),
    keep_gradients: bool = False,
    warm_up_on_zero_gradients: bool = False,
) -> StepMemory:
    """Create the optimizer state with a first step, then measure a second: its peak, and this rank's state after it.

    Args:
        model: the model as trained (an FSDP2 root, a DDP wrapper or a plain module).
        optimizer: ``None``: measure one forward and backward alone (when another optimizer will run, as DeepSpeed's
            does).
        inputs: the batch's tensors, tracked as inputs.
        keep_gradients: gradients stay allocated between steps (DDP's live in its buckets, which ``zero_grad`` does
            not free).
        warm_up_on_zero_gradients: create the optimizer state with a step on zero gradients instead of a forward and
            backward (half a simulation's time; not for a real DDP, whose gradients must be its bucket views).
    """
    if optimizer is not None:
        if warm_up_on_zero_gradients:
            for parameter in model.parameters():
                if parameter.requires_grad:
                    parameter.grad = torch.zeros_like(parameter)
        else:
            forward_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=not keep_gradients)
    tracker = _tracker(model, optimizer, inputs)
    with tracker:
        forward_backward()
        grads = tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
        if optimizer is not None:
            optimizer.step()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=not keep_gradients)
    (by_category,) = tracker.get_tracker_snapshot("peak").values()
    peak = {getattr(category, "value", category): nbytes for category, nbytes in by_category.items()}
    gathered = sum(peak.get(category, 0) for category in GATHERED_CATEGORIES)
    state_at_peak = sum(peak.get(category, 0) for category in STATE_CATEGORIES)
    return StepMemory(
        params=tensor_bytes(model.parameters()),
        grads=grads,
        optimizer=tensor_bytes(optimizer_state_tensors(optimizer)) if optimizer is not None else 0,
        gathered_peak=gathered,
        activations_peak=peak[TOTAL] - state_at_peak - gathered,
        peak=peak[TOTAL],
    )
