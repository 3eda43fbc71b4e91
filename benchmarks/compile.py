"""Regional (per-block) vs whole-model torch.compile with inductor on CPU: compile time and step time.

Each setup runs in a fresh process. Before the model, the process compiles a
one-line function: that is inductor's start-up (imports, probing the CPU's
vector ISA with gcc, building its C++ headers), about 6 s cold on this machine,
paid once by any job that compiles anything, whatever the scope. It is
printed on its own. The model's compile time is its first training step's
time minus an eager step's time; step time is the median of the following
steps. Compile time is measured twice:
- cold: an empty inductor cache, so every C++ kernel of the model is built;
- warm kernels: a second process on the same cache with the graph caches off,
  so tracing, partitioning and lowering are redone but identical kernels are
  reused, as in a re-run of a job whose graphs changed.
Identical blocks give identical kernels, built once in either scope; what
grows with depth is whole-model tracing and lowering.

    python benchmarks/compile.py [--layers 8 16 24] [--steps 20]
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


def start_inductor() -> float:
    """Compile and run a one-line function forward and backward; return the seconds it took."""
    import torch

    start = time.perf_counter()
    tiny = torch.compile(lambda x: (x + 1).sum(), backend="inductor")
    tiny(torch.ones(4, requires_grad=True)).backward()
    return time.perf_counter() - start


def measure(setup: str, layers: int, steps: int) -> dict:
    import torch

    from lightning_fastdist.demo import Block, TinyGPT
    from lightning_fastdist.parallel.plan.compile import apply_compile

    start_up = start_inductor() if setup != "eager" else 0.0
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
    return {"start_up": start_up, "first": times[0], "step": statistics.median(times[1:])}


def run_child(setup: str, layers: int, steps: int, cache: str) -> dict:
    """Measure one setup in a fresh process whose inductor cache is ``cache``."""
    command = [sys.executable, __file__, "--child", setup, "--layers", str(layers), "--steps", str(steps)]
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": cache,
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
    }
    output = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(output.stdout.strip().splitlines()[-1])


def report_depth(layers: int, steps: int) -> None:
    """Run eager, per-block and whole-model compile at one depth (cold, then warm kernels) and print a table."""
    cold, warm = {}, {}
    for setup in SETUPS:
        with tempfile.TemporaryDirectory(prefix="inductor-cache-") as cache:
            cold[setup] = run_child(setup, layers, steps, cache)
            if setup != "eager":
                warm[setup] = run_child(setup, layers, steps, cache)
    eager_step = cold["eager"]["step"]
    cold_compile = {s: cold[s]["first"] - eager_step for s in warm}
    warm_compile = {s: warm[s]["first"] - eager_step for s in warm}
    print(f"\nTinyGPT n_layer={layers}, batch 8 x 128 tokens, inductor on CPU")
    print(
        f"{'setup':8} {'start-up s':>11} {'cold compile s':>15} {'warm-kernel compile s':>22} "
        f"{'step ms':>8} {'vs eager':>9}"
    )
    for setup in SETUPS:
        compiled = setup in warm
        start_up = f"{cold[setup]['start_up']:>11.1f}" if compiled else f"{'-':>11}"
        cold_s = f"{cold_compile[setup]:>15.1f}" if compiled else f"{'-':>15}"
        warm_s = f"{warm_compile[setup]:>22.1f}" if compiled else f"{'-':>22}"
        step = cold[setup]["step"]
        print(f"{setup:8} {start_up} {cold_s} {warm_s} {1000 * step:>8.1f} {step / eager_step:>9.2f}")
    with_start_up = {s: cold_compile[s] + cold[s]["start_up"] for s in warm}
    print(
        f"whole-model / per-block compile time: cold {cold_compile['model'] / cold_compile['blocks']:.1f}x, "
        f"warm kernels {warm_compile['model'] / warm_compile['blocks']:.1f}x, "
        f"cold with start-up {with_start_up['model'] / with_start_up['blocks']:.1f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 24], help="model depths to measure")
    parser.add_argument("--steps", type=int, default=20, help="steady steps after the first (compiling) one")
    parser.add_argument("--child", choices=SETUPS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.layers[0], args.steps)))
        return
    for layers in args.layers:
        report_depth(layers, args.steps)


if __name__ == "__main__":
    main()
