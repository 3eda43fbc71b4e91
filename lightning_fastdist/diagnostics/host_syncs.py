"""Count device-to-host synchronisations and say where each one came from.

A host sync is any point where Python waits for the accelerator: a value read (``.item()``, ``float()``,
``bool()``, ``.tolist()``), a value-sized op (``nonzero``), a blocking host/device copy, an explicit
``synchronize()``. With ``device="cuda"`` only tensors on a non-CPU device count. With ``device="cpu"`` every
tensor stands in for an accelerator one, except what torch keeps on the host in a GPU run too (unfused optimizers'
``step`` counters, ``torch.utils.data``'s reads, tensors made with the literal ``device="cpu"``). A callback may
enter the counter in one hook and leave it in a later one, and may set ``HostSyncCounter.label`` so that each recorded
event carries it. ``docs/sync-free.md`` shows its use.
"""

from __future__ import annotations

import collections
import os
import sys
import types
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE_KINDS = ("cpu", "cuda")

# Ops that return a Python value read from the tensor.
_VALUE_READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
}
# Ops whose output size depends on the values, so the host must wait to allocate it.
_VALUE_SIZED = {
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_dim.default,
    torch.ops.aten.unique_consecutive.default,
}
# Cross-device copies (blocking unless ``non_blocking=True``).
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim") + os.sep
_DATA_DIR = os.path.join(_TORCH_DIR, "utils", "data") + os.sep
_THIS_FILE = os.path.abspath(__file__)
# ``torch.tensor(..., device=...)`` with no device, or with the literal string "cpu", makes a tensor that stays
# on the host in a GPU run too (torch.optim spells its host-side step counters this way); a ``torch.device``
# object usually comes from the model or the strategy and stands for the accelerator.
_HOST_DEVICE_SPELLINGS = (None, "cpu")


@dataclass(frozen=True)
class HostSync:
    """One recorded device-to-host synchronisation.

    Attributes:
        op: what synchronised, e.g. ``"aten._local_scalar_dense"``, ``"Tensor.tolist"``, ``"torch.cuda.synchronize"``.
        origin: the innermost calling frame outside torch, as ``"path:line in function"``.
        stack: calling frames outside torch, innermost first.
        label: the counter's ``label`` when it happened.
    """

    op: str
    origin: str
    stack: tuple[str, ...]
    label: Hashable


def _short_path(path: str) -> str:
    marker = f"{os.sep}site-packages{os.sep}"
    return path.split(marker, 1)[1] if marker in path else path


