"""Regional (per-block) vs whole-model torch.compile with inductor on CPU: compile time and step time.

Each setup runs in a fresh process, so compile time is real: the first
training step's time minus an eager step's time. Step time is the median of
the following steps. Compile time is measured twice:
- cold: an empty inductor cache, so every C++ kernel is built with gcc;
- warm kernels: a second process on the same cache with the graph caches off,
  so tracing, partitioning and lowering are redone but identical kernels are
  reused, as in a re-run of a job whose graphs changed.
On CPU the cold figure is dominated by gcc building a fixed set of kernels
(identical blocks give identical kernels, built once either way); the
graph-size-dependent part is what the warm figure shows.

    python benchmarks/compile.py [--layers 8] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SETUPS = ("eager", "blocks", "model")


def measure(setup: str, layers: int, steps: int) -> dict:
    import torch

    from lightning_fastdist.demo import Block, TinyGPT
    from lightning_fastdist.parallel.compile import apply_compile

    torch.manual_seed(0)
    model = TinyGPT(n_layer=layers)
    if setup != "eager":
        apply_compile(model, {"backend": "inductor"}, setup, [Block])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps + 1):
        tokens = torch.randint(0, 256, (8, 129), generator=generator)
        start = time.perf_counter()
        TinyGPT._loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return {"first": times[0], "step": statistics.median(times[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--child", choices=SETUPS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.layers, args.steps)))
        return
    def run(setup: str, cache: str) -> dict:
        command = [sys.executable, __file__, "--child", setup, "--layers", str(args.layers), "--steps", str(args.steps)]
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": cache,
            "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
            "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
        }
        output = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
        return json.loads(output.stdout.strip().splitlines()[-1])

    results, warm = {}, {}
    for setup in SETUPS:
        with tempfile.TemporaryDirectory(prefix="inductor-cache-") as cache:
            results[setup] = run(setup, cache)
            if setup != "eager":
                warm[setup] = run(setup, cache)
    eager_step = results["eager"]["step"]
    cold_compile = {s: results[s]["first"] - eager_step for s in warm}
    warm_compile = {s: warm[s]["first"] - eager_step for s in warm}
    print(f"TinyGPT n_layer={args.layers}, batch 8 x 128 tokens, inductor on CPU")
    print(f"{'setup':8} {'cold compile s':>15} {'warm-kernel compile s':>22} {'step ms':>8} {'vs eager':>9}")
    for setup in SETUPS:
        cold = f"{cold_compile[setup]:>15.1f}" if setup in warm else f"{'-':>15}"
        hot = f"{warm_compile[setup]:>22.1f}" if setup in warm else f"{'-':>22}"
        step = results[setup]["step"]
        print(f"{setup:8} {cold} {hot} {1000 * step:>8.1f} {step / eager_step:>9.2f}")
    print(
        f"whole-model / per-block compile time: cold {cold_compile['model'] / cold_compile['blocks']:.1f}x, "
        f"warm kernels {warm_compile['model'] / warm_compile['blocks']:.1f}x"
    )


if __name__ == "__main__":
    main()
