"""How close ``doctor --simulate`` is to real ranks, how it scales, and how long a 7B Llama at world 64 takes.

    python benchmarks/simulate.py                 # all three parts
    python benchmarks/simulate.py --skip-7b       # without the 7B part (about a minute)

1. Reality: TinyGPT and a HuggingFace Llama (tiny random config) at world 2, simulated and then
   trained for real on 2 gloo ranks, measured with the same tracker: per-rank state
   (parameters + gradients + optimizer) and peak, ddp / zero2 / zero3 x checkpointing none / full.
2. Scale: zero3's sharded state at world 64 against world 2 (ideally 1/32).
3. A 7B Llama config (32 layers, 4096 wide, sequence 4096, micro-batch 1, bf16-mixed) at world 64,
   8 GPUs per node: wall time and peak memory of this process, and the per-rank table.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support.harness, tests.support.model_zoo

from lightning_fastdist.planning.simulation.recipe_run import RecipeRun  # noqa: E402
from lightning_fastdist.planning.simulation.simulate import simulate  # noqa: E402
from tests.commands.test_doctor_simulate import LLAMA, MEASURED, TEXT, TINY_GPT, TOKENS, real_memory  # noqa: E402
from tests.support.harness import run_function  # noqa: E402

GiB = 2**30
LLAMA_7B = {
    "class_path": "tests.support.model_zoo.HFLlama",
    "init_args": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
    },
}  # fmt: skip
TOKENS_7B = {
    "class_path": "tests.support.model_zoo.RandomTokens",
    "init_args": {"vocab_size": 32000, "seq_len": 4096, "batch_size": 1, "samples": 1},
}


def reality() -> None:
    print("1. simulated vs real at world 2 (rank 0; bytes)")
    header = ("model", "setup", "AC", "state real", "simulated", "diff", "peak real", "simulated", "diff")
    print("   " + " ".join(f"{h:>11}" for h in header))
    for name, model, data in (("tinygpt", TINY_GPT, TEXT), ("hf-llama", LLAMA, TOKENS)):
        run = RecipeRun(model, data)
        rows = simulate(run, 2, 2, ("none", "full")).rows
        simulated = {(r.setup, r.activation_checkpointing): r.memory for r in rows if not r.cpu_offload}
        real = run_function(real_memory, 2, args=(run,), timeout=300)[0]
        for key in MEASURED:
            s, r = simulated[key], real[key]
            print(
                f"   {name:9} {key[0]:6} {key[1]:5} {r.state:11,} {s.state:11,} {s.state / r.state - 1:+7.2%} "
                f"{r.peak:11,} {s.peak:11,} {s.peak / r.peak - 1:+7.2%}"
            )


def scale() -> None:
    run = RecipeRun(TINY_GPT, TEXT)
    at = {
        world: next(r.memory for r in simulate(run, world, 8, ("none",)).rows if r.setup == "zero3")
        for world in (2, 64)
    }
    print("2. zero3 state per rank, world 64 / world 2 (ideal 1/32 = 0.03125)")
    for field in ("params", "grads", "optimizer"):
        ratio = getattr(at[64], field) / getattr(at[2], field)
        print(f"   {field:9} {getattr(at[2], field):10,} -> {getattr(at[64], field):8,} B   ratio {ratio:.5f}")


def llama_7b() -> None:
    run = RecipeRun(LLAMA_7B, TOKENS_7B, precision="bf16-mixed")
    start = time.perf_counter()
    simulation = simulate(run, 64, 8)
    seconds = time.perf_counter() - start
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(
        f"3. 7B Llama at world 64: {simulation.parameters:,} parameters, {seconds:.1f} s, "
        f"this process {peak_rss:.2f} GiB"
    )
    for row in simulation.rows:
        m = row.memory
        print(
            f"   {row.name:9} {row.activation_checkpointing:9} offload={'yes' if row.cpu_offload else 'no ':3} "
            f"state {m.state / GiB:7.2f} GiB  activations {m.activations_peak / GiB:6.2f} GiB  "
            f"peak {m.peak / GiB:7.2f} GiB"
        )
    for setup, checkpointing, reason in simulation.not_traced:
        print(f"   {setup:9} {checkpointing:9} not traced: {reason[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-7b", action="store_true", help="leave out the 7B Llama timing")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    reality()
    scale()
    if not args.skip_7b:
        llama_7b()


if __name__ == "__main__":
    main()
