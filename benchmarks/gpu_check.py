"""Every GPU-only check of this package in one run: one JSON report and a PASS/FAIL/SKIP line per check.

    bash benchmarks/gpu_check.sh                 # on a GPU machine: the wheels it lacks, then this
    python benchmarks/gpu_check.py [--out DIR] [--only a,b] [--steps N] [--budget-s S]
    python benchmarks/gpu_check.py --device cpu  # the plumbing on a CPU, CUDA-only checks skipped

Each check runs in a process of its own (a crash, a hang or an NCCL abort ends that check alone, and
the MFU check gets a fresh compile), inside try/finally that resets CUDA's sync debug mode and
torch._dynamo; the checks are in benchmarks/gpu_check_cases.py. The report
(``<out>/gpu_check.json``) is rewritten after every check, so a run cut short still leaves one;
the children's output goes to ``<out>/gpu_check.log``. Exit status: 0 if nothing failed, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULT_PREFIX = "GPU_CHECK_RESULT "


@dataclass(frozen=True)
class Check:
    """A check of gpu_check_cases (same name); ``cuda_only`` says why a CPU run skips it."""

    name: str
    timeout_s: int
    cuda_only: str = ""


# In this order: MFU first (a fresh compile on an idle GPU), the slow and optional ones last.
CHECKS = (
    Check("mfu", 180, "MFU is measured against a GPU's peak FLOPs"),
    Check("host_syncs", 120),
    Check("amp_bf16", 90),
    Check("amp_fp16", 90, "16-mixed is refused on CPU without an explicit scaler, and is a GPU feature"),
    Check("comm_hooks", 150),
    Check("powersgd_resume", 120),
    Check("fsdp_modes", 150),
    Check("fsdp_checkpoints", 180),
    Check("compile_inductor", 150),
    Check("bf16_attention", 90),
    Check("rng_states", 60, "it restores a CUDA generator"),
    Check("deepspeed", 150),
    Check("cuda_graph_modes", 180),
    Check("deepspeed_offload", 240, "DeepSpeed's CPU Adam is only built for CUDA runs"),
)
INJECTED = Check("injected_failure", 60)
MIN_SECONDS_TO_START = 20  # below this much of the budget, the remaining checks are skipped


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def line(self) -> str:
        return f"[{self.status}] {self.name}: {self.detail}"


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    parser.add_argument("--out", default="bench_results/gpu_check", help="folder of the JSON report and the log")
    parser.add_argument("--only", default="", help="comma-separated check names; the others are reported skipped")
    parser.add_argument("--steps", type=int, default=None, help="training steps per fit (default: 20 cuda, 4 cpu)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="seconds for all checks (default 450)")
    parser.add_argument("--inject-failure", action="store_true", help="add a check that fails (tests the runner)")
    parser.add_argument("--list", action="store_true", help="print the checks and exit")
    parser.add_argument("--run-one", default=None, help=argparse.SUPPRESS)  # child mode: one check
    return parser.parse_args(argv)


def environment() -> dict[str, Any]:
    """What the report says about the machine, read without starting CUDA in this (parent) process."""
    import lightning
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "lightning": lightning.__version__}  # fmt: skip
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except ImportError:
        info["deepspeed"] = None
    return info


def run_child(check: Check, args: argparse.Namespace, device: str, steps: int, log, seconds: float) -> Result:
    """Run one check in a new process; its output goes to ``log``, its result comes back on a marked line."""
    command = [sys.executable, str(Path(__file__).resolve()), "--run-one", check.name, "--device", device,
               "--steps", str(steps)]  # fmt: skip
    log.write(f"\n===== {check.name}: {' '.join(command)}\n")
    log.flush()
    started = time.monotonic()
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=seconds)
        output, returncode = done.stdout, done.returncode
    except subprocess.TimeoutExpired as timeout:
        output = timeout.output.decode() if isinstance(timeout.output, bytes) else timeout.output or ""
        log.write(output)
        if seconds < check.timeout_s:  # the run's budget ended it, not the check's own limit
            return Result(check.name, "SKIP", f"cut short by the budget after {seconds:.0f} s (its limit: "
                          f"{check.timeout_s} s)", seconds=seconds)  # fmt: skip
        return Result(check.name, "FAIL", f"no result within {seconds:.0f} s (killed)", seconds=seconds)
    log.write(output)
    log.flush()
    elapsed = time.monotonic() - started
    marked = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    if not marked:
        tail = [line for line in output.strip().splitlines() if line.strip()][-1:] or ["no output"]
        return Result(check.name, "FAIL", f"process ended with status {returncode}: {tail[0][:300]}", seconds=elapsed)
    result = Result(**json.loads(marked[-1][len(RESULT_PREFIX) :]))
    result.seconds = elapsed
    return result


def run_one(name: str, device: str, steps: int) -> Result:
    """Child mode: the check, isolated (try/finally, CUDA's sync debug mode and dynamo reset), as a Result."""
    import gpu_check_cases as cases
    import torch

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as tmp:
        try:
            passed, detail, numbers = getattr(cases, name)(cases.Context(device, steps, Path(tmp)))
            result = Result(name, "PASS" if passed else "FAIL", detail, numbers)
        except ImportError as error:
            result = Result(name, "SKIP", f"cannot import {error.name}: carry its wheel (make gpu-wheels)")
        except Exception as error:  # the check's failure, in one line; the traceback is in the log
            import traceback

            traceback.print_exc()
            first = (str(error).strip().splitlines() or [""])[0][:300]
            result = Result(name, "FAIL", f"{type(error).__name__}: {first}")
        finally:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)
            torch._dynamo.reset()
    result.seconds = time.monotonic() - started
    return result


