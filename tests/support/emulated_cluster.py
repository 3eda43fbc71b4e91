"""An emulated cluster on this machine: N "nodes" x R ranks, traffic between nodes crossing a link of a given rate.

On this machine's loopback communication is nearly free; on a real cluster it is 20-60% of a step. Tests and
benchmarks that must show what a feature does to communication run their ranks in this cluster instead.

How it is built (each choice checked on this machine; ``docs/bench.md``, "The emulated cluster", has the numbers):

- One network namespace per node, and one "switch" namespace holding a bridge. Each node has one NIC, a veth
  pair ``eth0`` (in the node) / ``pK`` (a bridge port), MTU 9000, address ``198.18.0.(K+1)/24`` (RFC 2544's range
  for benchmarks). The namespaces have no link to the host or to each other except through that bridge: nothing
  leaves them, and nothing of the host is touched.
- Ranks of one node talk over the node's own ``lo`` (the kernel delivers traffic to a local address on ``lo``, even
  to ``eth0``'s address), so intra-node traffic is free, like NVLink or shared memory; traffic between nodes
  crosses ``eth0``, the bridge and the peer's ``eth0``.
- Shaping: ``tbf`` at the link rate on each node's ``eth0`` (what it sends) and on its bridge port (what it
  receives): a full-duplex NIC of that rate, as on a real cluster. The rate counts Ethernet frames (headers too).
- Not one namespace whose ``lo`` carries per-node loopback addresses with ``htb``/``u32`` classes: gloo binds its
  listening socket to the node's address but connects from an unbound socket, which the kernel gives the source
  127.0.0.1, so a filter cannot tell which node sent half of the packets (seen with ``ss -tn``).
- Each node's command runs under ``ip netns exec NODE unshare --uts`` with its address as hostname and
  ``GLOO_SOCKET_IFNAME=eth0`` (gloo binds to ``eth0``'s address), and with what a multi-node launch gives each
  node: ``MASTER_ADDR`` (node 0), ``MASTER_PORT``, ``NODE_RANK`` for Lightning, ``PET_*`` for ``torchrun``. With
  ``forked=True`` a ``python -m MODULE`` command is instead forked from the suite's server, which imported torch and
  Lightning once (about 7 s of CPU less per node), into the same namespaces (:func:`enter_node`).
- Teardown: namespace names carry the creating process's pid. Leaving the ``with`` block, ``atexit`` and SIGTERM
  kill every process in the namespaces and delete them; creating a cluster first does the same to namespaces
  whose creator is dead (it was SIGKILLed), so nothing outlives the next run.

Command line (from the repository root), running the command on every node and exiting with the worst status::

    python -m tests.support.emulated_cluster --nodes 2 --ranks-per-node 2 --link-mbit 100 -- COMMAND...
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import functools
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

# _wait_all and _kill_group: the same wait-with-grace and process-group kill as run_processes, for streamed output.
from tests.support.harness import ForkedModule, RankOutput, _kill_group, _wait_all, run_processes

PREFIX = "fdcl"
SUBNET = "198.18.0"
NIC = "eth0"
MTU = 9000
REPO_ROOT = Path(__file__).resolve().parents[2]
CLONE_NEWNET, CLONE_NEWUTS = 0x40000000, 0x04000000  # <sched.h>: setns(2) and unshare(2) take them
# A namespace of ours: fdcl-<creator pid>-<cluster number>-<sw | nK | sK> (switch, node, stranger).
_OUR_NAMESPACE = re.compile(rf"^{PREFIX}-(\d+)-\d+-(?:sw|n\d+|s\d+)$")
_cluster_numbers = itertools.count()


class EmulationError(RuntimeError):
    """A command that builds or inspects the cluster failed; the message holds its stderr."""


@dataclass(frozen=True)
class LinkCounters:
    """What one node's NIC counted: bytes of the frames it sent and received, and frames its shapers dropped."""

    sent: int
    received: int
    dropped: int


