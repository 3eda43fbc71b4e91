"""How long Ray Train's flows take with our strategies, against a real Ray cluster of two Ray nodes on this machine.

The Ray cluster of ``tests/ray`` (``tests/support/ray_cluster.py``: ``ray.cluster_utils.Cluster``, two nodes of one
CPU each, the second on another loopback address) runs the tests' job (``tests/support/ray_training.py``): one
``TorchTrainer`` of two workers (gloo), ``FailureConfig(max_failures=2)``, ``ScalingConfig(num_workers=(1, 2))``:

1. one fit of 8 steps each under Ray's ``RayDDPStrategy``, ``FastDDPStrategy()``,
   ``FastFSDPStrategy(sharding="zero3", async_checkpointing=True)``, ``FastDeepSpeedStrategy(stage=2)`` (TinyGPT 2 x 32,
   batch 4 per rank), ours through ``RayReport(every_n_train_steps=4)``;
2. ``FastDDPStrategy`` through ``RayReport(every_n_train_steps=2)``, rank 1 SIGKILLed at step 5: Ray restarts both
   workers, which resume from the last reported checkpoint;
3. the same, the second Ray node removed while its worker holds at step 5: Ray restarts one worker, which resumes at
   world size 1.

Printed per round: ``cluster_start_s`` (two Ray nodes up, this process connected), ``job_s`` (``fit()`` of the whole
job), each fit's ``<fit>_steps_s`` (first step's end to last step's end, on rank 0), ``kill_to_first_step_s`` (the
SIGKILL to the end of the first step after the restart) and ``node_removed_to_first_step_s`` (the node's removal to
the same); then the median and maximum of each; the last line is one JSON object.

    python benchmarks/ray_flows.py [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support

from tests.support.ray_cluster import SECOND_NODE_ADDRESS, WORKERS, RayTestCluster, ray_missing  # noqa: E402
from tests.support.ray_training import ENGINES, read_lines, train_engines_then_lose_workers  # noqa: E402

LOSE_AT_STEP = 5


def steps_seconds(fit: Path) -> float:
    """Rank 0's first step's end to its last step's end, in the fit's first attempt."""
    times = [line["time"] for line in read_lines(fit / "steps-rank0.jsonl") if line["attempt"] == 0]
    return times[-1] - times[0]


def to_first_step_after(fit: Path, since: float) -> float:
    """From ``since`` to the end of the first step any rank took after the restart."""
    return min(line["time"] for line in read_lines(fit / "steps-rank0.jsonl") if line["attempt"] == 1) - since


def one_round(folder: Path) -> dict[str, float]:
    started = time.monotonic()
    cluster = RayTestCluster()
    numbers = {"cluster_start_s": time.monotonic() - started}
    config = {
        "out": str(folder),
        "report_every": 2,
        "engines_report_every": 4,
        "kill_step": LOSE_AT_STEP,
        "removal_step": LOSE_AT_STEP,
        "second_node": SECOND_NODE_ADDRESS,
    }
    removal = folder / "node_removed" / "lost.json"
    try:
        started = time.monotonic()
        result = cluster.fit(
            train_engines_then_lose_workers,
            config,
            folder / "storage",
            max_failures=2,
            remove_second_node_at=removal,
            num_workers=(1, WORKERS),
        )
        numbers["job_s"] = time.monotonic() - started
    finally:
        cluster.close()
    if result.error is not None:
        raise SystemExit(f"the job failed: {result.error}")
    for fit in (*ENGINES, "killed", "node_removed"):
        numbers[f"{fit}_steps_s"] = steps_seconds(folder / fit)
    killed = json.loads((folder / "killed" / "lost.json").read_text())["time"]
    numbers["kill_to_first_step_s"] = to_first_step_after(folder / "killed", killed)
    removed = float(Path(f"{removal}.removed").read_text())
    numbers["node_removed_to_first_step_s"] = to_first_step_after(folder / "node_removed", removed)
    return numbers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    why_not = ray_missing()
    if why_not is not None:
        raise SystemExit(why_not)
    rounds = []
    for index in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="ray_flows-") as folder:
            numbers = one_round(Path(folder))
        rounds.append(numbers)
        print(f"round {index + 1}: " + ", ".join(f"{name} {value:.1f}" for name, value in numbers.items()), flush=True)
    summary = {
        name: {"median": statistics.median(r[name] for r in rounds), "max": max(r[name] for r in rounds)}
        for name in rounds[0]
    }
    for name, values in summary.items():
        print(f"{name}: median {values['median']:.1f} s, max {values['max']:.1f} s")
    print(json.dumps({"rounds": rounds, "summary": summary}))


if __name__ == "__main__":
    main()
