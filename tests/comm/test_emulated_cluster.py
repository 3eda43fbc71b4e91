"""The emulated cluster: what crosses its shaped link, what stays inside a node, and that nothing outlives it.

Behaviour only (bytes on the link, sums, namespaces left): times are for benchmarks/link_probe.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.support.emulated_cluster import (
    REPO_ROOT,
    EmulatedCluster,
    allreduce_command,
    allreduce_results,
    cannot_emulate,
    our_namespaces,
)

pytestmark = pytest.mark.emulated

# fp32 gradients of the demo model: the all-reduce the issue measured.
GRADIENT_BYTES = 3_370_000
# Bytes a node may send while its ranks only talk among themselves: barriers, TCP keep-alive, ND.
CONTROL_BYTES = 64 * 1024


@pytest.fixture
def emulation() -> None:
    reason = cannot_emulate()
    if reason:
        pytest.skip(reason)


def _namespaces_of(cluster_name: str) -> list[str]:
    return [name for name in our_namespaces() if name.startswith(cluster_name + "-")]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pids_in(namespace: str, at_least: int, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
        if len(pids) >= at_least:
            return [int(pid) for pid in pids]
        time.sleep(0.05)
    raise AssertionError(f"fewer than {at_least} processes appeared in {namespace}")


@contextlib.contextmanager
def _controller() -> Iterator[tuple[subprocess.Popen, str]]:
    """A Python process that builds a 2-node cluster, runs ``sleep`` on its nodes and waits; and the cluster's name."""
    code = (
        "import time\nfrom tests.support.emulated_cluster import EmulatedCluster\n"
        "cluster = EmulatedCluster(2, link_mbit=100).__enter__()\ncluster.start(['sleep', '600'])\n"
        "print(cluster.name, flush=True)\ntime.sleep(600)\n"
    )
    controller = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        yield controller, controller.stdout.readline().strip()
    finally:
        controller.kill()  # a failed test leaves its namespaces to the next cluster's sweep
        controller.wait()


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="nodes"):
        EmulatedCluster(0)
    with pytest.raises(ValueError, match="ranks_per_node"):
        EmulatedCluster(2, 0)
    with pytest.raises(ValueError, match="link_mbit"):
        EmulatedCluster(2, 1, link_mbit=0)


def test_each_node_gets_its_namespace_address_and_launch_environment(emulation: None) -> None:
    script = 'echo "$NODE_RANK $(hostname) $MASTER_ADDR $GLOO_SOCKET_IFNAME $EMULATED_RANKS_PER_NODE"; ip -br -4 addr'
    with EmulatedCluster(2, 2) as cluster:
        outputs = cluster.run(["sh", "-c", script], timeout=30)
    for node, output in enumerate(outputs):
        first, *addresses = output.stdout.splitlines()
        assert first.split() == [str(node), f"198.18.0.{node + 1}", "198.18.0.1", "eth0", "2"]
        assert any(line.startswith("eth0") and f"198.18.0.{node + 1}/24" in line for line in addresses)


@pytest.mark.slow
def test_a_cross_node_allreduce_crosses_the_shaped_link(emulation: None) -> None:
    """2 nodes x 1 rank (the uniform link): each node must send the other its whole contribution."""
    with EmulatedCluster(2, 1, link_mbit=100) as cluster:
        before = cluster.link_counters()
        results = allreduce_results(cluster.run(allreduce_command(GRADIENT_BYTES), timeout=120))
        after = cluster.link_counters()
    assert [r["node"] for r in results] == [0, 1] and all(r["correct"] for r in results)
    for start, end, result in zip(before, after, results):
        # For any algorithm: the peer needs this node's sum of every element, GRADIENT_BYTES of it.
        assert result["link_bytes_sent"] >= GRADIENT_BYTES
        assert end.sent - start.sent >= 2 * GRADIENT_BYTES  # the warm-up and the measured all-reduce
        assert end.dropped == 0  # the shaper's queue is long enough: TCP never had to retransmit
    assert not _namespaces_of(cluster.name)


