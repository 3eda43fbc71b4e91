"""Modules that keep their parameters in float32 under FSDP's mixed precision.

Under ``bf16-mixed`` FSDP reduce-scatters one buffer of one dtype per unit, and a module that casts itself to float32
(SwitchTransformers' router) hands it gradients of two dtypes: ``keep_fp32`` makes such a class a unit of its own, and
an unnamed one is refused at the first forward (``docs/models.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

# Parameters and gradients in the parameters' own dtype; inputs left as they come (the module casts them).
OWN_DTYPE_POLICY = MixedPrecisionPolicy(cast_forward_inputs=False)


class ParameterDtypeChangedError(ValueError):
    """A module changed its parameters' dtype inside an FSDP unit that computes in another dtype."""


def refuse_dtype_changes(unit: nn.Module, units: Sequence[nn.Module], compute_dtype: torch.dtype) -> None:
    """At ``unit``'s first forward, raise :class:`ParameterDtypeChangedError` if one of its own parameters (not
    those of the other ``units`` inside it) is no longer in ``compute_dtype``; the check then removes itself.

    Register before ``fully_shard``: the hook must see the gathered parameters, before FSDP reshards them.
    """
    named = dict(unit.named_modules())
    unit_class = type(unit).__name__  # fully_shard renames the class (FSDP<name>)
    inside = {id(module) for module in named.values()}
    nested = {id(m) for other in units if other is not unit and id(other) in inside for m in other.modules()}
    own = [(name, module) for name, module in named.items() if id(module) not in nested]

    def check(module: nn.Module, args: Any, output: Any) -> None:
        handle.remove()
        for name, owner in own:
            changed = [
                p
                for p in owner.parameters(recurse=False)
                # A sharded parameter (a DTensor) is FSDP's own fp32 copy: the forward already resharded it
                # (manual optimization steps inside training_step, which runs in the root's forward).
                if p.is_floating_point() and p.dtype != compute_dtype and not isinstance(p, DTensor)
            ]
            if changed:
                # A torch layer (the Linear a router casts) is named by the module around it, which does the cast.
                caster = name.rpartition(".")[0] if type(owner).__module__.startswith("torch.nn") and name else name
                raise ParameterDtypeChangedError(
                    f"keep_fp32: '{name}' in {unit_class} turned its parameters into {changed[0].dtype} "
                    f"during the forward, where mixed precision gathers them in {compute_dtype}; name the class "
                    f"that does it, e.g. keep_fp32: ['{type(named[caster]).__name__}'], to make it a unit of its "
                    "own in its own dtype."
                )

    handle = unit.register_forward_hook(check)
