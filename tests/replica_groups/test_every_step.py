"""FastDDPStrategy(replica_groups=...): each node a torchft replica group, the gradients averaged across the nodes
every step. What it computes is Lightning's DDP, bit for bit; a node lost mid-step costs that step, the others train
on, and a node started again takes a live node's state and trains on with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch

from lightning_fastdist import FastDDPStrategy
from lightning_fastdist.parallel.replica_groups.gradients import FlatGradients
from tests.support.harness import free_port_span, run_processes
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
    """GPT-2, a BatchNorm CNN and T5 (tied embeddings), fitted one after the other in the same processes (the second
    and third fits of the job), on two loopback nodes: under replica_groups and under Lightning's DDPStrategy the
    losses of every step on every node and the final weights are bitwise equal; the buffers every forward reads are
    node 0's, as DDP broadcasts rank 0's. What Lightning reduces over the job's ranks is reduced over every node: a
    value logged with ``sync_dist=True``, and ModelCheckpoint's decision to keep a step as the best by each rank's own
    training loss (every rank must agree: node 0 alone would keep GPT-2's step 6), and NonFiniteLoss's flag: T5's
    loss on node 1 at step 3 is NaN, and both nodes skip that step (node 0 alone would step on NaN gradients). Each
    step sends each node's gradients once across nodes, in fp32, with one mark per parameter."""
    runs = {}
    for engine in ("fast", "lightning"):
        commands, environments = _node_commands(
            engine, "gpt2,resnet,t5", 6, nodes=2, REPLICA_FIT_CHECKPOINTS=str(tmp_path), REPLICA_FIT_NAN="t5:1:3"
        )
        outputs = run_processes(commands, environments, timeout=240)
        runs[engine] = [_reports(output.stdout) for output in outputs]
    for fast_node, lightning_node in zip(runs["fast"], runs["lightning"], strict=True):
        assert [r["model"] for r in fast_node] == ["gpt2", "resnet", "t5"]
        for fast, lightning in zip(fast_node, lightning_node, strict=True):
            assert fast["losses"] == lightning["losses"], fast["model"]
            assert fast["digests"] == lightning["digests"] and fast["final"] == lightning["final"], fast["model"]
            assert fast["members"] == fast["training_ranks"] == [2] * 6 and fast["skipped"] == []
            assert fast["node_rank_mean"] == lightning["node_rank_mean"] == [0.5] * 5  # (0 + 1) / 2, logged at step
            assert fast["checkpoints"] == lightning["checkpoints"], fast["model"]
    node0, node1 = runs["fast"]
    assert node0[2]["digests"][2] == node0[2]["digests"][1] == node1[2]["digests"][2]  # T5's step 3 moved nothing
    assert node0[1]["buffers"] == node1[1]["buffers"] == runs["lightning"][0][1]["buffers"]  # the CNN's running stats
    parameters = list(HFCausalLM().parameters())
    assert node0[0]["sent"] == [4 * (sum(p.numel() for p in parameters) + len(parameters))] * 6
    assert node0[0]["checkpoints"] == ["step=2.ckpt"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_per_node_average_in_the_node_then_across_nodes_as_lightning_ddp_does_over_four_ranks():
    """Two nodes of two ranks: DDP averages inside each node, local rank 0 across the nodes, and the node's other rank
    takes the result. Every rank ends with the same weights, and the losses are those of Lightning's DDP over the four
    ranks up to float rounding (the sums are grouped by node: not bitwise); ``sync_dist`` reaches all four ranks."""
    runs = {}
    for engine in ("fast", "lightning"):
        commands, environments = _node_commands(engine, "gpt2", 3, nodes=2, EMULATED_RANKS_PER_NODE="2")
        outputs = run_processes(commands, environments, timeout=240)
        runs[engine] = sorted(
            (report for output in outputs for report in _reports(output.stdout)),
            key=lambda report: (report["node"], report["local_rank"]),
        )
    fast, lightning = runs["fast"], runs["lightning"]
    assert [(r["node"], r["local_rank"]) for r in fast] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({r["final"] for r in fast}) == 1  # every rank of every node holds the same weights
    for ours, theirs in zip(fast, lightning, strict=True):
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5, abs=0)
        assert ours["node_rank_mean"] == theirs["node_rank_mean"] == [0.5, 0.5]  # (0 + 0 + 1 + 1) / 4


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_node_lost_mid_step_costs_that_step_and_started_again_it_trains_on_from_a_live_peer(tmp_path):
    """Three nodes, ``min_nodes: 2``, GPT-2. Node 2 is SIGKILLed during step 6's backward, once that step's quorum
    holds it; the others' all-reduce of step 6 fails, the step is not applied (no weight moves), and they train on
    from step 7 without it. Node 2, started again with the same command once they finished step 10, takes a live
    node's weights and Adam state from its memory (the bytes counted) at the quorum of a later step, sits that step
    out (torchft counts a node that heals out), ends it with their weights bit for bit, and trains on with them. No
    sample is read by two nodes."""
    steps, started = 16, tmp_path / "started"
    faults = {"NODE_FAULT_KILL": "2:6", "NODE_FAULT_KILL_IN": "backward", "NODE_FAULT_HOLD": f"10:{started}"}
    commands, environments = _node_commands("fast", "gpt2", steps, nodes=3, min_nodes=2, **faults)
    nodes = [
        subprocess.Popen(
            command, env={**os.environ, **extra}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for command, extra in zip(commands, environments)
    ]
    nodes[2] = start_again_once_held(nodes[2], commands[2], environments[2], started)
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0, 0], "\n".join(err[-3000:] for _, err in outputs)
    (survivor, other), (restarted,) = [_reports(out)[0] for out, _ in outputs[:2]], _reports(outputs[2][0])
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
    assert source in ("node0", "node1")
    read = [{(epoch, i) for epoch, ids in node["samples"] for i in ids} for node in (survivor, other, restarted)]
    assert [len(ids) for ids in read] == [4 * steps, 4 * steps, 4 * (steps - came_back)]
    assert not (read[0] & read[1] or read[2] & (read[0] | read[1]))  # no sample read by two nodes
    for _, err in outputs[:2]:
        assert "replica_groups: step 6 is not applied on node" in err
        assert "replica_groups: node2 left the job at step 6 (no heartbeat for 5 s, or not at the step's quorum" in err
        assert f"replica_groups: node2 came back at step {came_back} (restarted): 3 of 3 nodes train on." in err
    rejoined = f"replica_groups: node2 rejoined the job at step {came_back} with the weights and optimizer state of"
    assert f"{rejoined} {source} ({restarted['rejoined']['bytes']:,} bytes from its memory" in outputs[2][1]


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
