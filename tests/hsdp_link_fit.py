"""Train TinyGPT 3 steps under FastFSDPStrategy (``--sharding``) on 2 nodes x 2 ranks; rank 0 prints JSON: the
losses and the bytes each collective counted (run once per node of an emulated cluster by tests)."""

from __future__ import annotations

import json
import sys

from lightning_fastdist import FastFSDPStrategy
from tests.workloads import LossRecorder, make_trainer, repeated_batches, tiny_gpt


def main(sharding: str) -> None:
    losses = LossRecorder()
    strategy = FastFSDPStrategy(sharding=sharding)
    trainer = make_trainer(strategy, devices=2, num_nodes=2, max_steps=3, callbacks=[losses])
    trainer.fit(tiny_gpt(), repeated_batches())
    if trainer.global_rank == 0:
        traffic = {name: t.bytes for name, t in strategy.comm_stats.last_step.items()}
        print("FIT", json.dumps({"losses": losses.losses, "bytes": traffic}))


if __name__ == "__main__":
    main(sys.argv[1])
