"""Semi-synchronous training across nodes (``outer_sync``, DiLoCo on torchft): options, fragments, schedule, bytes.

The two-node test runs two real "nodes" on this machine (each its own Lightning launch with ``NODE_RANK``, its own
torch.distributed world, torchft's lighthouse started by global rank 0) and asserts what crossed between them and
when, never time.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy, OuterSync
from lightning_fastdist.commands.bench.setups import all_setups
from lightning_fastdist.parallel.across_nodes.outer_sync.fragments import split_into_fragments
from lightning_fastdist.parallel.checkpoint.problems import UnusableCheckpointError
from lightning_fastdist.parallel.checkpoint.side_saves import OUTER_SYNC_NODES
from lightning_fastdist.planning.fsdp_shards import shard_numels
from lightning_fastdist.planning.outer_sync_memory import outer_sync_memory
from lightning_fastdist.planning.setup import Setup
from lightning_fastdist.recipes.recipe import Recipe
from lightning_fastdist.strategies.across_nodes.outer_sync_checkpoint import read_node_state
from tests.support.emulated_cluster import REPO_ROOT, EmulatedCluster, cannot_emulate
from tests.support.harness import ForkedModule, free_port_span, run_processes
from tests.support.node_faults import start_again_once_held
from tests.support.workloads import tiny_gpt

# Bytes a node may send besides the weights and pseudo-gradients: headers, torchft's heartbeats (10 a second to the
# lighthouse) and quorums. Sending the pseudo-gradients in fp32 instead of bf16 would exceed it here.
CONTROL_BYTES = 256 * 1024


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"every": 0}, "outer_sync.every=0 must be an integer >= 1."),
        ({"every": 5, "fragments": 2}, "outer_sync.every=5 is not a multiple of outer_sync.fragments=2"),
        ({"every": 20, "fragments": 2, "delay": 10}, "outer_sync.delay=10 must be less than every/fragments=10"),
        ({"lr": 0.0}, "outer_sync.lr=0.0 must be > 0"),
        ({"momentum": 0.0}, "outer_sync.nesterov needs momentum > 0"),
        ({"dtype": "fp8"}, "outer_sync.dtype='fp8': accepted values are ['fp32', 'bf16']."),
        ({"evry": 4}, "outer_sync has no option 'evry'"),
    ],
)
def test_bad_options_are_refused_in_one_line_naming_the_field(options, message):
    with pytest.raises(ValueError, match="^FastDDPStrategy: ") as error:
        FastDDPStrategy(outer_sync=options)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_fsdp_names_itself_and_refuses_hsdp_in_one_line():
    with pytest.raises(ValueError, match=r"^FastFSDPStrategy: outer_sync.every=0 must be an integer >= 1.$"):
        FastFSDPStrategy(outer_sync={"every": 0})
    with pytest.raises(ValueError, match=r"^FastFSDPStrategy: outer_sync .* give sharding='zero3' or 'zero2'"):
        FastFSDPStrategy(sharding="hsdp", outer_sync={"every": 4})


def test_one_node_is_refused_when_the_trainer_is_built_before_any_process_starts():
    with pytest.raises(ValueError, match=r"outer_sync synchronises across nodes and this job has num_nodes=1"):
        L.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy=FastDDPStrategy(outer_sync={"every": 4}))


def test_the_schedule_syncs_one_fragment_every_every_over_fragments_steps():
    settings = OuterSync(every=6, fragments=3, delay=1)
    assert settings.sync_steps(1, 12) == [(2, 0), (4, 1), (6, 2), (8, 0), (10, 1), (12, 2)]
    assert OuterSync(every=4, fragments=1, delay=0).sync_steps(1, 9) == [(4, 0), (8, 0)]


def test_fragments_are_runs_of_blocks_and_hold_every_trainable_parameter_once():
    model = tiny_gpt(n_layer=4)
    blocks = list(model.blocks)
    fragments = split_into_fragments(model, blocks, 2)
    held = [id(p) for fragment in fragments for p in fragment.parameters()]
    assert sorted(held) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    assert {id(p) for p in blocks[1].parameters()} <= {id(p) for p in fragments[0].parameters()}
    assert {id(p) for p in blocks[2].parameters()} <= {id(p) for p in fragments[1].parameters()}
    with pytest.raises(ValueError, match=r"outer_sync.fragments=3 does not divide the model's 4 blocks"):
        split_into_fragments(model, blocks, 3)


def test_bench_and_the_setup_vocabulary_know_both_forms():
    setups = all_setups()
    forms = {"ddp-diloco": 1, "ddp-streaming-diloco": 4, "fsdp-zero3-diloco": 1, "fsdp-zero3-streaming-diloco": 4}
    for name, fragments in forms.items():
        row = setups[name]
        assert row.strategy_args["outer_sync"]["fragments"] == fragments and not row.exact
        assert row.unavailable(Recipe({}), 2, nodes=1).startswith("synchronises across nodes")
        assert row.unavailable(Recipe({}), 2, nodes=2) is None
        assert Setup.from_strategy(row.strategy_class, row.strategy_args).name == name


def _node_commands(
    options: dict, steps: int, *checkpointing: str, nodes: int = 2, **environment: str
) -> tuple[list, list]:
    """The command and environment of each of ``nodes`` "nodes" of this machine running the outer_sync fit."""
    port = free_port_span(1 + nodes)  # each node's store at +1+node (node 0's the register); the lighthouse: any
    command = [sys.executable, "-m", "tests.support.outer_sync_fit", json.dumps(options), str(steps), *checkpointing]
    environments = [
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node), **environment}
        for node in range(nodes)
    ]
    return [command] * nodes, environments


def _node_fits(
    options: dict, steps: int, *checkpointing: str, ranks_per_node: int = 1, engine: str = "ddp", **environment: str
) -> list[dict]:
    """Each rank's report of a fit on two "nodes" of this machine, by node then local rank."""
    commands, environments = _node_commands(
        options, steps, *checkpointing, EMULATED_RANKS_PER_NODE=str(ranks_per_node), OUTER_SYNC_FIT_ENGINE=engine,
        **environment,
    )  # fmt: skip
    outputs = run_processes(commands, environments, timeout=240, forked=True)
    reports = [json.loads(line[4:]) for o in outputs for line in o.stdout.splitlines() if line.startswith("FIT ")]
    assert len(reports) == 2 * ranks_per_node, "\n".join(f"--- node {o.rank}:\n{o.stdout[-3000:]}" for o in outputs)
    return sorted(reports, key=lambda report: (report["node"], report["local_rank"]))


