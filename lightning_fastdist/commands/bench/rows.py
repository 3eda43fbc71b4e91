"""bench's rows as numbers and as text: the arithmetic that compares rows (throughput, the ratio to the engine's
Lightning baseline, how far apart the exact rows' final losses are) and the table's columns. ``tune`` ranks its
trials by the same ``throughput``."""

from __future__ import annotations

from lightning_fastdist.commands.bench.setups import BenchSetup

COLUMNS = (
    ("setup", 23, "{}"),
    ("step ms", 9, "{:.1f}"),
    ("tokens/s", 10, "{:,.0f}"),
    ("MFU", 6, "{:.1%}"),
    ("vs Lightning", 12, "{:.2f}x"),
    ("peak MiB", 9, "{:.0f}"),
    ("comm B/step", 12, "{:,.0f}"),
    ("exposed ms", 10, "{:.1f}"),
    ("syncs/step", 10, "{:.1f}"),
    ("loss", 8, "{:.4f}"),
    ("held-out", 8, "{:.4f}"),
)


def throughput(row: dict) -> float | None:
    """Tokens per second, or samples per second for a model that does not read tokens."""
    return (row["tokens_per_s"] or row["samples_per_s"]) if "step_time_s" in row else None


def add_baseline_ratio(row: dict, rows: list[dict], setup: BenchSetup) -> None:
    """Set ``vs_lightning``: the row's throughput over its engine's Lightning baseline's (``None``: none ran)."""
    baseline = row if setup.name == setup.baseline else next((r for r in rows if r["setup"] == setup.baseline), None)
    mine, theirs = throughput(row), throughput(baseline) if baseline else None
    row["vs_lightning"] = mine / theirs if mine and theirs else None


def loss_spread(rows: list[dict]) -> tuple[float, list[str]] | None:
    """Largest minus smallest final loss over the exact setups that ran (fp32 data parallelism computes
    the same thing, whatever the engine), and their names; ``None`` with fewer than two."""
    exact = [row for row in rows if row.get("exact") and row.get("final_loss") is not None]
    if len(exact) < 2:
        return None
    losses = [row["final_loss"] for row in exact]
    return max(losses) - min(losses), [row["setup"] for row in exact]


def format_row(row: dict) -> str:
    name_width = COLUMNS[0][1]
    if "skipped" in row or "failed" in row:
        reason = "skipped: " + row["skipped"] if "skipped" in row else "FAILED: " + row["failed"]
        return f"{row['setup']:<{name_width}} {reason}"
    values = (
        row["setup"],
        1000 * row["step_time_s"] if row["step_time_s"] else None,
        row["tokens_per_s"],
        row.get("mfu"),
        row.get("vs_lightning"),
        row["peak_memory_bytes_max_rank"] / 2**20,
        row["comm_bytes_per_step"],
        1000 * row["exposed_comm_s"] if row.get("exposed_comm_s") is not None else None,
        row["host_syncs_per_step"],
        row["final_loss"],
        row["held_out_loss"],
    )
    cells = [
        (fmt.format(value) if value is not None else "n/a").rjust(width) if i else f"{value:<{width}}"
        for i, ((_, width, fmt), value) in enumerate(zip(COLUMNS, values))
    ]
    return " ".join(cells)


def header() -> str:
    return " ".join(name.rjust(width) if i else f"{name:<{width}}" for i, (name, width, _) in enumerate(COLUMNS))
