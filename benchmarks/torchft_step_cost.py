"""What torchft's every-step protocol costs on this machine: the ground for the synchronous form of issue 38.

Two processes on loopback, each a torchft replica group of one (a lighthouse in the first), run ``--steps`` steps of
``--compute-ms`` of sleep standing in for forward and backward, then average ``--bytes`` of gradient:

- ``torchft``: the quorum started before the compute (torchft's async quorum, overlapping it), the all-reduce
  through the ``Manager`` after it, then ``should_commit`` (one round trip to the group's manager server);
- ``plain``: the same compute and a plain gloo all-reduce of the same bytes between the same two processes.

Prints each process's median step time of both, then as its last line one JSON object with the slower process's
medians and their ratio. Loopback only; no root needed.

    python benchmarks/torchft_step_cost.py
    python benchmarks/torchft_step_cost.py --compute-ms 0 --bytes 4194304
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support.harness

from tests.support.harness import free_port_span  # noqa: E402

WARMUP = 10  # steps left out of the medians


def one_process(rank: int, port: int, steps: int, compute_s: float, nbytes: int) -> dict[str, float]:
    """Rank ``rank``'s medians (seconds per step) of both protocols."""
    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    timeout = timedelta(seconds=60)
    lighthouse = LighthouseServer(bind=f"[::]:{port}", min_replicas=2, join_timeout_ms=30000) if rank == 0 else None
    store = dist.TCPStore("127.0.0.1", port + 1 + rank, 1, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None, min_replica_size=2,
        use_async_quorum=True, rank=0, world_size=1, store_addr="127.0.0.1", store_port=port + 1 + rank,
        lighthouse_addr=f"http://127.0.0.1:{port}", replica_id=f"node{rank}", init_sync=False, timeout=timeout,
    )  # fmt: skip
    gradient = torch.ones(nbytes // 4)
    torchft_steps = []
    for _ in range(steps):
        start = time.perf_counter()
        manager.start_quorum()
        time.sleep(compute_s)
        manager.allreduce(gradient).wait()
        manager.should_commit()
        torchft_steps.append(time.perf_counter() - start)
    manager.shutdown(wait=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port + 3}", rank=rank, world_size=2)
    plain_steps = []
    for _ in range(steps):
        start = time.perf_counter()
        time.sleep(compute_s)
        dist.all_reduce(gradient)
        plain_steps.append(time.perf_counter() - start)
    dist.destroy_process_group()
    del store
    if lighthouse is not None:
        lighthouse.shutdown()
    return {
        "torchft_s": statistics.median(torchft_steps[WARMUP:]),
        "plain_s": statistics.median(plain_steps[WARMUP:]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--compute-ms", type=float, default=50.0, help="forward and backward, as a sleep")
    parser.add_argument("--bytes", type=int, default=1 << 20, help="gradient bytes averaged per step")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # set for the two processes this starts
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        medians = one_process(args.rank, args.port, args.steps, args.compute_ms / 1000, args.bytes)
        print(f"RESULT {json.dumps(medians)}", flush=True)
        return 0
    port = free_port_span(4)
    options = ["--steps", str(args.steps), "--compute-ms", str(args.compute_ms), "--bytes", str(args.bytes)]
    command = [sys.executable, __file__, *options, "--port", str(port), "--rank"]
    processes = [
        subprocess.Popen([*command, str(rank)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for rank in range(2)
    ]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    if any(process.returncode for process in processes):
        raise SystemExit(f"a process failed: exit {[process.returncode for process in processes]}")
    results = [json.loads(line[7:]) for out in outputs for line in out.splitlines() if line.startswith("RESULT ")]
    for rank, result in enumerate(results):
        print(
            f"rank {rank}: torchft {result['torchft_s'] * 1000:.2f} ms/step, plain gloo {result['plain_s'] * 1000:.2f}"
        )
    torchft_s, plain_s = max(r["torchft_s"] for r in results), max(r["plain_s"] for r in results)
    summary = {"compute_ms": args.compute_ms, "bytes": args.bytes, "torchft_ms": round(torchft_s * 1000, 2)}
    summary |= {"plain_ms": round(plain_s * 1000, 2), "torchft_vs_plain": round(torchft_s / plain_s, 3)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
