"""One prepared run for a lent GPU: bench's single-GPU rows, a sweep of the levers of a fast step, the best profiled.

    bash benchmarks/gpu_bench.sh [--out DIR] [--budget-s S] [--levers a,b] [--best JSON]   # on the GPU machine
    python benchmarks/gpu_bench.py --device cpu                                           # the plumbing, tiny shape

1. Rows (``lightning-fastdist bench``'s, one GPU, one recipe, the same global batch): ``lightning-ddp``
   (Lightning's DDPStrategy in Lightning's bf16-mixed), ``fast-default`` (``FastDDPStrategy()`` +
   ``FastMixedPrecision("bf16-mixed")``), ``recipe`` (the ``single_node`` recipe: our best single-GPU form) and
   ``hand-loop`` (the same model, data and optimizer in a plain loop, compiled whole).
2. Levers, each switched from the best setting so far, on the ``recipe`` row, kept when it is faster by more than
   ``KEEP_MARGIN``: micro-batch (accumulation keeping the global batch), whole-model vs per-block compile, the loss
   path, fused AdamW, the SDPA kernel, fp8, CUDA graphs (on the hand-written loop: our strategies refuse them),
   fp8 at a 2048-wide shape, and inductor's max-autotune last (the slowest to compile).
3. The best setting again, with ``bench --profile``'s torch.profiler record of two steps.

Every run is a fresh process (bench's own); inductor's cache is shared between them, so a graph compiled once is
reused. ``<out>/gpu_bench.json`` and ``gpu_bench.png`` are rewritten after every run, so a run cut short still returns
what it found; ``recipe_best.yaml`` is the recipe the best setting trains, ``best.trace.json.gz`` and
``best.ops.txt`` the profile, ``gpu_bench.log`` the runs' outputs (a failed run's in full). docs/gpu.md says more.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from lightning_fastdist.commands.bench.command import parse_args as bench_arguments
from lightning_fastdist.commands.bench.rows import throughput
from lightning_fastdist.commands.bench.setup_run import run_setup
from lightning_fastdist.commands.bench.setups import all_setups, recipe_setup
from lightning_fastdist.commands.bench.step_profile import PROFILE_STEPS
from lightning_fastdist.commands.written_marks import claim_folder
from lightning_fastdist.recipes.recipe import MIXED_PRECISION_PLUGIN, Recipe

ROWS = ("lightning-ddp", "fast-default", "recipe", "hand-loop")
KEEP_MARGIN = 0.02  # a lever is kept when the row is this much faster: less is within a run's noise
MFU_NOTE = "MFU: 6N + 12 L H Q T FLOPs per token over the device's dense bf16 peak (docs/bench.md)"


@dataclass(frozen=True)
class Shape:
    """The model and batch of a run: the global batch is ``micro_batch x accumulation`` sequences of ``block``."""

    n_layer: int
    n_head: int
    n_embd: int
    block: int
    vocab: int
    micro_batch: int
    accumulation: int
    workers: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation


SHAPES = {
    # GPT-2 small (124M): the yardstick; 64 x 1024 = 65,536 tokens per optimizer step.
    "gpt2-small": Shape(12, 12, 768, 1024, 50304, micro_batch=16, accumulation=4, workers=4),
    # 2048 wide (a 1B model's layers, 4 of them): where fp8 should pay.
    "wide": Shape(4, 16, 2048, 1024, 50304, micro_batch=16, accumulation=4, workers=4),
    "tiny": Shape(2, 2, 32, 32, 256, micro_batch=4, accumulation=4, workers=0),
    "tiny-wide": Shape(1, 2, 272, 32, 256, micro_batch=4, accumulation=4, workers=0),
}


@dataclass(frozen=True)
class Setting:
    """The levers of the ``recipe`` row (their defaults: the ``single_node`` recipe as it is)."""

    micro_batch: int | None = None  # None: the shape's
    compile_scope: str = "blocks"
    loss_path: str = "full"
    fuse_optimizers: bool | str = True
    attention: str = "auto"
    fp8: str | None = None
    compile_mode: str = "default"


@dataclass(frozen=True)
class Lever:
    """A lever: the ``Setting`` field it switches, the values tried, and whether it needs CUDA (why, if so)."""

    name: str
    values: tuple
    cuda_only: str = ""
    setting_name: str = ""  # the Setting field it switches, when not its own name

    @property
    def setting_field(self) -> str:
        return self.setting_name or self.name


LEVERS = (
    Lever("micro_batch", ("x2", "x4")),  # twice and four times the shape's micro-batch, accumulation divided
    Lever("compile_scope", ("model",)),
    Lever("loss_path", ("chunked",)),
    Lever("fuse_optimizers", ("always",)),
    Lever("attention", ("cudnn", "flash"), "the SDPA kernels compared are CUDA's"),
    Lever("fp8", ("tensorwise",)),
    Lever("cuda_graphs", ("reduce-overhead",), "CUDA graphs are a GPU feature"),
    Lever("fp8_wide", ("tensorwise",), "fp8 at the wide shape: a GPU of compute capability 8.9+", setting_name="fp8"),
    Lever("compile_mode", ("max-autotune-no-cudagraphs",), "inductor's autotuning times GPU kernels"),
)


@dataclass
class Context:
    """What every run of one gpu_bench invocation shares: where, at which shape, how long, and the report so far."""

    device: str
    shape: Shape
    steps: int
    warmup_steps: int
    work: Path
    out: Path
    deadline: float
    run_limit_s: float
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()


def recipe_for(setting: Setting, shape: Shape, device: str) -> dict:
    """The ``single_node`` recipe at ``shape`` on one ``device``, with ``setting``'s levers."""
    config = copy.deepcopy(Recipe.read("single_node").config)
    micro_batch = setting.micro_batch or shape.micro_batch
    trainer = config["trainer"]
    trainer.update(accelerator="gpu" if device == "cuda" else "cpu", devices=1,
                   accumulate_grad_batches=shape.global_batch // micro_batch)  # fmt: skip
    compile_options: dict[str, Any] = {} if device == "cuda" else {"backend": "eager"}  # inductor: ~15 s a graph on CPU
    if setting.compile_mode != "default":
        compile_options["mode"] = setting.compile_mode
    trainer["strategy"]["init_args"].update(compile=compile_options or True, compile_scope=setting.compile_scope)
    precision = {"precision": "bf16-mixed", "fuse_optimizers": setting.fuse_optimizers}
    if setting.fp8 is not None:
        precision["fp8"] = setting.fp8
    trainer["plugins"] = [{"class_path": MIXED_PRECISION_PLUGIN, "init_args": precision}]
    config["model"]["init_args"].update(
        n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd, block_size=shape.block,
        vocab_size=shape.vocab, loss_path=setting.loss_path, attention=setting.attention,
    )  # fmt: skip
    config["data"]["init_args"].update(batch_size=micro_batch, block_size=shape.block, num_workers=shape.workers)
    return config


def refusal(setting: Setting, device: str) -> str | None:
    """The one-line refusal of ``setting`` here, before any process starts (fp8 without its hardware or torchao)."""
    if setting.fp8 is None:
        return None
    from lightning_fastdist import FastMixedPrecision  # noqa: PLC0415 - imports Lightning: only when asked

    try:
        FastMixedPrecision("bf16-mixed", device=device, fp8=setting.fp8)
    except ValueError as error:
        return str(error)
    return None


def run_row(context: Context, name: str, setting: Setting, shape: Shape, label: str, **options: Any) -> dict:
    """Train bench's row ``name`` on the recipe of ``setting`` at ``shape``; its row, labelled, with the seconds."""
    folder = context.work / label
    claim_folder(folder, "bench")  # bench's output folder, where the row's recipe goes beside bench's files
    recipe_path = folder / "setting.yaml"  # not SETUP.yaml: bench writes its overlays under those names
    recipe_path.write_text(yaml.safe_dump(recipe_for(setting, shape, context.device), sort_keys=False))
    steps = context.steps + (PROFILE_STEPS if options.get("profile") else 0)
    argv = ["--config", str(recipe_path), "--devices", "1", "--steps", str(steps),
            "--warmup-steps", str(context.warmup_steps), "--output", str(folder),
            "--compile-backend", "inductor" if context.cuda else "eager"]  # fmt: skip
    if options.get("profile"):
        argv.append("--profile")
    args = bench_arguments(argv)
    setup = recipe_setup(args.recipe) if name == "recipe" else all_setups(args.compile_backend)[name]
    if options.get("compile_mode"):  # the hand-written loop's torch.compile mode
        compile_options = {**setup.strategy_args["compile"], "mode": options["compile_mode"]}
        setup = replace(setup, strategy_args={"compile": compile_options})
    limit = min(context.run_limit_s, context.remaining_s())
    started = time.monotonic()
    row = run_setup(setup, args, folder, timeout_s=limit)
    if row.get("failed", "").startswith("cut after") and limit < context.run_limit_s:  # the budget, not the run
        row = {"setup": row["setup"], "skipped": f"cut short by the budget after {limit:.0f} s"}
    row.update(label=label, seconds=round(time.monotonic() - started, 1), setting=vars(setting), shape=vars(shape))
    with open(context.out / "gpu_bench.log", "a") as log:
        text = (folder / f"{setup.name}.log").read_text() if (folder / f"{setup.name}.log").exists() else ""
        log.write(f"\n===== {label}: {row.get('failed') or row.get('skipped') or 'done'} ({row['seconds']} s)\n")
        log.write(text if "failed" in row else text[-3000:])
    return row


def describe(row: dict) -> str:
    if "skipped" in row or "failed" in row:
        return f"[{row['label']}] {'skipped: ' + row['skipped'] if 'skipped' in row else 'FAILED: ' + row['failed']}"
    mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "n/a"
    tokens = throughput(row) or 0
    peak_gib = row["peak_memory_bytes_max_rank"] / 2**30
    return (
        f"[{row['label']}] {tokens:,.0f} tokens/s, MFU {mfu}, peak {peak_gib:.2f} GiB, "
        f"{row['host_syncs_per_step']} syncs/step, tail loss {row['tail_loss']:.4f} ({row['seconds']} s)"
    )


def goals(report: dict) -> dict:
    """The issue's ratios, from what ran: each ``None`` until both of its rows did."""
    rows = {row["label"]: row for row in report["rows"]}

    def tokens(label: str) -> float | None:
        row = rows.get(label) or next((r for r in report["levers"] if r["label"] == label), None)
        return throughput(row) if row else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    best = report.get("best_row") or {}
    fp8 = [r for r in report["levers"] if r["lever"] == "fp8" and "tokens_per_s" in r]
    wide = {r["label"]: r for r in report["levers"] if r["lever"] == "fp8_wide" and "tokens_per_s" in r}
    return {
        "default_vs_lightning_ddp (>= 2.5)": ratio(tokens("fast-default"), tokens("lightning-ddp")),
        "default_vs_hand_loop (>= 0.97)": ratio(tokens("fast-default"), tokens("hand-loop")),
        "best_vs_hand_loop (>= 0.97)": ratio(throughput(best) if best else None, tokens("hand-loop")),
        "best_mfu (>= 0.40 H100, 0.425 H200)": best.get("mfu"),
        "fp8_vs_bf16 (>= 1.05)": ratio(throughput(fp8[0]), fp8[0]["base_tokens_per_s"]) if fp8 else None,
        "fp8_vs_bf16_wide (>= 1.25)": ratio(tokens("fp8_wide=tensorwise"), tokens("fp8_wide=None")) if wide else None,
    }


def write_report(context: Context) -> None:
    """The JSON and the plot, replaced whole (a reader never sees half a file)."""
    report = context.report
    report["goals"] = goals(report)
    staged = context.out / "gpu_bench.json.partial"
    staged.write_text(json.dumps(report, indent=2, default=str))
    os.replace(staged, context.out / "gpu_bench.json")
    write_plot(report, context.out / "gpu_bench.png")


def write_plot(report: dict, path: Path) -> None:
    """Tokens/s of every run that measured, rows first, then the levers (kept ones darker)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    measured = [r for r in [*report["rows"], *report["levers"]] if throughput(r)]
    if not measured:
        return
    colours = ["tab:gray" if r in report["rows"] else ("tab:green" if r.get("kept") else "tab:olive") for r in measured]
    figure, axis = plt.subplots(figsize=(10, 1.0 + 0.35 * len(measured)))
    axis.barh([r["label"] for r in measured], [throughput(r) for r in measured], color=colours, edgecolor="black")
    for index, row in enumerate(measured):
        if row.get("mfu") is not None:
            axis.text(throughput(row), index, f" {row['mfu']:.1%}", va="center", fontsize=8)
    axis.invert_yaxis()
    axis.set_xlabel("tokens / s (one device; MFU at the bar's end)")
    axis.set_title(f"gpu_bench on {report['device_name']}: rows (gray), levers (green: kept)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def sweep(context: Context, levers: list[Lever], best: Setting, best_row: dict) -> Setting:
    """Switch each lever from ``best``; keep what is faster by ``KEEP_MARGIN``. Rows go into the report as they end."""
    best_tokens = throughput(best_row) or 0.0
    for lever in levers:
        for value in lever.values:
            label = f"{lever.name}={value}"
            record = {"lever": lever.name, "value": value, "label": label, "base_tokens_per_s": best_tokens}
            if lever.cuda_only and not context.cuda:
                context.report["levers"].append({**record, "skipped": f"needs CUDA: {lever.cuda_only}"})
                print(f"[{label}] skipped: needs CUDA: {lever.cuda_only}", flush=True)
                continue
            if context.remaining_s() < context.run_limit_s / 4:
                context.report["levers"].append({**record, "skipped": "out of time (--budget-s spent)"})
                print(f"[{label}] skipped: out of time", flush=True)
                continue
            row, candidate = run_lever(context, lever, value, best, label)
            row = {**record, **row}
            faster = throughput(row) and throughput(row) > best_tokens * (1 + KEEP_MARGIN)
            row["kept"] = bool(faster and candidate is not None)
            if row["kept"]:
                best, best_tokens = candidate, throughput(row)
                context.report["best"], context.report["best_row"] = vars(best), row
            context.report["levers"].append(row)
            print(describe(row) + (" -> kept" if row["kept"] else ""), flush=True)
            write_report(context)
    return best


def run_lever(context: Context, lever: Lever, value: Any, best: Setting, label: str) -> tuple[dict, Setting | None]:
    """One lever run; the row and the setting it measured (``None``: a comparison that no setting can keep)."""
    if lever.name == "cuda_graphs":  # on the hand-written loop, against its default compile
        return run_row(context, "hand-loop", best, context.shape, label, compile_mode=value), None
    if lever.name == "fp8_wide":  # a pair at the wide shape: bf16 (the best setting), then fp8
        wide = SHAPES["wide" if context.cuda else "tiny-wide"]
        base = run_row(context, "recipe", best, wide, "fp8_wide=None")
        context.report["levers"].append({"lever": lever.name, "value": None, "kept": False, **base})
        print(describe(base), flush=True)
        candidate = replace(best, fp8=value)
        reason = refusal(candidate, context.device)
        row = {"skipped": reason} if reason else run_row(context, "recipe", candidate, wide, label)
        return {**row, "base_tokens_per_s": throughput(base) or 0.0}, None
    if lever.name == "micro_batch":
        micro_batch = context.shape.micro_batch * int(value[1:])
        if context.shape.global_batch % micro_batch:
            return {"skipped": f"micro-batch {micro_batch} does not divide the global batch"}, None
        value = micro_batch
    candidate = replace(best, **{lever.setting_field: value})
    reason = refusal(candidate, context.device)
    if reason is not None:
        return {"skipped": reason}, None
    return run_row(context, "recipe", candidate, context.shape, label), candidate


def environment() -> dict[str, Any]:
    """Versions, read without starting CUDA in this process (the runs are children)."""
    import lightning  # noqa: PLC0415
    import torch  # noqa: PLC0415

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "lightning": lightning.__version__}  # fmt: skip
    for package in ("torchao", "jsonargparse"):
        try:
            info[package] = __import__(package).__version__
        except ImportError:
            info[package] = None
    return info


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    parser.add_argument("--out", default="bench_results/gpu_bench", help="folder of the report (at most 7 files)")
    parser.add_argument("--work", default=None, help="folder of every run's files (default: a temporary one)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="seconds for everything (default 450)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 16 cuda, 7 cpu)")
    parser.add_argument("--levers", default=None, help=f"comma-separated, of: {', '.join(x.name for x in LEVERS)}")
    parser.add_argument(
        "--no-rows", action="store_true", help="only the start setting's recipe row, not the four (to rerun levers)"
    )
    parser.add_argument("--best", default=None, help="start the sweep from this setting (JSON of Setting's fields)")
    parser.add_argument("--no-profile", action="store_true", help="no profile of the best setting at the end")
    parser.add_argument("--list", action="store_true", help="print the rows and levers and exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    if args.list:
        print("rows:", ", ".join(ROWS))
        for lever in LEVERS:
            needs = f" (CUDA only: {lever.cuda_only})" if lever.cuda_only else ""
            print(f"lever {lever.name}: {', '.join(map(str, lever.values))}{needs}")
        return 0
    known = {lever.name: lever for lever in LEVERS}
    chosen = [name for name in (args.levers.split(",") if args.levers is not None else known) if name]
    unknown = [name for name in chosen if name not in known]
    if unknown:
        print(f"--levers: unknown {', '.join(unknown)}; the levers: {', '.join(known)}")
        return 2
    try:
        start = Setting(**json.loads(args.best)) if args.best else Setting()
    except (TypeError, ValueError) as error:
        print(f"--best: expected a JSON object of {', '.join(vars(Setting()))}; {error}")
        return 2
    device = args.device
    if device is None:
        import torch  # noqa: PLC0415

        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-bench-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor-cache"))  # one compile per distinct graph
    (out / "gpu_bench.log").write_text("")
    shape = SHAPES["gpt2-small" if cuda else "tiny"]
    context = Context(device, shape, args.steps or (16 if cuda else 7), 4 if cuda else 2, work, out,
                      time.monotonic() + args.budget_s, run_limit_s=180.0 if cuda else 60.0)  # fmt: skip
    device_name = "cpu"
    if cuda:
        import torch  # noqa: PLC0415

        device_name = torch.cuda.get_device_name()
    context.report.update(
        command=[sys.executable, *sys.argv], device=device, device_name=device_name, environment=environment(),
        budget_s=args.budget_s, steps=context.steps, shape=vars(shape), note=MFU_NOTE, rows=[], levers=[],
        best=vars(start), best_row=None,
    )  # fmt: skip
    print(f"gpu_bench on {device_name}: {context.report['environment']}; report {out / 'gpu_bench.json'}", flush=True)
    # Without the rows, the starting setting is measured first: each lever is compared with a number of this run.
    for name in ("recipe",) if args.no_rows else ROWS:
        row = run_row(context, name, start, shape, "start" if args.no_rows else name)
        context.report["rows"].append(row)
        if name == "recipe":
            context.report["best_row"] = row
        print(describe(row), flush=True)
        write_report(context)
    best_row = context.report["best_row"] or {}
    best = sweep(context, [known[name] for name in chosen], start, best_row)
    (out / "recipe_best.yaml").write_text(yaml.safe_dump(recipe_for(best, shape, device), sort_keys=False))
    if not args.no_profile and context.remaining_s() > context.run_limit_s / 4:
        row = run_row(context, "recipe", best, shape, "profile", profile=True)
        for suffix in (".trace.json.gz", ".ops.txt"):
            made = context.work / "profile" / f"recipe{suffix}"
            if made.exists():
                shutil.copy(made, out / f"best{suffix}")
        context.report["profile"] = {"row": row, "files": [f"best{s}" for s in (".trace.json.gz", ".ops.txt")]}
        print(describe(row), flush=True)
    write_report(context)
    print(f"best setting: {json.dumps(vars(best))}", flush=True)
    print("goals: " + json.dumps(context.report["goals"], default=str), flush=True)
    failed = [r["label"] for r in [*context.report["rows"], *context.report["levers"]] if "failed" in r]
    print(f"failed: {', '.join(failed) or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
