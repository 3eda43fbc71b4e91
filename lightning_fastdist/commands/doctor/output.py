"""What ``doctor`` writes, and the mark that lets it replace only its own files: the recipe (its first line names
doctor and its arguments, then why it was chosen) and ``--simulate``'s JSON (its ``written_by``). Anything else at
those paths is refused before a file is written.
"""

from __future__ import annotations

from pathlib import Path

from lightning_fastdist.commands.doctor import simulate as doctor_simulate
from lightning_fastdist.commands.doctor.plan_inputs import DoctorError
from lightning_fastdist.commands.written_marks import first_line_starts_with, json_written_by, refusal
from lightning_fastdist.planning.advisor import Recommendation, Target
from lightning_fastdist.planning.memory_model import GiB

WRITTEN_BY = "lightning-fastdist doctor"
# First words of every recipe doctor writes (then its arguments): the only files ``--output`` may replace.
HEADER_START = f"# Written by: {WRITTEN_BY}"


def check_ours(path: Path, json: bool) -> None:
    """Refuse an ``--output`` (``--json``) that is a folder or a file doctor did not write (it is never replaced)."""
    if json:
        mark = doctor_simulate.JSON_MARKER["written_by"]
        ours, writer, advice = (lambda p: json_written_by(p) == mark), "doctor --simulate", "give another --json path"
        problem = refusal("--json", path, "simulation.json", ours, writer, advice)
    else:
        ours, advice = (lambda p: first_line_starts_with(p, HEADER_START)), "give another --output or move that file"
        problem = refusal("--output", path, "doctor-recipe.yaml", ours, "doctor", advice)
    if problem:
        raise DoctorError(problem + ".")


def recipe_comments(recommendation: Recommendation, target: Target, argv: list[str]) -> list[str]:
    """The recipe's first lines: doctor's mark with its arguments, the devices, the estimated peak and every reason."""
    return [
        " ".join([HEADER_START, *argv]),
        f"# For {target.nodes} node(s) x {target.devices} {target.accelerator}(s), "
        f"{target.device_memory_bytes / GiB:.1f} GiB each.",
        f"# Estimated peak per device: {recommendation.estimate.total / GiB:.3f} GiB"
        f" (usable {recommendation.usable_bytes / GiB:.2f} GiB){'' if recommendation.fits else ' -- DOES NOT FIT'}.",
        *(f"#   {reason}" for reason in recommendation.reasons),
    ]
