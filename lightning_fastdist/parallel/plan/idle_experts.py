"""Zero gradients for experts that sat idle in a step, so that every rank reduces the same gradients.

An expert no token of this rank reached gets no gradient, which differs between ranks, so FSDP2 would reduce-scatter
buffers of different sizes (gloo aborts). Adding to the layer's output a zero tied to the idle experts' parameters
gives each a zero gradient. Experts: a ``ModuleList``/``ModuleDict`` of 2+ same-class modules owning parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

EXPERT_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


class _ZeroGradientTie(torch.autograd.Function):
    """A scalar zero that depends on ``parameters``: in the backward, a zero gradient for each of them.

    Nothing is computed from the parameters' values (an idle expert's weights may hold anything).
    """

    @staticmethod
    def forward(ctx: Any, *parameters: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(p.shape, p.dtype, p.device) for p in parameters]
        return parameters[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes)


def expert_containers(unit: nn.Module, units: Sequence[nn.Module] = ()) -> list[nn.Module]:
    """The containers of experts inside ``unit``, leaving out the other ``units`` nested in it and lists whose
    modules are units themselves (a stack's layers)."""
    inside = {id(m) for m in unit.modules()}
    nested_units = [other for other in units if other is not unit and id(other) in inside]
    excluded = {id(m) for other in nested_units for m in other.modules()}
    found = []
    for module in unit.modules():
        if id(module) in excluded or not isinstance(module, EXPERT_CONTAINERS):
            continue
        children = list(module.children())
        if any(child in nested_units for child in children):
            continue
        owns_parameters = all(next(child.parameters(), None) is not None for child in children)
        if len(children) >= 2 and len({type(child) for child in children}) == 1 and owns_parameters:
            found.append(module)
    return found


class IdleExperts:
    """The expert containers inside a model's units, hooked to give their idle experts zero gradients.

    Build it before ``fully_shard``: the ties must run before FSDP's post-forward hook of a unit that calls its
    experts itself, while the parameters are still gathered.

    Args:
        units: the modules that become FSDP units, ``model`` among them.

    Attributes:
        group: the process group the ranks agree over on which experts were idle (a CPU group, gloo, keeps the flags
            on the host: no device sync); ``None``: the default group.
    """

    def __init__(self, model: nn.Module, units: Sequence[nn.Module]) -> None:
        parents = {id(child): parent for parent in model.modules() for child in parent.children()}
        self.group: dist.ProcessGroup | None = None
        self.trackers: list[_IdleExpertTracker] = []
        for unit in units:
            for container in expert_containers(unit, units):
                # A plain ModuleList/ModuleDict has no forward: its parent calls the experts.
                own_forward = type(container).forward is not nn.Module.forward
                caller = container if own_forward else parents[id(container)]
                self.trackers.append(_IdleExpertTracker(caller, list(container.children()), type(container).__name__))

    def describe(self) -> str:
        """``"2 SwitchTransformersExperts of 16 experts each"``: what was found, for a log line or an error."""
        counts: dict[str, set[int]] = {}
        for tracker in self.trackers:
            counts.setdefault(tracker.container_class, set()).add(len(tracker.experts))
        return ", ".join(
            f"{sum(t.container_class == name for t in self.trackers)} {name} of "
            f"{'/'.join(map(str, sorted(sizes)))} experts each"
            for name, sizes in counts.items()
        )

    def drop_gradients_of_experts_idle_everywhere(self) -> int:
        """Collective over :attr:`group`: drop the gradients of experts no rank called since the last
        call, as DDP's ``find_unused_parameters`` does, so AdamW's momentum and weight decay leave them alone.
        Returns how many experts that was."""
        experts = [expert for tracker in self.trackers for expert in tracker.experts]
        called = torch.tensor(
            [any(id(expert) in tracker.called_this_step for tracker in self.trackers) for expert in experts],
            dtype=torch.uint8,
        )
        dist.all_reduce(called, op=dist.ReduceOp.MAX, group=self.group)
        for tracker in self.trackers:
            tracker.called_this_step.clear()
        idle = [expert for expert, used in zip(experts, called.tolist()) if not used]
        for expert in idle:
            for parameter in expert.parameters():
                parameter.grad = None
        return len(idle)


class _IdleExpertTracker:
    """Records which experts ran during one forward of ``caller``, and ties the others to its output."""

    def __init__(self, caller: nn.Module, experts: list[nn.Module], container_class: str) -> None:
        self.caller = caller
        self.experts = experts
        self.container_class = container_class
        self.called: set[int] = set()  # during the caller's current forward
        self.called_this_step: set[int] = set()  # over every forward since the last optimizer step
        caller.register_forward_pre_hook(self._start)
        for expert in experts:
            expert.register_forward_pre_hook(self._mark_called)
        caller.register_forward_hook(self._tie_idle)

    def _start(self, module: nn.Module, args: Any) -> None:
        self.called = set()

    def _mark_called(self, expert: nn.Module, args: Any) -> None:
        self.called.add(id(expert))
        self.called_this_step.add(id(expert))

    def _tie_idle(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return None
        idle = [p for expert in self.experts if id(expert) not in self.called for p in expert.parameters()]
        idle = [p for p in idle if p.requires_grad]
        if not idle:
            return None
        leaves, spec = tree_flatten(output)
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad:
                leaves[index] = leaf + _ZeroGradientTie.apply(*idle).to(leaf.dtype)
                return tree_unflatten(leaves, spec)
        return None
