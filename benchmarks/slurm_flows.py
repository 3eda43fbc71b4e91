"""How long SLURM's stops take on the packaged ``train.sbatch``, against real daemons on this machine.

A SLURM cluster of two nodes (``tests/support/slurm_cluster.py``: munged, slurmctld, two slurmd; needs root and
slurm-wlm) runs ``train.sbatch`` on 2 nodes x 1 task, the ``multi_node`` recipe at the demo's size (TinyGPT 4 x 128,
block 128, batch 16 per rank, the recipe's accumulation of 4: ``make demo``'s model), CPU overrides as its comments
give them. One job per round, in the ``low_grace`` partition (GraceTime 5 s), stopped four times:

1. ``usr1``: ``scancel --signal=USR1`` to the tasks, what ``--signal=USR1@90`` sends ahead of the time limit
   (slurmctld's timer sends that one up to 60 s early);
2. ``preempted``: a ``high`` job preempts it (SIGTERM to the tasks, the grace starts);
3. ``lost_node``: n1 SIGKILLed with its slurmd; once rank 0 has exited, n1 is set DOWN (a health check; SLURM on its
   own takes ``SlurmdTimeout``) and, once the job is requeued, started again;
4. ``scancel``: the job cancelled.

For each stop: ``to_checkpoint_s``, from the signal to a new complete ``last.ckpt`` (the atomic rename that
publishes it; the lost node has none); ``to_requeue_s``, from the signal (for the lost node: the DOWN) to SLURM
counting the requeue; ``requeue_to_first_step_s``, from there to the end of the requeued run's first step. The
requeued run cannot start before SLURM's ``cred_expire`` (5 s here, the minimum; 120 s by default) has passed since
the previous run ended.

    python benchmarks/slurm_flows.py [--rounds 3] [--steps 60]

Prints one line per stop and round, then the median and maximum of each number; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support

from tests.support.slurm_cluster import SlurmCluster, slurm_available  # noqa: E402
from tests.support.slurm_training import (  # noqa: E402
    last_step,
    read_runs,
    submit_training,
    wait_for_output,
    wait_for_step,
)

DEMO_SIZE = [
    "--trainer.accelerator", "cpu", "--trainer.strategy.init_args.compile", "false",
    "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
    "--trainer.enable_progress_bar", "false",
    "--model.n_layer", "4", "--model.n_head", "4", "--model.n_embd", "128", "--model.block_size", "128",
    "--data.block_size", "128", "--data.batch_size", "16", "--data.num_workers", "0",
    "--trainer.callbacks+", "tests.support.slurm_workload.SampleLog",
]  # fmt: skip
ACCUMULATION = 4  # the recipe's accumulate_grad_batches, kept
POLL_S = 0.02


def checkpoint_mark(path: Path) -> tuple[int, int] | None:
    """What identifies this ``last.ckpt`` file (a new save publishes a new inode), or None before the first."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


class Stopwatch:
    """Times one stop of the job: the signal, the new ``last.ckpt``, SLURM's requeue, the next run's first step."""

    def __init__(self, cluster: SlurmCluster, job_id: int, folder: Path) -> None:
        self.cluster, self.job_id, self.folder = cluster, job_id, folder
        self.last = folder / "checkpoints" / "multi_node" / "last.ckpt"

    def measure(self, name: str, stop, run: int, save: bool = True) -> dict:
        """Call ``stop()`` (it returns when the signal went, or the DOWN), then wait for what follows."""
        before = checkpoint_mark(self.last)
        restarts = self.cluster.job(self.job_id).restarts
        signalled = stop()
        result: dict = {"stop": name, "stopped_at_step": last_step(self.folder / "samples", run)}
        if save:
            while checkpoint_mark(self.last) == before:
                if self.cluster.job(self.job_id).state in ("CANCELLED", "FAILED", "COMPLETED"):
                    raise SystemExit(f"slurm_flows: {name}: the job ended without a new checkpoint; see {self.folder}")
                time.sleep(POLL_S)
            result["to_checkpoint_s"] = round(time.time() - signalled, 2)
        if name == "scancel":
            self.cluster.wait(self.job_id, timeout=120)
            return result
        while self.cluster.job(self.job_id).restarts == restarts:
            time.sleep(0.1)
        requeued = time.time()
        result["to_requeue_s"] = round(requeued - signalled, 2)
        if name == "lost_node":  # once the first run's script has named n1 (n1 still DOWN), as the tests do
            wait_for_output(self.cluster, self.job_id, "train.sbatch: lost node")
            self.cluster.revive_node("n1")
        wait_for_step(self.cluster, self.job_id, self.folder / "samples", run + 1, 1, timeout=300)
        while len(batches := read_runs(self.folder / "samples")[0, run + 1].steps) < ACCUMULATION:
            time.sleep(POLL_S)
        # A resumed run starts at an optimizer step: its first one ends with its ACCUMULATION-th batch.
        result["requeue_to_first_step_s"] = round(batches[ACCUMULATION - 1]["time"] - requeued, 2)
        return result


