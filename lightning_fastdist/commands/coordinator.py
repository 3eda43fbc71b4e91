"""``lightning-fastdist coordinator``: torchft's lighthouse and the store where the nodes meet, in one process on a
machine that outlives the nodes.

Without it, a job of torchft replica groups (``replica_groups``, or ``outer_sync`` with ``min_nodes``) keeps both in
node 0, and losing node 0 ends the job. Use one per job and stop it once the job ended: its register belongs to that
job. ``docs/fault-tolerance.md`` ("Losing node 0").
"""

from __future__ import annotations

import argparse
import signal
import socket
import threading

import torch.distributed as dist

from lightning_fastdist.commands.arguments import positive
from lightning_fastdist.parallel.across_nodes.group import COORDINATOR_VARIABLE, start_lighthouse

PROG = "lightning-fastdist coordinator"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=positive(int), default=29400, help="the lighthouse's; the store's is PORT + 1")
    parser.add_argument(
        "--min-nodes", type=positive(int), required=True, help="the job's min_nodes: the fewest nodes a quorum holds"
    )
    return parser


def main(argv: list[str]) -> int:
    """Serve until Ctrl-C or SIGTERM."""
    args = build_parser().parse_args(argv)
    lighthouse = start_lighthouse(args.port, args.min_nodes, PROG)
    store = dist.TCPStore(socket.gethostname(), args.port + 1, is_master=True, wait_for_workers=False)
    address = f"{socket.gethostname()}:{args.port}"
    print(
        f"{PROG}: lighthouse at http://{address}, store at port {args.port + 1}; start every node with "
        f"{COORDINATOR_VARIABLE}={address}",
        flush=True,
    )
    stopped = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        while not stopped.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        lighthouse.shutdown()
        del store
    print(f"{PROG}: stopped.", flush=True)
    return 0
