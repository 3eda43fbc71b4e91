"""Train TinyGPT 3 steps under FastFSDPStrategy zero3, then hsdp, on 2 nodes x 2 ranks (run once per node of an
emulated cluster by tests). Local rank 0 of each node prints JSON: per sharding, the bytes its node's NIC sent
(the node's own ``eth0``), and on global rank 0 the losses and the bytes each collective counted."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_fastdist import FastFSDPStrategy
from tests.support.workloads import LossRecorder, make_trainer, repeated_batches, tiny_gpt

NIC_SENT = Path("/sys/class/net/eth0/statistics/tx_bytes")  # inside the node's network namespace


def main() -> None:
    report = {}
    for sharding in ("zero3", "hsdp"):
        losses = LossRecorder()
        strategy = FastFSDPStrategy(sharding=sharding)
        trainer = make_trainer(strategy, devices=2, num_nodes=2, max_steps=3, callbacks=[losses])
        sent_before = int(NIC_SENT.read_text())
        trainer.fit(tiny_gpt(), repeated_batches())
        traffic = {name: t.bytes for name, t in strategy.comm_stats.last_step.items()}
        report[sharding] = {"losses": losses.losses, "bytes": traffic, "sent": int(NIC_SENT.read_text()) - sent_before}
    if trainer.local_rank == 0:
        print("FIT", json.dumps(report))


if __name__ == "__main__":
    main()