def write_report(path: Path, report: dict[str, Any]) -> None:
    staged = path.with_name(path.name + ".partial")
    staged.write_text(json.dumps(report, indent=2, default=str))
    os.replace(staged, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    checks = CHECKS + ((INJECTED,) if args.inject_failure else ())
    if args.list:
        for check in checks:
            print(f"{check.name}{f'  (CUDA only: {check.cuda_only})' if check.cuda_only else ''}")
        return 0
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    steps = args.steps or (20 if device == "cuda" else 4)
    if args.run_one:
        print(RESULT_PREFIX + json.dumps(asdict(run_one(args.run_one, device, steps)), default=str), flush=True)
        return 0

    selected = {name for name in args.only.split(",") if name} or {check.name for check in checks}
    selected |= {INJECTED.name} if args.inject_failure else set()
    unknown = selected - {check.name for check in checks}
    if unknown:
        print(f"--only: unknown check(s) {', '.join(sorted(unknown))}; the checks: {', '.join(c.name for c in checks)}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"command": [sys.executable, *sys.argv], "device": device, "steps": steps, "budget_s": args.budget_s,
              "environment": environment(), "checks": []}  # fmt: skip
    print(f"gpu_check on {device}: {report['environment']}; report {out / 'gpu_check.json'}", flush=True)
    deadline = time.monotonic() + args.budget_s
    with open(out / "gpu_check.log", "a") as log:
        for check in checks:
            remaining = deadline - time.monotonic()
            if check.name not in selected:
                result = Result(check.name, "SKIP", "not selected (--only)")
            elif device == "cpu" and check.cuda_only:
                result = Result(check.name, "SKIP", f"needs CUDA: {check.cuda_only}")
            elif remaining < MIN_SECONDS_TO_START:
                result = Result(check.name, "SKIP", f"out of time ({args.budget_s:.0f} s budget spent)")
            else:
                result = run_child(check, args, device, steps, log, min(check.timeout_s, remaining))
            print(result.line() + (f" ({result.seconds:.0f} s)" if result.seconds else ""), flush=True)
            report["checks"].append(asdict(result))
            report["summary"] = {s: sum(c["status"] == s for c in report["checks"]) for s in ("PASS", "FAIL", "SKIP")}
            write_report(out / "gpu_check.json", report)
    print(f"summary: {report['summary']}", flush=True)
    return 1 if report["summary"]["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
