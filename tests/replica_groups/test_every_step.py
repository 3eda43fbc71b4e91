"""FastDDPStrategy(replica_groups=...) and FastFSDPStrategy(replica_groups=...): each node a torchft replica group,
the gradients averaged across the nodes every step. What they compute is Lightning's DDP, bit for bit with one rank
per node; a node lost mid-step costs that step, the others train on, and a node started again takes a live node's
state and trains on with them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy
from lightning_fastdist.parallel.across_nodes.replica_groups.gradients import FlatGradients
from lightning_fastdist.planning.fsdp_shards import shard_numel
from lightning_fastdist.strategies.across_nodes import TrainingStart
from tests.support.emulated_cluster import REPO_ROOT, EmulatedCluster, cannot_emulate
from tests.support.harness import ForkedModule, cli_command, free_port_span, run_function, run_processes
from tests.support.listeners import listening_addresses, on_a_wildcard
from tests.support.lost_node_runs import fit_reports
from tests.support.model_zoo import HFCausalLM
from tests.support.node_faults import start_again_once_held, wait_until_held


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
        optimizers = [torch.optim.SGD(module.parameters(), lr=0.1)]
        strategy.across_nodes.start(TrainingStart(module, module, optimizers, timedelta(1)))


def test_fsdp_names_itself_and_refuses_replica_groups_beside_outer_sync_in_one_line():
    with pytest.raises(ValueError, match=r"^FastFSDPStrategy: replica_groups.min_nodes=0 must be an integer >= 1.$"):
        FastFSDPStrategy(replica_groups={"min_nodes": 0})
    with pytest.raises(ValueError, match=r"^FastFSDPStrategy: outer_sync and replica_groups are two forms of train"):
        FastFSDPStrategy(replica_groups={"min_nodes": 1}, outer_sync={"every": 4})


def test_a_coordinator_address_that_is_not_host_port_is_refused_in_one_line_before_any_process_starts(monkeypatch):
    job = FastDDPStrategy(replica_groups={"min_nodes": 1}).across_nodes
    monkeypatch.setenv("LIGHTNING_FASTDIST_COORDINATOR", "vm")
    with pytest.raises(ValueError, match=r"^LIGHTNING_FASTDIST_COORDINATOR='vm' must be HOST:PORT of a running `"):
        job.check_launch(2)
    monkeypatch.setenv("LIGHTNING_FASTDIST_COORDINATOR", "vm:29400")
    job.check_launch(2)


def _node_commands(engine: str, models: str, steps: int, nodes: int, min_nodes: int = 1, **environment: str):
    port = free_port_span(1 + nodes)  # each node's store at +1+node (node 0's the register); the lighthouse: any
    command = [sys.executable, "-m", "tests.support.replica_groups_fit", engine, models, str(steps), str(min_nodes)]
    environments = [
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node),
         "REPLICA_FIT_NODES": str(nodes), **environment}
        for node in range(nodes)
    ]  # fmt: skip
    return [command] * nodes, environments


def _reports(output: str) -> list[dict]:
    return [json.loads(line[4:]) for line in output.splitlines() if line.startswith("FIT ")]


LATE_HEARTBEAT_S = 2.0  # node 1's manager starts this long after node 0 asked for its first quorum
REJOIN_TIMEOUT_S = 60  # torchft's quorum timeout where a restarted node waits to be taken back


def _equalize_with_a_late_node(first_port: int) -> dict:
    """One node of two (``RANK``) makes its weights equal to node 0's through a real lighthouse; node 1's torchft
    manager starts late, so that the lighthouse has not heard from it when node 0 asks for its first quorum."""
    from lightning_fastdist.parallel.across_nodes.group import Membership, ReplicaGroup, equalize_weights
    from lightning_fastdist.parallel.across_nodes.state_transport import NodeStateTransport
    from lightning_fastdist.parallel.across_nodes.torchft_servers import Lighthouse, new_manager

    node = int(os.environ["RANK"])
    timeout = timedelta(seconds=60)
    finished = torch.distributed.TCPStore("127.0.0.1", first_port, 2, is_master=node == 0, timeout=timeout)
    gate_register = torch.distributed.TCPStore("127.0.0.1", first_port, is_master=False, timeout=timeout)
    lighthouse = Lighthouse("127.0.0.1", 1, "test", gate_register) if node == 0 else None
    if lighthouse is not None:
        lighthouse.announce(finished)
    if node == 1:
        finished.wait(["node 0 asks"])
        time.sleep(LATE_HEARTBEAT_S)  # node 0's first quorum forms meanwhile, without this node
    group = ReplicaGroup(
        node_rank=node, num_nodes=2, local_rank=0, sharded=False, ranks_per_node=1, min_nodes=1,
        store_host="127.0.0.1", store_port=first_port + 1 + node, lighthouse=finished.get("lighthouse").decode(),
        first_store=("127.0.0.1", first_port),
    )  # fmt: skip
    # The node's own store, where its manager's process groups meet (NodeProcessGroups hosts it in a fit).
    node_store = torch.distributed.TCPStore("127.0.0.1", group.store_port, is_master=True, wait_for_workers=False)
    transport = NodeStateTransport("127.0.0.1", "a token", timeout)
    manager = new_manager(group, timeout, transport, async_quorum=True, owner="test")
    reports: list[str] = []
    membership = Membership("replica_groups", 2, lambda: 0, "the step's quorum", reports.append)
    membership.watch(manager)
    torch.manual_seed(node)  # different weights on each node until they are made equal
    model = torch.nn.Linear(8, 8)
    torch.manual_seed(0)
    node_0_weights = torch.nn.Linear(8, 8).state_dict()
    if node == 0:
        finished.set("node 0 asks", "")
    equalize_weights(manager, model, "test", membership, timeout)
    result = {
        "equal to node 0's": all(torch.equal(model.state_dict()[k], v) for k, v in node_0_weights.items()),
        "participants": manager.num_participants(),
        "reports": reports,
    }
    finished.add("done", 1)
    while node == 0 and finished.add("done", 0) < 2:  # node 0's lighthouse and store serve until node 1 is done
        time.sleep(0.05)
    manager.shutdown(wait=False)
    if lighthouse is not None:
        lighthouse.shutdown()
    del node_store
    return result


def _rejoin_as_the_job_ends(first_port: int) -> dict:
    """Node 0 (``RANK`` 0) holds the register and lighthouse of a job whose nodes train; node 1 starts as a restarted
    node does (it reads that the nodes train) and waits for the quorum that takes it back, which never comes: node 0
    ends the job (closes the fit in the register) once node 1 read it. Node 1's run ends in one error."""
    import threading

    from lightning_fastdist.parallel.across_nodes.group import TRAINING_KEY, FitRegister, JobEndedError, ReplicaGroup
    from lightning_fastdist.parallel.across_nodes.replica_groups.run import EveryStepRun
    from lightning_fastdist.parallel.across_nodes.torchft_servers import Lighthouse

    node = int(os.environ["RANK"])
    timeout = timedelta(seconds=REJOIN_TIMEOUT_S)
    register = torch.distributed.TCPStore("127.0.0.1", first_port, 2, is_master=node == 0, timeout=timeout)
    if node == 0:
        gate_register = torch.distributed.TCPStore("127.0.0.1", first_port, is_master=False, timeout=timeout)
        lighthouse = Lighthouse("127.0.0.1", 2, "test", gate_register)  # a quorum needs both nodes: none forms
        lighthouse.announce(register)
        register.set(TRAINING_KEY, "1")  # the nodes train their first fit
        register.wait(["node 1 read the register"])
        register.delete_key(TRAINING_KEY)  # node 0's fit ends (FitRegister.close)
        register.wait(["node 1 is done"])
        lighthouse.shutdown()
        return {}

    def say_once_read() -> None:
        while FitRegister.fits_in_this_process != 1:  # set where a restarted node reads which fit it rejoins
            time.sleep(0.01)
        register.set("node 1 read the register", "")

    threading.Thread(target=say_once_read, daemon=True).start()
    group = ReplicaGroup(
        node_rank=1, num_nodes=2, local_rank=0, sharded=False, ranks_per_node=1, min_nodes=1,
        store_host="127.0.0.1", store_port=first_port + 2, lighthouse=register.get("lighthouse").decode(),
        first_store=("127.0.0.1", first_port), fit=1, transport_token="a token",
    )  # fmt: skip
    node_store = torch.distributed.TCPStore("127.0.0.1", group.store_port, is_master=True, wait_for_workers=False)
    model = torch.nn.Linear(8, 8)
    try:  # torchft's timeout would end it in torchft's TimeoutError instead
        EveryStepRun(model, torch.optim.SGD(model.parameters(), lr=0.1), group, timeout)
        ended = "it rejoined"
    except JobEndedError as error:
        ended = str(error)
    register.set("node 1 is done", "")
    del node_store
    return {"ended": ended}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_node_restarted_as_the_job_ends_says_so_at_once_instead_of_waiting_out_the_quorum():
    # Campaign trial 209 (seed 7): node 1, restarted, read that the nodes train as node 0 took its last step; node 0
    # finished and node 1 waited out torchft's quorum timeout, then ended in torchft's traceback.
    _, restarted = run_function(_rejoin_as_the_job_ends, 2, args=(free_port_span(3),), init_process_group=False)
    assert restarted["ended"] == (
        "replica_groups: node1 was started again as the job took its last steps, and the job ended before a quorum "
        "took this node back: nothing was trained here; the job's checkpoints are those its other nodes wrote."
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_node_the_lighthouse_has_not_heard_from_yet_is_waited_for_when_the_weights_are_made_equal():
    # Seen under load between two fits in one process: node 0's first quorum formed without node 1, whose manager had
    # not sent its first heartbeat yet; node 0 went on to its first step while node 1 was still making its weights
    # equal, and gloo failed on sizes that did not match.
    results = run_function(_equalize_with_a_late_node, 2, args=(free_port_span(3),), init_process_group=False)
    for node, result in enumerate(results):
        assert result["equal to node 0's"] and result["participants"] == 2, (node, result)
        assert result["reports"] == [], result["reports"]  # node 1 did not come back: it had not left


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
        outputs = run_processes(commands, environments, timeout=300, forked=True)
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
    """Two nodes of two ranks: DDP averages inside each node, local rank 0 across the nodes, and the node's other rank
    takes the result. Every rank ends with the same weights, and the losses are those of Lightning's DDP over the four
    ranks up to float rounding (the sums are grouped by node: not bitwise); ``sync_dist`` reaches all four ranks. (Two
    FSDP ranks per node: the node-0 test below.)"""
    runs = {}
    for engine in ("fast", "lightning"):
        commands, environments = _node_commands(engine, "gpt2", 3, nodes=2, EMULATED_RANKS_PER_NODE="2")
        outputs = run_processes(commands, environments, timeout=240, forked=True)
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
def test_node_0_lost_mid_step_costs_that_step_and_started_again_each_rank_takes_its_shard_from_a_live_peer(tmp_path):
    """Two nodes of two FSDP ranks, ``min_nodes: 1``, GPT-2, the lighthouse and the nodes' meeting store in a
    ``lightning-fastdist coordinator`` outside them. Node 0 (global rank 0) is SIGKILLed during step 3's backward,
    once that step's quorum holds it: node 1's all-reduce of step 3 fails, both its ranks agree (torchft's commit)
    not to apply it, and node 1 trains on alone. Node 0, started again with the same command once node 1 finished
    step 6, finds it training in the coordinator's store and heals rank by rank: each of its ranks receives, from the
    rank of node 1 holding the same shard, that shard of the weights and of Adam's state (the bytes counted), sits
    that step out (torchft counts a node that heals out), then ends each step with that rank's shard bit for bit. No
    sample is read twice, and the two ranks of a node send the gradients across nodes once between them. A sharded
    checkpoint every 2 steps is written by the first node of the step's quorum: node 1's ranks while node 0 is away,
    so none is missing."""
    steps, started, port, saved = 10, tmp_path / "started", free_port_span(2), tmp_path / "checkpoints"
    coordinator = subprocess.Popen(
        cli_command("coordinator", "--port", str(port), "--min-nodes", "1", "--bind", "127.0.0.1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert coordinator.stdout is not None
    announced = coordinator.stdout.readline()  # once both serve
    assert f"LIGHTNING_FASTDIST_COORDINATOR=127.0.0.1:{port}" in announced, announced
    faults = {"NODE_FAULT_KILL": "0:3", "NODE_FAULT_KILL_IN": "backward", "NODE_FAULT_HOLD": f"6:{started}",
              "REPLICA_FIT_CHECKPOINTS": str(saved), "REPLICA_FIT_SAVE_EVERY": "2"}  # fmt: skip
    commands, environments = _node_commands(
        "fsdp", "gpt2", steps, nodes=2, EMULATED_RANKS_PER_NODE="2",
        LIGHTNING_FASTDIST_COORDINATOR=f"127.0.0.1:{port}", **faults,
    )  # fmt: skip
    nodes = [ForkedModule(command, {**os.environ, **extra}) for command, extra in zip(commands, environments)]
    listening: list[str] = []

    def look_then_start(command: list[str], environment: dict[str, str]) -> ForkedModule:
        """While node 1 holds at step 6: what it and the coordinator listen on (docs/security.md)."""
        listening.extend(listening_addresses([coordinator.pid, nodes[1].pid]))
        return ForkedModule(command, environment)

    try:
        nodes[0] = start_again_once_held(nodes[0], commands[0], environments[0], started, start=look_then_start)
        outputs = [node.communicate(timeout=240) for node in nodes]
    finally:
        coordinator.terminate()
        _, coordinator_lines = coordinator.communicate(timeout=30)
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(err[-3000:] for _, err in outputs)
    assert coordinator.returncode == 0
    # The register, the lighthouse, node 1's store, its fit's torchft store, manager server and state transports, gloo.
    assert len(listening) >= 5 and on_a_wildcard(listening) == [], listening
    # torchft's Rust side logs every quorum and commit at INFO unless RUST_LOG asks for it: here nothing did.
    assert not [lines for lines in (coordinator_lines, *(err for _, err in outputs)) if "[INFO] [torchft" in lines]
    restarted, survivors = (sorted(_reports(out), key=lambda r: r["local_rank"]) for out, _ in outputs)
    came_back = restarted[0]["rejoined"]["step"]  # the step node 1 had taken when node 0's first quorum formed
    assert came_back in range(6, steps)
    parameters = list(HFCausalLM().parameters())
    for local_rank, (survivor, again) in enumerate(zip(survivors, restarted, strict=True)):
        assert survivor["steps"] == list(range(1, steps + 1)) and survivor["skipped"] == [3]
        assert survivor["digests"][2] == survivor["digests"][1]  # step 3 moved no weight
        assert survivor["members"] == [2] * 3 + [1] * (came_back - 3) + [2] * (steps - came_back)
        assert survivor["training_ranks"] == [2 * members for members in survivor["members"]]  # SpeedMonitor's
        assert again["rejoined"]["source"] == "node1" and again["rejoined"]["step"] == came_back
        assert again["steps"] == list(range(came_back + 1, steps + 1))
        assert again["first_digest"] == survivor["digests"][came_back - 1]  # the shard it received
        assert again["digests"] == survivor["digests"][came_back:]
        shard = sum(shard_numel(p.shape, 2, local_rank) for p in parameters)
        assert again["rejoined"]["bytes"] == 3 * 4 * shard + 4 * len(parameters)  # its shard of weights and Adam
    assert survivors[0]["digests"] != survivors[1]["digests"]  # two shards
    gradients_and_marks = 4 * (sum(p.numel() for p in parameters) + 2 * len(parameters))  # a mark per parameter each
    assert survivors[0]["sent"][0] + survivors[1]["sent"][0] == gradients_and_marks  # the gradients cross once
    read = [{(epoch, i) for epoch, ids in rank["samples"] for i in ids} for rank in (*survivors, *restarted)]
    assert [len(ids) for ids in read] == [4 * steps] * 2 + [4 * (steps - came_back)] * 2
    assert sum(map(len, read)) == len(set().union(*read))  # no sample read by two ranks
    survivor_lines = outputs[1][1]
    assert "replica_groups: step 3 is not applied on node1 (a node was lost during its all-reduce" in survivor_lines
    assert "replica_groups: node0 left the job at step 3 (no heartbeat for 5 s" in survivor_lines
    assert f"replica_groups: node0 came back at step {came_back} (restarted): 2 of 2 nodes train on." in survivor_lines
    assert survivor_lines.count("replica_groups: node0 left the job") == 1  # one line per node, not per rank
    shard_bytes = restarted[0]["rejoined"]["bytes"]
    rejoined = f"replica_groups: node0 rejoined the job at step {came_back} with the weights and optimizer state of"
    assert f"{rejoined} node1 (local rank 0's shard: {shard_bytes:,} bytes from its memory" in outputs[0][1]
    checkpoints = sorted(saved.iterdir(), key=lambda path: int(path.name[5:-5]))  # step 4 while node 0 was away
    assert [path.name for path in checkpoints] == [f"step={step}.ckpt" for step in range(2, steps + 1, 2)]
    assert [torch.load(path / "meta.pt", weights_only=False)["global_step"] for path in checkpoints] == [2, 4, 6, 8, 10]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.emulated
def test_after_a_node_was_lost_and_came_back_a_checkpoint_resumes_bit_for_bit_and_a_stop_to_all_saves_once(tmp_path):
    """In the emulated cluster (each node a network namespace with its own address). Run A: node 1 is SIGKILLed after
    step 2 and started again once node 0 finished step 3 (node 0 trains alone meanwhile, then both), with a checkpoint
    every 7 steps, for 10 steps. Run B: the whole job from A's step-7 checkpoint, written after the membership change;
    SIGTERM to both nodes during step 9: both exit 143 and global rank 0 writes one ``last.ckpt``. Run C: the whole job
    from it. C's step 10 has A's losses and C ends with A's weights, bit for bit: both resumes were exact."""
    reason = cannot_emulate()
    if reason:
        pytest.skip(reason)
    periodic, stopped, started = tmp_path / "periodic", tmp_path / "stopped", tmp_path / "started"
    command = [sys.executable, "-m", "tests.support.replica_groups_fit", "fast", "gpt2", "10", "1"]
    every_7 = {"REPLICA_FIT_NODES": "2", "REPLICA_FIT_CHECKPOINTS": str(periodic), "REPLICA_FIT_SAVE_EVERY": "7",
               "NODE_FAULT_HOLD": f"3:{started}"}  # fmt: skip
    stop_at_9 = {"REPLICA_FIT_NODES": "2", "REPLICA_FIT_CHECKPOINTS": str(stopped), "REPLICA_FIT_SAVE_EVERY": "100",
                 "REPLICA_FIT_RESUME": str(periodic / "step=7.ckpt"), "NODE_FAULT_SIGTERM_AT": "9"}  # fmt: skip
    resume = {"REPLICA_FIT_NODES": "2", "REPLICA_FIT_RESUME": str(stopped / "last.ckpt")}
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
    with EmulatedCluster(nodes=2, strangers=1) as cluster:
        nodes = cluster.start(command, {**every_7, "NODE_FAULT_KILL": "1:2"}, REPO_ROOT, tmp_path / "a", forked=True)
        assert nodes[1].wait(timeout=240) == -signal.SIGKILL
        wait_until_held(started)
        # A stranger on the nodes' network tries every port node 0 listens on (register, lighthouse, stores, manager
        # server, state transport, gloo): it is answered nothing, learns no replica to kill, and node 0 trains on.
        listening = cluster.listening(0)
        endpoints = [endpoint for endpoint in listening if not endpoint.startswith("127.")]  # the servers' gated own
        probe = [sys.executable, "-m", "tests.support.stranger", *endpoints]
        answers = [json.loads(line) for line in cluster.run_as_stranger(probe, timeout=120).splitlines()]
        assert len(answers) == len(endpoints) >= 5 and not on_a_wildcard(listening), listening
        assert [(a["answered_200"], a["replicas_named"]) for a in answers] == [(0, 0)] * len(answers), answers
        again = {**every_7, "NODE_FAULT_ANNOUNCE": str(started)}
        nodes[1] = cluster.start_again(1, command, again, REPO_ROOT, tmp_path / "a", forked=True)
        assert [node.wait(timeout=240) for node in nodes] == [0, 0], (tmp_path / "a" / "node0.err").read_text()[-3000:]
        straight = fit_reports(tmp_path / "a", ["node0", "node1.again"])
        came_back = straight[1]["rejoined"]["step"]
        assert 1 in straight[0]["members"] and came_back < 7  # the step-7 checkpoint follows a membership change
        assert straight[0]["members"][6:] == [2] * 4
        assert sorted(path.name for path in periodic.iterdir()) == ["step=7.ckpt"]

        stopping = cluster.start(command, stop_at_9, REPO_ROOT, tmp_path / "b", forked=True)
        assert [node.wait(timeout=240) for node in stopping] == [143, 143]
        assert sorted(path.name for path in stopped.iterdir()) == ["last.ckpt"]

        resumed = [_reports(output.stdout)[0] for output in cluster.run(command, 240, resume, REPO_ROOT, forked=True)]
    for before, after in zip(straight, resumed, strict=True):
        assert after["steps"] == [10] and after["members"] == [2]
        assert after["losses"] == before["losses"][-1:] and after["final"] == before["final"]
