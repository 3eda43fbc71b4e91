"""PowerSGD hook state in checkpoints: every rank's memories gathered on save, each rank's restored on load.

Error feedback differs per rank, so rank 0 alone cannot save it: :func:`gather_to_rank_zero`
collects all ranks' states into the checkpoint, and :func:`restore_hook_state` gives each rank
its own back (or, at a different world size, keeps the shared step count and ``Q`` factors and
restarts error feedback from zero).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_fastdist.parallel.comm_hooks import HookState
from lightning_fastdist.parallel.powersgd import PowerSGDState


def gather_to_rank_zero(state: dict, world_size: int, rank: int) -> list[dict] | None:
    """Every rank's ``state`` as a list on rank 0 (``None`` elsewhere); a collective on all ranks."""
    if not (dist.is_available() and dist.is_initialized()) or world_size == 1:
        return [state]
    gathered: list[dict] | None = [{} for _ in range(world_size)] if rank == 0 else None
    dist.gather_object(state, gathered, dst=0)
    return gathered


def restore_hook_state(
    hook_state: HookState | None, comm_hook: str, saved: dict, world_size: int, rank: int, device: torch.device
) -> None:
    """Load the part of a checkpoint's hook state that belongs to this rank into ``hook_state``.

    Args:
        hook_state: the registered hook's state.
        comm_hook: the strategy's ``comm_hook`` option (named in the warning when it ignores the state).
        saved: what the checkpoint holds: ``{"comm_hook": name, "per_rank": [state, ...]}``.
        world_size: ranks now.
        rank: this rank.
        device: where the restored tensors go.
    """
    if not isinstance(hook_state, PowerSGDState) or saved["comm_hook"] != "powersgd":
        rank_zero_warn(f"The checkpoint holds {saved['comm_hook']!r} hook state; comm_hook={comm_hook!r} ignores it.")
        return
    per_rank = saved["per_rank"]
    if len(per_rank) == world_size:
        hook_state.load_state_dict(per_rank[rank], device)
        return
    rank_zero_warn(
        f"PowerSGD state was saved by {len(per_rank)} ranks and is resumed by {world_size}: "
        "keeping the step count and Q factors, restarting error feedback from zero."
    )
    hook_state.load_state_dict({**per_rank[0], "errors": {}}, device)
