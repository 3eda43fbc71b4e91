"""What a Lightning user writes today for FSDP2, as the ``lightning-fsdp2`` baseline of ``bench`` runs it.

``ModelParallelStrategy`` shards nothing itself: the module calls ``fully_shard`` in ``configure_model``, each block
first, as Lightning's documentation shows. Nothing more (no mixed-precision policy, no prefetch tuning), so the
baseline row measures Lightning's strategy unchanged.
"""

from __future__ import annotations

from torch.distributed.fsdp import fully_shard

from lightning_fastdist.demo import TinyGPT


class HandShardedTinyGPT(TinyGPT):
    """The demo model with the ``configure_model`` a user writes for FSDP2 in Lightning."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)