def _run(*command: str, check: bool = True) -> str:
    result = subprocess.run(command, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise EmulationError(f"`{' '.join(command)}` exited {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: a killed creator may wait unreaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def our_namespaces() -> list[str]:
    """Names of the network namespaces any emulated cluster of this machine holds now."""
    if shutil.which("ip") is None:
        return []
    names = (line.split()[0] for line in _run("ip", "netns", "list", check=False).splitlines() if line.strip())
    return [name for name in names if _OUR_NAMESPACE.match(name)]


def _remove_namespace(name: str) -> None:
    """Kill every process inside ``name``, then delete it (its veth ends go with it)."""
    for pid in _run("ip", "netns", "pids", name, check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    _run("ip", "netns", "delete", name, check=False)


def sweep_stale_namespaces() -> list[str]:
    """Remove the namespaces whose creating process is dead; return their names."""
    stale = [name for name in our_namespaces() if not _alive(int(_OUR_NAMESPACE.match(name).group(1)))]
    for name in stale:
        _remove_namespace(name)
    return stale


def enter_node(namespace: str, hostname: str) -> None:
    """Move this (single-threaded, just forked) process into node ``namespace``'s network namespace and a UTS
    namespace of its own named ``hostname``: what ``ip netns exec NAMESPACE unshare --uts`` gives a command, less the
    remounted ``/sys`` (a forked node reads no ``/sys/class/net``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{namespace}") as handle:
        entered = libc.setns(handle.fileno(), CLONE_NEWNET) == 0
    if not entered or libc.unshare(CLONE_NEWUTS) != 0:
        raise EmulationError(f"entering {namespace}: {os.strerror(ctypes.get_errno())}")
    socket.sethostname(hostname)


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _start(
    command: list[str],
    env: dict[str, str],
    cwd: str | Path | None,
    output: Path | None,
    name: str,
    entering: Callable[[], None] | None = None,
) -> subprocess.Popen | ForkedModule:
    """Start one node's command leading its own process group; with ``output``, writing ``NAME.out`` and ``NAME.err``
    there. With ``entering`` (:meth:`EmulatedCluster._entering`), ``command`` is ``python -m MODULE ...`` forked into
    the node."""
    if entering is not None:
        files = (output / f"{name}.out", output / f"{name}.err") if output is not None else (None, None)
        return ForkedModule(command, {**os.environ, **env}, cwd, *files, prepare=entering)
    streams = {}
    if output is not None:
        streams = {stream: open(output / f"{name}.{stream[3:]}", "w") for stream in ("stdout", "stderr")}
    process = subprocess.Popen(command, env={**os.environ, **env}, cwd=cwd, start_new_session=True, **streams)
    for stream in streams.values():
        stream.close()  # the child holds its own copy
    return process


class EmulatedCluster:
    """``nodes`` x ``ranks_per_node`` ranks on this machine, nodes linked at ``link_mbit`` Mbit/s each way.

    ``link_mbit=None`` builds the same namespaces and addresses without shaping, for the unshaped comparison.
    Use it as a context manager; :meth:`run` or :meth:`start` runs one command per node.
    """

    def __init__(self, nodes: int, ranks_per_node: int = 1, link_mbit: float | None = None, strangers: int = 0) -> None:
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes must be between 1 and 250, got {nodes}")
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node}")
        if link_mbit is not None and not link_mbit > 0:
            raise ValueError(f"link_mbit must be positive (or None for an unshaped link), got {link_mbit}")
        self.nodes = nodes
        self.strangers = strangers  # namespaces on the same bridge that run no node: processes outside the job
        self.ranks_per_node = ranks_per_node
        self.link_mbit = link_mbit
        self.name = f"{PREFIX}-{os.getpid()}-{next(_cluster_numbers)}"
        self._created: list[str] = []
        self._ports = itertools.count(29500)  # a fresh port per run: node 0's namespace is ours alone
        self._port = 0  # the last run's
        self._sigterm_installed = False

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def switch(self) -> str:
        """The namespace holding the bridge all nodes are plugged into."""
        return f"{self.name}-sw"

    def namespace(self, node: int) -> str:
        return f"{self.name}-n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def stranger_namespace(self, stranger: int) -> str:
        return f"{self.name}-s{stranger}"

    def stranger_address(self, stranger: int) -> str:
        return f"{SUBNET}.{251 - stranger}"

    def listening(self, node: int) -> list[str]:
        """``ADDRESS:PORT`` of every TCP socket listening in node ``node``'s namespace (its processes only)."""
        shown = _run("ip", "netns", "exec", self.namespace(node), "ss", "-ltnH")
        return [line.split()[3] for line in shown.splitlines() if line.strip()]

    def run_as_stranger(self, command: Sequence[str], stranger: int = 0, timeout: float = 60) -> str:
        """Run ``command`` in a stranger's namespace (on the nodes' bridge, in no job) and return its output."""
        wrapped = ["ip", "netns", "exec", self.stranger_namespace(stranger), *command]
        done = subprocess.run(wrapped, capture_output=True, text=True, check=True, timeout=timeout, cwd=REPO_ROOT)
        return done.stdout

    # ------------------------------------------------------------ building and teardown

    def __enter__(self) -> EmulatedCluster:
        sweep_stale_namespaces()
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # else the owner of the handler decides
                signal.signal(signal.SIGTERM, _raise_system_exit)  # SystemExit runs __exit__ and atexit
                self._sigterm_installed = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process in the cluster's namespaces and delete them. Safe to call twice."""
        for name in reversed(self._created):
            _remove_namespace(name)
        self._created.clear()
        atexit.unregister(self.close)
        if self._sigterm_installed and signal.getsignal(signal.SIGTERM) is _raise_system_exit:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._sigterm_installed = False

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        hosts = [(self.namespace(node), f"p{node}", self.address(node)) for node in range(self.nodes)]
        hosts += [(self.stranger_namespace(k), f"s{k}", self.stranger_address(k)) for k in range(self.strangers)]
        for namespace, port, address in hosts:
            self._add_namespace(namespace)
            _run(
                "ip", "-n", self.switch, "link", "add", port, "mtu", str(MTU), "type", "veth",
                "peer", "name", NIC, "mtu", str(MTU), "netns", namespace,
            )  # fmt: skip
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", NIC)
            _run("ip", "-n", namespace, "link", "set", NIC, "up")
            if self.link_mbit is not None:
                self._shape(namespace, NIC)  # what the host sends
                self._shape(self.switch, port)  # what it receives

    def _shape(self, namespace: str, device: str) -> None:
        """A token bucket at the link rate on ``device``'s egress.

        The bucket holds one GSO packet (veth hands tbf up to 64 KiB at once; a smaller bucket makes tbf split
        each one: 6-14% below the rate here) and 1 ms of traffic, no more: a full bucket goes out at once, so
        1 MiB would give every collective that starts after a pause 1 MiB for free. The queue holds 0.5 s of
        traffic and at least 4 MiB: TCP keeps it short itself, while a 100 kB queue dropped hundreds of packets
        per all-reduce (each one a retransmission).
        """
        bytes_per_second = self.link_mbit * 1e6 / 8
        burst = max(64 * 1024 + MTU, int(bytes_per_second / 1000))
        limit = max(4 * 1024 * 1024, int(bytes_per_second / 2))
        _run(
            "tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
            "rate", f"{int(self.link_mbit * 1e6)}bit", "burst", str(burst), "limit", str(limit),
        )  # fmt: skip

    # ------------------------------------------------------------ running commands

    def node_environment(self, node: int, port: int) -> dict[str, str]:
        """What a multi-node launch gives node ``node``'s command: Lightning's and torchrun's variables."""
        return {
            "MASTER_ADDR": self.address(0),
            "MASTER_PORT": str(port),
            "NODE_RANK": str(node),
            "PET_MASTER_ADDR": self.address(0),
            "PET_MASTER_PORT": str(port),
            "PET_NODE_RANK": str(node),
            "PET_NNODES": str(self.nodes),
            "PET_NPROC_PER_NODE": str(self.ranks_per_node),
            "EMULATED_NODES": str(self.nodes),
            "EMULATED_RANKS_PER_NODE": str(self.ranks_per_node),
            "GLOO_SOCKET_IFNAME": NIC,
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // self.world_size)),
        }

    def node_command(self, node: int, command: Sequence[str]) -> list[str]:
        """``command`` wrapped to run inside node ``node``, in its own UTS namespace named after its address."""
        hostname_then_exec = 'hostname "$0" && exec "$@"'
        return [
            "ip", "netns", "exec", self.namespace(node),
            "unshare", "--uts", "sh", "-c", hostname_then_exec, self.address(node), *command,
        ]  # fmt: skip

    def _entering(self, node: int) -> Callable[[], None]:
        """What a process forked for node ``node`` calls to run inside it (:func:`enter_node`)."""
        return functools.partial(enter_node, self.namespace(node), self.address(node))

    def _launch(
        self, command: Sequence[str], env: dict[str, str] | None, forked: bool
    ) -> tuple[list[list[str]], list[dict]]:
        if not self._created:
            raise RuntimeError("the cluster is not built: use it as `with EmulatedCluster(...) as cluster:`")
        self._port = next(self._ports)
        commands = [list(command) if forked else self.node_command(node, command) for node in range(self.nodes)]
        environments = [{**self.node_environment(node, self._port), **(env or {})} for node in range(self.nodes)]
        return commands, environments

    def run(
        self,
        command: Sequence[str],
        timeout: float = 180.0,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        forked: bool = False,
    ) -> list[RankOutput]:
        """Run ``command`` once per node (its ``NODE_RANK`` tells which) and return each node's output, by node.
        ``forked``: ``command`` is ``python -m MODULE ...``, forked into each node from the suite's server (no
        start-up of its own: :class:`~tests.support.harness.ForkedModule`).

        Raises :class:`tests.support.harness.DistributedRunError` with the failing nodes' output if one exits
        non-zero or the run exceeds ``timeout`` seconds (every node's process group is then killed).
        """
        commands, environments = self._launch(command, env, forked)
        prepares = [self._entering(node) for node in range(self.nodes)] if forked else None
        return run_processes(commands, environments, timeout=timeout, cwd=cwd, forked=forked, prepares=prepares)

    def start(
        self,
        command: Sequence[str],
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        output: Path | None = None,
        forked: bool = False,
    ) -> list[subprocess.Popen | ForkedModule]:
        """Start ``command`` on every node without waiting; its output goes to this process's, or with ``output`` (a
        folder) to ``nodeK.out`` and ``nodeK.err`` there (forked: to files of its own unless ``output`` is given).
        ``forked``: as in :meth:`run`.

        Each node's command leads its own process group; :meth:`close` kills whatever is left in the namespaces.
        """
        commands, environments = self._launch(command, env, forked)
        return [
            _start(node_command, extra, cwd, output, f"node{node}", self._entering(node) if forked else None)
            for node, (node_command, extra) in enumerate(zip(commands, environments))
        ]

    def start_again(
        self,
        node: int,
        command: Sequence[str],
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        output: Path | None = None,
        forked: bool = False,
    ) -> subprocess.Popen | ForkedModule:
        """Start ``command`` on node ``node`` alone, in the job :meth:`start` began last (its ports): a node restarted
        while the others run. With ``output``, its output goes to ``nodeK.again.out`` and ``nodeK.again.err`` there.
        ``forked``: as in :meth:`run`."""
        environment = {**self.node_environment(node, self._port), **(env or {})}
        if forked:
            return _start(list(command), environment, cwd, output, f"node{node}.again", self._entering(node))
        return _start(self.node_command(node, command), environment, cwd, output, f"node{node}.again")

    # ------------------------------------------------------------ what crossed the link

    def link_counters(self) -> list[LinkCounters]:
        """Each node's NIC counters since the cluster was built, by node; subtract two readings for one run.

        ``sent`` counts what left node K for other nodes (intra-node traffic never reaches ``eth0``): IP packets
        with their headers, an offloaded (GSO) packet's headers counted once.
        """
        counters = []
        for node in range(self.nodes):
            stats = json.loads(_run("ip", "-n", self.namespace(node), "-j", "-s", "link", "show", "dev", NIC))
            dropped = self._qdisc_drops(self.namespace(node), NIC) + self._qdisc_drops(self.switch, f"p{node}")
            rx_tx = stats[0]["stats64"]
            counters.append(LinkCounters(rx_tx["tx"]["bytes"], rx_tx["rx"]["bytes"], dropped))
        return counters

    def _qdisc_drops(self, namespace: str, device: str) -> int:
        qdiscs = json.loads(_run("tc", "-n", namespace, "-j", "-s", "qdisc", "show", "dev", device) or "[]")
        return sum(qdisc.get("drops", 0) for qdisc in qdiscs)


@functools.cache
def cannot_emulate() -> str | None:
    """Why this machine cannot host an emulated cluster (one line, for a test's skip), or None when it can.

    Beyond root and the tools, it builds a small shaped cluster and runs a command in it.
    """
    if not sys.platform.startswith("linux"):
        return "emulated cluster: needs Linux network namespaces"
    if os.geteuid() != 0:
        return "emulated cluster: needs root (ip netns, tc)"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"emulated cluster: {', '.join(missing)} not found"
    try:
        with EmulatedCluster(2, 1, link_mbit=100) as cluster:
            cluster.run(["true"], timeout=30)
    except Exception as error:  # noqa: BLE001 - any failure is the reason to skip
        return f"emulated cluster: cannot build one here ({str(error).splitlines()[0]})"
    return None


def can_emulate() -> bool:
    return cannot_emulate() is None


# ---------------------------------------------------------------- a gloo all-reduce per node


def allreduce_command(nbytes: int, groups: Sequence[str] = ("world",), iterations: int = 1) -> list[str]:
    """The command for :meth:`EmulatedCluster.run` that all-reduces ``nbytes`` of fp32 on every rank.

    For each of ``groups`` in turn, ``"world"`` (all ranks) or ``"node"`` (each node's ranks among themselves):
    one warm-up all-reduce, then ``iterations`` timed ones. Local rank 0 of each node prints one JSON line per
    group (:func:`allreduce_results` reads them) with the times, the bytes its node's NIC sent meanwhile (the
    node's own counter: separates the groups of one run) and whether every sum was right.
    """
    code = (
        f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); "
        "from tests.support.emulated_cluster import allreduce_node; allreduce_node()"
    )
    return [sys.executable, "-c", code, str(nbytes), ",".join(groups), str(iterations)]


def allreduce_results(outputs: Sequence[RankOutput]) -> list[dict[str, Any]]:
    """The JSON lines :func:`allreduce_command` printed on every node, in node order."""
    return [json.loads(line) for output in outputs for line in output.stdout.splitlines() if line.startswith("{")]


def allreduce_node() -> None:
    """One node of :func:`allreduce_command`: fork the node's ranks (torch imported once), exit with the worst."""
    import multiprocessing

    import torch  # noqa: F401 - imported before the fork so the ranks share it

    nbytes, groups, iterations = int(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3])
    context = multiprocessing.get_context("fork")
    ranks = [
        context.Process(target=_allreduce_rank, args=(local, nbytes, groups, iterations))
        for local in range(int(os.environ["EMULATED_RANKS_PER_NODE"]))
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    sys.exit(max(0 if process.exitcode == 0 else 1 for process in ranks))


def _nic_bytes_sent() -> int:
    """This namespace's ``eth0`` transmit counter (/proc/net/dev is per network namespace)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == NIC:
            return int(fields.split()[8])
    raise EmulationError(f"no {NIC} in /proc/net/dev: not inside an emulated node")


def _allreduce_rank(local: int, nbytes: int, groups: list[str], iterations: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    node, per_node = int(os.environ["NODE_RANK"]), int(os.environ["EMULATED_RANKS_PER_NODE"])
    rank, world_size = node * per_node + local, int(os.environ["EMULATED_NODES"]) * per_node
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    # Every rank creates every node's group, as new_group requires.
    node_groups = [dist.new_group(list(range(k * per_node, (k + 1) * per_node))) for k in range(world_size // per_node)]
    tensor = torch.empty(nbytes // 4)
    for name in groups:
        group = node_groups[node] if name == "node" else dist.group.WORLD
        members = range(node * per_node, (node + 1) * per_node) if name == "node" else range(world_size)
        expected = float(sum(member + 1 for member in members))
        dist.all_reduce(tensor.fill_(rank + 1.0), group=group)  # warm-up
        dist.barrier()
        sent_before = _nic_bytes_sent()
        seconds, correct = [], True
        for _ in range(iterations):
            tensor.fill_(rank + 1.0)
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            seconds.append(time.perf_counter() - start)
            correct = correct and bool(tensor.eq(expected).all())
        dist.barrier()
        if local == 0:
            result = {
                "node": node,
                "group": name,
                "seconds": seconds,
                "link_bytes_sent": _nic_bytes_sent() - sent_before,
            }
            print(json.dumps({**result, "correct": correct}), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.emulated_cluster",
        description="Run COMMAND once per node of an emulated cluster (NODE_RANK, MASTER_ADDR, MASTER_PORT set); "
        "print the bytes each node sent and received over its link; exit with the worst exit status.",
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument(
        "--ranks-per-node", type=int, default=1, help="sets EMULATED_RANKS_PER_NODE, PET_NPROC_PER_NODE"
    )
    parser.add_argument("--link-mbit", type=float, default=None, help="link rate each way; omit for an unshaped link")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before every node is killed (exit 124)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run on every node after --")
    reason = cannot_emulate()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    with EmulatedCluster(args.nodes, args.ranks_per_node, args.link_mbit) as cluster:
        before = cluster.link_counters()
        processes = cluster.start(command)
        timed_out = _wait_all(processes, args.timeout)
        # A node still running now was killed: on a timeout, or after another node failed (it would hang).
        killed = [process.poll() is None for process in processes]
        for process in processes:
            _kill_group(process)
        after = cluster.link_counters()
    statuses = [_exit_status(process.returncode) for process in processes]
    link = "unshaped link" if args.link_mbit is None else f"{args.link_mbit:g} Mbit/s link"
    for node, (start, end, status, was_killed) in enumerate(zip(before, after, statuses, killed)):
        outcome = "killed" if was_killed else f"exit {status}"
        print(
            f"node {node} ({cluster.address(node)}): sent {end.sent - start.sent:,} B, received "
            f"{end.received - start.received:,} B over its {link}, {end.dropped - start.dropped} dropped; {outcome}"
        )
    worst = max((status for status, was_killed in zip(statuses, killed) if not was_killed), default=0)
    return 124 if timed_out else worst


def _exit_status(returncode: int) -> int:
    """A shell's exit status for a return code: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


if __name__ == "__main__":
    sys.exit(main())
