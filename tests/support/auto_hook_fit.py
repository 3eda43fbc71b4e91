"""Train TinyGPT under ``FastDDPStrategy()``'s default ``comm_hook="auto"`` and print what it decided (rank 0, JSON).

Run once per node of an emulated cluster (tests/ddp/test_auto_comm_hook.py): ``python -m tests.support.auto_hook_fit
--nodes 2 --steps 14 --window 3 --root DIR [--resume]``; the checkpoint goes to DIR/last.ckpt.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fastdist import FastDDPStrategy
from tests.support.workloads import LossRecorder, make_trainer, repeated_batches, tiny_gpt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--window", type=int, required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    losses = LossRecorder()
    checkpoint = ModelCheckpoint(dirpath=args.root, save_last=True, save_top_k=0)
    trainer = make_trainer(
        # rank 4: tiny_gpt's 32-wide matrices would not compress at the default rank, and auto would stay at bf16
        FastDDPStrategy(comm_hook_window=args.window, powersgd_rank=4), devices=args.devices, num_nodes=args.nodes,
        max_steps=args.steps, callbacks=[losses, checkpoint], enable_checkpointing=True, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(tiny_gpt(), repeated_batches(), ckpt_path=str(args.root / "last.ckpt") if args.resume else None)
    state = trainer.strategy.hook_state
    if trainer.global_rank == 0:
        report = {
            "level": state.level,
            "decisions": [[d.step, d.level_from, d.level_to, d.exposed_share] for d in state.decisions],
            "metric": float(trainer.callback_metrics["comm/hook_level"]),
            "losses": losses.losses,
        }
        print("AUTO", json.dumps(report))


if __name__ == "__main__":
    main()
