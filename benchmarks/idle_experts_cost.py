"""What giving idle experts zero gradients costs a mixture of experts (parallel/plan/idle_experts.py).

One process, the model matrix's SwitchTransformers (16 experts per sparse layer), a forward and backward per
step: with the hooks of ``IdleExperts`` (expert calls recorded, idle experts tied to their layer's output) and
without, alternating rounds, median milliseconds per step; then the per-step all-reduce of which experts ran,
on a one-rank gloo group (on more ranks it is one more small message). Prints the numbers.

    python benchmarks/idle_experts_cost.py --rounds 6 --steps 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support.model_zoo

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_fastdist.parallel.plan.blocks import block_modules, find_blocks  # noqa: E402
from lightning_fastdist.parallel.plan.idle_experts import IdleExperts  # noqa: E402
from tests.support.model_zoo import MODELS  # noqa: E402


def step_ms(model: torch.nn.Module, batch: dict, steps: int) -> float:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model.model(**batch).loss.backward()
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    plain, hooked = MODELS["switch"](), MODELS["switch"]()
    experts = IdleExperts(hooked, [*block_modules(hooked, find_blocks(hooked)), hooked])
    batch = next(iter(plain.batches()))
    step_ms(plain, batch, 3), step_ms(hooked, batch, 3)  # warm-up
    without, with_hooks = [], []
    for _ in range(args.rounds):
        without.append(step_ms(plain, batch, args.steps))
        with_hooks.append(step_ms(hooked, batch, args.steps))
    drops = []
    for _ in range(args.steps):
        hooked.model(**batch).loss.backward()
        started = time.perf_counter()
        experts.drop_gradients_of_experts_idle_everywhere()
        drops.append(1000 * (time.perf_counter() - started))
    base, hooks = statistics.median(without), statistics.median(with_hooks)
    print(f"SwitchTransformers ({experts.describe()}), forward + backward per step, median of {args.rounds} rounds:")
    print(f"  without hooks {base:.2f} ms, with IdleExperts {hooks:.2f} ms: {hooks / base:.3f}x")
    print(f"  agreeing on idle experts after the step's backward: {statistics.median(drops):.3f} ms (1 rank)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
