"""FastDDPStrategy(replica_groups=...) and FastFSDPStrategy(replica_groups=...): each node a torchft replica group,
the gradients averaged across the nodes every step. What they compute is Lightning's DDP, bit for bit with one rank
per node; a node lost mid-step costs that step, the others train on, and a node started again takes a live node's
state and trains on with them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch

from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy
from lightning_fastdist.parallel.replica_groups.gradients import FlatGradients
from lightning_fastdist.planning.fsdp_shards import shard_numel
from tests.support.harness import cli_command, free_port_span, run_processes
from tests.support.model_zoo import HFCausalLM
from tests.support.node_faults import start_again_once_held


def test_gradients_cross_as_one_flat_tensor_per_dtype_and_a_parameter_no_node_used_keeps_none():
    used, unused_here, unused_anywhere = (torch.nn.Parameter(torch.zeros(2, 3)) for _ in range(3))
    double = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    gradients = FlatGradients([used, unused_here, unused_anywhere, double])
    used.grad, double.grad = torch.ones(2, 3), torch.full((2,), 2.0, dtype=torch.float64)
    flats = gradients.gather()
    assert [(flat.dtype, flat.numel()) for flat in flats] == [(torch.float32, 3 * 6 + 3), (torch.float64, 2 + 1)]
    assert flats[0][-3:].tolist() == [1.0, 0.0, 0.0]  # which parameters have a gradient on this node
    flats[0][6:12], flats[0][-2] = 0.5, 0.5  # averaged with a node that had one for the second
    gradients.scatter(apply=True)
    assert unused_here.grad.eq(0.5).all() and unused_anywhere.grad is None and double.grad.eq(2.0).all()
    assert gradients.gather() is flats  # the same tensors every step
    gradients.scatter(apply=False)  # a step that did not commit moves nothing
    assert all(p.grad is None for p in (used, unused_here, unused_anywhere, double))


def test_a_lightning_module_that_steps_its_optimizers_itself_is_refused_in_one_line():
    strategy = FastDDPStrategy(replica_groups={"min_nodes": 1})
    module = HFCausalLM()
    module.automatic_optimization = False
    with pytest.raises(ValueError, match=r"replica_groups averages the gradients of Lightning's automatic optimi"):
        strategy.replica_groups.start(module, module, [torch.optim.SGD(module.parameters(), lr=0.1)], timedelta(1))


def test_fsdp_names_itself_and_refuses_replica_groups_beside_outer_sync_in_one_line():
    with pytest.raises(ValueError, match=r"^FastFSDPStrategy: replica_groups.min_nodes=0 must be an integer >= 1.$"):
        FastFSDPStrategy(replica_groups={"min_nodes": 0})
    with pytest.raises(ValueError, match=r"^FastFSDPStrategy: outer_sync and replica_groups are two forms of train"):
        FastFSDPStrategy(replica_groups={"min_nodes": 1}, outer_sync={"every": 4})


def test_a_coordinator_address_that_is_not_host_port_is_refused_in_one_line_before_any_process_starts(monkeypatch):
    job = FastDDPStrategy(replica_groups={"min_nodes": 1}).replica_groups
    monkeypatch.setenv("LIGHTNING_FASTDIST_COORDINATOR", "vm")
    with pytest.raises(ValueError, match=r"^LIGHTNING_FASTDIST_COORDINATOR='vm' must be HOST:PORT of a running `"):
        job.check_launch(2)
    monkeypatch.setenv("LIGHTNING_FASTDIST_COORDINATOR", "vm:29400")
    job.check_launch(2)


def _node_commands(engine: str, models: str, steps: int, nodes: int, min_nodes: int = 1, **environment: str):
    port = free_port_span(3 + nodes)  # the lighthouse at +1, each node's store at +2+node
    command = [sys.executable, "-m", "tests.support.replica_groups_fit", engine, models, str(steps), str(min_nodes)]
    environments = [
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node),
         "REPLICA_FIT_NODES": str(nodes), **environment}
        for node in range(nodes)
    ]  # fmt: skip
    return [command] * nodes, environments


def _reports(output: str) -> list[dict]:
    return [json.loads(line[4:]) for line in output.splitlines() if line.startswith("FIT ")]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_nodes_compute_what_lightning_ddp_computes_bit_for_bit_on_models_we_did_not_write(tmp_path):
    """GPT-2, a BatchNorm CNN and T5 (tied embeddings), fitted one after the other in the same processes by
    FastDDPStrategy, then by FastFSDPStrategy (the second to sixth fits of the job), on two loopback nodes: under
    replica_groups and under Lightning's DDPStrategy the losses of every step on every node and the final weights are
    bitwise equal (FSDP's T5: within float rounding); the buffers every forward reads are node 0's, as DDP broadcasts
    rank 0's. What Lightning reduces over the job's ranks is reduced over every node: a
    value logged with ``sync_dist=True``, and ModelCheckpoint's decision to keep a step as the best by each rank's own
    training loss (every rank must agree: node 0 alone would keep GPT-2's step 6), and NonFiniteLoss's flag: T5's
    loss on node 1 at step 3 is NaN, and both nodes skip that step (node 0 alone would step on NaN gradients). Each
    step sends each node's gradients once across nodes, in fp32, with one mark per parameter."""
    runs = {}
    for engines in ("fast,fsdp", "lightning"):
        commands, environments = _node_commands(
            engines, "gpt2,resnet,t5", 6, nodes=2, REPLICA_FIT_CHECKPOINTS=str(tmp_path), REPLICA_FIT_NAN="t5:1:3"
        )
        outputs = run_processes(commands, environments, timeout=300)
        runs[engines] = [_reports(output.stdout) for output in outputs]
    for ours_node, lightning_node in zip(runs["fast,fsdp"], runs["lightning"], strict=True):
        assert [(r["engine"], r["model"]) for r in ours_node] == [
            (engine, model) for engine in ("fast", "fsdp") for model in ("gpt2", "resnet", "t5")
        ]
        for ours, lightning in zip(ours_node, lightning_node * 2):
            label = f"{ours['engine']} {ours['model']}"
            if label == "fsdp t5":  # FSDP's T5 differs from DDP's in float rounding
                assert ours["losses"] == pytest.approx(lightning["losses"], rel=1e-6, abs=0, nan_ok=True)
            else:
                assert ours["losses"] == lightning["losses"], label
                assert ours["digests"] == lightning["digests"] and ours["final"] == lightning["final"], label
            assert ours["members"] == ours["training_ranks"] == [2] * 6 and ours["skipped"] == []
            assert ours["node_rank_mean"] == lightning["node_rank_mean"] == [0.5] * 5  # (0 + 1) / 2, logged at step
            assert ours["checkpoints"] == lightning["checkpoints"], label
    node0, node1 = runs["fast,fsdp"]
    for t5 in (2, 5):
        assert node0[t5]["digests"][2] == node0[t5]["digests"][1] == node1[t5]["digests"][2]  # step 3 moved nothing
    for resnet in (1, 4):
        assert node0[resnet]["buffers"] == node1[resnet]["buffers"] == runs["lightning"][0][1]["buffers"]
    parameters = list(HFCausalLM().parameters())
    for gpt2 in (0, 3):
        assert node0[gpt2]["sent"] == [4 * (sum(p.numel() for p in parameters) + len(parameters))] * 6
        assert node0[gpt2]["checkpoints"] == ["step=2.ckpt"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_per_node_average_in_the_node_then_across_nodes_as_lightning_ddp_does_over_four_ranks():
    """Two nodes of two ranks, FastDDPStrategy then FastFSDPStrategy in the same processes. Under DDP the gradients
    are averaged inside each node, then by local rank 0 across the nodes, and the node's other rank takes the result:
    every rank ends with the same weights. Under FSDP (zero3) each rank's shard of the gradients, reduce-scattered
    inside the node, is averaged with the rank holding the same shard on the other node: the ranks holding a shard
    end with the same shard, and between them they send what a DDP node sends. Under both the losses are those of
    Lightning's DDP over the four ranks up to float rounding (the sums are grouped by node: not bitwise);
    ``sync_dist`` reaches all four ranks."""
    runs = {}
    for engines in ("fast,fsdp", "lightning"):
        commands, environments = _node_commands(engines, "gpt2", 3, nodes=2, EMULATED_RANKS_PER_NODE="2")
        outputs = run_processes(commands, environments, timeout=300)
        runs[engines] = sorted(
            (report for output in outputs for report in _reports(output.stdout)),
            key=lambda report: (report["engine"], report["node"], report["local_rank"]),
        )
    fast, fsdp, lightning = runs["fast,fsdp"][:4], runs["fast,fsdp"][4:], runs["lightning"]
    for engine, reports in (("fast", fast), ("fsdp", fsdp)):
        assert [(r["engine"], r["node"], r["local_rank"]) for r in reports] == [
            (engine, node, local_rank) for node in (0, 1) for local_rank in (0, 1)
        ]
        for ours, theirs in zip(reports, lightning, strict=True):
            assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5, abs=0), engine
            assert ours["node_rank_mean"] == theirs["node_rank_mean"] == [0.5, 0.5]  # (0 + 0 + 1 + 1) / 4
    assert len({r["final"] for r in fast}) == 1  # every rank of every node holds the same weights
    assert [r["final"] for r in fsdp[:2]] == [r["final"] for r in fsdp[2:]]  # each shard the same on both nodes
    assert fsdp[0]["final"] != fsdp[1]["final"]  # two shards
    assert [r["members"] for r in fsdp] == [[2] * 3] * 4
    marks = 4 * len(list(HFCausalLM().parameters()))  # each rank marks which parameters have a gradient
    assert fsdp[0]["sent"][0] + fsdp[1]["sent"][0] == fast[0]["sent"][0] + marks  # the link carries the gradients once


@pytest.mark.slow
@pytest.mark.multiprocess
def test_node_0_lost_mid_step_costs_that_step_and_started_again_it_trains_on_from_a_live_peer(tmp_path):
    """Three nodes, ``min_nodes: 2``, GPT-2, the lighthouse and the nodes' meeting store in a ``lightning-fastdist
    coordinator`` outside them. Node 0 (global rank 0) is SIGKILLed during step 6's backward, once that step's quorum
    holds it; the others' all-reduce of step 6 fails, the step is not applied (no weight moves), and they train on
    from step 7 without it. Node 0, started again with the same command once they finished step 10, finds them
    training in the coordinator's store, takes a live node's weights and Adam state from its memory (the bytes
    counted) at the quorum of a later step, sits that step out (torchft counts a node that heals out), ends it with
    their weights bit for bit, and trains on with them. No sample is read by two nodes."""
    steps, started, port = 16, tmp_path / "started", free_port_span(2)
    coordinator = subprocess.Popen(
        cli_command("coordinator", "--port", str(port), "--min-nodes", "2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # torchft's lighthouse logs every quorum
        text=True,
    )
    assert coordinator.stdout is not None
    announced = coordinator.stdout.readline()  # once both serve
    assert f"LIGHTNING_FASTDIST_COORDINATOR={socket.gethostname()}:{port}" in announced, announced
    faults = {"NODE_FAULT_KILL": "0:6", "NODE_FAULT_KILL_IN": "backward", "NODE_FAULT_HOLD": f"10:{started}"}
    commands, environments = _node_commands(
        "fast", "gpt2", steps, nodes=3, min_nodes=2, LIGHTNING_FASTDIST_COORDINATOR=f"127.0.0.1:{port}", **faults
    )
    nodes = [
        subprocess.Popen(
            command, env={**os.environ, **extra}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for command, extra in zip(commands, environments)
    ]
    try:
        nodes[0] = start_again_once_held(nodes[0], commands[0], environments[0], started)
        outputs = [node.communicate(timeout=240) for node in nodes]
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=30)
    assert [node.returncode for node in nodes] == [0, 0, 0], "\n".join(err[-3000:] for _, err in outputs)
    assert coordinator.returncode == 0
    restarted, survivor, other = [_reports(out)[0] for out, _ in outputs]
    came_back = restarted["rejoined"]["step"]  # the step the others had taken when its first step's quorum formed
    assert came_back in range(10, steps)
    for node in (survivor, other):
        assert node["steps"] == list(range(1, steps + 1))
        assert node["skipped"] == [6] and node["digests"][5] == node["digests"][4]  # step 6 moved no weight
        assert node["members"] == [3] * 6 + [2] * (came_back - 6) + [3] * (steps - came_back)
        assert node["training_ranks"] == node["members"]  # what SpeedMonitor counts (one rank per node)
    assert other["digests"] == survivor["digests"]
    assert restarted["steps"] == list(range(came_back + 1, steps + 1))
    assert restarted["first_digest"] == survivor["digests"][came_back - 1]  # the state it received
    assert restarted["digests"] == survivor["digests"][came_back:]  # equal after its first step, and every one after
    parameters = list(HFCausalLM().parameters())
    # fp32 weights and Adam's two moments, and Adam's step counts.
    assert restarted["rejoined"]["bytes"] == 3 * 4 * sum(p.numel() for p in parameters) + 4 * len(parameters)
    source = restarted["rejoined"]["source"]
    assert source in ("node1", "node2")
    read = [{(epoch, i) for epoch, ids in node["samples"] for i in ids} for node in (survivor, other, restarted)]
    assert [len(ids) for ids in read] == [4 * steps, 4 * steps, 4 * (steps - came_back)]
    assert not (read[0] & read[1] or read[2] & (read[0] | read[1]))  # no sample read by two nodes
    for _, err in outputs[1:]:
        assert "replica_groups: step 6 is not applied on node" in err
        assert "replica_groups: node0 left the job at step 6 (no heartbeat for 5 s, or not at the step's quorum" in err
        assert f"replica_groups: node0 came back at step {came_back} (restarted): 3 of 3 nodes train on." in err
    rejoined = f"replica_groups: node0 rejoined the job at step {came_back} with the weights and optimizer state of"
    assert f"{rejoined} {source} ({restarted['rejoined']['bytes']:,} bytes from its memory" in outputs[0][1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_under_fsdp_each_rank_of_a_restarted_node_takes_its_shard_from_the_rank_holding_it_on_a_live_node(tmp_path):
    """Two nodes of two FSDP ranks, ``min_nodes: 1``, GPT-2. Node 1 is SIGKILLed during step 3's backward: node 0's
    two ranks do not apply step 3 (both agree, through torchft's commit) and train on alone. Node 1, started again,
    heals rank by rank: each of its ranks receives, from the rank of node 0 holding the same shard, that shard of the
    weights and of Adam's state, then ends each step with that rank's shard bit for bit."""
    steps, started = 10, tmp_path / "started"
    faults = {"NODE_FAULT_KILL": "1:3", "NODE_FAULT_KILL_IN": "backward", "NODE_FAULT_HOLD": f"6:{started}"}
    commands, environments = _node_commands("fsdp", "gpt2", steps, nodes=2, EMULATED_RANKS_PER_NODE="2", **faults)
    nodes = [
        subprocess.Popen(
            command, env={**os.environ, **extra}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for command, extra in zip(commands, environments)
    ]
    nodes[1] = start_again_once_held(nodes[1], commands[1], environments[1], started)
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(err[-3000:] for _, err in outputs)
    survivors, restarted = (sorted(_reports(out), key=lambda r: r["local_rank"]) for out, _ in outputs)
    came_back = restarted[0]["rejoined"]["step"]
    assert came_back in range(6, steps)
    parameters = list(HFCausalLM().parameters())
    for local_rank, (survivor, again) in enumerate(zip(survivors, restarted, strict=True)):
        assert survivor["steps"] == list(range(1, steps + 1)) and survivor["skipped"] == [3]
        assert survivor["digests"][2] == survivor["digests"][1]  # step 3 moved no weight
        assert survivor["members"] == [2] * 3 + [1] * (came_back - 3) + [2] * (steps - came_back)
        assert again["rejoined"]["source"] == "node0" and again["rejoined"]["step"] == came_back
        assert again["steps"] == list(range(came_back + 1, steps + 1))
        assert again["first_digest"] == survivor["digests"][came_back - 1]  # the shard it received
        assert again["digests"] == survivor["digests"][came_back:]
        shard = sum(shard_numel(p.shape, 2, local_rank) for p in parameters)
        assert again["rejoined"]["bytes"] == 3 * 4 * shard + 4 * len(parameters)  # its shard of weights and Adam
    assert survivors[0]["digests"] != survivors[1]["digests"]  # two shards
    assert "replica_groups: step 3 is not applied on node0" in outputs[0][1]
    assert "with the weights and optimizer state of node0 (local rank 0's shard: " in outputs[1][1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_stop_signal_to_every_node_saves_once_and_the_whole_job_resumes_bit_for_bit(tmp_path):
    """SIGTERM to both nodes during step 4: both exit 143, global rank 0 writes one ``last.ckpt`` of step 4, and the
    whole job resumed from it trains steps 5-8 with the losses and weights of an uninterrupted run."""
    saving = {"REPLICA_FIT_CHECKPOINTS": str(tmp_path), "REPLICA_FIT_SAVE_EVERY": "100"}
    straight = [_reports(o.stdout)[0] for o in run_processes(*_node_commands("fast", "gpt2", 8, nodes=2), timeout=240)]
    commands, environments = _node_commands("fast", "gpt2", 8, nodes=2, NODE_FAULT_SIGTERM_AT="4", **saving)
    stopped = [
        subprocess.Popen(
            command, env={**os.environ, **extra}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for command, extra in zip(commands, environments)
    ]
    for node in stopped:
        node.communicate(timeout=240)
    assert [node.returncode for node in stopped] == [143, 143]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt"]
    last = tmp_path / "last.ckpt"
    commands, environments = _node_commands("fast", "gpt2", 8, nodes=2, REPLICA_FIT_RESUME=str(last))
    resumed = [_reports(output.stdout)[0] for output in run_processes(commands, environments, timeout=240)]
    for before, after in zip(straight, resumed, strict=True):
        assert after["steps"] == [5, 6, 7, 8]
        assert after["losses"] == before["losses"][4:] and after["final"] == before["final"]
