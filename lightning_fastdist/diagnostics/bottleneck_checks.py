"""Turn measurements into checklist rows (what was measured, OK/WARN, the fix as recipe YAML) and render them.

Each threshold is a module constant (``*_WARN``, :data:`MIN_BUCKET_BYTES`); ``docs/bottlenecks.md`` tables the
checks, what each measures and its fix.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from lightning_fastdist.parallel.ddp.buckets import MAX_BUCKET_MB, MIN_BUCKET_MB

DATA_WAIT_WARN = 0.20
COMM_WARN = 0.30
OPTIMIZER_WARN = 0.30
MEMORY_WARN = 0.90
MIN_BUCKET_BYTES = int(MIN_BUCKET_MB * 2**20)  # the auto rule's floor: smaller buckets only pay latency


@dataclass(frozen=True)
class CheckRow:
    """One line of the checklist.

    Attributes:
        check: what was checked (``"data wait"``, ``"host syncs"``, ...).
        measured: the measurement, with units.
        status: ``"OK"``, ``"WARN"`` or ``"N/A"`` (could not be measured here; ``measured`` says why).
        fix: for a WARN, the change as a YAML snippet for a recipe (comments explain non-YAML parts).
    """

    check: str
    measured: str
    status: str
    fix: str = ""


def _row(check: str, measured: str, warn: bool, fix: str) -> CheckRow:
    return CheckRow(check, measured, "WARN" if warn else "OK", fix if warn else "")


def check_data_wait(fraction: float, mean_wait_s: float, suggested_workers: int) -> CheckRow:
    """Share of the loop spent waiting for batches."""
    fix = (
        f"data:\n  init_args:\n    num_workers: {suggested_workers}"
        "   # or let the tuner pick and rebuild the loaders:\n"
        "trainer:\n  callbacks:\n    - class_path: lightning_fastdist.DataLoaderTuner\n      init_args: {mode: auto}"
    )
    measured = f"{fraction:.1%} of the loop ({mean_wait_s * 1e3:.1f} ms per batch)"
    return _row("data wait", measured, fraction > DATA_WAIT_WARN, fix)


def check_host_syncs(median_per_step: float, top_origin: str | None) -> CheckRow:
    """Device-to-host syncs on ordinary steps (median per step over the counted steps)."""
    where = f"; most frequent: {top_origin}" if top_origin else ""
    fix = (
        f"# remove the value read{(' at ' + top_origin) if top_origin else ''} (.item(), float(), print(tensor)),\n"
        "# log tensors instead, and keep logged values on the device:\n"
        "trainer:\n  callbacks:\n    - class_path: lightning_fastdist.SyncFreeLogging"
    )
    return _row("host syncs", f"{median_per_step:g} per step{where}", median_per_step >= 1, fix)


def check_buckets(bucket_cap_bytes: int | None, gradient_bytes: int) -> CheckRow:
    """DDP gradient bucket size against the gradients' size."""
    if bucket_cap_bytes is None:
        return CheckRow("gradient buckets", "not DDP: no buckets", "N/A")
    buckets = -(-gradient_bytes // max(1, bucket_cap_bytes))
    tiny = bucket_cap_bytes < MIN_BUCKET_BYTES and buckets > 1
    fix = (
        "trainer:\n  strategy:\n    class_path: lightning_fastdist.FastDDPStrategy\n"
        "    init_args:\n"
        f"      bucket_cap_mb: auto   # gradient MB / 8, clamped to [{MIN_BUCKET_MB:g}, {MAX_BUCKET_MB:g}] MB"
    )
    measured = (
        f"{bucket_cap_bytes / 2**20:.3g} MiB cap, ~{buckets} bucket(s) "
        f"for {gradient_bytes / 2**20:.3g} MiB of gradients"
    )
    return _row("gradient buckets", measured, tiny, fix)


def check_comm_rounds(rounds: int | None, optimizer_steps: int) -> CheckRow:
    """Gradient synchronisations per optimizer step (1 expected; more means accumulation syncs every micro-batch)."""
    if rounds is None:
        return CheckRow("gradient sync rounds", "not counted: FastDDPStrategy and FastFSDPStrategy count them", "N/A")
    if optimizer_steps == 0:
        return CheckRow("gradient sync rounds", f"{rounds} round(s) and no optimizer step in the window", "N/A")
    per_step = rounds / optimizer_steps
    fix = (
        "# accumulate with Lightning (it skips the gradient sync on non-final micro-batches):\n"
        "trainer:\n  accumulate_grad_batches: 4\n"
        "# with manual optimization, wrap non-final backwards in `with self.trainer.strategy.block_backward_sync():`"
    )
    measured = f"{per_step:.2f} per optimizer step ({rounds} rounds / {optimizer_steps} steps)"
    return _row("gradient sync rounds", measured, per_step > 1.0, fix)


def check_comm_time(comm_s: float | None, step_s: float, why_unmeasured: str = "", sharded: bool = False) -> CheckRow:
    """Time to re-send one optimizer step's collectives, without overlap, against the step time.

    ``sharded``: the traffic is FSDP's parameter all-gathers, which need another fix.
    """
    if comm_s is None:
        return CheckRow("communication", f"not measured: {why_unmeasured}", "N/A")
    share = comm_s / step_s if step_s > 0 else 0.0
    if sharded:
        fix = (
            "trainer:\n  precision: bf16-mixed       # parameters gathered in bf16: half the all-gather bytes\n"
            "  strategy:\n    class_path: lightning_fastdist.FastFSDPStrategy\n"
            "    init_args:\n      sharding: zero2        # gather each block once per step, not twice (more memory)"
        )
    else:
        fix = (
            "trainer:\n  strategy:\n    class_path: lightning_fastdist.FastDDPStrategy\n"
            "    init_args:\n      comm_hook: bf16        # half the bytes; powersgd sends 10-30x fewer"
        )
    measured = f"{comm_s * 1e3:.1f} ms per step if not overlapped ({share:.0%} of a step)"
    return _row("communication", measured, share > COMM_WARN, fix)


def check_optimizer_time(optimizer_s: float, loop_s: float) -> CheckRow:
    """Time in the optimizer step against the loop's time."""
    share = optimizer_s / loop_s if loop_s > 0 else 0.0
    fix = (
        "# shard the optimizer step across ranks (each updates 1/N of the weights):\n"
        "trainer:\n  strategy:\n    class_path: lightning_fastdist.FastFSDPStrategy\n    init_args: {sharding: zero2}\n"
        "# and/or build the optimizer with fused=True (torch.optim.AdamW)"
    )
    return _row("optimizer step", f"{share:.1%} of the loop", share > OPTIMIZER_WARN, fix)


def check_memory(peak_bytes: int | None, capacity_bytes: int | None, what: str) -> CheckRow:
    """Peak memory against the device's (or, on CPU, the host's) memory."""
    if peak_bytes is None or not capacity_bytes:
        return CheckRow("peak memory", f"not measured ({what})", "N/A")
    share = peak_bytes / capacity_bytes
    fix = (
        "trainer:\n  strategy:\n    class_path: lightning_fastdist.FastFSDPStrategy\n"
        "    init_args: {sharding: zero3, activation_checkpointing: selective}\n"
        "# or lower data.init_args.batch_size and raise trainer.accumulate_grad_batches"
    )
    measured = f"{peak_bytes / 2**30:.2f} of {capacity_bytes / 2**30:.1f} GiB ({share:.0%}, {what})"
    return _row("peak memory", measured, share > MEMORY_WARN, fix)


def check_recompiles(count: int) -> CheckRow:
    """torch.compile recompiles inside the measured window (after warm-up)."""
    fix = "trainer:\n  strategy:\n    init_args:\n      compile: {dynamic: true}   # or pad batches to fixed shapes"
    return _row("recompiles", f"{count} in the window", count > 0, fix)


def check_precision(precision: str, bf16_available: bool, device_type: str) -> CheckRow:
    """fp32 training where the device computes in bf16."""
    fp32 = precision in ("32-true", "32", "64-true", "64")
    fix = (
        "trainer:\n  precision: null   # the plugin sets it (Lightning refuses both)\n"
        "  plugins:\n    - class_path: lightning_fastdist.FastMixedPrecision\n"
        f"      init_args: {{precision: bf16-mixed, device: {'cuda' if device_type == 'cuda' else 'cpu'}}}"
    )
    available = "bf16 available" if bf16_available else "no bf16 on this device"
    return _row("precision", f"{precision} ({available} on {device_type})", fp32 and bf16_available, fix)


def render_text(rows: list[CheckRow]) -> str:
    """A fixed-width table, then each WARN row's fix."""
    widths = [max(len(r.check) for r in rows), max(len(r.measured) for r in rows)]
    lines = [f"{'check':{widths[0]}}  {'status':6}  measured", "-" * (widths[0] + widths[1] + 10)]
    lines += [f"{r.check:{widths[0]}}  {r.status:6}  {r.measured}" for r in rows]
    for row in rows:
        if row.fix:
            lines += ["", f"Fix for {row.check}:", *(f"  {line}" for line in row.fix.splitlines())]
    return "\n".join(lines)


def render_markdown(rows: list[CheckRow], title: str) -> str:
    """A Markdown table, then each WARN row's fix as a YAML block."""
    lines = [f"# {title}", "", "| check | status | measured |", "| --- | --- | --- |"]
    lines += [f"| {r.check} | {r.status} | {r.measured.replace('|', '/')} |" for r in rows]
    for row in rows:
        if row.fix:
            lines += ["", f"## Fix: {row.check}", "", "```yaml", row.fix, "```"]
    return "\n".join(lines) + "\n"


def render_json(rows: list[CheckRow], details: dict) -> str:
    """``{"rows": [...], "details": {...}}`` as indented JSON."""
    return json.dumps({"rows": [asdict(r) for r in rows], "details": details}, indent=2, default=str)
