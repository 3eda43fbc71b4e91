#!/usr/bin/env bash
# bench's single-GPU rows, a sweep of the levers of a fast step and a profile of the best, in one command on a GPU
# machine with no network access needed: the machine's own python3 and torch, this working tree on PYTHONPATH, and
# the wheels of what the machine lacks (jsonargparse for the CLI each run starts, torchao for fp8), prepared elsewhere
# by `make gpu-wheels` into .gpu-wheels/. Nothing is fetched: pip runs with --no-index only. From the repository root:
#
#   bash benchmarks/gpu_bench.sh [--out DIR] [--budget-s S] [--levers a,b] [--best JSON] [--no-rows]
#
# Writes DIR/gpu_bench.json, gpu_bench.png, gpu_bench.log, recipe_best.yaml, best.trace.json.gz and best.ops.txt
# (default DIR: bench_results/gpu_bench), rewritten as runs end; prints a line per run. docs/gpu.md says more.
# Environment: PYTHON (default python3), GPU_WHEELS (default .gpu-wheels), GPU_SITE (where the wheels are unpacked;
# default a fresh private folder, removed at the end: benchmarks/offline_site.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/offline_site.sh "the runs need jsonargparse (make gpu-wheels prepares it), fp8 needs torchao"
trap remove_offline_site EXIT

if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PYTHON" benchmarks/gpu_bench.py "$@"
