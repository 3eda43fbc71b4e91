"""bench.png: throughput and peak memory per setup that ran, one colour per engine (``tune.png`` takes the same
colours, so an engine looks alike in both). matplotlib is imported only when a plot is drawn: nothing else needs it.
"""

from __future__ import annotations

from pathlib import Path

from lightning_fastdist.commands.bench.rows import throughput
from lightning_fastdist.commands.bench.setups import ENGINES

ENGINE_COLOURS = {"DDP": "tab:blue", "FSDP2": "tab:orange", "DeepSpeed": "tab:green"}


def write_plot(rows: list[dict], path: Path) -> None:
    """Bar charts of throughput and peak memory per setup that ran, coloured by engine; Lightning's own hatched."""
    import matplotlib  # noqa: PLC0415 - only bench needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    measured = [r for r in rows if throughput(r)]
    names = [r["setup"] for r in measured]
    colours = [ENGINE_COLOURS[r["engine"]] for r in measured]
    hatches = ["//" if r["setup"].startswith("lightning-") else "" for r in measured]
    unit = "tokens" if all(r["tokens_per_s"] for r in measured) else "samples"
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(12, 0.9 + 0.35 * max(len(measured), 4)))
    speed.barh(names, [throughput(r) for r in measured], color=colours, hatch=hatches, edgecolor="black")
    speed.set_xlabel(f"{unit} / s (all ranks)")
    peaks = [r["peak_memory_bytes_max_rank"] / 2**20 for r in measured]
    memory.barh(names, peaks, color=colours, hatch=hatches, edgecolor="black")
    memory.set_xlabel(f"peak MiB per rank ({measured[0]['peak_memory_kind'] if measured else ''})")
    for axis in (speed, memory):
        axis.invert_yaxis()
    legend = [Patch(facecolor=ENGINE_COLOURS[engine], edgecolor="black", label=engine) for engine in ENGINES]
    legend.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="Lightning's own strategy"))
    figure.legend(handles=legend, loc="lower center", ncol=len(legend), frameon=False)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(path, dpi=100)
    plt.close(figure)
