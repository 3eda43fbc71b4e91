"""What DeepSpeed's ZeRO partitions, where it keeps it, and its communication buckets: checked once, when built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lightning_fastdist.parallel.deepspeed.runtime import MAX_AUTO_BUCKET, auto_bucket_size

STAGES = (1, 2, 3)
BucketSize = int | Literal["auto"]


@dataclass(frozen=True)
class DeepSpeedSettings:
    """How DeepSpeed's ZeRO shards a model; each bad value is refused in one ``ValueError`` naming the option.

    Args:
        stage: ``1`` partitions the optimizer state, ``2`` also the gradients, ``3`` also the parameters
            (gathered block by block for compute).
        offload_optimizer: keep the optimizer state and run its step in host memory (ZeRO-Offload); every stage.
        offload_parameters: keep the partitioned parameters in host memory (ZeRO-Infinity); stage 3 only.
        allgather_bucket_size: elements per all-gather of updated parameters (stages 1 and 2), or ``"auto"``:
            the trainable parameters, capped.
        reduce_bucket_size: elements per gradient reduction, or ``"auto"`` (the same rule).
    """

    stage: Literal[1, 2, 3] = 2
    offload_optimizer: bool = False
    offload_parameters: bool = False
    allgather_bucket_size: BucketSize = "auto"
    reduce_bucket_size: BucketSize = "auto"

    def __post_init__(self) -> None:
        if self.stage not in STAGES or isinstance(self.stage, bool):
            raise ValueError(f"stage: got {self.stage!r}; use 1, 2 or 3 (the ZeRO stage).")
        if self.offload_parameters and self.stage != 3:
            raise ValueError(
                f"offload_parameters: needs stage=3 (parameters are only partitioned at stage 3), got "
                f"stage={self.stage}; offload_optimizer works at every stage."
            )
        for option, value in self.buckets.items():
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{option}: got {value!r}; use 'auto' or a number of elements >= 1.")

    @property
    def buckets(self) -> dict[str, BucketSize]:
        """The bucket sizes by their name in DeepSpeed's ``zero_optimization`` config."""
        return {"allgather_bucket_size": self.allgather_bucket_size, "reduce_bucket_size": self.reduce_bucket_size}

    def bucket_sizes(self, model: torch.nn.Module | None = None) -> dict[str, int]:
        """The bucket sizes in elements, ``"auto"`` sized to ``model`` (to its cap, :data:`MAX_AUTO_BUCKET`, while
        there is no model yet)."""
        auto = MAX_AUTO_BUCKET if model is None else auto_bucket_size(model)
        return {option: auto if value == "auto" else value for option, value in self.buckets.items()}
