"""How fast the emulated cluster's link really is: a gloo all-reduce timed against bytes / rate.

For each topology (2 nodes x 1 rank: the uniform link; 2 nodes x 2 ranks) and each link rate, plus the
unshaped link, it runs ``tests.support.emulated_cluster.allreduce_command`` (the demo model's 3.37 MB of fp32
gradients by default) in a fresh :class:`~tests.support.emulated_cluster.EmulatedCluster` and prints one row:

- all-reduce ms: median over the timed all-reduces, on node 0's first rank;
- link B/op: bytes the busiest node sent over its link per all-reduce (its NIC counter: what the algorithm
  makes cross nodes, headers included; gloo's ring sends 1x the tensor per node at 2x1, 1.5x at 2x2);
- bytes/rate ms: that many bytes at the configured rate, the least time the link allows;
- ratio: measured / (bytes/rate), 1.00 for a link that delivers its rate exactly;
- achieved Mbit/s: link B/op over the measured time;
- payload/rate ms: the tensor's own bytes at the rate (the time a 2-rank all-reduce would take if gloo sent
  nothing more than the tensor, once, each way).

    python benchmarks/link_probe.py [--rates 50,100,200,400,1000] [--iterations 5] [--bytes 3370000]   # as root

Needs what the emulated cluster needs (root, ``ip``, ``tc``); it prints why not and exits 2 otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support.emulated_cluster

from tests.support.emulated_cluster import EmulatedCluster, allreduce_command, allreduce_results, cannot_emulate  # noqa: E402

TOPOLOGIES = ((2, 1), (2, 2))
HEADER = (
    f"{'topology':<9} {'link Mbit/s':>11} {'all-reduce ms':>13} {'link B/op':>11} {'bytes/rate ms':>13} "
    f"{'ratio':>6} {'achieved Mbit/s':>15} {'payload/rate ms':>15}"
)


def probe(nodes: int, ranks_per_node: int, link_mbit: float | None, nbytes: int, iterations: int) -> str:
    """One row: a fresh cluster, one warm-up and ``iterations`` timed all-reduces of ``nbytes``."""
    with EmulatedCluster(nodes, ranks_per_node, link_mbit) as cluster:
        results = allreduce_results(cluster.run(allreduce_command(nbytes, iterations=iterations), timeout=600))
    if not all(result["correct"] for result in results):
        raise AssertionError(f"wrong sums at {nodes}x{ranks_per_node}, {link_mbit} Mbit/s: {results}")
    seconds = statistics.median(results[0]["seconds"])
    link_bytes = max(result["link_bytes_sent"] for result in results) / iterations
    achieved = link_bytes * 8 / seconds / 1e6
    row = f"{nodes}x{ranks_per_node:<7} "
    if link_mbit is None:
        return row + f"{'unshaped':>11} {seconds * 1e3:13.1f} {link_bytes:11,.0f} {'':>13} {'':>6} {achieved:15.0f}"
    least = link_bytes * 8 / (link_mbit * 1e6)
    payload = nbytes * 8 / (link_mbit * 1e6)
    return row + (
        f"{link_mbit:11g} {seconds * 1e3:13.1f} {link_bytes:11,.0f} {least * 1e3:13.1f} "
        f"{seconds / least:6.2f} {achieved:15.0f} {payload * 1e3:15.1f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="50,100,200,400,1000", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--iterations", type=int, default=5, help="timed all-reduces per row (after one warm-up)")
    parser.add_argument("--bytes", type=int, default=3_370_000, help="size of the fp32 tensor all-reduced")
    args = parser.parse_args()
    reason = cannot_emulate()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    rates: list[float | None] = [None, *(float(rate) for rate in args.rates.split(","))]
    print(f"gloo all-reduce of {args.bytes:,} B of fp32, median of {args.iterations}; link rate per node, each way")
    print(HEADER)
    for nodes, ranks_per_node in TOPOLOGIES:
        for rate in rates:
            print(probe(nodes, ranks_per_node, rate, args.bytes, args.iterations), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
