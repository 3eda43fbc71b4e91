"""Training every step across nodes that are torchft replica groups (``replica_groups`` of FastDDPStrategy, or with
``--engine fsdp`` of FastFSDPStrategy): what it costs without faults, and what a node lost mid-run costs, in the
emulated cluster.

- **Cost without faults**: 2 emulated nodes x 1 rank, unshaped, a 4-layer GPT-2 of 3.4M parameters
  (``tests/support/replica_groups_fit.py``'s ``gpt2-wide``) at two batch sizes: the median seconds per step under
  ``replica_groups`` against the same strategy as one world across the same nodes (what the form replaces:
  FastDDPStrategy; under ``--engine fsdp`` FastFSDPStrategy with ``sharding: hsdp``, sharded inside each node and
  replicated across them as ``replica_groups`` lays it out), the two
  interleaved ``--rounds`` times (``overhead_batch_N``: the median of the rounds' ratios, minus 1; every round's is
  printed: on 2 shared cores a round's steps move by several milliseconds).
- **A lost node**: 3 emulated nodes x 1 rank, ``min_nodes: 2``, the zoo's GPT-2, ``--steps`` steps: once
  uninterrupted, once with node 2 SIGKILLed during step ``--kill-at``'s backward (once that step's quorum holds it, so
  that the others' all-reduce of that step fails) and started again with the same command once the others finished
  step ``--kill-at + 4``. Measured as ``benchmarks/lost_node.py`` measures ``outer_sync``: ``continue_s`` (from the
  kill to the end of the survivors' first step without node 2), ``steps_lost`` (steps the survivors did not apply, or
  did not train), ``rejoin_s`` (from the restart to the end of the restarted node's first step), ``rejoin_bytes``,
  ``weights_equal_after_rejoin`` (when its first step starts, and after it), ``samples_repeated``, and
  ``final_loss_vs_uninterrupted``: the survivors' mean training loss over the last 5 steps (the same samples in both
  runs) against the uninterrupted run's.
- **Today's path** beside it: the same job as one world (no ``replica_groups``: the cost's one world), a checkpoint
  every ``--save-every`` steps, node 2 SIGKILLed after step ``--kill-at`` and the whole job restarted from its last
  checkpoint as soon as node 2 is gone (a scheduler that notices at once: the best case for that path).

The last line is one JSON object. Needs root, ``ip`` and ``tc``.

    python benchmarks/replica_groups.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support

from tests.support.emulated_cluster import EmulatedCluster, cannot_emulate  # noqa: E402
from tests.support.lost_node_runs import KILLED, NODES, fit_reports, restart_whole_job, run_losing_a_node  # noqa: E402
from tests.support.node_faults import samples_read_twice  # noqa: E402

FIT = [sys.executable, "-m", "tests.support.replica_groups_fit"]
MIN_NODES = 2
ENGINES = {"ddp": ("fast", "one-world"), "fsdp": ("fsdp", "hsdp")}  # replica_groups, and the one world it replaces


def step_seconds(engine: str, batch: int, steps: int, folder: Path) -> float:
    """The median seconds per step (after 5 of warm-up) on the slower of 2 unshaped emulated nodes."""
    folder.mkdir(parents=True)
    with EmulatedCluster(nodes=2, ranks_per_node=1) as cluster:
        processes = cluster.start(
            [*FIT, engine, "gpt2-wide", str(steps)], env={"REPLICA_FIT_BATCH": str(batch)}, cwd=ROOT, output=folder
        )
        codes = [process.wait(timeout=600) for process in processes]
    if codes != [0, 0]:
        raise SystemExit(f"{engine} at batch {batch} exited {codes}: see {folder}")
    medians = []
    for report in fit_reports(folder, ["node0", "node1"]):
        ends = report["step_ends"]
        medians.append(statistics.median(b - a for a, b in zip(ends[5:], ends[6:])))
    return max(medians)


def lost_node_run(
    engine: str, steps: int, kill_at: int | None, folder: Path
) -> tuple[list[dict], float | None, float | None]:
    """One fit of ``steps`` steps on 3 emulated nodes under replica_groups; with ``kill_at``, node 2 is SIGKILLed
    during that step's backward and started again once the others finished step ``kill_at + 4``
    (:func:`run_losing_a_node`). Returns every node's report (node 2's of its restart), and the wall-clock times of
    the kill and of the restart."""
    command = [*FIT, engine, "gpt2", str(steps), str(MIN_NODES)]
    env = {"REPLICA_FIT_NODES": str(NODES)}
    reports, codes, killed_at, restarted_at = run_losing_a_node(
        command, env, kill_at, folder, NODE_FAULT_KILL_IN="backward"
    )
    if codes != [0] * NODES:
        raise SystemExit(f"the run with kill_at={kill_at} exited {codes}: see {folder}")
    return reports, killed_at, restarted_at


def restart_path(engine: str, steps: int, kill_at: int, save_every: int, folder: Path) -> tuple[float, int]:
    """Today's path: one world (``engine``), a checkpoint every ``save_every`` steps, node 2 SIGKILLed after step
    ``kill_at``, the whole job restarted from its last checkpoint at once (:func:`restart_whole_job`)."""
    checkpoints = folder / "checkpoints"
    command = [*FIT, engine, "gpt2", str(steps)]
    env = {"REPLICA_FIT_NODES": str(NODES), "REPLICA_FIT_CHECKPOINTS": str(checkpoints)}
    env["REPLICA_FIT_SAVE_EVERY"] = str(save_every)

    def resume(last: Path) -> tuple[list[str], dict[str, str]]:
        return command, {**env, "REPLICA_FIT_RESUME": str(last)}

    return restart_whole_job(command, env, resume, checkpoints, kill_at, folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=sorted(ENGINES), default="ddp", help="the strategy under replica_groups")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=10, help="node 2 is SIGKILLed during this step's backward")
    parser.add_argument("--save-every", type=int, default=4, help="checkpoints of today's path, every so many steps")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16], help="batch sizes of the cost run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of each setup, per batch size")
    parser.add_argument("--cost-steps", type=int, default=60, help="steps of each run of the cost")
    args = parser.parse_args(argv)
    reason = cannot_emulate()
    if reason:
        print(f"cannot run the emulated cluster here: {reason}")
        return 2
    result: dict = {"engine": args.engine}
    replica_engine, one_world_engine = ENGINES[args.engine]
    with tempfile.TemporaryDirectory(prefix="replica-groups-") as scratch:
        for batch in args.batches:
            rounds = []
            for round_ in range(args.rounds):
                steps = args.cost_steps
                one_world = step_seconds(one_world_engine, batch, steps, Path(scratch, f"one-world-{batch}-{round_}"))
                replicas = step_seconds(replica_engine, batch, steps, Path(scratch, f"replicas-{batch}-{round_}"))
                rounds.append((replicas, one_world))
                print(f"batch {batch}: replica_groups {replicas * 1000:.1f} ms/step, one world {one_world * 1000:.1f}")
            result[f"step_ms_batch_{batch}"] = [round(replicas * 1000, 1) for replicas, _ in rounds]
            result[f"step_ms_one_world_batch_{batch}"] = [round(one_world * 1000, 1) for _, one_world in rounds]
            result[f"overhead_batch_{batch}"] = round(statistics.median(r / o for r, o in rounds) - 1, 4)
        uninterrupted, _, _ = lost_node_run(replica_engine, args.steps, None, Path(scratch, "uninterrupted"))
        killed = Path(scratch, "killed")
        reports, killed_at, restarted_at = lost_node_run(replica_engine, args.steps, args.kill_at, killed)
        if killed_at is None or restarted_at is None:
            raise SystemExit("node 2 was not killed and restarted")
        job_restart_s, steps_trained_again = restart_path(
            one_world_engine, args.steps, args.kill_at, args.save_every, Path(scratch, "restart")
        )
    *survivors, restarted = reports
    first_without = [report["members"].index(NODES - 1) for report in survivors]
    continue_s = max(report["step_ends"][step] for report, step in zip(survivors, first_without)) - killed_at
    came_back = restarted["rejoined"]["step"]
    weights_equal = (
        restarted["first_digest"] == survivors[0]["digests"][came_back - 1]
        and restarted["digests"][0] == survivors[0]["digests"][came_back]
    )
    last = [statistics.mean(report["losses"][-5:]) for report in survivors]
    reference = [statistics.mean(report["losses"][-5:]) for report in uninterrupted[: NODES - 1]]
    result.update(
        {
            "nodes": NODES,
            "killed_node": KILLED,
            "killed_in_step": args.kill_at,
            "steps": args.steps,
            "continue_s": round(continue_s, 2),
            "first_step_without_it": first_without[0] + 1,
            "steps_lost": max(len(report["skipped"]) + args.steps - len(report["losses"]) for report in survivors),
            "rejoin_s": round(restarted["step_ends"][0] - restarted_at, 2),
            "rejoined_at_step": came_back,
            "rejoined_from": restarted["rejoined"]["source"],
            "rejoin_bytes": restarted["rejoined"]["bytes"],
            "weights_equal_after_rejoin": weights_equal,
            "samples_repeated": samples_read_twice(reports),
            "final_weights_equal": len({report["final"] for report in reports}) == 1,
            "final_loss": statistics.mean(last),
            "final_loss_uninterrupted": statistics.mean(reference),
            "final_loss_vs_uninterrupted": statistics.mean(last) / statistics.mean(reference) - 1,
            "restart_path_resume_s": round(job_restart_s, 2),
            "restart_path_steps_trained_again": steps_trained_again,
            "restart_path_save_every": args.save_every,
        }
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