def _assert_held_as_modelled(options: dict, held_numels: list[int], report: dict) -> None:
    """What doctor --simulate adds for outer_sync on a rank holding ``held_numels`` of each fragment is what torchft
    held on the rank of ``report`` (docs/outer-sync.md, "Memory")."""
    modelled = outer_sync_memory(OuterSync(**options), held_numels, torch.float32)
    for name, measured in report["held_bytes"].items():
        assert getattr(modelled, name) == pytest.approx(measured, rel=0.10), name


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_nodes_sync_each_fragment_every_h_steps_and_agree_on_the_global_weights():
    options, steps = {"every": 4, "fragments": 2, "delay": 1}, 12
    node0, node1 = _node_fits(options, steps)
    schedule = OuterSync(**options).sync_steps(1, steps)
    assert [step for step, _ in schedule] == [2, 4, 6, 8, 10, 12]
    for node in (node0, node1):
        # After step s (1-based), as many outer steps were applied as the schedule has up to s.
        assert node["syncs"] == [sum(1 for step, _ in schedule if step <= s) for s in range(1, steps + 1)]
        # A fragment's bf16 pseudo-gradient is sent `delay` steps before the step that applies it, and nothing else.
        sent = {step - options["delay"]: 2 * node["fragment_numels"][fragment] for step, fragment in schedule}
        assert node["outer_bytes"] == [sent.get(s, 0) for s in range(1, steps + 1)]
    assert node0["losses"] != node1["losses"]  # each node trains on its own data between syncs
    # Under SyncFreeLogging (and SpeedMonitor), no step waits on the device, the outer syncs' steps included.
    assert node0["host_syncs"] == node1["host_syncs"] == [0] * steps
    # Validation and the final model are the global weights, bitwise the same on both nodes; every node evaluates
    # all of the validation data, so both log the same validation loss (and would take the same EarlyStopping step).
    assert node0["validated"] == node1["validated"] and len(node0["validated"]) == 2
    assert node0["val_losses"] == node1["val_losses"]
    assert node0["final"] == node1["final"]
    for node in (node0, node1):  # local rank 0 holds whole fragments
        _assert_held_as_modelled(options, node["fragment_numels"], node)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_fit_resumed_between_two_outer_syncs_goes_on_bit_for_bit(tmp_path):
    """Each node's own weights, inner optimizer and random states come back from its file beside the checkpoint;
    the outer momentum and the schedule from the checkpoint (whose weights are the global ones). The uninterrupted
    fit keeps the step of its highest validation loss too (step 12 here): ModelCheckpoint's decision is every rank
    of a node's (Lightning's own compares a node's count with the job's world size, and kept the first one)."""
    options = {"every": 4, "fragments": 2, "delay": 1}
    straight = _node_fits(options, 12, OUTER_SYNC_FIT_BEST=str(tmp_path / "best"))
    first, second = straight[0]["val_losses"]  # after steps 6 and 12
    best = 12 if second > first else 6
    assert [path.name for path in (tmp_path / "best").glob("*.ckpt")] == [f"best-step={best}.ckpt"]
    # Saves after step 6, mid-epoch: fragment 0 was just synced, fragment 1 (synced at step 4) is mid-way, and no
    # all-reduce is in flight.
    _node_fits(options, 6, str(tmp_path), "6")
    checkpoint = tmp_path / "step=6.ckpt"
    assert sorted(p.name for p in Path(OUTER_SYNC_NODES.save_folder(checkpoint, 6)).iterdir()) == [
        "node00000.pt",
        "node00001.pt",
    ]
    resumed = _node_fits(options, 12, str(tmp_path / "resumed"), "100", str(checkpoint))
    for before, after in zip(straight, resumed):
        assert after["losses"] == before["losses"][6:]  # steps 7-12, bit for bit
        assert after["syncs"] == before["syncs"][6:]
        assert after["final"] == before["final"]
        assert after["validated"] == before["validated"][1:]  # the validation after step 12


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_checkpoint_written_while_an_all_reduce_is_in_flight_is_refused_in_one_line(tmp_path):
    options = {"every": 4, "fragments": 2, "delay": 1}
    _node_fits(options, 3, str(tmp_path), "3")  # after step 3: fragment 1's all-reduce started, applied at step 4
    with pytest.raises(AssertionError, match="while a fragment's all-reduce was in flight, and cannot resume exactly"):
        _node_fits(options, 6, str(tmp_path / "resumed"), "100", str(tmp_path / "step=3.ckpt"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_per_node_send_each_pseudo_gradient_once_per_node_and_stay_equal():
    """Local rank 0 talks across nodes and hands each applied fragment to its node's other rank."""
    options, steps = {"every": 4, "fragments": 2, "delay": 1}, 8
    ranks = _node_fits(options, steps, ranks_per_node=2)
    assert [(r["node"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    talking, receiving = [ranks[0], ranks[2]], [ranks[1], ranks[3]]
    schedule = OuterSync(**options).sync_steps(1, steps)
    for rank in talking:
        sent = {step - options["delay"]: 2 * rank["fragment_numels"][fragment] for step, fragment in schedule}
        assert rank["outer_bytes"] == [sent.get(s, 0) for s in range(1, steps + 1)]
    assert all(rank["outer_bytes"] == [0] * steps for rank in receiving)
    assert all(set(rank["held_bytes"].values()) == {0} for rank in receiving)  # torchft's state is local rank 0's
    assert len({rank["final"] for rank in ranks}) == 1  # the global weights, on all four ranks
    assert len({tuple(rank["validated"]) for rank in ranks}) == 1


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp_inside_each_node_every_rank_sends_its_shard_and_a_resume_goes_on_bit_for_bit(tmp_path):
    """Under FSDP each rank sends its shard's pseudo-gradient to the rank holding the same shard on the other node:
    the link carries each pseudo-gradient once per node, as under DDP; each node's own shards and both optimizers'
    come back from its folder of shards beside the (sharded) checkpoint."""
    options, steps = {"every": 4, "fragments": 2, "delay": 1}, 8
    straight = _node_fits(options, steps, str(tmp_path), "4", ranks_per_node=2, engine="fsdp")
    assert [(r["node"], r["local_rank"]) for r in straight] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    schedule = OuterSync(**options).sync_steps(1, steps)
    numels = straight[0]["fragment_numels"]  # whole fragments (each rank holds half of each)
    sent = {step - options["delay"]: 2 * numels[fragment] for step, fragment in schedule}
    for node in (straight[:2], straight[2:]):
        assert all(any(rank["outer_bytes"]) for rank in node)  # every rank talks
        per_step = [sum(steps_bytes) for steps_bytes in zip(*(rank["outer_bytes"] for rank in node))]
        assert per_step == [sent.get(s, 0) for s in range(1, steps + 1)]
    for local_rank in (0, 1):  # the same shards of the global weights on both nodes, bit for bit
        on_node0, on_node1 = straight[local_rank], straight[2 + local_rank]
        assert on_node0["final"] == on_node1["final"] and on_node0["validated"] == on_node1["validated"]
        assert on_node0["losses"] != on_node1["losses"]
    assert straight[0]["final"] != straight[1]["final"]  # two halves
    assert len({tuple(rank["val_losses"]) for rank in straight}) == 1
    # Every rank holds torchft's state of its shard of each fragment, the outer momentum too (momentum 0.9 by default).
    model = tiny_gpt()
    fragments = split_into_fragments(model, list(model.blocks), options["fragments"])
    assert shard_numels(fragments, 1, 0) == numels and OuterSync(**options).momentum > 0
    for rank in straight:
        assert all(rank["held_bytes"].values())
        _assert_held_as_modelled(options, shard_numels(fragments, 2, rank["local_rank"]), rank)
    nodes = Path(OUTER_SYNC_NODES.save_folder(tmp_path / "step=4.ckpt", 4))
    assert (tmp_path / "step=4.ckpt").is_dir() and sorted(p.name for p in nodes.iterdir()) == ["node00000", "node00001"]
    resumed = _node_fits(
        options, steps, str(tmp_path / "resumed"), "100", str(tmp_path / "step=4.ckpt"), ranks_per_node=2, engine="fsdp"
    )
    for before, after in zip(straight, resumed):
        assert after["losses"] == before["losses"][4:]  # steps 5-8, bit for bit
        assert after["syncs"] == before["syncs"][4:] and after["final"] == before["final"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_stop_signal_saves_the_global_weights_beside_last_and_the_requeued_job_resumes_from_last(tmp_path):
    """Each node stops on its own (no agreement across nodes yet): what it saves holds the global weights only, and
    cannot resume the job. It goes to ``stopped.ckpt``: ``last.ckpt`` keeps the last periodic state, which the job
    requeued with ``--ckpt_path last`` resumes from (the stop save used to replace it, and that resume died)."""
    options = {"every": 4, "fragments": 2, "delay": 1}
    commands, environments = _node_commands(
        options, 12, str(tmp_path), "4", NODE_FAULT_SIGTERM_AT="5", OUTER_SYNC_FIT_SAVE_LAST="1"
    )
    nodes = [ForkedModule(command, {**os.environ, **extra}) for command, extra in zip(commands, environments)]
    assert [node.wait(timeout=240) for node in nodes] == [143, 143]
    stopped = torch.load(tmp_path / "stopped.ckpt", weights_only=True)["fast_outer_sync"]
    assert stopped == {"written_on_stop": True}
    with pytest.raises(UnusableCheckpointError, match="written when a stop signal ended the fit, and holds the global"):
        read_node_state(stopped, tmp_path / "stopped.ckpt", 0, 2, 1)  # given by path: one line
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 4
    resumed = _node_fits(options, 8, str(tmp_path), "4", "last", OUTER_SYNC_FIT_SAVE_LAST="1")
    assert [node["steps"] for node in resumed] == [[5, 6, 7, 8]] * 2  # from the periodic state of step 4


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("engine", "fault"), [("ddp", "SIGKILL"), ("fsdp", "SIGTERM")])
def test_with_min_nodes_a_lost_node_is_left_out_and_rejoins_from_a_live_peer_when_restarted(tmp_path, engine, fault):
    """Three nodes, ``min_nodes: 2``; node 2 is SIGKILLed after step 6 (the sync of step 6 done), or sent SIGTERM
    there (preempted alone: it stops by itself with exit status 143 and writes nothing, not being global rank 0), and
    started again with the same command once the others finished step 10 (they wait there for it to start training).

    The two others go on at the next sync without restarting: the quorum holds 2 nodes from step 8, no sync is
    skipped, one line names the lost node and the step. The restarted node joins at a later sync: it receives a live
    node's weights, Adam state, global copy and schedule from that node's memory (its bytes counted), starts its
    first step from the others' weights bit for bit, trains the remaining steps with them (equal weights after every
    sync) and reads none of the samples they read, even when it is also given a checkpoint to resume from (the live
    state replaces it); all three end with the same weights. Under FSDP (one rank per
    node: its one shard is the whole model) the weights and Adam's moments travel as DTensors' local shards."""
    options = {"every": 2, "fragments": 1, "delay": 0, "lr": 1.0, "momentum": 0.0, "nesterov": False, "min_nodes": 2}
    steps, started = 20, tmp_path / "started"
    faults = {"NODE_FAULT_KILL": "2:6", "NODE_FAULT_KILL_SIGNAL": fault, "NODE_FAULT_HOLD": f"10:{started}"}
    saved = tmp_path / "checkpoints"  # every 4 steps: those of steps 8 and 12 lack node 2's state
    commands, environments = _node_commands(
        options, steps, str(saved), "4", nodes=3, OUTER_SYNC_FIT_NODES="3", OUTER_SYNC_FIT_ENGINE=engine, **faults
    )
    nodes = [ForkedModule(command, {**os.environ, **extra}) for command, extra in zip(commands, environments)]
    # Under DDP it is given the checkpoint of step 4 to resume from as well (as `--ckpt_path last` would): the live
    # state replaces it.
    again = [*commands[2], str(saved / "step=4.ckpt")] if engine == "ddp" else commands[2]
    nodes[2] = start_again_once_held(nodes[2], again, environments[2], started, start=ForkedModule)  # after step 10
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0, 0], "\n".join(err[-3000:] for _, err in outputs)
    *survivors, restarted = [
        next(json.loads(line[4:]) for line in out.splitlines() if line.startswith("FIT ")) for out, _ in outputs
    ]
    came_back = restarted["rejoined"]["step"]  # the others' first sync after it started (timing decides which)
    assert came_back in range(12, steps + 1, 2)
    for node in survivors:
        assert node["steps"] == list(range(1, steps + 1))
        assert node["members"] == [3] * 7 + [2] * (came_back - 8) + [3] * (steps - came_back + 1)
        assert node["training_ranks"] == node["members"]  # what SpeedMonitor counts (one rank per node)
        assert node["syncs"] == [step // 2 for step in range(1, steps + 1)]  # no outer step lost
    assert restarted["steps"] == list(range(came_back + 1, steps + 1))
    assert restarted["syncs"] == [step // 2 for step in restarted["steps"]]
    assert restarted["first_digest"] == survivors[0]["digests"][came_back - 1]  # bit for bit, from the first step
    for step in restarted["steps"][1::2]:  # after each sync all three hold the same weights
        assert restarted["digests"][step - came_back - 1] == survivors[0]["digests"][step - 1]
        assert survivors[1]["digests"][step - 1] == survivors[0]["digests"][step - 1]
    assert restarted["final"] == survivors[0]["final"] == survivors[1]["final"]
    model = tiny_gpt()
    parameters, numel = len(list(model.parameters())), sum(p.numel() for p in model.parameters())
    # fp32: the weights, Adam's two moments and DiLoCo's global copy; Adam's step counts (outer SGD without momentum
    # holds no state).
    assert restarted["rejoined"]["bytes"] == 4 * numel * 4 + 4 * parameters
    source = restarted["rejoined"]["source"]
    assert source in ("node0", "node1")
    read = [{(epoch, index) for epoch, indices in node["samples"] for index in indices} for node in survivors]
    read.append({(epoch, index) for epoch, indices in restarted["samples"] for index in indices})
    assert [len(indices) for indices in read] == [4 * steps, 4 * steps, 4 * (steps - came_back)]
    assert not (read[0] & read[1] or read[2] & (read[0] | read[1]))  # no sample trained twice
    lost = "outer_sync: node2 left the job at step 8 (no heartbeat for 5 s, or not at the sync within 30 s): 2 of 3"
    back = f"outer_sync: node2 came back at step {came_back} (restarted): 3 of 3 nodes train on."
    assert all(lost in err and back in err for _, err in outputs[:2])
    rejoined = f"outer_sync: node2 rejoined the job at step {came_back} with the weights, optimizer state and schedule"
    assert f"{rejoined} of {source} ({restarted['rejoined']['bytes']:,} bytes from its memory" in outputs[2][1]
    assert not any("did not write its state of the checkpoint" in err for _, err in outputs)  # none waited for one
    assert sorted(path.name for path in saved.glob("*.ckpt")) == [f"step={step}.ckpt" for step in (12, 16, 20, 4, 8)]

    # The whole job resumed from step 8, which node 2 missed: it takes node 0's state and all three go on together.
    commands, environments = _node_commands(
        options, 10, str(tmp_path / "resumed"), "100", str(saved / "step=8.ckpt"), nodes=3, OUTER_SYNC_FIT_NODES="3",
        OUTER_SYNC_FIT_ENGINE=engine,
    )  # fmt: skip
    resumed = run_processes(commands, environments, timeout=240, forked=True)
    reports = [json.loads(line[4:]) for o in resumed for line in o.stdout.splitlines() if line.startswith("FIT ")]
    assert [report["steps"] for report in reports] == [[9, 10]] * 3
    assert len({report["final"] for report in reports}) == 1
    fallback = "outer_sync: node2 has no state in this checkpoint (it had left the job when step 8 was saved): it "
    assert f"{fallback}resumes from node0's weights and optimizer state" in resumed[2].stderr


@pytest.mark.slow
@pytest.mark.emulated
def test_what_crosses_the_link_is_the_pseudo_gradients_and_the_first_weights():
    """In the emulated cluster: each node's NIC sends what its outer all-reduces hold (a 2-node all-reduce sends
    its tensor once each way), the fp32 weights made equal before the first step, and little else."""
    reason = cannot_emulate()
    if reason:
        pytest.skip(reason)
    options, steps = {"every": 4, "fragments": 2, "delay": 1}, 12
    command = [sys.executable, "-m", "tests.support.outer_sync_fit", json.dumps(options), str(steps)]
    with EmulatedCluster(nodes=2, ranks_per_node=1) as cluster:
        before = cluster.link_counters()
        outputs = cluster.run(command, timeout=240, cwd=REPO_ROOT, forked=True)
        after = cluster.link_counters()
    reports = [json.loads(line[4:]) for o in outputs for line in o.stdout.splitlines() if line.startswith("FIT ")]
    for report, start, end in zip(reports, before, after):
        pseudo_gradients = sum(report["outer_bytes"])
        first_weights = 4 * sum(report["fragment_numels"])
        sent = end.sent - start.sent
        # Measured: 512,560 and 529,439 B sent for 341,760 B of tensors (the rest: headers, heartbeats, quorums).
        assert pseudo_gradients + first_weights <= sent <= pseudo_gradients + first_weights + CONTROL_BYTES