@pytest.mark.slow
def test_traffic_inside_a_node_stays_off_the_link(emulation: None) -> None:
    """2 nodes x 2 ranks: an all-reduce within each node sends (almost) nothing on the link; one over all does."""
    with EmulatedCluster(2, 2, link_mbit=200) as cluster:
        outputs = cluster.run(allreduce_command(GRADIENT_BYTES, groups=("node", "world")), timeout=120)
    results = {(r["node"], r["group"]): r for r in allreduce_results(outputs)}
    assert sorted(results) == [(0, "node"), (0, "world"), (1, "node"), (1, "world")]
    assert all(result["correct"] for result in results.values())
    for node in (0, 1):
        assert results[node, "node"]["link_bytes_sent"] < CONTROL_BYTES
        assert results[node, "world"]["link_bytes_sent"] >= GRADIENT_BYTES
    assert not _namespaces_of(cluster.name)


def test_leaving_the_block_kills_its_processes_and_deletes_its_namespaces(emulation: None) -> None:
    with pytest.raises(RuntimeError, match="inside"):
        with EmulatedCluster(2, link_mbit=50) as cluster:
            cluster.start(["sleep", "600"])
            stray = _pids_in(cluster.namespace(1), at_least=1)
            assert len(_namespaces_of(cluster.name)) == 3  # the switch and two nodes
            raise RuntimeError("a failure inside the block")
    assert not _namespaces_of(cluster.name)
    assert not any(_running(pid) for pid in stray)


def test_a_sigterm_to_the_controller_tears_the_cluster_down(emulation: None) -> None:
    with _controller() as (controller, name):
        stray = _pids_in(f"{name}-n0", at_least=1)
        controller.send_signal(signal.SIGTERM)
        assert controller.wait(timeout=30) == 128 + signal.SIGTERM
    assert not _namespaces_of(name)
    assert not any(_running(pid) for pid in stray)


def test_a_sigkilled_controllers_cluster_is_swept_by_the_next_one(emulation: None) -> None:
    with _controller() as (controller, name):
        stray = _pids_in(f"{name}-n1", at_least=1)
        controller.kill()
        controller.wait(timeout=30)
    assert len(_namespaces_of(name)) == 3  # nothing could run in the killed process
    with EmulatedCluster(1) as live:
        with EmulatedCluster(1) as sweeper:  # its creation sweeps: the dead controller's, not the live one's
            assert not _namespaces_of(name)
            assert len(_namespaces_of(live.name)) == 2 and len(_namespaces_of(sweeper.name)) == 2
    assert not any(_running(pid) for pid in stray)
    assert not _namespaces_of(live.name) and not _namespaces_of(sweeper.name)


def test_the_command_line_reports_link_bytes_and_the_worst_exit_status(emulation: None) -> None:
    command = [sys.executable, "-m", "tests.support.emulated_cluster", "--nodes", "2", "--link-mbit", "100"]
    completed = subprocess.run(
        [*command, "--", "sh", "-c", "exit $((NODE_RANK * 3))"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert completed.returncode == 3, completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[0].startswith("node 0 (198.18.0.1): sent ") and lines[0].endswith("exit 0")
    assert "over its 100 Mbit/s link" in lines[1] and lines[1].endswith("exit 3")


@pytest.mark.slow
def test_hsdp_keeps_its_gathers_inside_a_node_and_sends_less_over_the_slow_link(emulation):
    # 2 nodes x 2 ranks: zero3 all-gathers and reduce-scatters over all 4 ranks (across the link); hsdp shards
    # within each node and sends only the all-reduce of its gradient shards across. Same losses either way.
    with EmulatedCluster(nodes=2, ranks_per_node=2, link_mbit=200) as cluster:
        outputs = cluster.run([sys.executable, "-m", "tests.support.hsdp_link_fit"], timeout=240, cwd=REPO_ROOT)
    nodes = [json.loads(output.stdout.split("FIT ", 1)[1]) for output in outputs]
    zero3, hsdp = nodes[0]["zero3"], nodes[0]["hsdp"]
    assert hsdp["losses"] == pytest.approx(zero3["losses"], rel=1e-5)
    assert set(hsdp["bytes"]) == {"allgather", "reduce_scatter", "allreduce"}  # the all-reduce across nodes
    assert "allreduce" not in zero3["bytes"]
    sent = {sharding: sum(node[sharding]["sent"] for node in nodes) for sharding in ("zero3", "hsdp")}
    assert sent["hsdp"] < 0.6 * sent["zero3"]  # the gathers stayed on each node's loopback