def _caller_frames(depth: int) -> tuple[str, ...]:
    """Up to ``depth`` frames outside torch and this file, innermost first."""
    frames: list[str] = []
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and len(frames) < depth:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and os.path.abspath(path) != _THIS_FILE:
            frames.append(f"{_short_path(path)}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return tuple(frames) or ("<unknown>",)


def _inside_data_loading() -> bool:
    """True if torch.utils.data (samplers, collate, workers) is on the call stack: it runs on the host."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_DATA_DIR):
            return True
        frame = frame.f_back
    return False


def _is_host_side_optimizer_step(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` is a ``step`` counter that a torch.optim optimizer keeps on the host in GPU runs too."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_filename.startswith(_OPTIM_DIR) else None
        if isinstance(owner, torch.optim.Optimizer):
            for group in owner.param_groups:
                if group.get("fused") or group.get("capturable"):
                    continue
                for param in group["params"]:
                    if owner.state.get(param, {}).get("step") is tensor:
                        return True
        frame = frame.f_back
    return False


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _VALUE_READS or func in _VALUE_SIZED:
            if self.counter._counts_reads_of(args[0]):
                self.counter._record(str(func.overloadpacket).replace("aten::", "aten."))
        elif func in _COPIES and self.counter.device == "cuda":
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = args[0] if func is torch.ops.aten.copy_.default else result
            crosses = (source.device.type == "cpu") != (target.device.type == "cpu")
            if crosses and not kwargs.get("non_blocking", False) and not (len(args) > 2 and args[2]):
                self.counter._record(
                    f"{func.overloadpacket} {source.device.type}->{target.device.type}".replace("aten::", "aten.")
                )
        return result


class _FunctionCounter(TorchFunctionMode):
    """Python-level reads that never reach the dispatcher for CPU tensors (stand-in mode only)."""

    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist or func is torch.Tensor.numpy:
            if self.counter._counts_reads_of(args[0]):
                self.counter._record(f"Tensor.{func.__name__}")
        elif func is torch.tensor and kwargs.get("device") not in _HOST_DEVICE_SPELLINGS:
            self.counter._record("torch.tensor(device=...)")
        return func(*args, **kwargs)


class HostSyncCounter:
    """Context manager that records host syncs; made and documented by :func:`count_host_syncs`."""

    def __init__(self, device: str | None = None, stack_depth: int = 8) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in DEVICE_KINDS:
            raise ValueError(f"count_host_syncs: device must be one of {DEVICE_KINDS}, got {device!r}.")
        if stack_depth < 1:
            raise ValueError(f"count_host_syncs: stack_depth must be >= 1, got {stack_depth}.")
        self.device = device
        self.stack_depth = stack_depth
        self.label: Hashable = None
        self.events: list[HostSync] = []
        self._modes: list[Any] = []
        self._restore: list[tuple[Any, str, Any]] = []

    @property
    def count(self) -> int:
        """Number of host syncs recorded so far."""
        return len(self.events)

    def counts_by_label(self) -> collections.Counter:
        """Number of syncs per :attr:`label` value."""
        return collections.Counter(event.label for event in self.events)

    def counts_by_origin(self) -> collections.Counter:
        """Number of syncs per ``(op, origin)`` pair."""
        return collections.Counter((event.op, event.origin) for event in self.events)

    def report(self, top: int = 10) -> str:
        """A short table of the ``top`` most frequent sync sources."""
        rows = [f"{number:6d}  {op:32s} {origin}" for (op, origin), number in self.counts_by_origin().most_common(top)]
        return "\n".join([f"{self.count} host sync(s)", *rows])

    def reset(self) -> None:
        """Forget the events recorded so far."""
        self.events.clear()

    def _counts_reads_of(self, tensor: Any) -> bool:
        if not isinstance(tensor, torch.Tensor):
            return False
        if self.device == "cuda":
            return tensor.device.type != "cpu"
        return tensor.device.type == "cpu" and not _inside_data_loading() and not _is_host_side_optimizer_step(tensor)

    def _record(self, op: str) -> None:
        stack = _caller_frames(self.stack_depth)
        self.events.append(HostSync(op=op, origin=stack[0], stack=stack, label=self.label))

    def _count_calls(self, owner: Any, name: str, op: str) -> None:
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._record(op)
            return original(*args, **kwargs)

        self._restore.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self) -> HostSyncCounter:
        if self._modes:
            raise RuntimeError("count_host_syncs: this counter is already active; create a new one to nest.")
        if self.device == "cuda":
            self._count_calls(torch.cuda, "synchronize", "torch.cuda.synchronize")
            self._count_calls(torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize")
            self._count_calls(torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize")
        else:
            self._modes.append(_FunctionCounter(self))
        self._modes.append(_DispatchCounter(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc_info)
        self._modes.clear()
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()


def count_host_syncs(device: str | None = None, stack_depth: int = 8) -> HostSyncCounter:
    """Return a context manager that counts host syncs inside it and records where each came from.

    Args:
        device: ``"cuda"`` or ``"cpu"``: which reads count (the module docstring says which); ``None``: ``"cuda"`` if
            available, else ``"cpu"``.
        stack_depth: calling frames outside torch kept per event.

    Raises:
        ValueError: ``device`` is not ``"cpu"``, ``"cuda"`` or ``None``, or ``stack_depth < 1``.
    """
    return HostSyncCounter(device=device, stack_depth=stack_depth)
