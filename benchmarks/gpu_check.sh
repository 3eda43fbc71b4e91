#!/usr/bin/env bash
# Every GPU-only check of this package in one command, on a GPU machine with no network access needed:
# the machine's own python3 and torch, this working tree on PYTHONPATH, and the wheels of what the
# machine lacks (DeepSpeed and its pydantic, jsonargparse), prepared elsewhere by `make gpu-wheels`
# into .gpu-wheels/. Nothing is fetched: pip runs with --no-index only. From the repository root:
#
#   bash benchmarks/gpu_check.sh [--out DIR] [--only a,b] [--steps N] [--budget-s S]
#
# Writes DIR/gpu_check.json (default bench_results/gpu_check) and DIR/gpu_check.log, prints one
# PASS/FAIL/SKIP line per check; exit status 1 if a check failed. docs/gpu.md says more.
# Environment: PYTHON (default python3), GPU_WHEELS (default .gpu-wheels), GPU_SITE (where the
# wheels are unpacked; default a fresh private folder, removed at the end: benchmarks/offline_site.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/offline_site.sh "checks that need a missing package say so (make gpu-wheels prepares them)"
trap remove_offline_site EXIT

if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PYTHON" benchmarks/gpu_check.py "$@"
