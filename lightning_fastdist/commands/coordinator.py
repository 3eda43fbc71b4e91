"""``lightning-fastdist coordinator``: torchft's lighthouse and the register where the nodes meet, in one process on a
machine that outlives the nodes.

Without it, a job of torchft replica groups (``replica_groups``, or ``outer_sync`` with ``min_nodes``) keeps both in
node 0, and losing node 0 ends the job. Use one per job and stop it once the job ended: its register belongs to that
job (claimed for ``--run-id``, or for the first node's). Both listen on ``--bind`` only (``docs/security.md``).
``docs/fault-tolerance.md`` ("Losing node 0").
"""

from __future__ import annotations

import argparse
import signal
from datetime import timedelta

from lightning_fastdist.commands.arguments import positive
from lightning_fastdist.parallel.across_nodes.group import COORDINATOR_VARIABLE, register_client
from lightning_fastdist.parallel.across_nodes.torchft_servers import Lighthouse
from lightning_fastdist.parallel.faults.job_identity import claim_or_check_run_id
from lightning_fastdist.parallel.faults.listeners import PortInUseError, bound_store, host_address, url_host

PROG = "lightning-fastdist coordinator"
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
STORE_TIMEOUT = timedelta(minutes=30)  # how long a node's request to the register may wait for a key


def port_number(text: str) -> int:
    """A TCP port, 1 to 65535."""
    value = positive(int)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port, 1 to 65535, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=port_number, default=29400, help="the register's (the lighthouse picks its own)")
    parser.add_argument(
        "--min-nodes", type=positive(int), required=True, help="the job's min_nodes: the fewest nodes a quorum holds"
    )
    parser.add_argument(
        "--bind", default=None, metavar="ADDRESS", help="the address to listen on (default: this machine's name's)"
    )
    parser.add_argument(
        "--run-id", default=None, help="the job's run id (SLURM_JOB_ID, ...); default: the first node's"
    )
    return parser


def main(argv: list[str]) -> int:
    """Serve until SIGTERM or Ctrl-C."""
    parser = build_parser()
    args = parser.parse_args(argv)
    address = args.bind or host_address()
    # Waited for in the main thread, not handled: a handler runs between two bytecodes of whatever the main thread
    # does, and one that took a lock the main thread held could hang the process until SIGKILL.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        try:
            register = bound_store(address, args.port, STORE_TIMEOUT, f"{PROG}'s register")
        except PortInUseError as error:
            parser.exit(2, f"{PROG}: error: --port: {error}\n")
        if args.run_id is not None:
            claim_or_check_run_id(register, args.run_id, f"{PROG}'s register")
        gate_register = register_client((address, args.port), STORE_TIMEOUT)  # read in the gate's thread
        lighthouse = Lighthouse(address, args.min_nodes, PROG, gate_register)
        lighthouse.announce(register)
        print(
            f"{PROG}: lighthouse at {lighthouse.url}, register at {url_host(address)}:{args.port}; start every node "
            f"with {COORDINATOR_VARIABLE}={url_host(address)}:{args.port}",
            flush=True,
        )
        signal.sigwait(STOP_SIGNALS)
        lighthouse.shutdown()
        del register
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    print(f"{PROG}: stopped.", flush=True)
    return 0
