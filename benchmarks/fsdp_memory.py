"""Memory of DDP vs FSDP ZeRO-2 vs ZeRO-3, and the cost of activation checkpointing, on TinyGPT (CPU, gloo).

Part 1 (2 processes): per-rank bytes of parameters + gradients + AdamW state
after one step, and the bytes a forward pass leaves alive (activations plus,
under ZeRO-2, the gathered parameters kept for backward), per sharding mode.

Part 2 (1 process): activation bytes left alive by the forward pass, and the
fastest forward+backward time (modes interleaved), for no / selective / full checkpointing.

    python benchmarks/fsdp_memory.py
"""

from __future__ import annotations

import copy
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lightning_fastdist.demo import Block, TinyGPT
from lightning_fastdist.parallel.fsdp.sharding import FSDPSharding
from lightning_fastdist.parallel.plan.activation_checkpointing import apply_activation_checkpointing
from lightning_fastdist.planning.activation_memory import ActivationMemory

SIZES = {  # name: TinyGPT options
    "small": dict(n_layer=4, n_embd=128, n_head=4, block_size=128),
    "medium": dict(n_layer=6, n_embd=256, n_head=8, block_size=128),
    "large": dict(n_layer=8, n_embd=384, n_head=8, block_size=128),
}
BATCH = 8
TIMING_REPEATS = 5
MiB = 2**20


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(_local_bytes(t) for t in params + [p.grad for p in params if p.grad is not None] + states)


def _one_rank(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    inputs = torch.randint(0, 256, (BATCH, 128), generator=torch.Generator().manual_seed(rank))
    for size, options in SIZES.items():
        for mode in ("ddp", "zero2", "zero3"):
            torch.manual_seed(0)
            model = TinyGPT(**options)
            if mode == "ddp":
                wrapped = DistributedDataParallel(model)
            else:
                sharding = FSDPSharding(mode)
                sharding.shard(model, sharding.mesh("cpu", 2), [Block])
                wrapped = model
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            wrapped(inputs).logsumexp(-1).mean().backward()
            optimizer.step()
            with ActivationMemory() as memory:
                loss = wrapped(inputs).logsumexp(-1).mean()
            held_after_forward = memory.live_bytes()
            loss.backward()
            if rank == 0:
                results[(size, mode)] = (_state_bytes(model, optimizer), held_after_forward)
            dist.barrier()
    dist.destroy_process_group()


def sharding_table() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_one_rank, args=(port, results), nprocs=2)
        results = dict(results)
    print(
        "Per-rank bytes, 2 ranks (MiB): params+grads+AdamW state | alive after forward (activations + gathered params)"
    )
    print(f"{'size':8} {'params':>8} | {'ddp':>15} {'zero2':>15} {'zero3':>15}")
    for size, options in SIZES.items():
        count = TinyGPT(**options).num_parameters()
        cells = [
            f"{results[(size, m)][0] / MiB:6.2f} | {results[(size, m)][1] / MiB:6.2f}"
            for m in ("ddp", "zero2", "zero3")
        ]
        print(f"{size:8} {count / 1e6:7.2f}M | " + " ".join(f"{c:>15}" for c in cells))


def _step_seconds(model: torch.nn.Module, inputs: torch.Tensor) -> float:
    started = time.perf_counter()
    model(inputs).logsumexp(-1).mean().backward()
    return time.perf_counter() - started


def checkpointing_table() -> None:
    print(f"\nActivation checkpointing, 1 process, batch {BATCH} x 128 tokens: activation MiB, fastest fwd+bwd seconds")
    print(f"{'size':8} {'mode':10} {'act MiB':>8} {'vs none':>8} {'step s':>8} {'vs none':>8}")
    inputs = torch.randint(0, 256, (BATCH, 128), generator=torch.Generator().manual_seed(0))
    modes = ("none", "selective", "full")
    for size, options in SIZES.items():
        torch.manual_seed(0)
        base = TinyGPT(**options)
        models, held = {}, {}
        for mode in modes:
            models[mode] = copy.deepcopy(base)
            apply_activation_checkpointing(models[mode], mode, [Block])
            with ActivationMemory() as memory:
                loss = models[mode](inputs).logsumexp(-1).mean()
            held[mode] = memory.live_bytes()
            loss.backward()  # also the warm-up step
        # Interleave the modes and keep each one's fastest step: a shared CPU only ever adds time.
        times = {mode: [] for mode in modes}
        for _ in range(TIMING_REPEATS):
            for mode in modes:
                times[mode].append(_step_seconds(models[mode], inputs))
        for mode in modes:
            memory_change = held[mode] / held["none"] - 1
            time_change = min(times[mode]) / min(times["none"]) - 1
            print(
                f"{size:8} {mode:10} {held[mode] / MiB:8.2f} {memory_change:+8.0%} "
                f"{min(times[mode]):8.3f} {time_change:+8.0%}"
            )


if __name__ == "__main__":
    sharding_table()
    checkpointing_table()
    sys.exit(0)