def one_round(cluster: SlurmCluster, folder: Path, steps: int) -> list[dict]:
    fit_args = [*DEMO_SIZE, "--trainer.callbacks.folder", str(folder / "samples"), "--trainer.max_steps", str(steps)]
    job_id = submit_training(cluster, folder, fit_args, "--partition=low_grace")
    watch = Stopwatch(cluster, job_id, folder)
    samples = folder / "samples"

    def scancel(*args, **kwargs):
        def send() -> float:
            sent = time.time()
            cluster.scancel(job_id, *args, **kwargs)
            return sent

        return send

    def preempt() -> float:
        sent = time.time()
        cluster.submit("#!/bin/bash\ntrue\n", "--partition=high", "--nodes=1")
        return sent

    def lose_n1() -> float:
        cluster.kill_node("n1")
        while "srun: error: n0: task 0: Exited with exit code 1\n" not in (folder / f"slurm-{job_id}.out").read_text():
            time.sleep(POLL_S)
        downed = time.time()
        cluster.set_node_state("n1", "DOWN", reason="lost")
        return downed

    results = []
    for run, (name, stop) in enumerate((("usr1", scancel("USR1")), ("preempted", preempt), ("lost_node", lose_n1),
                                        ("scancel", scancel()))):  # fmt: skip
        wait_for_step(cluster, job_id, samples, run, 1, timeout=300)  # the run trains ...
        wait_for_step(cluster, job_id, samples, run, last_step(samples, run) + 3, timeout=300)  # ... 3 steps more
        results.append(watch.measure(name, stop, run=run, save=name != "lost_node"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="max_steps of the job (it is cancelled before)")
    parser.add_argument("--workdir", type=Path, help="keep the jobs' folders here (default: a temporary folder)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through the `with`: the cluster is stopped
    why_not = slurm_available()
    if why_not is not None:
        raise SystemExit(f"slurm_flows: {why_not}")
    results = []
    with SlurmCluster(preempt_send_user_signal=False) as cluster, tempfile.TemporaryDirectory() as scratch:
        for index in range(args.rounds):
            folder = (args.workdir or Path(scratch)) / f"round{index}"
            for result in one_round(cluster, folder, args.steps):
                print(json.dumps({"round": index, **result}), flush=True)
                results.append(result)
            cluster.wait_nodes("idle", timeout=120)
    summary = {}
    for stop in ("usr1", "preempted", "lost_node", "scancel"):
        rows = [row for row in results if row["stop"] == stop]
        for key in ("to_checkpoint_s", "to_requeue_s", "requeue_to_first_step_s"):
            values = [row[key] for row in rows if key in row]
            if values:
                summary[f"{stop}.{key}"] = {"median": statistics.median(values), "max": max(values)}
    for key, value in summary.items():
        print(f"{key:40} median {value['median']:6.2f}  max {value['max']:6.2f}")
    print(json.dumps({"cpu_cores": os.cpu_count(), "rounds": args.rounds, "summary": summary}))


if __name__ == "__main__":
    main()
